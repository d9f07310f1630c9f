"""bench/: the reproduction runner's registry, README and plots, its job runner, and the network file system.

The measurements themselves are benchmarks (`make reproduce`), not tests; these
check the machinery around them. No timing is asserted.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import BENCH, run_python



def test_the_runner_lists_every_reproduction_once():
    proc = run_python(BENCH / "reproduce.py", "--list", timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == ["allreduce_bandwidth", "epoch_by_allreduce", "shuffle_scaling", "memory_vs_files",
                     "comm_vs_ranks", "train_vs_ddp", "sma_tta", "sma_tta_resnet", "plan_batch_plan",
                     "plan_batch_check", "large_batch", "recipe", "allreduce_vs_mpich", "peer_loaders", "gpu_feed",
                     "cuda_graphs", "sma_tta_gpu", "gpu_allreduce"]
    assert [line.split()[0] for line in proc.stdout.splitlines() if "(opt-in)" in line] == [
        "sma_tta_resnet", "allreduce_vs_mpich", "peer_loaders", "gpu_feed", "cuda_graphs", "sma_tta_gpu",
        "gpu_allreduce"]


def test_no_bench_script_puts_the_repository_on_sys_path():
    """dimd is imported as installed, never from the bare folders; a probe may add bench/ for its helpers."""
    for script in [*BENCH.glob("*.py"), *BENCH.glob("*/*.py")]:
        for line in script.read_text().splitlines():
            if "sys.path.insert" in line:
                assert script.parent.name == "probes" and line.strip() == "sys.path.insert(1, str(BENCH))", (
                    f"{script.relative_to(BENCH)} makes the bare folders importable")


def test_the_readme_has_a_section_per_reproduction_even_before_any_is_measured(bench, tmp_path):
    reproduce = bench("reproduce")
    readme = tmp_path / "README.md"
    reproduce.write_readme(reproduce.registry(), tmp_path / "results", readme)
    text = readme.read_text()
    for number, r in enumerate(reproduce.registry().values(), 1):
        assert f"## {number}. {r.title}" in text and f"bench/reproduce.py {r.name}`" in text
    assert text.count("*Not measured yet.*") == len(reproduce.registry())


def test_committed_results_plot_and_read(bench, tmp_path):
    """Each committed bench/results/NAME.json builds its figure and a findings paragraph; one is written
    as a PNG through pillow-simd (needs matplotlib). Laying out and rendering every figure would take
    ~12 s of the suite; `bench/reproduce.py --plot-only` renders them all."""
    pytest.importorskip("matplotlib")
    reproduce = bench("reproduce")
    from dimd import plotting
    results = tmp_path / "results"
    shutil.copytree(BENCH / "results", results, ignore=shutil.ignore_patterns("*.png"))
    found = [r for r in reproduce.registry().values() if (results / f"{r.name}.json").exists()]
    if not found:
        pytest.skip("no committed results")
    for r in found:
        envelope = reproduce.read_result(results / f"{r.name}.json", f"bench/reproduce.py {r.name}")
        assert r.findings(envelope).strip()
        plotting.pyplot().close(r.plot(envelope))
    png = reproduce.draw_one(found[-1], results)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reproduce.write_readme(reproduce.registry(), results, tmp_path / "README.md")
    assert (tmp_path / "README.md").read_text().count("![") == len(found)


def test_a_job_that_overruns_gets_sigterm_and_time_to_clean_up(bench, tmp_path):
    common = bench("_common")
    cleaned = tmp_path / "cleaned"
    script = f"trap 'touch {cleaned}; exit 143' TERM; sleep 60 & wait"
    with pytest.raises(subprocess.TimeoutExpired):
        common.run(["bash", "-c", script], timeout=1)
    assert cleaned.exists()


def test_a_failing_job_names_its_command_and_output(bench):
    common = bench("_common")
    with pytest.raises(common.JobError, match=r"exit 3: bash -c .*\nboom"):
        common.run(["bash", "-c", "echo boom; exit 3"])


def test_records_written_as_files_hold_the_packed_bytes(bench, packed_sample, tmp_path):
    from dimd.format import PackedDataset

    common = bench("_common")
    packed = PackedDataset(packed_sample)
    assert common.write_records_as_files(packed_sample, tmp_path) == len(packed)
    for i in (0, len(packed) - 1):
        assert (tmp_path / packed.names[i]).read_bytes() == bytes(packed.record(i))


def test_the_delay_proxy_relays_both_ways_intact(tmp_path):
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data[::-1])

    threading.Thread(target=echo, daemon=True).start()
    payload = os.urandom(1000)
    proc = subprocess.run([sys.executable, BENCH / "delay_proxy.py", "127.0.0.1", str(port), "0.001"],
                          input=payload, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == payload[::-1]
    server.close()


def _netfs_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("sshfs") or not (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd")):
        return "sshd/sshfs not installed (make netfs-setup)"
    return None if os.path.exists("/dev/fuse") else "no /dev/fuse"


@pytest.mark.skipif(_netfs_missing() is not None, reason=str(_netfs_missing()))
def test_netfs_serves_the_files_and_cleans_up_on_sigterm(tmp_path):
    export, mount = tmp_path / "export", tmp_path / "mnt"
    (export / "a").mkdir(parents=True)
    (export / "a" / "x.bin").write_bytes(b"hello")
    info = tmp_path / "info.json"
    done = subprocess.run([BENCH / "netfs.sh", "run", "--export", export, "--mount", mount, "--rtt-ms", "1",
                           "--info", info, "--", "cat", mount / "a" / "x.bin"],
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"hello" and json.loads(info.read_text())["rtt_ms"] == 1
    assert not os.path.ismount(mount)

    started = tmp_path / "started"
    proc = subprocess.Popen([BENCH / "netfs.sh", "run", "--export", export, "--mount", mount, "--rtt-ms", "0",
                             "--", "bash", "-c", f"touch {started}; sleep 60"], stderr=subprocess.PIPE)
    for _ in range(600):
        if started.exists():
            break
        time.sleep(0.1)
    assert os.path.ismount(mount)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    assert not os.path.ismount(mount)   # unmounted; its sshd stopped with it (by PID)


def test_the_cost_model_hook_draws_plan_batch_predictions_and_nothing_else(bench):
    pytest.importorskip("matplotlib")
    comm = bench("comm_vs_ranks")
    from dimd import plotting
    fig, axes = plotting.figure()
    ax = axes[0][0]
    fitted = {"status": "fitted", "fit": {"algorithms": {
        "ring": {"predictions": [{"ranks": 2 ** k, "seconds": 0.01 * k} for k in range(11)]}}}}
    assert comm.draw_cost_model(ax, fitted, 1 << 20) and len(ax.lines) == 1
    assert not comm.draw_cost_model(ax, {"status": "pending", "why": "not yet"}, 1 << 20)
    assert not comm.draw_cost_model(ax, {"status": "fitted", "fit": {"algorithms": {"ring": {}}}}, 1 << 20)
    plotting.pyplot().close(fig)
