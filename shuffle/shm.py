"""Shared memory without names: an anonymous memory file (memfd) that the rank and its decoding workers map.

A segment has no name in ``/dev/shm`` or anywhere else: it exists while some
process holds its file descriptor or a mapping of it, so however a rank ends
(SIGKILL included) the kernel frees it with the last process that used it.
The descriptor reaches a worker over a Unix socket (``SCM_RIGHTS``), see
:mod:`dimd.shuffle.workers`.
"""

from __future__ import annotations

import itertools
import mmap
import os
import tempfile

import numpy as np

_keys = itertools.count(1)


def _anonymous_file(name: str) -> int:
    """A descriptor of a new, nameless memory file (memfd; an unlinked tmpfs file where memfd is missing)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryFile(dir=folder) as f:   # O_TMPFILE or unlinked at once: never listed
        return os.dup(f.fileno())


def _map(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of ``fd`` shared, asking for huge pages (4 KiB shared-memory page faults are costly).

    The kernel grants them only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
    allows ``advise``; elsewhere the request is a no-op.
    """
    mapped = mmap.mmap(fd, size)
    try:
        mapped.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):   # no transparent huge pages in this kernel
        pass
    return mapped


class Segment:
    """``size`` bytes of shared memory as a numpy uint8 array (``array``), identified by ``key``.

    ``Segment(size)`` makes one; ``Segment.attach(fd, size, key)`` maps one
    whose descriptor was received from the process that made it.
    """

    def __init__(self, size: int, name: str = "dimd", *, fd: int | None = None, key: int | None = None) -> None:
        self.size = int(size)
        self.key = next(_keys) if key is None else key
        self.fd = _anonymous_file(name) if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, max(self.size, 1))
        self._map = _map(self.fd, max(self.size, 1))
        self.array = np.frombuffer(self._map, np.uint8, self.size)

    @classmethod
    def attach(cls, fd: int, size: int, key: int) -> "Segment":
        return cls(size, fd=fd, key=key)

    def grow(self, size: int) -> None:
        """Make room for ``size`` bytes, keeping the bytes held; a grown segment gets a new ``key``.

        The mapping is extended where it lies (``mremap``), so the pages
        already touched stay mapped: only the new tail is faulted in. Views
        of the old mapping that are still alive force a second mapping
        instead. Processes that map the segment must attach it again.
        """
        if size <= self.size:
            return
        self.array = np.empty(0, np.uint8)   # our own view would block the resize
        try:
            self._map.resize(size)             # ftruncate and mremap
        except BufferError:                    # a view of the old mapping is alive: map the file again
            os.ftruncate(self.fd, size)
            self._map = _map(self.fd, size)
        self.size, self.key = int(size), next(_keys)
        self.array = np.frombuffer(self._map, np.uint8, self.size)

    def close(self) -> None:
        """Drop the descriptor and, unless numpy views of it are still alive, the mapping."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.array = np.empty(0, np.uint8)
        try:
            self._map.close()
        except BufferError:   # views still exist; the mapping goes with the last of them
            pass

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1
