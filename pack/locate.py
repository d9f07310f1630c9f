"""Which source SRC is: a folder, an LMDB, a tar of per-class tars, a flat tar, WebDataset shards, Parquet.

SRC may be several paths, a pattern (``train-{000000..000146}.tar`` as
webdataset writes ranges, ``data/train-*.parquet``), or a text file listing
them, one per line (relative to the list's folder). A file is recognised by
its first bytes, not its name: ``PAR1`` is Parquet; a tar header or a
gzip/bzip2/xz/zstd stream is a tar; text is a list of files. One tar is
looked into: per-class tars make it ImageNet's training tar, samples with a
``.cls`` or ``.json`` member a WebDataset shard; with ``list_file`` it is a
flat tar. Several tars are WebDataset shards.

Each option that applies to one kind of source is refused, in one line,
with any other, so a typo never goes unnoticed.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tarfile
from pathlib import Path
from typing import Iterator

from dimd.errors import DimdError, describe
from dimd.pack.config import PackConfig
from dimd.pack.sources import LMDB_DATA_FILE, Source, open_source, read_classes_file, read_lines, read_list
from dimd.pack.streamed import StreamedSource
from dimd.pack.tar_stream import ArchiveProblem, compression, extracted_file, members, open_tar

#: How many members of a single tar are looked at to tell its layout.
PEEK_MEMBERS = 64
_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)\}")


def open_pack_source(config: PackConfig) -> Source | StreamedSource:
    """The source ``config.src`` names, its options checked; one line naming the problem otherwise."""
    files: list[Path] = []
    for path in config.sources:
        if _is_pattern(str(path)):
            matched = expand(str(path))
            if not matched:
                raise DimdError(f"{path}: no file matches this pattern")
            files.extend(matched)
        else:
            files.append(path)
    if len(files) > 1:
        return _files_source(config, config.shown_src, files)
    path = _must_exist(files[0])
    if path.is_dir() or path.name == LMDB_DATA_FILE:
        _only(config, path, "folder")
        return open_source(path, config.list_file, config.classes_file)
    kind = file_kind(path)
    if kind == "list":
        return _files_source(config, str(path), list(_listed(path)))
    if kind == "tar":
        return _tar_source(config, path)
    if kind == "parquet":
        return _files_source(config, str(path), [path])
    raise DimdError(f"{path}: not a folder, a tar, a Parquet file or a list of them")


# ---------------------------------------------------------------------------- patterns and lists
def expand(pattern: str) -> list[Path]:
    """Brace ranges and lists (``{000000..000146}``, ``{a,b}``), then glob characters; sorted per glob."""
    paths: list[Path] = []
    for text in expand_braces(pattern):
        if glob.has_magic(text):
            paths.extend(Path(p) for p in sorted(glob.glob(text)))
        elif os.path.lexists(text):
            paths.append(Path(text))
        else:
            raise DimdError(f"{text}: no such file (from {pattern})")
    return paths


def expand_braces(text: str) -> list[str]:
    """``a-{00..02}.tar`` -> ``a-00.tar a-01.tar a-02.tar`` (zero padding kept); ``{x,y}`` -> each; nested."""
    start = text.find("{")
    if start < 0:
        return [text]
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            break
    else:
        return [text]  # an unmatched brace is part of a name
    inner, head, tail = text[start + 1:end], text[:start], text[end + 1:]
    numbers = _RANGE.fullmatch("{" + inner + "}")
    if numbers:
        first, last = numbers.group(1), numbers.group(2)
        width = len(first) if first.lstrip("-").startswith("0") else 0
        step = 1 if int(last) >= int(first) else -1
        choices = [str(n).zfill(width) for n in range(int(first), int(last) + step, step)]
    else:
        choices = _split_top(inner)
        if len(choices) < 2:
            return [head + "{" + c + "}" + t for c in choices for t in expand_braces(tail)]
    return [head + c + t for choice in choices for c in expand_braces(choice) for t in expand_braces(tail)]


def _split_top(inner: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in inner:
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        current.append(char)
    parts.append("".join(current))
    return parts


def _is_pattern(text: str) -> bool:
    if os.path.lexists(text):  # a file whose name holds [ or { is itself
        return False
    return glob.has_magic(text) or len(expand_braces(text)) > 1 or _RANGE.search(text) is not None


def _listed(list_path: Path) -> Iterator[Path]:
    """The files a list names, one per line (blank lines and ``#`` comments aside), relative to its folder."""
    for number, line in enumerate(read_lines(list_path, "list of files"), 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        full = entry if os.path.isabs(entry) else os.path.join(list_path.parent, entry)
        try:
            yield from expand(full) if _is_pattern(entry) else [_must_exist(Path(full))]
        except DimdError as exc:
            raise DimdError(f"{list_path}:{number}: {exc}") from None


def file_kind(path: Path) -> str:
    """"tar", "parquet", "list" (text) or "unknown", from the first bytes of ``path``."""
    try:
        with open(path, "rb") as f:
            head = f.read(tarfile.BLOCKSIZE)
    except OSError as exc:
        raise DimdError(f"{path}: cannot read ({describe(exc)})") from None
    if not head:
        raise DimdError(f"{path}: an empty file")
    if head.startswith(b"PAR1"):
        return "parquet"
    if compression(head) is not None or _tar_header(head):
        return "tar"
    if b"\0" not in head:
        try:
            head.decode("utf-8")
            return "list"
        except UnicodeDecodeError:
            pass
    return "tar" if path.name.lower().endswith((".tar", ".tgz", ".tar.gz")) else "unknown"


def _tar_header(block: bytes) -> bool:
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _must_exist(path: Path) -> Path:
    if not os.path.lexists(path):
        raise DimdError(f"{path}: no such file or directory")
    return path


# ---------------------------------------------------------------------------- the sources
def _tar_source(config: PackConfig, path: Path) -> StreamedSource:
    from dimd.pack.tar_source import ListedTarSource, NestedTarSource

    if config.list_file is not None:
        _only(config, path, "flat tar")
        classes = read_classes_file(config.classes_file) if config.classes_file is not None else None
        return ListedTarSource(path, config.list_file, read_list(config.list_file, classes), classes)
    layout = tar_layout(path)
    if layout == "webdataset":
        return _files_source(config, str(path), [path])
    _only(config, path, "tar of tars")
    if layout == "images":
        raise DimdError(f"{path}: a tar of images without `list_file`: give `list_file` (as for ImageNet's "
                        "val tar), or, for a WebDataset shard, a KEY.cls or KEY.json beside each KEY.jpg")
    return NestedTarSource(path)


def tar_layout(path: Path) -> str:
    """"tars" (a tar of per-class tars), "webdataset" or "images" (a flat tar), from its first members."""
    from dimd.pack.imaging import IMAGE_EXTENSIONS
    from dimd.pack.webdataset import LABEL_EXTENSIONS, split_key

    first_key, extensions = None, set()
    try:
        with open_tar(path) as tar:
            for count, member in enumerate(members(tar)):
                name = extracted_file(member)
                if count >= PEEK_MEMBERS or (name is not None and _sample_ends(name, first_key)):
                    break
                if name is None:
                    continue
                if first_key is None and name.lower().endswith(".tar"):
                    return "tars"
                split = split_key(name)
                if split is not None:
                    first_key = split[0]
                    extensions.add(split[1])
    except ArchiveProblem as problem:
        if not problem.member and first_key is None:
            raise DimdError(f"{path}: {problem.reason}") from None
    if first_key is None:
        raise DimdError(f"{path}: holds no images (no per-class tars, no samples)")
    if extensions & set(LABEL_EXTENSIONS):
        return "webdataset"
    if any(f".{e}" in IMAGE_EXTENSIONS for e in extensions):
        return "images"
    return "webdataset"


def _sample_ends(name: str, first_key: str | None) -> bool:
    from dimd.pack.webdataset import split_key

    split = split_key(name)
    return first_key is not None and (split is None or split[0] != first_key)


def _files_source(config: PackConfig, shown: str, files: list[Path]) -> StreamedSource:
    """Several files (or one shard or Parquet file): all tars (WebDataset) or all Parquet."""
    from dimd.pack.parquet_source import ParquetSource
    from dimd.pack.webdataset import WebDatasetSource

    if not files:
        raise DimdError(f"{shown}: names no files")
    kinds: dict[str, Path] = {}
    for path in files:
        if path.is_dir():
            raise DimdError(f"{path}: a folder among several sources; a folder is packed on its own")
        kind = file_kind(_must_exist(path))
        if kind not in ("tar", "parquet"):
            raise DimdError(f"{path}: not a tar (WebDataset shard) or a Parquet file")
        kinds.setdefault(kind, path)
    if len(kinds) > 1:
        raise DimdError(f"{kinds['tar']} is a tar and {kinds['parquet']} a Parquet file: pack them apart")
    kind = next(iter(kinds))
    unique, rejected = _once_each(files)
    classes = read_classes_file(config.classes_file) if config.classes_file is not None else None
    if kind == "tar":
        _only(config, Path(shown), "webdataset")
        return WebDatasetSource(unique, shown, classes, config.label_field, rejected)
    _only(config, Path(shown), "parquet")
    return ParquetSource(unique, shown, classes, config.image_column, config.label_column, rejected)


def _once_each(files: list[Path]) -> tuple[list[Path], list[tuple[str, str]]]:
    """Each file once (by device and inode); the later namings are rejected, named."""
    seen: dict[tuple[int, int], Path] = {}
    unique, rejected = [], []
    for path in files:
        st = os.stat(path)
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first is path:
            unique.append(path)
        else:
            same = "" if str(first) == str(path) else f" (as {first})"
            rejected.append((str(path), f"named twice{same}; read once"))
    return unique, rejected


#: The options that apply to some kinds of source only: field -> the kinds it applies to.
_APPLIES_TO = {
    "list_file": ("folder", "flat tar"),
    "classes_file": ("folder", "flat tar", "webdataset", "parquet"),
    "label_field": ("webdataset",),
    "image_column": ("parquet",),
    "label_column": ("parquet",),
}


def _only(config: PackConfig, src: Path, kind: str) -> None:
    """Refuse an option given for a kind of source it does not apply to."""
    defaults = {f.name: f.default for f in dataclasses.fields(PackConfig)}
    for name, kinds in _APPLIES_TO.items():
        if kind not in kinds and getattr(config, name) != defaults[name]:
            what = {"folder": "a folder", "flat tar": "a flat tar", "tar of tars": "a tar of per-class tars",
                    "webdataset": "WebDataset shards", "parquet": "Parquet files"}[kind]
            hint = " (its classes are its inner tars' names)" if name == "classes_file" else ""
            raise DimdError(f"{src}: is {what}; `{name}` does not apply to it{hint}")
