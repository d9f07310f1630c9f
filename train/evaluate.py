"""Validation: each rank scores its own share of the val set, the counts are summed across ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float        # fraction in [0, 1]
    top5: float
    samples: int
    seconds: float
    ema: EvalResult | None = None   # the weights' moving average's figures, scored on the same pass (``ema``)

    def as_dict(self) -> dict[str, float]:
        return {"loss": self.loss, "top1": self.top1, "top5": self.top5, "samples": self.samples,
                "seconds": self.seconds}


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """How many labels are among the top-k predictions, for each k (k capped at the class count)."""
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices
    hits = top == labels.view(-1, 1)
    return [int(hits[:, : min(k, kmax)].any(dim=1).sum()) for k in ks]


@torch.no_grad()
def local_counts(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 normalize: Callable[[torch.Tensor], torch.Tensor], *,
                 label_map: torch.Tensor | None = None) -> np.ndarray:
    """[loss sum, top-1 hits, top-5 hits, samples] over this rank's batches.

    ``label_map`` translates the batches' labels into the model's (by class name).
    """
    model.eval()
    counts = np.zeros(4, np.float64)
    for images, labels in batches:
        x = normalize(images)
        y = (labels if label_map is None else label_map[labels]).to(x.device)
        logits = model(x)
        counts[0] += float(F.cross_entropy(logits, y, reduction="sum"))
        top1, top5 = topk_correct(logits, y)
        counts[1:] += (top1, top5, y.numel())
    return counts


def summarize(counts: np.ndarray, seconds: float) -> EvalResult:
    """Counts summed over every rank -> the job's validation figures."""
    n = max(int(counts[3]), 1)
    return EvalResult(loss=float(counts[0] / n), top1=float(counts[1] / n), top5=float(counts[2] / n),
                      samples=int(counts[3]), seconds=seconds)
