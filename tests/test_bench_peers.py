"""bench/peer_loaders.py and bench/peers/: the manifest every format is written from, the check of a
format's records against the tree, CPU accounting with worker processes, an unavailable peer, and
the peers' harness end to end with dimd's own peer (the other peers' venvs are not needed here)."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from conftest import PEERS, run_python



def test_the_peer_figure_is_opt_in(bench):
    reproduce = bench("reproduce")
    reproductions = reproduce.registry()
    assert not reproductions["peer_loaders"].default
    assert "peer_loaders" not in [name for name, r in reproductions.items() if r.default]


def _write_tsv(path: Path, rows: list[tuple[str, int, int, int]]) -> Path:
    path.write_text("name\tlabel\tcrc32\tlength\n" + "".join(f"{n}\t{label}\t{c}\t{size}\n"
                                                          for n, label, c, size in rows))
    return path


def test_the_manifest_holds_the_packed_bytes_and_the_check_finds_every_fault(bench, packed_sample, tmp_path):
    peers = bench("peer_loaders")
    peers.write_manifest(packed_sample, tmp_path / "manifest")
    expected = peers.read_manifest(tmp_path / "manifest")
    assert len(expected) == 48
    for r in expected:
        data = (tmp_path / "manifest" / "files" / r["name"]).read_bytes()
        assert zlib.crc32(data) == int(r["crc32"]) and len(data) == int(r["length"])
    good = [(r["name"], int(r["label"]), int(r["crc32"]), int(r["length"])) for r in expected]
    assert peers.check_records(_write_tsv(tmp_path / "good.tsv", good), expected)["ok"]
    # webdataset keeps keys without the extension, in its own order
    keys = [(n.rsplit(".", 1)[0], *rest) for n, *rest in reversed(good)]
    assert peers.check_records(_write_tsv(tmp_path / "keys.tsv", keys), expected)["ok"]

    faults = {
        "missing": good[1:],
        "duplicated": good + good[:1],
        "wrong_label": [(good[0][0], good[0][1] + 1, *good[0][2:])] + good[1:],
        "wrong_bytes": [(*good[0][:2], good[0][2] ^ 1, good[0][3])] + good[1:],
        "unknown": good + [("nobody/none.JPEG", 0, 0, 0)],
    }
    for fault, rows in faults.items():
        check = peers.check_records(_write_tsv(tmp_path / f"{fault}.tsv", rows), expected)
        assert not check["ok"] and check[fault] == 1, (fault, check)
    # without bytes to compare (the original files), only names and labels count
    assert peers.check_records(_write_tsv(tmp_path / "x.tsv", faults["wrong_bytes"]), expected,
                               bytes_known=False)["ok"]


def test_the_tree_listing_labels_sorted_class_folders(bench, sample_tree, packed_sample):
    from dimd.format import PackedDataset

    peers = bench("peer_loaders")
    packed = PackedDataset(packed_sample)
    assert peers.tree_listing(sample_tree) == [(n, int(label)) for n, label in zip(packed.names, packed.labels)]


def test_a_peer_not_installed_or_failed_is_unavailable_with_its_reason(bench, tmp_path, monkeypatch):
    peers = bench("peer_loaders")
    common = bench("_common")
    monkeypatch.setattr(peers, "PEERS_DIR", tmp_path)
    python, why = peers.peer_python("ffcv")
    assert python is None and "setup.sh ffcv" in why
    (tmp_path / "ffcv").mkdir()
    (tmp_path / "ffcv" / "FAILED").write_text("installing ffcv==1.0.2 failed:\nerror: no turbojpeg\n")
    python, why = peers.peer_python("ffcv")
    assert python is None and why.endswith("error: no turbojpeg")
    with pytest.raises(common.JobError, match="ffcv is unavailable: installing"):
        peers.peer_job("ffcv", "load", [], tmp_path / "load.json")
    assert peers.peer_python("dimd") == (Path(sys.executable).parent / "python", None)


BUSY = "import time\nstart = time.process_time()\nwhile time.process_time() - start < {s}: pass\n{after}"


def test_cpu_seconds_count_worker_processes_alive_or_ended(bench):
    _peer = bench("_peer")
    with _peer.Stopwatch() as ended:
        subprocess.run([sys.executable, "-c", BUSY.format(s=0.3, after="")], check=True)
    assert ended.cpu_seconds >= 0.3
    # a worker still alive at both readings: its CPU time is read from /proc
    worker = subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.3, after="print(1, flush=True)\n"
                                                                "time.sleep(60)")], stdout=subprocess.PIPE)
    try:
        with _peer.Stopwatch() as alive:
            assert worker.stdout.readline().strip() == b"1"
        assert worker.poll() is None and alive.cpu_seconds >= 0.3
    finally:
        worker.kill()
        worker.wait()


def test_the_pillow_augmentation_gives_uint8_chw(bench, packed_sample):
    import numpy as np

    _peer = bench("_peer")
    from dimd.format import PackedDataset

    sample = _peer.pil_train_sample(bytes(PackedDataset(packed_sample).record(0)), 32, np.random.default_rng(0))
    assert tuple(sample.shape) == (3, 32, 32) and str(sample.dtype) == "torch.uint8"


def test_dimd_as_a_peer_packs_verifies_and_counts_the_images_it_delivers(bench, packed_sample, tmp_path):
    peers = bench("peer_loaders")
    manifest = tmp_path / "manifest"
    peers.write_manifest(packed_sample, manifest)

    def peer(*args: object) -> dict:
        out = tmp_path / f"{args[0]}.json"
        run_python(PEERS / "dimd_peer.py", *args, "--manifest", manifest, "--json", out, check=True)
        return json.loads(out.read_text())

    packed = peer("pack", "--out", tmp_path / "format", "--workers", 2)
    assert packed["records"] == 48 and packed["seconds"] > 0 and packed["bytes"] > 0
    peer("verify", "--data", tmp_path / "format", "--records", tmp_path / "records.tsv")
    assert peers.check_records(tmp_path / "records.tsv", peers.read_manifest(manifest))["ok"]
    loaded = peer("load", "--data", tmp_path / "format", "--workers", 2, "--batch-size", 10, "--image-size", 32,
                  "--epochs", 2, "--warmup-epochs", 1)
    assert [e["warmup"] for e in loaded["epochs"]] == [True, False, False]
    # dimd drops the last short batch: 4 batches of 10 from 48 records, every epoch
    assert [(e["images"], e["batches"]) for e in loaded["epochs"]] == [(40, 4)] * 3
    assert all(e["seconds"] > 0 and e["cpu_seconds"] > 0 for e in loaded["epochs"])
    assert loaded["versions"]["dimd"] and "worker processes" in loaded["how"]["workers"]


def test_the_setup_script_refuses_an_unknown_peer_before_installing_anything(tmp_path):
    proc = subprocess.run(["bash", PEERS / "setup.sh", "ffcv", "nosuchloader"], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "PEERS_DIR": str(tmp_path / "peers")})
    assert proc.returncode == 2 and "unknown peer 'nosuchloader'" in proc.stderr
    assert not (tmp_path / "peers").exists()
