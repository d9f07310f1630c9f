"""One run per checkpoint folder: a lock file made with O_EXCL, naming the host and process that hold it.

Two runs started without a launcher (each a one-rank job), or two jobs given
the same ``--checkpoint-dir``, would otherwise overwrite each other's
checkpoints silently. The first takes ``.dimd-train.lock`` in the folder; the
second stops with one line naming the first. A lock left by a run that died
(its process is gone from this host, or another process now has its pid) is
taken over; a lock held from another host cannot be checked from here, so the
line says which host and how to clear it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from dimd.errors import DimdError

LOCK_NAME = ".dimd-train.lock"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _alive_here(holder: dict[str, Any]) -> bool:
    """Whether the holder, on this host, still runs (the same process, not a new one with its pid)."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    started = _start_time(pid)
    return started is not None and (holder.get("started") is None or started == holder.get("started"))


class FolderLock:
    """``with FolderLock(folder):`` the folder is this run's until the block ends."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.held = False
        #: Folders this lock made (deepest first): removed again if the run leaves them empty, so a
        #: run refused at start-up leaves nothing behind.
        self.created: list[Path] = []

    def acquire(self) -> None:
        missing = [f for f in (self.folder, *self.folder.parents) if not f.exists()]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DimdError(f"{self.folder}: cannot create the checkpoint folder ({exc.strerror or exc})") from None
        self.created = missing
        for _ in range(3):   # a stale lock removed, or a racing run that just released, then again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and holder.get("retry"):
                    continue
                if holder is None or (holder.get("host") == socket.gethostname() and not _alive_here(holder)):
                    self.path.unlink(missing_ok=True)   # stale: its run is gone
                    continue
                raise DimdError(self._in_use(holder)) from None
            except OSError as exc:
                raise DimdError(f"{self.path}: cannot create the checkpoint folder's lock "
                                f"({exc.strerror or exc})") from None
            with os.fdopen(fd, "w") as f:
                json.dump(_me(), f)
            self.held = True
            return
        raise DimdError(f"{self.path}: the checkpoint folder's lock keeps changing hands; is another run "
                        f"starting there?")

    def _holder(self) -> dict[str, Any] | None:
        """The lock's contents; None when unreadable (a run killed while writing it: stale)."""
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"retry": True}   # released in between: not stale, just gone; try again
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _in_use(self, holder: dict[str, Any]) -> str:
        host, pid, since = holder.get("host", "?"), holder.get("pid", "?"), holder.get("since", "?")
        where = "this host" if host == socket.gethostname() else f"host {host}"
        advice = ("" if host == socket.gethostname() else
                  f"; if that run is gone, remove {self.path}")
        return (f"{self.folder}: checkpoint folder in use by another run (pid {pid} on {where}, since {since}): "
                f"two runs would overwrite each other's checkpoints; give this one another "
                f"`checkpoint_dir`{advice}")

    def release(self) -> None:
        if self.held:
            self.held = False
            self.path.unlink(missing_ok=True)
        for folder in self.created:   # deepest first; a folder with anything in it stays
            try:
                folder.rmdir()
            except OSError:
                break
        self.created = []

    def __enter__(self) -> "FolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_checkpoint_folder(comm: Any, folder: str | None, *, resume: bool, force: bool) -> FolderLock | None:
    """Collective: rank 0 locks ``folder`` for this run; every rank raises the same error if it cannot.

    A fresh run (not ``resume``) into a folder that holds an earlier run's
    checkpoints is refused: it would overwrite the same-named ones, and the
    rotation would then delete its own. ``force`` deletes them first.
    """
    from dimd.mpi import agree_or_raise
    from dimd.train.checkpoint import list_checkpoints

    if folder is None:
        return None
    lock, problem = None, None
    if comm.Get_rank() == 0:
        lock = FolderLock(folder)
        try:
            lock.acquire()
            earlier = list_checkpoints(folder)
            if earlier and not resume:
                if not force:
                    raise DimdError(f"{folder}: holds {len(earlier)} checkpoint(s) of an earlier run (newest "
                                    f"{earlier[-1].name}); continue that run with `resume`, give this one "
                                    f"another `checkpoint_dir`, or set `force` to delete them first")
                for path in earlier:
                    path.unlink()
        except DimdError as exc:
            lock.release()
            problem = str(exc)
    agree_or_raise(comm, problem)   # MPI: every rank stops with rank 0's reason
    return lock
