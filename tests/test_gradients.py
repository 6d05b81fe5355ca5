"""Gradient estimators: unbiased with the exact n/b scaling, O(b) per step, exact full sums."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from numpyro_sgmc import SGLD, SGLDFP
from numpyro_sgmc.data.gradients import control_variates, full_data_gradient, minibatch
from numpyro_sgmc.data.model import prepare_model
from problems import (
    PRIOR_SCALE,
    linear_regression,
    make_linear_regression,
    make_two_groups,
    two_groups,
)


def exact_linear_gradient(p, theta):
    """-∇U(θ)/n for the linear regression, in float64."""
    X, y = np.asarray(p.X, np.float64), np.asarray(p.y, np.float64)
    per_datum = X * (y - X @ theta)[:, None]
    return (per_datum.sum(0) - theta / PRIOR_SCALE**2) / p.n, per_datum


def batch_gradients(estimator, z, args, centre=None, draws=20000):
    """Gradient estimates on ``draws`` batches (consecutive batches for epochs)."""

    def one(state, k):
        g, state = estimator.estimate(state, z, k, args, {})
        return state, ravel_pytree(g)[0]

    def run(keys):
        state = estimator.init(keys[0], z if centre is None else centre, args, {})
        return jax.lax.scan(one, state, keys)[1]

    keys = jax.random.split(jax.random.key(3), draws)
    return np.asarray(jax.jit(run)(keys), np.float64)


@pytest.mark.parametrize(
    "n, batch_size, method, order",
    [
        (1000, None, "with_replacement", None),
        (1000, 7, "with_replacement", None),
        (1000, 500, "without_replacement", None),
        # rows in random order: a block is a batch of distinct indices, up to a fluctuation
        # of the noise covariance of about sqrt(2b/n) = 4.5% for this fixed order
        (10_000, 10, "blocks", None),
        (1000, 50, "blocks", "sorted"),  # unbiased for any row order, but far noisier
    ],
)
def test_minibatch_gradient_is_unbiased_with_the_batch_size_used(n, batch_size, method, order):
    p = make_linear_regression(n=n)
    if order == "sorted":
        rows = np.argsort(np.asarray(p.y))
        p = p._replace(X=p.X[rows], y=p.y[rows])
    prep = prepare_model(jax.random.key(0), linear_regression, (p.X, p.y), batch_size=batch_size)
    b = 100 if batch_size is None else batch_size
    assert prep.spec.plate("data").batch_size == b
    theta = p.mode + np.array([0.3, -0.2, 0.1])
    z = {"theta": jnp.asarray(theta, jnp.float32)}
    g = batch_gradients(minibatch(prep.spec, method), z, (p.X, p.y))
    exact, per_datum = exact_linear_gradient(p, theta)
    se = g.std(0) / np.sqrt(len(g))
    assert np.all(np.abs(g.mean(0) - exact) < 4.5 * se)
    # covariance Cov_i(∇l_i)/b, times (n-b)/(n-1) for b distinct indices (half, at b = n/2);
    # blocks of rows in random order are b distinct indices too
    factor = 1.0 if method == "with_replacement" else (p.n - b) / (p.n - 1)
    predicted_var = factor * np.var(per_datum, axis=0) / b
    if order == "sorted":
        assert np.sum(g.var(0)) > 3 * np.sum(predicted_var)
    else:
        rtol = 0.15 if method == "blocks" else 0.06
        np.testing.assert_allclose(g.var(0), predicted_var, rtol=rtol)


def test_an_epoch_sums_to_the_full_gradient():
    """Random reshuffling: the n/b batches of an epoch cover the data once (b divides n)."""
    p = make_linear_regression(n=1000)
    prep = prepare_model(jax.random.key(0), linear_regression, (p.X, p.y), batch_size=40)
    theta = p.mode + np.array([0.3, -0.2, 0.1])
    z = {"theta": jnp.asarray(theta, jnp.float32)}
    g = batch_gradients(minibatch(prep.spec, "epochs"), z, (p.X, p.y), draws=75)
    exact, _ = exact_linear_gradient(p, theta)
    for epoch in g.reshape(3, 25, -1):
        np.testing.assert_allclose(epoch.mean(0), exact, rtol=2e-4, atol=1e-5)
    assert not np.allclose(g[:25], g[25:50])  # a new order every epoch


@pytest.mark.slow
def test_two_plates_each_scaled_by_its_own_size():
    y1, y2, _, _ = make_two_groups()
    prep = prepare_model(jax.random.key(0), two_groups, (y1, y2), batch_size={"b": 5})
    assert prep.spec.plate("a").batch_size == 50 and prep.spec.plate("b").batch_size == 5
    n = prep.num_data
    assert n == 2500
    z = {"mu": jnp.float32(0.2), "delta": jnp.float32(-0.1)}
    g = batch_gradients(minibatch(prep.spec), z, (y1, y2))
    exact = full_data_gradient(prep.spec, z, (y1, y2), {})
    exact = np.asarray(ravel_pytree(exact)[0])
    y1n, y2n = np.asarray(y1, np.float64), np.asarray(y2, np.float64)
    mu, delta = 0.2, -0.1
    by_hand = (
        np.array(  # (delta, mu)
            [
                np.sum(y2n - mu - delta) / 4 - delta / PRIOR_SCALE**2,
                np.sum(y1n - mu) + np.sum(y2n - mu - delta) / 4 - mu / PRIOR_SCALE**2,
            ]
        )
        / n
    )
    np.testing.assert_allclose(exact, by_hand, rtol=1e-4, atol=1e-6)
    se = g.std(0) / np.sqrt(len(g))
    assert np.all(np.abs(g.mean(0) - by_hand) < 4.5 * se)


@pytest.mark.slow
def test_control_variates_are_unbiased_and_exact_at_the_centre():
    p = make_linear_regression(n=1000)
    prep = prepare_model(jax.random.key(0), linear_regression, (p.X, p.y), batch_size=10)
    centre = {"theta": jnp.asarray(p.mode, jnp.float32)}
    full = full_data_gradient(prep.spec, centre, (p.X, p.y), {})
    estimator = control_variates(
        minibatch(prep.spec), lambda z, args, kwargs: full_data_gradient(prep.spec, z, args, kwargs)
    )
    at_centre = batch_gradients(estimator, centre, (p.X, p.y), centre, draws=50)
    np.testing.assert_allclose(at_centre, np.tile(ravel_pytree(full)[0], (50, 1)), atol=2e-6)
    theta = p.mode + np.array([0.3, -0.2, 0.1])
    z = {"theta": jnp.asarray(theta, jnp.float32)}
    g = batch_gradients(estimator, z, (p.X, p.y), centre)
    exact, _ = exact_linear_gradient(p, theta)
    se = g.std(0) / np.sqrt(len(g))
    assert np.all(np.abs(g.mean(0) - exact) < 4.5 * se)
    plain = batch_gradients(minibatch(prep.spec), z, (p.X, p.y))
    assert np.all(g.var(0) < 0.5 * plain.var(0))  # the point of control variates


@pytest.mark.parametrize("chunk_size", [1000, 333, 64])
def test_full_data_gradient_in_chunks_is_exact(chunk_size):
    p = make_linear_regression(n=1000)
    prep = prepare_model(jax.random.key(0), linear_regression, (p.X, p.y))
    theta = p.mode + np.array([0.3, -0.2, 0.1])
    z = {"theta": jnp.asarray(theta, jnp.float32)}
    g = full_data_gradient(prep.spec, z, (p.X, p.y), {}, chunk_size)
    exact, _ = exact_linear_gradient(p, theta)
    np.testing.assert_allclose(np.asarray(g["theta"]), exact, rtol=2e-4, atol=2e-6)


@pytest.mark.slow
def test_two_plate_full_gradient_in_chunks_matches_one_pass():
    y1, y2, _, _ = make_two_groups(n1=2000, n2=517)
    prep = prepare_model(jax.random.key(0), two_groups, (y1, y2))
    z = {"mu": jnp.float32(0.2), "delta": jnp.float32(-0.1)}
    one = full_data_gradient(prep.spec, z, (y1, y2), {}, 4096)
    chunked = full_data_gradient(prep.spec, z, (y1, y2), {}, 300)
    for k in one:
        np.testing.assert_allclose(chunked[k], one[k], rtol=1e-4, atol=1e-7)


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.CentreWarning")
@pytest.mark.parametrize(
    "kernel_cls, method",
    [
        (SGLD, "with_replacement"),
        (SGLDFP, "with_replacement"),
        (SGLD, "without_replacement"),
        (SGLD, "epochs"),
        (SGLD, "blocks"),
    ],
)
def test_a_step_never_touches_an_array_of_the_data_size(kernel_cls, method):
    """O(b) per step: no intermediate of the compiled draw has a dimension of size n."""
    n = 12347  # prime, so no batch or parameter shape can coincide with it
    p = make_linear_regression(n=n)
    kernel = kernel_cls(linear_regression, step_size=1e-3, num_steps=3, batch_sampling=method)
    state = kernel.init(jax.random.key(0), 0, None, (p.X, p.y), {})
    jaxpr = jax.make_jaxpr(lambda s, X, y: kernel.sample(s, (X, y), {}))(state, p.X, p.y)

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                yield getattr(var.aval, "shape", ())
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from shapes(sub)

    offending = [s for s in shapes(jaxpr.jaxpr) if n in s]
    assert not offending, f"O(n) intermediates in a step: {offending}"
