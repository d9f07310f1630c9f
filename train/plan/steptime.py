"""Gamma(m) = gamma * max(m, M_T): the per-rank compute seconds of one step (Perrone et al., eq. 4).

Below the knee M_T a step costs the same whatever the batch (the device is
not yet full); above it, gamma seconds per image. :func:`fit_step_time`
fits both to per-batch median step times by least squares over the knee
position: for a fixed knee K the best gamma has a closed form, so the fit
is a one-dimensional search over K (a dense scan, then a golden-section
refinement between the neighbours of the best point).

The residuals are relative, (fit - measured) / measured, and so is the
objective: the batch sizes are usually powers of two, and an absolute fit
would let the largest batch decide the knee alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dimd.errors import DimdError

_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class StepTimeFit:
    """The fitted Gamma and how well it matches each measured batch."""

    gamma: float                   # seconds per image above the knee
    m_t: float                     # the knee, in images per rank
    batches: tuple[int, ...]
    seconds: tuple[float, ...]     # the measured medians the fit used
    fitted: tuple[float, ...]
    residuals: tuple[float, ...]   # relative: (fit - measured) / measured
    knee: str                      # "inside", or "at-smallest"/"at-largest": no knee inside the range

    @property
    def rms_residual(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.residuals))))

    def __call__(self, per_rank_batch: float | np.ndarray) -> float | np.ndarray:
        return step_seconds(self.gamma, self.m_t, per_rank_batch)

    def figures(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "m_t": self.m_t, "knee": self.knee,
                "rms_relative_residual": self.rms_residual}


def step_seconds(gamma: float, m_t: float, per_rank_batch: float | np.ndarray) -> float | np.ndarray:
    """Gamma(m) = gamma * max(m, M_T)."""
    return gamma * np.maximum(per_rank_batch, m_t)


def _gamma_for_knee(m: np.ndarray, y: np.ndarray, knee: float) -> tuple[float, float]:
    """The best gamma for a fixed knee and its relative sum of squares."""
    ratio = np.maximum(m, knee) / y          # the model over the measurement, per unit gamma
    gamma = float(ratio.sum() / (ratio @ ratio))
    residual = gamma * ratio - 1.0
    return gamma, float(residual @ residual)


def fit_step_time(batches: Sequence[int], seconds: Sequence[float]) -> StepTimeFit:
    """Least-squares gamma and M_T for per-rank batch sizes and their median step seconds."""
    m = np.asarray(batches, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if m.shape != y.shape or m.ndim != 1:
        raise DimdError(f"step-time fit: {m.size} batch sizes but {y.size} times")
    if np.unique(m).size < 2:
        raise DimdError(f"step-time fit needs at least 2 distinct batch sizes, got {sorted(set(batches))}")
    if np.any(m < 1) or np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise DimdError("step-time fit needs batch sizes >= 1 and positive, finite times")
    order = np.argsort(m, kind="stable")
    m, y = m[order], y[order]
    low, high = float(m[0]), float(m[-1])
    grid = np.unique(np.concatenate([np.geomspace(low, high, 2001), m]))
    sse = np.array([_gamma_for_knee(m, y, k)[1] for k in grid])
    best = int(np.argmin(sse))
    a, b = float(grid[max(best - 1, 0)]), float(grid[min(best + 1, grid.size - 1)])
    for _ in range(60):   # golden section between the scan's neighbours
        c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
        if _gamma_for_knee(m, y, c)[1] <= _gamma_for_knee(m, y, d)[1]:
            b = d
        else:
            a = c
    knee = (a + b) / 2
    if _gamma_for_knee(m, y, knee)[1] > sse[best]:
        knee = float(grid[best])
    gamma, _ = _gamma_for_knee(m, y, knee)
    fitted = np.asarray(step_seconds(gamma, knee, m))
    # A knee at the smallest batch means the data show none (pure gamma * m);
    # at the largest, no linear part was measured.
    edge = "at-smallest" if knee <= low * (1 + 1e-9) else "at-largest" if knee >= high * (1 - 1e-9) else "inside"
    return StepTimeFit(gamma=gamma, m_t=knee, batches=tuple(int(v) for v in m), seconds=tuple(y.tolist()),
                       fitted=tuple(fitted.tolist()), residuals=tuple(((fitted - y) / y).tolist()),
                       knee=edge)

