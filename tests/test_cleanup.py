"""Every way out cleans up: Ctrl-C, SIGTERM, a full disk, a file-size limit, a killed run.

Mechanisms: SIGTERM raises a ``KeyboardInterrupt`` (:mod:`dimd.signals`), so
the one cleanup path handles both; :class:`dimd.format.PackWriter` removes its
temporaries whatever the failure, and :func:`dimd.fsutil.disk_errors` turns a
full disk into one line; the next writer of an output removes temporaries
whose process is gone (:func:`dimd.fsutil.remove_stale_temporaries`).
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import DIMD, run_dimd
from hostile import can_mount_tmpfs, in_tmpfs, one_error_line, small_tree, temporaries
from PIL import Image

from dimd.format import PackedDataset
from dimd.fsutil import HOST_TAG

needs_tmpfs = pytest.mark.skipif(not can_mount_tmpfs(), reason="cannot mount a private tmpfs here")


@pytest.fixture(scope="module")
def slow_list(tmp_path_factory) -> tuple[Path, Path]:
    """One large PNG listed 400 times (allowed: same path, same label): many seconds of work."""
    root = tmp_path_factory.mktemp("slow")
    y, x = np.mgrid[0:2000, 0:3000]
    pixels = np.stack([(x // 7) % 256, (y // 5) % 256, ((x + y) // 11) % 256], -1).astype(np.uint8)
    Image.fromarray(pixels).save(root / "big.png", compress_level=1)
    (root / "list.txt").write_text("big.png 0\n" * 400)
    return root, root / "list.txt"


def children_of(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_pack(slow_list, out: Path, *extra: str) -> subprocess.Popen:
    """The pack as from a terminal: SIGINT at its default, which Python turns into KeyboardInterrupt.

    A suite started in the background of a script inherits SIGINT ignored, and Python keeps an
    ignored SIGINT ignored: the pack would finish as if no Ctrl-C had come.
    """
    root, listing = slow_list
    return subprocess.Popen([*DIMD, "pack", root, "--list", listing, "-o", out, "-q", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_records(out: Path, proc: subprocess.Popen, timeout: float = 120) -> set[int]:
    """Wait until the pack has written records to its temporary; return its worker PIDs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tmp = [p for p in out.parent.glob(f".{out.name}.dimd.tmp-*") if p.stat().st_size > 0]
        if tmp:
            return children_of(proc.pid)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the pack wrote nothing in time")


@pytest.mark.parametrize("signum, line, code", [
    (signal.SIGTERM, "dimd: terminated (SIGTERM)", 143),
    (signal.SIGINT, "dimd: interrupted", 130),
])
def test_a_signal_mid_pack_leaves_nothing_and_no_workers(slow_list, tmp_path, signum, line, code):
    out = tmp_path / "out" / "x"
    proc = start_pack(slow_list, out, "--workers", "2")
    workers = wait_for_records(out, proc)
    assert len(workers) >= 2
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code and stderr.strip() == line, stderr
    assert list((tmp_path / "out").iterdir()) == []
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if alive(pid)]


def test_a_worker_killed_mid_pack_ends_the_pack_in_one_line_and_leaves_nothing(slow_list, tmp_path):
    """The out-of-memory killer takes one worker: the pool replaces it, but its tasks are lost."""
    out = tmp_path / "out" / "x"
    proc = start_pack(slow_list, out, "--workers", "2")
    victim = min(wait_for_records(out, proc))
    os.kill(victim, signal.SIGKILL)
    try:
        _, stderr = proc.communicate(timeout=60)    # not a wait, forever, for the lost tasks' results
    finally:
        proc.terminate()
    assert proc.returncode == 1, stderr
    assert stderr.strip() == (f"dimd: error: worker process {victim} was killed by SIGKILL while packing "
                              f"{slow_list[0]} (out of memory?); its work is lost, so the run stops")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_pool_teardown_that_hangs_is_cut_off_and_its_workers_killed():
    """Pool.terminate() waits forever on a result-queue lock that a killed worker held (cpython#96995).

    Holding that lock here does to the teardown what such a worker does.
    """
    import multiprocessing

    from dimd.pack.process_pool import terminate_within_deadline

    pool = multiprocessing.get_context("fork").Pool(2)
    workers = [worker.pid for worker in pool._pool]
    assert pool._outqueue._wlock.acquire(timeout=5)    # what a worker killed mid-put leaves taken
    began = time.monotonic()
    terminate_within_deadline(pool, deadline_s=0.5)
    assert time.monotonic() - began < 5
    assert not [pid for pid in workers if alive(pid)]


def test_a_killed_packs_temporaries_are_removed_by_the_next_pack(slow_list, tmp_path):
    out = tmp_path / "x"
    proc = start_pack(slow_list, out, "--workers", "1")
    wait_for_records(out, proc)
    proc.kill()  # SIGKILL: no cleanup can run
    proc.wait()
    left = temporaries(tmp_path)
    assert left == [f".x.dimd.tmp-{HOST_TAG}-{proc.pid}"]
    root = small_tree(tmp_path / "tree", {"a": 2})
    again = run_dimd("pack", root, "-o", out, "-q")
    assert again.returncode == 0, again.stderr
    assert again.stderr.strip() == f"dimd: removed {tmp_path / left[0]}, left by a pack that no longer runs"
    assert temporaries(tmp_path) == [] and len(PackedDataset(out)) == 2


def test_temporaries_of_live_or_foreign_packs_are_left_alone(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 1})
    out = tmp_path / "out"
    out.mkdir()
    host = HOST_TAG
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    dead = out / f".x.idx.h5.tmp-{host}-{int(finished.stdout)}"
    live = out / f".x.dimd.tmp-{host}-{os.getpid()}"
    foreign = out / ".x.dimd.tmp-some-other-node-17"
    other_output = out / f".y.dimd.tmp-{host}-{int(finished.stdout)}"
    for path in (dead, live, foreign, other_output):
        path.write_bytes(b"partial")
    proc = run_dimd("pack", root, "-o", out / "x", "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"dimd: removed {dead}, left by a pack that no longer runs",
        f"dimd: note: {foreign} was left by a pack on another host; remove it if that pack no longer runs",
    ]
    assert not dead.exists() and live.exists() and foreign.exists() and other_output.exists()


@needs_tmpfs
def test_a_full_disk_is_one_line_and_frees_what_it_used(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 40, "b": 40}, size=(400, 300))
    mount = tmp_path / "mnt"
    proc = in_tmpfs(mount, "64k", f"{' '.join(DIMD)} pack {root} -o {mount}/sub/x -q; "
                                   f"echo rc=$?; ls -A {mount}/sub; df -k {mount} | tail -1")
    lines = proc.stdout.splitlines()
    assert lines[0] == "rc=1" and lines[1].split()[2] == "0", proc.stdout  # nothing left, 0 KiB used
    stderr = proc.stderr.strip().splitlines()
    assert len(stderr) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.fullmatch(rf"dimd: error: {mount}/sub/x\.dimd: no space left on device on the file system "
                        rf"at {mount} \(\d+\.\d KiB free of 64\.0 KiB, the output needs about "
                        rf"\d+\.\d [KM]iB\); nothing of this write was kept", stderr[0]), stderr[0]


@needs_tmpfs
def test_an_index_that_does_not_fit_is_one_line_too(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 2}, size=(32, 32))
    mount = tmp_path / "mnt"
    proc = in_tmpfs(mount, "8k", f"{' '.join(DIMD)} pack {root} -o {mount}/x -q --short-side 32; "
                                 f"echo rc=$?; ls -A {mount}")
    assert proc.stdout.splitlines() == ["rc=1"], proc.stdout  # and the folder is empty
    stderr = proc.stderr.strip().splitlines()
    assert len(stderr) == 1 and stderr[0].startswith(
        f"dimd: error: {mount}/x.idx.h5: no space left on device on the file system at {mount}"), proc.stderr


@needs_tmpfs
def test_a_json_that_does_not_fit_is_one_line(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 2})
    mount = tmp_path / "mnt"
    proc = in_tmpfs(mount, "64k", f"head -c 65536 /dev/zero > {mount}/filler; "
                                  f"{' '.join(DIMD)} pack {root} -o {tmp_path}/x -q --json {mount}/x.json; "
                                  f"echo rc=$?; ls -A {mount}")
    assert proc.stdout.splitlines()[-2:] == ["rc=1", "filler"], proc.stdout  # no temporary left
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"dimd: error: {mount}/x.json: no space left on device on the file system at {mount}"), proc.stderr


def test_a_file_size_limit_is_one_line_and_nothing_is_left(tmp_path):
    """``ulimit -f``: the same path as a full disk, and needs no root."""
    root = small_tree(tmp_path / "tree", {"a": 30}, size=(400, 300))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10))

    proc = run_dimd("pack", root, "-o", tmp_path / "out" / "x", "-q", timeout=120, preexec_fn=limit)
    line = one_error_line(proc)
    assert line.startswith(f"{tmp_path / 'out' / 'x.dimd'}: file too large (a limit of the file system, "
                           "or of `ulimit -f`) on the file system at ")
    assert list((tmp_path / "out").iterdir()) == []
