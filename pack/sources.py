"""Where images come from: a folder of class sub-folders, a folder plus a list file, a Caffe LMDB.

A source yields *tasks* (:mod:`dimd.pack.tasks`) that a worker turns into a
packed record: a :class:`~dimd.pack.tasks.FileTask` (the worker reads the file,
so reading runs in parallel) or a :class:`~dimd.pack.tasks.DatumTask` (a
serialized ``caffe.Datum``; its label comes from the datum). Tasks come in a
fixed order (sorted names, list order, LMDB key order), so the packed output is
the same for any number of workers.

Names are file-system strings (undecodable bytes as surrogate escapes, as
``os`` gives them; LMDB keys the same way), so nothing is lost before the
index stores them (:func:`dimd.format.escape_name`).

Only regular files are images. In a class tree, symlinks are followed as
torchvision's ImageFolder follows them, but every folder is walked once and
every file packed once: a symlink loop, or a second path to a folder or file
already packed, is skipped and named (the real location wins over a symlink
to it). See docs/policies.md.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator

import numpy as np

from dimd.errors import DimdError, describe
from dimd.pack.imaging import IMAGE_EXTENSIONS
from dimd.pack.labels import LabelBound, numbered_classes, parse_label
from dimd.pack.tasks import DatumTask, FileTask

LMDB_DATA_FILE = "data.mdb"


@dataclass(frozen=True)
class Source:
    """A resolved input: what it is, how many tasks, the class names if known up front."""

    kind: str                       # "tree", "list" or "lmdb"
    root: Path
    count: int
    classes: list[str] | None       # None: named after the labels found (LMDB without --classes-file)
    files: list[tuple[str, int]] = field(default_factory=list, repr=False)  # tree/list: (relative path, label)
    #: Entries found while listing that are not packed, with the reason (not a regular file,
    #: a symlink loop, a second path to a file already packed).
    rejected: list[tuple[str, str]] = field(default_factory=list, repr=False)
    #: Archives read: none (a source read front to back has some: :class:`dimd.pack.streamed.StreamedSource`).
    archives: ClassVar[int | None] = 0

    @property
    def label_bound(self) -> LabelBound:
        return LabelBound.for_classes(self.classes)

    def tasks(self) -> Iterator[FileTask | DatumTask]:
        if self.kind == "lmdb":
            yield from _lmdb_tasks(self.root)
            return
        root = os.fspath(self.root)
        for relative, label in self.files:
            yield FileTask(relative, label, os.path.join(root, relative))


def open_source(src: str | os.PathLike, list_file: str | os.PathLike | None = None,
                classes_file: str | os.PathLike | None = None) -> Source:
    """Resolve SRC (and ``--list``/``--classes-file``) into a :class:`Source`, or fail clearly."""
    root = Path(src)
    try:  # a folder on the way that may be read but not entered makes these raise (EACCES)
        if not root.exists():
            raise DimdError(f"{root}: no such file or directory")
        if root.is_file() and root.name == LMDB_DATA_FILE:
            root = root.parent
        if not root.is_dir():
            raise DimdError(f"{root}: not a folder (expected a class tree, a folder with `list_file`, "
                            f"or a Caffe LMDB folder holding {LMDB_DATA_FILE})")
        is_lmdb = (root / LMDB_DATA_FILE).is_file()
    except OSError as exc:
        raise DimdError(f"{root}: cannot read folder ({describe(exc)})") from None
    names = read_classes_file(classes_file) if classes_file is not None else None
    if is_lmdb:
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


# ---------------------------------------------------------------------------- class tree
def _tree_source(root: Path) -> Source:
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        raise DimdError(f"{root}: cannot list folder ({describe(exc)})") from None
    classes = sorted(e.name for e in entries if not e.name.startswith(".") and _is_dir(e))
    walk = _TreeWalk(root, len(classes))
    # Real class folders claim their (device, inode) before symlinked ones: the real location wins.
    for name in sorted(classes, key=lambda name: (root / name).is_symlink()):
        walk.claim_class(name)
    for label, name in enumerate(classes):
        walk.walk(name, label)
    walk.follow_links()
    named = {name for name, _ in walk.rejected}
    for label, name in enumerate(classes):  # kept, so labels match a sibling set's, but named
        if not walk.files[label] and f"{name}/" not in named:
            walk.rejected.append((f"{name}/", "a class folder with no images; its class is kept, empty"))
    files = [item for per_class in walk.files for item in per_class]
    if not files:
        loose = any(is_image_file(e.name) for e in entries if e.is_file())
        hint = (" (its images are not in class sub-folders: give `list_file`, a file of 'path label' lines)"
                if loose else "")
        raise DimdError(f"{root}: no images found{hint}")
    return Source("tree", root, len(files), classes, files, walk.rejected)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a symlink
    except OSError:
        return False


class _TreeWalk:
    """Walk class folders: real folders and files first, then what symlinks lead to, each once.

    Folders and files are identified by (device, inode). The class folders are
    claimed first, so a symlink from one class into another never moves the
    other's images; a folder or file reached a second time (a loop, or a second
    link) is named in ``rejected``. Regular files cost no ``stat``: the
    directory entry's type and inode come with the listing.
    """

    def __init__(self, root: Path, classes: int) -> None:
        self.root = root
        self.seen_dirs: dict[tuple[int, int], str] = {}
        self.seen_files: dict[tuple[int, int], str] = {}
        self.stat_keys: dict[str, tuple[int, int]] = {}  # files whose listed inode number was not enough
        self.files: list[list[tuple[str, int]]] = [[] for _ in range(classes)]
        self.rejected: list[tuple[str, str]] = []
        self.links: list[tuple[str, int, str]] = []  # (relative path, label, "dir" | "file"), deferred
        root_stat = os.stat(root)
        self.seen_dirs[(root_stat.st_dev, root_stat.st_ino)] = "."

    def claim_class(self, name: str) -> None:
        try:
            st = os.stat(self.root / name)
        except OSError:
            return
        self.seen_dirs.setdefault((st.st_dev, st.st_ino), name)

    def walk(self, relative: str, label: int, *, claimed: bool = True) -> None:
        """Files of ``relative`` and its real sub-folders; symlinks are deferred to :meth:`follow_links`."""
        stack = [relative]
        first = True
        while stack:
            folder = stack.pop()
            path = os.path.join(self.root, folder)
            try:
                st = os.stat(path)
                entries = sorted(os.scandir(path), key=lambda e: e.name)
            except OSError as exc:
                self.rejected.append((folder + "/", f"cannot list folder ({describe(exc)})"))
                continue
            key = (st.st_dev, st.st_ino)
            owner = self.seen_dirs.get(key)
            if owner is not None and not (first and claimed and owner == folder):
                self.rejected.append((folder + "/", _again("folder", owner + "/")))
                first = False
                continue
            self.seen_dirs[key] = folder
            first = False
            subfolders = []
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                name = f"{folder}/{entry.name}"
                if entry.is_symlink():
                    self.links.append((name, label, entry.name))
                elif entry.is_dir(follow_symlinks=False):
                    subfolders.append(name)
                elif is_image_file(entry.name):
                    if entry.is_file(follow_symlinks=False):
                        self._add_file(name, label, (st.st_dev, entry.inode()))
                    else:
                        self.rejected.append((name, _not_regular(_mode(entry))))
            stack.extend(reversed(subfolders))

    def follow_links(self) -> None:
        """Symlinked folders and files, after every real one (deferring again what they hold)."""
        while self.links:
            pending, self.links = self.links, []
            for name, label, base in pending:
                try:
                    st = os.stat(os.path.join(self.root, name))
                except OSError as exc:
                    if is_image_file(base):
                        self.rejected.append((name, _unreadable_link(exc)))
                    continue
                if stat.S_ISDIR(st.st_mode):
                    self.walk(name, label, claimed=False)
                elif is_image_file(base):
                    if stat.S_ISREG(st.st_mode):
                        self._add_file(name, label, (st.st_dev, st.st_ino))
                    else:
                        self.rejected.append((name, _not_regular(st.st_mode, via_link=True)))

    def _add_file(self, name: str, label: int, key: tuple[int, int]) -> None:
        owner = self.seen_files.get(key)
        if owner is not None:
            key, owner = self._confirmed(name, key, owner)
        if owner is not None:
            self.rejected.append((name, _again("file", owner)))
            return
        self.seen_files[key] = name
        self.files[label].append((name, label))

    def _confirmed(self, name: str, key: tuple[int, int], owner: str) -> tuple[tuple[int, int], str | None]:
        """(key, the file already packed under it, or None): ``stat`` has the last word on an inode number.

        A FUSE file system without inode numbers of its own (sshfs, by default)
        lists every file with the same one; two files that share a listed
        number are compared by what ``stat`` gives, and are keyed by that.
        """
        mine, theirs = self._stat_key(name), self._stat_key(owner)
        if mine == theirs:
            return key, owner
        self.seen_files.setdefault(theirs, owner)
        return mine, self.seen_files.get(mine)

    def _stat_key(self, name: str) -> tuple[int, int]:
        key = self.stat_keys.get(name)
        if key is None:
            try:
                st = os.stat(os.path.join(self.root, name))
                key = (st.st_dev, st.st_ino)
            except OSError:
                key = (-1, len(self.stat_keys))  # unreadable: packing it will name the problem
            self.stat_keys[name] = key
        return key


def _mode(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_mode
    except OSError:
        return 0


def _again(what: str, owner: str) -> str:
    if owner == "./":
        return "a symlink back to the top folder (a loop); not followed"
    if what == "folder":
        return f"leads to folder {owner}, which is walked already (a symlink loop or a second link); not followed"
    return f"the same file as {owner} (a symlink or hard link); packed once, as {owner}"


def _unreadable_link(exc: OSError) -> str:
    """Why a symlink leads to no file: nothing at its end, a loop (a link to itself), or what the OS says."""
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return "broken symlink"
    if exc.errno == errno.ELOOP:
        return "a symlink loop (a link that leads back to itself)"
    return f"cannot read ({describe(exc)})"


def _not_regular(mode: int, via_link: bool = False) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"not a regular file ({'a symlink to ' if via_link else ''}{kind})"


def file_problem(path: str | os.PathLike) -> tuple[str | None, tuple[int, int]]:
    """(why ``path`` is not a packable file or None, its (device, inode)); follows symlinks."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such file", (0, 0)
    except OSError as exc:
        return _unreadable_link(exc), (0, 0)
    if not stat.S_ISREG(st.st_mode):
        return _not_regular(st.st_mode, via_link=os.path.islink(path)), (0, 0)
    return None, (st.st_dev, st.st_ino)


# ---------------------------------------------------------------------------- list file
@dataclass(frozen=True)
class ListEntry:
    """One line of a list file: its number, the path as written, its label."""

    line: int
    path: str
    label: int


def read_list(list_file: Path, classes: list[str] | None) -> list[ListEntry]:
    """The ``relative/path label`` lines of ``list_file``, labels bounded; an error names the first bad line."""
    bound = LabelBound.for_classes(classes)
    entries: list[ListEntry] = []
    for number, line in enumerate(read_lines(list_file, "list file"), 1):
        if not line.strip():
            continue
        parts = line.strip().rsplit(None, 1)  # like convert_imageset: the label is the last field
        label = parse_label(parts[1]) if len(parts) == 2 else None
        if label is None:
            raise DimdError(f"{list_file}:{number}: expected 'relative/path label', got {_shown(line.strip())!r}")
        problem = bound.problem(label, parts[1])
        if problem:
            raise DimdError(f"{list_file}:{number}: {problem}")
        entries.append(ListEntry(number, parts[0], label))
    if not entries:
        raise DimdError(f"{list_file}: list file names no images")
    return entries


def list_classes(entries: list[ListEntry], list_file: Path, classes: list[str] | None) -> list[str]:
    """The classes file's names, or ``"0".."max"`` for the labels the list uses."""
    if classes is not None:
        return classes
    return numbered_classes(np.fromiter((e.label for e in entries), np.int64, len(entries)), str(list_file))


def _list_source(root: Path, list_file: Path, classes: list[str] | None) -> Source:
    entries = read_list(list_file, classes)
    files: list[tuple[str, int]] = []
    first_seen: dict[tuple[int, int], ListEntry] = {}  # file -> the first line naming it
    for entry in entries:
        where, relative, label = f"{list_file}:{entry.line}", entry.path, entry.label
        problem, key = file_problem(root / relative)
        if problem:
            raise DimdError(f"{where}: {_shown(str(root / relative))}: {problem}")
        earlier = first_seen.setdefault(key, entry)
        if earlier.label != label:
            same = "" if earlier.path == relative else f" (as {_shown(earlier.path)})"
            raise DimdError(f"{where}: {_shown(relative)} has label {label}, but line {earlier.line} "
                            f"gave the same file{same} label {earlier.label}")
        files.append((relative, label))
    return Source("list", root, len(files), list_classes(entries, list_file, classes), files)


def read_classes_file(path: str | os.PathLike) -> list[str]:
    """One class name per line; line ``i`` names label ``i``; every name once."""
    names = [line.strip() for line in read_lines(Path(path), "classes file")]
    while names and not names[-1]:
        names.pop()
    if not names or not all(names):
        raise DimdError(f"{path}: classes file must have one non-empty class name per line")
    first: dict[str, int] = {}
    for number, name in enumerate(names, 1):
        earlier = first.setdefault(name, number)
        if earlier != number:
            raise DimdError(f"{path}:{number}: class name {_shown(name)!r} is already the name of "
                            f"line {earlier} (label {earlier - 1}); each class needs its own name")
    return names


def read_lines(path: Path, what: str) -> list[str]:
    """A text file's lines, without a leading byte order mark; undecodable bytes kept as surrogate
    escapes (they may be file names)."""
    try:
        if not path.is_file():
            raise DimdError(f"{path}: cannot read {what} (" + ("not a regular file" if path.exists()
                                                                else "No such file or directory") + ")")
        # utf-8-sig: a byte order mark (Windows editors write one) is no part of the first name.
        return path.read_text(encoding="utf-8-sig", errors="surrogateescape").splitlines()
    except OSError as exc:
        raise DimdError(f"{path}: cannot read {what} ({describe(exc)})") from None


def _shown(text: str) -> str:
    from dimd.format import escape_name

    return escape_name(text)


# ---------------------------------------------------------------------------- Caffe LMDB
def _lmdb_source(root: Path, classes: list[str] | None) -> Source:
    import lmdb

    problem = lmdb_size_problem(root / LMDB_DATA_FILE)
    if problem:
        raise DimdError(problem)
    try:
        with lmdb.open(os.fspath(root), readonly=True, lock=False, readahead=False,
                       max_readers=4) as env:
            count = int(env.stat()["entries"])
    except lmdb.Error as exc:
        raise DimdError(f"{root}: cannot open LMDB ({exc})") from None
    if count == 0:
        raise DimdError(f"{root}: the LMDB has no entries")
    return Source("lmdb", root, count, classes)


#: LMDB's meta page: after the 16-byte page header, magic, version, address, map size,
#: the two database records (48 bytes each; the first one's md_pad holds the page size),
#: the last page in use and the transaction id (mdb.c, struct MDB_meta; 64-bit builds).
_META = struct.Struct("<II8xQ I44x 48x QQ")
_LMDB_MAGIC = 0xBEEFC0DE
_PAGE_HEADER = 16


def lmdb_size_problem(data_file: Path) -> str | None:
    """Why ``data.mdb`` cannot be read safely, or None: a file shorter than its header says.

    LMDB maps the file into memory; reading a page past a truncated end
    kills the process with SIGBUS, with no message. The newer of the two meta
    pages names the last page in use; the file must reach the end of it.
    """
    try:
        with open(data_file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(_PAGE_HEADER + _META.size)
            if len(first) < _PAGE_HEADER + _META.size:
                return f"{data_file}: {size} bytes, too short for an LMDB header (truncated?)"
            magic, _version, _mapsize, page_size, last_page, txnid = _META.unpack_from(first, _PAGE_HEADER)
            if magic != _LMDB_MAGIC:
                return f"{data_file}: not an LMDB data file (no LMDB magic number; or a 32-bit or big-endian LMDB)"
            if not 512 <= page_size <= 1 << 16 or page_size & (page_size - 1):
                return f"{data_file}: LMDB header gives page size {page_size}; the file is damaged"
            f.seek(page_size)
            second = f.read(_PAGE_HEADER + _META.size)
    except OSError as exc:
        return f"{data_file}: cannot read ({describe(exc)})"
    if len(second) == _PAGE_HEADER + _META.size:
        magic2, _v, _m, _p, last2, txnid2 = _META.unpack_from(second, _PAGE_HEADER)
        if magic2 == _LMDB_MAGIC and txnid2 > txnid:
            last_page = last2
    needed = (last_page + 1) * page_size
    if size < needed:
        return (f"{data_file}: truncated: the file is {size:,} bytes but its LMDB header says its "
                f"pages reach byte {needed:,} (an interrupted copy?)")
    return None


def _lmdb_tasks(root: Path) -> Iterator[DatumTask]:
    """Key order, as Caffe reads it; opened here so the iterating thread owns the transaction."""
    import lmdb

    with lmdb.open(os.fspath(root), readonly=True, lock=False, readahead=False,
                   max_readers=4) as env, env.begin(buffers=False) as txn:
        for key, value in txn.cursor():
            yield DatumTask(key.decode("utf-8", "surrogateescape"), value)
