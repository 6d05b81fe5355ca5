"""SGHMC and AdaSGHMC: mixing as predicted, the momentum carried, the mass adapted.

The Gaussian location model has constant per-datum Hessians, so the linearised ``(θ, r)``
recursion of ``docs/theory.md`` §5 is exact at any step size (the stationary laws are rows of
``test_laws.py``). Step sizes are ``h``, with ``h λmax(M⁻¹J) = c`` (stable below
``2(2 - α)``); Chen et al.'s ``η`` is ``sqrt(h/n)``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.infer import MCMC

from harness import run_chains
from numpyro_sgmc import SGHMC, AdaSGHMC, ChainInit, Dense, Diagonal
from numpyro_sgmc.diagnostics import DivergenceWarning
from numpyro_sgmc.theory import sghmc_prediction
from problems import draws, gaussian_location, make_gaussian_location

CHAINS = 32


@pytest.fixture(scope="module")
def problem():
    return make_gaussian_location(n=1000, sd=(1.0, 0.3), corr=0.6, seed=0)


@pytest.fixture(scope="module")
def stiff():
    """Scales 10× apart (curvatures 100× apart): identity mass is badly conditioned."""
    return make_gaussian_location(n=1000, sd=(1.0, 0.1), corr=0.3, seed=1)


def step_for(problem, mass_diag, c=1.0):
    """``h`` with ``h λmax(M⁻¹J) = c`` (stability needs ``c < 2(2 - α) = 3.8``)."""
    scale = 1.0 / np.sqrt(mass_diag)
    return c / np.linalg.eigvalsh(scale[:, None] * problem.J * scale[None, :]).max()


def start_at_mode(problem, chains=CHAINS):
    return {"theta": jnp.tile(jnp.asarray(problem.mode, jnp.float32), (chains, 1))}


def prediction(problem, h, mass_diag=None, batch_size=50, **kwargs):
    return sghmc_prediction(
        problem.J,
        num_data=problem.n,
        step_size=h,
        mass=mass_diag,
        I=problem.I,
        batch_size=batch_size,
        **kwargs,
    )


def integrated_autocorrelation(x, batch=500):
    """Per-coordinate IACT of ``(C, T, d)`` draws by batch means: ``B·Var(batch means)/Var``
    with batches of ``B ≫ τ`` draws (unbiased up to ``O(τ/B)``; robust to the oscillating
    autocorrelations of an underdamped chain)."""
    x = np.asarray(x, np.float64)
    C, T, d = x.shape
    means = x[:, : T // batch * batch].reshape(C, -1, batch, d).mean(axis=2)
    return batch * means.var(axis=1, ddof=1).mean(axis=0) / x.var(axis=1).mean(axis=0)


@pytest.mark.slow
def test_matched_diagonal_mass_mixes_faster_than_identity(stiff):
    """At the same fraction of its own stability limit, a mass matched to the target's
    scales gives lower integrated autocorrelation times, as predicted."""
    taus = {}
    for label, mass in [("identity", np.ones(2)), ("matched", np.diag(stiff.J) / stiff.J[0, 0])]:
        h = step_for(stiff, mass)
        pred = prediction(stiff, h, mass, batch_size=None)
        kernel = SGHMC(
            gaussian_location,
            h,
            mass=Diagonal({"theta": jnp.asarray(mass, jnp.float32)}),
            batch_size=stiff.n,
            num_steps=1,
        )
        x = draws(run_chains(kernel, (stiff.W, stiff.L), start_at_mode(stiff, 16), 200, 20_000))
        taus[label] = integrated_autocorrelation(x)
        np.testing.assert_allclose(taus[label], pred.autocorrelation_times, rtol=0.2)
    assert taus["matched"].max() < 0.5 * taus["identity"].max()


def test_momentum_is_carried_across_draws(problem):
    """Noise-free (β = ∞), full-batch SGHMC is heavy-ball descent: the draws follow the
    hand-written recursion only if ``r`` survives from one draw to the next."""
    h, alpha = step_for(problem, np.ones(2), c=0.5), 0.3
    eta = math.sqrt(h / problem.n)
    kernel = SGHMC(
        gaussian_location,
        h,
        momentum_decay=alpha,
        inverse_temperature=math.inf,
        batch_size=problem.n,
        num_steps=3,
    )
    start = problem.mode + np.array([0.05, -0.02])
    mcmc = MCMC(kernel, num_warmup=0, num_samples=5, progress_bar=False)
    mcmc.run(jax.random.key(0), problem.W, problem.L, init_params={"theta": jnp.asarray(start)})
    got = np.asarray(mcmc.get_samples()["theta"])
    theta, r, expected = start.copy(), np.zeros(2), []
    H = problem.n * problem.J
    for _ in range(5):
        for _ in range(3):
            r = r - eta * H @ (theta - problem.mode) - alpha * r
            theta = theta + eta * r
        expected.append(theta.copy())
    np.testing.assert_allclose(got, np.array(expected), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_adasghmc_adapts_mass_to_root_mean_square_gradient_then_freezes(stiff):
    """Full-batch, small steps: ``E(∇Ũ)² = n² diag(J Σθ J) ≈ n diag(J)``, so the adapted
    (min-normalised) mass is ``sqrt(diag J / J_11)``; after warm-up it does not change."""
    h = step_for(stiff, np.ones(2), c=0.1)
    kernel = AdaSGHMC(
        gaussian_location, h, batch_size=stiff.n, num_steps=100, adaptation_window=500
    )
    mcmc = MCMC(
        kernel,
        num_warmup=100,
        num_samples=20,
        num_chains=16,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.warmup(jax.random.key(0), stiff.W, stiff.L, init_params=start_at_mode(stiff, 16))
    adapted = np.asarray(mcmc.last_state.params.mass.values)
    pred = sghmc_prediction(stiff.J, num_data=stiff.n, step_size=h, mass=adapted.mean(0))
    H = stiff.n * stiff.J
    expected = np.sqrt(np.diag(H @ pred.position_covariance @ H))
    expected = expected / expected.min()
    np.testing.assert_allclose(adapted.mean(axis=0), expected, rtol=0.1)
    assert expected[1] / expected[0] > 5  # a factor-2 error in v̂ (√2 in M) would fail
    mcmc.run(jax.random.key(1), stiff.W, stiff.L)
    np.testing.assert_array_equal(np.asarray(mcmc.last_state.params.mass.values), adapted)


@pytest.mark.slow
def test_adasghmc_without_warmup_keeps_the_initial_mass(problem):
    mass = Diagonal({"theta": jnp.array([1.0, 3.0])})
    kernel = AdaSGHMC(gaussian_location, 1e-3, mass=mass, num_steps=10)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=5, progress_bar=False)
    mcmc.run(jax.random.key(0), problem.W, problem.L)
    np.testing.assert_array_equal(mcmc.last_state.params.mass.values, [1.0, 3.0])


def test_sghmc_per_chain_masses(problem):
    masses = Diagonal({"theta": jnp.array([[1.0, 1.0], [1.0, 9.0]])})
    kernel = SGHMC(gaussian_location, 1e-3, num_steps=5)
    mcmc = MCMC(
        kernel,
        num_warmup=0,
        num_samples=3,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(
        jax.random.key(0),
        problem.W,
        problem.L,
        init_params=ChainInit(params=start_at_mode(problem, 2), preconditioner=masses),
    )
    np.testing.assert_array_equal(mcmc.last_state.params.mass.values, masses.values["theta"])


def test_sghmc_divergence_is_reported_not_returned_as_nan(problem):
    h = step_for(problem, np.ones(2), c=50.0)  # far beyond the stability limit
    kernel = SGHMC(gaussian_location, h, num_steps=50)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=20, progress_bar=False)
    with pytest.warns(DivergenceWarning):
        mcmc.run(
            jax.random.key(0),
            problem.W,
            problem.L,
            init_params={"theta": jnp.asarray(problem.mode)},
        )
    assert np.all(np.isfinite(np.asarray(mcmc.get_samples()["theta"])))
    assert np.any(np.asarray(mcmc.get_extra_fields()["diverging"]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(momentum_decay=0.0), "momentum_decay must be in"),
        (dict(momentum_decay=1.5), "momentum_decay must be in"),
        (dict(friction=-1.0), "friction must be positive"),
        (dict(gradient_noise=-1.0), "gradient_noise must be non-negative"),
        (dict(preconditioner=Diagonal({"theta": 1.0})), "unexpected keyword argument"),
    ],
)
def test_sghmc_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SGHMC(gaussian_location, 1e-3, **kwargs)


def test_gradient_noise_above_friction_is_an_error(problem):
    kernel = SGHMC(gaussian_location, 1e-3, friction=10.0, gradient_noise=20.0)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=1, progress_bar=False)
    with pytest.raises(ValueError, match="exceeds the friction"):
        mcmc.run(jax.random.key(0), problem.W, problem.L)
    kernel = SGHMC(gaussian_location, 1e-3, momentum_decay=0.1, gradient_noise=1e3)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=1, progress_bar=False)
    with pytest.raises(ValueError, match="raise momentum_decay"):
        mcmc.run(jax.random.key(0), problem.W, problem.L)


def test_adasghmc_rejects_a_dense_initial_mass(problem):
    kernel = AdaSGHMC(gaussian_location, 1e-3, mass=Dense(jnp.eye(2)))
    mcmc = MCMC(kernel, num_warmup=1, num_samples=1, progress_bar=False)
    with pytest.raises(ValueError, match="diagonal mass"):
        mcmc.run(jax.random.key(0), problem.W, problem.L)
