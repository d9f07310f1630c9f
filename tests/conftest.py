"""Shared fixtures: the sample tree, packed sets, this process's MPI world, and real MPI jobs.

Tests that start ranks go through :func:`run_mpi` (any program), :func:`run_mpi_dimd`
(``dimd CMD`` as a user runs it) or :func:`mpi_run` (a case, ``tests/mpi_case.py``), and
carry ``@pytest.mark.mpi``, so ``pytest -m "not mpi"`` runs without launching MPI::

    MPIEXEC="srun --mpi=pmi2" pytest             # a site's launcher, with its own options
    MPIEXEC="mpirun --oversubscribe" pytest      # Open MPI, more ranks than cores
    pytest -m "not mpi"                          # no MPI jobs at all

Tests that need no separate process call the CLI in this one through :func:`invoke_dimd`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest
from mpi_case import case_command
from mpi_segments import descendants, held_by, remove_leftover_mpi_segments

BIN = Path(sys.executable).parent
DIMD = [sys.executable, "-m", "dimd"]
BENCH = Path(__file__).resolve().parent.parent / "bench"
PEERS = BENCH / "peers"


#: `make test` runs a test process per core (pytest-xdist), so MPI jobs of different tests share the
#: cores: their ranks yield when idle, as dimd makes them do when its own ranks outnumber the cores
#: (docs/mpi.md), instead of spinning in a wait against the other job's work.
SHARED_CORES = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1"}
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    for key, value in SHARED_CORES.items():
        os.environ.setdefault(key, value)


def run_python(*args: object, check: bool = False, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` (``SCRIPT.py ...`` or ``-m MODULE ...``) in a process of its own, output captured.

    The process is forked from the warm interpreter (:class:`WarmInterpreter`),
    standard input at /dev/null; ``DIMD_TESTS_FRESH_PROCESS=1`` starts a fresh
    ``python`` for each run instead. ``env`` (the whole environment, as
    :func:`subprocess.run` takes it) is the one keyword argument the warm path
    takes; any other goes to :func:`subprocess.run` with a fresh process.
    """
    command = [sys.executable, *map(str, args)]
    if set(kwargs) <= {"env"}:
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        command, kwargs = _warm.command(command, env), {"env": env, "stdin": subprocess.DEVNULL}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"python {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def run_dimd(*args: object, check: bool = False, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run ``dimd ARGS`` as a user would, in a process of its own (as :func:`run_python` runs Python)."""
    return run_python(*DIMD[1:], *args, check=check, timeout=timeout, **kwargs)


class WarmInterpreter:
    """This test process's warm interpreter (``tests/warm_dimd.py``), started on first use.

    It imported torch and dimd once; a process that would be ``python ARGS`` (a
    ``dimd`` run, an MPI rank, a job script's ``dimd``) is instead
    ``python -S tests/warm_rank.py ARGS``, a stub that borrows a child forked
    from it: the caller's streams, signals, exit status and (for a rank) the
    launcher's PMI wire-up stay as they were, without the ~3 CPU-seconds of a
    fresh start. Ranks use it with the venv's MPICH only (they find the
    launcher through the ``PMI_FD`` they inherit).
    """

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None
        self.folder: tempfile.TemporaryDirectory | None = None
        self.path = ""

    def start(self) -> str:
        if self.server is None or self.server.poll() is not None:
            self.folder = tempfile.TemporaryDirectory(prefix="dimd-warm-")
            self.path = os.path.join(self.folder.name, "socket")
            self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("warm_dimd.py")),
                                            self.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.server.stdout.readline()   # listening
            atexit.register(self.close)
        return self.path

    def command(self, args: list[str], env: dict[str, str]) -> list[str]:
        """``args`` (``python -m ...`` or ``python SCRIPT.py ...``) as a stub of the warm interpreter."""
        python = len(args) > 1 and args[0] == sys.executable and (args[1] == "-m" or args[1].endswith(".py"))
        if not python or env.get("DIMD_TESTS_FRESH_PROCESS"):
            return args
        env["DIMD_TESTS_WARM"] = self.start()
        return [sys.executable, "-S", str(Path(__file__).with_name("warm_rank.py")), *args[1:]]

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait(timeout=30)
            self.server.stdout.close()
        if self.folder is not None:
            self.folder.cleanup()


_warm = WarmInterpreter()


def dimd_on_path(folder: Path) -> dict[str, str]:
    """Environment for a job script that runs ``dimd`` from PATH: ``{"PATH": ...}`` with ``folder`` first.

    ``folder/dimd`` borrows the warm interpreter as an MPI rank does
    (tests/warm_rank.py: the same streams, signals and exit status), unless
    ``DIMD_TESTS_FRESH_PROCESS=1``, where the venv's own ``dimd`` is found.
    """
    env = {"PATH": f"{folder}:{BIN}:{os.environ['PATH']}"}
    if not os.environ.get("DIMD_TESTS_FRESH_PROCESS") and not os.environ.get("MPIEXEC"):
        folder.mkdir(parents=True, exist_ok=True)
        stub = folder / "dimd"
        stub.write_text(f'#!/bin/sh\nexec {shlex.join(_warm.command(DIMD, env))} "$@"\n')
        stub.chmod(0o755)
    return env


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Put back what a command run in this process may change for the whole process.

    The stop-signal handlers (``dimd train`` installs them for the process), torch's
    thread count (set from ``--threads``) and the training's process-wide stop flag.
    """
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else len(os.sched_getaffinity(0))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        if "dimd.train.signals" in sys.modules:
            sys.modules["dimd.train.signals"]._process_stop = None


def invoke_dimd(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``dimd ARGS`` in this process through click's CliRunner: what :func:`run_dimd` gives, faster.

    Starting Python and importing torch costs a few seconds per process; here it is
    paid once per session. MPI may start (a world of one rank, as the ``world`` fixture
    starts it), and :func:`process_state_kept` puts back signal handlers and torch's
    threads, so a command that refuses its options or configuration (``dimd train``
    included) runs here. A run that trains, forks workers, is sent a signal or gets
    as far as claiming its checkpoint folder (given back when its process exits)
    needs a process of its own (:func:`run_dimd`). An exception that escapes the
    command fails the test with its own traceback.
    """
    from click.testing import CliRunner

    from dimd.cli import main

    with process_state_kept():
        result = CliRunner().invoke(main, list(map(str, args)), prog_name="dimd", catch_exceptions=False)
    proc = subprocess.CompletedProcess(["dimd", *map(str, args)], result.exit_code,
                                       result.stdout, result.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"dimd {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def mpiexec() -> list[str]:
    """The launcher: ``$MPIEXEC`` split like a shell would (``srun --mpi=pmi2``), else the venv's ``mpiexec``."""
    return shlex.split(os.environ.get("MPIEXEC", "")) or [str(BIN / "mpiexec")]


_current_test: pytest.Item | None = None
_session_started = time.time()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove what killed MPI jobs of this run left in /dev/shm (once, in the controlling process)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        remove_leftover_mpi_segments(_session_started)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Remember the test being set up, so that :func:`launcher` can check its ``mpi`` mark."""
    global _current_test
    _current_test = item


def signal_at(job: subprocess.Popen, marker: str, send) -> tuple[str, str]:
    """Read ``job``'s output until a line holding ``marker``, call ``send(job)``, then wait for the end:
    (everything it printed, its stderr; "" when stderr goes to stdout). The job is killed on any way out."""
    seen = []
    try:
        for line in job.stdout:
            seen.append(line)
            if marker in line:
                send(job)
                break
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    return "".join(seen) + out, err or ""


def launcher_is_open_mpi() -> bool:
    """Whether ``$MPIEXEC`` is Open MPI's mpirun (which kills the ranks 250 ms after a SIGTERM)."""
    version = subprocess.run([mpiexec()[0], "--version"], capture_output=True, text=True)
    return "Open MPI" in version.stdout + version.stderr


def launcher(n: int) -> list[str]:
    """``$MPIEXEC -n N``, for the test now running, which must be marked ``@pytest.mark.mpi``."""
    if _current_test is not None and _current_test.get_closest_marker("mpi") is None:
        pytest.fail(f"{_current_test.nodeid} starts MPI ranks: mark it @pytest.mark.mpi "
                    "so that `pytest -m \"not mpi\"` leaves it out", pytrace=False)
    return [*mpiexec(), "-n", str(n)]


def mpi_command(n: int, args: Sequence[object], env: dict[str, str]) -> list[str]:
    """``$MPIEXEC -n N ARGS``; without ``$MPIEXEC``, each rank a stub of the warm interpreter.

    ``env`` is the environment the command will run with (the stub's socket is added to it)."""
    args = list(map(str, args))
    return [*launcher(n), *(args if os.environ.get("MPIEXEC") else _warm.command(args, env))]


def run_mpi(n: int, *args: str, timeout: float = 240, check: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``$MPIEXEC -n N ARGS`` (e.g. a dimd command or a Python script) on real ranks.

    A job that hangs fails the test through ``timeout`` instead of blocking it.
    """
    full_env = {**os.environ, **(env or {})}
    command = mpi_command(n, args, full_env)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{shlex.join(command)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def run_mpi_dimd(n: int, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``$MPIEXEC -n N dimd ARGS``, as a user starts a dimd command on N ranks."""
    return run_mpi(n, *DIMD, *args, **kwargs)


def run_mpi_dimd_watched(n: int, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, set[str]]:
    """:func:`run_mpi_watched` for a dimd command."""
    return run_mpi_watched(n, *DIMD, *args, timeout=timeout)


def run_mpi_watched(n: int, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, set[str]]:
    """:func:`run_mpi`, and the MPICH hydra topology files (``/tmp/hydra_hwloc_xmlfile_*``) the job's
    processes held open while it ran.

    Hydra's proxy holds its file open from the ranks' start to the job's end and removes it only when the job
    ends in order (``MPI_Abort`` leaves it behind for good), so a test can check that its own job left none,
    whatever other tests' jobs leave meanwhile. Empty under another launcher (``$MPIEXEC``).
    """
    env = dict(os.environ)
    command = mpi_command(n, list(args), env)
    held: set[str] = set()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        job = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env)
        deadline = time.monotonic() + timeout
        try:
            while job.poll() is None:
                held |= held_by(job.pid)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(command, timeout)
                time.sleep(0.01)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, job.returncode, out.read(), err.read()), held


def mpi_run(case: Callable[..., None], n: int, *args: object, timeout: float = 120, check: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``case`` (a function marked ``@case``, ``tests/mpi_case.py``) on N ranks under ``python -m mpi4py``.

    ``python -m mpi4py`` aborts the job when any rank raises, so a failed assert
    on one rank ends every rank at once, its traceback in ``stderr``::

        proc = mpi_run(allreduce_sweep, 3, "ring,tree")
        assert proc.returncode == 0, proc.stderr
    """
    return run_mpi(n, *case_command(case), *map(str, args), timeout=timeout, check=check, env=env)


@pytest.fixture
def mpi_leaves_no_files():
    """Asserts, after the test, that its jobs left nothing of MPI's in /dev/shm (MPICH's files).

    MPICH's short-lived files of an aborted job go within seconds (its ranks are still being ended); the one
    it keeps per node for a job's life would stay for good had dimd not unlinked it at start-up.
    """
    before = set(Path("/dev/shm").glob("mpich_shm_*"))
    yield
    deadline = time.monotonic() + 15
    while (left := not_anothers(set(Path("/dev/shm").glob("mpich_shm_*")) - before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left in /dev/shm: {sorted(map(str, left))}"


def not_anothers(files: set[Path]) -> set[Path]:
    """``files`` less those a process outside this test process's tree maps: a job another test process (or
    anyone else on the machine) runs meanwhile, whose per-node file lives as long as that job."""
    ours, theirs = descendants(os.getpid()), set()
    for process in Path("/proc").glob("[0-9]*"):
        if files - theirs and int(process.name) not in ours:
            with contextlib.suppress(OSError):
                maps = (process / "maps").read_text()
                theirs |= {path for path in files if str(path) in maps}
    return files - theirs


@pytest.fixture(scope="session")
def sample_tree(tmp_path_factory) -> Path:
    """A small class-tree of real JPEGs (4 classes x 12 images, some > 1000 px)."""
    from dimd.sample_data import SampleSpec, generate

    root = tmp_path_factory.mktemp("sample") / "train"
    generate(SampleSpec(root=root, classes=4, per_class=12, seed=7, large_share=0.2), workers=2)
    return root


def pack_tree_as_is(root: Path, out: Path) -> Path:
    """Pack a class tree without re-encoding (the files' own JPEG bytes).

    Later stages test against this so they do not depend on ``dimd pack``'s
    resize path; ``out`` is the dataset stem (``out.dimd`` + ``out.idx.h5``).
    """
    from PIL import Image

    from dimd.format import PackedRecord, PackWriter

    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    with PackWriter(out) as writer:
        for label, name in enumerate(classes):
            for path in sorted((root / name).iterdir()):
                with Image.open(path) as image:
                    width, height = image.size
                writer.add(PackedRecord(path.read_bytes(), label, f"{name}/{path.name}",
                                        height, width))
        writer.commit(classes, short_side=0, quality=0, source=str(root))
    return out


@pytest.fixture(scope="session")
def packed_sample(sample_tree, tmp_path_factory) -> Path:
    """The sample tree as a packed data set stem (48 records, 4 classes)."""
    return pack_tree_as_is(sample_tree, tmp_path_factory.mktemp("packed") / "sample")


@pytest.fixture(scope="session")
def world():
    """This process's ``MPI.COMM_WORLD``: one rank, started the way dimd starts MPI (no launcher)."""
    from dimd.mpi import init_mpi

    init_mpi("funneled")
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture(scope="module")
def store(packed_sample, world):
    """The packed sample loaded into a one-rank in-memory store."""
    from dimd.shuffle import DistributedStore

    return DistributedStore.load(packed_sample, world)


COLOURS = {"red": (200, 30, 30), "green": (30, 190, 40), "blue": (30, 40, 200), "grey": (128, 128, 128)}


@pytest.fixture(scope="session")
def colour_set(tmp_path_factory):
    """4 classes of 12 noisy solid-colour 16 px JPEGs: a set LeNet learns perfectly in a few dozen steps."""
    import io

    import numpy as np
    from PIL import Image

    from dimd.format import PackedRecord, PackWriter

    out = tmp_path_factory.mktemp("colours") / "colours"
    rng = np.random.default_rng(3)
    with PackWriter(out) as writer:
        for label, (name, rgb) in enumerate(COLOURS.items()):
            for i in range(12):
                pixels = np.clip(np.array(rgb) + rng.normal(0, 12, (16, 16, 3)), 0, 255).astype(np.uint8)
                data = io.BytesIO()
                Image.fromarray(pixels).save(data, format="JPEG", quality=90)
                writer.add(PackedRecord(data.getvalue(), label, f"{name}/{i}.jpg", 16, 16))
        writer.commit(list(COLOURS), short_side=16, quality=90, source="colours")
    return out


@pytest.fixture
def bench(monkeypatch):
    """bench/'s modules (and bench/peers/'s) importable, as when their scripts run: ``bench("reproduce")``."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(PEERS))
    return lambda name: importlib.import_module(name)
