"""``step_size="auto"``: each chain's ``h`` at a fixed fraction of its stability bound.

The rule (:mod:`numpyro_sgmc.kernels.auto_step`): ``h_k = f·B/λ̂_k`` with ``λ̂_k = 1.1·λmax(P_k J)``
at chain ``k``'s start, ``B = 2(2 - α)`` for SGHMC (``P = M⁻¹``) and ``4`` for the Langevin
kernels (``P = Γ``), ``docs/theory.md`` §3 and §5. Checked on models whose ``J`` is known:

* a linear-Gaussian regression, ``J = XᵀX/n`` (plus the prior's ``1/(σ₀²n)``), estimated from
  ``b`` random rows: the tolerance is the Monte Carlo error of that estimate;
* a potential with a saddle, ``J = diag(a, -c)`` at every point and no row noise: the shifted
  power iteration must find ``a``, not ``-c``, to float32 precision.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC

from numpyro_sgmc import SGHMC, SGLD, ChainInit, Diagonal
from numpyro_sgmc.kernels.auto_step import FRACTION, Auto, AutoStep

N = 4000
SCALES = np.array([3.0, 1.0, 0.3], np.float32)  # sd of the covariates: J ≈ diag(9, 1, 0.09)
PRIOR_SD = 10.0


def linear(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("obs", dist.Normal(Xb @ w, 1.0), obs=yb)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = (rng.standard_normal((N, 3)) * SCALES).astype(np.float32)
    y = (X @ np.array([1.0, -1.0, 2.0], np.float32) + rng.standard_normal(N)).astype(np.float32)
    return jnp.asarray(X), jnp.asarray(y)


def exact_lam(X, mass=None):
    """``λmax(M⁻¹J)`` of the full data, ``J = XᵀX/n + I/(σ₀²n)``."""
    X = np.asarray(X, np.float64)
    J = X.T @ X / N + np.eye(X.shape[1]) / (PRIOR_SD**2 * N)
    m = np.ones(X.shape[1]) if mass is None else np.asarray(mass, np.float64)
    r = 1 / np.sqrt(m)  # M^{-1/2} J M^{-1/2} has the eigenvalues of M^{-1} J
    return float(np.linalg.eigvalsh(r[:, None] * J * r[None, :]).max())


def init(kernel, data, params, num_chains=None, preconditioner=None):
    """``kernel.init`` for ``num_chains`` vectorised chains (``None``: one chain)."""
    chain_init = ChainInit(params=params, preconditioner=preconditioner)
    key = jax.random.key(3)
    if num_chains is not None:
        key = jax.random.split(key, num_chains)
    kernel.init(key, 0, chain_init, data, {})
    return kernel.auto_step


def tolerance(num_rows):
    """4 Monte Carlo sds of the batch estimate of ``λmax ≈ J₁₁``: ``J₁₁`` is the mean of
    ``x₁²`` over ``num_rows`` rows drawn with replacement, relative sd ``√(2/num_rows)`` for a
    Gaussian covariate (``Var(x²)/E[x²]² = 2``), the other directions at most 1/9 as stiff."""
    return 4 * math.sqrt(2 / num_rows)


@pytest.mark.parametrize("kernel_cls, bound", [(SGHMC, 2 * (2 - 0.1)), (SGLD, 4.0)])
def test_step_is_the_fraction_of_the_bound_at_the_estimated_curvature(data, kernel_cls, bound):
    auto = init(kernel_cls(linear, "auto"), data, {"w": jnp.zeros(3)})
    assert isinstance(auto, AutoStep) and auto.fraction == FRACTION and auto.bound == bound
    assert auto.step_size.shape == auto.lam_max.shape == (1,)
    np.testing.assert_allclose(auto.step_size * auto.lam_max, FRACTION * bound, rtol=1e-6)
    # λ̂ = 1.1·λmax(J), λmax from 4096 random rows: within the estimate's Monte Carlo error
    lam = exact_lam(data[0])
    assert auto.lam_max[0] / 1.1 == pytest.approx(lam, rel=tolerance(auto.num_rows))
    assert "step_size='auto'" in str(auto) and f"{auto.step_size[0]:.4g}" in str(auto)


def test_sghmc_auto_uses_each_chains_own_mass(data):
    """Chain ``k``'s ``λ̂`` is ``λmax(M_k⁻¹J)``: three chains, three masses that each make
    another direction the stiffest; every ``h·λ̂`` is ``f·B``."""
    masses = np.array([[1.0, 1.0, 1.0], [81.0, 1.0, 1.0], [81.0, 1.0, 0.01]], np.float32)
    params = {"w": jnp.zeros((3, 3))}
    auto = init(
        SGHMC(linear, Auto(num_rows=N)),
        data,
        params,
        num_chains=3,
        preconditioner=Diagonal({"w": jnp.asarray(masses)}),
    )
    assert auto.step_size.shape == (3,)
    for k in range(3):
        lam = exact_lam(data[0], masses[k])
        assert auto.lam_max[k] / 1.1 == pytest.approx(lam, rel=tolerance(N)), k
    np.testing.assert_allclose(auto.step_size * auto.lam_max, FRACTION * 3.8, rtol=1e-6)
    # the three curvatures differ by far more than the tolerance: 9, 1, 9
    assert auto.lam_max[1] < 0.5 * auto.lam_max[0] and auto.lam_max[1] < 0.5 * auto.lam_max[2]


A, C = 1.0, 4.0  # J = diag(A, -C): the eigenvalue of largest magnitude is negative


def saddle(x):
    """``U(w) = -log p₀(w) + n(A w₀²/2 - C w₁²/2)``: the same curvature at every point and in
    every row."""
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([2]).to_event(1))
    with numpyro.plate("data", x.shape[0], subsample_size=10):
        xb = numpyro.subsample(x, event_dim=0)
        numpyro.factor("l", jnp.zeros_like(xb) - 0.5 * A * w[0] ** 2 + 0.5 * C * w[1] ** 2)


def test_shifted_power_iteration_finds_the_largest_positive_curvature():
    x = jnp.zeros(200)
    auto = init(SGHMC(saddle, "auto"), (x,), {"w": jnp.array([0.3, -0.2])})
    lam = A + 1 / (PRIOR_SD**2 * 200)  # not -C: the step is limited by positive curvature
    assert auto.lam_max[0] == pytest.approx(1.1 * lam, rel=1e-4)


def test_no_positive_curvature_is_an_error():
    def hill(x):
        w = numpyro.sample("w", dist.Normal(0.0, 1e3).expand([2]).to_event(1))  # J = 1e-6/n - 1
        with numpyro.plate("data", x.shape[0], subsample_size=10):
            xb = numpyro.subsample(x, event_dim=0)
            numpyro.factor("l", jnp.zeros_like(xb) + 0.5 * jnp.sum(w**2))

    with pytest.raises(ValueError, match="no positive curvature"):
        init(SGLD(hill, "auto"), (jnp.zeros(50),), {"w": jnp.array([0.1, 0.2])})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(step_size=Auto(fraction=1.0)), "fraction of the stability bound"),
        (dict(step_size=Auto(num_rows=0)), "num_rows"),
        (dict(step_size=Auto(iterations=2.5)), "iterations"),
        (dict(step_size="auto", friction=1.0), "default friction"),
    ],
)
def test_bad_auto_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SGHMC(linear, **kwargs)


def test_a_step_size_string_other_than_auto_is_a_type_error():
    with pytest.raises(TypeError, match="positive number or 'auto', got 'fast'"):
        SGHMC(linear, step_size="fast")


@pytest.mark.slow
def test_auto_sghmc_run_is_stable_and_centred(data):
    """A run at the automatic step: no divergence, and the chains' average within 5 Monte
    Carlo standard errors of the exact posterior mean (standard errors from the spread of 4
    chains' means, each over 200 draws after 100 discarded)."""
    X, y = (np.asarray(a, np.float64) for a in data)
    precision = X.T @ X + np.eye(3) / PRIOR_SD**2
    mean = np.linalg.solve(precision, X.T @ y)
    kernel = SGHMC(linear, "auto", num_steps=10)
    mcmc = MCMC(
        kernel,
        num_warmup=100,
        num_samples=200,
        num_chains=4,
        chain_method="vectorized",
        progress_bar=False,
    )
    start = {"w": jnp.asarray(np.tile(mean, (4, 1)) + 0.05, jnp.float32)}
    mcmc.run(jax.random.key(0), *data, init_params=start)
    assert int(np.sum(np.asarray(mcmc.last_state.num_diverging))) == 0
    assert kernel.auto_step.step_size.shape == (4,)
    chain_means = np.asarray(mcmc.get_samples(group_by_chain=True)["w"], np.float64).mean(1)
    se = chain_means.std(0, ddof=1) / 2  # sd over 4 chains / sqrt(4)
    assert np.all(np.abs(chain_means.mean(0) - mean) < 5 * se + 1e-4), (chain_means, mean)
