"""Checkpoint files: a failed write keeps the older ones; a foreign or malicious file is refused in one line."""

import errno
import os
from pathlib import Path

import pytest
import torch

from dimd.errors import DimdError
from dimd.train.checkpoint import VERSION, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


def state(epoch, step):
    return {"epoch": epoch, "step": step, "model": {"w": torch.ones(3) * step}}


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_older_ones_stay(tmp_path, monkeypatch):
    for step in (1, 2):
        save_checkpoint(tmp_path, state(0, step), keep=2)
    before = {p.name: p.read_bytes() for p in list_checkpoints(tmp_path)}

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(DimdError) as caught:
        save_checkpoint(tmp_path, state(0, 3), keep=2)
    message = str(caught.value)
    assert "checkpoint-e0000-s00000003.pt: no space left on device on the file system at " in message
    assert "nothing of this write was kept" in message
    assert "the 2 older checkpoint(s)" in message and "\n" not in message
    assert {p.name: p.read_bytes() for p in list_checkpoints(tmp_path)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)     # no temporary left behind


class RunsCode:
    def __reduce__(self):
        return (print, ("this ran while loading a checkpoint",))


def test_a_file_that_would_run_code_is_refused_without_inviting_unpickling(tmp_path, capsys):
    path = tmp_path / "checkpoint-e0001-s00000001.pt"
    torch.save({"format": "dimd-checkpoint", "version": VERSION, "model": RunsCode()}, path)
    with pytest.raises(DimdError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert "not a readable dimd checkpoint" in message and "will not load this file" in message
    assert "weights_only" not in message and "\n" not in message
    assert "this ran" not in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"", b"not a zip at all", b"PK\x03\x04truncated"])
def test_a_truncated_or_foreign_file_is_one_line(tmp_path, content):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(content)
    with pytest.raises(DimdError) as caught:
        load_checkpoint(path)
    assert str(caught.value).startswith(f"{path}: not a readable dimd checkpoint") and "\n" not in str(caught.value)


def test_another_programs_torch_file_is_not_a_dimd_checkpoint(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(DimdError, match="not a dimd checkpoint"):
        load_checkpoint(path)


@pytest.mark.parametrize("version", [None, 1, 3, VERSION - 2, VERSION + 1])
def test_a_checkpoint_of_another_version_is_refused_in_one_line_naming_it(tmp_path, version):
    """(VERSION - 1 is read through a mapping of its names: tests/test_trained_model.py.)"""
    path = tmp_path / "checkpoint-e0001-s00000010.pt"
    document = {"format": "dimd-checkpoint", "epoch": 1, "step": 10}   # version 1 wrote no number
    torch.save(document if version is None else {**document, "version": version}, path)
    with pytest.raises(DimdError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: checkpoint version {version or 1}; this dimd reads version {VERSION}")
    assert "\n" not in message


def test_random_bytes_are_refused_as_damaged_not_as_unsafe(tmp_path):
    path = tmp_path / "checkpoint-e0001-s00000010.pt"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(DimdError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert "not the zip archive torch.save writes" in message and "Python objects" not in message


def test_a_checkpoint_without_a_field_resume_reads_is_one_line(tmp_path):
    path = tmp_path / "checkpoint-e0001-s00000010.pt"
    torch.save({"format": "dimd-checkpoint", "version": VERSION, "epoch": 1, "step": 10, "model_name": "lenet"}, path)
    with pytest.raises(DimdError, match=r"a damaged checkpoint: it has no 'run_id', 'sync', 'classes' \.\.\."):
        load_checkpoint(path)


def test_checkpoints_are_listed_in_the_order_they_were_written(tmp_path):
    """A run resumed on another layout counts fewer steps: its new checkpoints are still the newest."""
    stale, new = tmp_path / "checkpoint-e0004-s00000050.pt", tmp_path / "checkpoint-e0005-s00000047.pt"
    stale.write_bytes(b"old layout, mid-epoch")
    new.write_bytes(b"after --resume-from the boundary")
    os.utime(stale, ns=(1_000_000_000, 1_000_000_000))
    assert list_checkpoints(tmp_path) == [stale, new] and latest_checkpoint(tmp_path) == new


def test_a_requeued_job_that_always_passes_resume_is_not_stuck_after_a_layout_change(packed_sample, world,
                                                                                     tmp_path):
    """The whole story: a job stops mid-epoch on one layout, is requeued on another (refused, with advice),
    resumed from the boundary the advice names, then requeued again with plain ``resume``: it continues
    from its newest checkpoint, not from the old layout's stale mid-epoch one (which has the higher step)."""
    from dimd.train.config import TrainConfig
    from dimd.train.engine import Hooks, Trainer
    from dimd.train.signals import StopRequest

    def run(batch_size, epochs, stop_after=None, **options):
        config = TrainConfig(train=str(packed_sample), val=str(packed_sample), model="lenet", image_size=32,
                             batch_size=batch_size, epochs=epochs, lr=0.01, lr_scaling=False, schedule="constant",
                             decode_workers=1, threads=1, checkpoint_dir=str(tmp_path), **options)
        stop, taken = StopRequest(), []

        def on_step(n):   # the scheduler's time-limit warning, after `stop_after` steps of this run
            taken.append(n)
            if len(taken) == stop_after:
                stop.received = "SIGUSR1"

        return Trainer(config, world, stop=stop, hooks=Hooks(on_step=on_step)).run()

    # 48 records: 12 steps per epoch at batch 4, 3 at batch 16
    boundary = run(4, 1).checkpoint                                   # step 12, an epoch's end
    stale = run(4, 2, stop_after=7, resume=True)                      # warned mid-epoch 2: stops after step 20
    assert stale.stopped_by == "SIGUSR1" and stale.checkpoint.endswith("-s00000020.pt")
    with pytest.raises(DimdError, match=f"written mid-epoch .* resume from {boundary} \\(an epoch boundary\\)"):
        run(16, 3, resume=True)                                       # requeued on another layout
    advised = run(16, 3, resume_from=boundary)                        # the advice: steps 13-18, epochs 2 and 3
    assert advised.resumed_from == boundary and advised.checkpoint.endswith("e0003-s00000018.pt")
    requeued = run(16, 4, resume=True)                                # the job's own line again: plain resume
    assert requeued.resumed_from == advised.checkpoint
    assert requeued.epochs[-1].epoch == 4 and requeued.checkpoint.endswith("e0004-s00000021.pt")
    assert latest_checkpoint(tmp_path) == Path(requeued.checkpoint)
