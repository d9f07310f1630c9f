"""`dimd pack --list`, skipping bad images, --strict, and clear errors for bad inputs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import run_dimd
from PIL import Image

from dimd.errors import DimdError
from dimd.format import PackedDataset, dataset_paths
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


def test_missing_and_empty_sources_are_clear_errors(tmp_path):
    proc = run_dimd("pack", tmp_path / "absent", "-o", tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"dimd: error: {tmp_path / 'absent'}: no such file or directory"
    (tmp_path / "empty" / "class_a").mkdir(parents=True)
    (tmp_path / "empty" / "class_a" / "readme.txt").write_text("no images here")
    with pytest.raises(DimdError, match="empty: no images found"):
        pack(PackConfig(tmp_path / "empty", tmp_path / "out"))
    (tmp_path / "loose").mkdir()
    Image.new("RGB", (10, 10)).save(tmp_path / "loose" / "a.jpg")
    with pytest.raises(DimdError, match="not in class sub-folders: give `list_file`"):
        pack(PackConfig(tmp_path / "loose", tmp_path / "out"))
    assert not dataset_paths(tmp_path / "out")[1].exists()


@pytest.mark.parametrize("option, value, message", [
    ("--short-side", "0", "Invalid value for '--short-side': must be in [1, 65500] (got 0)"),
    ("--quality", "101", "Invalid value for '--quality': must be in [1, 100] (got 101)"),
    ("--workers", "0", "Invalid value for '--workers': must be at least 1 (got 0)"),
])
def test_bad_options_are_clear_errors(sample_tree, tmp_path, option, value, message):
    proc = run_dimd("pack", sample_tree, "-o", tmp_path / "out", option, value)
    assert proc.returncode == 2 and message in proc.stderr  # a usage error, named by its flag


def test_missing_output_folders_are_created(sample_tree, tmp_path):
    result = pack(PackConfig(sample_tree, tmp_path / "no" / "such" / "out", workers=1))
    assert result.images == 48 and len(PackedDataset(tmp_path / "no" / "such" / "out")) == 48


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
