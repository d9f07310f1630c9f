"""Every output location is checked before the work, in one line, in every command.

Mechanism: options of type :data:`dimd.options.OUTPUT_FILE` / ``OUTPUT_DIR``
are checked by :func:`dimd.fsutil.output_problem` as they are parsed, or,
under MPI, on rank 0 once MPI is up, agreed by every rank
(:func:`dimd.commands.mpi_job.mpi_command`); ``pack -o`` is checked (and its
folders created) by :class:`dimd.format.PackWriter` before the scan; ``train``
checks its three locations at start-up (:func:`dimd.commands.mpi_job.check_outputs`).
"""

from __future__ import annotations

import pytest
from conftest import DIMD, run_dimd, run_mpi_dimd
from hostile import can_mount_tmpfs, in_tmpfs, mpi_error, one_error_line, small_tree, temporaries

from dimd.format import PackedDataset
from dimd.pack.packer import PackConfig, pack


@pytest.fixture
def tree(tmp_path):
    """A tree with a bad image: a pack that got to work would print 'dimd: skipped ...'."""
    root = small_tree(tmp_path / "tree", {"a": 2, "b": 1})
    (root / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff not really")
    (tmp_path / "afile").write_text("a regular file")
    return root


def pack_cases(tmp_path):
    afile = tmp_path / "afile"
    (tmp_path / "stem.dimd").mkdir()
    (tmp_path / "index.idx.h5").mkdir()
    return [
        (["--json", tmp_path / "nodir" / "x.json"], f"--json {tmp_path / 'nodir' / 'x.json'}: folder "
                                                     f"{tmp_path / 'nodir'} does not exist"),
        (["--skipped", tmp_path / "nodir" / "x.txt"], f"--skipped {tmp_path / 'nodir' / 'x.txt'}: folder "
                                                       f"{tmp_path / 'nodir'} does not exist"),
        (["--json", tmp_path], f"--json {tmp_path}: is a folder, expected a file name"),
        (["--json", afile / "x.json"], f"--json {afile / 'x.json'}: {afile} is not a folder"),
        (["-o", tmp_path / "stem", "--force"], f"output {tmp_path / 'stem.dimd'}: is a folder, expected a "
                                               "file name"),
        (["-o", tmp_path / "index", "--force"], f"output {tmp_path / 'index.idx.h5'}: is a folder, expected "
                                                "a file name"),
        (["-o", afile / "sub" / "x"], f"output {afile / 'sub' / 'x.dimd'}: cannot create folders under "
                                      f"{afile}, which is not a folder"),
        # A folder is no stem: it would write the hidden pair ...dimd and ...idx.h5 in tmp_path.
        (["-o", tmp_path / ".."], f"output {tmp_path / '..'}: names a folder, not the stem of OUT.dimd and "
                                  f"OUT.idx.h5; give one such as {tmp_path / '..' / 'train'}"),
        (["-o", f"{tmp_path}/"], f"output {tmp_path}/: names a folder, not the stem of OUT.dimd and "
                                 f"OUT.idx.h5; give one such as {tmp_path / 'train'}"),
    ]


def test_pack_refuses_each_bad_output_before_any_work(tree, tmp_path):
    for extra, message in pack_cases(tmp_path):
        args = ["pack", tree, *extra] + ([] if "-o" in extra else ["-o", tmp_path / "out" / "x"])
        proc = run_dimd(*args)
        assert one_error_line(proc) == message, extra  # and no 'skipped' line: the work never began
        assert not (tmp_path / "out").exists() and temporaries(tmp_path) == []


def test_pack_creates_missing_output_folders(tree, tmp_path):
    proc = run_dimd("pack", tree, "-o", tmp_path / "new" / "sub" / "x", "-q",
                    "--json", tmp_path / "x.json")
    assert proc.returncode == 0, proc.stderr
    assert len(PackedDataset(tmp_path / "new" / "sub" / "x")) == 3


@pytest.mark.skipif(not can_mount_tmpfs(), reason="cannot mount a private tmpfs here")
@pytest.mark.parametrize("command", ["pack", "json", "train"])
def test_a_read_only_output_folder_is_refused_at_start_up(tree, packed_sample, tmp_path, command):
    mount = tmp_path / "mnt"
    dimd = " ".join(DIMD)
    script = {
        "pack": f"{dimd} pack {tree} -o {mount}/out/x",
        "json": f"{dimd} pack {tree} -o {tmp_path}/x --json {mount}/out/x.json",
        "train": f"{dimd} train {packed_sample} --val {packed_sample} --model resnet20 --epochs 1 "
                 f"--checkpoint-dir {mount}/out/ckpt",
    }[command]
    proc = in_tmpfs(mount, "1m", script, read_only=True)
    what = {"pack": f"output {mount}/out/x.dimd", "json": f"--json {mount}/out/x.json",
            "train": f"--checkpoint-dir {mount}/out/ckpt"}[command]
    assert one_error_line(proc) == f"{what}: cannot write in folder {mount}/out (Read-only file system)"
    assert not (tmp_path / "x.dimd").exists()


@pytest.mark.parametrize("args, message", [
    (["inspect", "{data}", "--json", "{tmp}/nodir/i.json"],
     "--json {tmp}/nodir/i.json: folder {tmp}/nodir does not exist"),
    (["verify", "{data}", "--json", "{tmp}"], "--json {tmp}: is a folder, expected a file name"),
    (["sample-data", "{tmp}/afile/sub"], "DIRECTORY {tmp}/afile/sub: cannot create folders under {tmp}/afile, "
                                         "which is not a folder"),
    (["sample-data", "{tmp}/afile"], "DIRECTORY {tmp}/afile: exists and is not a folder"),
    (["bench-io", "{data}", "--tree", "{tmp}", "--json", "{tmp}/nodir/b.json"],
     "--json {tmp}/nodir/b.json: folder {tmp}/nodir does not exist"),
])
def test_other_commands_refuse_bad_outputs_in_one_line(packed_sample, tmp_path, args, message):
    (tmp_path / "afile").write_text("x")
    fill = {"data": packed_sample, "tmp": tmp_path}
    proc = run_dimd(*[a.format(**fill) for a in args], timeout=120)
    assert one_error_line(proc) == message.format(**fill)


@pytest.mark.mpi
@pytest.mark.parametrize("args, message", [
    (["shuffle", "{data}", "--json", "{tmp}/nodir/s.json"],
     "--json {tmp}/nodir/s.json: folder {tmp}/nodir does not exist"),
    (["shuffle", "{data}", "--save-order", "{tmp}/afile"], "--save-order {tmp}/afile: exists and is not a folder"),
    (["bench-allreduce", "-e", "64", "--json", "{tmp}"], "--json {tmp}: is a folder, expected a file name"),
])
def test_mpi_commands_check_outputs_on_rank_0_for_all(packed_sample, tmp_path, args, message):
    (tmp_path / "afile").write_text("x")
    fill = {"data": packed_sample, "tmp": tmp_path}
    proc = run_mpi_dimd(2, *[a.format(**fill) for a in args], timeout=120)
    assert mpi_error(proc) == message.format(**fill)
    assert "round" not in proc.stdout and "busbw" not in proc.stdout  # before the work
    assert "MPI_Abort" not in proc.stderr   # every rank knew the problem: the job ends in order


@pytest.mark.mpi
@pytest.mark.parametrize("extra, message", [
    (["--checkpoint-dir", "{tmp}/afile/ckpt"], "--checkpoint-dir {tmp}/afile/ckpt: cannot create folders under "
                                                "{tmp}/afile, which is not a folder"),
    (["--metrics", "{tmp}/nodir/m.jsonl"], "--metrics {tmp}/nodir/m.jsonl: folder {tmp}/nodir does not exist"),
    (["--json", "{tmp}/nodir/t.json"], "--json {tmp}/nodir/t.json: folder {tmp}/nodir does not exist"),
])
def test_train_checks_its_outputs_before_the_first_epoch(packed_sample, tmp_path, extra, message):
    (tmp_path / "afile").write_text("x")
    fill = {"tmp": tmp_path}
    proc = run_mpi_dimd(2, "train", packed_sample, "--val", packed_sample, "--model", "resnet20",
                        "--image-size", "32", "--epochs", "1", "--batch-size", "8", "--decode-workers", "1",
                        "--threads", "1", *[a.format(**fill) for a in extra], timeout=180)
    assert mpi_error(proc) == message.format(**fill)
    assert "epoch 1/" not in proc.stdout


def test_missing_output_folders_are_created(sample_tree, tmp_path):
    result = pack(PackConfig(sample_tree, tmp_path / "no" / "such" / "out", workers=1))
    assert result.images == 48 and len(PackedDataset(tmp_path / "no" / "such" / "out")) == 48
