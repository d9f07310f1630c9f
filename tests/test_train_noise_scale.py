"""dimd train --noise-scale: McCandlish et al.'s B_simple, estimated from the gradient allreduce for free."""

import json
from typing import Any

import pytest
from conftest import invoke_dimd, mpi_run, run_mpi_dimd
from mpi_case import case, say, world


@case
def noise_scale_matches_offline_estimator(data: str, algorithm: str = "default") -> None:
    """The engine's B_simple equals :class:`NoiseScale` fed offline with the same gradients, with ``algorithm``
    (default: the engine's choice; gloo: the squared norms ride torch.distributed's allreduce of the buckets,
    the path NCCL takes on GPUs)::

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py noise_scale_matches_offline_estimator PACKED_SET gloo
        -> ok 8 steps with gloo; B_simple per epoch ...

    Every rank trains lenet with ``noise_scale`` on and keeps a float64 copy of
    its gradient just before each allreduce (the buckets' ``synchronize`` is
    wrapped; the noise scale keeps overlap off, so nothing is reduced before it);
    rank 0 gathers the copies, feeds the estimator with norms computed from them
    in float64, and compares per epoch.
    """
    import numpy as np

    from dimd.train.buckets import GradientBuckets
    from dimd.train.config import SSGDConfig, TrainConfig
    from dimd.train.engine import train
    from dimd.train.noise import NoiseScale, noise_estimates_from_gradients

    comm = world("funneled")
    seen: list[Any] = []
    real_synchronize = GradientBuckets.synchronize

    def synchronize(self: GradientBuckets) -> None:   # this rank's gradient, as computed
        seen.append(self.flat.grads.detach().double().numpy().copy())
        real_synchronize(self)

    GradientBuckets.synchronize = synchronize  # type: ignore[method-assign]
    batch = 6
    config = TrainConfig(train=data, val=data, model="lenet", image_size=16, epochs=2, batch_size=batch, lr=0.1,
                         lr_scaling=False, schedule="constant", decode_workers=1, threads=1,
                         ssgd=SSGDConfig(noise_scale=True),
                         allreduce=None if algorithm == "default" else algorithm)
    result = train(config, comm)
    everyone = comm.gather(seen, root=0)
    if comm.Get_rank() != 0:
        return
    ranks = comm.Get_size()
    offline = NoiseScale()
    per_epoch = []
    for step in range(len(seen)):
        grads = np.stack([everyone[r][step] for r in range(ranks)])          # P x D
        local = float(np.mean(np.einsum("pd,pd->p", grads, grads)))
        mean = grads.mean(axis=0)
        offline.update(local, float(mean @ mean), batch, ranks)
        g2, _ = noise_estimates_from_gradients(grads, batch)   # the scalar form is the gradient form
        assert np.isclose(g2, (ranks * float(mean @ mean) - local) / (ranks - 1))
        if (step + 1) % result.steps_per_epoch == 0:
            per_epoch.append(offline.figures())
    assert len(per_epoch) == len(result.epochs) == 2
    for engine, expected in zip(result.epochs, per_epoch):
        assert engine.noise_steps == expected["noise_steps"]
        for key in ("noise_gradient_sqnorm", "noise_trace", "noise_scale"):
            got, want = getattr(engine, key), expected[key]
            assert (got is None) == (want is None), (key, got, want)
            if want is not None:
                assert np.isclose(got, want, rtol=1e-3, atol=1e-7), (key, got, want)
    assert result.epochs[-1].noise_scale is not None   # |G|^2's average has turned positive by then
    say(f"ok {len(seen)} steps with {result.allreduce}; B_simple per epoch "
        + ", ".join(f"{e.noise_scale}" for e in result.epochs))


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["default", "gloo"])
def test_the_engines_estimate_equals_the_estimator_fed_offline_with_the_same_gradients(colour_set, algorithm):
    proc = mpi_run(noise_scale_matches_offline_estimator, 2, colour_set, algorithm, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok 8 steps" in proc.stdout     # 48 images / (2 ranks x 6) = 4 steps an epoch, 2 epochs
    assert ("with gloo" in proc.stdout) == (algorithm == "gloo")


def train_args(data, *extra):
    return ["train", data, "--val", data, "--model", "lenet", "--image-size", "16", "--epochs", "2",
            "--batch-size", "6", "--threads", "1", "--decode-workers", "1", *map(str, extra)]


@pytest.mark.mpi
def test_noise_scale_goes_into_every_metrics_line_and_the_json_history(colour_set, tmp_path):
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "t.json"
    proc = run_mpi_dimd(2, *train_args(colour_set, "--noise-scale", "--metrics", metrics, "--json", summary))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    history = json.loads(summary.read_text())["result"]["history"]
    assert len(lines) == len(history) == 2
    for line, epoch in zip(lines, history):
        assert line["noise_steps"] == epoch["noise_steps"] == 4 * line["epoch"]
        assert "noise_scale" in line and line["noise_scale"] == epoch["noise_scale"]
        assert line["noise_trace"] is not None and line["noise_gradient_sqnorm"] is not None
    assert "B_simple" in proc.stdout


def test_noise_scale_is_refused_on_one_rank_and_with_sma_in_one_line(colour_set):
    proc = invoke_dimd(*train_args(colour_set, "--noise-scale"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dimd: error: --noise-scale needs at least 2 ranks: it compares each rank's gradient with their "
        "average (run under mpirun -n 2 or more)"]
    proc = invoke_dimd(*train_args(colour_set, "--noise-scale", "--sync", "sma"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "'--noise-scale': is a setting of S-SGD: it compares each rank's gradient" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
