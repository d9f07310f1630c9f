"""The sample set is real, learnable-looking and reproducible."""

import hashlib

from PIL import Image

from dimd.sample_data import MAX_CLASSES, SampleSpec, class_names, generate


def digest(root):
    return {p.relative_to(root).as_posix(): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.JPEG"))}


def test_same_seed_same_files_for_any_worker_count(tmp_path):
    a = generate(SampleSpec(tmp_path / "a", classes=3, per_class=4, seed=5), workers=1)
    b = generate(SampleSpec(tmp_path / "b", classes=3, per_class=4, seed=5), workers=2)
    assert a.images == b.images == 12
    assert digest(tmp_path / "a") == digest(tmp_path / "b")


def test_tree_layout_has_one_folder_per_class_and_large_images(sample_tree):
    folders = sorted(p.name for p in sample_tree.iterdir())
    assert folders == sorted(class_names(4))
    sizes = [Image.open(p).size for p in sample_tree.rglob("*.JPEG")]
    assert len(sizes) == 48
    assert any(max(s) > 1000 for s in sizes) and any(max(s) < 800 for s in sizes)
    assert len({round(w / h, 1) for w, h in sizes}) > 5  # mixed aspect ratios


def test_flat_layout_writes_a_caffe_list(tmp_path):
    result = generate(SampleSpec(tmp_path, classes=2, per_class=3, layout="flat"), workers=1)
    lines = result.list_file.read_text().splitlines()
    assert len(lines) == 6 and lines[-1].split()[1] == "1"
    assert (tmp_path / lines[0].split()[0]).exists()
    assert (tmp_path / "classes.txt").read_text().split() == class_names(2)


def test_class_names_are_distinct_up_to_the_maximum():
    assert len(set(class_names(MAX_CLASSES))) == MAX_CLASSES
