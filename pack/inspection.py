"""``dimd inspect`` and ``dimd verify``: what a packed data set holds, and whether every record is sound."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
import numpy as np

from dimd.format import PackedDataset, crc32
from dimd.pack.process_pool import imap_watched, pool_size, worker_pool
from dimd.progress import Advance


def describe(out: str | os.PathLike) -> dict:
    """Count, classes (with record counts), bytes, image-size statistics and the index attributes.

    Opening the data set checks that the data file's size matches the index.
    """
    ds = PackedDataset(out)
    rows = ds.records
    per_class = np.bincount(rows["label"], minlength=len(ds.classes)) if len(ds) else np.zeros(
        len(ds.classes), np.int64)
    lengths = rows["length"].astype(np.int64)
    heights = rows["height"].astype(np.int64)
    widths = rows["width"].astype(np.int64)
    return {
        "dataset": str(ds.data_path.with_suffix("")),
        "data_path": str(ds.data_path), "index_path": str(ds.index_path),
        "count": len(ds),
        "classes": len(ds.classes),
        "class_counts": {name: int(n) for name, n in zip(ds.classes, per_class)},
        "data_bytes": ds.data_bytes,
        "index_bytes": ds.index_path.stat().st_size,
        "record_bytes": _stats(lengths),
        "height": _stats(heights),
        "width": _stats(widths),
        "short_side": _stats(np.minimum(heights, widths)),
        "attributes": ds.attrs,
    }


def _stats(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"min": 0, "mean": 0.0, "median": 0.0, "max": 0}
    return {"min": int(values.min()), "mean": round(float(values.mean()), 2),
            "median": float(np.median(values)), "max": int(values.max())}


@dataclass
class VerifyResult:
    count: int
    bad: list[tuple[int, str, str]] = field(default_factory=list)  # (index, name, problem)
    file_problem: str = ""  # e.g. the data file's size does not match the index
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.bad and not self.file_problem

    def figures(self) -> dict:
        """The ``--json`` figures (the CLI wraps them in the standard envelope)."""
        return {"count": self.count, "bad": len(self.bad), "ok": self.ok, "seconds": round(self.seconds, 3),
                "file_problem": self.file_problem,
                "bad_records": [{"index": i, "name": n, "problem": p} for i, n, p in self.bad]}


def verify(out: str | os.PathLike, *, workers: int = 1, decode: bool = True,
           advance: Advance | None = None) -> VerifyResult:
    """Check every record's crc32 and (with ``decode``) that it decodes to the indexed size.

    A truncated data file is not refused up front: the records it cut are named.
    """
    began = time.perf_counter()
    ds = PackedDataset(out, check_size=False)
    size = ds.data_path.stat().st_size
    file_problem = (f"{ds.data_path}: data file is {size} bytes, the index expects {ds.data_bytes}"
                    if size != ds.data_bytes else "")
    count = len(ds)
    step = 64
    spans = [(start, min(start + step, count)) for start in range(0, count, step)]
    problems: list[tuple[int, str]] = []
    workers = pool_size(workers, len(spans))
    if workers <= 1:
        for start, stop in spans:
            problems.extend(check_records(ds, start, stop, decode))
            if advance:
                advance(stop - start)
    else:
        with worker_pool(workers, _open_in_worker, (str(ds.data_path),)) as pool:
            args = [(start, stop, decode) for start, stop in spans]
            for (start, stop), found in zip(spans, imap_watched(pool, _check_in_worker, args,
                                                                  doing=f"verifying {ds.data_path}")):
                problems.extend(found)
                if advance:
                    advance(stop - start)
    names = ds.names if problems else []
    return VerifyResult(count, [(i, names[i], problem) for i, problem in problems], file_problem,
                        seconds=time.perf_counter() - began)


def check_records(ds: PackedDataset, start: int, stop: int, decode: bool = True) -> list[tuple[int, str]]:
    """Problems of records ``start..stop-1``: (index, what is wrong)."""
    rows = ds.records
    end_of_file = len(ds.data)
    found = []
    for i in range(start, stop):
        if int(rows["offset"][i]) + int(rows["length"][i]) > end_of_file:
            found.append((i, "extends past the end of the data file (truncated)"))
            continue
        data = ds.record(i)
        if crc32(data) != int(rows["crc32"][i]):
            found.append((i, "crc32 mismatch"))
            continue
        if decode:
            problem = _decode_problem(bytes(data), int(rows["height"][i]), int(rows["width"][i]))
            if problem:
                found.append((i, problem))
    return found


_WORKER_DATASET: PackedDataset | None = None


def _open_in_worker(path: str) -> None:
    global _WORKER_DATASET
    _WORKER_DATASET = PackedDataset(path, check_size=False)


def _check_in_worker(arg: tuple) -> list[tuple[int, str]]:
    assert _WORKER_DATASET is not None
    return check_records(_WORKER_DATASET, *arg)


def _decode_problem(data: bytes, height: int, width: int) -> str:
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            size = image.size
    except Exception as exc:  # any failure to decode is the finding, whatever its type
        return f"does not decode ({exc})"
    if size != (width, height):
        return f"decodes to {size[0]}x{size[1]}, the index says {width}x{height}"
    return ""
