"""``dimd pack``: turn a source into a packed data set, in parallel, with the same bytes for any worker count.

Workers (a process pool) read, decode, resize and encode; results come back in
task order (``imap``), and the parent appends them to :class:`dimd.format.PackWriter`,
which renames the outputs into place only when the pack completes. The tasks in
flight are bounded (chunks of at most :data:`CHUNK_BYTES` when they carry an
archive's bytes), so memory stays flat whatever the size of the source.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generator

from dimd.errors import DimdError, describe
from dimd.format import PackedRecord, PackWriter, dataset_paths, escape_name
from dimd.pack.config import IMAGE_SIZE, PackConfig
from dimd.pack.labels import LabelBound, numbered_classes
from dimd.pack.locate import open_pack_source
from dimd.pack.process_pool import imap_watched, pool_size, worker_pool
from dimd.pack.sources import Source
from dimd.pack.streamed import StreamedSource
from dimd.pack.tasks import (ArchiveTask, BytesTask, DatumTask, FileTask, Outcome, Packed, RangeTask, Skipped,
                             SkipTask, Task)
from dimd.progress import Advance

#: Tasks that carry bytes (archive members) go to a worker in chunks of about this many bytes.
CHUNK_BYTES = 1 << 19
#: Chunks in flight per worker.
CHUNKS_PER_WORKER = 4

OnSkip = Callable[[str, str], None]
OnArchive = Callable[[str], None]
AnySource = Source | StreamedSource


@dataclass
class PackResult:
    data_path: Path
    index_path: Path
    source_kind: str
    workers: int
    images: int = 0
    classes: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process and its workers: comparable on a busy machine
    stale_removed: list[str] = field(default_factory=list)  # a dead run's temporaries, removed
    stale_foreign: list[str] = field(default_factory=list)  # another host's temporaries, left alone
    archives: int = 0  # archives read (inner tars, shards, Parquet files)
    source_info: dict = field(default_factory=dict)  # an archive source's files, sizes and record order

    @property
    def images_per_s(self) -> float:
        return (self.images + len(self.skipped)) / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict:
        return {"images": self.images, "skipped": len(self.skipped), "classes": len(self.classes),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "seconds": round(self.seconds, 3), "images_per_s": round(self.images_per_s, 1),
                "cpu_seconds": round(self.cpu_seconds, 3),
                "workers": self.workers, "source_kind": self.source_kind,
                "data_path": str(self.data_path), "index_path": str(self.index_path),
                **({"archives": self.archives, **self.source_info} if self.source_info else {}),
                "skipped_images": [{"name": n, "reason": r} for n, r in self.skipped]}


def pack(config: PackConfig, *, advance: Advance | None = None, on_skip: OnSkip | None = None,
         on_start: Callable[[AnySource], None] | None = None,
         on_archive: OnArchive | None = None) -> PackResult:
    """Pack ``config.src`` into ``config.out`` (``.dimd`` + ``.idx.h5``); see the module docstring.

    ``on_start(source)`` is called once the source is resolved (e.g. to size a
    progress bar), ``advance(n)`` after each image, ``on_skip(name, reason)``
    for each image that is not packed, ``on_archive(name)`` as each archive
    of an archive source starts.
    """
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    data_path, index_path = dataset_paths(config.out)
    # The writer first: a bad or existing OUT is refused before a long scan of SRC, not after it.
    with PackWriter(config.out, force=config.force) as writer:
        source = open_pack_source(config)
        writer.expected = source.count
        if on_start:
            on_start(source)
        workers = pool_size(config.workers, source.count)
        result = PackResult(data_path, index_path, source.kind, workers,
                            stale_removed=[str(p) for p in writer.stale.removed],
                            stale_foreign=[str(p) for p in writer.stale.foreign])

        def skip(name: str, reason: str) -> None:
            name = escape_name(name)
            result.skipped.append((name, reason))
            if on_skip:
                on_skip(name, reason)
            if config.strict:
                raise DimdError(f"{name}: {reason} (`strict` stops at the first bad image)")

        for name, reason in source.rejected:
            skip(name, reason)
        with contextlib.closing(_processed(source, config, workers)) as outcomes:
            for outcome in outcomes:
                if isinstance(outcome, ArchiveTask):
                    result.archives += 1
                    if on_archive:
                        on_archive(outcome.shown)
                    continue
                result.bytes_in += outcome.bytes_in
                if isinstance(outcome, Skipped):
                    skip(outcome.shown, outcome.reason)
                else:
                    writer.add(outcome.record)
                if advance:
                    advance(1)
        if len(writer) == 0:
            counted = f" {source.count}" if source.count is not None else ""
            raise DimdError(f"{config.shown_src}: none of its{counted} images could be packed")
        if isinstance(source, StreamedSource):
            classes = source.finish(writer)
            result.source_info = source.summary()
        else:
            classes = source.classes if source.classes is not None else numbered_classes(
                writer.labels, str(config.src), lambda i: escape_name(writer.name(i)))
        writer.commit(classes, short_side=config.short_side, quality=config.quality,
                      source=config.shown_src,
                      extra_attrs={"source_kind": source.kind, "skipped": len(result.skipped)})
        result.images, result.bytes_out, result.classes = len(writer), writer.data_bytes, list(classes)
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = _cpu_seconds() - cpu_start
    return result


def _cpu_seconds() -> float:
    """CPU time of this process plus its finished children (the pool's workers, once joined)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _processed(source: AnySource, config: PackConfig, workers: int) -> Generator[Outcome, None, None]:
    """Results in task order, from this process or from a pool of ``workers``."""
    bound = source.label_bound
    settings = (config.short_side, config.quality, bound.limit, bound.named)
    if workers == 1:
        _init_worker(*settings)
        try:
            yield from map(process_task, source.tasks())
        finally:
            _close_archives()
        return
    _preload_imaging()  # once here, not once per forked worker
    with worker_pool(workers, _init_pool_worker, settings) as pool:
        yield from imap_watched(pool, process_task, source.tasks(), config.chunksize,
                                doing=f"packing {escape_name(config.shown_src)}",
                                window=workers * CHUNKS_PER_WORKER, chunk_bytes=CHUNK_BYTES, size_of=_task_bytes)


def _task_bytes(task: Task) -> int:
    return len(task.data) if isinstance(task, BytesTask) else 0


def _preload_imaging() -> None:
    from PIL import Image

    import dimd.pack.imaging
    import dimd.pack.lmdb_source  # noqa: F401

    Image.preinit()  # JPEG, PNG and the other common plugins, so workers do not each import them


_SETTINGS: tuple[int, int, LabelBound] = (256, 90, LabelBound.for_classes(None))


def _init_worker(short_side: int, quality: int, label_limit: int, named: bool) -> None:
    global _SETTINGS
    _SETTINGS = (short_side, quality, LabelBound(label_limit, named))


def _init_pool_worker(*settings) -> None:
    """Ctrl-C and SIGTERM are the parent's to handle: it stops the pool and removes the partial outputs."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Pool.terminate() must end a worker at once
    _init_worker(*settings)


def process_task(task: Task) -> Outcome:
    """One task -> the record to write, or why it is skipped; an :class:`ArchiveTask` comes back as it is.

    Whatever goes wrong with one record (including an error no one foresaw)
    skips that record and names the reason; it never ends the pack.
    """
    from dimd.pack.imaging import ImageSkipped, resize_encoded

    if isinstance(task, ArchiveTask):
        return task
    if isinstance(task, SkipTask):
        return Skipped(task.shown, task.reason)
    short_side, quality, bound = _SETTINGS
    size_in = 0
    try:
        if isinstance(task, DatumTask):   # a Caffe Datum: its label and its pixels or encoded image
            from dimd.pack.lmdb_source import datum_image

            size_in = len(task.value)
            label, image = datum_image(task.value, short_side, quality)
            problem = bound.problem(label)
            if problem:
                raise ImageSkipped(problem)
        else:
            data = _read(task)
            size_in, label = len(data), task.label
            image = resize_encoded(data, short_side, quality)
    except ImageSkipped as exc:
        return Skipped(task.shown, str(exc), size_in)
    except Exception as exc:  # one record's failure, named; the pack goes on
        return Skipped(task.shown, f"failed ({type(exc).__name__}: {exc})", size_in)
    return Packed(PackedRecord(image.data, label, task.name, image.height, image.width), size_in)


def _read(task: FileTask | BytesTask | RangeTask) -> bytes:
    """The encoded image a task names: a file's bytes, the bytes it carries, or a member's, read in place."""
    if isinstance(task, FileTask):
        return read_image_file(task.path)
    if isinstance(task, BytesTask):
        return task.data
    return read_in_place(task.path, task.offset, task.size)


#: A worker's open archives (path -> descriptor), the most recently used last; at most a few stay open.
_ARCHIVES: collections.OrderedDict[str, int] = collections.OrderedDict()
OPEN_ARCHIVES = 4


def read_in_place(path: str, offset: int, size: int) -> bytes:
    """An archive member's bytes, read where they lie (the archive stays open for the next member)."""
    from dimd.pack.imaging import ImageSkipped
    from dimd.pack.tar_stream import TRUNCATED

    fd = _ARCHIVES.pop(path, None)
    try:
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            while len(_ARCHIVES) >= OPEN_ARCHIVES:
                os.close(_ARCHIVES.popitem(last=False)[1])
        _ARCHIVES[path] = fd
        data = os.pread(fd, size, offset)
    except OSError as exc:
        raise ImageSkipped(f"cannot read ({describe(exc)})") from None
    if len(data) != size:  # the archive was cut since it was read
        raise ImageSkipped(TRUNCATED)
    return data


def _close_archives() -> None:
    while _ARCHIVES:
        os.close(_ARCHIVES.popitem()[1])


def read_image_file(path: str) -> bytes:
    """The bytes of a regular file of at most :data:`~dimd.pack.config.IMAGE_SIZE`; :class:`ImageSkipped`
    otherwise.

    Opened without blocking, so a FIFO named ``x.jpg`` never hangs the pack,
    and checked with ``fstat`` on the open file (what was listed may have been
    replaced since).
    """
    import stat

    from dimd.pack.imaging import ImageSkipped

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise ImageSkipped(f"cannot read ({describe(exc)})") from None
    with open(fd, "rb", closefd=True) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageSkipped("not a regular file")
        too_large = IMAGE_SIZE.problem(st.st_size)
        if too_large:
            raise ImageSkipped(too_large)
        try:
            return f.read()  # sized from fstat; read(MAX + 1) would allocate 1 GiB per image first
        except OSError as exc:
            raise ImageSkipped(f"cannot read ({describe(exc)})") from None
