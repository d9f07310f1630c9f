"""The loader's region decode: only the rows and columns a crop needs, the same crop as a full decode."""

import io

import numpy as np
import pytest
from PIL import Image

from dimd.shuffle import DecodeError, decode_eval, decode_train
from dimd.shuffle import decode as decoding
from dimd.shuffle.crop import SCALE, crop_box, draw_crops


def textured_jpeg(width: int, height: int, seed: int = 0, *, subsampling: int = 2, progressive: bool = False,
                  mode: str = "RGB") -> bytes:
    """Noise over gradients: a pixel read from the wrong place, or decoded differently, shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([255 * x / width, 255 * y / height, 128 + 60 * np.sin(x / 7.0)], axis=2)
    pixels = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    if mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, subsampling=subsampling, progressive=progressive)
    return out.getvalue()


def pillow_crop(data: bytes, box: tuple[float, float, float, float], size: int) -> np.ndarray:
    """The same crop through Pillow's full decode."""
    return decoding._crop_resize(Image.open(io.BytesIO(data)), box, size)


def test_the_region_decoder_is_built_in_this_install():
    assert decoding._jpeg_region is not None, "pip did not build dimd.shuffle._jpeg_region (libjpeg-turbo headers?)"


@pytest.mark.parametrize("subsampling, progressive", [(2, False), (1, False), (0, False), (2, True)])
@pytest.mark.parametrize("size", [224, 64, 32])   # draft scales 1, 2-4 and 4-8 on these images
def test_random_crops_equal_the_full_decodes_to_the_bit(subsampling, progressive, size):
    rng = np.random.default_rng(size + subsampling)
    for seed, (width, height) in enumerate([(341, 256), (256, 384), (500, 375), (263, 257)]):
        data = textured_jpeg(width, height, seed, subsampling=subsampling, progressive=progressive)
        assert decoding._shape(data) == (width, height)
        draws = draw_crops(rng, 12)
        for i in range(len(draws)):
            tries, position, _ = draws.row(i)
            left, top, w, h = crop_box(width, height, tries, position, SCALE)
            region = decoding.crop_hwc(data, size, tries, position)
            assert region.shape == (size, size, 3)
            assert np.array_equal(region, pillow_crop(data, (left, top, left + w, top + h), size))


@pytest.mark.parametrize("size", [224, 48])
def test_evaluation_crops_equal_the_full_decodes_to_the_bit(size):
    for width, height in [(341, 256), (256, 341), (1000, 700)]:
        data = textured_jpeg(width, height)
        left, top, side, _ = decoding.centre_crop_box(width, height, size)
        expected = pillow_crop(data, (left, top, left + side, top + side), size)
        assert np.array_equal(decoding.eval_hwc(data, size), expected)


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grey_and_cmyk_jpegs_take_the_full_decode(mode):
    data = textured_jpeg(300, 200, mode=mode)
    assert decoding._shape(data) is None
    assert decode_train(data, 48, np.random.default_rng(0)).shape == (3, 48, 48)
    assert decode_eval(data, 48).shape == (3, 48, 48)


def test_a_jpeg_cut_short_is_refused_whatever_rows_the_crop_needs():
    data = textured_jpeg(400, 300)[:-3000]
    assert decoding._shape(data) is None    # no end marker: Pillow decodes it, and refuses it
    for seed in range(5):
        with pytest.raises(DecodeError, match="not a decodable image"):
            decode_train(data, 32, np.random.default_rng(seed))


def test_where_libjpeg_warns_pillows_verdict_stands():
    """libjpeg only warns about corrupt or extraneous data; the image goes to Pillow, which refuses
    a broken stream and tolerates bytes before a marker, as before the region decode."""
    clean = textured_jpeg(400, 300)
    broken = bytearray(clean)
    broken[len(broken) // 2: len(broken) // 2 + 400] = b"\xff\x00" * 200 + b"\xd0\xff" * 100
    with pytest.raises(ValueError, match="^warning: "):
        decoding._jpeg_region.decode(bytes(broken), 1, 0, 0, 400, 300, bytearray(1 << 20))
    with pytest.raises(DecodeError, match="not a decodable image"):
        decode_eval(bytes(broken), 224)
    scan = clean.index(b"\xff\xda")
    extraneous = clean[:scan] + b"\x00" * 5 + clean[scan:]
    with pytest.raises(ValueError, match="^warning: .*extraneous bytes"):
        decoding._jpeg_region.decode(extraneous, 1, 0, 0, 400, 300, bytearray(1 << 20))
    tries, position, _ = draw_crops(np.random.default_rng(0), 1).row(0)
    left, top, w, h = crop_box(400, 300, tries, position)
    assert np.array_equal(decoding.crop_hwc(extraneous, 224, tries, position),
                          pillow_crop(extraneous, (left, top, left + w, top + h), 224))


def test_a_record_that_is_no_jpeg_at_all_is_a_decode_error():
    with pytest.raises(DecodeError, match="not a decodable image"):
        decode_eval(b"\xff\xd8 not a jpeg at all \xff\xd9", 32)


def test_a_region_outside_the_image_is_refused_in_one_line():
    data = textured_jpeg(100, 80)
    with pytest.raises(ValueError, match=r"region \(0, 0, 101, 80\) is not inside the 100x80 image"):
        decoding._jpeg_region.decode(data, 1, 0, 0, 101, 80, bytearray(1 << 16))
    with pytest.raises(ValueError, match="scale must be 1, 2, 4 or 8"):
        decoding._jpeg_region.decode(data, 3, 0, 0, 10, 10, bytearray(1 << 16))
    with pytest.raises(ValueError, match="output buffer of 16 bytes"):
        decoding._jpeg_region.decode(data, 1, 0, 0, 50, 50, bytearray(16))


def test_the_region_benchmark_times_both_ways_on_equal_crops(packed_sample, tmp_path):
    import json

    from conftest import BENCH, run_python

    out = tmp_path / "region.json"
    run_python(BENCH / "probes" / "region_decode.py", packed_sample, "--runs", "2", "--images", "12",
               "--image-size", "48", "--json", out, check=True, timeout=200)
    results = json.loads(out.read_text())["result"]["results"]
    for kind in ("train", "eval"):
        assert results[kind]["full_us"]["median"] > 0 and results[kind]["region_us"]["median"] > 0
        assert len(results[kind]["ratio"]["runs"]) == 2
