"""Gamma(m) = c + gamma * max(m, M_T): the fit finds the fixed cost, the knee and the slope, and says when
there is no knee."""

import numpy as np
import pytest

from dimd.errors import DimdError
from dimd.train.plan.steptime import fit_step_time, step_seconds

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("gamma, knee, seed", [(2e-3, 12.0, 0), (5e-4, 3.0, 1), (1e-2, 40.0, 2)])
def test_fit_recovers_the_papers_gamma_and_knee_from_noisy_medians(gamma, knee, seed):
    rng = np.random.default_rng(seed)
    measured = step_seconds(0.0, gamma, knee, np.array(BATCHES)) * np.exp(rng.normal(0, 0.03, len(BATCHES)))
    fit = fit_step_time(BATCHES, measured)
    assert fit.gamma == pytest.approx(gamma, rel=0.05)
    assert fit.overhead < 0.1 * gamma * knee
    assert fit.m_t == pytest.approx(knee, rel=0.15)
    assert fit.knee == "inside"
    assert fit.rms_residual < 0.06
    # residuals are relative and signed: (fit - measured) / measured
    assert np.allclose(fit.residuals, (np.array(fit.fitted) - measured) / measured)


@pytest.mark.parametrize("overhead", [0.0, 4e-3])
def test_exact_data_give_exact_parameters(overhead):
    fit = fit_step_time(BATCHES, step_seconds(overhead, 1e-3, 10.0, np.array(BATCHES)))
    assert fit.gamma == pytest.approx(1e-3, rel=1e-6)
    assert fit.m_t == pytest.approx(10.0, rel=1e-4)
    assert fit.overhead == pytest.approx(overhead, abs=1e-9)
    assert fit(4) == pytest.approx(overhead + 1e-2) and fit(100) == pytest.approx(overhead + 0.1)


def test_a_straight_line_has_its_knee_at_the_smallest_batch():
    fit = fit_step_time([4, 8, 16, 32], [4e-3, 8e-3, 16e-3, 32e-3])
    assert fit.knee == "at-smallest" and fit.m_t == pytest.approx(4)
    assert fit.gamma == pytest.approx(1e-3) and fit.overhead == pytest.approx(0, abs=1e-12)


def test_a_step_with_a_fixed_cost_is_fitted_as_measured():
    """LeNet's medians on MNIST (ms; plan_batch_check): affine, which the paper's c = 0 fits 22-30 % low."""
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    medians = np.array([1.30, 1.43, 1.58, 1.92, 2.63, 4.56, 7.21, 13.24, 24.46]) * 1e-3
    fit = fit_step_time(batches, medians)
    assert fit.overhead == pytest.approx(1.2e-3, rel=0.1) and fit.gamma == pytest.approx(9.4e-5, rel=0.1)
    assert fit.rms_residual < 0.05
    assert max(abs(r) for r in fit.residuals) < 0.1


def test_a_flat_curve_has_its_knee_at_the_largest_batch():
    fit = fit_step_time([1, 2, 4, 8], [0.01, 0.01, 0.01, 0.01])
    assert fit.knee == "at-largest" and fit.m_t == pytest.approx(8)
    assert fit.gamma * fit.m_t == pytest.approx(0.01)


def test_unordered_input_is_sorted():
    fit = fit_step_time([64, 1, 16, 4], step_seconds(0.0, 1e-3, 8.0, np.array([64, 1, 16, 4])))
    assert fit.batches == (1, 4, 16, 64)
    assert fit.m_t == pytest.approx(8.0, rel=1e-3)


@pytest.mark.parametrize("batches, times, message", [
    ([8], [0.1], "at least 2 distinct batch sizes"),
    ([8, 8, 8], [0.1, 0.1, 0.1], "at least 2 distinct batch sizes"),
    ([1, 2], [0.1, 0.0], "positive, finite times"),
    ([0, 2], [0.1, 0.2], "batch sizes >= 1"),
    ([1, 2, 4], [0.1, 0.2], "3 batch sizes but 2 times"),
])
def test_bad_inputs_are_one_clear_error(batches, times, message):
    with pytest.raises(DimdError, match=message):
        fit_step_time(batches, times)
