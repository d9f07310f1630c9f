"""Read each training image from its original file instead of memory: the baseline DIMD beats.

``dimd train --read-from files`` wraps the in-memory store in
:class:`OriginalFiles`: the sampler, the shuffle and the decoding stay the
same, but every record's bytes come from ``ROOT/<name>`` on each access (a
file open and read per image, as a PyTorch DataLoader over an image folder
does), where ``ROOT`` is the folder the set was packed from. This isolates
what the paper's section 5.3 measures: per-epoch time with and without the
in-memory data.

``--read-from files-cold`` drops each file's cached pages
(``posix_fadvise(POSIX_FADV_DONTNEED)``) just before reading it, so every read
goes to the disk or the file server, as on a cluster whose data set is far
larger than the page cache. Only this job's files are evicted: other users'
cached data stays, unlike ``echo 1 > /proc/sys/vm/drop_caches``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dimd.errors import DimdError
from dimd.format import PackedDataset


class OriginalFiles:
    """A :class:`~dimd.shuffle.DistributedStore` look-alike whose ``record(i)`` reads the source file."""

    def __init__(self, store: Any, root: str | os.PathLike | None = None, *, cold: bool = False) -> None:
        dataset = PackedDataset(store.path, check_size=False)
        self.root = Path(root if root is not None else dataset.source)
        if dataset.attrs.get("source_kind", "tree") == "lmdb":
            raise DimdError(f"{store.path}: packed from an LMDB, there are no original files to read")
        self.names = dataset.source_names  # file-system names: exact even where not UTF-8
        self.cold = cold and hasattr(os, "posix_fadvise")
        self._store = store
        missing = self.root / self.names[int(store.global_index[0])] if len(store) else None
        if missing is not None and not missing.is_file():
            raise DimdError(f"{missing}: original file not found (give the folder the set was packed "
                            f"from with `files_root`)")

    def __len__(self) -> int:
        return len(self._store)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def record_paths(self, indices: Any) -> list[str]:
        """The files of local records ``indices`` (what the loader's decoding workers read)."""
        return [str(self.root / self.names[int(self._store.global_index[i])]) for i in indices]

    def record(self, i: int) -> bytes:
        with open(self.root / self.names[int(self._store.global_index[i])], "rb") as f:
            if self.cold:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return f.read()
