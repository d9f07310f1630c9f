"""Tar sources: ImageNet's tar of per-class tars, and a flat tar of images with a list file.

``ILSVRC2012_img_train.tar`` holds one tar per class (``n01440764.tar`` ...).
Packed directly, it gives the bytes packing its extracted tree gives: the
classes are the inner tars' names without ``.tar``, sorted (as ImageFolder
sorts the extracted folders), each record is named ``class/member`` and the
records come in the folder source's walk order (:func:`tree_key`). A flat tar
(``ILSVRC2012_img_val.tar``) with ``--list`` gives what the flat folder and
the list give: the list's records, in list order, with its labels.

The archive is read once, front to back. ImageNet's tars are in sorted order,
so the records come out in order as they are read; a tar made from a folder
by plain ``tar cf`` lists files in directory order, and then the records are
put in order once all are written (:func:`dimd.pack.streamed.put_in_order`).
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Generator, Iterator

import numpy as np

from dimd.errors import DimdError
from dimd.format import PackWriter
from dimd.pack.config import IMAGE_SIZE
from dimd.pack.sources import ListEntry, is_image_file, list_classes
from dimd.pack.streamed import SourceFile, StreamedSource, put_in_order, where
from dimd.pack.tar_stream import (ArchiveProblem, extracted_file, member_file, member_kind, member_location,
                                  member_path, members, on_local_disk, open_tar, read_member, second_member, tree_key)
from dimd.pack.tasks import ArchiveTask, BytesTask, MemberTask, RangeTask, SkipTask, Task

INNER_SUFFIX = ".tar"


def image_task(tar, member, name: str, label: int, shown: str, in_place: Path | None) -> MemberTask:
    """A member as a task: where it lies, for the worker to read (``in_place``: the tar's path, on a local disk,
    uncompressed), else its bytes, read here; :class:`ArchiveProblem` if the archive ends inside it."""
    offset = member_location(tar, member) if in_place is not None else None
    if offset is not None:
        return RangeTask(name, label, str(in_place), offset, member.size, shown)
    return BytesTask(name, label, read_member(tar, member), shown)


class NestedTarSource(StreamedSource):
    """A tar of per-class tars (``ILSVRC2012_img_train.tar``)."""

    kind = "tar"
    record_order = "tree"

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), [SourceFile.of(path)], classes=None)
        self.path = path
        self.in_place = path if on_local_disk(path) else None
        self._order: dict[str, int] = {}  # class -> its provisional label: the order the class tars came in

    def tasks(self) -> Iterator[Task]:
        truncated_inner = None  # an inner tar that ended early: the outer archive ends there too, named once
        with open_tar(self.path) as tar:
            try:
                for member in members(tar):
                    path = extracted_file(member)
                    if path is None:
                        continue
                    name = posixpath.basename(path)
                    if name.lower().endswith(INNER_SUFFIX) and len(name) > len(INNER_SUFFIX):
                        yield ArchiveTask(where(self.shown, member.name))
                        if (yield from self._inner(tar, member, name[: -len(INNER_SUFFIX)])):
                            truncated_inner = member.name
                    elif is_image_file(name):
                        raise DimdError(f"{self.shown}: {member.name}: an image outside any per-class tar; a tar "
                                        f"of images (as ImageNet's val tar) needs `list_file`")
            except ArchiveProblem as problem:
                if not (problem.member and problem.member == truncated_inner):
                    yield SkipTask(where(self.shown, problem.member), problem.reason)
        if not self._order:
            raise DimdError(f"{self.shown}: holds no per-class tars (NAME.tar members)")

    def _inner(self, tar, member, label_name: str) -> Generator[Task, None, bool]:
        """The images of one inner tar (one class), in archive order; returns whether it ended early."""
        shown = where(self.shown, member.name)
        if label_name in self._order:
            yield SkipTask(shown, f"a second tar of class {label_name}; not read (tar x would mix the two)")
            return False
        label = self._order[label_name] = len(self._order)
        kind = member_kind(member)
        if kind:
            yield SkipTask(shown, f"{kind}; its class is kept, empty")
            return False
        images, ended = 0, False
        read: set[str] = set()
        try:
            with open_tar(member.name, member_file(tar, member)) as inner:
                for image in members(inner):
                    if member_path(image.name) is None:
                        if is_image_file(posixpath.basename(image.name)):
                            yield SkipTask(where(self.shown, member.name, image.name),
                                           "a path outside the tar's top folder (tar x refuses it)")
                        continue
                    path = extracted_file(image)
                    if path is None or not is_image_file(posixpath.basename(path)):
                        continue
                    image_shown = where(self.shown, member.name, image.name)
                    problem = member_kind(image) or IMAGE_SIZE.problem(image.size) or second_member(path, read)
                    if problem:
                        yield SkipTask(image_shown, problem)
                        continue
                    images += 1
                    yield image_task(inner, image, f"{label_name}/{path}", label, image_shown, self.in_place)
        except ArchiveProblem as problem:
            ended = problem.ends
            if not images and not problem.member:  # no tar at all, or damaged before its first image
                yield SkipTask(shown, f"{problem.reason}; its class is kept, empty")
                return ended
            yield SkipTask(where(self.shown, member.name, problem.member), problem.reason)
        if not images:
            yield SkipTask(shown, "an inner tar with no images; its class is kept, empty")
        return ended

    def finish(self, writer: PackWriter) -> list[str]:
        """Classes by sorted name, as ImageFolder sorts the extracted folders; records in the tree's order."""
        classes = sorted(self._order)
        final = {name: label for label, name in enumerate(classes)}
        remap = [final[name] for name in self._order]   # provisional label -> final
        labels = writer.labels
        labels[:] = np.asarray(remap, labels.dtype)[labels]
        self.reordered = put_in_order(writer, lambda i: tree_key(writer.name(i)))
        return classes


class ListedTarSource(StreamedSource):
    """A flat tar of images plus a list file (``ILSVRC2012_img_val.tar`` with ``val.txt``).

    Each list line names a member (``./`` and ``/`` prefixes aside); the
    records are the list's, in list order, as for a folder and its list.
    """

    kind = "tar"
    record_order = "list"

    def __init__(self, path: Path, list_file: Path, entries: list[ListEntry], classes: list[str] | None) -> None:
        super().__init__(str(path), [SourceFile.of(path)], classes=list_classes(entries, list_file, classes),
                         count=len(entries), archives=1)
        self.path, self.list_file, self.entries = path, list_file, entries
        self.in_place = path if on_local_disk(path) else None
        self._wanted: dict[str, list[int]] = {}   # member path -> indices into entries
        for i, entry in enumerate(entries):
            key = member_path(entry.path)
            if key is None or not key:
                raise DimdError(f"{list_file}:{entry.line}: {entry.path}: not a path inside the archive")
            listed = self._wanted.setdefault(key, [])
            if listed and entries[listed[0]].label != entry.label:
                first = entries[listed[0]]
                raise DimdError(f"{list_file}:{entry.line}: {entry.path} has label {entry.label}, but line "
                                f"{first.line} gave the same member label {first.label}")
            listed.append(i)

    def tasks(self) -> Iterator[Task]:
        read: set[str] = set()
        ended = None
        yield ArchiveTask(self.shown)
        with open_tar(self.path) as tar:
            try:
                for member in members(tar):
                    path = member_path(member.name)
                    listed = self._wanted.get(path) if path else None
                    if not path or not listed:
                        continue
                    shown = where(self.shown, member.name)
                    second = second_member(path, read)
                    if second:
                        yield SkipTask(shown, second)
                        continue
                    kind = member_kind(member)
                    if kind:
                        entry = self.entries[listed[0]]
                        raise DimdError(f"{self.list_file}:{entry.line}: {entry.path}: {kind} in {self.shown}")
                    too_large = IMAGE_SIZE.problem(member.size)
                    if too_large:
                        yield from (SkipTask(shown, too_large) for _ in listed)
                        continue
                    task = image_task(tar, member, "", -1, shown, self.in_place)
                    for i in listed:  # a member listed twice is packed twice, its bytes read once here
                        yield task._replace(name=self.entries[i].path, label=self.entries[i].label)
            except ArchiveProblem as problem:
                ended = problem
                yield SkipTask(where(self.shown, problem.member), problem.reason)
        for entry in self.entries:
            if member_path(entry.path) not in read:
                if ended is None:
                    raise DimdError(f"{self.list_file}:{entry.line}: {entry.path}: no such member in {self.shown}")
                yield SkipTask(where(self.shown, entry.path), "not read: the archive ends before it")

    def finish(self, writer: PackWriter) -> list[str]:
        """Records in list order (a name listed twice takes its places in turn)."""
        places: dict[str, list[int]] = {}
        for i, entry in enumerate(self.entries):
            places.setdefault(entry.path, []).append(i)
        taken: dict[str, int] = {}
        position = []
        for i in range(len(writer)):
            name = writer.name(i)
            turn = taken.get(name, 0)
            taken[name] = turn + 1
            position.append(places[name][turn])
        self.reordered = put_in_order(writer, position.__getitem__)
        assert self.classes is not None
        return self.classes
