"""The packed format: what a writer commits is exactly what a reader sees."""

import io

import h5py
import numpy as np
import pytest
from PIL import Image

from dimd.errors import DimdError
from dimd.format import FORMAT_NAME, PackedDataset, PackedRecord, PackWriter, crc32, dataset_paths


def jpeg(colour, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def write_set(out, records, classes=("a", "b"), force=False):
    with PackWriter(out, force=force) as writer:
        for record in records:
            writer.add(record)
        writer.commit(classes, short_side=30, quality=95, source="test")


def test_round_trip(tmp_path):
    blobs = [jpeg((255, 0, 0)), jpeg((0, 0, 255), (30, 50))]
    write_set(tmp_path / "set", [PackedRecord(blobs[0], 0, "a/0.jpg", 30, 40),
                                 PackedRecord(blobs[1], 1, "b/1.jpg", 50, 30)])
    ds = PackedDataset(tmp_path / "set")
    assert len(ds) == 2 and ds.classes == ["a", "b"]
    assert bytes(ds.record(1)) == blobs[1]
    assert (ds.label(1), ds.name(1)) == (1, "b/1.jpg")
    assert ds.records["offset"].tolist() == [0, len(blobs[0])]
    assert ds.records["crc32"][0] == crc32(blobs[0])
    assert ds.byte_range(0, 2) == (0, sum(map(len, blobs)))
    assert Image.open(io.BytesIO(ds.record(0))).getpixel((5, 5))[0] > 200


def test_index_is_plain_hdf5(tmp_path):
    write_set(tmp_path / "set", [PackedRecord(jpeg((1, 2, 3)), 0, "x", 30, 40)])
    with h5py.File(tmp_path / "set.idx.h5") as f:
        assert f.attrs["format"] == FORMAT_NAME
        assert f["offset"].dtype == np.uint64 and f["height"].dtype == np.uint16
        assert f["name"].asstr()[0] == "x"


def test_paths_accept_either_suffix():
    assert dataset_paths("d/x.dimd") == dataset_paths("d/x.idx.h5") == dataset_paths("d/x")


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with PackWriter(tmp_path / "set") as writer:
            writer.add(PackedRecord(jpeg((1, 2, 3)), 0, "x", 30, 40))
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path):
    write_set(tmp_path / "set", [])
    with pytest.raises(DimdError, match="output exists .set `force` to overwrite it."):
        PackWriter(tmp_path / "set")
    write_set(tmp_path / "set", [PackedRecord(jpeg((1, 2, 3)), 0, "x", 30, 40)], force=True)
    assert len(PackedDataset(tmp_path / "set")) == 1


def test_truncated_data_file_is_a_clear_error(tmp_path):
    write_set(tmp_path / "set", [PackedRecord(jpeg((1, 2, 3)), 0, "x", 30, 40)])
    data = tmp_path / "set.dimd"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(DimdError, match=r"set\.dimd.*truncated"):
        PackedDataset(tmp_path / "set")


def test_missing_index_is_a_clear_error(tmp_path):
    with pytest.raises(DimdError, match="index file not found"):
        PackedDataset(tmp_path / "nothing")
