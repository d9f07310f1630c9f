"""Packing a Caffe LMDB: encoded datums, raw CHW BGR datums (1 and 3 channels), bad values."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import lmdb
import numpy as np
import pytest
from conftest import invoke_dimd
from PIL import Image

from dimd.errors import DimdError
from dimd.format import PackedDataset
from dimd.pack.caffe_datum import Datum, parse_datum
from dimd.pack.packer import PackConfig, pack


def write_lmdb(path: Path, items: dict[bytes, bytes]) -> Path:
    with lmdb.open(str(path), map_size=1 << 26) as env, env.begin(write=True) as txn:
        for key, value in items.items():
            txn.put(key, value)
    return path


def jpeg_bytes(size, colour, mode="RGB", fmt="JPEG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).convert(mode).save(buffer, fmt)
    return buffer.getvalue()


def raw_datum(rgb_pixels: np.ndarray, label: int) -> bytes:
    """As Caffe's CVMatToDatum writes it: uint8, channel-major, BGR."""
    if rgb_pixels.ndim == 2:
        chw = rgb_pixels[None]
    else:
        chw = rgb_pixels[..., ::-1].transpose(2, 0, 1)
    c, h, w = chw.shape
    return Datum(channels=c, height=h, width=w, data=np.ascontiguousarray(chw).tobytes(),
                 label=label).SerializeToString()


def test_datum_field_numbers_match_caffe_proto():
    """Hand-encoded wire bytes (field << 3 | wire type) as caffe.proto defines them."""
    wire = (b"\x08\x03"            # channels = 3        (field 1, varint)
            b"\x10\x02"            # height = 2          (field 2, varint)
            b"\x18\x05"            # width = 5           (field 3, varint)
            b"\x22\x03abc"         # data = b"abc"       (field 4, length-delimited)
            b"\x28\x07"            # label = 7           (field 5, varint)
            b"\x35\x00\x00\x80\x3f"  # float_data = [1.0] (field 6, fixed32)
            b"\x38\x01")           # encoded = true      (field 7, varint)
    datum = parse_datum(wire)
    assert (datum.channels, datum.height, datum.width, datum.data, datum.label) == (3, 2, 5, b"abc", 7)
    assert list(datum.float_data) == [1.0] and datum.encoded is True
    assert Datum().encoded is False  # the proto2 default


@pytest.fixture
def mixed_lmdb(tmp_path) -> Path:
    """Caffe-style keys; encoded JPEG/PNG/grey datums and raw 3- and 1-channel datums."""
    red_left = np.zeros((200, 300, 3), np.uint8)
    red_left[:, :150] = (255, 0, 0)
    red_left[:, 150:] = (0, 0, 255)
    grey = np.full((260, 400), 90, np.uint8)
    items = {
        b"00000000_n01440764/a.JPEG": Datum(data=jpeg_bytes((500, 375), (0, 200, 0)), label=1,
                                            encoded=True).SerializeToString(),
        b"00000001_n01440764/b.png": Datum(data=jpeg_bytes((256, 300), (0, 0, 230), fmt="PNG"),
                                           label=0, encoded=True).SerializeToString(),
        b"00000002_grey.JPEG": Datum(data=jpeg_bytes((300, 300), (128, 128, 128), "L"), label=2,
                                     encoded=True).SerializeToString(),
        b"00000003_raw_bgr": raw_datum(red_left, 3),
        b"00000004_raw_grey": raw_datum(grey, 4),
    }
    return write_lmdb(tmp_path / "train_lmdb", items)


def test_lmdb_variants_pack_with_labels_names_and_rgb_order(mixed_lmdb, tmp_path):
    result = pack(PackConfig(mixed_lmdb, tmp_path / "out", workers=2))
    assert result.source_kind == "lmdb" and result.images == 5 and result.skipped == []
    ds = PackedDataset(tmp_path / "out")
    assert ds.names[0] == "00000000_n01440764/a.JPEG" and ds.names[3] == "00000003_raw_bgr"
    assert ds.labels.tolist() == [1, 0, 2, 3, 4]
    assert ds.classes == ["0", "1", "2", "3", "4"]
    sizes = list(zip(ds.records["height"].tolist(), ds.records["width"].tolist()))
    assert sizes == [(256, 341), (300, 256), (256, 256), (256, 384), (256, 394)]
    pixels = [np.asarray(Image.open(io.BytesIO(ds.record(i)))) for i in range(5)]
    assert all(p.ndim == 3 and p.shape[2] == 3 for p in pixels)
    assert np.abs(pixels[0][128, 170].astype(int) - (0, 200, 0)).max() < 10
    assert np.abs(pixels[3][128, 40].astype(int) - (255, 0, 0)).max() < 10   # BGR -> RGB: red left
    assert np.abs(pixels[3][128, 340].astype(int) - (0, 0, 255)).max() < 10  # blue right
    assert np.abs(pixels[4][128, 200].astype(int) - 90).max() < 4


def test_lmdb_data_mdb_path_and_classes_file(mixed_lmdb, tmp_path):
    names = tmp_path / "synsets.txt"
    names.write_text("tench\ngoldfish\nshark\nray\nhen\n")
    pack(PackConfig(mixed_lmdb / "data.mdb", tmp_path / "out", classes_file=names, workers=1))
    assert PackedDataset(tmp_path / "out").classes == ["tench", "goldfish", "shark", "ray", "hen"]
    names.write_text("tench\n")  # one bad record never loses the run: datums it cannot name are skipped
    result = pack(PackConfig(mixed_lmdb, tmp_path / "again", classes_file=names, workers=1))
    assert result.images == 1 and len(result.skipped) == 4
    assert "label 4 but the classes file names only 1 classes" in dict(result.skipped).values()
    with pytest.raises(DimdError, match="label [1-4] but the classes file names only 1 classes"):
        pack(PackConfig(mixed_lmdb, tmp_path / "strict", classes_file=names, workers=1, strict=True))


def test_bad_lmdb_values_are_skipped_never_unpickled(tmp_path):
    class Boom:
        def __reduce__(self):
            return (Path(tmp_path / "PWNED").touch, ())

    good = Datum(data=jpeg_bytes((300, 300), (9, 9, 9)), label=0, encoded=True).SerializeToString()
    items = {
        b"0_good": good,
        b"1_pickle": pickle.dumps(Boom()),
        b"2_short_raw": Datum(channels=3, height=10, width=10, data=b"x" * 7).SerializeToString(),
        b"3_four_channels": Datum(channels=4, height=1, width=1, data=b"abcd").SerializeToString(),
        b"4_float": Datum(channels=1, height=1, width=2, float_data=[0.5, 0.25]).SerializeToString(),
        b"5_bad_encoded": Datum(data=b"not an image", encoded=True).SerializeToString(),
    }
    source = write_lmdb(tmp_path / "db", items)
    result = pack(PackConfig(source, tmp_path / "out", workers=2))
    assert result.images == 1 and not (tmp_path / "PWNED").exists()
    reasons = dict(result.skipped)
    assert set(reasons) == {"1_pickle", "2_short_raw", "3_four_channels", "4_float", "5_bad_encoded"}
    assert "not channels*height*width" in reasons["2_short_raw"]
    assert "4 channels" in reasons["3_four_channels"]
    assert "float_data" in reasons["4_float"]


def test_empty_lmdb_and_list_with_lmdb_are_errors(tmp_path):
    write_lmdb(tmp_path / "empty", {})
    with pytest.raises(DimdError, match="the LMDB has no entries"):
        pack(PackConfig(tmp_path / "empty", tmp_path / "out"))
    (tmp_path / "list.txt").write_text("a 0\n")
    with pytest.raises(DimdError, match="is an LMDB; `list_file` applies to image folders only"):
        pack(PackConfig(tmp_path / "empty", tmp_path / "out", list_file=tmp_path / "list.txt"))


def test_cli_packs_an_lmdb(mixed_lmdb, tmp_path):
    proc = invoke_dimd("pack", mixed_lmdb, "-o", tmp_path / "out", check=True)
    assert "packed 5 images in 5 classes" in proc.stdout
    assert "pack (lmdb): 5/5" in proc.stderr
