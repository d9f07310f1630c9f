"""Fit each allreduce's cost model to ``bench-allreduce`` results and predict Delta(P).

Every measured row (algorithm, P, bytes, seconds) gives one equation
``seconds = a L + b X + c R + s W`` (:mod:`dimd.train.plan.commmodel`; W, the
messages per shared core, is zero unless the ranks outnumbered the cores);
the constants are fitted by non-negative least squares on relative errors, so a
64 KiB row counts as much as a 16 MiB one. The check that matters is on rank
counts the fit never saw: fit on the smaller P, predict the larger, report
the relative errors per held-out P. The parameters used for prediction are
then refitted on every row.

Predictions Delta(P) at the gradient size assume a core per rank (the
span, no s); measurements taken with more ranks than cores are fitted with
Brent's bound and s, so a laptop's oversubscribed runs still teach a, b and c.

Results of ``bench-allreduce --device cuda`` (a GPU per rank) give ``nccl``'s
rows, fitted like the others with a GPU per rank (no shared cores); their host
algorithms' rows include the copies between device and host, which no cost
model has, and are skipped (the same algorithms on host buffers fit as usual).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from dimd.errors import DimdError
from dimd.train.plan.config import CommFitConfig
from dimd.train.plan.commmodel import COST_MODELS, PARAMETERS, features, get_cost_model
from dimd.train.plan.lsq import relative_errors, weighted_nnls

BENCH_COMMAND = "bench-allreduce"
COMMAND = "plan-batch comm"


@dataclass(frozen=True)
class Sample:
    """One measured row: an allreduce of ``nbytes`` on ``ranks`` ranks took ``seconds``."""

    algorithm: str
    ranks: int
    nbytes: int
    seconds: float
    job_cores: float | None = None      # cores the whole job shared (None: a core per rank)
    colors: int | None = None
    segment_bytes: int | None = None
    repeats: int = 1                    # rows this one combines (the same size in several files)

    def features(self) -> np.ndarray:
        return features(self.algorithm, self.nbytes, self.ranks, cores=self.job_cores,
                        colors=self.colors, segment_bytes=self.segment_bytes)


@dataclass
class BenchResults:
    """The rows of one or more bench-allreduce results, and what they say about themselves."""

    samples: list[Sample] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    gradient_bytes: set[int] = field(default_factory=set)


def load_bench_results(documents: Iterable[tuple[str, dict[str, Any]]]) -> BenchResults:
    """Samples from ``(source, envelope)`` pairs of bench-allreduce results, all of one element type."""
    out = BenchResults()
    dtypes: dict[str, str] = {}   # element type -> the first file that measured it
    for source, document in documents:
        if document.get("command") != BENCH_COMMAND:
            raise DimdError(f"{source}: a result of `{document.get('command')}`, expected `{BENCH_COMMAND}`")
        result = document.get("result") or {}
        parameters = document.get("parameters") or {}
        dtypes.setdefault(str(parameters.get("dtype", "float32")), source)
        if len(dtypes) > 1:   # a sum costs per element, and repeats would be combined across the types
            (first, first_source), (other, _) = dtypes.items()
            raise DimdError(f"{source}: measured {other} elements, {first_source} {first}: fit the results "
                            f"of one --dtype (float32, as gradients are)")
        mpi = document.get("mpi") or {}
        on_gpus = parameters.get("device") == "cuda"   # device buffers: a GPU per rank, host rows with copies
        ranks = result.get("world_size")
        rows = result.get("rows")
        if not isinstance(ranks, int) or ranks < 1 or not isinstance(rows, list):
            raise DimdError(f"{source}: no 'world_size' and 'rows' in its result")
        if result.get("gradient_bytes"):
            out.gradient_bytes.add(int(result["gradient_bytes"]))
        cores = mpi.get("cores")
        local = mpi.get("local_ranks") or ranks
        # The ranks of one node share its cores; the job has cores * nodes of them.
        job_cores = float(cores) * ranks / local if cores else None
        for row in rows:
            name = row.get("algorithm")
            if name not in COST_MODELS:
                out.skipped[str(name)] = "no cost model"
                continue
            if on_gpus and name != "nccl":
                out.skipped[f"{name} on device buffers"] = "includes the copies between device and host: no cost model"
                continue
            if row.get("wrong"):
                out.skipped[f"{name} at P={ranks}, {row.get('bytes')} B"] = "wrong sums in --check"
                continue
            if ranks < 2 or not row.get("bytes") or not row.get("time_us"):
                continue  # nothing to model: no communication, or an empty message
            out.samples.append(Sample(name, ranks, int(row["bytes"]), float(row["time_us"]) * 1e-6,
                                      None if on_gpus else job_cores,   # GPUs: the host's cores do not matter
                                      parameters.get("colors"), parameters.get("segment_bytes")))
    return out


def combine_repeats(samples: Sequence[Sample], statistic: str = "median") -> list[Sample]:
    """One sample per (algorithm, P, bytes, options): the median (or minimum) of its repeats."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.algorithm, s.ranks, s.nbytes, s.job_cores, s.colors, s.segment_bytes), []).append(s)
    pick = np.median if statistic == "median" else np.min
    return [replace(group[0], seconds=float(pick([s.seconds for s in group])), repeats=len(group))
            for group in groups.values()]


def read_bench_results(paths: Sequence[str | Path]) -> BenchResults:
    """The samples of bench-allreduce results, each file checked against its schema before any arithmetic."""
    from dimd.report import read_result
    from dimd.train.plan import schema

    documents = []
    for path in paths:
        document = read_result(path, BENCH_COMMAND)
        schema.check(document["result"], schema.BENCH_RESULT, str(path))
        schema.check(document.get("mpi") or {}, schema.BENCH_MPI, str(path), "mpi")
        schema.check(document.get("parameters") or {}, schema.BENCH_PARAMETERS, str(path), "parameters")
        documents.append((str(path), document))
    return load_bench_results(documents)


@dataclass(frozen=True)
class AlgorithmFit:
    """One algorithm's fitted constants, its held-out check and its predictions."""

    algorithm: str
    parameters: tuple[float, ...]               # (a, b, c, s)
    rows: int
    ranks: tuple[int, ...]
    fit_errors: tuple[float, ...]              # relative, on every row, refitted on all
    holdout: dict[str, Any] | None             # None when only one rank count was measured
    predictions: tuple[tuple[int, float], ...]

    def figures(self) -> dict[str, Any]:
        return {
            "parameters": dict(zip(PARAMETERS, self.parameters)),
            "formula": get_cost_model(self.algorithm).formula,
            "rows": self.rows, "ranks": list(self.ranks),
            "fit_rms_relative_error": float(np.sqrt(np.mean(np.square(self.fit_errors)))),
            "holdout": self.holdout,
            "predictions": [{"ranks": p, "seconds": s} for p, s in self.predictions],
        }


def fit_parameters(samples: Sequence[Sample]) -> np.ndarray:
    """Non-negative (a, b, c, s) minimising the relative squared errors of ``samples``."""
    a = np.array([s.features() for s in samples])
    y = np.array([s.seconds for s in samples])
    return weighted_nnls(a, y, 1.0 / y**2)


def predict(samples: Sequence[Sample], parameters: np.ndarray) -> np.ndarray:
    return np.array([s.features() @ parameters for s in samples])


def default_holdout(ranks: Sequence[int]) -> tuple[int, ...]:
    """The larger half of the measured rank counts (at least one held out, one kept)."""
    ordered = sorted(set(ranks))
    keep = max(1, (len(ordered) + 1) // 2)
    return tuple(ordered[keep:])


def holdout_check(samples: Sequence[Sample], holdout: Sequence[int]) -> dict[str, Any] | None:
    """Fit on the rank counts not in ``holdout``; relative errors on those in it."""
    held = set(holdout)
    train = [s for s in samples if s.ranks not in held]
    test = [s for s in samples if s.ranks in held]
    if not train or not test:
        return None
    params = fit_parameters(train)
    per_rank = []
    all_errors: list[float] = []
    for p in sorted({s.ranks for s in test}):
        rows = sorted((s for s in test if s.ranks == p), key=lambda s: s.nbytes)
        predicted = predict(rows, params)
        errors = relative_errors([s.seconds for s in rows], predicted)
        all_errors.extend(errors)
        per_rank.append({
            "ranks": p, "median_abs_error": float(np.median(np.abs(errors))),
            "max_abs_error": float(np.max(np.abs(errors))),
            "rows": [{"bytes": s.nbytes, "measured_s": s.seconds, "repeats": s.repeats, "predicted_s": float(q),
                      "relative_error": float(e)} for s, q, e in zip(rows, predicted, errors)],
        })
    return {"fit_ranks": sorted({s.ranks for s in train}), "parameters": dict(zip(PARAMETERS, params.tolist())),
            "median_abs_error": float(np.median(np.abs(all_errors))),
            "max_abs_error": float(np.max(np.abs(all_errors))), "per_ranks": per_rank}


def prediction_ranks(measured: Iterable[int], max_ranks: int, extra: Iterable[int] = ()) -> list[int]:
    """1, 2, 4, ... up to ``max_ranks``, plus the measured and ``extra`` rank counts."""
    powers = [1 << i for i in range(max_ranks.bit_length()) if 1 << i <= max_ranks]
    return sorted(set(powers) | set(measured) | set(extra) | {max_ranks})


def fit_algorithms(results: BenchResults, config: CommFitConfig) -> dict[str, Any]:
    """Every algorithm's fit, held-out check and Delta(P) at the gradient size: the ``comm`` figures."""
    gradient_bytes = config.gradient_bytes
    if gradient_bytes is None:
        if len(results.gradient_bytes) != 1:
            found = ", ".join(map(str, sorted(results.gradient_bytes))) or "none"
            raise DimdError("no gradient size: give --model or --bytes (the bench results recorded "
                            f"{found})")
        gradient_bytes = next(iter(results.gradient_bytes))
    combined = combine_repeats(results.samples, config.statistic)
    measured = sorted({s.ranks for s in combined})
    if len(measured) < 2:
        raise DimdError("the bench results cover "
                        + (f"only P = {measured[0]}" if measured else "no run with 2 or more ranks")
                        + "; give results at 2 or more rank counts (e.g. P = 2, 3, 4, 5)")
    holdout = tuple(config.holdout) if config.holdout is not None else default_holdout(measured)
    missing = sorted(set(holdout) - set(measured))
    if missing:
        raise DimdError(f"--holdout {','.join(map(str, missing))}: no bench result at that rank count "
                        f"(measured: {', '.join(map(str, measured))})")
    if set(holdout) >= set(measured):
        raise DimdError("--holdout must leave at least one measured rank count to fit on")
    names = [n for n in COST_MODELS if any(s.algorithm == n for s in combined)]
    if config.algorithms is not None:
        names = [n for n in names if n in config.algorithms]
    if not names:
        raise DimdError("no modelled algorithm in the bench results")
    ranks_out = prediction_ranks(measured, config.max_ranks)
    fits: dict[str, AlgorithmFit] = {}
    for name in names:
        samples = [s for s in combined if s.algorithm == name]
        params = fit_parameters(samples)
        errors = relative_errors([s.seconds for s in samples], predict(samples, params))
        predictions = tuple((p, predict_delta(name, params, gradient_bytes, p)) for p in ranks_out)
        fits[name] = AlgorithmFit(name, tuple(params.tolist()), len(samples),
                                  tuple(sorted({s.ranks for s in samples})), tuple(errors.tolist()),
                                  holdout_check(samples, holdout), predictions)
    fastest = []
    for i, p in enumerate(ranks_out):
        times = {name: fit.predictions[i][1] for name, fit in fits.items()}
        best = min(times, key=lambda name: times[name]) if p > 1 else None
        fastest.append({"ranks": p, "algorithm": best, "seconds": times[best] if best else 0.0})
    return {
        "gradient_bytes": gradient_bytes,
        "ranks_measured": measured,
        "holdout_ranks": list(holdout),
        "repeats": f"rows measured more than once combined by their {config.statistic}",
        "prediction_assumes": "one core per rank; the measured network's a, b, c",
        "algorithms": {name: fit.figures() for name, fit in fits.items()},
        "fastest": fastest,
        "skipped": results.skipped,
    }


def predict_delta(algorithm: str, parameters: Sequence[float] | np.ndarray, nbytes: int, ranks: int) -> float:
    """Delta(P): one allreduce of ``nbytes`` on ``ranks`` ranks with dimd's default options, a core per rank."""
    return float(features(algorithm, nbytes, ranks) @ np.asarray(parameters, dtype=np.float64))


def comm_model_from_figures(figures: dict[str, Any], source: str) -> dict[str, np.ndarray]:
    """{algorithm: (a, b, c, s)} from a ``plan-batch comm`` result."""
    try:
        algorithms = figures["algorithms"]
        return {name: np.array([float(fit["parameters"][p]) for p in PARAMETERS])
                for name, fit in algorithms.items() if name in COST_MODELS}
    except (KeyError, TypeError, ValueError):
        raise DimdError(f"{source}: no fitted parameters ('algorithms' with {', '.join(PARAMETERS)})") from None
