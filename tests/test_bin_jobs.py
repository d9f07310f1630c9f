"""The SLURM train job under stand-in `srun`/`scancel`/`scontrol`: warn -> checkpoint -> requeue -> resume.

For machines without SLURM; tests/slurm/run.sh runs the same jobs on a real one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import dimd_on_path

BIN = Path(__file__).resolve().parents[1] / "bin"
SCRIPT = BIN / "slurm" / "train.sbatch"

FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$SCONTROL_LOG"
while [[ $1 == --* ]]; do shift; done   # srun's own options
echo $$ > "$SRUN_PID"                   # the one task, for the stand-in scancel
exec "$@"
"""
FAKE_SCANCEL = """#!/usr/bin/env bash
echo "scancel $*" >> "$SCONTROL_LOG"
kill -s "${1#--signal=}" "$(cat "$SRUN_PID")"   # what `scancel --signal=SIG JOB` does to the ranks
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$SCONTROL_LOG"
"""


def start_job(tmp: Path, data: Path) -> subprocess.Popen:
    fake = tmp / "fakebin"
    fake.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = {**os.environ, **dimd_on_path(fake),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "test", "SLURM_CPUS_PER_TASK": "1",
           "SLURM_NTASKS": "1", "RUN_DIR": str(tmp / "run"), "SCONTROL_LOG": str(tmp / "scontrol.log"),
           "SRUN_PID": str(tmp / "srun.pid"), "DEVICE": "cpu", "MODEL": "lenet", "EPOCHS": "500",
           "BATCH_SIZE": "8"}
    return subprocess.Popen(["bash", str(SCRIPT), str(data), "--image-size", "32", "--lr", "0.05",
                             "--keep-checkpoints", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.fixture
def data(packed_sample, tmp_path) -> Path:
    """A job's data folder: DATA/train and DATA/val, the packed sample under both names."""
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "val"):
        for suffix in (".dimd", ".idx.h5"):
            (folder / f"{split}{suffix}").symlink_to(packed_sample.with_name(packed_sample.name + suffix))
    return folder


def calls(tmp: Path) -> list[str]:
    return (tmp / "scontrol.log").read_text().splitlines()


def test_time_limit_warning_checkpoints_requeues_and_the_next_run_resumes(data, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"

    job = start_job(tmp_path, data)
    wait_for(lambda: checkpoints.is_dir() and any(checkpoints.glob("*.pt")))
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@120` sends
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert "stopped by SIGUSR1" in out and "requeueing job 42" in out
    assert calls(tmp_path)[0].startswith("srun --mpi=pmi2 ")   # the PMI the mpich wheel needs
    assert calls(tmp_path)[1:] == ["scancel --signal=USR1 42", "scontrol requeue 42"]
    saved = sorted(checkpoints.glob("*.pt"))

    (tmp_path / "scontrol.log").unlink()
    job = start_job(tmp_path, data)  # the requeued job
    wait_for(lambda: len(list(checkpoints.glob("*.pt"))) > len(saved))
    job.send_signal(signal.SIGTERM)  # scancel: checkpoint and stop, no requeue
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert f"resumed from {saved[-1]}" in out
    assert "stopped by SIGTERM" in out and "not requeued" in out
    assert calls(tmp_path)[1:] == ["scancel --signal=TERM 42"]   # to the ranks, never to srun


def sbatch_options(script: str) -> list[str]:
    """The options sbatch reads from a script: its '#SBATCH' lines up to the first command, where sbatch stops."""
    options = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            options += shlex.split(line.removeprefix("#SBATCH"), comments=True)
        elif line.strip() and not line.startswith("#"):
            break
    return options


def test_the_train_job_asks_for_no_gpu_as_shipped_and_one_per_rank_with_its_gpu_lines_on():
    """A CPU site runs train.sbatch unchanged; a GPU site removes one '#' from two lines, which sbatch then
    reads (they stand before the first command)."""
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)   # the script parses
    shipped = SCRIPT.read_text()
    assert not [option for option in sbatch_options(shipped) if "gpu" in option]
    turned_on = re.sub(r"^##SBATCH( --gpu)", r"#SBATCH\1", shipped, flags=re.MULTILINE)
    gpu_options = [option for option in sbatch_options(turned_on) if "gpu" in option]
    assert gpu_options == ["--gpus-per-task=1", "--gpu-bind=single:1"]
    assert "sbatch --gpus-per-task=1 --gpu-bind=single:1 bin/slurm/train.sbatch OUT" in shipped   # the other way


FAKE_MPIRUN = """#!/usr/bin/env bash
while [[ $1 == -* ]]; do shift; done   # the launcher's own options
exec "$@"                              # one rank; the script's kill -s reaches it
"""


def start_lsf_job(tmp: Path, data: Path, mpirun: str = FAKE_MPIRUN, own_session: bool = False) -> subprocess.Popen:
    """The LSF train job on ``data``, its ``mpirun`` a stand-in with ``mpirun``'s text."""
    fake = tmp / "fakebin"
    fake.mkdir(exist_ok=True)
    (fake / "mpirun").write_text(mpirun)
    (fake / "mpirun").chmod(0o755)
    env = {**os.environ, **dimd_on_path(fake),
           "LSB_JOBID": "42", "LSB_DJOB_NUMPROC": "1", "OUT": str(data), "RUN_DIR": str(tmp / "run"),
           "DEVICE": "cpu", "MODEL": "lenet", "EPOCHS": "500", "BATCH_SIZE": "8",
           "TRAIN_ARGS": "--image-size 32 --lr 0.05 --keep-checkpoints 0 --decode-workers 1"}
    return subprocess.Popen(["bash", str(BIN / "lsf" / "train.lsf")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=own_session)


def test_lsf_job_exits_99_for_a_requeue_only_after_the_warning(data, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"

    job = start_lsf_job(tmp_path, data)
    wait_for(lambda: checkpoints.is_dir() and any(checkpoints.glob("*.pt")))
    job.send_signal(signal.SIGUSR1)  # what `#BSUB -wa USR1` sends
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 99, out   # -Q "99" requeues
    assert "stopped by SIGUSR1" in out and "asking LSF to requeue" in out
    parameters = json.loads((tmp_path / "run" / "train.json").read_text())["parameters"]
    assert parameters["image_size"] == 32 and parameters["decode_workers"] == 1   # from TRAIN_ARGS
    saved = sorted(checkpoints.glob("*.pt"))

    job = start_lsf_job(tmp_path, data)  # the requeued job
    wait_for(lambda: len(list(checkpoints.glob("*.pt"))) > len(saved))
    job.send_signal(signal.SIGTERM)  # bkill -s TERM: checkpoint and stop, no requeue
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert f"resumed from {saved[-1]}" in out and "not requeued" in out


#: Open MPI's mpirun as PRRTE behaves: USR1 and USR2 reach the rank as they are, a TERM (or INT,
#: HUP) kills it (PRRTE sends SIGKILL 250 ms after its SIGTERM, too soon for a checkpoint).
FAKE_OPENMPI_MPIRUN = """#!/usr/bin/env bash
[[ ${1:-} == --version ]] && { echo "mpirun (Open MPI) 5.0.11"; exit 0; }
while [[ $1 == -* ]]; do shift; done
"$@" &
rank=$!
trap 'echo "mpirun: SIGTERM: killing the ranks" >&2; kill -KILL $rank' TERM INT HUP
trap 'kill -USR1 $rank' USR1
trap 'kill -USR2 $rank' USR2
while :; do status=0; wait $rank || status=$?; kill -0 $rank 2>/dev/null || break; done
exit $status
"""


def test_lsf_job_under_open_mpi_turns_a_term_into_usr2_for_mpirun(data, tmp_path):
    """A TERM to the job's process group (what bkill -s TERM may send) reaches the script, not mpirun."""
    checkpoints = tmp_path / "run" / "checkpoints"
    job = start_lsf_job(tmp_path, data, FAKE_OPENMPI_MPIRUN, own_session=True)
    wait_for(lambda: checkpoints.is_dir() and any(checkpoints.glob("*.pt")))
    os.killpg(job.pid, signal.SIGTERM)   # the job's process group: the script and what stayed in it
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert "is Open MPI's: a TERM is passed on as USR2" in out
    assert "SIGTERM -> the ranks, through mpirun (as SIGUSR2)" in out
    assert "stopped by SIGUSR2" in out and "not requeued" in out and "killing the ranks" not in out


#: Open MPI 5.0.11's mpirun after it ended a job that lost a node (docs/mpi.md): the ranks are gone,
#: dimd wrote nothing, and the launcher's exit status is 0.
LAUNCHER_LOST_A_NODE = """#!/usr/bin/env bash
[[ ${1:-} == --version ]] && { echo "mpirun (Open MPI) 5.0.11"; exit 0; }
echo "PRTE has lost communication with a remote daemon." >&2
exit 0
"""
TRAIN_JOBS = {"slurm/train.sbatch": ("srun", {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "test", "SLURM_NTASKS": "2"}),
              "lsf/train.lsf": ("mpirun", {"LSB_JOBID": "42", "LSB_DJOB_NUMPROC": "2"})}


def run_train_job(script: str, tmp: Path, launcher_text: str, *args: str) -> subprocess.CompletedProcess:
    launcher, scheduler_env = TRAIN_JOBS[script]
    fake = tmp / "fakebin"
    fake.mkdir(exist_ok=True)
    (fake / launcher).write_text(launcher_text)
    (fake / launcher).chmod(0o755)
    env = {**os.environ, **dimd_on_path(fake), **scheduler_env, "OUT": str(tmp), "RUN_DIR": str(tmp / "run")}
    data = [str(tmp)] if script.startswith("slurm/") else []   # the LSF job reads OUT
    return subprocess.run(["bash", str(BIN / script), *data, *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("script", TRAIN_JOBS)
def test_a_train_job_fails_when_its_launcher_exits_0_but_dimd_did_not_finish(script, tmp_path):
    proc = run_train_job(script, tmp_path, LAUNCHER_LOST_A_NODE)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"the launcher exited 0 but {tmp_path / 'run' / 'train.json'} is missing" in proc.stderr


def test_the_pipeline_stops_when_a_launcher_exits_0_but_dimd_did_not_finish(tmp_path):
    launcher = tmp_path / "fakebin" / "mpirun"
    launcher.parent.mkdir()
    launcher.write_text(LAUNCHER_LOST_A_NODE)
    launcher.chmod(0o755)
    env = {**os.environ, **dimd_on_path(launcher.parent), "LAUNCH": f"{launcher} -n 2", "STEPS": "bench train"}
    proc = subprocess.run(["bash", str(BIN / "pipeline.sh"), str(tmp_path), str(tmp_path), str(tmp_path / "work")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"the launcher exited 0 but {tmp_path / 'work' / 'allreduce.json'} is missing" in proc.stderr
    assert "== train" not in proc.stdout       # the next step never starts


@pytest.mark.parametrize("script", TRAIN_JOBS)
def test_a_train_job_keeps_its_own_json(script, tmp_path):
    proc = run_train_job(script, tmp_path, "#!/bin/sh\nexit 0\n", "--json=mine.json")
    assert proc.returncode == 2 and "--json is this script's own" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_pipeline_keeps_its_own_json(tmp_path):
    proc = subprocess.run(["bash", str(BIN / "pipeline.sh"), str(tmp_path), str(tmp_path), str(tmp_path / "work"),
                           "--json", "mine.json"], env={**os.environ, **dimd_on_path(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--json is this script's own" in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("script", ["slurm/train.sbatch", "slurm/pack.sbatch", "lsf/train.lsf",
                                    "lsf/pack.lsf", "pipeline.sh"])
def test_jobs_say_when_dimd_is_not_on_path(script, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "SRC": str(tmp_path), "HOME": str(tmp_path),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "test"}
    proc = subprocess.run(["bash", str(BIN / script), str(tmp_path), str(tmp_path), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 127
    assert "'dimd' is not on PATH" in proc.stderr


def run_pack_job(src: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **dimd_on_path(out.parent / "fakebin"), "SLURM_CPUS_PER_TASK": "1", **env}
    return subprocess.run(["bash", str(BIN / "slurm" / "pack.sbatch"), str(src), str(out), "--short-side", "32"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_pack_job_names_the_val_classes_and_keeps_finished_output(sample_tree, tmp_path):
    from dimd.format import PackedDataset
    from dimd.sample_data import SampleSpec, generate

    src = tmp_path / "src"
    src.mkdir()
    (src / "train").symlink_to(sample_tree)
    generate(SampleSpec(root=src / "val", classes=4, per_class=2, seed=3, layout="flat"), workers=1)
    (src / "val" / "labels.txt").rename(src / "val_labels.txt")   # ImageNet's layout: a flat val folder
    proc = run_pack_job(src, tmp_path / "out")
    assert proc.returncode == 2 and "val_classes.txt (their class names" in proc.stderr
    assert not (tmp_path / "out" / "train.dimd").exists()        # refused before packing anything

    (src / "val" / "classes.txt").rename(src / "val_classes.txt")
    proc = run_pack_job(src, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    train_classes = PackedDataset(tmp_path / "out" / "train").classes
    val_classes = set(PackedDataset(tmp_path / "out" / "val").classes)
    assert val_classes == set(train_classes)                     # names, not "0".."3": train takes it

    again = run_pack_job(src, tmp_path / "out")                  # a rerun, or a requeue
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("verified and packed from") == 2 and "pack (" not in again.stderr
    forced = run_pack_job(src, tmp_path / "out", FORCE="1")
    assert forced.returncode == 0 and "kept" not in forced.stdout
