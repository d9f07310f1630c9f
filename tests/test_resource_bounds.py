"""Inputs that could ask for unbounded resources get a clear line or a named skip.

One mechanism each: labels pass :class:`dimd.pack.labels.LabelBound` (and the
empty-class rule) before any class name is built; only regular files are read
as images, opened without blocking; the class-tree walk visits each folder and
each file once; sizes that become allocations are checked against memory.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess

import lmdb
import pytest
from conftest import run_dimd, run_mpi_dimd
from hostile import jpeg, one_error_line, small_tree, temporaries

from dimd.format import PackedDataset
from dimd.pack.caffe_datum import Datum
from dimd.pack.labels import MAX_EMPTY_CLASSES, MAX_LABEL
from dimd.pack.packer import PackConfig, pack

_GIB = 1 << 30


def run_capped(*args, memory: int = 3 * _GIB, timeout: float = 120) -> subprocess.CompletedProcess:
    """``dimd ARGS`` with its address space capped: a regression fails the test, not the machine."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return run_dimd(*args, timeout=timeout, preexec_fn=cap)


@pytest.fixture
def flat(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    for i in range(3):
        (root / f"{i}.jpg").write_bytes(jpeg((40, 30), (60 * i, 0, 0)))
    return root


@pytest.mark.parametrize("label, message", [
    ("2147483647", f"label 2147483647 is above {MAX_LABEL:,}, the largest dimd accepts without --classes-file"),
    ("99999999999999999999", "label 99999999999999999999 is above"),
    ("1000000", "label 1000000 is above"),
])
def test_huge_list_labels_are_refused_at_their_line(flat, tmp_path, label, message):
    (tmp_path / "list.txt").write_text(f"0.jpg 0\n1.jpg {label}\n")
    proc = run_capped("pack", flat, "--list", tmp_path / "list.txt", "-o", tmp_path / "out" / "x")
    line = one_error_line(proc)
    assert line.startswith(f"{tmp_path / 'list.txt'}:2: {message}")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("labels, ok", [
    ((0, 1, 999), True),                      # a small subset of 1,000 classes: fine
    ((0, 5_000), False),                      # 4,999 empty classes for 2 records
    ((0, 1, MAX_LABEL), False),               # a million classes, three used
])
def test_a_gap_of_empty_classes_is_an_error_unless_named(flat, tmp_path, labels, ok):
    lines = "".join(f"{i}.jpg {label}\n" for i, label in enumerate(labels))
    (tmp_path / "list.txt").write_text(lines)
    proc = run_capped("pack", flat, "--list", tmp_path / "list.txt", "-o", tmp_path / "x", "-q")
    if ok:
        assert proc.returncode == 0, proc.stderr
        assert len(PackedDataset(tmp_path / "x").classes) == max(labels) + 1
        return
    empty = max(labels) + 1 - len(labels)
    assert empty > MAX_EMPTY_CLASSES
    line = one_error_line(proc)
    assert line == (f"{tmp_path / 'list.txt'}: labels go up to {max(labels):,} but only {len(labels)} of "
                    f"them are used, so {empty:,} classes would be empty; fix the labels, or name the "
                    f"classes with --classes-file")


def test_a_classes_file_names_every_class_a_label_may_use(flat, tmp_path):
    (tmp_path / "classes.txt").write_text("a\nb\n")
    (tmp_path / "list.txt").write_text("0.jpg 0\n1.jpg 2\n")
    proc = run_capped("pack", flat, "--list", tmp_path / "list.txt", "--classes-file",
                      tmp_path / "classes.txt", "-o", tmp_path / "x")
    assert one_error_line(proc) == f"{tmp_path / 'list.txt'}:2: label 2 but the classes file names only 2 classes"


def test_datum_labels_are_bounded_per_record(tmp_path):
    good = jpeg((50, 40))
    with lmdb.open(str(tmp_path / "db"), map_size=1 << 24) as env, env.begin(write=True) as txn:
        txn.put(b"a", Datum(data=good, label=0, encoded=True).SerializeToString())
        txn.put(b"b", Datum(data=good, label=2**31 - 1, encoded=True).SerializeToString())
        txn.put(b"c", Datum(data=good, label=1, encoded=True).SerializeToString())
    result = pack(PackConfig(tmp_path / "db", tmp_path / "x", workers=2))
    assert (result.images, result.classes) == (2, ["0", "1"])
    assert result.skipped == [("b", f"label 2147483647 is above {MAX_LABEL:,}, the largest dimd "
                                    "accepts without `classes_file`")]
    # A stray label below the bound but far above the others: the data set is refused, the record named.
    with lmdb.open(str(tmp_path / "db2"), map_size=1 << 24) as env, env.begin(write=True) as txn:
        txn.put(b"a", Datum(data=good, label=0, encoded=True).SerializeToString())
        txn.put(b"stray", Datum(data=good, label=70_000, encoded=True).SerializeToString())
    proc = run_capped("pack", tmp_path / "db2", "-o", tmp_path / "y", "-q")
    assert one_error_line(proc) == (f"{tmp_path / 'db2'}: labels go up to 70,000 (stray has it) but only 2 "
                                    "of them are used, so 69,999 classes would be empty; fix the labels, "
                                    "or name the classes with --classes-file")
    assert temporaries(tmp_path) == [] and not (tmp_path / "y.dimd").exists()


def test_only_regular_files_are_images_and_nothing_hangs(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 2, "b": 1})
    os.mkfifo(root / "a" / "fifo.jpg")
    (root / "a" / "zero.jpg").symlink_to("/dev/zero")
    (root / "b" / "null.png").symlink_to("/dev/null")
    (root / "b" / "folder.jpg").mkdir()  # a folder with an image name is a folder: walked, empty
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(root / "b" / "sock.jpg"))
    try:
        proc = run_capped("pack", root, "-o", tmp_path / "x", "--workers", "2", timeout=60)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stderr.splitlines() if line.startswith("dimd: skipped")) == [
        "dimd: skipped a/fifo.jpg: not a regular file (a FIFO)",
        "dimd: skipped a/zero.jpg: not a regular file (a symlink to a character device)",
        "dimd: skipped b/null.png: not a regular file (a symlink to a character device)",
        "dimd: skipped b/sock.jpg: not a regular file (a socket)",
    ]
    ds = PackedDataset(tmp_path / "x")
    assert ds.names == ["a/0.jpg", "a/1.jpg", "b/0.jpg"]


def test_a_link_to_itself_is_a_loop_and_a_link_to_nothing_is_broken(tmp_path, flat):
    root = small_tree(tmp_path / "tree", {"a": 1})
    (root / "a" / "self.jpg").symlink_to("self.jpg")
    (root / "a" / "gone.jpg").symlink_to("missing.jpg")
    proc = run_capped("pack", root, "-o", tmp_path / "x", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stderr.splitlines() if line.startswith("dimd: skipped")) == [
        "dimd: skipped a/gone.jpg: broken symlink",
        "dimd: skipped a/self.jpg: a symlink loop (a link that leads back to itself)",
    ]
    (flat / "self.jpg").symlink_to("self.jpg")
    (tmp_path / "list.txt").write_text("0.jpg 0\nself.jpg 1\n")
    proc = run_capped("pack", flat, "--list", tmp_path / "list.txt", "-o", tmp_path / "y", timeout=60)
    assert one_error_line(proc) == (f"{tmp_path / 'list.txt'}:2: {flat / 'self.jpg'}: a symlink loop (a link that "
                                    "leads back to itself)")


def test_a_fifo_named_in_a_list_is_an_error_at_its_line(flat, tmp_path):
    os.mkfifo(flat / "pipe.jpg")
    (tmp_path / "list.txt").write_text("0.jpg 0\npipe.jpg 1\n")
    proc = run_capped("pack", flat, "--list", tmp_path / "list.txt", "-o", tmp_path / "x", timeout=60)
    assert one_error_line(proc) == f"{tmp_path / 'list.txt'}:2: {flat / 'pipe.jpg'}: not a regular file (a FIFO)"


def test_symlinks_are_followed_once_never_packing_a_file_twice(tmp_path):
    """A loop between class folders, links to files and folders of other classes, a hard link."""
    root = small_tree(tmp_path / "tree", {"a": 1, "b": 1, "c": 1})
    (root / "a" / "to_b").symlink_to("../b")            # loop a -> b -> a
    (root / "b" / "to_a").symlink_to("../a")
    (root / "a" / "c0.jpg").symlink_to("../c/0.jpg")    # a file of class c, linked from a
    (root / "c" / "up").symlink_to("..")                # back to the top
    os.link(root / "b" / "0.jpg", root / "c" / "hard.jpg")
    outside = small_tree(tmp_path / "outside", {"extra": 1})
    (root / "c" / "more").symlink_to(outside / "extra")  # outside the tree: followed, packed once
    (root / "d").symlink_to("a")                        # a class folder that is another class
    proc = run_dimd("pack", root, "-o", tmp_path / "x", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    ds = PackedDataset(tmp_path / "x")
    assert ds.classes == ["a", "b", "c", "d"]
    assert list(zip(ds.names, ds.labels.tolist())) == [
        ("a/0.jpg", 0), ("b/0.jpg", 1), ("c/0.jpg", 2), ("c/more/0.jpg", 2)]
    skipped = sorted(line for line in proc.stderr.splitlines() if line.startswith("dimd: skipped"))
    assert skipped == [
        "dimd: skipped a/c0.jpg: the same file as c/0.jpg (a symlink or hard link); packed once, as c/0.jpg",
        "dimd: skipped a/to_b/: leads to folder b/, which is walked already (a symlink loop or a second "
        "link); not followed",
        "dimd: skipped b/to_a/: leads to folder a/, which is walked already (a symlink loop or a second "
        "link); not followed",
        "dimd: skipped c/hard.jpg: the same file as b/0.jpg (a symlink or hard link); packed once, as b/0.jpg",
        "dimd: skipped c/up/: a symlink back to the top folder (a loop); not followed",
        "dimd: skipped d/: leads to folder a/, which is walked already (a symlink loop or a second link); "
        "not followed",
    ]


@pytest.mark.mpi
@pytest.mark.parametrize("size, message", [
    ("1T", "a largest message of 1.0 TiB (--max-bytes) needs about 2.0 TiB per rank, but a rank has "),
    # the largest size the sweep reaches: 8 B doubled up to at most 100000 TiB
    ("100000T", "a largest message of 65536.0 TiB (--max-bytes) needs about 131072.0 TiB per rank, but "),
])
def test_command_line_sizes_beyond_memory_are_refused(size, message):
    proc = run_mpi_dimd(1, "bench-allreduce", "-a", "mpi", "-e", size, timeout=120)
    line = one_error_line(proc)
    assert line.startswith(message) and line.endswith("of available memory on this node"), line
    assert "busbw" not in proc.stdout  # refused before the table starts
