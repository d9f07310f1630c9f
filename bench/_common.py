"""What every reproduction in bench/ shares: running jobs, reading their envelopes, spreads, results.

A reproduction (one module in bench/, listed in ``reproduce.py``'s
``MODULES``) defines ``REPRODUCTION = Reproduction(...)``: what the paper
claims, a ``measure`` function that runs real dimd commands (each writes its
``--json`` envelope, read back with :func:`dimd.report.read_result`) and
returns ``(parameters, figures)``, a ``plot`` function that draws the
figures, and a ``findings`` function that says in a few sentences what they
show. The runner writes ``bench/results/NAME.json`` (the standard envelope,
:func:`dimd.report.result_document`), ``NAME.png`` and ``bench/README.md``.

Repeated runs are summarised with :func:`dimd.report.spread` (median, min,
max and the runs themselves) and nothing else.
"""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from dimd.host import available_cores
from dimd.report import read_result, result_document, spread, write_json

__all__ = ["BENCH", "BIN", "JobError", "Context", "Reproduction", "SampleSet", "dimd_job", "json_job", "machine",
           "mpi_python", "no_cuda_line", "read_result", "run", "sample_set", "spread", "write_result"]

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
#: Generated data, raw per-run envelopes and logs; never committed.
WORK = Path(os.environ.get("DIMD_BENCH_WORK", BENCH / "work"))
#: The environment's executables (mpiexec, dimd): the ones next to the running Python.
BIN = Path(sys.executable).parent
JOB_TIMEOUT_S = 1800


class JobError(RuntimeError):
    """A command a reproduction ran failed; the message holds its command line and output tail."""


# ---------------------------------------------------------------------------- running jobs
def run(cmd: Sequence[Any], *, env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT_S,
        log: Path | None = None) -> str:
    """Run ``cmd`` to the end and return its output (stdout and stderr together).

    The output goes to ``log`` as it comes (``tail -f`` it to follow a long
    job), else to a temporary file. The command gets a process group of its
    own. If this process is interrupted (Ctrl-C, SIGTERM) or the command
    overruns ``timeout``, the group gets SIGTERM and 30 s to clean up
    (bench/netfs.sh unmounts and stops its sshd then) before SIGKILL.
    """
    import tempfile

    argv = [str(c) for c in cmd]
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with (open(log, "w+") if log is not None else tempfile.TemporaryFile("w+")) as out:
        out.write(" ".join(argv) + "\n")
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except BaseException:
            _stop_group(proc)
            raise
        out.seek(0)
        output = out.read().split("\n", 1)[-1]
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-25:])
        raise JobError(f"exit {proc.returncode}: {' '.join(argv)}\n{tail}")
    return output


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


_FIRST = object()


def json_job(argv: Sequence[Any], json_path: Path, *, env: dict[str, str] | None = None,
             timeout: float = JOB_TIMEOUT_S) -> None:
    """Run ``ARGV --json JSON_PATH`` (output logged beside it as .log), no stale JSON left to be read back."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.unlink(missing_ok=True)
    run([*argv, "--json", json_path], env=env, timeout=timeout, log=json_path.with_suffix(".log"))


def dimd_job(args: Sequence[Any], json_path: Path, *, ranks: int | None = None,
             env: dict[str, str] | None = None, wrap: Sequence[Any] = (), timeout: float = JOB_TIMEOUT_S,
             command: Any = _FIRST) -> dict:
    """Run ``[mpiexec -n RANKS] dimd ARGS --json JSON_PATH`` and return the envelope it wrote.

    ``wrap`` goes in front of the whole command (e.g. bench/netfs.sh run ... --).
    The envelope must come from ``command`` (default: ARGS[0]; None: any).
    """
    launcher = [BIN / "mpiexec", "-n", ranks] if ranks else []
    json_job([*wrap, *launcher, BIN / "dimd", *args], json_path, env=env, timeout=timeout)
    return read_result(json_path, str(args[0]) if command is _FIRST else command)


def mpi_python(ranks: int, script: Path, args: Sequence[Any], json_path: Path, command: str,
               *, env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT_S) -> dict:
    """Run a bench/ MPI script under ``python -m mpi4py`` (one rank's error ends the job) and read its envelope."""
    json_job([BIN / "mpiexec", "-n", ranks, sys.executable, "-m", "mpi4py", script, *args], json_path,
             env=env, timeout=timeout)
    return read_result(json_path, command)


def python_job(script: Path, args: Sequence[Any], json_path: Path, command: str, *,
               env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT_S) -> dict:
    """Run a bench/ script in a Python process of its own and read the envelope it wrote."""
    json_job([sys.executable, script, *args], json_path, env=env, timeout=timeout)
    return read_result(json_path, command)


# ---------------------------------------------------------------------------- the machine
def steady(per_epoch: list[float]) -> float:
    """A run's figure: the median of its epochs after the first (start-up and warm-up)."""
    return statistics.median(per_epoch[1:] if len(per_epoch) > 1 else per_epoch)


def time_left(deadline: float | None) -> float:
    """A job's time limit: what is left before ``deadline`` (time.monotonic()), or the bench's default."""
    return JOB_TIMEOUT_S if deadline is None else max(1.0, deadline - time.monotonic())


def gpu_decode_workers() -> int:
    """The decoding processes of a GPU benchmark's runs: the cores but two (the training process and the feed's
    thread keep theirs)."""
    return max(1, available_cores() - 2)


def no_cuda_line(script: str, does: str = "measures on a GPU") -> str | None:
    """Why ``script`` cannot run here (one line), or None on a CUDA machine."""
    import torch

    if torch.cuda.is_available():
        return None
    return (f"{script} {does}: this machine has no CUDA device (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda or 'not built in'})")


def machine() -> dict[str, Any]:
    """What the figures were measured on, for the JSON and the plots' footnotes."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return {"cpu": cpu, "cores": available_cores(), "memory_gib": round(memory / 2**30, 1),
            "system": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


# ---------------------------------------------------------------------------- reproductions
@dataclass
class Context:
    """What a reproduction's ``measure`` gets: the size to run at, a work folder, a progress line."""

    name: str
    quick: bool
    work: Path = WORK
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))

    def size(self, full: dict[str, Any], quick: dict[str, Any]) -> dict[str, Any]:
        """The parameters for this run: ``full``, with ``quick``'s values over them under --quick."""
        return {**full, **(quick if self.quick else {}), "quick": self.quick}

    def folder(self, *parts: str) -> Path:
        """A folder for this reproduction's raw envelopes and logs (under the work folder)."""
        path = self.work / "runs" / self.name / Path(*parts) if parts else self.work / "runs" / self.name
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass(frozen=True)
class Reproduction:
    """One figure of the gallery: a paper's claim, how to measure it here, how to draw and read it."""

    name: str                                              # bench/results/NAME.json and NAME.png
    title: str                                             # the README section's heading
    claim: str                                             # what the paper says (Markdown)
    measure: Callable[[Context], tuple[dict[str, Any], dict[str, Any]]]   # -> (parameters, figures)
    plot: Callable[[dict[str, Any]], Any]                  # envelope -> a matplotlib Figure
    findings: Callable[[dict[str, Any]], str]              # envelope -> what it shows here (Markdown)
    minutes: float                                         # full size on a quiet 2-core machine, estimated
    default: bool = True                                   # run by `make reproduce` (False: opt-in)


def write_result(name: str, parameters: dict[str, Any], figures: dict[str, Any],
                 results: Path = RESULTS) -> tuple[Path, dict[str, Any]]:
    """Write ``results/NAME.json`` in the standard envelope (versions, commit, date, host) and return it."""
    document = result_document(f"bench/reproduce.py {name}", parameters, {**figures, "machine": machine()})
    path = results / f"{name}.json"
    results.mkdir(parents=True, exist_ok=True)
    write_json(path, document)
    return path, read_result(path)


# ---------------------------------------------------------------------------- shared data
@dataclass(frozen=True)
class SampleSet:
    """A generated image set, packed, and its records written back out as files of the same bytes."""

    images: Path     # dimd sample-data's tree (the originals, varied sizes)
    train: Path      # the packed training set (stem)
    val: Path        # the packed validation set (stem)
    files: Path      # one file per packed record, the packed JPEG's bytes, at the record's name

    @property
    def records(self) -> int:
        from dimd.format import PackedDataset

        return len(PackedDataset(self.train))


def sample_set(classes: int = 10, per_class: int = 64, val_per_class: int = 8, seed: int = 1,
               work: Path = WORK, log: Callable[[str], None] = lambda line: None,
               short_side: int = 256, large_share: float | None = None,
               deadline: float | None = None) -> SampleSet:
    """``dimd sample-data`` + ``dimd pack`` at ``short_side`` (cached in the work folder by its parameters).

    ``files`` holds each packed record as a file, so reading from files and
    reading from memory decode the very same bytes: the comparison measures
    where the bytes come from, not a different resize. ``large_share``:
    sample-data's share of images over 1000 px (its default when None; 0 for
    a set packed small, where they only cost time). ``deadline``
    (time.monotonic()): no command runs past it.
    """
    root = work / "data" / (f"c{classes}x{per_class}v{val_per_class}s{seed}"
                            + (f"-side{short_side}" if short_side != 256 else "")
                            + (f"-large{large_share:g}" if large_share is not None else ""))
    done = root / ".complete"
    result = SampleSet(root / "images" / "train", root / "train", root / "val", root / "files")
    if done.exists():
        return result
    log(f"generating the sample set in {root} ({classes} classes x {per_class} images)")
    dimd = BIN / "dimd"
    large = ["--large-share", large_share] if large_share is not None else []
    for folder, count, seeded in ((result.images, per_class, seed), (root / "images" / "val", val_per_class,
                                                                      seed + 1000)):
        run([dimd, "sample-data", folder, "--classes", classes, "--per-class", count, "--seed", seeded, *large],
            timeout=time_left(deadline))
    side = ["--short-side", short_side]
    for folder, stem in ((result.images, result.train), (root / "images" / "val", result.val)):
        run([dimd, "pack", folder, "-o", stem, "--force", "--quiet", *side], timeout=time_left(deadline))
    write_records_as_files(result.train, result.files)
    done.touch()
    return result


def write_records_as_files(stem: Path, folder: Path) -> int:
    """Each record of a packed set as ``folder/<name>``, holding exactly the record's bytes."""
    from dimd.format import PackedDataset

    packed = PackedDataset(stem)
    for i, name in enumerate(packed.names):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(packed.record(i)))
    return len(packed)

