"""`dimd inspect`: what a packed set holds; a truncated or mismatched pair fails clearly."""

from __future__ import annotations

import json

import pytest
from conftest import invoke_dimd

from dimd.errors import DimdError
from dimd.format import dataset_paths
from dimd.pack.inspection import describe
from dimd.pack.packer import PackConfig, pack


@pytest.fixture(scope="module")
def packed(sample_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect") / "train"
    pack(PackConfig(sample_tree, out, workers=2))
    return out


def test_describe_counts_classes_bytes_and_sizes(packed):
    info = describe(packed)
    assert info["count"] == 48 and info["classes"] == 4
    assert sum(info["class_counts"].values()) == 48
    assert set(info["class_counts"].values()) == {12}
    assert info["data_bytes"] == dataset_paths(packed)[0].stat().st_size
    assert info["short_side"]["min"] == info["short_side"]["max"] == 256
    assert info["height"]["min"] >= 256 and info["width"]["min"] >= 256
    assert info["record_bytes"]["min"] <= info["record_bytes"]["mean"] <= info["record_bytes"]["max"]
    assert info["attributes"]["source_kind"] == "tree"


def test_cli_inspect_prints_and_writes_json(packed, tmp_path):
    proc = invoke_dimd("inspect", packed, "--json", tmp_path / "info.json", check=True)
    assert "records     48" in proc.stdout and "classes     4" in proc.stdout
    doc = json.loads((tmp_path / "info.json").read_text())
    assert doc["result"]["count"] == 48 and doc["command"] == "inspect"
    # either file of the pair names the data set too
    assert "records     48" in invoke_dimd("inspect", f"{packed}.idx.h5", check=True).stdout


def test_truncated_data_file_fails_clearly(packed, tmp_path):
    data, index = dataset_paths(packed)
    copy = tmp_path / "cut"
    copy_data, copy_index = dataset_paths(copy)
    copy_data.write_bytes(data.read_bytes()[:-100])
    copy_index.write_bytes(index.read_bytes())
    with pytest.raises(DimdError, match="truncated, or not the pair"):
        describe(copy)
    proc = invoke_dimd("inspect", copy)
    assert proc.returncode == 1
    assert proc.stderr.startswith("dimd: error: ") and "Traceback" not in proc.stderr


def test_missing_files_fail_clearly(tmp_path):
    with pytest.raises(DimdError, match="index file not found"):
        describe(tmp_path / "nothing")
    (tmp_path / "lonely.idx.h5").write_bytes(b"not hdf5")
    (tmp_path / "lonely.dimd").write_bytes(b"")
    with pytest.raises(DimdError, match="unreadable index"):
        describe(tmp_path / "lonely")
