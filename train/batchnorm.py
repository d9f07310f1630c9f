"""A model's batch-norm statistics recomputed on training batches, over every rank (SWA's way).

SMA's central model z is not any learner: its weights are an average of
theirs (with momentum), so no learner's running statistics belong to it, and
the learners' statistics averaged miss the spread of their means (a mean of
variances is not the variance of the mixture). Before z is evaluated or
saved, its own statistics are measured instead: every batch-norm layer's
running mean and variance are reset and accumulated (a cumulative average,
``momentum=None``) over a few training batches through z in training mode,
with everything else in evaluation mode (no dropout), and without gradients.
Each rank measures on its own batches; one allreduce of every layer's mean
and mean square (``var + mean**2``) makes the statistics of the whole job's
batches, the same bits on every rank. docs/sma.md has the measurements
behind the choice.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Iterable

import torch
from torch import nn

from dimd.shuffle.device_feed import Batch
from dimd.train.flatgrad import Reduce


class CalibrationBatches:
    """Training batches for a recompute, ``(round, images)`` -> this rank's first batches of the
    draw ``round`` that hold at least ``images`` images, from one loader kept for the whole run.

    ``loader`` is a training :class:`~dimd.shuffle.BatchLoader` of its own seed
    (so the training loader's position and batches are untouched, and a resumed
    run draws the same calibration batches: they depend on seed, rank, round
    and step); it shares the training loader's decoding workers (one pool per
    process) and keeps its batch slots between recomputes, and it decodes only
    the batches taken. :meth:`close` lets go of them with the run.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __call__(self, round: int, images: int) -> Generator[Batch, None, None]:
        loader = self.loader
        batches = max(1, -(-images // loader.batch_size))
        loader.seek(round, 0)
        yield from loader.epoch(round, stop=batches)

    def close(self) -> None:
        self.loader.close()


#: torch's batch-norm layers (a lazy one becomes its BatchNorm*d at its first forward).
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
BatchNorm = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm


def batch_norm_layers(model: nn.Module) -> list[BatchNorm]:
    return [m for m in model.modules() if isinstance(m, BATCH_NORMS) and m.track_running_stats]


def _statistics(layer: BatchNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tracking layer's running mean, running variance and batch count (never None for these layers)."""
    mean, var, count = layer.running_mean, layer.running_var, layer.num_batches_tracked
    assert mean is not None and var is not None and count is not None
    return mean, var, count


@torch.no_grad()
def recompute_batch_norm(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         normalize: Callable[[torch.Tensor], torch.Tensor], reduce: Reduce,
                         world_size: int) -> int:
    """Collective: ``model``'s running statistics measured on ``batches`` (this rank's) and pooled
    over the ``world_size`` ranks through ``reduce`` (a sum); returns this rank's image count.

    Every rank must pass at least one batch. The layers' ``num_batches_tracked`` are left as they were.
    """
    layers = batch_norm_layers(model)
    if not layers:
        return 0
    saved = [(layer.momentum, _statistics(layer)[2].clone()) for layer in layers]
    was_training = model.training
    model.eval()
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None                        # a cumulative average over the batches
        layer.train()
    images = 0
    try:
        for x, _ in batches:
            model(normalize(x))
            images += int(x.shape[0])
    finally:
        for layer, (momentum, count) in zip(layers, saved):
            layer.momentum = momentum
            _statistics(layer)[2].copy_(count)
        model.train(was_training)
    if images == 0:
        raise ValueError("no batches to recompute the batch-norm statistics on")
    stats = [_statistics(layer) for layer in layers]
    pooled = torch.cat([torch.cat([m, v + m ** 2]) for m, v, _ in stats]).double().cpu().numpy()
    reduce(pooled)                                   # MPI: summed over the ranks
    pooled /= world_size
    offset = 0
    for running_mean, running_var, _ in stats:
        n = running_mean.numel()
        mean = torch.from_numpy(pooled[offset: offset + n])
        square = torch.from_numpy(pooled[offset + n: offset + 2 * n])
        running_mean.copy_(mean)
        running_var.copy_((square - mean * mean).clamp_min(0))
        offset += 2 * n
    return images
