"""T_C(M, P) = N_update(M) * (Gamma(M/P) + Delta(P)), and the batch that minimises it.

With N_update(M) = N_inf + alpha/M, Gamma(m) = c + gamma * max(m, M_T) and
Delta(P) = delta for a given P, write d = c + delta (the seconds of an
update that do not grow with the batch):

* above the knee (M/P >= M_T), T = N_inf gamma M/P + N_inf d + alpha gamma/P
  + alpha d/M; dT/dM = N_inf gamma/P - alpha d/M^2 vanishes at
  M* = sqrt(alpha d P / (gamma N_inf)), and d2T/dM2 = 2 alpha d/M^3 > 0,
  so M* is the minimum there (for N_inf > 0, alpha > 0);
* below the knee, T = (N_inf + alpha/M)(gamma M_T + d) only falls as M grows
  (alpha > 0), so the best M there is the knee itself, M_T P.

Hence M_opt(P) = max(M*, M_T P) (the paper's eq. 9, whose Gamma has c = 0),
and T is unimodal in M: falling up to M_opt, rising after. The boundary
cases: d = 0 (P = 1 and c = 0) gives M* = 0 and M_opt = M_T (eq. 8);
N_inf <= 0 (the fit can give it) makes T fall for ever above the knee, so
the largest allowed batch wins and a cap is needed; alpha <= 0 (more images
never save updates) makes the smallest batch win. Real batches are whole
images per rank, possibly from a list (powers of two): because T is
unimodal, the best allowed batch is one of the two allowed neighbours of
M_opt / P, and :func:`best_per_rank_batch` checks both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dimd.errors import DimdError
from dimd.train.plan.commfit import predict_delta
from dimd.train.plan.config import SolveConfig
from dimd.train.plan.convergence import updates_to_target
from dimd.train.plan.steptime import step_seconds

COMMAND = "plan-batch solve"


@dataclass(frozen=True)
class Model:
    """The fitted constants of T_C."""

    overhead: float  # c: seconds per step whatever the batch
    gamma: float     # seconds per image per rank above the knee
    m_t: float       # the knee, images per rank
    n_inf: float
    alpha: float

    def __post_init__(self) -> None:
        if not (self.overhead >= 0 and math.isfinite(self.overhead)):
            raise DimdError(f"step time: the overhead c must be a number >= 0, got {self.overhead}")
        if not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise DimdError(f"step time: gamma must be a positive number, got {self.gamma}")
        if not (self.m_t > 0 and math.isfinite(self.m_t)):
            raise DimdError(f"step time: the knee M_T must be positive, got {self.m_t}")
        if not (math.isfinite(self.n_inf) and math.isfinite(self.alpha)):
            raise DimdError(f"convergence: N_inf and alpha must be numbers, got {self.n_inf}, {self.alpha}")

    def updates(self, batch: float | np.ndarray) -> float | np.ndarray:
        return updates_to_target(self.n_inf, self.alpha, batch)

    @property
    def critical_batch(self) -> float | None:
        """alpha / N_inf (McCandlish et al.'s B_crit); None when N_inf or alpha is not positive.

        Above it the fitted law is nearly flat (N_update ~ N_inf), which is where SGD's real updates rise
        again (the large-batch wall) unless the optimizer keeps them down (LARS): a prediction there is an
        extrapolation of the fit, not something the sweep showed.
        """
        return self.alpha / self.n_inf if self.n_inf > 0 and self.alpha > 0 else None

    def update_seconds(self, per_rank: float | np.ndarray, delta: float) -> float | np.ndarray:
        return step_seconds(self.overhead, self.gamma, self.m_t, per_rank) + delta

    def time_to_target(self, batch: float | np.ndarray, ranks: int, delta: float,
                       per_rank: float | np.ndarray | None = None) -> float | np.ndarray:
        """T_C(M, P); ``per_rank`` (default M/P) lets a caller charge the slowest rank's share."""
        b = np.asarray(batch, dtype=np.float64)
        share = b / ranks if per_rank is None else per_rank
        return self.updates(b) * self.update_seconds(share, delta)


def continuous_optimum(model: Model, ranks: int, delta: float) -> tuple[float, str]:
    """(M_opt, case) over real M > 0: case "sqrt" (M* above the knee), "knee" (M_T P),
    "unbounded" (T keeps falling: N_inf <= 0) or "smallest" (alpha <= 0: T never falls)."""
    knee = model.m_t * ranks
    fixed = model.overhead + delta
    if model.alpha <= 0:
        return 0.0, "smallest"
    if model.n_inf > 0:
        m_star = math.sqrt(model.alpha * fixed * ranks / (model.gamma * model.n_inf))
        return (m_star, "sqrt") if m_star > knee else (knee, "knee")
    if model.n_inf == 0 and fixed == 0:
        return knee, "knee"   # T = alpha gamma / P on the whole linear part: the knee is the smallest best M
    return math.inf, "unbounded"


def closed_form_time(model: Model, ranks: int, delta: float) -> float | None:
    """The paper's eq. 10 with delta + c for its delta: T_C at the continuous M_opt (N_inf > 0, alpha > 0 only)."""
    if model.n_inf <= 0 or model.alpha <= 0:
        return None
    fixed = model.overhead + delta
    if ranks < model.alpha * fixed / (model.gamma * model.m_t**2 * model.n_inf):
        return (math.sqrt(fixed * model.n_inf) + math.sqrt(model.alpha * model.gamma / ranks)) ** 2
    return (model.n_inf + model.alpha / (model.m_t * ranks)) * (fixed + model.gamma * model.m_t)


def best_per_rank_batch(model: Model, ranks: int, delta: float, *, allowed: Sequence[int] | None = None,
                        largest: int | None = None) -> tuple[int, float, str]:
    """(images per rank, M_opt over real M, case): the best whole batch per rank.

    ``allowed``: the per-rank batches to choose from (default: every integer
    from 1); ``largest``: a cap on the per-rank batch (from ``--max-batch``).
    """
    m_opt, case = continuous_optimum(model, ranks, delta)
    options = sorted(set(int(b) for b in allowed)) if allowed else None
    if options is not None and largest is not None:
        options = [b for b in options if b <= largest]
    if options is not None and not options:
        raise DimdError(f"no allowed per-rank batch at P = {ranks} (cap {largest} per rank)")
    low = options[0] if options else 1
    high = options[-1] if options else largest
    if high is not None and high < low:
        raise DimdError(f"--max-batch leaves no whole image per rank at P = {ranks}")
    if case == "smallest":
        return low, m_opt, case
    target = m_opt / ranks
    if math.isinf(target):
        if high is None:
            raise DimdError(f"N_inf = {model.n_inf:.4g} <= 0: the time to target falls without limit as the "
                            "batch grows; give --max-batch (e.g. the training set's size)")
        return high, m_opt, case
    if options is None:
        below = max(low, math.floor(target))
        above = max(low, math.ceil(target))
        if high is not None:
            below, above = min(below, high), min(above, high)
        candidates = sorted({below, above})
    else:
        under = [b for b in options if b <= target]
        over = [b for b in options if b >= target]
        candidates = sorted({under[-1] if under else options[0], over[0] if over else options[-1]})
    times = [float(model.time_to_target(b * ranks, ranks, delta)) for b in candidates]
    return candidates[int(np.argmin(times))], m_opt, case


@dataclass(frozen=True)
class Communication:
    """Delta(P) from fitted cost models: the fastest of ``parameters``' algorithms at each P."""

    parameters: dict[str, np.ndarray]
    gradient_bytes: int

    def fastest(self, ranks: int) -> tuple[str | None, float]:
        if ranks == 1:
            return None, 0.0
        times = {name: predict_delta(name, params, self.gradient_bytes, ranks)
                 for name, params in self.parameters.items()}
        best = min(times, key=lambda name: times[name])
        return best, times[best]


@dataclass(frozen=True)
class Ranges:
    """What was measured, so a row can say where it extrapolates."""

    step_batches: tuple[int, int]          # per rank
    convergence_batches: tuple[int, int]   # global
    comm_ranks: tuple[int, int]


def _regime(model: Model, batch: int, ranks: int, delta: float, ranges: Ranges) -> dict[str, Any]:
    """One regime's row entry: batch, time and what it extrapolates from."""
    if batch < ranks:
        return {"batch": batch, "per_rank": None, "time_s": None,
                "note": f"fewer images ({batch}) than ranks ({ranks})"}
    per_rank = math.ceil(batch / ranks)   # the slowest rank sets the pace when P does not divide M
    updates = float(model.updates(batch))
    update_s = float(model.update_seconds(per_rank, delta))
    outside = []
    if not ranges.step_batches[0] <= per_rank <= ranges.step_batches[1]:
        outside.append("step-time")
    if not ranges.convergence_batches[0] <= batch <= ranges.convergence_batches[1]:
        outside.append("convergence")
    if ranks > 1 and not ranges.comm_ranks[0] <= ranks <= ranges.comm_ranks[1]:
        outside.append("comm")
    if model.critical_batch is not None and batch > model.critical_batch:
        outside.append("critical-batch")
    return {"batch": batch, "per_rank": per_rank, "time_s": updates * update_s if updates > 0 else None,
            "updates": updates, "update_s": update_s, "extrapolated": outside}


def plan_rows(model: Model, comm: Communication, config: SolveConfig, ranges: Ranges) -> dict[str, Any]:
    """The ``solve`` figures: one row per P with the optimal, strong and weak regimes."""
    ranks = sorted(set(config.ranks))
    deltas = {p: comm.fastest(p) for p in ranks}

    def optimal(p: int) -> tuple[int, float, str]:
        largest = config.max_batch // p if config.max_batch is not None else None
        if largest is not None and largest < 1:
            raise DimdError(f"--max-batch {config.max_batch} is smaller than P = {p}")
        return best_per_rank_batch(model, p, deltas[p][1], allowed=config.allowed_per_rank, largest=largest)

    # Defaults: strong scaling keeps the batch that is best on the most ranks, weak scaling the
    # per-rank batch that is best on the fewest.
    last_b, _, _ = optimal(ranks[-1])
    strong = config.strong_batch or last_b * ranks[-1]
    weak = config.weak_per_rank or optimal(ranks[0])[0]
    rows = []
    for p in ranks:
        algorithm, delta = deltas[p]
        b, m_continuous, case = optimal(p)
        best = _regime(model, b * p, p, delta, ranges)
        best.update({"continuous_batch": m_continuous if math.isfinite(m_continuous) else None, "case": case,
                     "closed_form_time_s": closed_form_time(model, p, delta)})
        rows.append({"ranks": p, "algorithm": algorithm, "delta_s": delta, "optimal": best,
                     "strong": _regime(model, strong, p, delta, ranges),
                     "weak": _regime(model, weak * p, p, delta, ranges)})
    return {"strong_batch": strong, "weak_per_rank": weak, "max_batch": config.max_batch,
            "gradient_bytes": comm.gradient_bytes, "algorithms": sorted(comm.parameters),
            "model": {"overhead": model.overhead, "gamma": model.gamma, "m_t": model.m_t, "n_inf": model.n_inf,
                      "alpha": model.alpha},
            "plan": rows}
