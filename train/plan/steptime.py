"""Gamma(m) = c + gamma * max(m, M_T): the per-rank compute seconds of one step.

Perrone et al. (eq. 4) model a step as gamma * max(m, M_T): the same cost
below the knee M_T (the device is not yet full), gamma seconds per image
above it. Measured steps also have a fixed cost above the knee (launching
kernels, the optimizer's pass over the weights, Python): LeNet on MNIST at
28 px took 1.30 ms at m = 1 and 1.92, 2.63, 4.56, 7.21 ms at 8, 16, 32, 64,
an affine curve that the paper's form fits 22-30 % low at m = 8-32, where
M_opt falls. So the fit adds c >= 0 seconds per step; with c = 0 it is the
paper's model.

:func:`fit_step_time` fits all three to per-batch median step times by least
squares over the knee position: for a fixed knee K the best (c, gamma) is a
two-parameter linear least-squares problem, so the fit is a one-dimensional
search over K (a dense scan, then a golden-section refinement between the
neighbours of the best point).

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
#: A per-image cost below this share of the largest step is rounding, not a slope (flat data).
_NEGLIGIBLE = 1e-9


@dataclass(frozen=True)
class StepTimeFit:
    """The fitted Gamma and how well it matches each measured batch."""

    overhead: float                # c: seconds per step whatever the batch
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
        return step_seconds(self.overhead, self.gamma, self.m_t, per_rank_batch)

    def figures(self) -> dict[str, Any]:
        return {"overhead": self.overhead, "gamma": self.gamma, "m_t": self.m_t, "knee": self.knee,
                "rms_relative_residual": self.rms_residual}


def step_seconds(overhead: float, gamma: float, m_t: float,
                 per_rank_batch: float | np.ndarray) -> float | np.ndarray:
    """Gamma(m) = c + gamma * max(m, M_T)."""
    return overhead + gamma * np.maximum(per_rank_batch, m_t)


def _fit_for_knee(m: np.ndarray, y: np.ndarray, knee: float) -> tuple[float, float, float]:
    """(c, gamma, relative sum of squares): the best c >= 0 and gamma > 0 for a fixed knee.

    Minimises sum(((c + gamma x) / y - 1)^2) with x = max(m, knee). Where the
    unconstrained optimum has c < 0 or no slope, or the knee leaves every x
    equal (c and gamma * knee then say the same), c = 0: the paper's form,
    whose best gamma is closed form.
    """
    x = np.maximum(m, knee)
    u, v = 1.0 / y, x / y                     # the model over the measurement, per unit c and per unit gamma
    uu, uv, vv = u @ u, u @ v, v @ v
    determinant = uu * vv - uv * uv
    if determinant > 1e-12 * uu * vv:
        c = (vv * u.sum() - uv * v.sum()) / determinant
        gamma = (uu * v.sum() - uv * u.sum()) / determinant
        if c >= 0 and gamma * x.max() > _NEGLIGIBLE * (c + gamma * x.max()):
            residual = c * u + gamma * v - 1.0
            return float(c), float(gamma), float(residual @ residual)
    gamma = v.sum() / vv
    residual = gamma * v - 1.0
    return 0.0, float(gamma), float(residual @ residual)


def fit_step_time(batches: Sequence[int], seconds: Sequence[float]) -> StepTimeFit:
    """Least-squares c, gamma and M_T for per-rank batch sizes and their median step seconds."""
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

    def sse(knee: float) -> float:
        return _fit_for_knee(m, y, knee)[2]

    grid = np.unique(np.concatenate([np.geomspace(low, high, 2001), m]))
    scanned = np.array([sse(k) for k in grid])
    best = int(np.argmin(scanned))   # the first of equal minima: the smallest knee that fits as well
    a, b = float(grid[max(best - 1, 0)]), float(grid[min(best + 1, grid.size - 1)])
    for _ in range(60):   # golden section between the scan's neighbours
        c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
        if sse(c) <= sse(d):
            b = d
        else:
            a = c
    knee = (a + b) / 2
    if sse(knee) >= scanned[best]:
        knee = float(grid[best])
    overhead, gamma, _ = _fit_for_knee(m, y, knee)
    fitted = np.asarray(step_seconds(overhead, gamma, knee, m))
    # A knee at the smallest batch means the data show none (an affine c + gamma * m);
    # at the largest, no linear part was measured.
    edge = "at-smallest" if knee <= low * (1 + 1e-9) else "at-largest" if knee >= high * (1 - 1e-9) else "inside"
    return StepTimeFit(overhead=overhead, gamma=gamma, m_t=knee, batches=tuple(int(v) for v in m),
                       seconds=tuple(y.tolist()), fitted=tuple(fitted.tolist()),
                       residuals=tuple(((fitted - y) / y).tolist()), knee=edge)
