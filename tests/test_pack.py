"""`dimd pack` from a class tree: sizes, labels, colours, worker-count invariance, atomic outputs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_dimd
from PIL import Image

from dimd.errors import DimdError
from dimd.format import PackedDataset, dataset_paths
from dimd.pack.packer import PackConfig, pack

COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}


def decode(ds: PackedDataset, i: int) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(ds.record(i))).convert("RGB"))


def solid(size: tuple[int, int], colour, mode: str = "RGB") -> Image.Image:
    return Image.new("RGB", size, colour).convert(mode)


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
