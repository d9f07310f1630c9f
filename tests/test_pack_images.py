"""What pack makes of each image: any size or mode becomes an RGB JPEG of the short side asked for
(transparency white, EXIF orientation applied, 16 bits kept to their top 8, large JPEGs decoded in
the DCT domain), a huge image packs without Pillow's bomb warning, and a format this Pillow cannot
read is named as such."""

from __future__ import annotations

import base64
import io
import warnings

import numpy as np
import pytest
from conftest import run_dimd
from hostile import decode, small_tree, solid
from PIL import Image, features

from dimd.format import PackedDataset
from dimd.pack.imaging import resize_encoded, unreadable_format
from dimd.pack.packer import PackConfig, pack

#: A 1x1 lossless WebP (the one Modernizr uses to detect WebP support).
WEBP_1X1 = base64.b64decode("UklGRhoAAABXRUJQVlA4TA0AAAAvAAAAEAcQERGIiP4HAA==")


def test_a_large_legitimate_image_packs_without_pillows_warning(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 1})
    Image.new("L", (9600, 9400), 128).save(root / "a" / "huge.jpg", quality=50)  # 90 M pixels > 89.5 M
    proc = run_dimd("pack", root, "-o", tmp_path / "x", "-q", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and "packed 2 images" in proc.stdout


def test_the_bomb_warning_is_silenced_where_the_size_is_handled(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # warn above 1000 pixels, refuse above 2000
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), (1, 2, 3)).save(buffer, "PNG")  # 1600 pixels
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        image = resize_encoded(buffer.getvalue(), 32, 90)
    assert (image.width, image.height) == (32, 32)


def test_an_image_format_this_pillow_lacks_is_named_as_such(tmp_path):
    root = small_tree(tmp_path / "tree", {"a": 1})
    (root / "a" / "tiny.webp").write_bytes(WEBP_1X1)
    (root / "a" / "photo.heic").write_bytes(b"\x00\x00\x00\x18ftypheic" + bytes(40))
    (root / "a" / "garbage.png").write_bytes(b"just text")
    proc = run_dimd("pack", root, "-o", tmp_path / "x", "--skipped", tmp_path / "skipped.txt", "-q")
    assert proc.returncode == 0, proc.stderr
    reasons = dict(line.split("\t") for line in (tmp_path / "skipped.txt").read_text().splitlines())
    assert reasons.pop("a/garbage.png") == "not an image Pillow can read"
    assert reasons.pop("a/photo.heic").startswith("a HEIF/HEIC image, but this Pillow build (")
    if features.check("webp"):
        assert reasons == {} and "packed 2 images" in proc.stdout
    else:
        assert reasons["a/tiny.webp"].startswith("a WebP image, but this Pillow build (")
        assert reasons["a/tiny.webp"].endswith(") cannot read WebP (it was built without libwebp)")


@pytest.mark.parametrize("data, name", [
    (WEBP_1X1, "WebP"),
    (b"\x00\x00\x00\x1cftypavif" + bytes(20), "AVIF"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n" + bytes(20), "JPEG 2000"),
    (b"\xff\x0a" + bytes(20), "JPEG XL"),
])
def test_format_sniffing_names_the_format(data, name):
    assert unreadable_format(data).startswith(f"a {name} image")


def test_upscales_small_images_to_the_short_side(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    solid((100, 50), (10, 200, 30)).save(tmp_path / "src" / "a" / "tiny.png")
    pack(PackConfig(tmp_path / "src", tmp_path / "out", workers=1))
    ds = PackedDataset(tmp_path / "out")
    assert (ds.records["height"][0], ds.records["width"][0]) == (256, 512)


@pytest.mark.parametrize("mode", ["L", "CMYK", "P", "RGBA", "LA", "1", "I;16"])
def test_every_mode_becomes_rgb(tmp_path, mode):
    (tmp_path / "src" / "a").mkdir(parents=True)
    image = solid((320, 300), (200, 40, 40), "RGB")
    if mode == "I;16":
        image = Image.fromarray(np.full((300, 320), 40000, np.uint16))
    elif mode != "RGB":
        image = image.convert(mode)
    suffix = ".jpg" if mode in ("L", "CMYK") else (".tif" if mode == "I;16" else ".png")
    image.save(tmp_path / "src" / "a" / f"img{suffix}")
    pack(PackConfig(tmp_path / "src", tmp_path / "out", workers=1))
    ds = PackedDataset(tmp_path / "out")
    stored = Image.open(io.BytesIO(ds.record(0)))
    assert stored.mode == "RGB" and min(stored.size) == 256


def test_transparent_pixels_become_white(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    rgba = Image.new("RGBA", (300, 300), (0, 0, 0, 0))
    rgba.paste((255, 0, 0, 255), (0, 0, 150, 300))  # left half opaque red, right transparent
    rgba.save(tmp_path / "src" / "a" / "alpha.png")
    pack(PackConfig(tmp_path / "src", tmp_path / "out", workers=1))
    pixels = decode(PackedDataset(tmp_path / "out"), 0)
    assert np.abs(pixels[128, 30].astype(int) - (255, 0, 0)).max() < 10
    assert pixels[128, 225].min() > 245


def test_exif_orientation_is_applied(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    image = Image.new("RGB", (600, 300), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 300, 300))  # stored: red on the left, blue on the right
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": red ends up on top
    image.save(tmp_path / "src" / "a" / "rotated.jpg", exif=exif.tobytes(), quality=95)
    pack(PackConfig(tmp_path / "src", tmp_path / "out", workers=1))
    ds = PackedDataset(tmp_path / "out")
    pixels = decode(ds, 0)
    assert pixels.shape[:2] == (512, 256)  # portrait after rotation
    assert pixels[60, 128, 0] > 200 and pixels[60, 128, 2] < 60  # top is red
    assert pixels[450, 128, 2] > 200 and pixels[450, 128, 0] < 60  # bottom is blue


def test_large_jpegs_use_draft_decoding_and_keep_quality(tmp_path):
    """A 2400 px JPEG goes through DCT-domain downscaling; the result still matches a full decode."""
    from dimd.pack.imaging import resize_encoded, target_size

    rng = np.random.default_rng(0)
    smooth = rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)
    big = Image.fromarray(smooth).resize((2400, 1800), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    big.save(buffer, "JPEG", quality=95)
    data = buffer.getvalue()
    probe = Image.open(io.BytesIO(data))
    probe.draft("RGB", target_size(2400, 1800, 256))
    assert probe.size[0] < 2400  # libjpeg will decode at reduced scale
    packed = resize_encoded(data, 256, 90)
    assert (packed.width, packed.height) == (341, 256)
    ours = np.asarray(Image.open(io.BytesIO(packed.data)), float)
    reference = np.asarray(big.resize((341, 256), Image.Resampling.LANCZOS), float)
    psnr = 10 * np.log10(255**2 / np.mean((ours - reference) ** 2))
    assert psnr > 30


@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_sixteen_bit_grey_keeps_its_top_eight_bits(tmp_path, suffix):
    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.fromarray(np.full((300, 320), 40000, np.uint16)).save(tmp_path / "src" / "a" / f"deep{suffix}")
    pack(PackConfig(tmp_path / "src", tmp_path / "out", workers=1))
    pixels = decode(PackedDataset(tmp_path / "out"), 0)
    assert np.abs(pixels.astype(int) - (40000 >> 8)).max() <= 2


def test_broken_exif_keeps_the_image(tmp_path):
    from dimd.pack.imaging import resize_encoded

    buffer = io.BytesIO()
    solid((300, 300), (0, 0, 200)).save(buffer, "JPEG", exif=b"Exif\x00\x00MM\x00*garbage")
    packed = resize_encoded(buffer.getvalue(), 256, 90)
    assert (packed.width, packed.height) == (256, 256)
