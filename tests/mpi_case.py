"""MPI test cases: small MPI programs that a test runs on real ranks, each in the test file beside its test.

A case is a function of a test module decorated with :func:`case`. Its test
starts it on N ranks through ``conftest.mpi_run``, which takes the function
itself, and then checks the job by its output and exit status::

    @case
    def allreduce_sweep(algorithms: str = "") -> None:
        comm = world()
        ...
        say(f"rank {comm.rank} checked {checked} failed {failed}")

    @pytest.mark.mpi
    def test_ring_sums():
        proc = mpi_run(allreduce_sweep, 3, "ring")
        assert proc.returncode == 0, proc.stderr

This file runs a case on the ranks under ``python -m mpi4py``; by hand, from
the repository root (case names are unique across the test files, so the
name alone finds its file)::

    mpiexec -n 3 python -m mpi4py tests/mpi_case.py allreduce_sweep ring,tree
    mpiexec -n 3 python -m mpi4py tests/mpi_case.py tests/test_allreduce.py allreduce_sweep ring,tree
    python tests/mpi_case.py --list

``python -m mpi4py`` calls ``MPI_Abort`` when a rank ends with an uncaught
exception, so a failed ``assert`` on any rank ends the whole job at once, its
traceback on stderr, instead of leaving the other ranks waiting in a collective
until the test's timeout.

A case's positional arguments arrive as strings from the command line; it
starts MPI through :func:`world` (as dimd does, before ``mpi4py.MPI`` is
imported), asserts what it can on every rank, and prints with :func:`say` what
the test should check.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable

TESTS = Path(__file__).resolve().parent


def case(function: Callable[..., None]) -> Callable[..., None]:
    """Mark ``function`` as a case that :func:`main` may run on ranks."""
    function.mpi_case = True
    return function


def world(thread_level: str = "single") -> Any:
    """``MPI.COMM_WORLD``, with MPI started the way dimd starts it (thread level, progress throttle)."""
    from dimd.mpi import init_mpi

    init_mpi(thread_level)
    from mpi4py import MPI

    return MPI.COMM_WORLD


def reduction(algorithm: str, comm: Any) -> tuple[Callable[[Any], None], Any]:
    """A strategy's ``(reduce, device_reduce)`` for ``algorithm``: a host algorithm over MPI (device_reduce
    None), or for nccl and gloo their torch.distributed group, started here (close it at the case's end)."""
    import torch

    from dimd.allreduce import allreduce, device_group

    group = device_group(algorithm, comm, torch.device("cpu"))
    return (lambda array: allreduce(array, comm, algorithm)), group


def say(line: str) -> None:
    """Print ``line`` in one write and flush it: ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def case_command(function: Callable[..., None], mpi4py: bool = True) -> list[str]:
    """The command that runs ``function`` (a case) in a process: ``python -m mpi4py mpi_case.py FILE CASE``
    (without ``-m mpi4py`` when ``mpi4py`` is false: a script as a user runs it, nothing aborting MPI)."""
    if not getattr(function, "mpi_case", False):
        raise TypeError(f"{function.__qualname__} is not marked @case")
    return [sys.executable, *(["-m", "mpi4py"] if mpi4py else []), __file__, inspect.getfile(function),
            function.__name__]


def cases_of(path: Path) -> dict[str, Callable[..., None]]:
    """The cases defined in the test module at ``path``, imported under its own name (as pytest does)."""
    sys.path.insert(0, str(path.resolve().parent))
    module = importlib.import_module(path.stem)
    return {name: value for name, value in vars(module).items()
            if getattr(value, "mpi_case", False) and value.__module__ == module.__name__}


def files_with_cases() -> list[Path]:
    """The test files that define a case (found by their text: nothing is imported)."""
    return [path for path in sorted(TESTS.glob("test_*.py")) if "\n@case\n" in path.read_text()]


def file_of(name: str) -> Path:
    """The one test file that defines the case ``name``."""
    found = [path for path in files_with_cases() if f"\n@case\ndef {name}(" in path.read_text()]
    if len(found) != 1:
        raise SystemExit(f"no case {name!r} in tests/ (python {sys.argv[0]} --list names them)" if not found else
                         f"case {name!r} is defined in {len(found)} files: {', '.join(map(str, found))}")
    return found[0]


def main(argv: list[str] | None = None) -> None:
    """``[TEST_FILE] CASE [ARG...]``: run that case; ``--list [TEST_FILE...]``: the cases (default: of every file)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--list"]:
        for path in [Path(a) for a in argv[1:]] or files_with_cases():
            for name in cases_of(path):
                print(os.path.relpath(path), name)
        return
    named_file = bool(argv) and argv[0].endswith(".py")
    if len(argv) < 1 + named_file:
        raise SystemExit(f"usage: python -m mpi4py {sys.argv[0]} [TEST_FILE] CASE [ARG...]\n"
                         f"       python {sys.argv[0]} --list [TEST_FILE...]")
    path = Path(argv.pop(0)) if named_file else file_of(argv[0])
    name, *args = argv
    cases = cases_of(path)
    if name not in cases:
        raise SystemExit(f"{path} has no case {name!r}; its cases: {', '.join(cases)}")
    cases[name](*args)


if __name__ == "__main__":
    main()
