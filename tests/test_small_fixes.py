"""Issue 13, group 8: Pillow's bomb warning, formats this Pillow cannot read, bench-allreduce row sizes."""

from __future__ import annotations

import base64
import io
import warnings

import pytest
from conftest import run_dimd, run_mpi_dimd
from hostile import one_error_line, small_tree
from PIL import Image, features

from dimd.pack.imaging import resize_encoded, unreadable_format

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


@pytest.mark.mpi
@pytest.mark.parametrize("args, dtype, size, got", [
    (["-b", "7", "-e", "64"], "float32", 4, 7),
    (["-b", "12", "-e", "64", "-d", "float64"], "float64", 8, 12),
    (["-b", "1", "-e", "64", "-d", "int32"], "int32", 4, 1),
])
def test_bench_allreduce_sizes_are_whole_elements(args, dtype, size, got):
    proc = run_mpi_dimd(1, "bench-allreduce", "-a", "mpi", *args, timeout=120)
    assert one_error_line(proc, code=2) == (
        f"Invalid value for '--min-bytes': must be a whole number of {dtype} elements, a multiple of "
        f"{size} bytes (got {got}): a row is labelled with the bytes it reduces")


@pytest.mark.mpi
def test_bench_allreduce_rows_are_labelled_with_the_size_asked_for(tmp_path):
    proc = run_mpi_dimd(1, "bench-allreduce", "-a", "mpi", "-b", "0", "-e", "40", "-f", "5", "-n", "2",
                        "--json", tmp_path / "ar.json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    rows = json.loads((tmp_path / "ar.json").read_text())["result"]["rows"]
    assert [r["bytes"] for r in rows] == [0, 4, 20] and [r["count"] for r in rows] == [0, 1, 5]
