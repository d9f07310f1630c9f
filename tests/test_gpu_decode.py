"""--decode gpu's batch transform, on the CPU: the loader's crops, Pillow's pixels, in batched kernels."""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from dimd.shuffle import BatchLoader
from dimd.shuffle.decode import DecodeError, to_chw
from dimd.shuffle.gpu_decode import PIXEL_TOLERANCE, crop_resize_flip, gpu_decode_problem
from dimd.shuffle.raw_batches import jpeg_size, raw_batches

#: Where the CPU path decodes in the DCT domain (a crop at least twice the output), its pixels are
#: draft mode's downscale, not a resample of the full image: they agree on average only.
DRAFT_MEAN_TOLERANCE = 2.0


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, world):
    """Eight ordinary-sized JPEGs (none of the sample's > 1000 px ones: full-size decodes on a CPU are slow)."""
    from conftest import pack_tree_as_is

    from dimd.sample_data import SampleSpec, generate
    from dimd.shuffle import DistributedStore

    root = tmp_path_factory.mktemp("gpu-decode") / "train"
    generate(SampleSpec(root=root, classes=2, per_class=4, seed=5, large_share=0.0), workers=1)
    return DistributedStore.load(pack_tree_as_is(root, root.parent / "packed"), world)


def pillow_decode(record) -> torch.Tensor:
    """The CPU path's decoder (Pillow), at full size, as the 3 x H x W tensor nvJPEG would give."""
    return torch.from_numpy(np.array(Image.open(io.BytesIO(record)).convert("RGB"))).permute(2, 0, 1).contiguous()


def drafted(record, box, size: int) -> bool:
    """Whether the CPU path decodes this crop at a reduced size (JPEG draft mode), as it decides it."""
    image = Image.open(io.BytesIO(record))
    width, height = image.size
    k = size / min(box[2], box[3])
    if k < 1:
        image.draft("RGB", (math.ceil(width * k), math.ceil(height * k)))
    return image.size != (width, height)


def test_crop_resize_flip_matches_pillows_resize_on_any_box():
    rng = np.random.default_rng(0)
    images, boxes, flips, expected = [], [], [], []
    for k in range(10):
        width, height = int(rng.integers(20, 240)), int(rng.integers(20, 240))
        noise = Image.fromarray((rng.random((height // 4 + 1, width // 4 + 1, 3)) * 255).astype(np.uint8))
        pixels = np.asarray(noise.resize((width, height), Image.Resampling.BILINEAR))
        left, top = rng.uniform(0, width / 3), rng.uniform(0, height / 3)
        box = (left, top, rng.uniform(4, width - left), rng.uniform(4, height - top))
        if k % 3 == 0:
            box = tuple(float(int(v)) for v in box)
        flip = bool(k % 2)
        shrunk = Image.fromarray(pixels).resize((24, 24), Image.Resampling.BILINEAR,
                                                box=(box[0], box[1], box[0] + box[2], box[1] + box[3]))
        images.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).contiguous())
        boxes.append(box)
        flips.append(flip)
        expected.append(to_chw(np.asarray(shrunk), flip))

    batch = crop_resize_flip(images, np.array(boxes), np.array(flips), 24)

    assert batch.shape == (10, 3, 24, 24) and batch.dtype == torch.uint8
    difference = (batch.int() - torch.from_numpy(np.stack(expected)).int()).abs()
    assert int(difference.max()) <= PIXEL_TOLERANCE
    assert float(difference.float().mean()) < 0.05


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_gpu_path_cuts_the_loaders_crops_with_the_loaders_pixels(small_store, train):
    size = 128
    with BatchLoader(small_store, batch_size=8, image_size=size, train=train, seed=3) as loader:
        cpu_images, cpu_labels = next(iter(loader.epoch(0)))
    loader = BatchLoader(small_store, batch_size=8, image_size=size, train=train, seed=3)
    raw = next(raw_batches(loader, 0))

    batch = crop_resize_flip([pillow_decode(r) for r in raw.records], raw.boxes, raw.flips, size)

    assert raw.labels.tolist() == cpu_labels.tolist()
    assert raw.flips.any() == train
    difference = (batch.int() - cpu_images.int()).abs()
    exact = np.array([not drafted(r, b, size) for r, b in zip(raw.records, raw.boxes)])
    assert exact.any() and (~exact).any()   # the sample has both kinds at this size
    assert int(difference[torch.from_numpy(exact)].max()) <= PIXEL_TOLERANCE
    per_image = difference.flatten(1).float().mean(1)
    assert float(per_image[torch.from_numpy(~exact)].max()) <= DRAFT_MEAN_TOLERANCE


def test_raw_batches_move_the_loader_like_its_own_batches(store):
    loader = BatchLoader(store, batch_size=8, image_size=32, seed=1)
    batches = raw_batches(loader, 2)
    next(batches)
    next(batches)
    assert loader.position == (2, 2)
    batches.close()
    resumed = [b.labels.tolist() for b in raw_batches(loader, 2)]
    assert len(resumed) == loader.steps_per_epoch - 2
    assert loader.position == (3, 0)
    assert resumed == [store.labels[i].tolist() for i in loader.epoch_indices(2)[2:]]


def test_raw_batches_carry_the_epochs_size_and_evaluations_crop_ratio(store):
    """What nvJPEG's crops are resized to is the batch's own size: an epoch's under progressive resizing."""
    loader = BatchLoader(store, batch_size=8, image_size=32, seed=1, sizes=lambda epoch: 16 + 8 * epoch)
    assert [next(raw_batches(loader, epoch)).image_size for epoch in range(3)] == [16, 24, 32]
    evaluation = BatchLoader(store, batch_size=8, image_size=32, train=False, crop_ratio=0.5)
    raw = next(raw_batches(evaluation, 0))
    width, height = raw.sizes[0]
    assert raw.image_size == 32 and raw.boxes[0][2] == pytest.approx(min(width, height) / 2)


def test_jpeg_size_reads_the_frame_header_without_decoding(store):
    for i in range(len(store)):
        assert jpeg_size(store.record(i)) == Image.open(io.BytesIO(store.record(i))).size
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    for bad in (png.getvalue(), b"\xff\xd8\xff\xe0\x00\x10JFIF", b""):
        with pytest.raises(DecodeError, match="not a"):
            jpeg_size(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_decode_says_in_one_line_why_it_cannot_run_without_cuda():
    problem = gpu_decode_problem()
    assert problem is not None and "CUDA" in problem and "\n" not in problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_train_refuses_decode_gpu_in_one_line_before_loading_without_cuda(packed_sample, tmp_path):
    from conftest import run_dimd

    proc = run_dimd("train", packed_sample, "--val", packed_sample, "--model", "lenet", "--decode", "gpu",
                    "--json", tmp_path / "train.json")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "decode gpu needs" in proc.stderr and "loaded" not in proc.stdout
    assert not (tmp_path / "train.json").exists()
