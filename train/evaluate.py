"""Validation: each rank scores its own share of the val set, the counts are summed across ranks.

``dimd train`` evaluates its model with it after every epoch, and ``dimd eval`` a checkpoint
(:mod:`dimd.train.checkpoint_eval`), so the two give the same figures on the same set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dimd.train.config import TTA

#: The leading counts of :func:`local_counts`; per-class counts follow them.
_SUMS = 4


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float        # fraction in [0, 1]
    top5: float
    samples: int
    seconds: float
    ema: EvalResult | None = None   # the weights' moving average's figures, scored on the same pass (``ema``)
    #: With per-class counts: each class's (top-1 hits, samples), in the model's class order.
    per_class: tuple[tuple[int, int], ...] = ()

    def as_dict(self) -> dict[str, float]:
        return {"loss": self.loss, "top1": self.top1, "top5": self.top5, "samples": self.samples,
                "seconds": self.seconds}


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """How many labels are among the top-k predictions, for each k (k capped at the class count)."""
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices
    hits = top == labels.view(-1, 1)
    return [int(hits[:, : min(k, kmax)].any(dim=1).sum()) for k in ks]


def logits_of(model: nn.Module, x: torch.Tensor, tta: str | None = None) -> torch.Tensor:
    """The model's logits for the normalised batch ``x``; with ``tta`` "flip", the mean of those of ``x``
    and of its left-right mirror (the same weights, twice the compute)."""
    logits = model(x)
    if tta == "flip":
        logits = (logits + model(torch.flip(x, dims=(3,)))) / 2
    elif tta is not None:
        raise ValueError(f"unknown test-time augmentation {tta!r}; choose from {', '.join(TTA)}")
    return logits


@torch.no_grad()
def local_counts(model: nn.Module | Sequence[nn.Module], batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 normalize: Callable[[torch.Tensor], torch.Tensor], *,
                 label_map: torch.Tensor | None = None, tta: str | None = None, classes: int = 0) -> np.ndarray:
    """[loss sum, top-1 hits, top-5 hits, samples] over this rank's batches; with ``classes`` C, then each
    class's top-1 hits and each class's samples (2C more), so that they sum over ranks as the rest do.
    Several models (the run's and its weight average) are scored on one pass over the batches: a row each.

    ``label_map`` translates the batches' labels into the model's (by class name); ``tta`` see :func:`logits_of`.
    """
    models = [model] if isinstance(model, nn.Module) else list(model)
    for each in models:
        each.eval()
    counts = np.zeros((len(models), _SUMS + 2 * classes), np.float64)
    for images, labels in batches:
        x = normalize(images)
        y = (labels if label_map is None else label_map[labels]).to(x.device)
        for row, each in zip(counts, models):
            logits = logits_of(each, x, tta)
            row[0] += float(F.cross_entropy(logits, y, reduction="sum"))
            top1, top5 = topk_correct(logits, y)
            row[1:_SUMS] += (top1, top5, y.numel())
            if classes:
                hit = logits.argmax(dim=1) == y
                row[_SUMS:_SUMS + classes] += torch.bincount(y[hit], minlength=classes).cpu().numpy()
                row[_SUMS + classes:] += torch.bincount(y, minlength=classes).cpu().numpy()
    return counts[0] if isinstance(model, nn.Module) else counts


def summarize(counts: np.ndarray, seconds: float) -> EvalResult:
    """Counts summed over every rank -> the job's validation figures."""
    n = max(int(counts[3]), 1)
    classes = (len(counts) - _SUMS) // 2
    per_class = tuple(zip(counts[_SUMS:_SUMS + classes].astype(int).tolist(),
                          counts[_SUMS + classes:].astype(int).tolist()))
    return EvalResult(loss=float(counts[0] / n), top1=float(counts[1] / n), top5=float(counts[2] / n),
                      samples=int(counts[3]), seconds=seconds, per_class=per_class)
