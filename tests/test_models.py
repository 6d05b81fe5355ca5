"""Constrained sites, deterministic sites and two data plates, against exact posteriors."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import biject_to, constraints

from harness import assert_law, run_chains
from numpyro_sgmc import SGLD, SGLDFP, ChainInit, layerwise
from numpyro_sgmc.theory import stationary_covariance
from problems import make_two_groups, two_groups

CHAINS = 32


def scale_model(y):
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.deterministic("log_sigma", jnp.log(sigma))
    with numpyro.plate("data", y.shape[0], subsample_size=50):
        yb = numpyro.subsample(y, event_dim=0)
        numpyro.deterministic("standardised", yb / sigma)  # per datum: left out of the draws
        numpyro.sample("y", dist.Normal(0.0, sigma), obs=yb)


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


def test_layerwise_preconditioner_with_two_plates_matches_its_prediction():
    """Per-site scalars Γ = diag(2, 1/2) and two plates' minibatch noise, in the stationary law.

    The estimate is ĝ = ∇log p0/n + Σ_p (n_p/(n b_p)) Σ_{i∈B_p} ∇l_p(i), so its noise covariance
    per step is Σ_p (n_p/n)² I_p / b_p; the likelihood is quadratic, so the discrete Lyapunov
    prediction is exact.
    """
    y1, y2, mean, post_cov = make_two_groups(n1=2000, n2=500)
    n1, n2, b1, b2 = 2000, 500, 10, 5
    n = n1 + n2
    y1n, y2n = np.asarray(y1, np.float64), np.asarray(y2, np.float64)
    delta, mu = mean
    grads_a = np.stack([np.zeros(n1), y1n - mu], -1)  # (delta, mu)
    r = (y2n - mu - delta) / 4
    grads_b = np.stack([r, r], -1)
    noise = (n1 / n) ** 2 * np.cov(grads_a.T, bias=True) / b1
    noise += (n2 / n) ** 2 * np.cov(grads_b.T, bias=True) / b2
    J = np.linalg.inv(post_cov) / n
    gamma = np.array([2.0, 0.5])
    h = 0.2
    cov = stationary_covariance(
        J, noise, step_size=h, batch_size=1, num_data=n, preconditioner=gamma
    )
    kernel = SGLD(
        two_groups,
        step_size=h,
        batch_size={"a": b1, "b": b2},
        preconditioner=layerwise({"delta": 2.0, "mu": 0.5}),
        num_steps=20,
    )
    rng = np.random.default_rng(3)
    start = rng.multivariate_normal(mean, cov, size=CHAINS)
    z = {k: jnp.asarray(start[:, i], jnp.float32) for i, k in enumerate(("delta", "mu"))}
    mcmc = run_chains(kernel, (y1, y2), z, num_warmup=10, num_samples=400)
    s = mcmc.get_samples(group_by_chain=True)
    x = np.stack([np.asarray(s["delta"]), np.asarray(s["mu"])], -1)
    assert_law(x, mean, cov, label="layer-wise, two plates")
    assert np.all(np.diag(cov) / np.diag(post_cov) > 1.3)  # far from the posterior: noise shows
