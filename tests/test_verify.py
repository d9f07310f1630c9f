"""`dimd verify`: crc32 and a full decode of every record; bad records are named."""

from __future__ import annotations

import io
import json
import shutil
import time

import pytest
from conftest import invoke_dimd

from dimd.format import PackedDataset, PackedRecord, PackWriter, dataset_paths
from dimd.pack.inspection import verify
from dimd.pack.packer import PackConfig, pack


@pytest.fixture(scope="module")
def packed(sample_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "train"
    pack(PackConfig(sample_tree, out, workers=2))
    return out


def copy_of(packed, tmp_path, name="copy"):
    for src, dst in zip(dataset_paths(packed), dataset_paths(tmp_path / name)):
        shutil.copyfile(src, dst)
    return tmp_path / name


def test_sound_dataset_verifies(packed):
    for workers in (1, 2):
        began = time.perf_counter()
        result = verify(packed, workers=workers)
        assert result.ok and result.count == 48 and result.bad == []
        assert 0 < result.seconds <= time.perf_counter() - began   # its own time, not a record index
    proc = invoke_dimd("verify", packed, check=True)
    assert "ok: 48 records" in proc.stdout


def test_flipped_byte_is_named_with_its_record(packed, tmp_path):
    copy = copy_of(packed, tmp_path)
    ds = PackedDataset(copy)
    victim = 17
    position = int(ds.records["offset"][victim]) + 500
    data_path = dataset_paths(copy)[0]
    raw = bytearray(data_path.read_bytes())
    raw[position] ^= 0xFF
    data_path.write_bytes(bytes(raw))
    for workers in (1, 2):
        result = verify(copy, workers=workers)
        assert [(i, problem) for i, _, problem in result.bad] == [(victim, "crc32 mismatch")]
        assert result.bad[0][1] == ds.names[victim]
    proc = invoke_dimd("verify", copy, "--json", tmp_path / "v.json")
    assert proc.returncode == 1
    assert f"bad record {victim} ({ds.names[victim]}): crc32 mismatch" in proc.stderr
    assert "1 of 48 records are bad" in proc.stderr
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["result"]["ok"] is False and doc["result"]["bad_records"][0]["index"] == victim


def test_record_that_does_not_decode_is_named(tmp_path):
    from PIL import Image

    good = io.BytesIO()
    Image.new("RGB", (300, 256), (1, 2, 3)).save(good, "JPEG")
    with PackWriter(tmp_path / "mixed") as writer:
        writer.add(PackedRecord(good.getvalue(), 0, "good.jpg", 256, 300))
        writer.add(PackedRecord(b"\xff\xd8 garbage with a valid crc", 0, "garbage.jpg", 256, 300))
        writer.add(PackedRecord(good.getvalue(), 0, "wrong-size.jpg", 100, 100))
        writer.commit(["a"], short_side=256, quality=90, source="test")
    result = verify(tmp_path / "mixed")
    problems = {name: problem for _, name, problem in result.bad}
    assert set(problems) == {"garbage.jpg", "wrong-size.jpg"}
    assert problems["garbage.jpg"].startswith("does not decode")
    assert "index says 100x100" in problems["wrong-size.jpg"]
    assert verify(tmp_path / "mixed", decode=False).ok  # crc32s alone are fine


def test_truncated_data_file_names_the_cut_records(packed, tmp_path):
    copy = copy_of(packed, tmp_path)
    data_path = dataset_paths(copy)[0]
    data_path.write_bytes(data_path.read_bytes()[:-10])
    result = verify(copy)
    assert not result.ok and "index expects" in result.file_problem
    assert [i for i, _, _ in result.bad] == [47]
    proc = invoke_dimd("verify", copy)
    assert proc.returncode == 1 and "bad record 47" in proc.stderr
