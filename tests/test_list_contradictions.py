"""Issue 13, group 6: ``--list`` and ``--classes-file`` refuse contradictions, with the line numbers.

Mechanism: while reading the list, each file (by device and inode, so
``x.jpg``, ``./x.jpg`` and a link to it are the same file) remembers the line
and label it first had; :func:`dimd.pack.sources.read_classes_file` remembers
the line of each name.
"""

from __future__ import annotations

import os

import pytest
from hostile import jpeg, one_error_line
from conftest import run_dimd

from dimd.format import PackedDataset


@pytest.fixture
def flat(tmp_path):
    root = tmp_path / "flat"
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
def test_one_file_with_two_labels_is_refused(flat, tmp_path, lines, message):
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    proc = run_dimd("pack", flat, "--list", tmp_path / "list.txt", "--classes-file", tmp_path / "classes.txt",
                    "-o", tmp_path / "x")
    assert one_error_line(proc) == f"{tmp_path / message}"
    assert not (tmp_path / "x.dimd").exists()


def test_the_same_file_twice_with_the_same_label_is_packed_twice(flat, tmp_path):
    """As Caffe's convert_imageset allows it (an oversampled class)."""
    (tmp_path / "list.txt").write_text("x.jpg 1\ny.jpg 0\nx.jpg 1\nlink.jpg 1\n")
    proc = run_dimd("pack", flat, "--list", tmp_path / "list.txt", "-o", tmp_path / "x", "-q")
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
def test_a_classes_file_naming_a_class_twice_is_refused(flat, tmp_path, names, message):
    (tmp_path / "classes.txt").write_text(names)
    (tmp_path / "list.txt").write_text("x.jpg 0\n")
    proc = run_dimd("pack", flat, "--list", tmp_path / "list.txt", "--classes-file", tmp_path / "classes.txt",
                    "-o", tmp_path / "x")
    assert one_error_line(proc) == f"{tmp_path / message}"


def test_a_list_of_names_that_are_not_utf8_reads_them_exactly(flat, tmp_path):
    with open(os.path.join(os.fsencode(flat), b"\xe9t\xe9.jpg"), "wb") as f:
        f.write(jpeg((40, 30)))
    (tmp_path / "list.txt").write_bytes(b"\xe9t\xe9.jpg 0\nx.jpg 1\n")  # Latin-1 file names, as on old systems
    proc = run_dimd("pack", flat, "--list", tmp_path / "list.txt", "-o", tmp_path / "x", "-q")
    assert proc.returncode == 0, proc.stderr
    ds = PackedDataset(tmp_path / "x")
    assert ds.names == ["\\xe9t\\xe9.jpg", "x.jpg"]
    assert os.fsencode(ds.source_names[0]) == b"\xe9t\xe9.jpg"
