"""dimd train on a CUDA device: each precision (graphed and eager), nvJPEG decoding against the CPU decoders, resume.

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

#: (rtol, atol) of weights after an epoch of dimd train graphed against eager: the graphed step's optimizer is
#: torch.optim.SGD's fused kernel, the eager one its foreach kernels, and cuDNN may sum gradients in another order.
EPOCH_TOLERANCE = (1e-3, 1e-4)

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


def weights(result: dict) -> dict[str, torch.Tensor]:
    return torch.load(result["checkpoint"], weights_only=True)["model"]


def assert_runs_close(a: dict, b: dict) -> None:
    """Weights after the same epochs within EPOCH_TOLERANCE (test_cuda_graphs.py says why not bit for bit)."""
    rtol, atol = EPOCH_TOLERANCE
    for (name, x), y in zip(weights(a).items(), weights(b).values()):
        torch.testing.assert_close(x.float(), y.float(), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_an_epoch_in_each_precision_trains_on_the_gpu_graphed_as_eagerly(packed_sample, tmp_path, precision):
    """At batch 8 and 32 px the step replays as CUDA graphs by default; the eager epoch gives the same weights."""
    result = train(packed_sample, tmp_path / "graphed", "--epochs", "1", "--precision", precision)["result"]
    eager = train(packed_sample, tmp_path / "eager", "--epochs", "1", "--precision", precision,
                  "--no-cuda-graphs")["result"]
    assert result["device"].startswith("cuda") and result["precision"] == precision
    assert np.isfinite(result["final"]["train_loss"]) and result["epochs_run"] == 1
    if precision == "16-mixed":
        assert result["skipped_steps"] < result["steps_per_epoch"]
    graphs = result["cuda_graphs"]
    assert graphs["on"] and graphs["rule"].startswith("on: 8 images of 32 px")
    assert [(c["graph"], c["reason"]) for c in graphs["captures"]] == [("step", "first capture")]
    assert eager["cuda_graphs"] == {"on": False, "rule": "off: --no-cuda-graphs"}
    assert result["final"]["train_loss"] == pytest.approx(eager["final"]["train_loss"], rel=1e-2)
    assert_runs_close(result, eager)


@pytest.mark.skipif(not has_torchvision(), reason="decode gpu needs torchvision")
def test_nvjpeg_decodes_the_loaders_crops_close_to_the_cpu_decoders(store):
    from dimd.shuffle import BatchLoader
    from dimd.shuffle.gpu_decode import GpuDecoder
    from dimd.shuffle.raw_batches import raw_batches

    size = 128
    with BatchLoader(store, batch_size=8, image_size=size, seed=3) as loader:
        cpu_images, cpu_labels = next(iter(loader.epoch(0)))
    raw = next(raw_batches(BatchLoader(store, batch_size=8, image_size=size, seed=3), 0))
    images, labels = GpuDecoder(torch.device("cuda"))(raw)
    assert images.is_cuda and labels.tolist() == cpu_labels.tolist()
    difference = (images.cpu().int() - cpu_images.int()).abs().flatten(1).float().mean(1)
    assert float(difference.max()) <= NVJPEG_MEAN_TOLERANCE


@pytest.mark.skipif(not has_torchvision(), reason="decode gpu needs torchvision")
def test_an_epoch_with_gpu_decoding_learns(packed_sample, tmp_path):
    result = train(packed_sample, tmp_path, "--epochs", "2", "--decode", "gpu", "--precision", "bf16-mixed")["result"]
    assert result["epochs_run"] == 2 and np.isfinite(result["final"]["val_loss"])


def test_a_run_checkpointed_under_graphs_resumes_on_the_gpu_where_it_left_off(packed_sample, tmp_path):
    first = train(packed_sample, tmp_path, "--epochs", "1", "--precision", "16-mixed", "--cuda-graphs")["result"]
    resumed = train(packed_sample, tmp_path, "--epochs", "2", "--precision", "16-mixed", "--cuda-graphs",
                    "--resume")["result"]
    straight = train(packed_sample, tmp_path / "straight", "--epochs", "2", "--precision", "16-mixed",
                     "--cuda-graphs")["result"]
    assert resumed["resumed_from"] == first["checkpoint"]
    assert [e["epoch"] for e in resumed["history"]] == [1, 2]
    assert resumed["history"][1]["step"] == 2 * first["steps_per_epoch"]
    state = torch.load(resumed["checkpoint"], weights_only=True)
    assert state["config"]["precision"] == "16-mixed" and state["strategy"]["precision"]["loss_scale"] is not None
    assert all(isinstance(group["lr"], float) for group in state["strategy"]["optimizer"]["param_groups"])
    assert [c["reason"] for c in resumed["cuda_graphs"]["captures"]] == ["first capture"]   # loaded before it
    assert_runs_close(resumed, straight)


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


def test_one_rank_trains_with_nccl_started_from_mpi(packed_sample, tmp_path):
    """--allreduce nccl on one GPU: the group started from the (one-rank) MPI job, NCCL's communicator on the
    rank's GPU, the buckets given to it (one rank: nothing to sum, the graphed step one graph), and the run's
    JSON says so."""
    result = train(packed_sample, tmp_path, "--epochs", "1", "--allreduce", "nccl")["result"]
    assert result["allreduce"] == "nccl" and result["allreduce_choice"]["how"] == "requested"
    assert result["device"].startswith("cuda") and np.isfinite(result["final"]["train_loss"])
    graphs = result["cuda_graphs"]   # batch 8 at 32 px: graphed by the default rule
    assert graphs["on"] and [c["graph"] for c in graphs["captures"]] == ["step"]


def test_a_gradient_bucket_is_averaged_by_nccl_on_the_device(world):
    """One rank's group: NCCL's AVG over one rank leaves the bucket as it was, on the GPU, without a host copy."""
    from dimd.allreduce import start_group

    with start_group(world, "nccl", torch.device("cuda", torch.cuda.current_device())) as group:
        bucket = torch.arange(1000, dtype=torch.float32, device="cuda")
        group.start(bucket, average=True).wait()
        assert torch.equal(bucket.cpu(), torch.arange(1000, dtype=torch.float32))
        host = np.arange(10, dtype=np.float32)
        group.reduce_array(host)   # the registry's form: through the device and back
        assert np.array_equal(host, np.arange(10, dtype=np.float32))


def test_bench_allreduce_times_device_buffers(tmp_path):
    out = tmp_path / "cuda.json"
    run_dimd("bench-allreduce", "--device", "cuda", "-a", "mpi,ring", "-b", "1M", "-e", "16M", "-f", "4",
             "--check", "--json", out, check=True, timeout=300)
    rows = json.loads(out.read_text())["result"]["rows"]
    assert {r["algorithm"] for r in rows} == {"nccl", "d2h+h2d", "mpi", "ring"}
    assert all(r["wrong"] in (0, None) and r["time_us"] > 0 for r in rows)
    copies = {r["bytes"]: r["time_us"] for r in rows if r["algorithm"] == "d2h+h2d"}
    assert copies[16 << 20] > copies[1 << 20]   # the copies' cost grows with the size
