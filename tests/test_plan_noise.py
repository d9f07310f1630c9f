"""McCandlish et al.'s gradient noise scale from per-rank and averaged squared gradient norms."""

import numpy as np
import pytest

from dimd.errors import DimdError
from dimd.train.noise import NoiseScale, noise_estimates, noise_estimates_from_gradients


def rank_gradients(rng, true_gradient, covariance_root, ranks, local_batch, trials):
    """Each rank's mean gradient over ``local_batch`` samples drawn from N(G, Sigma), ``trials`` times."""
    d = true_gradient.size
    samples = rng.standard_normal((trials, ranks, local_batch, d)) @ covariance_root.T + true_gradient
    return samples.mean(axis=2)


@pytest.mark.parametrize("ranks, local_batch", [(2, 4), (4, 8), (8, 1)])
def test_estimates_are_unbiased_on_gradients_with_a_known_covariance(ranks, local_batch):
    rng = np.random.default_rng(ranks * 100 + local_batch)
    d = 20
    true_gradient = rng.normal(0, 0.5, d)
    root = rng.normal(0, 1, (d, d)) / np.sqrt(d)          # Sigma = root root^T, not diagonal
    trace = float(np.trace(root @ root.T))
    grads = rank_gradients(rng, true_gradient, root, ranks, local_batch, trials=4000)
    estimates = np.array([noise_estimates_from_gradients(g, local_batch) for g in grads])
    mean, error = estimates.mean(axis=0), estimates.std(axis=0) / np.sqrt(len(estimates))
    # within 4 standard errors of |G|^2 and tr(Sigma)
    assert abs(mean[0] - true_gradient @ true_gradient) < 4 * error[0]
    assert abs(mean[1] - trace) < 4 * error[1]


def test_the_scalar_form_matches_the_gradient_form():
    rng = np.random.default_rng(5)
    grads = rng.normal(size=(3, 10))
    local = float(np.mean(np.sum(grads**2, axis=1)))
    total = float(np.sum(grads.mean(axis=0) ** 2))
    assert noise_estimates(local, total, 16, 3) == pytest.approx(noise_estimates_from_gradients(grads, 16))


def test_noise_scale_is_the_ratio_of_the_averages():
    g2, trace, b, p = 2.0, 600.0, 8, 4
    # norms a step would see if every estimate were exact: E|G_b|^2 and E|G_B|^2
    local, total = g2 + trace / b, g2 + trace / (b * p)
    scale = NoiseScale(smoothing=0.9)
    assert scale.b_simple is None
    first = scale.update(local, total, b, p)
    assert first == pytest.approx(trace / g2)     # the bias correction: no pull towards zero
    for _ in range(50):
        scale.update(local, total, b, p)
    assert scale.b_simple == pytest.approx(300.0)
    assert scale.gradient_sqnorm == pytest.approx(g2) and scale.trace_covariance == pytest.approx(trace)
    assert scale.steps == 51


def test_ema_smooths_noisy_steps_towards_the_true_noise_scale():
    rng = np.random.default_rng(11)
    d, ranks, b = 30, 4, 4
    true_gradient = rng.normal(0, 0.3, d)
    root = np.eye(d) * 0.8
    scale = NoiseScale(smoothing=0.995)
    for grads in rank_gradients(rng, true_gradient, root, ranks, b, trials=3000):
        local = float(np.mean(np.sum(grads**2, axis=1)))
        total = float(np.sum(grads.mean(axis=0) ** 2))
        scale.update(local, total, b, ranks)
    expected = np.trace(root @ root.T) / (true_gradient @ true_gradient)
    assert scale.b_simple == pytest.approx(expected, rel=0.2)


def test_non_finite_steps_are_skipped():
    scale = NoiseScale()
    scale.update(3.0, 1.5, 8, 2)
    before = scale.b_simple
    assert scale.update(float("inf"), 1.0, 8, 2) == before
    assert scale.steps == 1


def test_one_rank_or_a_bad_setting_is_one_clear_error():
    with pytest.raises(DimdError, match="at least 2 ranks"):
        noise_estimates(1.0, 1.0, 8, 1)
    with pytest.raises(DimdError, match="local batch must be at least 1"):
        noise_estimates(1.0, 1.0, 0, 2)
    with pytest.raises(DimdError, match="smoothing must be in"):
        NoiseScale(smoothing=1.0)
