"""Constrained sites, deterministic sites, two data plates and flat priors, against exact
posteriors.

Each model's posterior is known in closed form or by quadrature; the draws are judged by the
shared harness (independent chains, a factor-2 power check)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.diagnostics import effective_sample_size
from numpyro.distributions import biject_to, constraints
from numpyro.infer import MCMC

from harness import Z_MAX, assert_law, run_chains
from numpyro_sgmc import SGLDFP, ChainInit, autotune
from problems import flat_regression, make_two_groups, two_groups

CHAINS = 32


def scale_model(y):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.deterministic("log_sigma", jnp.log(sigma))
    with numpyro.plate("data", y.shape[0], subsample_size=50):
        yb = numpyro.subsample(y, event_dim=0)
        numpyro.deterministic("standardised", yb / sigma)  # per datum: left out of the draws
        numpyro.sample("y", dist.Normal(0.0, sigma), obs=yb)


@pytest.mark.slow
def test_halfnormal_scale_matches_quadrature_and_is_returned_constrained():
    rng = np.random.default_rng(0)
    y = 0.5 * rng.standard_normal(500)
    grid = np.linspace(0.3, 0.8, 20001)
    log_post = dist.HalfNormal(1.0).log_prob(grid) + (
        -0.5 * np.sum(y**2) / grid**2 - y.size * np.log(grid)
    )
    w = np.exp(log_post - log_post.max())
    w /= w.sum()
    mean = np.sum(w * grid)
    var = np.sum(w * (grid - mean) ** 2)
    mode_u = np.log(grid[np.argmax(log_post + np.log(grid))])  # mode of the unconstrained potential

    start = {"sigma": jnp.asarray(mode_u + 0.03 * rng.standard_normal(CHAINS), jnp.float32)}
    centre = {"sigma": jnp.full(CHAINS, mode_u, jnp.float32)}
    mcmc = run_chains(
        SGLDFP(scale_model, step_size=0.01),
        (jnp.asarray(y, jnp.float32),),
        ChainInit(start, centre=centre),
        num_warmup=5,
        num_samples=300,
    )
    samples = mcmc.get_samples(group_by_chain=True)
    assert set(samples) == {"sigma", "log_sigma"}
    sigma = np.asarray(samples["sigma"], np.float64)
    assert np.all(sigma > 0)
    np.testing.assert_allclose(samples["log_sigma"], np.log(sigma), rtol=1e-5, atol=1e-6)
    assert_law(sigma[..., None], [mean], [[var]], label="HalfNormal scale")


def dirichlet_model(y):
    p = numpyro.sample("p", dist.Dirichlet(jnp.ones(3)))
    with numpyro.plate("data", y.shape[0], subsample_size=30):
        numpyro.sample("y", dist.Categorical(probs=p), obs=numpyro.subsample(y, event_dim=0))


@pytest.mark.slow
def test_dirichlet_matches_its_conjugate_posterior():
    counts = np.array([150, 100, 50])
    y = jnp.asarray(np.repeat(np.arange(3), counts))
    alpha = 1.0 + counts
    mean = alpha / alpha.sum()
    cov = (np.diag(mean) - np.outer(mean, mean)) / (alpha.sum() + 1)
    to_simplex = biject_to(constraints.simplex)
    rng = np.random.default_rng(1)
    starts = rng.dirichlet(alpha, size=CHAINS)
    z = {"p": jnp.asarray(to_simplex.inv(jnp.asarray(starts)), jnp.float32)}
    kernel = SGLDFP(dirichlet_model, step_size=0.01)
    mcmc = run_chains(kernel, (y,), z, num_warmup=5, num_samples=300)
    p = np.asarray(mcmc.get_samples(group_by_chain=True)["p"], np.float64)
    assert p.shape == (CHAINS, 300, 3)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
    assert np.all(p > 0)
    assert_law(p, mean, cov, label="Dirichlet")


@pytest.mark.slow
def test_two_plates_of_different_sizes_sample_the_exact_posterior():
    y1, y2, mean, cov = make_two_groups(n1=2000, n2=500)
    rng = np.random.default_rng(2)
    start = rng.multivariate_normal(mean, cov, size=CHAINS)  # (delta, mu)
    names = ("delta", "mu")
    z = {k: jnp.asarray(start[:, i], jnp.float32) for i, k in enumerate(names)}
    centre = {k: jnp.full(CHAINS, m, jnp.float32) for k, m in zip(names, mean, strict=True)}
    kernel = SGLDFP(two_groups, step_size=0.02)
    mcmc = run_chains(kernel, (y1, y2), ChainInit(z, centre=centre), num_warmup=5, num_samples=300)
    assert kernel.plates["a"].size == 2000 and kernel.plates["b"].size == 500
    assert kernel.num_data == 2500 and kernel.inverse_temperature == 2500.0
    s = mcmc.get_samples(group_by_chain=True)
    x = np.stack([np.asarray(s["delta"]), np.asarray(s["mu"])], -1)
    assert_law(x, mean, cov, label="two plates")


def test_a_support_bounded_by_the_data_gets_concrete_bounds():
    """The first trace is abstract, but a support computed from the data
    (``Uniform(0, y.max())``) needs concrete bounds for its transform: such a model is traced
    again eagerly, and its transform maps onto the data's own interval."""
    import pickle

    from numpyro_sgmc.data.model import prepare_model

    def bounded(y):
        upper = numpyro.sample("upper", dist.Uniform(0.0, 2.0 * jnp.max(y)))
        with numpyro.plate("data", y.shape[0], subsample_size=10):
            numpyro.sample("y", dist.Uniform(0.0, upper), obs=numpyro.subsample(y, event_dim=0))

    y = np.linspace(0.1, 3.0, 50, dtype=np.float32)
    prepared = prepare_model(jax.random.key(0), bounded, (y,))
    edges = prepared.transforms["upper"](jnp.array([-30.0, 30.0]))
    np.testing.assert_allclose(np.asarray(edges), [0.0, 6.0], atol=1e-5)
    pickle.dumps(prepared.transforms)  # no leaked tracer


def test_a_flat_improper_prior_has_the_least_squares_posterior():
    """An ImproperUniform site (a flat prior, which NUTS runs) has no sampler: NumPyro raised
    a bare NotImplementedError from the first trace. Under a flat prior and unit noise the
    posterior is exactly N(β̂, (XᵀX)⁻¹): the tuner's mode and sds are those, and a run's
    mean is within its Monte Carlo error of β̂."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((2000, 3)) * [1.0, 3.0, 0.3]
    y = X @ [0.5, -1.0, 2.0] + rng.standard_normal(2000)
    beta_hat = np.linalg.lstsq(X, y, rcond=None)[0]
    sd = np.sqrt(np.diag(np.linalg.inv(X.T @ X)))
    X, y = X.astype(np.float32), y.astype(np.float32)
    kernel, report = autotune(flat_regression, jax.random.key(0), X, y)
    np.testing.assert_allclose(report.mode["beta"], beta_hat, atol=0.01 * sd.min())
    np.testing.assert_allclose(report.predicted_sd, sd, rtol=2e-3)
    mcmc = MCMC(kernel, num_warmup=20, num_samples=report.draws_for(ess=400), progress_bar=False)
    mcmc.run(jax.random.key(1), X, y)
    draws = np.asarray(mcmc.get_samples(group_by_chain=True)["beta"], np.float64)
    ess = np.asarray(effective_sample_size(draws))
    z = (draws.mean(axis=(0, 1)) - beta_hat) / (sd / np.sqrt(ess))
    assert np.all(np.abs(z) < Z_MAX), z
