"""The sample set is real, learnable-looking and reproducible."""

import hashlib
import re

import pytest
from conftest import DIMD
from hostile import can_mount_tmpfs, in_tmpfs
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


@pytest.mark.skipif(not can_mount_tmpfs(), reason="cannot mount a private tmpfs here")
def test_a_full_disk_is_one_line_and_leaves_no_truncated_image(tmp_path):
    mount = tmp_path / "mnt"
    proc = in_tmpfs(mount, "128k", f"{' '.join(DIMD)} sample-data {mount}/s --classes 2 --per-class 10 "
                                   f"--large-share 0 -q; echo rc=$?; "
                                   f"cd {mount}/s && find . -type f | sort | xargs md5sum")
    lines = proc.stdout.splitlines()
    assert lines[0] == "rc=1", (proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.fullmatch(rf"dimd: error: {mount}/s/\S+\.JPEG: cannot write \(No space left on device\); "
                        rf"the sample set in {mount}/s is incomplete", proc.stderr.strip()), proc.stderr
    written = dict(line.split()[::-1] for line in lines[1:])
    assert written and not [name for name in written if "/." in name]   # no temporary left
    # Each file that is there is whole: the very bytes a run with room for them writes.
    expected = digest(generate(SampleSpec(tmp_path / "roomy", classes=2, per_class=10, large_share=0),
                               workers=2).root)
    assert {name[2:]: md5 for name, md5 in written.items()} == {name: expected[name] for name in
                                                                (n[2:] for n in written)}
