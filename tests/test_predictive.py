"""Posterior-predictive metrics against hand computations: lppd, ECE and evaluate()."""

import math

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy.special import softmax
from scipy.stats import norm

from numpyro_sgmc.bde.predictive import (
    evaluate,
    expected_calibration_error,
    lppd,
    predictive_distribution,
)


def regression(X, y=None, subsample_size=None):
    """Linear-Gaussian regression with an unknown noise scale and a per-datum deterministic."""
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0], subsample_size=subsample_size):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        mu = numpyro.deterministic("mu", Xb @ theta)
        numpyro.sample("y", dist.Normal(mu, sigma), obs=yb)


def softmax_regression(X, y=None, subsample_size=None):
    """Multinomial logistic regression with 3 classes."""
    W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([X.shape[1], 3]).to_event(2))
    with numpyro.plate("data", X.shape[0], subsample_size=subsample_size):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("label", dist.Categorical(logits=Xb @ W), obs=yb)


def class_frequencies(y=None, num_data=8):
    """One probability vector for all data: the plate expands the categorical distribution."""
    p = numpyro.sample("p", dist.Dirichlet(jnp.ones(3)))
    with numpyro.plate("data", num_data):
        numpyro.sample("obs", dist.Categorical(probs=p), obs=y)


@pytest.fixture(scope="module")
def regression_data():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((6, 2)).astype(np.float32)
    y = (X @ np.array([1.0, -0.5]) + 0.3 * rng.standard_normal(6)).astype(np.float32)
    draws = {
        "theta": np.array([[1.0, -0.4], [0.9, -0.6], [1.2, -0.5], [0.8, -0.3]], np.float32),
        "sigma": np.array([0.3, 0.5, 0.25, 0.4], np.float32),
        # what MCMC on 50 training rows also returns: ignored, recomputed for these rows
        "mu": np.zeros((4, 50), np.float32),
        "y": np.zeros((4, 50), np.float32),
    }
    return X, y, draws


def test_lppd_by_hand():
    p = np.array([[0.2, 0.5, 0.1], [0.4, 0.3, 0.1]])
    # per datum log((p_1i + p_2i) / 2): log 0.3, log 0.4, log 0.1
    assert float(lppd(np.log(p))) == pytest.approx(np.mean(np.log([0.3, 0.4, 0.1])), rel=1e-6)
    # far in the tail, where exp(log p) underflows: log-sum-exp by hand
    log_lik = np.array([[-1000.0, -2000.0, -5.0], [-1001.0, -2002.0, -5.0]])
    by_hand = [
        -1000.0 + math.log((1 + math.exp(-1)) / 2),
        -2000.0 + math.log((1 + math.exp(-2)) / 2),
        -5.0,
    ]
    assert float(lppd(log_lik)) == pytest.approx(np.mean(by_hand), rel=1e-6)


def test_ece_by_hand():
    probs = np.array(
        [[0.4, 0.3, 0.3], [0.2, 0.35, 0.45], [0.9, 0.05, 0.05], [0.1, 0.8, 0.1]], np.float32
    )
    y = np.array([0, 0, 0, 2])
    # bin (0, 1/2]: confidences 0.4 (right), 0.45 (wrong) -> |1/2 - 0.425| = 0.075
    # bin (1/2, 1]: confidences 0.9 (right), 0.8 (wrong)  -> |1/2 - 0.85| = 0.35
    ece = expected_calibration_error(probs, y, num_bins=2)
    assert float(ece) == pytest.approx(2 / 4 * 0.075 + 2 / 4 * 0.35, rel=1e-5)
    # one bin: |accuracy - mean confidence| over all data
    ece = expected_calibration_error(probs, y, num_bins=1)
    assert float(ece) == pytest.approx(abs(0.5 - 0.6375), rel=1e-5)


def test_ece_of_calibrated_and_overconfident_predictions():
    # confidence 0.7 and 7 of 10 right; confidence 1 (the closed end of the last bin) and right
    probs = np.array([[0.7, 0.3]] * 10 + [[0.0, 1.0]] * 5, np.float32)
    y = np.array([0] * 7 + [1] * 3 + [1] * 5)
    assert float(expected_calibration_error(probs, y)) == pytest.approx(0.0, abs=1e-6)
    y_wrong = np.array([1] * 10 + [1] * 5)  # the 0.7 bin is never right
    ece = expected_calibration_error(probs, y_wrong)
    assert float(ece) == pytest.approx(10 / 15 * 0.7, rel=1e-5)


def test_evaluate_regression_closed_form(regression_data):
    X, y, draws = regression_data
    metrics = evaluate(regression, draws, X, y=y, site="y")
    assert set(metrics) == {"lppd", "rmse", "gaussian_nll"}
    assert all(type(v) is float for v in metrics.values())
    X64, y64 = X.astype(np.float64), y.astype(np.float64)
    means = draws["theta"].astype(np.float64) @ X64.T  # (S, N)
    density = norm.pdf(y64, means, draws["sigma"].astype(np.float64)[:, None])
    assert metrics["lppd"] == pytest.approx(np.mean(np.log(density.mean(0))), rel=1e-5)
    rmse = np.sqrt(np.mean((means.mean(0) - y64) ** 2))
    assert metrics["rmse"] == pytest.approx(rmse, rel=1e-5)
    # moment-matched Gaussian: mean of the variances plus variance of the means
    variance = np.mean(draws["sigma"].astype(np.float64) ** 2) + means.var(0)
    nll = -np.mean(norm.logpdf(y64, means.mean(0), np.sqrt(variance)))
    assert metrics["gaussian_nll"] == pytest.approx(nll, rel=1e-5)


def test_evaluate_uses_every_row_of_a_subsampled_model(regression_data):
    X, y, draws = regression_data
    full = evaluate(regression, draws, X, y=y, site="y")
    subsampled = evaluate(regression, draws, X, y=y, site="y", subsample_size=2)
    assert subsampled == pytest.approx(full, rel=1e-6)
    fn = predictive_distribution(regression, draws, X, site="y", subsample_size=2, draw_chunk=3)
    assert fn.loc.shape == (4, 6) and fn.batch_shape == (6,)  # a draw axis, then all rows
    np.testing.assert_allclose(fn.loc, draws["theta"] @ X.T, rtol=1e-6)


def test_evaluate_categorical_by_hand():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((20, 2)).astype(np.float32)
    y = rng.integers(0, 3, 20).astype(np.int32)
    W = rng.standard_normal((3, 2, 3)).astype(np.float32)  # 3 draws
    probs = softmax(np.einsum("nd,sdk->snk", X.astype(np.float64), W), axis=-1).mean(0)
    # draw_chunk=2 splits the 3 draws into a chunk and a remainder
    metrics = evaluate(softmax_regression, {"W": W}, X, y=y, site="label", draw_chunk=2)
    assert set(metrics) == {"lppd", "accuracy", "ece"}
    assert metrics["accuracy"] == pytest.approx(np.mean(probs.argmax(-1) == y))
    assert metrics["lppd"] == pytest.approx(np.mean(np.log(probs[np.arange(20), y])), rel=1e-5)
    ece = expected_calibration_error(probs, y)
    assert metrics["ece"] == pytest.approx(float(ece), rel=1e-4, abs=1e-6)
    subsampled = evaluate(softmax_regression, {"W": W}, X, y=y, site="label", subsample_size=5)
    assert subsampled == pytest.approx(metrics, rel=1e-6)


def test_evaluate_categorical_expanded_by_the_plate():
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], np.float32)
    y = np.array([0, 1, 1, 2, 1, 0, 1, 1])
    metrics = evaluate(class_frequencies, {"p": p}, y=y)
    mean = p.mean(0)  # [0.3, 0.45, 0.25]: class 1 predicted for every datum
    assert metrics["accuracy"] == pytest.approx(np.mean(y == 1))
    assert metrics["lppd"] == pytest.approx(np.mean(np.log(mean[y])), rel=1e-5)
    assert metrics["ece"] == pytest.approx(abs(np.mean(y == 1) - 0.45), rel=1e-5)


def test_errors(regression_data):
    X, y, draws = regression_data
    with pytest.raises(ValueError, match=r"Site 'obs' is not a sample site.*\['theta', 'sigma', "):
        evaluate(regression, draws, X, y=y)
    with pytest.raises(ValueError, match=r"no draws of the latent site\(s\) \['sigma'\]"):
        evaluate(regression, {"theta": draws["theta"]}, X, y=y, site="y")
    with pytest.raises(ValueError, match="same leading draw axis"):
        evaluate(regression, dict(draws, sigma=draws["sigma"][:3]), X, y=y, site="y")
    with pytest.raises(ValueError, match="same leading draw axis"):
        evaluate(regression, dict(draws, sigma=np.float32(0.5)), X, y=y, site="y")
    with pytest.raises(ValueError, match="no draws"):
        evaluate(regression, {}, X, y=y, site="y")
    with pytest.raises(ValueError, match=r"y has shape \(6, 1\), but site 'y' has shape \(6,\)"):
        evaluate(regression, draws, X, y=y[:, None], site="y")
