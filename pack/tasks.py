"""What a source hands the workers of ``dimd pack``, and what a worker hands back: small picklable tuples.

A source yields one task per record, per skip found while reading, and per
archive that starts; they pass through the worker pool in order, so records,
skips and progress come out in the order the source was read, for any number
of workers. The folder sources yield :class:`FileTask` (the worker reads the
file, so reading runs in parallel) or :class:`DatumTask`; the sources read
front to back (:mod:`dimd.pack.streamed`) yield :class:`BytesTask` or
:class:`RangeTask`, :class:`SkipTask` and :class:`ArchiveTask`.

A worker turns each task into an :data:`Outcome`: the record to write
(:class:`Packed`), the reason it is not packed (:class:`Skipped`), or the
:class:`ArchiveTask` itself, which marks where an archive starts.
"""

from __future__ import annotations

from typing import NamedTuple

from dimd.format import PackedRecord


class FileTask(NamedTuple):
    """A file of a folder source, read by the worker."""

    name: str
    label: int
    path: str

    @property
    def shown(self) -> str:
        return self.name


class DatumTask(NamedTuple):
    """A serialized ``caffe.Datum`` from an LMDB; its label comes from the datum."""

    name: str
    value: bytes

    @property
    def shown(self) -> str:
        return self.name


class BytesTask(NamedTuple):
    """An archive member's bytes, read by the source; ``shown`` names the member inside its archive
    (``train.tar: n01440764.tar/n01440764_10026.JPEG``) for a skip."""

    name: str
    label: int
    data: bytes
    shown: str


class RangeTask(NamedTuple):
    """Where a member of an uncompressed tar on a local disk lies: the worker reads it in place
    (``pread``), as it reads a file, so its bytes never pass through the packing process."""

    name: str
    label: int
    path: str
    offset: int
    size: int
    shown: str


class SkipTask(NamedTuple):
    """A member or an archive that is not packed, found while reading, at its place in the order."""

    shown: str
    reason: str


class ArchiveTask(NamedTuple):
    """The next archive starts (for progress)."""

    shown: str


#: An archive member as a task: its bytes, or where they lie.
MemberTask = BytesTask | RangeTask
Task = FileTask | DatumTask | BytesTask | RangeTask | SkipTask | ArchiveTask


class Packed(NamedTuple):
    """A record to write, and the bytes read to make it."""

    record: PackedRecord
    bytes_in: int


class Skipped(NamedTuple):
    """A record that is not packed: where it was, why, and the bytes read before that was known."""

    shown: str
    reason: str
    bytes_in: int = 0


#: What a worker makes of one task.
Outcome = Packed | Skipped | ArchiveTask
