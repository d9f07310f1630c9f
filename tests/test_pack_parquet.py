"""`dimd pack` from Parquet files as the Hugging Face Hub stores image sets (the `dimd[parquet]` extra).

The files hold the sample tree's images in an ``image`` struct (``bytes``,
``path``) and an int64 ``label``, written with pyarrow; packing them must give
the records packing the tree gives. Skipped where pyarrow is not installed
(without it, the refusal is checked in ``test_pack_archive_errors.py``).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import BENCH, invoke_dimd
from hostile import jpeg, one_error_line

from dimd.format import PackedDataset
from dimd.pack.packer import PackConfig, pack

pa = pytest.importorskip("pyarrow", reason="the dimd[parquet] extra (pyarrow) is not installed")
pq = pytest.importorskip("pyarrow.parquet")
sys.path.insert(0, str(BENCH / "probes"))
import archive_copies  # noqa: E402  (bench/probes/: shared with bench/probes/pack_archives.py)


@pytest.fixture(scope="module")
def tree_pack(sample_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("tree") / "train"
    pack(PackConfig(sample_tree, out, short_side=64, workers=1))
    return out


@pytest.mark.parametrize("class_label", [True, False])
def test_parquet_files_give_the_records_of_the_tree(sample_tree, tree_pack, tmp_path, class_label):
    files = archive_copies.write_parquet(sample_tree, tmp_path / "data", files=3, class_label=class_label)
    classes = None
    if not class_label:  # the class names from a file instead of the Hub's metadata
        classes = tmp_path / "classes.txt"
        classes.write_text("".join(f"{n}\n" for n, _ in archive_copies.tree_files(sample_tree)))
    result = pack(PackConfig(str(tmp_path / "data" / "train-*.parquet"), tmp_path / "out", short_side=64,
                             workers=2, classes_file=classes))
    assert (result.archives, result.source_kind, result.images) == (3, "parquet", 48)
    tree, rows = PackedDataset(tree_pack), PackedDataset(tmp_path / "out")
    assert tree.data_path.read_bytes() == rows.data_path.read_bytes()
    np.testing.assert_array_equal(tree.records, rows.records)
    assert rows.classes == tree.classes
    assert rows.names[:2] == [f"{files[0].name}/0", f"{files[0].name}/1"]


def test_without_class_names_the_labels_name_the_classes(sample_tree, tmp_path):
    archive_copies.write_parquet(sample_tree, tmp_path / "data", files=1, class_label=False)
    result = pack(PackConfig(tmp_path / "data" / "train-00000-of-00001.parquet", tmp_path / "out", short_side=32,
                             workers=1))
    assert result.classes == ["0", "1", "2", "3"]


def test_a_classes_file_names_the_classes_instead_of_the_metadata(sample_tree, tmp_path):
    archive_copies.write_parquet(sample_tree, tmp_path / "data", files=1)
    data = tmp_path / "data" / "train-00000-of-00001.parquet"
    renamed = tmp_path / "renamed.txt"
    renamed.write_text("w\nx\ny\nz\n")
    result = pack(PackConfig(data, tmp_path / "out", short_side=32, workers=1, classes_file=renamed))
    assert result.classes == ["w", "x", "y", "z"]
    fewer = tmp_path / "fewer.txt"
    fewer.write_text("w\nx\n")
    assert one_error_line(invoke_dimd("pack", data, "--classes-file", fewer, "-o", tmp_path / "refused")) == (
        f"{data}: its ClassLabel names 4 classes, the classes file 2")
    assert not list(tmp_path.glob("refused*"))


def write(path, table) -> None:
    pq.write_table(table, path)


def test_bad_parquet_files_and_rows_are_skipped_and_named(tmp_path):
    image = jpeg((20, 20))
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    names = {b"huggingface": json.dumps({"info": {"features": {
        "label": {"names": ["cat", "dog"], "_type": "ClassLabel"}}}}).encode()}
    good = pa.table({"image": pa.array([{"bytes": image, "path": "a.jpg"}, {"bytes": image, "path": "b.jpg"},
                                        {"bytes": None, "path": "c.jpg"}, {"bytes": b"junk", "path": None}], struct),
                     "label": pa.array([1, 2, 0, 0], pa.int64())}).replace_schema_metadata(names)
    write(tmp_path / "a.parquet", good)
    write(tmp_path / "b.parquet", pa.table({"picture": pa.array([image]), "label": pa.array([0])}))
    write(tmp_path / "c.parquet", pa.table({"image": pa.array([image]), "label": pa.array(["cat"])}))
    (tmp_path / "d.parquet").write_bytes(b"PAR1 not really PAR1")
    proc = invoke_dimd("pack", tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "c.parquet",
                       tmp_path / "d.parquet", "-o", tmp_path / "out", "--workers", "1", "--short-side", "16",
                       "--skipped", tmp_path / "skipped.txt", "-q")
    assert proc.returncode == 0, proc.stderr
    reasons = [line.split("\t") for line in (tmp_path / "skipped.txt").read_text().splitlines()]
    assert reasons[:4] == [
        [f"{tmp_path / 'a.parquet'}: row 1", f"label 2 but the ClassLabel metadata of {tmp_path / 'a.parquet'} "
                                             "names only 2 classes"],
        [f"{tmp_path / 'a.parquet'}: row 2", "no image bytes (only a path: c.jpg)"],
        [f"{tmp_path / 'a.parquet'}: row 3", "not an image Pillow can read"],
        [str(tmp_path / "b.parquet"), "no column 'image' (its columns: picture, label; see --image-column and "
                                      "--label-column)"],
    ]
    assert reasons[4] == [str(tmp_path / "c.parquet"), "column 'label' is string, not integers"]
    assert reasons[5][0] == str(tmp_path / "d.parquet") and reasons[5][1].startswith("not a Parquet file")
    ds = PackedDataset(tmp_path / "out")
    assert (ds.classes, ds.names) == (["cat", "dog"], ["a.parquet/0"])
    strict = invoke_dimd("pack", tmp_path / "b.parquet", "-o", tmp_path / "strict", "--workers", "1", "--strict")
    assert one_error_line(strict).startswith(f"{tmp_path / 'b.parquet'}: no column 'image'")


def test_a_binary_image_column_and_other_column_names(tmp_path):
    image = jpeg((20, 20))
    write(tmp_path / "x.parquet", pa.table({"jpg": pa.array([image, image], pa.large_binary()),
                                            "cls": pa.array([0, 1], pa.int16())}))
    proc = invoke_dimd("pack", tmp_path / "x.parquet", "--image-column", "jpg", "--label-column", "cls",
                       "-o", tmp_path / "out", "--workers", "1", "-q")
    assert proc.returncode == 0, proc.stderr
    assert PackedDataset(tmp_path / "out").classes == ["0", "1"]
