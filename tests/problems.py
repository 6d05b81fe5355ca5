"""Models with exact answers, shared by the tests."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

PRIOR_SCALE = 10.0


def linear_regression(X, y=None, noise=1.0, subsample_size=100):
    """Bayesian linear regression, Gaussian prior and likelihood: a conjugate posterior."""
    theta = numpyro.sample("theta", dist.Normal(0.0, PRIOR_SCALE).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=subsample_size):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Normal(Xb @ theta, noise), obs=yb)


class LinearRegressionProblem(NamedTuple):
    """Data and exact quantities; every matrix per datum unless named ``post_cov``."""

    X: jnp.ndarray
    y: jnp.ndarray
    n: int
    mode: np.ndarray  # posterior mean = mode = θ̂ (the prior is included)
    post_cov: np.ndarray  # exact posterior covariance
    J: np.ndarray  # ∇²U(θ̂)/n
    I: np.ndarray  # covariance over the data of the per-datum gradients at θ̂
    S: np.ndarray  # sandwich J⁻¹ I J⁻¹
    hessians: np.ndarray  # (n, d, d) per-datum Hessians of l


def make_linear_regression(n=1000, d=3, rho=0.5, heteroscedastic=False, seed=0):
    """Correlated covariates (equicorrelation ``rho``); noise sd 1 in the model.

    With ``heteroscedastic=True`` the data's noise sd grows with ``|x_1|``, so the model is
    misspecified and ``I`` differs clearly from ``J``.
    """
    rng = np.random.default_rng(seed)
    cov_x = (1 - rho) * np.eye(d) + rho * np.ones((d, d))
    X = rng.multivariate_normal(np.zeros(d), cov_x, size=n)
    theta_true = np.linspace(1.0, -1.0, d)
    scale = 0.3 + 1.5 * np.abs(X[:, 0]) if heteroscedastic else np.ones(n)
    y = X @ theta_true + scale * rng.standard_normal(n)
    precision = X.T @ X + np.eye(d) / PRIOR_SCALE**2
    post_cov = np.linalg.inv(precision)
    mode = post_cov @ X.T @ y
    J = precision / n
    grads = X * (y - X @ mode)[:, None]  # per-datum ∇l at θ̂
    I = np.cov(grads.T, bias=True)
    Jinv = np.linalg.inv(J)
    hessians = -np.einsum("ni,nj->nij", X, X)
    return LinearRegressionProblem(
        jnp.asarray(X, jnp.float32),
        jnp.asarray(y, jnp.float32),
        n,
        mode,
        post_cov,
        J,
        I,
        Jinv @ I @ Jinv,
        hessians,
    )


def start_near_mode(problem, num_chains, cov, seed=1):
    """Unconstrained starting points drawn from ``N(θ̂, cov)``, one per chain."""
    rng = np.random.default_rng(seed)
    z = rng.multivariate_normal(problem.mode, cov, size=num_chains)
    return {"theta": jnp.asarray(z, jnp.float32)}


def flat_masses(masses, params):
    """``(K, d)`` flat masses (the chains' ``state.params.mass.values``) of per-site masses
    with a leading member axis (``bde.mass_from_warm_start``), for members' ``params``."""
    parts = []
    for name in sorted(params):
        value = np.asarray(masses.values[name], np.float64)
        shape = np.shape(params[name])
        value = value.reshape(value.shape + (1,) * (len(shape) - value.ndim))
        parts.append(np.broadcast_to(value, shape).reshape(shape[0], -1))
    return np.concatenate(parts, axis=1)


def draws(mcmc, site="theta"):
    """``(C, T, d)`` draws of one site as NumPy."""
    return np.asarray(jax.device_get(mcmc.get_samples(group_by_chain=True)[site]))


def two_groups(y1, y2, b1=50, b2=20):
    """Two datasets of different sizes sharing ``mu``.

    ``y1 ~ N(mu, 1)`` (plate "a"), ``y2 ~ N(mu + delta, 2)`` (plate "b").
    """
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SCALE))
    delta = numpyro.sample("delta", dist.Normal(0.0, PRIOR_SCALE))
    with numpyro.plate("a", y1.shape[0], subsample_size=b1):
        numpyro.sample("y1", dist.Normal(mu, 1.0), obs=numpyro.subsample(y1, event_dim=0))
    with numpyro.plate("b", y2.shape[0], subsample_size=b2):
        numpyro.sample("y2", dist.Normal(mu + delta, 2.0), obs=numpyro.subsample(y2, event_dim=0))


def make_two_groups(n1=2000, n2=500, seed=0):
    """Data for :func:`two_groups` and its exact Gaussian posterior over ``(delta, mu)``.

    The order ``(delta, mu)`` is the unconstrained flattening order (sites sorted by name).
    """
    rng = np.random.default_rng(seed)
    y1 = 0.7 + rng.standard_normal(n1)
    y2 = 0.7 - 0.4 + 2.0 * rng.standard_normal(n2)
    # design in (delta, mu): y1 = mu, y2 = mu + delta
    A = np.concatenate([np.tile([0.0, 1.0], (n1, 1)), np.tile([1.0, 1.0], (n2, 1))])
    w = np.concatenate([np.full(n1, 1.0), np.full(n2, 0.25)])
    y = np.concatenate([y1, y2])
    precision = A.T @ (w[:, None] * A) + np.eye(2) / PRIOR_SCALE**2
    cov = np.linalg.inv(precision)
    mean = cov @ A.T @ (w * y)
    return jnp.asarray(y1, jnp.float32), jnp.asarray(y2, jnp.float32), mean, cov


def poisson_regression(X, y=None, subsample_size=100):
    """Poisson regression with a log link (misspecified when the counts are overdispersed)."""
    theta = numpyro.sample("theta", dist.Normal(0.0, PRIOR_SCALE).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=subsample_size):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Poisson(jnp.exp(Xb @ theta)), obs=yb)


def make_overdispersed_counts(n=10_000, concentration=1.5, seed=0):
    """Counts ``~ NegativeBinomial(mean exp(Xθ), concentration)``, an intercept and two
    correlated covariates: a Poisson fit to them has ``I ≈ (1 + μ/r) J``, clearly not ``J``.
    """
    rng = np.random.default_rng(seed)
    Z = rng.multivariate_normal([0.0, 0.0], [[1.0, 0.6], [0.6, 1.0]], size=n)
    X = np.column_stack([np.ones(n), 0.5 * Z])
    mean = np.exp(X @ np.array([0.5, 0.4, -0.3]))
    y = rng.negative_binomial(concentration, concentration / (concentration + mean))
    return jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32)


def logistic_regression(X, y=None, subsample_size=100):
    theta = numpyro.sample("theta", dist.Normal(0.0, PRIOR_SCALE).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=subsample_size):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ theta), obs=yb)


def wide_logistic(X, y, subsample_size=100):
    """A logistic regression under ``N(0, 1)`` coefficients: for many of them, against
    :func:`logistic_laplace64`."""
    theta = numpyro.sample("theta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=subsample_size):
        Xb = numpyro.subsample(X, event_dim=1)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ theta), obs=numpyro.subsample(y, 0))


def make_wide_logistic64(n, d, coefficient_sd, rho=0.0, seed=0):
    """``(X, y)`` in float64 for :func:`wide_logistic`: covariates equicorrelated with
    ``rho``, coefficients ``N(0, coefficient_sd²)``."""
    rng = np.random.default_rng(seed)
    X = np.sqrt(1 - rho) * rng.standard_normal((n, d)) + np.sqrt(rho) * rng.standard_normal((n, 1))
    y = rng.random(n) < 1 / (1 + np.exp(-X @ rng.normal(0, coefficient_sd, d)))
    return X, y.astype(np.float64)


def logistic_laplace64(X, y, steps=8):
    """``(mode, H)`` of :func:`wide_logistic` in float64: Newton's steps from zero, and the
    Hessian of the potential at the mode."""
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)

    def hessian(theta):
        p = 1 / (1 + np.exp(-X @ theta))
        return X.T @ (X * (p * (1 - p))[:, None]) + np.eye(X.shape[1])

    theta = np.zeros(X.shape[1])
    for _ in range(steps):
        minus_gradient = X.T @ (y - 1 / (1 + np.exp(-X @ theta))) - theta
        theta = theta + np.linalg.solve(hessian(theta), minus_gradient)
    return theta, hessian(theta)


def flat_regression(X, y):
    """A linear regression with unit noise under a flat prior (an ImproperUniform site)."""
    beta = numpyro.sample(
        "beta", dist.ImproperUniform(constraints.real, (), event_shape=(X.shape[1],))
    )
    with numpyro.plate("data", X.shape[0], subsample_size=50):
        Xb = numpyro.subsample(X, event_dim=1)
        numpyro.sample("y", dist.Normal(Xb @ beta, 1.0), obs=numpyro.subsample(y, event_dim=0))


def make_logistic(n=100_000, d=4, rho=0.5, seed=0):
    """Well-specified logistic regression with equicorrelated covariates."""
    rng = np.random.default_rng(seed)
    cov_x = (1 - rho) * np.eye(d) + rho * np.ones((d, d))
    X = rng.multivariate_normal(np.zeros(d), cov_x, size=n)
    theta = np.linspace(1.0, -0.5, d)
    y = rng.random(n) < 1.0 / (1.0 + np.exp(-X @ theta))
    return jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32)


def offset_regression(x, y=None, subsample_size=100):
    """``y ~ N(mu + x, sigma)`` with an unknown noise scale: a constrained (HalfNormal) site."""
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SCALE))
    sigma = numpyro.sample("sigma", dist.HalfNormal(5.0))
    with numpyro.plate("data", x.shape[0], subsample_size=subsample_size):
        xb = numpyro.subsample(x, event_dim=0)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Normal(mu + xb, sigma), obs=yb)


def gaussian_location(W, L, subsample_size=50):
    """``y_i ~ N(θ, P⁻¹)`` written in whitened form: ``w_i = Lᵀy_i ~ N(Lᵀθ, I)``, ``P = LLᵀ``.

    Every per-datum Hessian is ``-P``, so minibatch gradient noise is exactly additive (its
    covariance ``I/b`` does not depend on ``θ``) and the linearised chains of
    ``docs/theory.md`` §3/§5 are exact at any step size.
    """
    theta = numpyro.sample("theta", dist.Normal(0.0, PRIOR_SCALE).expand([L.shape[0]]).to_event(1))
    with numpyro.plate("data", W.shape[0], subsample_size=subsample_size):
        Wb = numpyro.subsample(W, event_dim=1)
        numpyro.sample("w", dist.Normal(theta @ L, 1.0).to_event(1), obs=Wb)


class GaussianLocationProblem(NamedTuple):
    W: jnp.ndarray
    L: jnp.ndarray
    n: int
    mode: np.ndarray
    post_cov: np.ndarray
    J: np.ndarray  # ∇²U/n = P + prior precision / n
    I: np.ndarray  # covariance of the per-datum gradients P(y_i - θ)


def make_gaussian_location(n=1000, sd=(1.0, 0.3), corr=0.6, seed=0):
    """Data for :func:`gaussian_location` with observation sds ``sd`` and correlation ``corr``."""
    rng = np.random.default_rng(seed)
    sd = np.asarray(sd, np.float64)
    cov = corr * np.outer(sd, sd) + (1 - corr) * np.diag(sd**2)
    P = np.linalg.inv(cov)
    L = np.linalg.cholesky(P)
    Y = rng.multivariate_normal(np.linspace(1.0, -1.0, sd.size), cov, size=n)
    precision = n * P + np.eye(sd.size) / PRIOR_SCALE**2
    post_cov = np.linalg.inv(precision)
    mode = post_cov @ P @ Y.sum(axis=0)
    grads = (Y - mode) @ P
    return GaussianLocationProblem(
        jnp.asarray(Y @ L, jnp.float32),
        jnp.asarray(L, jnp.float32),
        n,
        mode,
        post_cov,
        precision / n,
        np.cov(grads.T, bias=True),
    )
