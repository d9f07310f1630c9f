"""One bad record never loses the run (skipped and named, or --strict stops); names are kept exactly;
a cut LMDB is one line.

Mechanisms: each record is processed inside one boundary that turns any
failure into a named skip (:func:`dimd.pack.packer.process_task`), with the
JPEG size limit checked before decoding (:func:`dimd.pack.imaging.target_size`);
names are stored by :func:`dimd.format.escape_name` (lossless, listed in
``escaped_names``); ``data.mdb`` is checked against its own header first.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
from conftest import run_dimd, run_mpi_dimd
from hostile import jpeg, one_error_line, small_tree
from PIL import Image

from dimd.errors import DimdError
from dimd.format import ESCAPED_NAMES, PackedDataset, escape_name, unescape_name
from dimd.pack.caffe_datum import Datum
from dimd.pack.packer import PackConfig, pack


def test_images_too_long_for_a_jpeg_are_skipped_and_named(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 2})
    Image.new("RGB", (1, 5000), (9, 9, 9)).save(root / "a" / "tall.png")
    Image.new("L", (5000, 1), 9).save(root / "a" / "wide.png")
    Image.new("RGB", (256, 65500), (9, 9, 9)).save(root / "a" / "fits.png")  # exactly the limit: packed
    proc = run_dimd("pack", root, "-o", tmp_path / "x", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "skipped.txt").read_text().splitlines() == [
        "a/tall.png\t1x5000 resized to a short side of 256 would be 256x1280000, longer than a JPEG "
        "can be (65500 px)",
        "a/wide.png\t5000x1 resized to a short side of 256 would be 1280000x256, longer than a JPEG "
        "can be (65500 px)",
    ]
    ds = PackedDataset(tmp_path / "x")
    assert ds.names == ["a/0.jpg", "a/1.jpg", "a/fits.png"]
    assert (int(ds.records["height"][2]), int(ds.records["width"][2])) == (65500, 256)


def test_past_twenty_skips_stderr_says_more_follow_and_the_file_names_them_all(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 1})
    for i in range(25):
        (root / "a" / f"broken{i:02}.jpg").write_bytes(b"not a jpeg")
    proc = run_dimd("pack", root, "-o", tmp_path / "x", "--skipped", tmp_path / "skipped.txt")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dimd: skip")]
    assert len(lines) == 21 and lines[-1].startswith("dimd: skipping more; the rest are not named here")
    assert len((tmp_path / "skipped.txt").read_text().splitlines()) == 25
    assert "packed 1 images in 1 classes (25 skipped)" in proc.stdout


def test_a_raw_datum_too_long_for_a_jpeg_is_skipped(tmp_path):
    with lmdb.open(str(tmp_path / "db"), map_size=1 << 24) as env, env.begin(write=True) as txn:
        txn.put(b"0", Datum(data=jpeg((60, 50)), label=0, encoded=True).SerializeToString())
        txn.put(b"1", Datum(channels=1, height=1, width=3000, data=bytes(3000), label=0).SerializeToString())
        txn.put(b"2", Datum(channels=3, height=4000, width=2, data=bytes(24000), label=1).SerializeToString())
    result = pack(PackConfig(tmp_path / "db", tmp_path / "x", workers=2))
    assert result.images == 1
    assert [name for name, _ in result.skipped] == ["1", "2"]
    assert all("longer than a JPEG can be (65500 px)" in reason for _, reason in result.skipped)


def test_an_unforeseen_failure_of_one_record_is_a_named_skip(tmp_path, monkeypatch):
    import dimd.pack.imaging as imaging

    root = small_tree(tmp_path / "tree", {"a": 3})
    real = imaging.resize_encoded
    target = (root / "a" / "1.jpg").read_bytes()

    def flaky(data, *args, **kwargs):
        if data == target:
            raise RuntimeError("a bug nobody foresaw")
        return real(data, *args, **kwargs)

    monkeypatch.setattr(imaging, "resize_encoded", flaky)
    result = pack(PackConfig(root, tmp_path / "x", workers=1))
    assert result.images == 2
    assert result.skipped == [("a/1.jpg", "failed (RuntimeError: a bug nobody foresaw)")]


@pytest.fixture
def undecodable_names(tmp_path):
    """A class folder and files whose names are not UTF-8, and one with a real backslash."""
    root = small_tree(tmp_path / "tree", {"ok": 1})
    bad_dir = os.path.join(os.fsencode(root), b"caf\xe9")
    os.mkdir(bad_dir)
    for name in (b"\xff.jpg", b"back\\slash \xfe.jpg"):
        with open(os.path.join(bad_dir, name), "wb") as f:
            f.write(jpeg((50, 40)))
    with open(os.path.join(os.fsencode(root), b"ok", b"x\\y.jpg"), "wb") as f:  # valid UTF-8: as is
        f.write(jpeg((50, 40)))
    return root


@pytest.mark.mpi
def test_names_that_are_not_utf8_are_stored_losslessly(undecodable_names, tmp_path):
    root = undecodable_names
    proc = run_dimd("pack", root, "-o", tmp_path / "x", "--json", tmp_path / "x.json")
    assert proc.returncode == 0, proc.stderr
    ds = PackedDataset(tmp_path / "x")
    assert ds.classes == ["caf\\xe9", "ok"]
    assert ds.names == ["caf\\xe9/back\\\\slash \\xfe.jpg", "caf\\xe9/\\xff.jpg", "ok/0.jpg", "ok/x\\y.jpg"]
    with h5py.File(tmp_path / "x.idx.h5") as f:
        assert f[ESCAPED_NAMES][...].tolist() == [0, 1]
    # The exact bytes come back, and name the real files.
    assert [os.fsencode(n) for n in ds.source_names] == [
        b"caf\xe9/back\\slash \xfe.jpg", b"caf\xe9/\xff.jpg", b"ok/0.jpg", b"ok/x\\y.jpg"]
    assert all(os.path.isfile(os.path.join(root, n)) for n in ds.source_names)
    assert json.loads((tmp_path / "x.json").read_text())["result"]["images"] == 4
    info = run_dimd("inspect", tmp_path / "x", check=True).stdout
    assert "caf\\xe9: 2" in info
    assert run_dimd("verify", tmp_path / "x", check=True).stdout.startswith("ok: 4 records")
    proc = run_mpi_dimd(2, "shuffle", tmp_path / "x", "--verify", "--rounds", "2", timeout=120)
    assert proc.returncode == 0 and "every round verified" in proc.stdout, proc.stderr


def test_an_undecodable_image_with_an_undecodable_name_is_named_readably(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 1})
    with open(os.path.join(os.fsencode(root), b"a", b"\xffbad.jpg"), "wb") as f:
        f.write(b"not an image")
    proc = run_dimd("pack", root, "-o", tmp_path / "x", "--skipped", tmp_path / "skipped.txt",
                    "--json", tmp_path / "x.json")
    assert proc.returncode == 0, proc.stderr
    assert "dimd: skipped a/\\xffbad.jpg: not an image Pillow can read" in proc.stderr
    assert (tmp_path / "skipped.txt").read_text() == "a/\\xffbad.jpg\tnot an image Pillow can read\n"
    doc = json.loads((tmp_path / "x.json").read_text())
    assert doc["result"]["skipped_images"] == [{"name": "a/\\xffbad.jpg", "reason": "not an image Pillow can read"}]


def test_lmdb_keys_that_are_not_utf8_round_trip(tmp_path):
    with lmdb.open(str(tmp_path / "db"), map_size=1 << 24) as env, env.begin(write=True) as txn:
        txn.put(b"plain", Datum(data=jpeg((40, 40)), label=0, encoded=True).SerializeToString())
        txn.put(b"\x00\xff\\key", Datum(data=jpeg((40, 40)), label=0, encoded=True).SerializeToString())
    pack(PackConfig(tmp_path / "db", tmp_path / "x", workers=1))
    ds = PackedDataset(tmp_path / "x")
    assert ds.names == ["\\x00\\xff\\\\key", "plain"]  # a NUL is escaped too: HDF5 strings end there
    assert unescape_name(ds.names[0]).encode("utf-8", "surrogateescape") == b"\x00\xff\\key"
    with h5py.File(tmp_path / "x.idx.h5") as f:
        assert f[ESCAPED_NAMES][...].tolist() == [0]


@pytest.mark.parametrize("name", ["plain.jpg", "x\\y.jpg", "\udcff.jpg", "a\\\udcfe\\\\b", "\udc80",
                                  "nul\0in.jpg"])
def test_escape_and_unescape_are_inverse(name):
    stored = escape_name(name)
    stored.encode("utf-8")  # always valid UTF-8
    if stored != name:
        assert unescape_name(stored) == name


@pytest.mark.parametrize("keep", [0, 100, 8192, "half", "last page"])
def test_a_truncated_data_mdb_is_one_line_not_sigbus(tmp_path, keep):
    with lmdb.open(str(tmp_path / "db"), map_size=1 << 26) as env, env.begin(write=True) as txn:
        for i in range(40):
            pixels = np.random.default_rng(i).integers(0, 255, (120, 120, 3), np.uint8)
            txn.put(b"%03d" % i, Datum(channels=3, height=120, width=120, data=pixels.tobytes(),
                                        label=i % 2).SerializeToString())
    data = tmp_path / "db" / "data.mdb"
    size = data.stat().st_size
    cut = {"half": size // 2, "last page": size - 4096}.get(keep, keep)  # type: ignore[arg-type]
    os.truncate(data, cut)
    proc = run_dimd("pack", tmp_path / "db", "-o", tmp_path / "x", timeout=60)
    line = one_error_line(proc)
    if cut < 16 + 136:
        assert line == f"{data}: {cut} bytes, too short for an LMDB header (truncated?)"
    elif cut < 8192:
        assert line.startswith(f"{data}: ") and "LMDB" in line
    else:
        assert line == (f"{data}: truncated: the file is {cut:,} bytes but its LMDB header says its "
                        f"pages reach byte {size:,} (an interrupted copy?)")
    assert not (tmp_path / "x.dimd").exists()


@pytest.fixture
def tree_with_bad_images(sample_tree, tmp_path) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(sample_tree, root)
    first_class = sorted(p for p in root.iterdir())[0]
    good = sorted(first_class.iterdir())[0]
    (first_class / "empty.jpg").write_bytes(b"")
    (first_class / "garbage.jpg").write_bytes(b"this is text, not a JPEG" * 10)
    (first_class / "truncated.jpg").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return root


def test_bad_images_are_skipped_named_and_listed(tree_with_bad_images, tmp_path):
    skipped = []
    result = pack(PackConfig(tree_with_bad_images, tmp_path / "out", workers=2),
                  on_skip=lambda name, reason: skipped.append((name, reason)))
    assert result.images == 48
    reasons = {name.split("/")[-1]: reason for name, reason in result.skipped}
    assert skipped == result.skipped
    assert reasons["empty.jpg"] == "empty file"
    assert reasons["garbage.jpg"] == "not an image Pillow can read"
    assert "truncated" in reasons["truncated.jpg"]
    assert PackedDataset(tmp_path / "out").attrs["skipped"] == 3


def test_cli_skipped_file_and_strict(tree_with_bad_images, tmp_path):
    proc = run_dimd("pack", tree_with_bad_images, "-o", tmp_path / "out",
                    "--skipped", tmp_path / "skipped.tsv", check=True)
    assert "(3 skipped)" in proc.stdout
    assert proc.stderr.count("dimd: skipped ") == 3
    lines = (tmp_path / "skipped.tsv").read_text().splitlines()
    assert [line.split("\t")[0].split("/")[-1] for line in lines] == \
        ["empty.jpg", "garbage.jpg", "truncated.jpg"]
    strict = run_dimd("pack", tree_with_bad_images, "-o", tmp_path / "strict", "--strict")
    assert strict.returncode == 1
    assert "empty.jpg: empty file (--strict stops at the first bad image)" in strict.stderr
    assert "Traceback" not in strict.stderr
    assert list(tmp_path.glob("strict*")) == [] and list(tmp_path.glob(".strict*")) == []


def test_source_with_only_bad_images_fails(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(b"")
    with pytest.raises(DimdError, match="none of its 1 images could be packed"):
        pack(PackConfig(tmp_path / "src", tmp_path / "out", workers=1))
    assert list(tmp_path.glob("out*")) == []
