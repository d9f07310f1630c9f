"""Output files: checked before the work, written so that a crash never leaves one that looks complete.

* :func:`output_problem` checks an output location before a command starts
  (the folder exists, or can be created; it is a folder; it is writable; the
  target is not a folder), so a typo costs a second, not a whole run.
* :func:`temporary_sibling` names the hidden temporary a writer fills before
  renaming it into place; the name holds the host and PID of the writer, so
  :func:`remove_stale_temporaries` can tell a dead run's leftovers from a live
  run's files (see docs/policies.md).
* :func:`disk_errors` turns a full disk or an exceeded quota into one line
  naming the file system, its free space and the bytes still needed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal

from dimd.errors import DimdError, describe

OutputKind = Literal["file", "folder"]


# ---------------------------------------------------------------------------- output locations
def output_problem(path: str | os.PathLike, *, kind: OutputKind = "file", create: bool = False,
                   what: str = "") -> str | None:
    """Why ``path`` cannot be written as a ``kind``, or None; nothing is created.

    ``create``: missing parent folders (or, for a folder, the folder itself)
    will be created by the writer (``mkdir -p``), so only the nearest existing
    ancestor must be a writable folder. Without it the parent must exist.
    ``what`` (e.g. ``"--json"``) starts the message, before the path.
    """
    target = Path(path)
    where = f"{what} {target}" if what else str(target)
    if target.is_dir():
        if kind == "file":
            return f"{where}: is a folder, expected a file name"
        return _unwritable(target, where)
    if kind == "folder" and (target.exists() or target.is_symlink()):
        return f"{where}: exists and is not a folder"
    parent = target.parent
    if not create:
        if not parent.exists():
            return f"{where}: folder {parent} does not exist"
        if not parent.is_dir():
            return f"{where}: {parent} is not a folder"
        return _unwritable(parent, where)
    ancestor = target if kind == "folder" else parent
    while not ancestor.exists() and not ancestor.is_symlink() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{where}: cannot create folders under {ancestor}, which is not a folder"
    return _unwritable(ancestor, where)


def _unwritable(folder: Path, where: str) -> str | None:
    """A real write test (root ignores permission bits; a read-only mount does not)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".dimd-probe-", dir=folder)
    except OSError as exc:
        return f"{where}: cannot write in folder {folder} ({describe(exc)})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def check_output(path: str | os.PathLike, *, kind: OutputKind = "file", create: bool = False,
                 what: str = "") -> None:
    """:func:`output_problem` as a :class:`DimdError`."""
    problem = output_problem(path, kind=kind, create=create, what=what)
    if problem:
        raise DimdError(problem)


def make_folders(folder: str | os.PathLike, what: str = "") -> Path:
    """``mkdir -p folder``, failing in one line."""
    target = Path(folder)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DimdError(f"{(what + ' ') if what else ''}{target}: cannot create folder "
                        f"({describe(exc)})") from None
    return target


# ---------------------------------------------------------------------------- temporaries
HOST_TAG = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def temporary_sibling(path: Path) -> Path:
    """A hidden name beside ``path`` that no reader mistakes for the real file: ``.NAME.tmp-HOST-PID``."""
    return path.with_name(f".{path.name}.tmp-{HOST_TAG}-{os.getpid()}")


@dataclass(frozen=True)
class StaleTemporaries:
    """What :func:`remove_stale_temporaries` did: removed (their writer is gone) and left alone."""

    removed: tuple[Path, ...] = ()
    foreign: tuple[Path, ...] = ()  # written on another host: their writer cannot be checked from here


def remove_stale_temporaries(*paths: str | os.PathLike) -> StaleTemporaries:
    """Delete the temporaries of ``paths`` (files of one folder) whose writer (a process on this host)
    no longer runs; the folder is listed once.

    A SIGKILLed or crashed writer leaves ``.NAME.tmp-HOST-PID``; the next
    writer of the same path removes it. A temporary of a live process, or
    of another host (a shared file system), is never touched: it may be a
    pack running now.
    """
    targets = [Path(p) for p in paths]
    prefixes = tuple(f".{t.name}.tmp-" for t in targets)
    removed, foreign = [], []
    try:
        entries = [e for e in os.scandir(targets[0].parent) if e.name.startswith(prefixes)]
    except OSError:
        return StaleTemporaries()
    for entry in entries:
        prefix = next(p for p in prefixes if entry.name.startswith(p))
        host, _, pid_text = entry.name[len(prefix):].rpartition("-")  # HOST-PID (or PID: older dimd)
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if host not in ("", HOST_TAG):
            foreign.append(Path(entry.path))
        elif pid != os.getpid() and not _process_exists(pid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return StaleTemporaries(tuple(removed), tuple(foreign))


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path; rename it onto ``path`` only if the block succeeds."""
    target = Path(path)
    remove_stale_temporaries(target)
    tmp = temporary_sibling(target)
    try:
        with disk_errors(target):
            yield tmp
            os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8", errors="surrogateescape")


# ---------------------------------------------------------------------------- full disks
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
         errno.EFBIG: "file too large (a limit of the file system, or of `ulimit -f`)"}


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _FULL


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike, needed: Callable[[], int | None] | None = None,
                written: Callable[[], int] | None = None) -> Iterator[None]:
    """Turn a full disk (or quota, or file size limit) while writing ``path`` into one clear line.

    ``needed()`` estimates the bytes the whole output needs (None: unknown);
    ``written()`` is what the caller wrote so far and will remove, so free
    again. Other errors pass through; the caller's cleanup runs either way.
    """
    try:
        yield
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise DimdError(disk_full_message(path, exc, needed() if needed else None,
                                          written() if written else 0)) from None


def disk_full_message(path: str | os.PathLike, exc: OSError, needed: int | None, written: int = 0) -> str:
    from dimd.units import format_bytes

    target = Path(path)
    mount = mount_point(target.parent)
    try:
        stats = os.statvfs(target.parent)
        free = f"{format_bytes(stats.f_bavail * stats.f_frsize + written)} free of " \
               f"{format_bytes(stats.f_blocks * stats.f_frsize)}"
    except OSError:
        free = "free space unknown"
    need = f", the output needs about {format_bytes(needed)}" if needed else ""
    return (f"{target}: {_FULL.get(exc.errno or 0) or exc.strerror} on the file system at {mount} "
            f"({free}{need}); nothing of this write was kept")


def mount_point(path: str | os.PathLike) -> Path:
    """The mount point of the file system holding ``path`` (or its nearest existing ancestor)."""
    current = Path(os.path.abspath(path))
    while not current.exists() and current != current.parent:
        current = current.parent
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return current
