"""`dimd pack` from a class tree: sizes, labels, colours, worker-count invariance, atomic outputs, and
one clear error for a bad source or option.

(What pack makes of each image: ``test_pack_images.py``; bad records: ``test_pack_bad_records.py``.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import run_dimd
from hostile import decode, solid
from PIL import Image

from dimd.errors import DimdError
from dimd.format import PackedDataset, dataset_paths
from dimd.pack.packer import PackConfig, pack
from dimd.pack.sources import open_source

COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}


@pytest.fixture
def colour_tree(tmp_path) -> Path:
    """Three classes of solid-colour JPEGs, sizes chosen to hit both resize paths."""
    root = tmp_path / "colours"
    sizes = [(400, 300), (300, 700), (1600, 1200), (256, 256)]
    for name, rgb in COLOURS.items():
        (root / name).mkdir(parents=True)
        for j, size in enumerate(sizes):
            solid(size, rgb).save(root / name / f"{j}.jpg", quality=95)
    (root / "red" / "notes.txt").write_text("not an image")
    (root / "red" / ".hidden.jpg").write_bytes(b"")
    return root


def test_round_trip_sizes_labels_and_rgb_order(colour_tree, tmp_path):
    result = pack(PackConfig(colour_tree, tmp_path / "out", workers=1))
    assert (result.images, result.skipped, result.classes) == (12, [], ["blue", "green", "red"])
    ds = PackedDataset(tmp_path / "out")
    assert ds.classes == ["blue", "green", "red"]
    assert ds.names[:4] == ["blue/0.jpg", "blue/1.jpg", "blue/2.jpg", "blue/3.jpg"]
    expected_sizes = [(256, 341), (597, 256), (256, 341), (256, 256)]  # (height, width)
    for i in range(len(ds)):
        label, name = ds.label(i), ds.name(i)
        assert name.split("/")[0] == ds.classes[label]
        pixels = decode(ds, i)
        assert pixels.shape[:2] == (ds.records["height"][i], ds.records["width"][i])
        assert pixels.shape[:2] == expected_sizes[i % 4]
        assert min(pixels.shape[:2]) == 256
        centre = pixels[pixels.shape[0] // 2, pixels.shape[1] // 2].astype(int)
        assert np.abs(centre - COLOURS[ds.classes[label]]).max() < 12, (name, centre)
    assert ds.attrs["short_side"] == 256 and ds.attrs["quality"] == 90
    assert ds.attrs["source_kind"] == "tree"


def test_output_is_byte_identical_for_any_worker_count(sample_tree, tmp_path):
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        pack(PackConfig(sample_tree, out, workers=workers))
        outputs.append(dataset_paths(out)[0].read_bytes())
        ds = PackedDataset(out)
        assert len(ds) == 48
    assert outputs[0] == outputs[1] == outputs[2]
    a, b = PackedDataset(tmp_path / "w1"), PackedDataset(tmp_path / "w3")
    assert (a.records == b.records).all() and a.names == b.names


def test_short_side_and_quality_options(colour_tree, tmp_path):
    small = pack(PackConfig(colour_tree, tmp_path / "q50", short_side=64, quality=50, workers=1))
    large = pack(PackConfig(colour_tree, tmp_path / "q95", short_side=64, quality=95, workers=1))
    ds = PackedDataset(tmp_path / "q50")
    assert np.minimum(ds.records["height"], ds.records["width"]).tolist() == [64] * 12
    assert small.bytes_out < large.bytes_out


def test_existing_output_is_refused_unless_force(colour_tree, tmp_path):
    pack(PackConfig(colour_tree, tmp_path / "out", workers=1))
    with pytest.raises(DimdError, match="output exists"):
        pack(PackConfig(colour_tree, tmp_path / "out", workers=1))
    pack(PackConfig(colour_tree, tmp_path / "out", workers=1, short_side=32, force=True))
    assert PackedDataset(tmp_path / "out").attrs["short_side"] == 32


def test_failed_pack_leaves_no_output_files(colour_tree, tmp_path):
    (colour_tree / "red" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(DimdError, match="broken.jpg"):
        pack(PackConfig(colour_tree, tmp_path / "out", workers=2, strict=True))
    assert list(tmp_path.glob("out*")) == [] and list(tmp_path.glob(".out*")) == []


def test_workers_are_capped_at_four_per_core(colour_tree, tmp_path, monkeypatch):
    """``--workers 100000`` does not fork 100,000 processes: the work is CPU-bound."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})   # one core available
    result = pack(PackConfig(colour_tree, tmp_path / "out", workers=100_000))
    assert result.workers == 4 and len(PackedDataset(tmp_path / "out")) == 12


def test_cli_pack_prints_summary_and_writes_json(colour_tree, tmp_path):
    proc = run_dimd("pack", colour_tree, "-o", tmp_path / "out", "--workers", "2",
                    "--json", tmp_path / "pack.json", check=True)
    assert "packed 12 images in 3 classes (0 skipped)" in proc.stdout
    assert "images/s" in proc.stdout
    assert "pack (tree): 12/12" in proc.stderr  # plain progress lines when not a terminal
    doc = json.loads((tmp_path / "pack.json").read_text())
    figures = doc["result"]
    assert figures["images"] == 12 and figures["skipped"] == 0 and figures["workers"] == 2
    assert figures["bytes_out"] == dataset_paths(tmp_path / "out")[0].stat().st_size
    assert doc["parameters"]["short_side"] == 256
    assert run_dimd("pack", colour_tree, "-o", tmp_path / "out").returncode == 1


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


@contextlib.contextmanager
def unprivileged():
    """Root reads any folder: drop to nobody's user id (the saved one stays root, to come back)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_a_source_folder_that_cannot_be_entered_is_one_clear_error(tmp_path):
    root = tmp_path / "tree"
    (root / "a").mkdir(parents=True)
    root.chmod(0o600)  # its names can be listed, nothing in it can be opened
    try:
        with unprivileged(), pytest.raises(DimdError, match=rf"^{re.escape(str(root))}: cannot read folder "
                                                            r"\(Permission denied\)$"):
            open_source(root)
    finally:
        root.chmod(0o755)


def test_a_class_folder_with_no_images_is_named_and_its_class_kept(colour_tree, tmp_path):
    """An empty class is likely a failed copy, so it is named; kept, so labels still match the sibling set."""
    (colour_tree / "grey").mkdir()
    (colour_tree / "grey" / "readme.txt").write_text("no images here")
    result = pack(PackConfig(colour_tree, tmp_path / "out", workers=1))
    assert result.skipped == [("grey/", "a class folder with no images; its class is kept, empty")]
    ds = PackedDataset(tmp_path / "out")
    assert ds.classes == ["blue", "green", "grey", "red"] and sorted(set(ds.labels.tolist())) == [0, 1, 3]
    with pytest.raises(DimdError, match="^grey/: a class folder with no images; its class is kept, empty"):
        pack(PackConfig(colour_tree, tmp_path / "strict", strict=True, workers=1))


@pytest.mark.parametrize("option, value, message", [
    ("--short-side", "0", "Invalid value for '--short-side': must be in [1, 65500] (got 0)"),
    ("--quality", "101", "Invalid value for '--quality': must be in [1, 100] (got 101)"),
    ("--workers", "0", "Invalid value for '--workers': must be at least 1 (got 0)"),
])
def test_bad_options_are_clear_errors(sample_tree, tmp_path, option, value, message):
    proc = run_dimd("pack", sample_tree, "-o", tmp_path / "out", option, value)
    assert proc.returncode == 2 and message in proc.stderr  # a usage error, named by its flag
