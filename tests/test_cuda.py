"""dimd train on a CUDA device: each precision, nvJPEG decoding against the CPU decoders, resume.

Skipped where there is no CUDA device (``-m cuda`` selects them on a GPU machine); everything they
build on is tested on the CPU elsewhere.
"""

import json

import numpy as np
import pytest
import torch

from conftest import run_dimd

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

#: nvJPEG's inverse DCT and chroma upsampling are not libjpeg-turbo's: the same crop of the same JPEG
#: may differ by a few levels at edges, and agrees on average.
NVJPEG_MEAN_TOLERANCE = 2.0


def has_torchvision() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return False
    return True


def train(data, out, *extra: str) -> dict:
    run_dimd("train", data, "--val", data, "--model", "resnet20", "--image-size", "32", "--batch-size", "8",
             "--lr", "0.01", "--no-lr-scaling", "--decode-workers", "2", "--device", "cuda",
             "--checkpoint-dir", out / "checkpoints", "--json", out / "train.json", *extra,
             check=True, timeout=300)
    return json.loads((out / "train.json").read_text())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_an_epoch_in_each_precision_trains_on_the_gpu(packed_sample, tmp_path, precision):
    document = train(packed_sample, tmp_path, "--epochs", "1", "--precision", precision)
    result = document["result"]
    assert result["device"].startswith("cuda") and result["precision"] == precision
    assert np.isfinite(result["final"]["train_loss"]) and result["epochs_run"] == 1
    if precision == "16-mixed":
        assert result["skipped_steps"] < result["steps_per_epoch"]


@pytest.mark.skipif(not has_torchvision(), reason="decode gpu needs torchvision")
def test_nvjpeg_decodes_the_loaders_crops_close_to_the_cpu_decoders(store):
    from dimd.shuffle import BatchLoader
    from dimd.shuffle.gpu_decode import GpuDecoder
    from dimd.shuffle.raw_batches import raw_batches

    size = 128
    with BatchLoader(store, batch_size=8, image_size=size, seed=3) as loader:
        cpu_images, cpu_labels = next(iter(loader.epoch(0)))
    raw = next(raw_batches(BatchLoader(store, batch_size=8, image_size=size, seed=3), 0))
    images, labels = GpuDecoder(torch.device("cuda"), size)(raw)
    assert images.is_cuda and labels.tolist() == cpu_labels.tolist()
    difference = (images.cpu().int() - cpu_images.int()).abs().flatten(1).float().mean(1)
    assert float(difference.max()) <= NVJPEG_MEAN_TOLERANCE


@pytest.mark.skipif(not has_torchvision(), reason="decode gpu needs torchvision")
def test_an_epoch_with_gpu_decoding_learns(packed_sample, tmp_path):
    result = train(packed_sample, tmp_path, "--epochs", "2", "--decode", "gpu", "--precision", "bf16-mixed")["result"]
    assert result["epochs_run"] == 2 and np.isfinite(result["final"]["val_loss"])


def test_a_run_resumes_on_the_gpu_where_its_checkpoint_left_off(packed_sample, tmp_path):
    first = train(packed_sample, tmp_path, "--epochs", "1", "--precision", "16-mixed")["result"]
    resumed = train(packed_sample, tmp_path, "--epochs", "2", "--precision", "16-mixed", "--resume")["result"]
    assert resumed["resumed_from"] == first["checkpoint"]
    assert [e["epoch"] for e in resumed["history"]] == [1, 2]
    assert resumed["history"][1]["step"] == 2 * first["steps_per_epoch"]
    state = torch.load(resumed["checkpoint"], weights_only=True)
    assert state["config"]["precision"] == "16-mixed" and state["strategy"]["precision"]["loss_scale"] is not None


def test_the_feed_copies_the_loaders_page_locked_slots_to_the_gpu_ahead_of_the_step(store):
    from dimd.shuffle import BatchLoader
    from dimd.shuffle.device_feed import device_feed

    with BatchLoader(store, batch_size=8, image_size=32, seed=5) as loader:
        expected = [(images.clone(), labels.clone()) for images, labels in loader.epoch(0)]
    feed = device_feed(BatchLoader(store, batch_size=8, image_size=32, seed=5, pin_memory=True), torch.device("cuda"))
    fed = [(images.cpu(), labels.cpu()) for images, labels in feed.epoch(0)]
    feed.close()
    assert len(fed) == len(expected)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fed, expected))
