"""In-memory decode: shapes, the crop distribution, draft decoding, and bad bytes."""

import io

import numpy as np
import pytest
from PIL import Image

from dimd.shuffle import DecodeError, decode_eval, decode_train
from dimd.shuffle.crop import random_resized_crop_box
from dimd.shuffle.decode import to_chw


def jpeg_bytes(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    """A smooth, non-symmetric test picture (gradients), so crops and flips are visible."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([255 * x / width, 255 * y / height, 128 + 60 * np.sin((x + seed) / 37.0)], axis=2)
    image = Image.fromarray(rgb.astype(np.uint8))
    if mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=92)
    return out.getvalue()


@pytest.mark.parametrize("size", [32, 224])
def test_decode_train_gives_chw_uint8_of_the_requested_size(size):
    out = decode_train(jpeg_bytes(500, 375), size, np.random.default_rng(0))
    assert out.shape == (3, size, size) and out.dtype == np.uint8 and out.flags.c_contiguous


def test_decode_train_is_a_function_of_the_generator():
    data = memoryview(jpeg_bytes(640, 480))
    a = decode_train(data, 64, np.random.default_rng(5))
    b = decode_train(data, 64, np.random.default_rng(5))
    c = decode_train(data, 64, np.random.default_rng(6))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_crop_boxes_stay_inside_and_follow_scale_and_ratio():
    rng = np.random.default_rng(1)
    for width, height in [(256, 256), (341, 256), (256, 900), (1200, 300), (20, 17)]:
        for _ in range(200):
            left, top, w, h = random_resized_crop_box(width, height, rng)
            assert 0 <= left and left + w <= width and 0 <= top and top + h <= height
            assert w > 0 and h > 0
    areas = []
    for _ in range(2000):
        _, _, w, h = random_resized_crop_box(400, 400, rng)
        areas.append(w * h / 400 ** 2)
        assert 3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02
    assert 0.07 <= min(areas) < 0.15 and max(areas) > 0.9


def test_a_larger_crop_scale_keeps_more_of_the_image():
    rng = np.random.default_rng(2)
    areas = [w * h / 400 ** 2 for _, _, w, h in
             (random_resized_crop_box(400, 400, rng, scale=(0.35, 1.0)) for _ in range(2000))]
    assert 0.33 <= min(areas) < 0.45 and max(areas) > 0.9


@pytest.mark.parametrize("crop_ratio, short", [(224 / 256, 73), (0.5, 128), (1.0, 64)])
def test_decode_eval_matches_resize_then_centre_crop(crop_ratio, short):
    """The shorter side resized to size / crop_ratio (torchvision's 224/256 by default), then the centre square."""
    data = jpeg_bytes(1000, 700)  # large enough that draft decoding kicks in
    ours = decode_eval(data, 64, crop_ratio) if crop_ratio != 224 / 256 else decode_eval(data, 64)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    resized = image.resize((round(1000 * short / 700), short), Image.BILINEAR)
    left = (resized.width - 64) // 2
    top = (resized.height - 64) // 2
    reference = to_chw(np.asarray(resized.crop((left, top, left + 64, top + 64))))
    assert ours.shape == (3, 64, 64)
    assert np.abs(ours.astype(int) - reference.astype(int)).mean() < 4


def test_flip_mirrors_the_crop():
    hwc = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    assert np.array_equal(to_chw(hwc, flip=True), to_chw(hwc)[:, :, ::-1])


def test_grayscale_jpegs_become_three_channels():
    data = jpeg_bytes(300, 200, mode="L")
    train = decode_train(data, 48, np.random.default_rng(0))
    evaluated = decode_eval(data, 48)
    assert train.shape == evaluated.shape == (3, 48, 48)
    assert np.array_equal(evaluated[0], evaluated[1])


def test_bad_bytes_raise_a_decode_error():
    with pytest.raises(DecodeError, match=r"^not a decodable image \(no image format recognised\)$"):
        decode_eval(b"definitely not a jpeg", 32)   # Pillow's own text names its BytesIO object
    truncated = jpeg_bytes(400, 300)[:2000]
    with pytest.raises(DecodeError):
        decode_train(truncated, 32, np.random.default_rng(0))


def torchvision_crop_and_flip(width, height, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params and RandomHorizontalFlip, drawing image by image."""
    import math

    area = width * height
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
            return (left, top, w, h), rng.random() < 0.5
    return None, rng.random() < 0.5   # the centre fallback (same in both)


def ks_statistic(a, b):
    """The two-sample Kolmogorov-Smirnov distance between the empirical distributions of a and b."""
    grid = np.union1d(a, b)
    cdf = lambda x: np.searchsorted(np.sort(x), grid, side="right") / len(x)  # noqa: E731
    return float(np.abs(cdf(a) - cdf(b)).max())


@pytest.mark.parametrize("width,height,scale", [(400, 300, (0.08, 1.0)), (1200, 300, (0.35, 1.0))])
def test_batch_drawn_crops_follow_torchvisions_distribution(width, height, scale):
    from dimd.shuffle.crop import crop_box, draw_crops

    n = 4000
    draws = draw_crops(np.random.default_rng(7), n)
    ours = [(crop_box(width, height, *draws.row(i)[:2], scale), draws.row(i)[2]) for i in range(n)]
    reference_rng = np.random.default_rng(8)
    theirs = [torchvision_crop_and_flip(width, height, reference_rng, scale) for _ in range(n)]
    theirs = [(box if box is not None else crop_box(width, height, [], [0, 0], scale), flip)
              for box, flip in theirs]

    def features(samples):
        boxes = np.array([box for box, _ in samples], float)
        left, top, w, h = boxes.T
        return {"scale": w * h / (width * height), "aspect": w / h,
                "left": left / np.maximum(width - w, 1), "top": top / np.maximum(height - h, 1)}

    for name, (a, b) in {k: (features(ours)[k], features(theirs)[k]) for k in features(ours)}.items():
        # 1.95 * sqrt(2 / n): a real difference would exceed it, chance only with p ~ 0.001
        assert ks_statistic(a, b) < 1.95 * (2 / n) ** 0.5, name
    flips = np.mean([flip for _, flip in ours]), np.mean([flip for _, flip in theirs])
    assert abs(flips[0] - 0.5) < 0.03 and abs(flips[1] - 0.5) < 0.03
