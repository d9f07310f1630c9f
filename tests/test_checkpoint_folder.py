"""One run per checkpoint folder: the lock, its stale-lock recovery, and no fresh start over an earlier run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import run_dimd

from dimd.errors import DimdError
from dimd.train.folderlock import LOCK_NAME, FolderLock, claim_checkpoint_folder


def test_a_second_run_stops_with_a_line_naming_the_first(tmp_path):
    with FolderLock(tmp_path / "ckpt"):
        with pytest.raises(DimdError, match=rf"in use by another run \(pid {os.getpid()} on this host"):
            FolderLock(tmp_path / "ckpt").acquire()
    FolderLock(tmp_path / "ckpt").acquire()   # released: free again


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": os.uname().nodename, "pid": int(gone.stdout),
                                                  "started": "1", "since": "earlier"}))
    lock = FolderLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_held_on_another_host_says_which_and_how_to_clear_it(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node17", "pid": 4242, "since": "09:00"}))
    with pytest.raises(DimdError, match=rf"pid 4242 on host node17.*remove {tmp_path / LOCK_NAME}"):
        FolderLock(tmp_path).acquire()


def test_a_fresh_run_over_an_earlier_runs_checkpoints_is_refused_unless_forced(world, tmp_path):
    old = tmp_path / "checkpoint-e0001-s00000012.pt"
    old.write_bytes(b"an earlier run's")
    with pytest.raises(DimdError, match="holds 1 checkpoint.*continue that run with `resume`.*`force`"):
        claim_checkpoint_folder(world, str(tmp_path), resume=False, force=False)
    assert old.exists() and not (tmp_path / LOCK_NAME).exists()   # nothing changed, no lock left
    claim_checkpoint_folder(world, str(tmp_path), resume=True, force=False).release()   # resuming it: fine
    lock = claim_checkpoint_folder(world, str(tmp_path), resume=False, force=True)
    assert not old.exists()
    lock.release()


def test_train_refuses_a_fresh_start_over_a_checkpoint_with_one_line(packed_sample, tmp_path):
    (tmp_path / "checkpoint-e0001-s00000012.pt").write_bytes(b"an earlier run's")
    proc = run_dimd("train", packed_sample, "--val", packed_sample, "--model", "lenet", "--image-size", "32",
                    "--checkpoint-dir", tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "--resume" in proc.stderr and "--force" in proc.stderr


def test_a_run_refused_at_start_up_leaves_no_folder_behind(tmp_path):
    lock = FolderLock(tmp_path / "runs" / "ckpt")
    lock.acquire()
    lock.release()
    assert not (tmp_path / "runs").exists()
