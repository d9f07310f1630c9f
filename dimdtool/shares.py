"""Balanced contiguous shares: how dimd cuts N items (records, buffer elements) into P parts."""

from __future__ import annotations

import numpy as np


def balanced_bounds(total: int, parts: int) -> np.ndarray:
    """``parts + 1`` int64 boundaries splitting ``total`` items into balanced contiguous shares.

    Share ``k`` is ``[bounds[k], bounds[k+1])``; the first ``total % parts``
    shares hold one item more (as ``np.array_split``); shares may be empty
    when ``total < parts``.
    """
    small, extra = divmod(int(total), int(parts))
    edges = np.arange(parts + 1, dtype=np.int64)
    return edges * small + np.minimum(edges, extra)
