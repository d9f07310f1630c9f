"""Small least-squares helpers: non-negative fits of a few parameters, R².

The cost models have three parameters at most, so non-negative least squares
is solved exactly by trying every subset of free parameters (2^k small
unconstrained fits) and keeping the best feasible one: no iterative solver,
no scipy.
"""

from __future__ import annotations

import itertools

import numpy as np
from numpy.typing import ArrayLike


def weighted_nnls(features: ArrayLike, target: ArrayLike, weights: ArrayLike | None = None) -> np.ndarray:
    """argmin over x >= 0 of sum w_i (features_i . x - target_i)^2, exactly, for a few columns.

    A parameter a column cannot identify (all zeros, or a copy of another)
    comes out as the minimum-norm share, so collinear columns split
    their weight instead of blowing up.
    """
    a = np.asarray(features, dtype=np.float64)
    y = np.asarray(target, dtype=np.float64)
    if a.ndim != 2 or y.shape != (a.shape[0],):
        raise ValueError(f"features must be rows x columns matching target, got {a.shape} and {y.shape}")
    k = a.shape[1]
    if k > 8:
        raise ValueError("weighted_nnls enumerates subsets; use it for at most 8 parameters")
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    root = np.sqrt(w)
    aw, yw = a * root[:, None], y * root
    # Scale columns to unit norm so lstsq's cut-off treats them alike.
    norms = np.linalg.norm(aw, axis=0)
    norms[norms == 0] = 1.0
    scaled = aw / norms
    best, best_sse = np.zeros(k), float(yw @ yw)
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            cols = list(subset)
            solution, *_ = np.linalg.lstsq(scaled[:, cols], yw, rcond=1e-10)
            if np.any(solution < 0):
                continue
            x = np.zeros(k)
            x[cols] = solution / norms[cols]
            residual = aw @ x - yw
            sse = float(residual @ residual)
            if sse < best_sse * (1 - 1e-12):
                best, best_sse = x, sse
    return best


def r_squared(observed: ArrayLike, predicted: ArrayLike) -> float:
    """1 - SSE/SST; 1.0 for a perfect fit, nan when the observations do not vary."""
    y = np.asarray(observed, dtype=np.float64)
    sst = float(np.sum((y - y.mean()) ** 2))
    sse = float(np.sum((y - np.asarray(predicted, dtype=np.float64)) ** 2))
    if sst == 0:
        return float("nan") if sse else 1.0
    return 1.0 - sse / sst


def relative_errors(observed: ArrayLike, predicted: ArrayLike) -> np.ndarray:
    """(predicted - observed) / observed: signed, so a reader sees over- and under-prediction."""
    y = np.asarray(observed, dtype=np.float64)
    return (np.asarray(predicted, dtype=np.float64) - y) / y
