"""The private APIs of torch, mpi4py and CPython that dimd relies on, each behind one function here.

No public API does these jobs (each function says why it needs its private
one), and a private API may change in any release. So the rest of dimd uses
only this module, and this module declares the versions it was written and
tested for (:data:`WRITTEN_FOR`). The first use of a package's hooks on
another version warns once (:class:`UntestedVersionWarning`), in one line
that says what to do: ``tests/test_private_apis.py`` exercises every hook
here, so run it on that version and, when it passes, add the version.

Nothing heavy is imported here: torch and mpi4py are imported by the hooks
that use them, which only their callers (holding those modules already) call.
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from typing import Any, Callable

#: Package -> the ``major.minor`` versions these hooks were written and tested for.
WRITTEN_FOR: dict[str, tuple[str, ...]] = {
    "torch": ("2.13",),
    "mpi4py": ("4.1",),
    "python": ("3.10", "3.11", "3.12", "3.13"),   # multiprocessing.Pool's _pool, the same in each
}


class UntestedVersionWarning(UserWarning):
    """A package's version is not one that dimd's private hooks for it were tested with."""


def _installed_version(package: str) -> str:
    if package == "python":
        return ".".join(map(str, sys.version_info[:3]))
    return str(importlib.import_module(package).__version__)   # the hook's caller has it imported already


@functools.cache
def _written_for(package: str) -> None:
    """Warn once per process when ``package``'s version is not one the hooks were written for."""
    found = _installed_version(package)
    series = ".".join(found.split("+")[0].split(".")[:2])
    if series not in WRITTEN_FOR[package]:
        written = " or ".join(WRITTEN_FOR[package])
        warnings.warn(f"dimd's private {package} hooks (dimd.private_apis) were written for {package} {written}, "
                      f"not {found}: run `pytest tests/test_private_apis.py`, and when it passes add "
                      f"\"{series}\" to WRITTEN_FOR there", UntestedVersionWarning, stacklevel=3)


# -- torch: autograd's backward pass ----------------------------------------------------------

def graph_task_id() -> int:
    """The id of the backward pass (autograd graph task) running on this thread; -1 outside backward.

    Ids grow with each pass of the process, so a hook tells its own pass from
    an enclosing one (activation checkpointing's reentrant backward) and from a
    forward that comes after a pass that raised. ``torch.autograd.graph`` has
    no public equivalent; PyTorch's DDP reducer reads the same id in C++.
    """
    _written_for("torch")
    import torch

    return torch._C._current_graph_task_id()


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running ends (call it from a hook inside that pass).

    What DDP and FSDP do to finish their reductions before ``backward()``
    returns; autograd's public hooks fire per tensor, none at the pass's end.
    """
    _written_for("torch")
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


def unscale_and_find_non_finite_(grads: Any, found: Any, inverse_scale: Any) -> None:
    """``grads *= inverse_scale`` in place and ``found`` set to 1 if any is inf or NaN, in one fused pass.

    The kernel behind ``torch.amp.GradScaler.unscale_``, which takes an
    optimizer; dimd unscales its flat gradient buffer before the allreduce.
    """
    _written_for("torch")
    import torch

    torch._amp_foreach_non_finite_check_and_unscale_([grads], found, inverse_scale)


def foreach(op: str) -> Callable[..., Any]:
    """torch's multi-tensor op ``torch._foreach_<op>`` (``norm``, ``mul``, ``add_``...): one kernel launch over
    a list of tensors, which torch's own optimizers run (documented as a beta API, named as a private one).
    LARS's per-layer norms and updates take no Python loop over the layers through them."""
    _written_for("torch")
    import torch

    return getattr(torch, f"_foreach_{op}")


def dataloader_worker_pids(loader: Any) -> list[int]:
    """The process ids of a ``torch.utils.data.DataLoader``'s workers (none before its first iteration).

    ``dimd bench-io`` counts their CPU time; the DataLoader keeps them private.
    """
    _written_for("torch")
    iterator = getattr(loader, "_iterator", None)
    return [worker.pid for worker in getattr(iterator, "_workers", [])]


# -- mpi4py: the MPI_Abort that ``python -m mpi4py`` asks for at exit --------------------------------

#: The status mpi4py was last asked to call MPI_Abort with at exit (0: none asked, or taken back).
_abort_at_exit = 0
_watching = False


def watch_abort_requests() -> None:
    """From now on, note each request for ``MPI_Abort`` at exit (call it once ``mpi4py.MPI`` is imported).

    ``python -m mpi4py`` makes one on an uncaught exception or a failing
    ``sys.exit``, through ``MPI._set_abort_status``; mpi4py keeps the status
    in C, where only its exit handler reads it. dimd's exit watch steps aside
    when one is pending, and an error every rank raised alike takes it back.
    """
    global _watching
    if _watching:
        return
    _written_for("mpi4py")
    from mpi4py import MPI

    ask = MPI._set_abort_status

    def noted(status: int) -> None:
        global _abort_at_exit
        _abort_at_exit = status
        ask(status)

    MPI._set_abort_status = noted
    _watching = True


def watching_abort_requests() -> bool:
    """Whether :func:`watch_abort_requests` has run in this process."""
    return _watching


def abort_requested_at_exit() -> int:
    """The status of the ``MPI_Abort`` that mpi4py will call at exit; 0 when none is pending."""
    return _abort_at_exit


def take_back_abort_at_exit() -> None:
    """Cancel a pending request for ``MPI_Abort`` at exit: the process ends through ``MPI_Finalize``."""
    if _abort_at_exit:
        from mpi4py import MPI

        MPI._set_abort_status(0)


# -- CPython: multiprocessing.Pool ---------------------------------------------------------------

def pool_workers(pool: Any) -> list[Any]:
    """The worker processes (``multiprocessing.Process``) a ``multiprocessing.Pool`` runs now.

    The pool starts and replaces them itself and lists them nowhere public;
    ``multiprocessing.active_children()`` would mix in the caller's other
    processes. dimd watches them for a death that loses tasks, and kills them
    when the pool's own teardown hangs.
    """
    _written_for("python")
    return list(pool._pool)
