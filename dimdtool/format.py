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
import re
import zlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import dimd
from dimd.errors import DimdError
from dimd.fsutil import (check_output, disk_errors, make_folders,
                         remove_stale_temporaries, temporary_sibling)

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
#: Optional dataset: the record indices (uint64) whose ``name`` is escaped (see :func:`escape_name`).
ESCAPED_NAMES = "escaped_names"


def dataset_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """``OUT`` (or ``OUT.dimd`` / ``OUT.idx.h5``) -> (data path, index path)."""
    text = os.fspath(out)
    for suffix in (DATA_SUFFIX, INDEX_SUFFIX):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
            break
    return Path(text + DATA_SUFFIX), Path(text + INDEX_SUFFIX)


def crc32(data: bytes | memoryview | np.ndarray) -> int:
    return zlib.crc32(data.data if isinstance(data, np.ndarray) else data) & 0xFFFFFFFF


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

    The output location is checked and its folders created (``mkdir -p``)
    when the writer opens, before any work; temporaries a dead writer left for
    the same output are removed then (:func:`dimd.fsutil.remove_stale_temporaries`,
    listed in :attr:`stale`). Leaving the ``with`` block without a commit (an
    error, Ctrl-C, SIGTERM, a full disk) deletes the temporaries, so an
    interrupted pack leaves nothing that looks valid, and nothing at all.
    ``expected`` (records the caller will add, set once it knows) sizes the
    estimate a full-disk message gives.
    """

    def __init__(self, out: str | os.PathLike, *, force: bool = False) -> None:
        self.data_path, self.index_path = dataset_paths(out)
        stem = os.fspath(self.data_path)[: -len(DATA_SUFFIX)]
        if Path(stem or ".").name in ("", ".", "..") or stem.endswith(os.sep):  # "-o ." wrote ..dimd
            raise DimdError(f"output {out}: names a folder, not the stem of OUT{DATA_SUFFIX} and "
                            f"OUT{INDEX_SUFFIX}; give one such as {Path(stem or '.', 'train')}")
        for path in (self.data_path, self.index_path):
            check_output(path, kind="file", create=True, what="output")
            if not force and path.exists():
                raise DimdError(f"{path}: output exists (set `force` to overwrite it)")
        make_folders(self.data_path.parent, "output")
        self.stale = remove_stale_temporaries(self.data_path, self.index_path)
        self.expected: int | None = None
        self._tmp_data = temporary_sibling(self.data_path)
        self._tmp_index = temporary_sibling(self.index_path)
        self._committed = False
        with self._disk_errors(self._tmp_data):
            self._file = open(self._tmp_data, "wb")
        self._rows = np.zeros(1024, RECORD_DTYPE)
        self._names: list[str] = []
        self._offset = 0

    def __len__(self) -> int:
        return len(self._names)

    @property
    def data_bytes(self) -> int:
        return self._offset

    def needed_bytes(self) -> int | None:
        """Estimated bytes of the finished pair, from the records so far and ``expected``."""
        if not self._names or not self.expected:
            return None
        per_record = self._offset / len(self._names) + 64  # the index row and name, roughly
        return int(per_record * max(self.expected, len(self._names)))

    def _disk_errors(self, path: Path):
        return disk_errors(path, self.needed_bytes, lambda: self._offset)

    def add(self, record: PackedRecord) -> None:
        """Append one record; its offset and crc32 are computed here."""
        i = len(self._names)
        if i == len(self._rows):
            self._rows = np.resize(self._rows, 2 * len(self._rows))
        try:
            self._file.write(record.data)
        except OSError:
            with self._disk_errors(self.data_path):  # a full disk becomes one line; others pass
                raise
        self._rows[i] = (self._offset, len(record.data), record.label, crc32(record.data),
                         record.height, record.width)
        self._names.append(record.name)
        self._offset += len(record.data)

    @property
    def labels(self) -> np.ndarray:
        """The labels added so far (a view)."""
        return self._rows["label"][: len(self._names)]

    def name(self, i: int) -> str:
        """Record ``i``'s name as added (a file-system string)."""
        return self._names[i]

    def reorder(self, order: np.ndarray) -> None:
        """Put the records added so far in ``order``: record ``order[i]`` becomes record ``i``.

        For a source whose records arrive in another order than the one they are
        stored in (an archive read front to back whose members are not sorted).
        The data file is copied once, record by record, into the index's
        temporary (unused until :meth:`commit`, and removed with the writer's
        other temporaries on every way out), which then replaces it.
        """
        count = len(self._names)
        order = np.asarray(order, np.int64)
        if order.shape != (count,) or not np.array_equal(np.sort(order), np.arange(count)):
            raise ValueError(f"order must be a permutation of the {count} records")
        if np.array_equal(order, np.arange(count)):
            return
        rows = self._rows[:count][order]
        with self._disk_errors(self.data_path):
            self._file.flush()
            with open(self._tmp_data, "rb") as old, open(self._tmp_index, "wb", buffering=1 << 22) as new:
                for offset, length in zip(rows["offset"].tolist(), rows["length"].tolist()):
                    new.write(os.pread(old.fileno(), length, offset))
            self._file.close()
            os.replace(self._tmp_index, self._tmp_data)
            self._file = open(self._tmp_data, "ab")
        rows["offset"] = np.concatenate(([0], np.cumsum(rows["length"], dtype=np.uint64)[:-1]))
        self._rows[:count] = rows
        self._names = [self._names[i] for i in order.tolist()]

    def commit(self, classes: Sequence[str], *, short_side: int, quality: int, source: str,
               extra_attrs: dict[str, Any] | None = None) -> None:
        """Write the index and rename both files into place (the index last)."""
        with self._disk_errors(self.data_path):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        attrs = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "count": len(self._names),
                 "data_bytes": self._offset, "short_side": short_side, "quality": quality,
                 "source": escape_name(source), "dimd_version": dimd.__version__, **(extra_attrs or {})}
        if attrs["source"] != source:
            attrs["source_escaped"] = True  # not UTF-8: PackedDataset.source restores the original
        rows = self._rows[: len(self._names)]
        check_records(rows, len(classes), self._offset, str(self.index_path))
        with self._disk_errors(self.index_path):
            write_index(self._tmp_index, rows, self._names, classes, attrs)
        with contextlib.suppress(FileNotFoundError):
            self.index_path.unlink()  # an old index must never describe the new data
        os.replace(self._tmp_data, self.data_path)
        os.replace(self._tmp_index, self.index_path)
        self._committed = True

    def close(self) -> None:
        """Close the data file and, without a commit, remove both temporaries whatever happens."""
        try:
            if not self._file.closed:
                with contextlib.suppress(OSError):  # a full disk fails the flush again: the file goes anyway
                    self._file.close()
        finally:
            if not self._committed:
                for tmp in (self._tmp_data, self._tmp_index):
                    with contextlib.suppress(FileNotFoundError):
                        tmp.unlink()

    def __enter__(self) -> "PackWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- names
def escape_name(name: str | bytes) -> str:
    """A file name or key as the index stores it: valid UTF-8, and reversible.

    A name that is valid UTF-8 is stored unchanged. One that is not (a file
    name's raw bytes, which Python holds as surrogate escapes, or an LMDB
    key's bytes), or that holds a NUL, is stored with each undecodable byte and
    NUL as ``\\xNN`` and each backslash doubled; :func:`write_index` lists such records in
    ``escaped_names`` so :func:`unescape_name` can restore the exact bytes.
    """
    raw = name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape")
    try:
        text = raw.decode("utf-8")
        if "\0" not in text:  # HDF5 strings end at a NUL byte
            return text
    except UnicodeDecodeError:
        pass
    escaped = raw.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")
    return escaped.replace("\0", "\\x00")


_ESCAPE = re.compile(r"\\(\\|x[0-9a-f]{2})")


def unescape_name(stored: str) -> str:
    """The inverse of :func:`escape_name` for an escaped name: the original, as a file-system str."""
    def byte(match: re.Match) -> str:
        if match.group(1) == "\\":
            return "\\"
        value = int(match.group(1)[1:], 16)
        return chr(0xDC00 + value) if value >= 0x80 else chr(value)  # surrogate escape, as os.fsdecode

    raw = _ESCAPE.sub(byte, stored)
    return raw.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")


def stored_names(names: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """``names`` as the index stores them, and the indices of those that had to be escaped.

    The common case (every name valid UTF-8) costs one join and one encode, in C.
    """
    try:
        joined = "\n".join(names)
        joined.encode("utf-8")
        if "\0" not in joined:
            return list(names), np.zeros(0, np.uint64)
    except UnicodeEncodeError:
        pass
    out, escaped = list(names), []
    for i, name in enumerate(names):
        stored = escape_name(name)
        if stored != name:  # only names that were not valid UTF-8 (or held a NUL) change
            out[i] = stored
            escaped.append(i)
    return out, np.array(escaped, np.uint64)


def write_index(path: str | os.PathLike, rows: np.ndarray, names: Sequence[str],
                classes: Sequence[str], attrs: dict[str, Any]) -> None:
    """Write an index file: one dataset per field, ``name``, ``classes``, attributes.

    Names that are not valid UTF-8 are escaped (:func:`escape_name`) and their
    record indices listed in the ``escaped_names`` dataset (only when there are any).
    The file is built in memory and written with one plain write: HDF5 writing
    to a full disk itself reports the failure only as it closes, in many raw
    lines, and may crash; a plain write raises one ``OSError``.
    """
    import h5py

    text = h5py.string_dtype("utf-8")
    stored, escaped = stored_names(names)
    with h5py.File(f"{os.fspath(path)}.in-memory", "w", driver="core", backing_store=False) as f:
        for field in RECORD_FIELDS:
            f.create_dataset(field, data=np.ascontiguousarray(rows[field]))
        f.create_dataset("name", data=np.array(stored, dtype=object), dtype=text)
        if len(escaped):
            f.create_dataset(ESCAPED_NAMES, data=escaped)
        f.create_dataset("classes", data=np.array([escape_name(c) for c in classes], dtype=object),
                         dtype=text)
        for key, value in attrs.items():
            f.attrs[key] = value
        f.flush()
        image = f.id.get_file_image()
    with open(path, "wb") as out:
        out.write(image)
        out.flush()
        os.fsync(out.fileno())


# ---------------------------------------------------------------------------- the contract, checked
@dataclass(frozen=True)
class IndexContents:
    """What :func:`read_index` found, every part of it checked."""

    attrs: dict[str, Any]
    records: np.ndarray
    classes: list[str]
    escaped: np.ndarray  # record indices whose stored name is escaped


#: Largest ``count`` an index may declare (the offsets are uint64, but 2^40 records is beyond any data set).
MAX_RECORDS = 1 << 40


def read_index(index_path: str | os.PathLike) -> IndexContents:
    """Read an index and check it against the format contract, or raise one clear :class:`DimdError`.

    Checked before anything is allocated: the attributes are present with
    sane values, every dataset is present, one-dimensional, of the declared
    dtype and ``count`` rows long. Then, over the whole arrays at once
    (:func:`check_records`): records lie inside ``data_bytes``, in data-file
    order, without overlapping, and every label names a class; class names
    are unique. Every reader (:class:`PackedDataset`) goes through here.
    """
    import h5py

    path = Path(index_path)
    where = str(path)
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            count, data_bytes = _check_attrs(attrs, where)
            for field in RECORD_FIELDS:
                _check_dataset(f, field, count, where, dtype=RECORD_DTYPE[field])
            _check_dataset(f, "name", count, where, text=True)
            _check_dataset(f, "classes", None, where, text=True)
            rows = np.empty(count, RECORD_DTYPE)
            for field in RECORD_FIELDS:
                rows[field] = f[field][...]
            classes = list(f["classes"].asstr()[...])
            escaped = np.zeros(0, np.uint64)
            if ESCAPED_NAMES in f:
                _check_dataset(f, ESCAPED_NAMES, None, where, dtype=np.dtype(np.uint64))
                escaped = f[ESCAPED_NAMES][...]
                if len(escaped) and int(escaped.max()) >= count:
                    raise DimdError(f"{where}: {ESCAPED_NAMES} names record {int(escaped.max())}, "
                                    f"but there are only {count} records")
    except OSError as exc:
        raise DimdError(f"{where}: unreadable index ({exc})") from None
    except UnicodeDecodeError as exc:
        raise DimdError(f"{where}: unreadable index (a name is not UTF-8: {exc})") from None
    check_records(rows, len(classes), data_bytes, where)
    _check_classes(classes, where)
    return IndexContents(attrs, rows, classes, escaped)


def _check_attrs(attrs: dict[str, Any], where: str) -> tuple[int, int]:
    if attrs.get("format") != FORMAT_NAME:
        raise DimdError(f"{where}: not a dimd index (format attribute is {attrs.get('format')!r})")
    missing = [name for name in REQUIRED_ATTRS if name not in attrs]
    if missing:
        raise DimdError(f"{where}: index lacks the attribute{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(missing)}")
    version = _integer(attrs, "version", where, 0, 1 << 31)
    if version > FORMAT_VERSION:
        raise DimdError(f"{where}: format version {version} is newer than this dimd reads "
                        f"({FORMAT_VERSION}); upgrade dimd")
    count = _integer(attrs, "count", where, 0, MAX_RECORDS)
    data_bytes = _integer(attrs, "data_bytes", where, 0, (1 << 63) - 1)
    return count, data_bytes


def _integer(attrs: dict[str, Any], name: str, where: str, low: int, high: int) -> int:
    value = attrs[name]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DimdError(f"{where}: attribute {name} is {value!r}, not an integer")
    if not low <= int(value) <= high:
        raise DimdError(f"{where}: attribute {name} is {int(value)}, outside {low}..{high}")
    return int(value)


def _check_dataset(f: Any, name: str, count: int | None, where: str, *,
                   dtype: np.dtype | None = None, text: bool = False) -> None:
    import h5py

    if name not in f:
        raise DimdError(f"{where}: index lacks the {name!r} dataset")
    ds = f[name]
    if not isinstance(ds, h5py.Dataset) or len(ds.shape) != 1:
        raise DimdError(f"{where}: {name!r} is not a one-dimensional dataset")
    if text and h5py.check_string_dtype(ds.dtype) is None:
        raise DimdError(f"{where}: dataset {name!r} holds {ds.dtype}, not strings")
    if dtype is not None and ds.dtype != dtype:
        raise DimdError(f"{where}: dataset {name!r} holds {ds.dtype}, the format declares {dtype}")
    if count is not None and ds.shape[0] != count:
        raise DimdError(f"{where}: dataset {name!r} has {ds.shape[0]} rows, the count attribute "
                        f"says {count}")


def check_records(rows: np.ndarray, classes: int, data_bytes: int, where: str) -> None:
    """Records inside ``data_bytes``, in order, not overlapping; labels in ``0..classes-1``.

    Vectorised over the whole index; the message names the first bad record
    and how many there are.
    """
    if not len(rows):
        return
    offset = rows["offset"]
    length = rows["length"].astype(np.uint64)
    past = (offset > np.uint64(data_bytes)) | (length > np.uint64(data_bytes) - np.minimum(
        offset, np.uint64(data_bytes)))
    _refuse(past, where, lambda i: f"record {i} (bytes {int(offset[i])}..{int(offset[i]) + int(length[i])}) "
            f"ends past the data_bytes {data_bytes} the index declares")
    ends = offset + length
    _refuse(np.concatenate([[False], offset[1:] < ends[:-1]]), where,
            lambda i: f"record {i} starts at byte {int(offset[i])}, before record {i - 1} ends "
                      f"(byte {int(ends[i - 1])}): records overlap or are out of data-file order")
    label = rows["label"]
    _refuse((label < 0) | (label >= classes), where,
            lambda i: f"record {i} has label {int(label[i])}, outside the {classes} classes "
                      f"(0..{classes - 1})")


def _refuse(bad: np.ndarray, where: str, describe: Any) -> None:
    found = np.flatnonzero(bad)
    if len(found):
        more = f" (and {len(found) - 1} more record{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
        raise DimdError(f"{where}: {describe(int(found[0]))}{more}")


def _check_classes(classes: list[str], where: str) -> None:
    if len(set(classes)) != len(classes):
        first: dict[str, int] = {}
        for label, name in enumerate(classes):
            if name in first:
                raise DimdError(f"{where}: class name {name!r} is used for labels {first[name]} and {label}")
            first[name] = label


class PackedDataset:
    """A packed dataset opened for reading: memory-mapped data, index arrays in memory.

    Opening it checks the index against the format contract (:func:`read_index`)
    and, with ``check_size``, that the data file is as long as the index says.

    >>> ds = PackedDataset("out/train")            # doctest: +SKIP
    >>> len(ds), ds.classes[ds.label(0)], ds.name(0)  # doctest: +SKIP
    >>> Image.open(io.BytesIO(ds.record(0)))         # doctest: +SKIP
    """

    def __init__(self, out: str | os.PathLike, *, check_size: bool = True) -> None:
        self.data_path, self.index_path = dataset_paths(out)
        if not self.index_path.exists():
            raise DimdError(f"{self.index_path}: index file not found (is this a `dimd pack` output?)")
        if not self.data_path.exists():
            raise DimdError(f"{self.data_path}: data file not found")
        if not self.data_path.is_file():
            raise DimdError(f"{self.data_path}: not a regular file")
        contents = read_index(self.index_path)
        self.attrs: dict[str, Any] = contents.attrs
        self.records = contents.records
        self.classes: list[str] = contents.classes
        self.escaped = contents.escaped
        self.data_bytes = int(self.attrs["data_bytes"])
        actual = self.data_path.stat().st_size
        if check_size and actual != self.data_bytes:
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
        """Record names as stored (escaped where the original was not UTF-8): for display."""
        import h5py

        try:
            with h5py.File(self.index_path, "r") as f:
                return list(f["name"].asstr()[...])
        except (OSError, KeyError, UnicodeDecodeError) as exc:
            raise DimdError(f"{self.index_path}: cannot read the record names ({exc})") from None

    @cached_property
    def source_names(self) -> list[str]:
        """Record names as the source had them (file-system strings): for opening the original files."""
        names = list(self.names)
        for i in self.escaped.tolist():
            names[i] = unescape_name(names[i])
        return names

    @property
    def source(self) -> str:
        """What the set was packed from (the ``source`` attribute), as a file-system string."""
        source = str(self.attrs.get("source", ""))
        return unescape_name(source) if self.attrs.get("source_escaped") else source

    @property
    def labels(self) -> np.ndarray:
        return self.records["label"]

    def record(self, i: int) -> memoryview:
        """The encoded bytes of record ``i``, without copying."""
        row = self.records[i]
        start = int(row["offset"])
        return self.data[start : start + int(row["length"])].data

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
