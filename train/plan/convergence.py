"""N_update(M) = N_inf + alpha / M: updates to a target against the global batch (Perrone et al., eq. 2).

The input is one :class:`Run` per (batch, seed): the updates it took to
first reach the target, or None when it had not reached it when its budget
ran out. Such runs are kept, never dropped: a batch's median counts them
as "more than the budget" (so it is still right while fewer than half of
its runs missed), and a batch whose median missed is reported and left out
of the fit. The fit is least squares of the per-batch medians on
1/M (relative residuals, :func:`fit_inverse_law`), with R²; alpha / N_inf is
the critical batch (McCandlish et al.).

A fit is of one optimizer's runs (``Run.optimizer``): LARS is made to keep
the updates low at batches where SGD's rise, so its N_inf and alpha differ,
and each optimizer is swept and fitted on its own; the figures name it.

``plan-batch convergence`` (which runs the trainings) turns each run's
evaluations into updates-to-target with :func:`first_reached`, hands the runs
to :func:`convergence_figures` and writes them with :func:`convergence_document`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from dimd.errors import DimdError
from dimd.train.plan.lsq import r_squared

COMMAND = "plan-batch convergence"


@dataclass(frozen=True)
class Run:
    """One training run at global batch ``batch``: updates to the target, or None if it never got there."""

    batch: int
    seed: int
    updates: int | None
    budget: int | None = None    # the updates it was allowed (its give-up point), when it missed
    reason: str | None = None    # why it missed, when known ("budget", "diverged at step 40")
    optimizer: str = "sgd"       # what trained it (dimd.train.optimizers)

    @property
    def reached(self) -> bool:
        return self.updates is not None


@dataclass(frozen=True)
class ConvergenceFit:
    n_inf: float
    alpha: float
    r2: float
    batches: tuple[int, ...]      # the batches whose medians the fit used
    medians: tuple[float, ...]
    n_inf_se: float | None = None   # standard errors from the medians' scatter about the line (3+ batches)
    alpha_se: float | None = None

    def __call__(self, batch: float | np.ndarray) -> float | np.ndarray:
        return updates_to_target(self.n_inf, self.alpha, batch)

    @property
    def critical_batch(self) -> float | None:
        """alpha / N_inf, McCandlish et al.'s B_crit; None when N_inf <= 0."""
        return self.alpha / self.n_inf if self.n_inf > 0 else None

    @property
    def critical_batch_range(self) -> tuple[float, float | None] | None:
        """alpha / N_inf with N_inf one standard error up and down (None above: N_inf may be 0).

        When the swept batches all lie well below the critical batch, N_update
        is nearly alpha / M and N_inf is a small difference of large numbers:
        this range says how far the sweep pins B_crit down.
        """
        if self.n_inf_se is None or self.alpha <= 0:
            return None
        high = self.n_inf + self.n_inf_se
        low = self.n_inf - self.n_inf_se
        if high <= 0:
            return None
        return self.alpha / high, (self.alpha / low if low > 0 else None)


def first_reached(evaluations: Iterable[tuple[int, float]], target: float) -> int | None:
    """The updates at the first evaluation whose score reached ``target``; None if none did.

    ``evaluations``: (updates so far, score) in training order, e.g. validation
    top-1 evaluated every fixed number of images. The answer is exact to the
    evaluation interval (the run reached the target at or before it).
    """
    for updates, score in evaluations:
        if score >= target:
            return int(updates)
    return None


def updates_to_target(n_inf: float, alpha: float, batch: float | np.ndarray) -> float | np.ndarray:
    return n_inf + alpha / np.asarray(batch, dtype=np.float64)


def fit_inverse_law(batches: Sequence[float], updates: Sequence[float]) -> ConvergenceFit:
    """Least squares of the relative residuals of N = N_inf + alpha x, x = 1/M; needs 2 distinct batches.

    Relative, as the step-time fit: T_C's error is relative, and ordinary
    least squares let the smallest batch (thousands of updates) decide alone.
    On plan_batch_check's MNIST sweep (M = 4-128) the ordinary fit predicted
    195 updates at M = 86 where the real runs took 230 (the relative fit: 231).
    """
    m = np.asarray(batches, dtype=np.float64)
    n = np.asarray(updates, dtype=np.float64)
    if np.unique(m).size < 2:
        raise DimdError(f"the inverse-law fit needs at least 2 distinct batch sizes, got {sorted(set(batches))}")
    if np.any(n <= 0):
        raise DimdError("the inverse-law fit needs positive update counts")
    x = 1.0 / m
    design = np.column_stack([np.ones_like(x), x])
    weighted = design / n[:, None]                 # each row divided by its measurement: relative residuals
    (n_inf, alpha), *_ = np.linalg.lstsq(weighted, np.ones_like(n), rcond=None)
    n_inf_se = alpha_se = None
    if m.size > 2 and np.unique(m).size > 2:   # weighted least squares' standard errors
        residual = weighted @ [n_inf, alpha] - 1.0
        variance = float(residual @ residual) / (m.size - 2)
        n_inf_se, alpha_se = (float(v) for v in np.sqrt(np.diag(variance * np.linalg.inv(weighted.T @ weighted))))
    return ConvergenceFit(float(n_inf), float(alpha), r_squared(n, design @ [n_inf, alpha]),
                          tuple(int(b) for b in m), tuple(n.tolist()), n_inf_se, alpha_se)


def batch_summary(batch: int, runs: Sequence[Run]) -> dict[str, Any]:
    """Median (a missed run counts as beyond any budget), spread of the runs that reached, and those that did not."""
    from dimd.report import spread

    reached = sorted(r.updates for r in runs if r.updates is not None)
    missed = [r for r in runs if r.updates is None]
    everything = np.array(reached + [np.inf] * len(missed), dtype=np.float64)
    median = float(np.median(everything)) if everything.size else float("inf")
    return {
        "batch": batch, "runs": len(runs), "reached": len(reached), "unreached": len(missed),
        "median_updates": median if np.isfinite(median) else None,
        "updates": spread(reached),
        "unreached_runs": [{"seed": r.seed, "budget": r.budget, "reason": r.reason} for r in missed],
    }


def batch_rows(runs: Iterable[Run]) -> list[dict[str, Any]]:
    """Every batch's summary (:func:`batch_summary`), smallest batch first; checks the runs."""
    runs = list(runs)
    if not runs:
        raise DimdError("no training runs to fit")
    bad = [r for r in runs if r.batch < 1 or (r.updates is not None and r.updates < 0)]
    if bad:
        raise DimdError(f"a run has batch {bad[0].batch} and updates {bad[0].updates}: "
                        "batches must be >= 1 and updates >= 0")
    return [batch_summary(b, [r for r in runs if r.batch == b]) for b in sorted({r.batch for r in runs})]


def convergence_figures(runs: Iterable[Run], target: Any = None) -> dict[str, Any]:
    """The ``plan-batch convergence`` figures: the fit and every batch's runs, missed ones included."""
    runs = list(runs)
    rows = batch_rows(runs)
    optimizer = sweep_optimizer(runs)
    if not any(r.reached for r in runs):
        what = f" {target}" if target is not None else ""
        raise DimdError(f"no run reached the target{what} ({len(runs)} runs at batches "
                        f"{', '.join(map(str, sorted({r.batch for r in runs})))}): lower the target or "
                        "raise the budget")
    usable = [row for row in rows if row["median_updates"] is not None]
    if len(usable) < 2:
        raise DimdError(f"only {len(usable)} batch size(s) reached the target in at least half their runs; "
                        "the inverse law needs 2 or more (reached: "
                        + ", ".join(f"M={row['batch']}: {row['reached']}/{row['runs']}" for row in rows) + ")")
    fit = fit_inverse_law([row["batch"] for row in usable], [row["median_updates"] for row in usable])
    for row in rows:
        row["in_fit"] = row["median_updates"] is not None
        row["fitted_updates"] = float(fit(row["batch"]))
    return {
        "n_inf": fit.n_inf, "alpha": fit.alpha, "r2": fit.r2, "b_crit": fit.critical_batch,
        "n_inf_se": fit.n_inf_se, "alpha_se": fit.alpha_se, "b_crit_range": fit.critical_batch_range,
        "batches_in_fit": len(usable),
        "target": target, "optimizer": optimizer,
        "fit_on": "per-batch medians against 1/M (least squares of the relative residuals)",
        "batches": rows,
        "unreached_runs": sum(row["unreached"] for row in rows),
    }


def sweep_optimizer(runs: Sequence[Run]) -> str:
    """The one optimizer that trained every run; runs of several are refused (fit each one's apart)."""
    names = sorted({r.optimizer for r in runs})
    if len(names) != 1:
        raise DimdError(f"the runs were trained by {', '.join(names) or 'no optimizer'}: one inverse law fits "
                        f"one optimizer's runs; fit each optimizer's runs apart")
    return names[0]


def unfitted_figures(runs: Iterable[Run], target: Any, problem: str) -> dict[str, Any]:
    """What a sweep that could not be fitted still reports: every batch's runs, the fit left empty."""
    runs = list(runs)
    rows = batch_rows(runs)
    for row in rows:
        row["in_fit"] = False
    return {"n_inf": None, "alpha": None, "r2": None, "b_crit": None, "n_inf_se": None, "alpha_se": None,
            "b_crit_range": None, "batches_in_fit": 0, "target": target, "optimizer": sweep_optimizer(runs),
            "error": problem,
            "batches": rows, "unreached_runs": sum(row["unreached"] for row in rows)}


def convergence_document(runs: Iterable[Run], parameters: Any, target: Any = None,
                         extra: dict[str, Any] | None = None, mpi: Any = None) -> dict[str, Any]:
    """The result envelope ``plan-batch convergence`` writes (and ``solve`` reads).

    ``extra``: more figures (each run's details, how the runs were spread over the ranks).
    """
    from dimd.report import result_document

    return result_document(COMMAND, parameters, {**convergence_figures(runs, target), **(extra or {})}, mpi=mpi)


def synthetic_runs(n_inf: float, alpha: float, batches: Sequence[int], seeds: int, *, noise: float = 0.05,
                   budget: int | None = None, rng: np.random.Generator | int = 0,
                   optimizer: str = "sgd") -> list[Run]:
    """Runs that follow the inverse law with relative log-normal noise (tests and dry runs of ``solve``).

    A run whose drawn updates exceed ``budget`` is reported as unreached.
    """
    rng = np.random.default_rng(rng)
    out = []
    for batch in batches:
        for seed in range(seeds):
            updates = int(round(float(updates_to_target(n_inf, alpha, batch)) * float(np.exp(rng.normal(0, noise)))))
            if budget is not None and updates > budget:
                out.append(Run(batch, seed, None, budget, optimizer=optimizer))
            else:
                out.append(Run(batch, seed, updates, optimizer=optimizer))
    return out
