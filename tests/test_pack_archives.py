"""`dimd pack` from archives: ImageNet's tar of per-class tars, a flat tar with a list, WebDataset shards.

Each archive is written with Python's tarfile from a set ``dimd sample-data``
made (bench/probes/archive_copies.py), and packing it must give the bytes packing the
files gives: the same data file, the same index rows, in the same order, for
any number of workers, whatever order and compression the archive has.
(Bad archives: ``test_pack_archive_errors.py``; Parquet: ``test_pack_parquet.py``.)
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import BENCH, invoke_dimd
from hostile import jpeg
from PIL import Image

from dimd.format import PackedDataset
from dimd.pack.locate import expand_braces
from dimd.pack.streamed import where
from dimd.pack.tar_stream import extracted_file
from dimd.pack.packer import PackConfig, pack

sys.path.insert(0, str(BENCH / "probes"))
import archive_copies  # bench/probes/: shared with bench/probes/pack_archives.py

SHORT_SIDE = 64  # small outputs: the records still differ image by image


def png(size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (30, 30, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def same_records(a: Path, b: Path) -> None:
    """Byte-identical packs: the data file, and every index column and the classes (not where they came from)."""
    first, second = PackedDataset(a), PackedDataset(b)
    assert first.data_path.read_bytes() == second.data_path.read_bytes()
    for field in first.records.dtype.names:
        np.testing.assert_array_equal(first.records[field], second.records[field], err_msg=field)
    assert first.names == second.names
    assert first.classes == second.classes


def packed(src, out: Path, **options) -> Path:
    pack(PackConfig(src, out, short_side=SHORT_SIDE, workers=options.pop("workers", 1), **options))
    return out


@pytest.fixture(scope="module")
def tree_pack(sample_tree, tmp_path_factory) -> Path:
    return packed(sample_tree, tmp_path_factory.mktemp("tree") / "train")


@pytest.fixture(scope="module")
def classes_file(sample_tree, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("classes") / "classes.txt"
    path.write_text("".join(f"{name}\n" for name, _ in archive_copies.tree_files(sample_tree)))
    return path


@pytest.mark.parametrize("order, compression", [("sorted", ""), ("shuffled", ""), ("shuffled", "gz")])
def test_a_tar_of_class_tars_packs_to_the_bytes_of_its_tree(sample_tree, tree_pack, tmp_path, order, compression):
    archive = tmp_path / ("train.tar" + (f".{compression}" if compression else ""))
    archive_copies.write_nested_tar(sample_tree, archive, compression=compression,
                                    shuffle_seed=None if order == "sorted" else 5)
    result = pack(PackConfig(archive, tmp_path / "out", short_side=SHORT_SIDE, workers=1))
    same_records(tree_pack, tmp_path / "out")
    assert result.archives == 4 and result.source_info["reordered"] == (order == "shuffled")
    assert PackedDataset(tmp_path / "out").attrs["source_kind"] == "tar"


@pytest.mark.parametrize("where", ["local disk", "network file system"])
def test_members_read_in_place_or_streamed_give_the_same_bytes(sample_tree, tree_pack, tmp_path, monkeypatch, where):
    """On a local disk the workers read an uncompressed tar's members in place; elsewhere this process streams
    them to the workers. Either way, the tree's bytes."""
    import dimd.pack.tar_source
    import dimd.pack.webdataset

    local = where == "local disk"
    for module in (dimd.pack.tar_source, dimd.pack.webdataset):
        monkeypatch.setattr(module, "on_local_disk", lambda path: local)
    archive = archive_copies.write_nested_tar(sample_tree, tmp_path / "train.tar", shuffle_seed=4)
    same_records(tree_pack, packed(archive, tmp_path / "out"))
    shards = archive_copies.write_webdataset(sample_tree, tmp_path / "shards", per_shard=30)
    tree, from_shards = PackedDataset(tree_pack), PackedDataset(packed(tuple(shards), tmp_path / "wds"))
    assert tree.data_path.read_bytes() == from_shards.data_path.read_bytes()


def test_the_tree_that_tar_x_extracts_packs_to_the_same_bytes(sample_tree, tmp_path):
    archive = archive_copies.write_nested_tar(sample_tree, tmp_path / "train.tar", shuffle_seed=9)
    extracted = tmp_path / "extracted"
    with tarfile.open(archive) as outer:
        for member in outer:
            inner_folder = extracted / member.name.removesuffix(".tar")
            with tarfile.open(fileobj=outer.extractfile(member)) as inner:
                inner.extractall(inner_folder, filter="data")
    same_records(packed(extracted, tmp_path / "from-tree"), packed(archive, tmp_path / "from-tar"))


def test_a_tar_packs_to_the_same_bytes_for_any_number_of_workers(sample_tree, tree_pack, tmp_path):
    archive = archive_copies.write_nested_tar(sample_tree, tmp_path / "train.tar", shuffle_seed=2)
    for workers in (2, 3):
        same_records(tree_pack, packed(archive, tmp_path / f"w{workers}", workers=workers))


def test_an_archive_gets_at_most_four_workers_per_core(sample_tree, tree_pack, tmp_path, monkeypatch):
    """Its image count is unknown until it is read, so only the cores bound ``--workers 100000``."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})   # one core available
    archive = archive_copies.write_nested_tar(sample_tree, tmp_path / "train.tar")
    result = pack(PackConfig(archive, tmp_path / "out", short_side=SHORT_SIDE, workers=100_000))
    assert result.workers == 4
    same_records(tree_pack, tmp_path / "out")


@pytest.fixture(scope="module")
def flat_set(tmp_path_factory) -> Path:
    from dimd.sample_data import SampleSpec, generate

    root = tmp_path_factory.mktemp("val") / "val"
    generate(SampleSpec(root=root, classes=3, per_class=5, seed=4, layout="flat", large_share=0.0), workers=1)
    return root


@pytest.mark.parametrize("shuffle_seed, compression", [(None, ""), (3, "xz")])
def test_a_flat_tar_with_a_list_packs_as_its_folder_and_list_do(flat_set, tmp_path, shuffle_seed, compression):
    listing, classes = flat_set / "labels.txt", flat_set / "classes.txt"
    names = [line.split()[0] for line in listing.read_text().splitlines()]
    name = "val.tar" + (f".{compression}" if compression else "")
    archive = archive_copies.write_flat_tar(flat_set, names, tmp_path / name, shuffle_seed=shuffle_seed,
                                            compression=compression)
    folder = packed(flat_set, tmp_path / "folder", list_file=listing, classes_file=classes)
    same_records(folder, packed(archive, tmp_path / "tar", list_file=listing, classes_file=classes))


def test_a_list_in_another_order_than_the_tar_gives_the_list_order(flat_set, tmp_path):
    lines = (flat_set / "labels.txt").read_text().splitlines()
    listing = tmp_path / "reversed.txt"
    listing.write_text("\n".join(reversed(lines + [lines[0]])) + "\n")  # the first image listed twice
    archive = archive_copies.write_flat_tar(flat_set, [line.split()[0] for line in lines], tmp_path / "val.tar")
    from_tar = packed(archive, tmp_path / "tar", list_file=listing)
    same_records(packed(flat_set, tmp_path / "folder", list_file=listing), from_tar)
    assert PackedDataset(from_tar).names[0] == PackedDataset(from_tar).names[-1] == lines[0].split()[0]


@pytest.mark.parametrize("label", ["cls", "json"])
def test_webdataset_shards_give_the_records_of_the_tree(sample_tree, tree_pack, classes_file, tmp_path, label):
    shards = archive_copies.write_webdataset(sample_tree, tmp_path / "shards", per_shard=10, label=label)
    assert len(shards) == 5
    pattern = str(tmp_path / "shards" / "train-{000000..000004}.tar")
    result = pack(PackConfig(pattern, tmp_path / "out", short_side=SHORT_SIDE, workers=2, classes_file=classes_file))
    assert result.archives == 5 and result.source_kind == "webdataset"
    tree, shards_pack = PackedDataset(tree_pack), PackedDataset(tmp_path / "out")
    assert tree.data_path.read_bytes() == shards_pack.data_path.read_bytes()
    np.testing.assert_array_equal(tree.records, shards_pack.records)
    assert shards_pack.names[0] == f"train-000000.tar/{tree.names[0].removesuffix('.JPEG')}.jpg"


def test_shards_can_be_named_one_by_one_or_in_a_file(sample_tree, classes_file, tmp_path):
    shards = archive_copies.write_webdataset(sample_tree, tmp_path / "shards", per_shard=20)
    by_pattern = packed(str(tmp_path / "shards" / "train-*.tar"), tmp_path / "glob", classes_file=classes_file)
    by_paths = packed(tuple(shards), tmp_path / "paths", classes_file=classes_file)
    listing = tmp_path / "shards" / "shards.txt"
    listing.write_text("# the training shards\n" + "".join(f"{p.name}\n" for p in shards))
    by_list = packed(listing, tmp_path / "list", classes_file=classes_file)
    same_records(by_pattern, by_paths)
    same_records(by_pattern, by_list)


def test_a_sample_takes_the_first_image_extension_and_the_named_json_field(tmp_path):
    first, second = jpeg((20, 20)), jpeg((30, 20), (10, 200, 10))
    shard = tmp_path / "shard-0.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in [("a.png", png((24, 24))), ("a.jpg", first), ("a.json", b'{"label": 7, "cls_id": 1}'),
                           ("b.webp", b"not read"), ("b.json", b'{"cls_id": 0}'), ("b.jpeg", second)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    result = pack(PackConfig(shard, tmp_path / "out", label_field="cls_id", workers=1))
    ds = PackedDataset(tmp_path / "out")
    assert (result.skipped, ds.names, ds.classes) == ([], ["shard-0.tar/a.jpg", "shard-0.tar/b.jpeg"], ["0", "1"])
    assert ds.records["label"].tolist() == [1, 0]


def test_progress_counts_the_images_and_the_archives_read(sample_tree, classes_file, tmp_path):
    archive_copies.write_webdataset(sample_tree, tmp_path / "shards", per_shard=20)
    proc = invoke_dimd("pack", tmp_path / "shards" / "train-{000000..000002}.tar", "-o", tmp_path / "out",
                       "--classes-file", classes_file, "--workers", "1", "--short-side", "16", check=True)
    assert proc.stderr.splitlines()[-1].startswith("pack (webdataset): 48 img, 3/3 archives, ")
    assert proc.stdout.rstrip().endswith("1 worker, 3 archives read")


def test_shards_without_a_classes_file_are_named_by_their_label_numbers(sample_tree, tmp_path):
    archive_copies.write_webdataset(sample_tree, tmp_path / "shards", per_shard=48)
    assert pack(PackConfig(tmp_path / "shards" / "train-000000.tar", tmp_path / "out",
                           short_side=SHORT_SIDE, workers=1)).classes == ["0", "1", "2", "3"]


def test_the_json_summary_names_each_archive_and_its_size(sample_tree, tmp_path):
    archive = archive_copies.write_nested_tar(sample_tree, tmp_path / "train.tar")
    invoke_dimd("pack", archive, "-o", tmp_path / "out", "--workers", "1", "--short-side", "32",
                "--json", tmp_path / "pack.json", "-q", check=True)
    result = json.loads((tmp_path / "pack.json").read_text())["result"]
    assert result["sources"] == [{"path": str(archive), "bytes": archive.stat().st_size}]
    assert (result["archives"], result["images"], result["record_order"]) == (4, 48, "tree")


@pytest.mark.parametrize("pattern, expected", [
    ("a-{000..002}.tar", ["a-000.tar", "a-001.tar", "a-002.tar"]),
    ("{8..10}", ["8", "9", "10"]),
    ("x{a,b{1..2}}y", ["xay", "xb1y", "xb2y"]),
    ("{3..1}", ["3", "2", "1"]),
    ("plain{}.tar", ["plain{}.tar"]),
])
def test_brace_patterns_expand_as_webdataset_writes_them(pattern, expected):
    assert expand_braces(pattern) == expected


@pytest.mark.parametrize("name, kind, extracted", [
    ("./a/b.jpg", tarfile.REGTYPE, "a/b.jpg"),
    ("/a/b.jpg", tarfile.REGTYPE, "a/b.jpg"),
    ("a/.hidden/b.jpg", tarfile.REGTYPE, None),
    ("a/.b.jpg", tarfile.REGTYPE, None),
    ("a/b", tarfile.DIRTYPE, None),
    ("./", tarfile.DIRTYPE, None),
    ("../b.jpg", tarfile.REGTYPE, None),
])
def test_members_are_seen_as_the_folder_source_sees_their_extracted_files(name, kind, extracted):
    member = tarfile.TarInfo(name)
    member.type = kind
    assert extracted_file(member) == extracted


def test_a_place_in_an_archive_is_named_archive_colon_path():
    assert where(Path("train.tar"), "n01.tar", "x.JPEG") == "train.tar: n01.tar/x.JPEG"
    assert where("data.parquet", "row 7") == "data.parquet: row 7"
    assert where("train.tar", "") == "train.tar"
