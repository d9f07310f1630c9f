"""The chain's files: what each step's JSON must hold for the next, read back with one-line errors.

``step-time``, ``comm`` and ``convergence`` each write one result envelope;
``solve`` reads all three through :func:`solve_documents`. Every check names
the file and the missing or impossible figure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dimd.errors import DimdError
from dimd.train.plan import commfit, convergence, schema, solver
from dimd.train.plan.config import SolveConfig

STEP_TIME_COMMAND = "plan-batch step-time"
COMM_COMMAND = commfit.COMMAND
CONVERGENCE_COMMAND = convergence.COMMAND


def _number(figures: dict[str, Any], key: str, source: str) -> float:
    value = figures.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DimdError(f"{source}: no number '{key}' in its result (got {value!r})")
    return float(value)


def _range(values: list[Any], what: str, source: str) -> tuple[int, int]:
    numbers = [int(v) for v in values if isinstance(v, (int, float))]
    if not numbers:
        raise DimdError(f"{source}: no {what} in its result")
    return min(numbers), max(numbers)


def step_inputs(document: dict[str, Any], source: str) -> tuple[float, float, float, tuple[int, int]]:
    """(c, gamma, M_T, measured per-rank batch range) from a step-time result."""
    figures = document["result"]
    rows = figures.get("batches") or []
    return (_number(figures, "overhead", source), _number(figures, "gamma", source),
            _number(figures, "m_t", source),
            _range([r.get("batch") for r in rows if isinstance(r, dict)], "per-batch medians ('batches')", source))


def convergence_inputs(document: dict[str, Any], source: str) -> tuple[float, float, tuple[int, int], str]:
    """(N_inf, alpha, measured global batch range, the optimizer that trained the runs) from a convergence
    result; one written before results named their optimizer was SGD's, the only one then."""
    figures = document["result"]
    rows = figures.get("batches") or []
    used = [r.get("batch") for r in rows if isinstance(r, dict) and r.get("in_fit", True)]
    return (_number(figures, "n_inf", source), _number(figures, "alpha", source),
            _range(used, "batch sizes that reached the target ('batches')", source), figures.get("optimizer") or "sgd")


def comm_inputs(document: dict[str, Any], source: str, algorithms: tuple[str, ...] | None = None,
                max_holdout_error: float | None = None,
                ) -> tuple[dict[str, np.ndarray], int, tuple[int, int], dict[str, str]]:
    """({algorithm: (a, b, c, s)}, gradient bytes, measured rank range, {left out: why}) from a comm result.

    ``algorithms``: exactly these (each must have a fit). Otherwise every
    fitted one whose held-out median error is at most ``max_holdout_error``
    (a model that failed its check predicts nothing at 1024 ranks).
    """
    figures = document["result"]
    parameters = commfit.comm_model_from_figures(figures, source)
    left_out: dict[str, str] = {}
    if algorithms is not None:
        unknown = sorted(set(algorithms) - set(parameters))
        if unknown:
            raise DimdError(f"{source}: no fit for {', '.join(unknown)} (fitted: {', '.join(parameters)})")
        parameters = {name: p for name, p in parameters.items() if name in algorithms}
    elif max_holdout_error is not None:
        for name in list(parameters):
            check = (figures["algorithms"][name] or {}).get("holdout") or {}
            error = check.get("median_abs_error")
            if isinstance(error, (int, float)) and error > max_holdout_error:
                left_out[name] = f"held-out median error {100 * error:.0f}% > {100 * max_holdout_error:.0f}%"
                del parameters[name]
    if not parameters:
        why = "; ".join(f"{k}: {v}" for k, v in left_out.items())
        raise DimdError(f"{source}: no fitted algorithm to plan with" + (f" ({why}; see --max-holdout-error)"
                                                                         if why else ""))
    gradient_bytes = int(_number(figures, "gradient_bytes", source))
    ranks = _range(figures.get("ranks_measured") or [], "'ranks_measured'", source)
    return parameters, gradient_bytes, ranks, left_out


#: The shape each planner input's ``result`` must have (checked before any arithmetic).
SCHEMAS = {STEP_TIME_COMMAND: schema.STEP_RESULT, COMM_COMMAND: schema.COMM_RESULT,
           CONVERGENCE_COMMAND: schema.CONVERGENCE_RESULT}


def read(path: str | Path, command: str) -> dict[str, Any]:
    """A planner input: the envelope of ``command``'s result, its ``result`` checked against its schema."""
    from dimd.report import read_result

    document = read_result(path, command)
    schema.check(document["result"], SCHEMAS[command], str(path))
    return document


def beyond_critical_batch(plan: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per regime (optimal, strong, weak): the rank counts whose batch lies beyond the fit's critical batch."""
    return {regime: [row["ranks"] for row in plan if "critical-batch" in (row[regime].get("extrapolated") or [])]
            for regime in ("optimal", "strong", "weak")}


def solve_documents(config: SolveConfig, step: dict[str, Any], comm: dict[str, Any],
                    conv: dict[str, Any], sources: tuple[str, str, str] = ("step", "comm", "convergence"),
                    ) -> dict[str, Any]:
    """The ``solve`` figures from the three previous results (already read)."""
    overhead, gamma, m_t, step_range = step_inputs(step, sources[0])
    parameters, gradient_bytes, comm_range, left_out = comm_inputs(comm, sources[1], config.algorithms,
                                                                   config.max_holdout_error)
    n_inf, alpha, conv_range, optimizer = convergence_inputs(conv, sources[2])
    model = solver.Model(overhead=overhead, gamma=gamma, m_t=m_t, n_inf=n_inf, alpha=alpha)
    figures = solver.plan_rows(model, solver.Communication(parameters, gradient_bytes), config,
                               solver.Ranges(step_range, conv_range, comm_range))
    figures["algorithms_left_out"] = left_out
    figures["optimizer"] = optimizer   # the plan assumes the runs' optimizer: its N_update is that one's
    figures["critical_batch"] = model.critical_batch
    figures["beyond_critical_batch"] = beyond_critical_batch(figures["plan"])
    figures["measured"] = {"per_rank_batches": list(step_range), "global_batches": list(conv_range),
                           "ranks": list(comm_range)}
    return figures
