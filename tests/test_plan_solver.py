"""M_opt(P): the closed form against brute force, the boundary cases, and the plan table."""

import math

import numpy as np
import pytest

from dimd.errors import ConfigError, DimdError
from dimd.train.plan.config import SolveConfig
from dimd.train.plan.solver import (Communication, Model, Ranges, best_per_rank_batch, closed_form_time,
                                    continuous_optimum, plan_rows)

MODEL = Model(overhead=0.0, gamma=2e-3, m_t=8.0, n_inf=400.0, alpha=2.0e5)   # the paper's Gamma (c = 0)


def brute_force(model, ranks, delta, low=1e-2, high=1e7, points=400001):
    """argmin of T_C over a fine log grid of real M."""
    grid = np.geomspace(low, high, points)
    times = model.time_to_target(grid, ranks, delta)
    return grid[int(np.argmin(times))], float(times.min())


def random_models(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield Model(overhead=float(rng.choice([0.0, 10 ** rng.uniform(-5, -1)])),
                    gamma=10 ** rng.uniform(-4, -1), m_t=10 ** rng.uniform(0, 2),
                    n_inf=10 ** rng.uniform(1, 4), alpha=10 ** rng.uniform(2, 6))


@pytest.mark.parametrize("ranks", [1, 2, 3, 16, 1024])
def test_closed_form_matches_brute_force_on_random_models(ranks):
    for i, model in enumerate(random_models(25, seed=ranks)):
        delta = 0.0 if ranks == 1 else 10 ** np.random.default_rng(i).uniform(-4, 0)
        m_opt, case = continuous_optimum(model, ranks, delta)
        grid_m, grid_t = brute_force(model, ranks, delta)
        t_opt = float(model.time_to_target(m_opt, ranks, delta))
        assert t_opt <= grid_t * (1 + 1e-9)          # never worse than the grid
        assert t_opt == pytest.approx(grid_t, rel=1e-4)   # the grid steps by 5e-5
        assert m_opt == pytest.approx(grid_m, rel=2e-3)
        assert case in ("sqrt", "knee")
        assert closed_form_time(model, ranks, delta) == pytest.approx(t_opt, rel=1e-9)   # the paper's eq. 10


def test_one_rank_has_its_optimum_at_the_knee():
    m_opt, case = continuous_optimum(MODEL, 1, 0.0)
    assert (m_opt, case) == (MODEL.m_t, "knee")   # the paper's eq. 8: M_opt = M_T


def test_a_fixed_cost_per_step_moves_one_ranks_optimum_past_the_knee():
    """c acts as Delta does: above the knee M* = sqrt(alpha (c + Delta) P / (gamma N_inf))."""
    model = Model(overhead=1e-3, gamma=MODEL.gamma, m_t=MODEL.m_t, n_inf=MODEL.n_inf, alpha=MODEL.alpha)
    m_opt, case = continuous_optimum(model, 1, 0.0)
    assert case == "sqrt" and m_opt == pytest.approx(math.sqrt(model.alpha * 1e-3 / (model.gamma * model.n_inf)))
    assert m_opt > model.m_t
    assert brute_force(model, 1, 0.0)[0] == pytest.approx(m_opt, rel=2e-3)
    with_delta = Model(overhead=0.0, gamma=MODEL.gamma, m_t=MODEL.m_t, n_inf=MODEL.n_inf, alpha=MODEL.alpha)
    assert continuous_optimum(model, 4, 0.01)[0] == pytest.approx(continuous_optimum(with_delta, 4, 0.011)[0])


@pytest.mark.parametrize("shift", [0.98, 0.999, 1.001, 1.02])
def test_near_the_boundary_between_the_sqrt_and_the_knee(shift):
    """delta chosen so that M* sits just below or just above M_T P."""
    ranks = 8
    delta_at_knee = (MODEL.m_t * ranks) ** 2 * MODEL.gamma * MODEL.n_inf / (MODEL.alpha * ranks)
    delta = delta_at_knee * shift**2
    m_opt, case = continuous_optimum(MODEL, ranks, delta)
    assert case == ("sqrt" if shift > 1 else "knee")
    assert m_opt == pytest.approx(max(MODEL.m_t * ranks * shift, MODEL.m_t * ranks), rel=1e-9)
    grid_m, grid_t = brute_force(MODEL, ranks, delta, low=1, high=1e4, points=200001)
    assert float(MODEL.time_to_target(m_opt, ranks, delta)) == pytest.approx(grid_t, rel=1e-7)
    assert m_opt == pytest.approx(grid_m, rel=1e-3)


@pytest.mark.parametrize("ranks, delta", [(1, 0.0), (2, 1e-3), (4, 0.05), (8, 0.3), (64, 0.02), (1024, 1.0)])
@pytest.mark.parametrize("allowed", [None, (1, 2, 4, 8, 16, 32, 64, 128, 256), (3, 5, 24, 100)])
def test_whole_per_rank_batches_match_brute_force(ranks, delta, allowed):
    for model in list(random_models(10, seed=ranks)) + [MODEL]:
        b, _, _ = best_per_rank_batch(model, ranks, delta, allowed=allowed, largest=4096)
        candidates = np.array(allowed if allowed else np.arange(1, 4097))
        times = model.time_to_target(candidates * ranks, ranks, delta)
        assert float(model.time_to_target(b * ranks, ranks, delta)) == pytest.approx(times.min(), rel=1e-12)


def test_a_cap_on_the_batch_is_respected():
    b, m_opt, case = best_per_rank_batch(MODEL, 4, 0.5, largest=10)
    assert case == "sqrt" and m_opt / 4 > 10 and b == 10


def test_n_inf_not_positive_needs_a_cap():
    model = Model(overhead=0.0, gamma=1e-3, m_t=4.0, n_inf=-50.0, alpha=1e5)
    assert continuous_optimum(model, 4, 0.01) == (math.inf, "unbounded")
    with pytest.raises(DimdError, match="N_inf = -50 <= 0: .* give --max-batch"):
        best_per_rank_batch(model, 4, 0.01)
    assert best_per_rank_batch(model, 4, 0.01, largest=64)[0] == 64
    assert closed_form_time(model, 4, 0.01) is None


def test_alpha_not_positive_takes_the_smallest_batch():
    model = Model(overhead=0.0, gamma=1e-3, m_t=4.0, n_inf=500.0, alpha=-10.0)
    assert best_per_rank_batch(model, 2, 0.01)[0] == 1
    assert best_per_rank_batch(model, 2, 0.01, allowed=(8, 16))[0] == 8


def test_bad_model_constants_are_refused():
    with pytest.raises(DimdError, match="gamma must be a positive number"):
        Model(overhead=0.0, gamma=0.0, m_t=1.0, n_inf=1.0, alpha=1.0)
    with pytest.raises(DimdError, match="knee M_T must be positive"):
        Model(overhead=0.0, gamma=1.0, m_t=-1.0, n_inf=1.0, alpha=1.0)
    with pytest.raises(DimdError, match="the overhead c must be a number >= 0"):
        Model(overhead=-1e-3, gamma=1.0, m_t=1.0, n_inf=1.0, alpha=1.0)


def comm_with(delta_per_rank):
    """A Communication whose one algorithm costs ``delta_per_rank * (P - 1)`` (a parameter server)."""
    return Communication({"ps": np.array([delta_per_rank / 2, 0.0, 0.0, 0.0])}, gradient_bytes=1 << 20)


RANGES = Ranges(step_batches=(1, 256), convergence_batches=(8, 512), comm_ranks=(2, 5))


def test_plan_rows_follow_the_contract():
    figures = plan_rows(MODEL, comm_with(0.01), SolveConfig(ranks=(1, 2, 4, 64)), RANGES)
    assert [row["ranks"] for row in figures["plan"]] == [1, 2, 4, 64]
    first = figures["plan"][0]
    assert first["algorithm"] is None and first["delta_s"] == 0.0
    assert first["optimal"]["batch"] == 8 and first["optimal"]["case"] == "knee"
    # defaults: strong keeps the best M on the most ranks, weak the best per-rank batch on the fewest
    assert figures["strong_batch"] == figures["plan"][-1]["optimal"]["batch"]
    assert figures["weak_per_rank"] == 8
    for row in figures["plan"]:
        assert {"ranks", "optimal", "strong", "weak", "algorithm"} <= set(row)
        assert {"batch", "time_s"} <= set(row["optimal"])
        # optimal is never slower than strong or weak at the same P
        for regime in ("strong", "weak"):
            if row[regime]["time_s"] is not None:
                assert row["optimal"]["time_s"] <= row[regime]["time_s"] * (1 + 1e-12)
    last = figures["plan"][-1]
    assert last["algorithm"] == "ps" and last["delta_s"] == pytest.approx(0.01 * 63)
    assert last["strong"]["batch"] == last["optimal"]["batch"]
    assert last["weak"]["batch"] == 8 * 64
    small = plan_rows(MODEL, comm_with(0.01), SolveConfig(ranks=(1, 64), strong_batch=8), RANGES)["plan"][-1]
    assert small["strong"]["time_s"] is None and "fewer images (8) than ranks (64)" in small["strong"]["note"]
    assert "comm" in last["optimal"]["extrapolated"]


def test_strong_scaling_charges_the_slowest_rank():
    figures = plan_rows(MODEL, comm_with(0.0), SolveConfig(ranks=(3,), strong_batch=100), RANGES)
    strong = figures["plan"][0]["strong"]
    assert strong["per_rank"] == 34
    assert strong["time_s"] == pytest.approx(float(MODEL.updates(100)) * MODEL.gamma * 34)


def test_the_fastest_algorithm_is_chosen_per_rank_count():
    comm = Communication({"ps": np.array([1e-3, 0, 0, 0]), "tree": np.array([3e-3, 0, 0, 0])}, gradient_bytes=4096)
    figures = plan_rows(MODEL, comm, SolveConfig(ranks=(2, 4, 16)), RANGES)
    # ps: 2(P-1) messages, tree: 2 ceil(log2 P): ps wins at 2, tree at 16
    assert [row["algorithm"] for row in figures["plan"]] == ["ps", "ps", "tree"]


@pytest.mark.parametrize("values, message", [
    ({"ranks": (0, 2)}, "ranks must be positive integers, got 0"),
    ({"ranks": ()}, "at least one rank count"),
    ({"strong_batch": 0}, "strong_batch must be at least 1"),
    ({"allowed_per_rank": (0, 4)}, "allowed_per_rank must be positive"),
    ({"ranks": (1, 2), "max_batch": 4, "strong_batch": 10}, r"strong_batch must not exceed `max_batch` \(got 10 > 4\)"),
    ({"ranks": (1, 8), "max_batch": 4}, "max_batch must give each rank an image: 4 is smaller than P = 8"),
])
def test_solve_config_refuses_bad_values(values, message):
    with pytest.raises(ConfigError, match=message):
        SolveConfig(**values)


def comm_document(errors):
    from dimd.report import result_document

    algorithms = {name: {"parameters": {"a": 1e-5, "b": 1e-10, "c": 0.0, "s": 0.0},
                         "holdout": {"median_abs_error": error} if error is not None else None}
                  for name, error in errors.items()}
    return result_document("plan-batch comm", {}, {"algorithms": algorithms, "gradient_bytes": 4096,
                                                   "ranks_measured": [2, 3, 4, 5]})


def test_models_that_failed_their_held_out_check_are_left_out_unless_asked_for():
    from dimd.train.plan.results import comm_inputs

    doc = comm_document({"ring": 0.12, "mpi": 0.98, "ps": None})
    parameters, nbytes, ranks, left_out = comm_inputs(doc, "comm.json", max_holdout_error=0.5)
    assert sorted(parameters) == ["ps", "ring"] and nbytes == 4096 and ranks == (2, 5)
    assert left_out == {"mpi": "held-out median error 98% > 50%"}
    parameters, *_ = comm_inputs(doc, "comm.json", algorithms=("mpi",), max_holdout_error=0.5)
    assert list(parameters) == ["mpi"]            # asked for by name: used whatever its check said
    assert len(comm_inputs(doc, "comm.json", max_holdout_error=None)[0]) == 3
    with pytest.raises(DimdError, match=r"no fitted algorithm to plan with \(mpi: held-out median error 98%"):
        comm_inputs(comm_document({"mpi": 0.98}), "comm.json", max_holdout_error=0.5)
    with pytest.raises(DimdError, match="comm.json: no fit for tree"):
        comm_inputs(doc, "comm.json", algorithms=("tree",))


def test_a_batch_beyond_the_critical_batch_is_marked_as_an_extrapolation():
    """MODEL's alpha / N_inf = 500: past it the fitted N_update is nearly flat, which no sweep below showed."""
    assert MODEL.critical_batch == pytest.approx(500.0)
    assert Model(overhead=0.0, gamma=1e-3, m_t=1.0, n_inf=0.0, alpha=10.0).critical_batch is None
    figures = plan_rows(MODEL, comm_with(0.0), SolveConfig(ranks=(1, 128), strong_batch=1024, weak_per_rank=8),
                        RANGES)
    one, many = figures["plan"]
    assert "critical-batch" in one["strong"]["extrapolated"] and "critical-batch" in many["strong"]["extrapolated"]
    assert "critical-batch" not in one["optimal"]["extrapolated"] and one["optimal"]["batch"] <= 500
    assert "critical-batch" not in one["weak"]["extrapolated"] and "critical-batch" in many["weak"]["extrapolated"]
