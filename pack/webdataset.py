"""WebDataset shards: tars of samples, each ``KEY.jpg`` (or ``.jpeg``, ``.png``, ``.webp``) with a label.

A sample is the run of consecutive members that share a key (the path up to
the first dot of the file name, as webdataset splits it: ``a/b.seg.png`` is
key ``a/b``, extension ``seg.png``). Its image is the first of
:data:`IMAGE_EXTENSIONS` it has; its label is ``KEY.cls`` (a number) or a
field of ``KEY.json`` (``label_field``). Samples are records in shard order,
shards in the order given, so a WebDataset copy of a set packs to the same
records as the set, given the same class order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dimd.pack.config import IMAGE_SIZE, LABEL_SIZE
from dimd.pack.labels import parse_label
from dimd.pack.streamed import SourceFile, StreamedSource, where
from dimd.pack.tar_source import image_task
from dimd.pack.tar_stream import (ArchiveProblem, extracted_file, member_kind, member_path, members, on_local_disk,
                                  open_tar, read_member)
from dimd.pack.tasks import ArchiveTask, MemberTask, SkipTask, Task

#: The image of a sample: the first of these extensions it has.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTENSIONS = ("cls", "json")
_KEY = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]+)$")


def split_key(path: str) -> tuple[str, str] | None:
    """(key, lower-case extension) of a member path, or None for a name without an extension."""
    match = _KEY.match(path)
    return (match.group(1), match.group(2).lower()) if match else None


@dataclass
class _Sample:
    key: str
    labels: dict[str, bytes] = field(default_factory=dict)   # "cls" / "json" -> its bytes
    images: dict[str, MemberTask] = field(default_factory=dict)    # extension -> the image as a task
    problem: str | None = None

    def has(self, extension: str) -> bool:
        return extension in self.labels or extension in self.images


class WebDatasetSource(StreamedSource):
    """Shards read in the order given, each front to back once."""

    kind = "webdataset"

    def __init__(self, shards: list[Path], shown: str, classes: list[str] | None, label_field: str,
                 rejected: list[tuple[str, str]]) -> None:
        super().__init__(shown, [SourceFile.of(p) for p in shards], classes=classes, archives=len(shards))
        self.shards, self.label_field = shards, label_field
        self.rejected = rejected

    def tasks(self) -> Iterator[Task]:
        for shard in self.shards:
            yield ArchiveTask(str(shard))
            yield from self._shard(shard)

    def _shard(self, shard: Path) -> Iterator[Task]:
        sample: _Sample | None = None
        in_place = shard if on_local_disk(shard) else None
        try:
            with open_tar(shard) as tar:
                for member in members(tar):
                    path = extracted_file(member)
                    split = split_key(path) if path is not None else None
                    if split is None:
                        continue
                    key, extension = split
                    if sample is None or key != sample.key:
                        if sample is not None:
                            yield self._task(shard, sample)
                        sample = _Sample(key)
                    if extension in IMAGE_EXTENSIONS or extension in LABEL_EXTENSIONS:
                        self._add(shard, sample, extension, member, tar, in_place)
        except ArchiveProblem as problem:
            lost = split_key(member_path(problem.member) or "") if problem.member else None
            if sample is not None and lost is not None and lost[0] == sample.key:
                sample = None   # a member of it is lost: the skip below names that member
            yield SkipTask(where(shard, problem.member), problem.reason)
        if sample is not None:
            yield self._task(shard, sample)

    def _add(self, shard: Path, sample: _Sample, extension: str, member, tar, in_place: Path | None) -> None:
        if sample.has(extension):
            sample.problem = sample.problem or f"two {sample.key}.{extension} members"
            return
        limit = IMAGE_SIZE if extension in IMAGE_EXTENSIONS else LABEL_SIZE
        problem = member_kind(member) or limit.problem(member.size)
        if problem:
            sample.problem = sample.problem or f"{member.name}: {problem}"
        elif extension in LABEL_EXTENSIONS:
            sample.labels[extension] = read_member(tar, member)
        else:  # the label is not known yet: filled in by _task
            sample.images[extension] = image_task(tar, member, f"{shard.name}/{member.name}", -1,
                                                  where(shard, member.name), in_place)

    def _task(self, shard: Path, sample: _Sample) -> Task:
        shown = where(shard, sample.key)
        if sample.problem:
            return SkipTask(shown, sample.problem)
        image = next((e for e in IMAGE_EXTENSIONS if e in sample.images), None)
        if image is None:
            return SkipTask(shown, "no image (" + ", ".join(f".{e}" for e in IMAGE_EXTENSIONS) + ")")
        label, problem = self._label(sample)
        if problem is None:
            assert label is not None
            problem = self.label_problem(label)
        if problem:
            return SkipTask(shown, problem)
        assert label is not None
        return sample.images[image]._replace(label=label)

    def _label(self, sample: _Sample) -> tuple[int | None, str | None]:
        """(label, None), or (None, why the sample has no single label)."""
        found: dict[str, int] = {}
        key = sample.key
        if "cls" in sample.labels:
            text = sample.labels["cls"].decode("utf-8", "replace").strip()
            label = parse_label(text)
            if label is None:
                return None, f"{key}.cls holds {text[:40]!r}, not a label"
            found["cls"] = label
        if "json" in sample.labels:
            try:
                document = json.loads(sample.labels["json"])
            except (ValueError, UnicodeDecodeError) as exc:
                return None, f"{key}.json is not JSON ({exc})"
            value = document.get(self.label_field) if isinstance(document, dict) else None
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    return None, f"{key}.json's {self.label_field!r} is {value!r}, not a label"
                if value < 0:
                    return None, f"negative label {value} in {key}.json"
                found["json"] = value
        if not found:
            if "json" in sample.labels:
                return None, f"no label: {key}.json has no {self.label_field!r} and there is no {key}.cls"
            return None, f"no label (no {key}.cls or {key}.json)"
        if len(set(found.values())) > 1:
            return None, (f"two labels: {key}.cls says {found['cls']}, {key}.json's {self.label_field!r} "
                          f"says {found['json']}")
        return next(iter(found.values())), None
