"""Where images come from: a folder of class sub-folders, a folder plus a list file, a Caffe LMDB.

A source yields *tasks*, small picklable tuples ``(name, label, kind, payload)``
that a worker turns into a packed record: ``kind`` is ``"file"`` (payload: the
path; the worker reads it, so reading runs in parallel) or ``"datum"`` (payload:
the serialized ``caffe.Datum``; its label comes from the datum, so ``label`` is
-1). Tasks come in a fixed order (sorted names, list order, LMDB key order), so
the packed output is the same for any number of workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dimd.errors import DimdError
from dimd.pack.imaging import IMAGE_EXTENSIONS

Task = tuple  # (name: str, label: int, kind: str, payload: str | bytes)
LMDB_DATA_FILE = "data.mdb"


@dataclass(frozen=True)
class Source:
    """A resolved input: what it is, how many tasks, the class names if known up front."""

    kind: str                       # "tree", "list" or "lmdb"
    root: Path
    count: int
    classes: list[str] | None       # None: named after the labels found (LMDB without --classes-file)
    files: list[tuple[str, int]] = field(default_factory=list, repr=False)  # tree/list: (relative path, label)

    def tasks(self) -> Iterator[Task]:
        if self.kind == "lmdb":
            yield from _lmdb_tasks(self.root)
            return
        root = os.fspath(self.root)
        for relative, label in self.files:
            yield relative, label, "file", os.path.join(root, relative)


def open_source(src: str | os.PathLike, list_file: str | os.PathLike | None = None,
                classes_file: str | os.PathLike | None = None) -> Source:
    """Resolve SRC (and ``--list``/``--classes-file``) into a :class:`Source`, or fail clearly."""
    root = Path(src)
    if not root.exists():
        raise DimdError(f"{root}: no such file or directory")
    if root.is_file() and root.name == LMDB_DATA_FILE:
        root = root.parent
    if not root.is_dir():
        raise DimdError(f"{root}: not a folder (expected a class tree, a folder with `list_file`, "
                        f"or a Caffe LMDB folder holding {LMDB_DATA_FILE})")
    names = read_classes_file(classes_file) if classes_file is not None else None
    if (root / LMDB_DATA_FILE).is_file():
        if list_file is not None:
            raise DimdError(f"{root}: is an LMDB; `list_file` applies to image folders only")
        return _lmdb_source(root, names)
    if list_file is not None:
        return _list_source(root, Path(list_file), names)
    if classes_file is not None:
        raise DimdError("`classes_file` applies to `list_file` and LMDB sources; a class tree's "
                        "classes are its sub-folder names")
    return _tree_source(root)


def is_image_file(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _tree_source(root: Path) -> Source:
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        for folder, subfolders, filenames in os.walk(root / name, followlinks=True):
            subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
            relative = Path(folder).relative_to(root).as_posix()
            files.extend((f"{relative}/{f}", label) for f in sorted(filenames) if is_image_file(f))
    if not files:
        loose = any(is_image_file(e.name) for e in os.scandir(root) if e.is_file())
        hint = (" (its images are not in class sub-folders: give `list_file`, a file of 'path label' lines)"
                if loose else "")
        raise DimdError(f"{root}: no images found{hint}")
    return Source("tree", root, len(files), classes, files)


def _list_source(root: Path, list_file: Path, classes: list[str] | None) -> Source:
    try:
        lines = list_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DimdError(f"{list_file}: cannot read list file ({_reason(exc)})") from None
    files: list[tuple[str, int]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.strip().rsplit(None, 1)  # like convert_imageset: the label is the last field
        if len(parts) != 2 or not parts[1].isdigit():
            raise DimdError(f"{list_file}:{number}: expected 'relative/path label', got {line.strip()!r}")
        relative, label = parts[0], int(parts[1])
        if not (root / relative).is_file():
            raise DimdError(f"{list_file}:{number}: {root / relative}: no such file")
        if classes is not None and label >= len(classes):
            raise DimdError(f"{list_file}:{number}: label {label} but the classes file names "
                            f"only {len(classes)} classes")
        files.append((relative, label))
    if not files:
        raise DimdError(f"{list_file}: list file names no images")
    if classes is None:
        classes = [str(i) for i in range(max(label for _, label in files) + 1)]
    return Source("list", root, len(files), classes, files)


def read_classes_file(path: str | os.PathLike) -> list[str]:
    """One class name per line; line ``i`` names label ``i``."""
    try:
        names = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DimdError(f"{path}: cannot read classes file ({_reason(exc)})") from None
    while names and not names[-1]:
        names.pop()
    if not names or not all(names):
        raise DimdError(f"{path}: classes file must have one non-empty class name per line")
    return names


def _lmdb_source(root: Path, classes: list[str] | None) -> Source:
    import lmdb

    try:
        with lmdb.open(os.fspath(root), readonly=True, lock=False, readahead=False,
                       max_readers=4) as env:
            count = int(env.stat()["entries"])
    except lmdb.Error as exc:
        raise DimdError(f"{root}: cannot open LMDB ({exc})") from None
    if count == 0:
        raise DimdError(f"{root}: the LMDB has no entries")
    return Source("lmdb", root, count, classes)


def _lmdb_tasks(root: Path) -> Iterator[Task]:
    """Key order, as Caffe reads it; opened here so the iterating thread owns the transaction."""
    import lmdb

    with lmdb.open(os.fspath(root), readonly=True, lock=False, readahead=False,
                   max_readers=4) as env, env.begin(buffers=False) as txn:
        for key, value in txn.cursor():
            yield key.decode("utf-8", "backslashreplace"), -1, "datum", value


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
