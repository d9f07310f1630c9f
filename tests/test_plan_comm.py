"""The allreduce cost models: they count what dimd's algorithms send, and their fits predict held-out P."""

import json
from typing import Any

import numpy as np
import pytest
from conftest import invoke_dimd, mpi_run
from mpi_case import case, say, world

from dimd.allreduce import ALGORITHMS, STANDALONE
from dimd.errors import DimdError
from dimd.report import result_document
from dimd.train.plan.commfit import (Sample, default_holdout, fit_algorithms, fit_parameters,
                                     load_bench_results, predict_delta, prediction_ranks)
from dimd.train.plan.commmodel import COST_MODELS, features, multicolor_plan, ring_root_segments
from dimd.train.plan.config import CommFitConfig

# Every message each rank sends and receives, per algorithm, on real ranks: allreduce_message_counts below.
# dimd's own algorithms, whose point-to-point calls a wrapped communicator sees (not MPI's or torch's).
COUNTED = [name for name, algorithm in ALGORITHMS.items() if algorithm.point_to_point]
#: Divisible by 2..5 and by 4 colours, so blocks are equal and the counts exact.
ELEMENTS = 60 * 4096


@case
def allreduce_message_counts(count: str, algorithms: str) -> None:
    """Count every message each rank sends and receives, per algorithm, on COUNT float32 ones.

    Each algorithm runs on a communicator that counts its point-to-point calls;
    rank 0 prints one JSON line: per algorithm, every rank's [messages, bytes]::

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py allreduce_message_counts 245760 ring,tree
        -> {"ring": [[4, 655360], ...], "tree": [...]}
    """
    import numpy as np

    from dimd.allreduce import ALGORITHMS

    class Counting:
        def __init__(self, comm: Any) -> None:
            self.comm, self.messages, self.moved = comm, 0, 0

        def Get_size(self) -> int:
            return self.comm.Get_size()

        def Get_rank(self) -> int:
            return self.comm.Get_rank()

        def _count(self, buf: Any) -> None:
            self.messages += 1
            self.moved += np.asarray(buf).nbytes

        def Send(self, buf: Any, *a: Any) -> Any:
            self._count(buf)
            return self.comm.Send(buf, *a)

        def Recv(self, buf: Any, *a: Any) -> Any:
            self._count(buf)
            return self.comm.Recv(buf, *a)

        def Isend(self, buf: Any, *a: Any) -> Any:
            self._count(buf)
            return self.comm.Isend(buf, *a)

        def Irecv(self, buf: Any, *a: Any) -> Any:
            self._count(buf)
            return self.comm.Irecv(buf, *a)

        def Sendrecv(self, send: Any, dest: int, stag: int, recv: Any, source: int, rtag: int) -> Any:
            self._count(send)
            self._count(recv)
            return self.comm.Sendrecv(send, dest, stag, recv, source, rtag)

    comm = world()
    out = {}
    for name in algorithms.split(","):
        counting = Counting(comm.Dup())
        buf = np.ones(int(count), np.float32)
        ALGORITHMS[name].function(buf, counting, **ALGORITHMS[name].options)
        assert np.all(buf == comm.Get_size()), name
        out[name] = comm.gather([counting.messages, counting.moved])
    if comm.Get_rank() == 0:
        say(json.dumps(out))


@pytest.fixture(scope="module")
def message_counts():
    counts = {}
    for ranks in (2, 3, 4, 5):
        proc = mpi_run(allreduce_message_counts, ranks, ELEMENTS, ",".join(COUNTED), timeout=120, check=True)
        counts[ranks] = json.loads(proc.stdout.strip().splitlines()[-1])
    return counts


def test_every_algorithm_the_planner_may_choose_has_a_cost_model_and_only_those():
    """The planner models what dimd.allreduce registers: every algorithm that runs on a communicator
    alone (what choose_fastest and bench-allreduce's 'all' sweep over), and nccl, whose rows
    bench-allreduce --device cuda times; nothing else (not gloo, nor the caller's torch group)."""
    assert sorted(COST_MODELS) == sorted([*STANDALONE, "nccl"])
    assert set(COUNTED) == set(STANDALONE) - {"mpi"} and len(COUNTED) >= 7


def test_comm_and_solve_refuse_an_algorithm_without_a_cost_model_as_a_usage_error(tmp_path):
    for command in (["comm", tmp_path / "ar.json"], ["solve", "--step", "s", "--comm", "c", "--convergence", "v"]):
        proc = invoke_dimd("plan-batch", *command, "--algorithms", "ring,torch")
        assert proc.returncode == 2, proc.stderr
        assert "Invalid value for '--algorithms' / '-a': algorithm 'torch' is not one of ring" in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", COUNTED)
def test_the_model_counts_what_the_algorithm_sends(message_counts, algorithm, ranks):
    per_rank = np.array(message_counts[ranks][algorithm], dtype=float)    # (messages, bytes) per rank
    n = ELEMENTS * 4
    costs = COST_MODELS[algorithm].costs(float(n), ranks)
    assert costs.work.messages == per_rank[:, 0].sum()
    assert costs.work.moved == pytest.approx(per_rank[:, 1].sum(), rel=1e-12)
    busiest = per_rank.max(axis=0)
    if algorithm == "ring-root" and ranks > 2:   # the span adds the pipeline's fill and drain
        assert costs.span.messages >= busiest[0] and costs.span.moved >= busiest[1]
    else:
        assert costs.span.messages == busiest[0]
        assert costs.span.moved == pytest.approx(busiest[1], rel=1e-12)


def test_pipeline_segments_follow_the_algorithms_sizing():
    assert ring_root_segments(16 << 20) == (16, 1 << 20)          # 1/16 of the message
    assert ring_root_segments(64 << 10) == (1, 64 << 10)          # one segment, at least 256 KiB
    assert ring_root_segments(1 << 20, segment_bytes=40000) == (27, 40000)
    plan = multicolor_plan(16 << 20, 8, colors=4)
    assert plan.colors == 4 and list(plan.segments) == [8, 8, 8, 8]   # 1/8 of a chunk, >= 512 KiB
    assert multicolor_plan(1 << 20, 3, colors=4).colors == 3


def test_firecaffe_shape_parameter_server_linear_tree_logarithmic():
    n = 30 << 20
    ps = [features("ps", n, p)[1] for p in (2, 4, 8, 16, 32)]
    tree = [features("tree", n, p)[1] for p in (2, 4, 8, 16, 32)]
    assert np.allclose(np.diff(ps), [2 * n * d for d in (2, 4, 8, 16)])   # 2(P-1) n: linear
    assert np.allclose(np.diff(tree), 2 * n)                              # 2 log2(P) n: one step per doubling
    # a ring's bytes per rank tend to a constant
    assert features("ring", n, 1024)[1] == pytest.approx(4 * n, rel=1e-3)


def test_shared_cores_stretch_the_time_to_work_over_cores():
    span = features("ring", 1 << 20, 5)
    shared = features("ring", 1 << 20, 5, cores=2)
    assert span[3] == 0                                   # a core per rank: no waiting for a time slice
    assert np.allclose(shared[:3], span[:3] * 5 / 2)      # every ring rank works alike: work = 5 x span
    assert shared[3] == 4 * 4 * 5 / 2                     # messages per core: 4(P-1) per rank, 5 ranks, 2 cores
    assert np.allclose(features("ring", 1 << 20, 2, cores=2), features("ring", 1 << 20, 2))
    assert np.all(features("mpi", 1 << 20, 1) == 0)


def test_time_slice_waits_are_fitted_on_shared_cores_and_left_out_of_predictions():
    params = np.array([20e-6, 0.25e-9, 0.15e-9, 1.5e-3])   # 1.5 ms per message on a shared core
    samples = synthetic_samples("ps", params, ranks=(2, 3, 4, 5), noise=0.02, job_cores=2.0)
    fitted = fit_parameters([s for s in samples if s.ranks <= 3])
    for s in samples:
        if s.ranks > 3:
            assert s.features() @ fitted == pytest.approx(s.seconds, rel=0.1)
    assert fitted[3] == pytest.approx(1.5e-3, rel=0.2)
    assert predict_delta("ps", fitted, 1 << 20, 64) == pytest.approx(predict_delta("ps", params, 1 << 20, 64),
                                                                     rel=0.2)


def synthetic_samples(algorithm, params, ranks=(2, 3, 4, 5), sizes=(64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20),
                      noise=0.02, seed=0, job_cores=None):
    rng = np.random.default_rng(seed)
    out = []
    for p in ranks:
        for n in sizes:
            exact = features(algorithm, n, p, cores=job_cores) @ params
            out.append(Sample(algorithm, p, n, float(exact * np.exp(rng.normal(0, noise))), job_cores))
    return out


@pytest.mark.parametrize("algorithm", list(COST_MODELS))
def test_fit_on_small_p_predicts_large_p(algorithm):
    """Fit on P = 2..5, predict 6..8 within 10 % (2 % noise). Fitting multicolor on P <= 4 alone could
    not tell b from c: with 4 colours every rank moves exactly 4x what it adds until P > 4."""
    params = np.array([20e-6, 0.25e-9, 0.15e-9, 0.0])     # 20 us per message, 4 GB/s moved, 6.7 GB/s added
    samples = synthetic_samples(algorithm, params, ranks=range(2, 9), seed=len(algorithm))
    fitted = fit_parameters([s for s in samples if s.ranks <= 5])
    for s in samples:
        if s.ranks > 5:
            assert s.features() @ fitted == pytest.approx(s.seconds, rel=0.1)
    everything = fit_parameters(samples)
    for p in (64, 1024):   # the fit extrapolates the law, not the noise
        assert predict_delta(algorithm, everything, 1 << 20, p) == pytest.approx(
            predict_delta(algorithm, params, 1 << 20, p), rel=0.15)


def test_identifiable_parameters_are_recovered():
    params = np.array([30e-6, 0.2e-9, 0.4e-9, 0.0])
    samples = synthetic_samples("recursive-doubling", params, ranks=(2, 3, 4, 5, 6, 7, 8), noise=0.0)
    assert fit_parameters(samples) == pytest.approx(params, rel=1e-6)


def bench_document(ranks, algorithm_params, *, cores=None, gradient_bytes=None, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for n in (64 << 10, 1 << 20, 16 << 20):
        for name, params in algorithm_params.items():
            seconds = features(name, n, ranks, cores=cores) @ params * np.exp(rng.normal(0, noise))
            rows.append({"bytes": n, "algorithm": name, "time_us": seconds * 1e6, "wrong": None})
    rows.append({"bytes": 4096, "algorithm": "gloo", "time_us": 50.0, "wrong": None})
    return result_document("bench-allreduce", {"colors": 4, "segment_bytes": None},
                           {"world_size": ranks, "rows": rows, "gradient_bytes": gradient_bytes},
                           mpi={"cores": cores, "local_ranks": ranks})


def test_fit_algorithms_reports_holdout_errors_and_predictions():
    truth = {"ring": np.array([10e-6, 0.3e-9, 0.1e-9, 1e-3]), "ps": np.array([15e-6, 0.2e-9, 0.2e-9, 5e-4])}
    docs = [(f"ar-P{p}.json", bench_document(p, truth, cores=2, gradient_bytes=1 << 20, noise=0.01, seed=p))
            for p in (2, 3, 4, 5)]
    results = load_bench_results(docs)
    figures = fit_algorithms(results, CommFitConfig(files=("x",), max_ranks=64))
    assert figures["gradient_bytes"] == 1 << 20 and figures["ranks_measured"] == [2, 3, 4, 5]
    assert figures["holdout_ranks"] == [4, 5]
    assert figures["skipped"] == {"gloo": "no cost model"}
    for name, fit in figures["algorithms"].items():
        check = fit["holdout"]
        assert check["fit_ranks"] == [2, 3]
        assert [r["ranks"] for r in check["per_ranks"]] == [4, 5]
        assert check["max_abs_error"] < 0.1, name
        predictions = {p["ranks"]: p["seconds"] for p in fit["predictions"]}
        assert list(predictions) == [1, 2, 3, 4, 5, 8, 16, 32, 64] and predictions[1] == 0.0
        assert predictions[64] == pytest.approx(predict_delta(name, truth[name], 1 << 20, 64), rel=0.1)
    assert figures["fastest"][0] == {"ranks": 1, "algorithm": None, "seconds": 0.0}
    for i, best in enumerate(figures["fastest"][1:], start=1):
        times = {name: fit["predictions"][i]["seconds"] for name, fit in figures["algorithms"].items()}
        assert best["algorithm"] == min(times, key=times.get) and best["seconds"] == min(times.values())


def test_comm_inputs_are_checked():
    truth = {"ring": np.array([10e-6, 0.3e-9, 0.1e-9, 0.0])}
    one = load_bench_results([("ar-P2.json", bench_document(2, truth, gradient_bytes=4096))])
    with pytest.raises(DimdError, match="cover only P = 2; give results at 2 or more rank counts"):
        fit_algorithms(one, CommFitConfig(files=("x",)))
    two = load_bench_results([(f"P{p}", bench_document(p, truth)) for p in (2, 3)])
    with pytest.raises(DimdError, match="no gradient size: give --model or --bytes"):
        fit_algorithms(two, CommFitConfig(files=("x",)))
    with pytest.raises(DimdError, match="--holdout 7: no bench result at that rank count"):
        fit_algorithms(two, CommFitConfig(files=("x",), gradient_bytes=4096, holdout=(7,)))
    with pytest.raises(DimdError, match="must leave at least one measured rank count"):
        fit_algorithms(two, CommFitConfig(files=("x",), gradient_bytes=4096, holdout=(2, 3)))
    wide = bench_document(3, truth)
    wide["parameters"]["dtype"] = "int64"
    with pytest.raises(DimdError, match="P3: measured int64 elements, P2 float32: fit the results of one --dtype"):
        load_bench_results([("P2", bench_document(2, truth)), ("P3", wide)])
    other = result_document("plan-batch step-time", {}, {"gamma": 1.0})
    with pytest.raises(DimdError, match="step.json: a result of `plan-batch step-time`, expected `bench-allreduce`"):
        load_bench_results([("step.json", other)])


def test_default_holdout_and_prediction_ranks():
    assert default_holdout([2, 3, 4, 5]) == (4, 5)
    assert default_holdout([2, 4, 8]) == (8,)
    assert default_holdout([2, 3]) == (3,)
    assert prediction_ranks([3, 5], 16) == [1, 2, 3, 4, 5, 8, 16]
    assert prediction_ranks([2], 1000)[-2:] == [512, 1000]


def test_nccl_rows_of_device_buffers_are_fitted_and_their_host_rows_with_copies_skipped():
    """bench-allreduce --device cuda at P = 2, 4, 8: nccl's rows fit its ring law with a GPU per rank (the host's
    few cores do not stretch them); the host algorithms' rows there include the copies and are skipped."""
    nccl = np.array([0.7e-6, 1.06e-12, 0.0, 0.0])         # ~470 GB/s of bus bandwidth, a few us per step
    docs = []
    for p in (2, 4, 8):
        doc = bench_document(p, {"nccl": nccl, "ring": np.array([10e-6, 0.3e-9, 0.1e-9, 0.0])},
                             gradient_bytes=102_228_128, noise=0.01, seed=p)
        doc["parameters"]["device"] = "cuda"
        doc["mpi"]["cores"] = 2                           # 8 ranks on 2 cores: no matter, each has a GPU
        docs.append((f"gpu-P{p}.json", doc))
    results = load_bench_results(docs)
    assert {s.algorithm for s in results.samples} == {"nccl"} and all(s.job_cores is None for s in results.samples)
    assert results.skipped["ring on device buffers"] == "includes the copies between device and host: no cost model"
    figures = fit_algorithms(results, CommFitConfig(files=("x",), max_ranks=64))
    fit = figures["algorithms"]["nccl"]
    assert fit["holdout"]["max_abs_error"] < 0.05 and fit["formula"].endswith("(NCCL's ring, in device memory)")
    predictions = {p["ranks"]: p["seconds"] for p in fit["predictions"]}
    assert predictions[64] == pytest.approx(predict_delta("nccl", nccl, 102_228_128, 64), rel=0.05)
