"""`dimd pack --list`: list order, class names, clear errors for a bad list, and contradictions refused
with their line numbers.

A file (by device and inode, so ``x.jpg``, ``./x.jpg`` and a link to it are the
same file) keeps the line and label it first had; a classes file keeps the line
of each name (:func:`dimd.pack.sources.read_classes_file`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_dimd
from hostile import jpeg, one_error_line
from PIL import Image

from dimd.errors import DimdError
from dimd.format import PackedDataset
from dimd.pack.packer import PackConfig, pack


@pytest.fixture
def flat(tmp_path) -> Path:
    """An ImageNet-val-like flat folder: images, a 'file label' list and class names."""
    root = tmp_path / "val"
    root.mkdir()
    lines = []
    for i, (colour, label) in enumerate([((255, 0, 0), 2), ((0, 255, 0), 0), ((0, 0, 255), 1),
                                         ((255, 0, 0), 2)]):
        Image.new("RGB", (300 + 40 * i, 280), colour).save(root / f"img {i}.JPEG")
        lines.append(f"img {i}.JPEG {label}")  # names with spaces: the label is the last field
    (root / "labels.txt").write_text("\n".join(lines) + "\n\n")
    (root / "classes.txt").write_text("green\nblue\nred\n")
    return root


def test_list_packs_in_list_order_with_named_classes(flat, tmp_path):
    result = pack(PackConfig(flat, tmp_path / "val", list_file=flat / "labels.txt",
                             classes_file=flat / "classes.txt", workers=2))
    assert result.images == 4 and result.source_kind == "list"
    ds = PackedDataset(tmp_path / "val")
    assert ds.names == ["img 0.JPEG", "img 1.JPEG", "img 2.JPEG", "img 3.JPEG"]
    assert ds.labels.tolist() == [2, 0, 1, 2]
    assert ds.classes == ["green", "blue", "red"]
    assert ds.records["width"].tolist() == [round((300 + 40 * i) * 256 / 280) for i in range(4)]


def test_list_without_classes_file_names_classes_by_label(flat, tmp_path):
    pack(PackConfig(flat, tmp_path / "val", list_file=flat / "labels.txt", workers=1))
    assert PackedDataset(tmp_path / "val").classes == ["0", "1", "2"]


def test_a_byte_order_mark_is_not_part_of_the_first_name(flat, tmp_path):
    """Windows editors start UTF-8 files with a BOM: it is no part of the first file or class name."""
    for name in ("labels.txt", "classes.txt"):
        (flat / name).write_bytes(b"\xef\xbb\xbf" + (flat / name).read_bytes())
    pack(PackConfig(flat, tmp_path / "val", list_file=flat / "labels.txt",
                    classes_file=flat / "classes.txt", workers=1))
    ds = PackedDataset(tmp_path / "val")
    assert ds.names[0] == "img 0.JPEG" and ds.classes == ["green", "blue", "red"]


def test_cli_list_with_labels_alias(flat, tmp_path):
    proc = run_dimd("pack", flat, "--labels", flat / "labels.txt", "--classes-file",
                    flat / "classes.txt", "-o", tmp_path / "val", check=True)
    assert "packed 4 images in 3 classes" in proc.stdout


@pytest.mark.parametrize("content, message", [
    ("img 0.JPEG 0\nmissing.JPEG 1\n", r"labels.txt:2: .*missing.JPEG: no such file"),
    ("img 0.JPEG zero\n", r"labels.txt:1: expected 'relative/path label'"),
    ("\n\n", r"labels.txt: list file names no images"),
    ("img 0.JPEG 7\n", r"labels.txt:1: label 7 but the classes file names only 3 classes"),
])
def test_bad_list_files_are_clear_errors(flat, tmp_path, content, message):
    (flat / "labels.txt").write_text(content)
    with pytest.raises(DimdError, match=message):
        pack(PackConfig(flat, tmp_path / "out", list_file=flat / "labels.txt",
                        classes_file=flat / "classes.txt", workers=1))


def test_unreadable_list_file_is_a_clear_error(flat, tmp_path):
    proc = run_dimd("pack", flat, "--list", flat / "nope.txt", "-o", tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"dimd: error: {flat / 'nope.txt'}: cannot read list file "
                                   "(No such file or directory)")


@pytest.fixture
def flat_with_link(tmp_path):
    root = tmp_path / "flat_with_link"
    (root / "sub").mkdir(parents=True)
    for name in ("x.jpg", "y.jpg", "sub/z.jpg"):
        (root / name).write_bytes(jpeg((40, 30)))
    (root / "link.jpg").symlink_to("x.jpg")
    (tmp_path / "classes.txt").write_text("cat\ndog\nfox\n")
    return root


@pytest.mark.parametrize("lines, message", [
    (["x.jpg 0", "y.jpg 1", "x.jpg 2"], "list.txt:3: x.jpg has label 2, but line 1 gave the same file label 0"),
    (["x.jpg 0", "./x.jpg 1"], "list.txt:2: ./x.jpg has label 1, but line 1 gave the same file (as x.jpg) label 0"),
    (["sub/z.jpg 1", "sub/../sub/z.jpg 0"], "list.txt:2: sub/../sub/z.jpg has label 0, but line 1 gave the "
                                            "same file (as sub/z.jpg) label 1"),
    (["x.jpg 0", "y.jpg 0", "link.jpg 2"], "list.txt:3: link.jpg has label 2, but line 1 gave the same file "
                                           "(as x.jpg) label 0"),
])
def test_one_file_with_two_labels_is_refused(flat_with_link, tmp_path, lines, message):
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    proc = run_dimd("pack", flat_with_link, "--list", tmp_path / "list.txt", "--classes-file", tmp_path / "classes.txt",
                    "-o", tmp_path / "x")
    assert one_error_line(proc) == f"{tmp_path / message}"
    assert not (tmp_path / "x.dimd").exists()


def test_the_same_file_twice_with_the_same_label_is_packed_twice(flat_with_link, tmp_path):
    """As Caffe's convert_imageset allows it (an oversampled class)."""
    (tmp_path / "list.txt").write_text("x.jpg 1\ny.jpg 0\nx.jpg 1\nlink.jpg 1\n")
    proc = run_dimd("pack", flat_with_link, "--list", tmp_path / "list.txt", "-o", tmp_path / "x", "-q")
    assert proc.returncode == 0, proc.stderr
    ds = PackedDataset(tmp_path / "x")
    assert ds.names == ["x.jpg", "y.jpg", "x.jpg", "link.jpg"] and ds.labels.tolist() == [1, 0, 1, 1]


@pytest.mark.parametrize("names, message", [
    ("cat\ndog\ncat\n", "classes.txt:3: class name 'cat' is already the name of line 1 (label 0); each class "
                        "needs its own name"),
    ("a\na\nb\n", "classes.txt:2: class name 'a' is already the name of line 1 (label 0); each class needs its "
                  "own name"),
    ("a\nb \n b\n", "classes.txt:3: class name 'b' is already the name of line 2 (label 1); each class needs "
                    "its own name"),
])
def test_a_classes_file_naming_a_class_twice_is_refused(flat_with_link, tmp_path, names, message):
    (tmp_path / "classes.txt").write_text(names)
    (tmp_path / "list.txt").write_text("x.jpg 0\n")
    proc = run_dimd("pack", flat_with_link, "--list", tmp_path / "list.txt", "--classes-file", tmp_path / "classes.txt",
                    "-o", tmp_path / "x")
    assert one_error_line(proc) == f"{tmp_path / message}"


def test_a_list_of_names_that_are_not_utf8_reads_them_exactly(flat_with_link, tmp_path):
    with open(os.path.join(os.fsencode(flat_with_link), b"\xe9t\xe9.jpg"), "wb") as f:
        f.write(jpeg((40, 30)))
    (tmp_path / "list.txt").write_bytes(b"\xe9t\xe9.jpg 0\nx.jpg 1\n")  # Latin-1 file names, as on old systems
    proc = run_dimd("pack", flat_with_link, "--list", tmp_path / "list.txt", "-o", tmp_path / "x", "-q")
    assert proc.returncode == 0, proc.stderr
    ds = PackedDataset(tmp_path / "x")
    assert ds.names == ["\\xe9t\\xe9.jpg", "x.jpg"]
    assert os.fsencode(ds.source_names[0]) == b"\xe9t\xe9.jpg"
