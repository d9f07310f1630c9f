"""The dimd packed format, declared once: every reader and writer imports it.

A packed dataset ``OUT`` is two files:

* ``OUT.dimd``: the encoded records (JPEG), concatenated, nothing between them;
* ``OUT.idx.h5``: an HDF5 index readable without dimd, one row per record in
  data-file order (the columns of :data:`RECORD_DTYPE` plus ``name``), the
  ``classes`` names and the attributes in :data:`REQUIRED_ATTRS`.

The index is written last and renamed into place last, so a pair whose index
exists is complete; :class:`PackWriter` guarantees that.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from dimd import __version__
from dimd.errors import DimdError
from dimd.fsutil import temporary_sibling

FORMAT_NAME = "dimd-pack"
FORMAT_VERSION = 1
DATA_SUFFIX = ".dimd"
INDEX_SUFFIX = ".idx.h5"

#: One index row; each field is an HDF5 dataset of the same name.
RECORD_DTYPE = np.dtype([
    ("offset", "<u8"),   # byte offset of the record in OUT.dimd
    ("length", "<u4"),   # byte length of the record
    ("label", "<i4"),    # class index into `classes`
    ("crc32", "<u4"),    # zlib.crc32 of the record's bytes
    ("height", "<u2"),   # stored image height
    ("width", "<u2"),    # stored image width
])
RECORD_FIELDS: tuple[str, ...] = RECORD_DTYPE.names  # type: ignore[assignment]
REQUIRED_ATTRS = ("format", "version", "count", "data_bytes", "short_side", "quality",
                  "source", "dimd_version")


def dataset_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """``OUT`` (or ``OUT.dimd`` / ``OUT.idx.h5``) -> (data path, index path)."""
    text = os.fspath(out)
    for suffix in (DATA_SUFFIX, INDEX_SUFFIX):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
            break
    return Path(text + DATA_SUFFIX), Path(text + INDEX_SUFFIX)


def crc32(data: bytes | memoryview | np.ndarray) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


@dataclass(frozen=True)
class PackedRecord:
    """One encoded image and its index fields, as a writer receives it."""

    data: bytes
    label: int
    name: str
    height: int
    width: int


class PackWriter:
    """Append records to temporary files; :meth:`commit` renames them into place.

    Leaving the ``with`` block without a commit (an error, Ctrl-C) deletes the
    temporaries, so an interrupted pack leaves nothing that looks valid.
    """

    def __init__(self, out: str | os.PathLike, *, force: bool = False) -> None:
        self.data_path, self.index_path = dataset_paths(out)
        if not force:
            for path in (self.data_path, self.index_path):
                if path.exists():
                    raise DimdError(f"{path}: output exists (set `force` to overwrite it)")
        if not self.data_path.parent.is_dir():
            raise DimdError(f"{self.data_path.parent}: output folder does not exist")
        self._tmp_data = temporary_sibling(self.data_path)
        self._tmp_index = temporary_sibling(self.index_path)
        self._file = open(self._tmp_data, "wb")
        self._rows = np.zeros(1024, RECORD_DTYPE)
        self._names: list[str] = []
        self._offset = 0
        self._committed = False

    def __len__(self) -> int:
        return len(self._names)

    @property
    def data_bytes(self) -> int:
        return self._offset

    def add(self, record: PackedRecord) -> None:
        """Append one record; its offset and crc32 are computed here."""
        i = len(self._names)
        if i == len(self._rows):
            self._rows = np.resize(self._rows, 2 * len(self._rows))
        self._rows[i] = (self._offset, len(record.data), record.label, crc32(record.data),
                         record.height, record.width)
        self._names.append(record.name)
        self._file.write(record.data)
        self._offset += len(record.data)

    def commit(self, classes: Sequence[str], *, short_side: int, quality: int, source: str,
               extra_attrs: dict[str, Any] | None = None) -> None:
        """Write the index and rename both files into place (the index last)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        attrs = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "count": len(self._names),
                 "data_bytes": self._offset, "short_side": short_side, "quality": quality,
                 "source": source, "dimd_version": __version__, **(extra_attrs or {})}
        write_index(self._tmp_index, self._rows[: len(self._names)], self._names, classes, attrs)
        with contextlib.suppress(FileNotFoundError):
            self.index_path.unlink()  # an old index must never describe the new data
        os.replace(self._tmp_data, self.data_path)
        os.replace(self._tmp_index, self.index_path)
        self._committed = True

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if not self._committed:
            for tmp in (self._tmp_data, self._tmp_index):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()

    def __enter__(self) -> "PackWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_index(path: str | os.PathLike, rows: np.ndarray, names: Iterable[str],
                classes: Sequence[str], attrs: dict[str, Any]) -> None:
    """Write an index file: one dataset per field, ``name``, ``classes``, attributes."""
    import h5py

    text = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as f:
        for field in RECORD_FIELDS:
            f.create_dataset(field, data=np.ascontiguousarray(rows[field]))
        f.create_dataset("name", data=np.array(list(names), dtype=object), dtype=text)
        f.create_dataset("classes", data=np.array(list(classes), dtype=object), dtype=text)
        for key, value in attrs.items():
            f.attrs[key] = value


class PackedDataset:
    """A packed dataset opened for reading: memory-mapped data, index arrays in memory.

    >>> ds = PackedDataset("out/train")            # doctest: +SKIP
    >>> len(ds), ds.classes[ds.label(0)], ds.name(0)  # doctest: +SKIP
    >>> Image.open(io.BytesIO(ds.record(0)))         # doctest: +SKIP
    """

    def __init__(self, out: str | os.PathLike, *, check_size: bool = True) -> None:
        import h5py

        self.data_path, self.index_path = dataset_paths(out)
        if not self.index_path.exists():
            raise DimdError(f"{self.index_path}: index file not found (is this a `dimd pack` output?)")
        if not self.data_path.exists():
            raise DimdError(f"{self.data_path}: data file not found")
        try:
            with h5py.File(self.index_path, "r") as f:
                self.attrs: dict[str, Any] = {k: _plain(v) for k, v in f.attrs.items()}
                if self.attrs.get("format") != FORMAT_NAME:
                    raise DimdError(f"{self.index_path}: not a dimd index (format attribute is "
                                    f"{self.attrs.get('format')!r})")
                if int(self.attrs.get("version", -1)) > FORMAT_VERSION:
                    raise DimdError(f"{self.index_path}: format version {self.attrs['version']} is "
                                    f"newer than this dimd reads ({FORMAT_VERSION}); upgrade dimd")
                count = int(self.attrs["count"])
                rows = np.empty(count, RECORD_DTYPE)
                for field in RECORD_FIELDS:
                    column = f[field]
                    if column.shape != (count,):
                        raise DimdError(f"{self.index_path}: dataset {field!r} has {column.shape[0]} "
                                        f"rows, the count attribute says {count}")
                    rows[field] = column[...]
                self.classes: list[str] = list(f["classes"].asstr()[...])
        except OSError as exc:
            raise DimdError(f"{self.index_path}: unreadable index ({exc})") from None
        except KeyError as exc:
            raise DimdError(f"{self.index_path}: index lacks {exc}") from None
        self.records = rows
        self.data_bytes = int(self.attrs["data_bytes"])
        actual = self.data_path.stat().st_size
        if check_size:
            end = int((rows["offset"] + rows["length"]).max()) if count else 0
            if actual != self.data_bytes or end > actual:
                raise DimdError(f"{self.data_path}: data file is {actual} bytes, the index expects "
                                f"{self.data_bytes} (truncated, or not the pair of {self.index_path.name})")
        self._size = actual

    def __len__(self) -> int:
        return len(self.records)

    @cached_property
    def data(self) -> np.ndarray:
        """The whole data file as a read-only uint8 memory map (zero-copy)."""
        if self._size == 0:
            return np.zeros(0, np.uint8)
        return np.memmap(self.data_path, dtype=np.uint8, mode="r", shape=(self._size,))

    @cached_property
    def names(self) -> list[str]:
        import h5py

        with h5py.File(self.index_path, "r") as f:
            return list(f["name"].asstr()[...])

    @property
    def labels(self) -> np.ndarray:
        return self.records["label"]

    def record(self, i: int) -> memoryview:
        """The encoded bytes of record ``i``, without copying."""
        row = self.records[i]
        start = int(row["offset"])
        return memoryview(self.data[start : start + int(row["length"])])

    def label(self, i: int) -> int:
        return int(self.records["label"][i])

    def name(self, i: int) -> str:
        return self.names[i]

    def byte_range(self, start: int, stop: int) -> tuple[int, int]:
        """The contiguous byte span [begin, end) of records ``start..stop-1``."""
        if stop <= start:
            return 0, 0
        rows = self.records
        return int(rows["offset"][start]), int(rows["offset"][stop - 1] + rows["length"][stop - 1])


def _plain(value: Any) -> Any:
    """HDF5 attributes come back as numpy scalars or bytes; make them JSON-friendly."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value
