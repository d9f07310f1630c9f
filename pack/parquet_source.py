"""Parquet files, as the Hugging Face Hub stores image sets (``imagenet-1k``): rows in file order.

The image is an ``image`` struct whose ``bytes`` field holds the encoded file
(the Hub's ``Image`` feature) or a binary column (``image_column``); the label
an integer column (``label_column``). Class names come from the Hub's
``ClassLabel`` feature in the schema metadata (key ``huggingface``) when
present. Files are read with pyarrow, the standard reader, installed by the
optional extra ``dimd[parquet]``; row groups are read one batch at a time, so
memory holds one batch, not a file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from dimd.errors import DimdError, describe
from dimd.pack.config import IMAGE_SIZE
from dimd.pack.streamed import SourceFile, StreamedSource, where
from dimd.pack.tasks import ArchiveTask, BytesTask, SkipTask, Task

#: Rows per batch read: a few MB of images, so the bytes in flight stay bounded.
BATCH_ROWS = 64
EXTRA = "pip install 'dimd[parquet]'"


def import_parquet(shown: str) -> Any:
    """``pyarrow.parquet``, or one line naming the extra that installs it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DimdError(f"{shown}: reading Parquet needs pyarrow, which is not installed ({EXTRA})") from None
    return pq


def class_label_names(schema: Any, column: str) -> list[str] | None:
    """The names of a Hugging Face ``ClassLabel`` feature ``column`` in an Arrow schema's metadata, if any."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    features = (info.get("info") or {}).get("features") if isinstance(info, dict) else None
    feature = features.get(column) if isinstance(features, dict) else None
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
        return None
    names = feature.get("names")
    return [str(n) for n in names] if isinstance(names, list) and names else None


class ParquetSource(StreamedSource):
    """Parquet files read in the order given, each row group front to back once."""

    kind = "parquet"

    def __init__(self, files: list[Path], shown: str, classes: list[str] | None, image_column: str,
                 label_column: str, rejected: list[tuple[str, str]]) -> None:
        pq = import_parquet(shown)
        self.paths, self.image_column, self.label_column = files, image_column, label_column
        rows, metadata_names, named_by = 0, None, None
        self._footers: dict[Path, Any] = {}   # each readable file's metadata, read once
        for path in files:
            try:
                parquet = pq.ParquetFile(path)
            except Exception:   # named where it is read, as a skip
                continue
            self._footers[path] = parquet.metadata
            rows += parquet.metadata.num_rows
            names = class_label_names(parquet.schema_arrow, label_column)
            if names is None:
                continue
            if metadata_names is None:
                metadata_names, named_by = names, path
            elif names != metadata_names:
                raise DimdError(f"{path}: its ClassLabel names for {label_column!r} differ from those of "
                                f"{named_by}; pack the files apart")
        if classes is not None and metadata_names is not None and len(classes) != len(metadata_names):
            raise DimdError(f"{named_by}: its ClassLabel names {len(metadata_names)} classes, the classes file "
                            f"{len(classes)}")
        super().__init__(shown, [SourceFile.of(p) for p in files], classes=classes or metadata_names,
                         count=rows, archives=len(files))
        if classes is None and metadata_names is not None:
            self.classes_from = f"the ClassLabel metadata of {named_by}"
        self.rejected = rejected

    def tasks(self) -> Iterator[Task]:
        pq = import_parquet(self.shown)
        for path in self.paths:
            yield ArchiveTask(str(path))
            try:
                parquet = pq.ParquetFile(path, metadata=self._footers.get(path))
            except Exception as exc:
                yield SkipTask(str(path), f"not a Parquet file pyarrow can read ({describe(exc)})")
                continue
            problem, image_bytes = self._columns(parquet.schema_arrow)
            if problem:
                yield SkipTask(str(path), problem)
                continue
            yield from self._rows(path, parquet, image_bytes)

    def _columns(self, schema: Any) -> tuple[str | None, bool]:
        """(why the file cannot be read, None) or (None, whether the image column is a struct with ``bytes``)."""
        import pyarrow as pa

        names = schema.names
        missing = [c for c in (self.image_column, self.label_column) if c not in names]
        if missing:
            return (f"no column {', '.join(repr(c) for c in missing)} (its columns: {', '.join(names)}; "
                    f"see `image_column` and `label_column`)"), False
        image, label = schema.field(self.image_column).type, schema.field(self.label_column).type
        if not pa.types.is_integer(label):
            return f"column {self.label_column!r} is {label}, not integers", False
        if pa.types.is_struct(image):
            field = image.get_field_index("bytes")
            if field < 0 or not _is_binary(image.field(field).type):
                return f"column {self.image_column!r} is {image}, a struct without binary 'bytes'", False
            return None, True
        if not _is_binary(image):
            return f"column {self.image_column!r} is {image}, not an image struct or binary", False
        return None, False

    def _rows(self, path: Path, parquet: Any, image_bytes: bool) -> Iterator[Task]:
        row = 0
        try:
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=[self.image_column, self.label_column]):
                images, labels = batch.column(0), batch.column(1).to_pylist()
                data = images.field("bytes") if image_bytes else images
                paths = images.field("path").to_pylist() if image_bytes and images.type.get_field_index("path") >= 0 \
                    else None
                for i, label in enumerate(labels):
                    shown = where(path, f"row {row}")
                    blob = data[i].as_py() if images[i].is_valid else None
                    if blob is None:
                        stored = paths[i] if paths is not None else None
                        yield SkipTask(shown, "no image bytes" + (f" (only a path: {stored})" if stored else ""))
                    elif label is None:
                        yield SkipTask(shown, "no label (null)")
                    elif problem := self.label_problem(label) or IMAGE_SIZE.problem(len(blob)):
                        yield SkipTask(shown, problem)
                    else:
                        yield BytesTask(f"{path.name}/{row}", label, blob, shown)
                    row += 1
        except Exception as exc:  # a damaged page or row group: the rest of this file is lost, named
            yield SkipTask(where(path, f"row {row}"), f"unreadable from here on ({describe(exc)})")


def _is_binary(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type)
