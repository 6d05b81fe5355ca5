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


def _newton_mode(X, y, rows, scale):
    """The float64 mode of the log posterior whose likelihood is ``rows``' times ``scale``."""
    Xn, yn = np.asarray(X, np.float64)[rows], np.asarray(y, np.float64)[rows]
    theta = np.zeros(X.shape[1])
    for _ in range(30):
        p = 1 / (1 + np.exp(-Xn @ theta))
        grad = scale * Xn.T @ (yn - p) - theta / PRIOR_SCALE**2
        hess = scale * (Xn * (p * (1 - p))[:, None]).T @ Xn + np.eye(len(theta)) / PRIOR_SCALE**2
        theta = theta + np.linalg.solve(hess, grad)
    return theta


@pytest.mark.slow  # 10-23 s: the quick suite's 10 minutes
def test_a_warm_start_on_a_row_sample_finds_the_samples_mode_and_autotune_the_datas(
    logistic, monkeypatch
):
    """Above ``max_rows`` rows the optimizer runs on a uniform sample (here 2,000 of 20,000
    rows; batches of 20, 1,000 steps: a fifth of the five epochs' cost): its mode is the
    sample's (the likelihood of those rows scaled to n), several posterior sds from the
    data's, and autotune's Newton steps on every row take it to the data's mode: the same
    tuning as without the sample."""
    from numpyro_sgmc import autotune, host
    from numpyro_sgmc.data.model import prepare_model
    from numpyro_sgmc.tuner import tuning
    from numpyro_sgmc.tuner.warmstart import _row_sample, warm_start_of

    X, y, mode, post_cov = logistic
    n = X.shape[0]
    small = {"subsample_size": 20}
    prepared = prepare_model(host.key_batch(KEY, 1), logistic_regression, (X, y), small)
    warm = warm_start_of(prepared, KEY, (X, y), small, 5, check=False, rescale=True,
                         max_rows=2000)  # fmt: skip
    assert warm.num_epochs == pytest.approx(1000 * 20 / n)
    rows, _ = _row_sample(prepared.plates, 2000, host.split_key(KEY, 3)[2])
    (sample,) = rows.values()
    sample_mode = _newton_mode(X, y, np.asarray(sample), n / len(sample))
    found = np.asarray(warm.params["theta"][0], np.float64)
    sds = np.sqrt(np.diag(post_cov))
    apart = np.linalg.norm((sample_mode - mode) / sds)
    to_sample, to_data = (np.linalg.norm((found - m) / sds) for m in (sample_mode, mode))
    # Adam's tail average on batches of 20 is about one sd from its optimum
    assert apart > 2 and to_sample < 0.5 * apart < to_data, (apart, to_sample, to_data)

    _, full = autotune(logistic_regression, jax.random.key(1), X, y, model_kwargs=small,
                       warm_start_epochs=5)  # fmt: skip
    _, start = autotune(logistic_regression, jax.random.key(1), X, y, model_kwargs=small)
    monkeypatch.setattr(tuning, "WARM_START_SAMPLE_ROWS", 2000)
    _, sampled = autotune(logistic_regression, jax.random.key(1), X, y, model_kwargs=small)
    assert sampled.warm_start.num_epochs == pytest.approx(1.0)
    assert full.warm_start.num_epochs == pytest.approx(5.0)
    assert start.warm_start.num_epochs == 0  # on every row: Newton steps from the start
    np.testing.assert_allclose(start.predicted_sd, full.predicted_sd, rtol=0.01)
    assert np.max(np.abs(np.asarray(start.mode["theta"]) - mode) / sds) < 0.1
    assert np.max(np.abs(np.asarray(sampled.mode["theta"]) - mode) / sds) < 0.1
    np.testing.assert_allclose(sampled.predicted_sd, full.predicted_sd, rtol=0.01)


def test_the_newton_polish_takes_a_last_step_it_predicts_without_a_pass(logistic, monkeypatch):
    """Where the contraction of the step before predicts that the next lands within tol/4,
    the polish takes that last step unconfirmed: it saves a pass over the data (at 10⁹ rows a
    pass over the disk) and ends where confirming it would have, within 0.02 sds, and within
    0.05 sds of the exact float64 mode. Whether a polish from a warm start meets that
    condition depends on where its steps land (3 of 4 seeds on one CPU, none on another), so
    the steps here are chord steps with ``J`` of the mode made 8% too large (contracting by
    0.074 each near the mode): from 30 sds, steps of 22.6, 6.5 and 0.83 sds leave 0.07 (the
    window is 0.05-0.2), whose step is predicted to land 0.006 sds from the mode (half of
    tol/4): margins no CPU's rounding crosses. From warm starts on 200 of 20,000 rows (6-22
    sds from the data's mode), every polish settles with or without that shortcut, and the
    two agree."""
    from numpyro_sgmc import autotune
    from numpyro_sgmc.data.model import prepare_model
    from numpyro_sgmc.data.passes import exact_gradient
    from numpyro_sgmc.scales import Dense
    from numpyro_sgmc.tuner import laplace, tuning
    from numpyro_sgmc.tuner.fisher import information_of

    X, y, mode, post_cov = logistic
    sds = np.sqrt(np.diag(post_cov))
    polish = laplace.newton_polish

    def both(*args, **kwargs):  # the polish as it is, and with every step confirmed
        quick = polish(*args, **kwargs)
        monkeypatch.setattr(laplace, "SETTLING_SDS", 0.0)
        confirmed = polish(*args, **kwargs)
        monkeypatch.setattr(laplace, "SETTLING_SDS", 0.2)
        theta, theta_confirmed = (np.asarray(r[0]["theta"], np.float64) for r in (quick, confirmed))
        assert quick[5] and confirmed[5]  # both settled
        assert np.max(np.abs(theta - theta_confirmed) / sds) < 0.02
        assert np.max(np.abs(theta - mode) / sds) < 0.05
        assert quick[2] <= confirmed[2]
        return quick, confirmed

    args = (X, y)
    prepared = prepare_model(KEY, logistic_regression, args)
    problem = laplace.Problem(prepared, args, {}, None, KEY)

    at_mode = information_of(prepared, KEY, args, {}, {"theta": jnp.asarray(mode, jnp.float32)})
    slow = at_mode._replace(J=Dense(np.asarray(at_mode.J.matrix) * 1.08))  # 8% too large

    direction = np.linalg.cholesky(post_cov) @ (np.ones(3) / np.sqrt(3.0))
    start = {"theta": jnp.asarray(mode + 30.0 * direction, jnp.float32)}
    potential, gradient = exact_gradient(prepared.spec, start, args, {})
    quick, confirmed = both(
        problem, start, gradient, lambda *_, **__: slow, potential=float(potential),
        distance=30.0,
    )  # fmt: skip
    assert quick[2] == confirmed[2] - 1, (quick[2], quick[6], confirmed[2], confirmed[6])

    monkeypatch.setattr(tuning, "WARM_START_SAMPLE_ROWS", 200)
    monkeypatch.setattr(laplace, "newton_polish", lambda *a, **k: both(*a, **k)[0])
    for seed in range(4):
        autotune(logistic_regression, jax.random.key(seed), X, y)
