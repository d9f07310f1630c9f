"""Read a tar once, front to back, and name every damage: the archive layer under the tar sources.

Python's :mod:`tarfile` reads the headers (ustar, GNU and pax names and
sizes) but is lenient where a packer must not be: a header it cannot parse, or
an archive that ends between two members, ends its iteration as if the archive
were complete, so the members after the damage would be lost in silence.
:func:`members` walks the archive with :meth:`tarfile.TarInfo.fromtarfile`
instead and raises :class:`ArchiveProblem` for each way an archive can end
early. An uncompressed tar is read through a large buffer (seeks within it
cost nothing, so small members are read sequentially and large ones skipped);
a compressed one is a stream (``r|gz``), read once.

Member paths are normalised as ``tar x`` would create them (``./a/b`` and
``/a/b`` are ``a/b``); :func:`tree_key` orders them as the folder source walks
the extracted files.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import re
import tarfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from dimd.errors import describe

#: The read buffer of an uncompressed tar, and the block size of a compressed one's stream: large
#: enough that a network file system sees few, long reads.
READ_BUFFER = 1 << 20
#: (first bytes, compression name, tarfile's name for it, the command that decompresses it)
COMPRESSIONS = (
    (b"\x1f\x8b", "gzip", "gz", "gunzip"),
    (b"BZh", "bzip2", "bz2", "bunzip2"),
    (b"\xfd7zXZ\x00", "xz", "xz", "unxz"),
    (b"\x28\xb5\x2f\xfd", "zstd", "zst", "zstd -d"),
)
TRUNCATED = "truncated (end of file inside the member)"
#: How :meth:`tarfile.TarInfo.frombuf` says why a block is no header (in tarfile since Python 3.2, not in
#: its documentation): a block of zeros (the end of the archive), nothing, or less than a block.
_END_BLOCK: type[Exception] = tarfile.EOFHeaderError  # type: ignore[attr-defined]
_NO_BLOCK: type[Exception] = tarfile.EmptyHeaderError  # type: ignore[attr-defined]
_PART_BLOCK: type[Exception] = tarfile.TruncatedHeaderError  # type: ignore[attr-defined]


class ArchiveProblem(Exception):
    """A member, or the archive itself (``member`` empty), that cannot be read.

    ``ends``: reading cannot go on past it (the archive is truncated or damaged
    there); otherwise only this member is lost.
    """

    def __init__(self, member: str, reason: str, *, ends: bool = True) -> None:
        super().__init__(f"{member}: {reason}" if member else reason)
        self.member, self.reason, self.ends = member, reason, ends


def compression(head: bytes) -> tuple[str, str, str] | None:
    """(name, tarfile's name, decompress command) of a compressed file's first bytes; None if not compressed."""
    for magic, name, mode, command in COMPRESSIONS:
        if head.startswith(magic):
            return name, mode, command
    return None


def readable_compression(mode: str) -> bool:
    """Whether this Python's tarfile knows ``mode`` ("gz", "zst", ...): zstd needs Python 3.14."""
    return mode in tarfile.TarFile.OPEN_METH


@contextlib.contextmanager
def open_tar(path: str | Path, fileobj: BinaryIO | None = None) -> Iterator[tarfile.TarFile]:
    """The tar at ``path`` (or in ``fileobj``, a member of another tar), opened for one pass.

    Raises :class:`ArchiveProblem` (member "") for a file that is no tar, or
    one compressed in a way this Python cannot read.
    """
    with contextlib.ExitStack() as stack:
        if fileobj is None:
            fileobj = stack.enter_context(open(path, "rb", buffering=READ_BUFFER))
        head = _peek(fileobj, 6)
        packed = compression(head)
        if packed is None:
            mode = "r:" if _seekable(fileobj) else "r|"
        else:
            name, method, command = packed
            if not readable_compression(method):
                raise ArchiveProblem("", f"a {name}-compressed tar, which this Python's tarfile cannot read; "
                                         f"decompress it first ({command} {Path(path).name})", ends=False)
            mode = f"r|{method}"
        try:
            tar = tarfile.open(fileobj=fileobj, mode=mode, bufsize=READ_BUFFER)  # type: ignore[call-overload]
        except tarfile.CompressionError as exc:  # the Python was built without zlib, bz2 or lzma
            raise ArchiveProblem("", f"cannot be read by this Python's tarfile ({describe(exc)})",
                                 ends=False) from None
        except (tarfile.TarError, EOFError, OSError) as exc:
            what = "an empty file" if not head else f"not a tar archive ({describe(exc)})"
            raise ArchiveProblem("", what, ends=False) from None
        stack.callback(tar.close)
        yield tar


def _seekable(fileobj: BinaryIO) -> bool:
    try:
        return fileobj.seekable()
    except AttributeError:  # a member of a compressed tar: its stream has no seekable()
        return False


def _peek(fileobj: BinaryIO, size: int) -> bytes:
    if isinstance(fileobj, io.BufferedReader):
        return fileobj.peek(size)[:size]
    start = fileobj.tell()
    head = fileobj.read(size)
    fileobj.seek(start)
    return head


def members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Every member of ``tar`` in archive order; :class:`ArchiveProblem` where the archive ends early.

    Unlike :meth:`tarfile.TarFile.next`, nothing is collected (a million
    members cost no memory) and damage is never taken for the archive's end.
    """
    previous = tar.next()  # the first member, read (strictly) when the tar was opened
    while previous is not None:
        yield previous
        previous = _next(tar, previous)


def _next(tar: tarfile.TarFile, previous: tarfile.TarInfo) -> tarfile.TarInfo | None:
    fileobj = tar.fileobj
    assert fileobj is not None
    try:
        if tar.offset != fileobj.tell():  # skip what is left of the previous member's data
            fileobj.seek(tar.offset - 1)
            if not fileobj.read(1):
                raise ArchiveProblem(previous.name, TRUNCATED)
        return tar.tarinfo.fromtarfile(tar)
    except _END_BLOCK:        # a block of zeros: the end-of-archive marker
        return None
    except _NO_BLOCK:
        raise ArchiveProblem("", f"truncated (it ends after {previous.name}, without the end-of-archive "
                                 "blocks; members after it may be missing)") from None
    except _PART_BLOCK:
        raise ArchiveProblem("", f"truncated (end of file inside the header after {previous.name})") from None
    except tarfile.HeaderError as exc:
        raise ArchiveProblem("", f"damaged (no valid member header after {previous.name}: "
                                 f"{describe(exc)})") from None
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:  # a corrupt compressed stream, mostly
        raise ArchiveProblem("", f"damaged after {previous.name} ({describe(exc)})") from None


def read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """The bytes of a regular member; :class:`ArchiveProblem` if the archive ends inside them."""
    try:
        stream = tar.extractfile(member)
        data = stream.read() if stream is not None else b""
    except (tarfile.TarError, EOFError, OSError, ValueError):
        raise ArchiveProblem(member.name, TRUNCATED) from None
    if len(data) != member.size:
        raise ArchiveProblem(member.name, TRUNCATED)
    return data


def member_location(tar: tarfile.TarFile, member: tarfile.TarInfo) -> int | None:
    """Where a regular member's bytes start in the file below ``tar`` (a tar inside a tar included).

    None for a compressed tar, whose bytes have no place in a file, and for a
    member whose bytes run past the end of the file (a truncated archive:
    :func:`read_member` names it).
    """
    fileobj: Any = tar.fileobj
    offset = member.offset_data
    while isinstance(getattr(fileobj, "raw", None), _Region):
        region = fileobj.raw
        if offset + member.size > region._size:
            return None
        fileobj, offset = region._file, region._start + offset
    if not (isinstance(fileobj, io.BufferedReader) and isinstance(fileobj.raw, io.FileIO)):
        return None
    return offset if offset + member.size <= os.fstat(fileobj.fileno()).st_size else None


#: File systems whose reads cost no round trip: there the workers read an uncompressed tar's members in
#: place, in parallel, as they read files; elsewhere (NFS, Lustre, GPFS, sshfs and other FUSE file systems)
#: the one sequential read of the packing process hands them the bytes.
LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "jfs",
                                "reiserfs", "tmpfs", "ramfs", "overlay"})


def on_local_disk(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on one of :data:`LOCAL_FILE_SYSTEMS` (Linux's /proc/self/mounts; False elsewhere)."""
    real = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as mounts:
            lines = mounts.read().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040 is a space
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind in LOCAL_FILE_SYSTEMS


def member_file(tar: tarfile.TarFile, member: tarfile.TarInfo) -> BinaryIO:
    """A regular member as a file object, to read a tar inside a tar without loading it."""
    assert tar.fileobj is not None
    return io.BufferedReader(_Region(tar.fileobj, member.offset_data, member.size), 1 << 16)


class _Region(io.RawIOBase):
    """Bytes ``[start, start + size)`` of a tar's file object, read in place.

    Unlike :meth:`tarfile.TarFile.extractfile`, a read that meets the end of
    the file returns what there is, so a tar read through it finds where a
    truncated archive ends instead of failing a read-ahead before that point.
    Over a compressed tar's stream it is read forwards only, as the stream is.
    """

    def __init__(self, fileobj, start: int, size: int) -> None:
        super().__init__()
        self._file, self._start, self._size, self._position = fileobj, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return _seekable(self._file)

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + position)
        return self._position

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self._size - self._position)
        if want <= 0:
            return 0
        self._file.seek(self._start + self._position)
        data = self._file.read(want)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


# ---------------------------------------------------------------------------- member paths
def member_path(name: str) -> str | None:
    """The path ``tar x`` extracts a member to, relative to where it extracts; None if it leaves that folder."""
    path = posixpath.normpath(name.lstrip("/"))
    if path == ".." or path.startswith("../"):
        return None
    return "" if path == "." else path


def is_hidden(path: str) -> bool:
    """A path with a folder or file name that starts with a dot: the folder source ignores it."""
    return any(part.startswith(".") for part in path.split("/"))


def extracted_file(member: tarfile.TarInfo) -> str | None:
    """The path of a member as the folder source would list it once ``tar x`` extracted it; None for a
    folder, a hidden path, the top folder itself, or a path outside it."""
    path = member_path(member.name)
    if not path or member.isdir() or is_hidden(path):
        return None
    return path


SECOND_MEMBER = "a second member of the same name in this tar; packed once, the first"


def second_member(path: str, read: set[str]) -> str | None:
    """Why a member is skipped as the second of its path in one tar (:data:`SECOND_MEMBER`), or None; the
    path is then one of ``read``."""
    if path in read:
        return SECOND_MEMBER
    read.add(path)
    return None


def tree_key(path: str) -> tuple[tuple[int, str], ...]:
    """Sorts the paths of one class folder as the folder source walks them.

    In each folder, its files (by name) come before its sub-folders (by name,
    each walked whole): ``b.jpg`` < ``z.jpg`` < ``a/x.jpg`` < ``a/sub/y.jpg`` < ``c/x.jpg``.
    """
    *folders, name = path.split("/")
    return (*((1, folder) for folder in folders), (0, name))


def member_kind(member: tarfile.TarInfo) -> str | None:
    """None for a regular file, else what it is, as a skip names it ("a symbolic link to x.jpg")."""
    if member.isreg():
        return "not a regular file (a sparse file)" if member.issparse() else None
    if member.issym():
        return f"a symbolic link to {member.linkname} (links in an archive are not followed)"
    if member.islnk():
        return f"a hard link to {member.linkname} (links in an archive are not followed)"
    if member.isdir():
        return "not a regular file (a folder)"
    kind = {tarfile.FIFOTYPE: "a FIFO", tarfile.CHRTYPE: "a character device",
            tarfile.BLKTYPE: "a block device"}.get(member.type, f"tar type {member.type!r}")
    return f"not a regular file ({kind})"
