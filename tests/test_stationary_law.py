"""The kernels sample the law the theory predicts: exact posteriors and discrete-Lyapunov laws.

Bayesian linear regression has a Gaussian posterior, and for it the linearised chain of
theory §3 is exact, so the discrete-Lyapunov covariance is the true stationary covariance at
any step size: a wrong factor anywhere in the update (the 1/2 in the drift, the noise scale,
the n/b scaling, the preconditioner's square root) shows up as a mismatch.
"""

import math

import numpy as np
import pytest

from harness import assert_law, assert_law_differs, run_chains
from numpyro_sgmc import SGD, SGLD, SGLDFP, ChainInit, Dense, Diagonal
from numpyro_sgmc.theory import stationary_covariance
from problems import draws, linear_regression, make_linear_regression, start_near_mode

CHAINS = 64


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=1000, d=3, rho=0.5, seed=0)


@pytest.fixture(scope="module")
def misspecified():
    return make_linear_regression(n=10_000, d=3, rho=0.5, heteroscedastic=True, seed=1)


def run(kernel, problem, start_cov, num_warmup, num_samples, seed=0, init=None):
    """Draws ``(CHAINS, T, d)`` from chains started at ``N(θ̂, start_cov)``."""
    params = start_near_mode(problem, CHAINS, start_cov, seed=seed + 1)
    init_params = params if init is None else init(params)
    args = (problem.X, problem.y)
    return draws(run_chains(kernel, args, init_params, num_warmup, num_samples, seed))


def centred_at_mode(problem):
    """``init`` for :func:`run`: every chain's control-variate centre at the exact mode."""
    centre = {"theta": np.tile(problem.mode, (CHAINS, 1))}
    return lambda params: ChainInit(params, centre=centre)


def predicted(problem, **kwargs):
    return stationary_covariance(
        problem.J, problem.I, num_data=problem.n, hessians=problem.hessians, **kwargs
    )


def test_sgld_small_step_samples_the_posterior(problem):
    # h·n/b = 0.06: the predicted gradient-noise and discretisation bias is ~1%, well inside
    # the Monte Carlo tolerance; mixing ~1400 iterations, 28 mixing times per chain.
    kernel = SGLD(linear_regression, step_size=0.006)
    x = run(kernel, problem, problem.post_cov, num_warmup=30, num_samples=400)
    bias = np.diag(predicted(problem, step_size=0.006, batch_size=100)) / np.diag(problem.post_cov)
    assert np.all(np.abs(bias - 1) < 0.015)
    assert_law(x, problem.mode, problem.post_cov, label="SGLD h=0.006")


def test_sgldfp_samples_the_posterior(problem):
    kernel = SGLDFP(linear_regression, step_size=0.02)
    x = run(
        kernel,
        problem,
        problem.post_cov,
        num_warmup=10,
        num_samples=150,
        init=centred_at_mode(problem),
    )
    assert_law(x, problem.mode, problem.post_cov, label="SGLD-FP h=0.02")


def test_sgld_large_step_matches_discrete_lyapunov_not_posterior(problem):
    # b = 10 overrides the model's subsample_size=100; the noise term h²I/(4b) then makes the
    # stationary covariance ~2.8x the posterior.
    kernel = SGLD(linear_regression, step_size=0.1, batch_size=10, num_steps=20)
    cov = predicted(problem, step_size=0.1, batch_size=10)
    x = run(kernel, problem, cov, num_warmup=20, num_samples=400)
    assert_law(x, problem.mode, cov, label="SGLD h=0.1 b=10")
    assert_law_differs(x, problem.post_cov, label="SGLD h=0.1 vs posterior")


def test_sgd_with_inverse_information_targets_the_sandwich(misspecified):
    # Table 1 row F: Γ = J⁻¹, h = 4b/n, β = ∞ → n·Cov → S = J⁻¹IJ⁻¹, far from J⁻¹ here.
    p = misspecified
    Jinv = np.linalg.inv(p.J)
    h = 4 * 100 / p.n
    kernel = SGD(linear_regression, step_size=h, preconditioner=Dense(Jinv), num_steps=10)
    x = run(kernel, p, p.S / p.n, num_warmup=50, num_samples=600)
    assert_law(x, p.mode, p.S / p.n, label="SGD row F vs S/n")
    lyapunov = predicted(
        p, step_size=h, batch_size=100, inverse_temperature=math.inf, preconditioner=Jinv
    )
    np.testing.assert_allclose(np.diag(lyapunov), np.diag(p.S / p.n), rtol=0.02)
    assert_law_differs(x, Jinv / p.n, label="SGD row F vs posterior")


def test_diagonal_preconditioner_matches_its_prediction(problem):
    # any SPD diagonal is a valid Γ = Λ; one far from the identity makes the law distinct
    scale = np.array([0.25, 1.0, 2.0])
    kernel = SGLD(
        linear_regression,
        step_size=0.1,
        batch_size=10,
        preconditioner=Diagonal({"theta": scale}),
        num_steps=20,
    )
    cov = predicted(problem, step_size=0.1, batch_size=10, preconditioner=scale)
    x = run(kernel, problem, cov, num_warmup=20, num_samples=400)
    assert_law(x, problem.mode, cov, label="SGLD diagonal")
    unpreconditioned = predicted(problem, step_size=0.1, batch_size=10)
    assert np.max(np.abs(np.diag(cov) / np.diag(unpreconditioned) - 1)) > 0.5


def test_dense_preconditioner_with_control_variates_matches_its_prediction(problem):
    # Row P4 at a large step: the control-variate Hessian term of theory §3 adds ~14% to the
    # covariance (1.52 vs 1.33 times the posterior without it); the draws must see it.
    Jinv = np.linalg.inv(problem.J)
    kernel = SGLDFP(
        linear_regression, step_size=1.0, batch_size=10, preconditioner=Dense(Jinv), num_steps=5
    )
    cov = predicted(
        problem, step_size=1.0, batch_size=10, preconditioner=Jinv, control_variates=True
    )
    x = run(kernel, problem, cov, num_warmup=20, num_samples=600, init=centred_at_mode(problem))
    assert_law(x, problem.mode, cov, label="SGLD-FP dense h=1")
    without_hessian_term = problem.post_cov / (1 - 1.0 / 4)
    assert np.all(np.diag(cov) / np.diag(without_hessian_term) > 1.1)


def test_dense_drift_with_separate_noise_preconditioner(problem):
    # Γ ≠ Λ: drift J⁻¹, noise diag(1/J_ii); the law is the Lyapunov solution with both.
    Jinv = np.linalg.inv(problem.J)
    lam = 1.0 / np.diag(problem.J)
    kernel = SGLD(
        linear_regression,
        step_size=0.2,
        batch_size=20,
        preconditioner=Dense(Jinv),
        noise_preconditioner=Diagonal({"theta": lam}),
        num_steps=10,
    )
    cov = predicted(
        problem, step_size=0.2, batch_size=20, preconditioner=Jinv, noise_preconditioner=lam
    )
    x = run(kernel, problem, cov, num_warmup=20, num_samples=400)
    assert_law(x, problem.mode, cov, label="SGLD dense drift, diagonal noise")


def test_distinct_indices_per_batch_match_their_prediction(problem):
    # b = n/2 distinct indices: the gradient noise is (n-b)/(n-1) ≈ 1/2 of the i.i.d. noise,
    # which makes the with-replacement prediction 17% too wide here.
    kernel = SGLD(
        linear_regression,
        step_size=1.0,
        batch_size=500,
        batch_sampling="without_replacement",
        num_steps=5,
    )
    cov = predicted(problem, step_size=1.0, batch_size=500, batch_sampling="without_replacement")
    x = run(kernel, problem, cov, num_warmup=10, num_samples=400)
    assert_law(x, problem.mode, cov, label="SGLD without replacement")
    iid = predicted(problem, step_size=1.0, batch_size=500)
    assert np.all(np.diag(iid) / np.diag(cov) > 1.1)
    assert_law_differs(x, iid, z_min=4.5, label="SGLD without replacement vs i.i.d. prediction")
