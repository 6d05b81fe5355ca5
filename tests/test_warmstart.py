"""The warm start finds the mode, keeps Adam's statistics, and says when it has not converged."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numpyro_sgmc import warm_start
from numpyro_sgmc.diagnostics import ConvergenceWarning
from problems import PRIOR_SCALE, logistic_regression, make_logistic, offset_regression

KEY = jax.random.key(0)


@pytest.fixture(scope="module")
def logistic():
    X, y = make_logistic(n=20_000, d=3, seed=3)
    Xn, yn = np.asarray(X, np.float64), np.asarray(y, np.float64)
    theta = np.zeros(3)
    for _ in range(30):  # Newton's method on the exact log posterior, float64
        p = 1 / (1 + np.exp(-Xn @ theta))
        grad = Xn.T @ (yn - p) - theta / PRIOR_SCALE**2
        hess = (Xn * (p * (1 - p))[:, None]).T @ Xn + np.eye(3) / PRIOR_SCALE**2
        theta = theta + np.linalg.solve(hess, grad)
    return X, y, theta, np.linalg.inv(hess)


@pytest.mark.slow
def test_restarts_reach_the_exact_mode(logistic):
    X, y, mode, post_cov = logistic
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        warm = warm_start(
            logistic_regression, jax.random.key(0), X, y, num_epochs=10, num_restarts=3
        )
    assert warm.num_restarts == 3 and warm.num_epochs == pytest.approx(10)
    assert np.all(warm.converged)
    # different starting points, one answer: each within a posterior sd of the exact mode
    assert len({round(float(v), 6) for v in warm.loss[:, 0]}) == 3
    offsets = np.asarray(warm.params["theta"]) - mode
    mahalanobis = np.sqrt(np.einsum("ki,ij,kj->k", offsets, np.linalg.inv(post_cov), offsets))
    assert np.all(mahalanobis < 3), mahalanobis
    np.testing.assert_allclose(warm.constrained["theta"], warm.params["theta"])
    # the loss went down, and the kept statistics have the parameters' shapes
    assert np.all(warm.loss[:, -100:].mean(1) < warm.loss[:, :100].mean(1))
    for stat in (warm.first_moment, warm.second_moment, warm.gradient):
        assert stat["theta"].shape == (3, 3)
    assert np.all(np.asarray(warm.second_moment["theta"]) > 0)
    # the stored gradient is the exact full-data average gradient -∇U/n at each mode
    Xn, yn = np.asarray(X, np.float64), np.asarray(y, np.float64)
    for k in range(3):
        t = np.asarray(warm.params["theta"][k], np.float64)
        exact = (Xn.T @ (yn - 1 / (1 + np.exp(-Xn @ t))) - t / PRIOR_SCALE**2) / len(yn)
        np.testing.assert_allclose(warm.gradient["theta"][k], exact, atol=2e-5)
    assert "3 restart(s)" in str(warm)


def test_constrained_site_mode():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(5000)
    y = 0.3 + x + 2.0 * rng.standard_normal(5000)
    warm = warm_start(
        offset_regression,
        KEY,
        jnp.asarray(x),
        jnp.asarray(y),
        num_epochs=20,
        model_kwargs={"subsample_size": 64},
    )
    resid = y - x
    assert float(warm.constrained["mu"][0]) == pytest.approx(resid.mean(), abs=0.03)
    assert float(warm.constrained["sigma"][0]) == pytest.approx(resid.std(), rel=0.01)
    np.testing.assert_allclose(np.exp(warm.params["sigma"]), warm.constrained["sigma"], rtol=1e-5)


def test_too_short_a_run_is_reported_with_numbers(logistic):
    X, y, *_ = logistic
    with pytest.warns(ConvergenceWarning, match="posterior standard deviations") as record:
        warm = warm_start(logistic_regression, KEY, X, y, num_epochs=0.05, learning_rate=1e-3)
    assert not warm.converged[0]
    assert "num_epochs=0.05" in str(record[0].message)
    assert warm.gradient_distance[0] > 10
    # check=False (what autotune uses): the same run, no check, no warning, and says so
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        unchecked = warm_start(
            logistic_regression, KEY, X, y, num_epochs=0.05, learning_rate=1e-3, check=False
        )
    assert unchecked.converged is None and np.isnan(unchecked.gradient_distance[0])
    np.testing.assert_array_equal(unchecked.params["theta"], warm.params["theta"])
    assert "convergence not checked" in str(unchecked)


def test_any_optax_optimizer_and_given_starting_points(logistic):
    X, y, mode, _ = logistic
    start = {"theta": jnp.asarray(mode + 0.1, jnp.float32)}
    warm = warm_start(
        logistic_regression,
        KEY,
        X,
        y,
        num_epochs=2,
        num_restarts=2,
        init_params=start,
        optimizer=optax.sgd(0.05),
    )
    assert warm.first_moment is None and warm.second_moment is None
    assert np.all(warm.converged)
    np.testing.assert_allclose(warm.params["theta"][0], mode, atol=0.05)


def test_bad_arguments(logistic):
    X, y, *_ = logistic
    with pytest.raises(ValueError, match="num_restarts"):
        warm_start(logistic_regression, KEY, X, y, num_restarts=0)
    with pytest.raises(ValueError, match="num_epochs"):
        warm_start(logistic_regression, KEY, X, y, num_epochs=0)
    with pytest.raises(ValueError, match="one per restart"):
        warm_start(logistic_regression, KEY, X, y, init_params={"theta": jnp.zeros((4, 3))})
    with pytest.raises(ValueError, match="larger than the data"):
        warm_start(logistic_regression, KEY, X, y, batch_size=10**6)
