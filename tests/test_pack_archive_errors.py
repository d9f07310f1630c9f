"""Bad archives, as bad files are for the folder sources (docs/policies.md): each bad member or archive is
skipped and named (`--skipped`), or, with `--strict`, refused in one line; a source dimd cannot read at
all is one line before any work; an interrupted pack leaves nothing behind.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BENCH, DIMD, invoke_dimd
from hostile import jpeg, one_error_line, small_tree, temporaries
from PIL import Image

from dimd.format import PackedDataset
from dimd.pack.config import IMAGE_SIZE, LABEL_SIZE
from dimd.pack.tar_stream import readable_compression

sys.path.insert(0, str(BENCH / "probes"))
import archive_copies  # bench/probes/: shared with bench/probes/pack_archives.py

TRUNCATED = "truncated (end of file inside the member)"


def add(tar: tarfile.TarFile, name: str, data: bytes, kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname = (len(data) if kind == tarfile.REGTYPE else 0), kind, link
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            add(tar, name, data)
    return buffer.getvalue()


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    path.write_bytes(tar_bytes(members))
    return path


def pack(*args) -> subprocess.CompletedProcess:
    """``dimd pack ARGS`` with one worker (no pool: it runs in this process), small outputs."""
    return invoke_dimd("pack", *args, "--workers", "1", "--short-side", "16", "-q")


def skipped(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


@pytest.fixture
def tiny(tmp_path) -> Path:
    return small_tree(tmp_path / "tiny", {"a": 3, "b": 3}, size=(24, 16))


# ---------------------------------------------------------------------------- tars
def test_a_truncated_tar_names_the_member_it_ends_in_and_keeps_what_came_before(tiny, tmp_path):
    archive = archive_copies.write_nested_tar(tiny, tmp_path / "train.tar")
    with tarfile.open(archive) as outer:
        inner_member = outer.getmember("b.tar")
        with tarfile.open(fileobj=outer.extractfile(inner_member)) as inner:
            image = inner.getmember("1.jpg")
    cut = inner_member.offset_data + image.offset_data + image.size // 2
    archive.write_bytes(archive.read_bytes()[:cut])

    proc = pack(archive, "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    assert skipped(tmp_path / "skipped.txt") == [[f"{archive}: b.tar/1.jpg", TRUNCATED]]
    assert PackedDataset(tmp_path / "out").names == ["a/0.jpg", "a/1.jpg", "a/2.jpg", "b/0.jpg"]

    strict = pack(archive, "-o", tmp_path / "strict", "--strict")
    assert one_error_line(strict) == f"{archive}: b.tar/1.jpg: {TRUNCATED} (--strict stops at the first bad image)"
    assert not list(tmp_path.glob("strict*")) and not temporaries(tmp_path)


def test_a_tar_cut_between_members_is_named_truncated(tiny, tmp_path):
    archive = archive_copies.write_nested_tar(tiny, tmp_path / "train.tar")
    with tarfile.open(archive) as outer:
        second = outer.getmember("b.tar")
    archive.write_bytes(archive.read_bytes()[:second.offset])   # no b.tar, no end-of-archive blocks
    proc = pack(archive, "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    [[where, reason]] = skipped(tmp_path / "skipped.txt")
    assert where == str(archive) and reason.startswith("truncated (it ends after a.tar, without the end-of-archive")
    assert PackedDataset(tmp_path / "out").classes == ["a"]


def test_an_inner_tar_that_is_not_a_tar_keeps_its_class_empty(tiny, tmp_path):
    archive = write_tar(tmp_path / "train.tar", {"a.tar": tar_bytes({"0.jpg": jpeg((20, 20))}),
                                                 "b.tar": b"\x01" * 3000})
    proc = pack(archive, "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    [[where, reason]] = skipped(tmp_path / "skipped.txt")
    assert where == f"{archive}: b.tar"
    assert reason.startswith("not a tar archive (") and reason.endswith("; its class is kept, empty")
    ds = PackedDataset(tmp_path / "out")
    assert ds.classes == ["a", "b"] and ds.names == ["a/0.jpg"]
    strict = pack(archive, "-o", tmp_path / "strict", "--strict")
    assert one_error_line(strict).startswith(f"{archive}: b.tar: not a tar archive (")


def test_members_that_are_not_images_or_do_not_decode_are_skipped_and_named(tmp_path):
    good = jpeg((20, 20))
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w") as tar:
        add(tar, "0.jpg", good)
        add(tar, "bad.jpg", b"not an image at all")
        add(tar, "cut.jpg", good[: len(good) // 2])
        add(tar, "notes.txt", b"ignored: not an image name")
        add(tar, "._0.jpg", b"ignored: hidden (macOS AppleDouble)")
        add(tar, "link.jpg", b"", tarfile.SYMTYPE, "0.jpg")
        add(tar, "fifo.jpg", b"", tarfile.FIFOTYPE)
    archive = write_tar(tmp_path / "train.tar", {"c.tar": inner.getvalue()})
    proc = pack(archive, "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    reasons = dict(skipped(tmp_path / "skipped.txt"))
    assert list(reasons) == [f"{archive}: c.tar/{name}" for name in ("bad.jpg", "cut.jpg", "link.jpg", "fifo.jpg")]
    assert reasons[f"{archive}: c.tar/bad.jpg"] == "not an image Pillow can read"
    assert reasons[f"{archive}: c.tar/cut.jpg"].startswith(("unreadable image (", "cannot decode ("))
    assert reasons[f"{archive}: c.tar/link.jpg"].startswith("a symbolic link to 0.jpg")
    assert reasons[f"{archive}: c.tar/fifo.jpg"] == "not a regular file (a FIFO)"
    assert PackedDataset(tmp_path / "out").names == ["c/0.jpg"]


def test_a_zstd_tar_is_refused_in_one_line_where_tarfile_cannot_read_it(tmp_path):
    if readable_compression("zst"):
        pytest.skip("this Python's tarfile reads zstd")
    archive = tmp_path / "train.tar.zst"
    archive.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(100))
    assert one_error_line(pack(archive, "-o", tmp_path / "out")) == (
        f"{archive}: a zstd-compressed tar, which this Python's tarfile cannot read; decompress it first "
        f"(zstd -d train.tar.zst)")


def test_sources_dimd_cannot_read_are_refused_in_one_line_before_any_work(tiny, tmp_path):
    flat = write_tar(tmp_path / "val.tar", {"x.jpg": jpeg((8, 8)), "y.jpg": jpeg((8, 8))})
    assert one_error_line(pack(flat, "-o", tmp_path / "out")).startswith(
        f"{flat}: a tar of images without --list: give --list (as for ImageNet's val tar)")
    listing = tmp_path / "val.txt"
    listing.write_text("x.jpg 0\nz.jpg 1\n")
    assert one_error_line(pack(flat, "--list", listing, "-o", tmp_path / "out")) == (
        f"{listing}:2: z.jpg: no such member in {flat}")
    (tmp_path / "empty.tar").write_bytes(b"")
    empty = tmp_path / "empty.tar"
    assert one_error_line(pack(empty, "-o", tmp_path / "out")) == f"{empty}: an empty file"
    (tmp_path / "noise.bin").write_bytes(bytes(range(256)) * 4)
    assert one_error_line(pack(tmp_path / "noise.bin", "-o", tmp_path / "out")) == (
        f"{tmp_path / 'noise.bin'}: not a folder, a tar, a Parquet file or a list of them")
    nested = archive_copies.write_nested_tar(tiny, tmp_path / "train.tar")
    assert one_error_line(pack(nested, "--label-field", "cls_id", "-o", tmp_path / "out")) == (
        f"{nested}: is a tar of per-class tars; --label-field does not apply to it")
    assert one_error_line(pack(nested, "--classes-file", listing, "-o", tmp_path / "out")) == (
        f"{nested}: is a tar of per-class tars; --classes-file does not apply to it (its classes are its inner "
        "tars' names)")
    assert one_error_line(pack(tmp_path / "train-{0..3}.tar", "-o", tmp_path / "out")) == (
        f"{tmp_path / 'train-0.tar'}: no such file (from {tmp_path / 'train-{0..3}.tar'})")
    assert not list(tmp_path.glob("out*")) and not temporaries(tmp_path)


# ---------------------------------------------------------------------------- WebDataset
def test_webdataset_samples_without_one_label_are_skipped_and_named(tmp_path):
    image = jpeg((20, 20))
    shard = tmp_path / "shard-0.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in [("ok.jpg", image), ("ok.cls", b"1\n"),
                           ("unlabelled.jpg", image),
                           ("nofield.json", b'{"other": 2}'), ("nofield.png", image),
                           ("two.cls", b"0"), ("two.json", b'{"label": 3}'), ("two.jpg", image),
                           ("twice.cls", b"0"), ("twice.cls", b"1"), ("twice.jpg", image),
                           ("noimage.cls", b"2"),
                           ("agree.cls", b"2"), ("agree.json", b'{"label": 2}'), ("agree.webp", b"RIFF....")]:
            add(tar, name, data)
    proc = pack(shard, "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    assert skipped(tmp_path / "skipped.txt") == [
        [f"{shard}: unlabelled", "no label (no unlabelled.cls or unlabelled.json)"],
        [f"{shard}: nofield", "no label: nofield.json has no 'label' and there is no nofield.cls"],
        [f"{shard}: two", "two labels: two.cls says 0, two.json's 'label' says 3"],
        [f"{shard}: twice", "two twice.cls members"],
        [f"{shard}: noimage", "no image (.jpg, .jpeg, .png, .webp)"],
        [f"{shard}: agree.webp", "not an image Pillow can read"],  # its two labels agree: only its bytes are bad
    ]
    assert PackedDataset(tmp_path / "out").names == ["shard-0.tar/ok.jpg"]
    strict = pack(shard, "-o", tmp_path / "strict", "--strict")
    assert one_error_line(strict) == (f"{shard}: unlabelled: no label (no unlabelled.cls or unlabelled.json) "
                                      "(--strict stops at the first bad image)")


def test_a_label_member_over_the_label_limit_is_skipped_naming_that_limit(tmp_path):
    """A KEY.cls of 1 MiB and one byte is no label: its skip names the label limit, not the image one."""
    over = LABEL_SIZE.most + 1
    shard = write_tar(tmp_path / "shard-0.tar", {"ok.jpg": jpeg((20, 20)), "ok.cls": b"0",
                                                 "big.jpg": jpeg((20, 20)), "big.cls": b"1".ljust(over)})
    proc = pack(shard, "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    assert skipped(tmp_path / "skipped.txt") == [
        [f"{shard}: big", "big.cls: 1,048,577 bytes, more than a label member (KEY.cls or KEY.json) may have "
                          "(1,048,576)"]]
    assert PackedDataset(tmp_path / "out").names == ["shard-0.tar/ok.jpg"]


def sparse_tar(path: Path, name: str, size: int, then: dict[str, bytes]) -> Path:
    """A tar whose first member, ``name``, claims ``size`` bytes of zeros, written as a hole (no disk used)."""
    info = tarfile.TarInfo(name)
    info.size = size
    with open(path, "wb") as f:
        f.write(info.tobuf(format=tarfile.GNU_FORMAT))
        f.seek(-(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE, io.SEEK_CUR)
        f.write(tar_bytes(then))
    return path


@pytest.mark.parametrize("source", ["folder", "flat tar"])
def test_an_image_over_the_image_limit_is_skipped_unread_naming_that_limit(tmp_path, source):
    """A 1 GiB + 1 byte image (a sparse file, or a member claiming that size) is skipped before it is read."""
    over = IMAGE_SIZE.most + 1
    (tmp_path / "list.txt").write_text("huge.jpg 0\nsmall.jpg 1\n")
    if source == "folder":
        src = tmp_path / "images"
        src.mkdir()
        (src / "small.jpg").write_bytes(jpeg((20, 20)))
        with open(src / "huge.jpg", "wb") as f:
            f.truncate(over)
        where = "huge.jpg"
    else:
        src = sparse_tar(tmp_path / "val.tar", "huge.jpg", over, {"small.jpg": jpeg((20, 20))})
        where = f"{src}: huge.jpg"
    proc = pack(src, "--list", tmp_path / "list.txt", "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    assert skipped(tmp_path / "skipped.txt") == [
        [where, "1,073,741,825 bytes, more than an image file may have (1,073,741,824)"]]
    assert PackedDataset(tmp_path / "out").names == ["small.jpg"]


@pytest.mark.parametrize("source", ["tar of tars", "flat tar"])
def test_a_second_member_of_one_name_is_skipped_and_the_first_packed(tmp_path, source):
    """``x.jpg`` and ``./x.jpg`` extract to one file: the first (20x30, packed 16x24) is the record."""
    flat = write_tar(tmp_path / "flat.tar", {"x.jpg": jpeg((20, 30)), "./x.jpg": jpeg((30, 20))})
    if source == "flat tar":
        (tmp_path / "list.txt").write_text("x.jpg 0\n")
        src, options, where = flat, ("--list", tmp_path / "list.txt"), f"{flat}: ./x.jpg"
    else:
        src, options = write_tar(tmp_path / "train.tar", {"a.tar": flat.read_bytes()}), ()
        where = f"{src}: a.tar/./x.jpg"
    proc = pack(src, *options, "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    assert skipped(tmp_path / "skipped.txt") == [
        [where, "a second member of the same name in this tar; packed once, the first"]]
    assert PackedDataset(tmp_path / "out").records["height"].tolist() == [24]


def test_a_shard_named_twice_is_read_once_or_refused_before_any_work(tmp_path):
    shard = write_tar(tmp_path / "s-0.tar", {"k.jpg": jpeg((20, 20)), "k.cls": b"0"})
    proc = pack(shard, tmp_path / "s-{0..0}.tar", "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    assert skipped(tmp_path / "skipped.txt") == [[str(shard), "named twice; read once"]]
    assert len(PackedDataset(tmp_path / "out")) == 1
    strict = pack(shard, shard, "-o", tmp_path / "strict", "--strict")
    assert one_error_line(strict) == f"{shard}: named twice; read once (--strict stops at the first bad image)"


def test_a_truncated_shard_loses_its_rest_and_the_next_shard_is_read(tmp_path):
    first = write_tar(tmp_path / "s-0.tar", {"a.jpg": jpeg((20, 20)), "a.cls": b"0",
                                             "b.jpg": jpeg((30, 20)), "b.cls": b"1"})
    cut = first.read_bytes()
    first.write_bytes(cut[: cut.index(b"b.jpg") + 512 + 100])  # inside b.jpg's bytes
    write_tar(tmp_path / "s-1.tar", {"c.jpg": jpeg((20, 20)), "c.cls": b"1"})
    proc = pack(tmp_path / "s-{0..1}.tar", "-o", tmp_path / "out", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    assert skipped(tmp_path / "skipped.txt") == [[f"{first}: b.jpg", TRUNCATED]]
    assert PackedDataset(tmp_path / "out").names == ["s-0.tar/a.jpg", "s-1.tar/c.jpg"]


def test_a_parquet_source_without_pyarrow_is_refused_naming_the_extra(tmp_path, monkeypatch):
    from dimd.errors import DimdError
    from dimd.pack.packer import PackConfig, pack as pack_library

    data = tmp_path / "train-00000.parquet"
    data.write_bytes(b"PAR1" + bytes(64) + b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DimdError) as error:
        pack_library(PackConfig(data, tmp_path / "out", workers=1))
    assert str(error.value) == (f"{data}: reading Parquet needs pyarrow, which is not installed "
                                "(pip install 'dimd[parquet]')")
    assert not temporaries(tmp_path)


# ---------------------------------------------------------------------------- interrupted
@pytest.fixture(scope="module")
def slow_tar(tmp_path_factory) -> Path:
    """A tar of one class: 120 copies of a 4000 x 3000 PNG, about a second of work each."""
    root = tmp_path_factory.mktemp("slow")
    y, x = np.mgrid[0:3000, 0:4000]
    pixels = np.stack([(x // 7) % 256, (y // 5) % 256, ((x + y) // 11) % 256], -1).astype(np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG", compress_level=1)
    inner = tar_bytes({f"{i:03d}.png": png.getvalue() for i in range(120)})
    return write_tar(root / "train.tar", {"big.tar": inner})


@pytest.mark.parametrize("signum, line, code", [
    (signal.SIGTERM, "dimd: terminated (SIGTERM)", 143),
    (signal.SIGINT, "dimd: interrupted", 130),
])
def test_a_signal_mid_tar_pack_leaves_nothing_behind(slow_tar, tmp_path, signum, line, code):
    from test_cleanup import alive, children_of

    out = tmp_path / "out" / "x"
    proc = subprocess.Popen([*DIMD, "pack", slow_tar, "-o", out, "-q", "--workers", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not [p for p in out.parent.glob(f".{out.name}.dimd.tmp-*") if p.stat().st_size > 0]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    workers = children_of(proc.pid)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code and stderr.strip() == line, stderr
    assert list(out.parent.iterdir()) == []
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if alive(pid)]


def test_the_skips_are_in_the_json_summary(tiny, tmp_path):
    archive = write_tar(tmp_path / "train.tar", {"a.tar": tar_bytes({"0.jpg": jpeg((20, 20)), "1.jpg": b"x"})})
    pack(archive, "-o", tmp_path / "out", "--json", tmp_path / "pack.json")
    result = json.loads((tmp_path / "pack.json").read_text())["result"]
    assert result["skipped_images"] == [{"name": f"{archive}: a.tar/1.jpg", "reason": "not an image Pillow can read"}]
