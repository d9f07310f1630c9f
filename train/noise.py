"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 from data-parallel training, for free.

McCandlish et al. (arXiv 1812.06162, appendix A): a gradient averaged over B
samples has E|G_B|^2 = |G|^2 + tr(Sigma) / B. Data-parallel training sees two
batch sizes every step: each rank's own gradient (b images, before the
allreduce) and the averaged one (B = P b, after it). From the mean of the
ranks' squared norms, |G_b|^2, and the averaged gradient's, |G_B|^2:

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)  =  (P |G_B|^2 - |G_b|^2) / (P - 1)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)  =  (|G_b|^2 - |G_B|^2) b P / (P - 1)

Both are unbiased. Their ratio is not, and one step's estimates are noisy
(either can come out negative), so each is smoothed by an exponential moving
average first and B_simple is the ratio of the averages (their appendix A.1),
with Adam's bias correction so the first steps are not pulled towards zero.
The cost in training: one more scalar (the local squared norm) in the
allreduce that already carries the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dimd.errors import DimdError


def noise_estimates(local_sqnorm_mean: float, global_sqnorm: float, local_batch: int,
                    ranks: int) -> tuple[float, float]:
    """One step's unbiased (|G|^2, tr(Sigma)) from the ranks' mean squared norm and the averaged one's.

    ``local_sqnorm_mean``: the mean over ranks of |g_r|^2, each g_r the mean
    gradient over ``local_batch`` images; ``global_sqnorm``: |mean_r g_r|^2.
    """
    if ranks < 2:
        raise DimdError("the gradient noise scale needs at least 2 ranks (two batch sizes to compare)")
    if local_batch < 1:
        raise DimdError(f"the local batch must be at least 1 image, got {local_batch}")
    g2 = (ranks * global_sqnorm - local_sqnorm_mean) / (ranks - 1)
    trace = (local_sqnorm_mean - global_sqnorm) * local_batch * ranks / (ranks - 1)
    return float(g2), float(trace)


def noise_estimates_from_gradients(local_gradients: np.ndarray, local_batch: int) -> tuple[float, float]:
    """The same from the ranks' gradients themselves (P x D): what the training hook computes in pieces."""
    grads = np.asarray(local_gradients, dtype=np.float64)
    local = float(np.mean(np.einsum("pd,pd->p", grads, grads)))
    mean = grads.mean(axis=0)
    return noise_estimates(local, float(mean @ mean), local_batch, grads.shape[0])


@dataclass
class NoiseScale:
    """Exponential moving averages of |G|^2 and tr(Sigma); :attr:`b_simple` is their ratio.

    ``smoothing`` is the weight the past keeps at each update (0.99: about the
    last hundred steps).
    """

    smoothing: float = 0.99
    _g2: float = 0.0
    _trace: float = 0.0
    _weight: float = 0.0     # the EMA's mass so far, for the bias correction
    steps: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.smoothing < 1:
            raise DimdError(f"noise-scale smoothing must be in [0, 1), got {self.smoothing}")

    def update(self, local_sqnorm_mean: float, global_sqnorm: float, local_batch: int, ranks: int) -> float | None:
        """Fold in one step's norms; return the current B_simple."""
        g2, trace = noise_estimates(local_sqnorm_mean, global_sqnorm, local_batch, ranks)
        if not (np.isfinite(g2) and np.isfinite(trace)):
            return self.b_simple   # a non-finite step (an overflow) is skipped, as AdaptDL does
        keep = self.smoothing
        self._g2 = keep * self._g2 + (1 - keep) * g2
        self._trace = keep * self._trace + (1 - keep) * trace
        self._weight = keep * self._weight + (1 - keep)
        self.steps += 1
        return self.b_simple

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps, so a resumed run continues the same averages."""
        return {"smoothing": self.smoothing, "g2": self._g2, "trace": self._trace, "weight": self._weight,
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.smoothing = float(state["smoothing"])
        self._g2, self._trace = float(state["g2"]), float(state["trace"])
        self._weight, self.steps = float(state["weight"]), int(state["steps"])

    def figures(self) -> dict[str, float | int | None]:
        """B_simple and the two averages it is the ratio of (``--metrics``, ``--json``)."""
        return {"noise_scale": self.b_simple, "noise_gradient_sqnorm": self.gradient_sqnorm,
                "noise_trace": self.trace_covariance, "noise_steps": self.steps}

    @property
    def gradient_sqnorm(self) -> float | None:
        return self._g2 / self._weight if self._weight else None

    @property
    def trace_covariance(self) -> float | None:
        return self._trace / self._weight if self._weight else None

    @property
    def b_simple(self) -> float | None:
        """tr(Sigma) / |G|^2 of the averages; None until |G|^2's average is positive."""
        g2, trace = self.gradient_sqnorm, self.trace_covariance
        if g2 is None or trace is None or g2 <= 0:
            return None
        return trace / g2
