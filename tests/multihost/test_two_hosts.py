"""dimd's jobs across two hosts (network namespaces h1 and h2), as on a cluster of two nodes.

``run.sh`` makes the hosts (root), runs these tests with ``MULTIHOST_PREFIX`` set and
removes the hosts on every way out; without it they are skipped. ``make test`` leaves this
folder out (pyproject's ``norecursedirs``): CI runs it through ``run.sh``. Every job starts on
h1 (its launcher too) and reaches h2 through ``on-host``, the launchers' stand-in for ssh, so
no traffic leaves the two namespaces (``multihost.py`` starts them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from dimd.allreduce import ALGORITHMS
from multihost import MPI, hosts_sh, on_hosts, processes_on, ranks

pytestmark = pytest.mark.skipif(
    not os.environ.get("MULTIHOST_PREFIX"),
    reason="needs the namespace hosts: run tests/multihost/run.sh as root")

LAYOUTS = ["h1,h2", "h1:2,h2:1"]
#: Every algorithm but ps: over TCP its MPI_ANY_SOURCE receives hang at times (see the allreduce test); and but
#: those of torch.distributed (timed by --peer gloo, or on device buffers).
OVER_TCP_ALGORITHMS = ",".join(name for name in ALGORITHMS if name not in ("ps", "torch", "nccl", "gloo"))
TRAIN = ("--model", "lenet", "--image-size", "32", "--batch-size", "4", "--lr", "0.05", "--no-lr-scaling",
         "--allreduce", "ring", "--decode-workers", "1", "--device", "cpu")


@pytest.mark.parametrize("hosts", LAYOUTS)
def test_shuffle_verifies_across_hosts(packed_sample, hosts):
    job = on_hosts(hosts, "shuffle", packed_sample, "--rounds", "2", "--verify")
    assert job.returncode == 0, job.stderr
    assert "verified" in job.stdout + job.stderr


@pytest.mark.parametrize("hosts", LAYOUTS)
def test_allreduce_sums_right_across_hosts(hosts, tmp_path):
    out = tmp_path / "allreduce.json"
    # every algorithm but ps: over TCP on h1:2,h2:1 its 32 KiB message never arrives. Rank 0's
    # MPI_ANY_SOURCE receive, one sender on shared memory and one on UCX's TCP: a plain mpi4py loop of
    # Send / Recv(ANY_SOURCE) hangs the same way at 32 KiB (MPICH 5.0.2's UCX netmod, not dimd)
    job = on_hosts(hosts, "bench-allreduce", "--check", "--max-bytes", "64K", "--factor", "16",
                   "--iters", "2", "-a", OVER_TCP_ALGORITHMS, "--json", out)
    assert job.returncode == 0, job.stderr
    doc = json.loads(out.read_text())
    assert doc["result"]["world_size"] == ranks(hosts)
    assert doc["mpi"]["local_ranks"] == int(hosts.split(",")[0].partition(":")[2] or 1)   # rank 0's node
    assert all(not row.get("wrong") for row in doc["result"]["rows"])


@pytest.mark.parametrize("hosts", LAYOUTS)
def test_train_one_epoch_across_hosts(packed_sample, hosts, tmp_path):
    out = tmp_path / "train.json"
    job = on_hosts(hosts, "train", packed_sample, "--val", packed_sample, *TRAIN, "--epochs", "1",
                   "--checkpoint-dir", tmp_path / "ckpt", "--json", out)
    assert job.returncode == 0, job.stderr
    result = json.loads(out.read_text())["result"]
    assert result["world_size"] == ranks(hosts) and result["epochs_run"] == 1
    assert result["replicas_identical"]
    assert f"{result['threads']} thread(s) per rank" in job.stdout


@pytest.mark.parametrize("hosts", LAYOUTS)
def test_train_with_gloo_across_hosts_trains_as_the_ring_does(packed_sample, hosts, tmp_path):
    """torch.distributed's group, started from the MPI job across the hosts (rank 0's TCPStore at its address
    on the veth, broadcast over MPI), reduces the buckets in place: the path NCCL takes between nodes."""
    weights = {}
    for algorithm in ("ring", "gloo"):
        out = tmp_path / algorithm
        out.mkdir()
        job = on_hosts(hosts, "train", packed_sample, "--val", packed_sample, *TRAIN, "--allreduce", algorithm,
                       "--epochs", "1", "--checkpoint-dir", out, "--json", out / "train.json")
        assert job.returncode == 0, job.stderr
        result = json.loads((out / "train.json").read_text())["result"]
        assert result["allreduce"] == algorithm and result["replicas_identical"]
        weights[algorithm] = result["final"]["train_loss"]
    assert weights["gloo"] == pytest.approx(weights["ring"], rel=1e-5)   # the same sums, up to their order


def stop_signal() -> signal.Signals:
    """What stops a run with a checkpoint when sent to the launcher (docs/batch-jobs.md)."""
    return signal.SIGUSR2 if MPI == "openmpi" else signal.SIGTERM


def test_a_stop_signal_to_the_launcher_checkpoints_across_hosts(packed_sample, tmp_path):
    ckpt = tmp_path / "ckpt"
    job = on_hosts("h1,h2", "train", packed_sample, "--val", packed_sample, *TRAIN, "--epochs", "200",
                   "--checkpoint-dir", ckpt, "--json", tmp_path / "train.json", popen=True)
    seen = []
    try:
        for line in job.stdout:          # up to the run's header: the data is loaded, training starts
            seen.append(line)
            if "thread(s) per rank" in line:
                break
        time.sleep(2)                    # a few steps in
        launcher = launcher_of(job.pid)
        subprocess.run(["kill", f"-{stop_signal().name}", str(launcher)], check=True)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    out = "".join(seen) + out
    assert job.returncode == 0, out + err
    assert f"stopped by {stop_signal().name}" in out
    result = json.loads((tmp_path / "train.json").read_text())["result"]
    assert result["stopped_by"] == stop_signal().name and list(ckpt.glob("*.pt"))


LAUNCHERS = {"mpiexec", "mpiexec.hydra", "mpirun", "prterun"}


def launcher_of(pid: int) -> int:
    """The launcher (mpiexec or mpirun) that ``on-host`` started as process ``pid`` or below it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = _find_launcher(pid)
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no launcher under process {pid}")


def _find_launcher(pid: int) -> int | None:
    proc = Path(f"/proc/{pid}")
    try:
        if (proc / "comm").read_text().strip() in LAUNCHERS:
            return pid
        children = [int(c) for task in (proc / "task").iterdir()
                    for c in (task / "children").read_text().split()]
    except OSError:
        return None
    for child in children:
        found = _find_launcher(child)
        if found is not None:
            return found
    return None


def test_a_checkpoint_folder_one_host_alone_sees_is_named_as_such(packed_sample, tmp_path):
    local = tmp_path / "local"   # on h1's own disk: h2 sees an empty folder there
    local.mkdir()
    first = on_hosts("h1", "train", packed_sample, "--val", packed_sample, *TRAIN, "--epochs", "1",
                     "--checkpoint-dir", local)
    assert first.returncode == 0, first.stderr
    job = on_hosts("h1,h2", "train", packed_sample, "--val", packed_sample, *TRAIN, "--epochs", "2",
                   "--checkpoint-dir", local, "--resume", env={"MULTIHOST_LOCAL_DIR": str(local)})
    assert job.returncode != 0
    assert "checkpoint not found by rank 1 on h2" in job.stderr
    assert "must be visible on every node" in job.stderr


@pytest.fixture
def cut_h2():
    """Cuts h2 off the network when called (its veth goes, as a dead node's link does); joins it back after."""
    cut = []
    yield lambda: (hosts_sh("hosts_cut"), cut.append(True))
    if cut:
        for host in ("h1", "h2"):      # whatever a failed test left running there
            for process in processes_on(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(process.split()[0]), signal.SIGKILL)
        hosts_sh("hosts_link")


#: Each MPI command, endless, with the line of its output after which it is in its waits for the other host.
CUT_OFF_JOBS = {
    "train": (("train", "{data}", "--val", "{data}", *TRAIN, "--epochs", "200", "--checkpoint-dir", "{tmp}/ckpt"),
              "thread(s) per rank"),
    "shuffle": (("shuffle", "{data}", "--rounds", "1000000"), "resident memory per rank"),
    # rows of about a second at first (a row is one wait: none may outlast the timeout before the cut)
    "bench-allreduce": (("bench-allreduce", "-a", "ring", "--min-bytes", "8", "--max-bytes", "1M", "--iters",
                         "10000"), "busbw"),
}


@pytest.mark.parametrize("command", CUT_OFF_JOBS)
def test_a_host_cut_off_mid_job_ends_the_job_with_one_line(packed_sample, tmp_path, cut_h2, command):
    """h2 leaves the network mid-job: no rank or launcher can learn it from MPI, which waits forever.
    The stall watchdog of the rank on h1 names itself, its host and the wait, and every process ends,
    the launcher on h1 and the proxy (Open MPI: the daemon) and rank on h2 too."""
    before = set(processes_on("h1") + processes_on("h2"))    # none, unless an earlier test left some
    words, started = CUT_OFF_JOBS[command]
    args = [word.format(data=packed_sample, tmp=tmp_path) for word in words]
    job = on_hosts("h1,h2", *args, "--stall-timeout", "5", popen=True)
    seen = []
    try:
        for line in job.stdout:          # up to the line after which the job waits for the other host
            seen.append(line)
            if started in line:
                break
        time.sleep(2)                    # a few steps, rounds or rows in
        cut_h2()
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0, "".join(seen) + out + err
    print(err)                           # shown with -s
    lines = [line for line in err.splitlines() if "no progress for" in line]
    assert lines and lines[0].startswith("dimd: error: rank 0 on h1: no progress for "), err
    assert "; a peer may be unreachable (--stall-timeout sets how long" in lines[0]
    assert "Traceback" not in err
    # rank 1's line is printed on h2, whose output can no longer reach the launcher; its processes end anyway
    def left():
        return set(processes_on("h1") + processes_on("h2")) - before

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left()


@pytest.fixture
def debian_hosts_file():
    """h1's /etc/hosts as Debian's installer writes it: its own name on 127.0.1.1 first."""
    path = Path(f"/etc/netns/{os.environ['MULTIHOST_PREFIX']}h1/hosts")
    before = path.read_text()
    path.write_text("127.0.0.1 localhost\n127.0.1.1 h1\n" + before.split("\n", 1)[1])
    yield path
    path.write_text(before)


def test_gloo_refuses_a_loopback_address_across_hosts_and_takes_master_addr(debian_hosts_file):
    args = ("bench-allreduce", "--peer", "gloo", "--max-bytes", "4K", "--factor", "16", "--iters", "2",
            "-a", OVER_TCP_ALGORITHMS)
    refused = on_hosts("h1,h2", *args, timeout=120)
    assert refused.returncode != 0
    assert "resolves to the loopback address 127.0.1.1" in refused.stderr and "MASTER_ADDR" in refused.stderr
    assert refused.stderr.count("dimd: error:") == 1
    given = on_hosts("h1,h2", *args, env={"MASTER_ADDR": "10.200.0.1"}, timeout=120)
    assert given.returncode == 0, given.stderr
    assert "gloo" in given.stdout


def test_gloo_training_refuses_a_loopback_address_across_hosts_in_one_line_and_takes_master_addr(
        packed_sample, debian_hosts_file, tmp_path):
    args = ("train", packed_sample, "--val", packed_sample, *TRAIN, "--allreduce", "gloo", "--epochs", "1")
    refused = on_hosts("h1,h2", *args, timeout=180)
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("dimd: error:")]
    assert len(errors) == 1 and "resolves to the loopback address 127.0.1.1" in errors[0], refused.stderr
    assert "MASTER_ADDR" in errors[0] and "Traceback" not in refused.stderr
    given = on_hosts("h1,h2", *args, "--json", tmp_path / "train.json", env={"MASTER_ADDR": "10.200.0.1"},
                     timeout=180)
    assert given.returncode == 0, given.stderr
    result = json.loads((tmp_path / "train.json").read_text())["result"]
    assert result["allreduce"] == "gloo" and result["replicas_identical"]
