"""``numpyro_sgmc.theory``'s SGHMC predictions (``docs/theory.md`` §5).

The transition ``F`` and noise ``D`` are checked algebraically against an explicit
implementation of the kernel's ``(r, θ)`` update, and the stationary covariance and
autocorrelation times against a float64 NumPy simulation of that update (many independent
chains; Monte Carlo tolerances from the spread between chains). The explicit update is written
in Chen et al.'s step ``η``; the library's ``step_size`` is ``h = n η²``.
"""

import math

import numpy as np
import pytest

from harness import Z_MAX as Z
from numpyro_sgmc import theory
from numpyro_sgmc.theory import (
    SGHMCPrediction,
    autocorrelation_times,
    sghmc_prediction,
    sghmc_recursion,
)

N = 1000  # n


def h(eta):
    """The library's step size for Chen et al.'s ``η``: ``h = n η²``."""
    return N * eta**2


def iterate_average_covariance(F, sigma, T):
    return np.asarray(theory.iterate_average_covariance(F, sigma, T))


def discrete_lyapunov(F, D):
    return np.asarray(theory.discrete_lyapunov(F, D))


J2 = np.array([[2.0, 0.6], [0.6, 1.0]])  # correlated per-datum curvature
I2 = np.array([[0.06, -0.02], [-0.02, 0.03]])  # per-datum gradient covariance


def rel(x, y):
    return np.linalg.norm(x - y) / np.linalg.norm(y)


def psd_sqrt(S):
    values, vectors = np.linalg.eigh(0.5 * (S + S.T))
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def sghmc_step(theta, r, e, xi, *, n, J, eta, M, C, B, T):
    """The kernel's update, written out (``theta``, ``r``, ``e``, ``xi``: ``(K, d)``).

    ``r' = r - η ∇Ũ(θ) - η C M⁻¹ r + sqrt(2ηT)(C - B̂)^{1/2} ξ``, ``θ' = θ + η M⁻¹ r'`` with
    ``∇Ũ(θ) = n J θ + e`` (mode at 0).
    """
    M_inv = np.linalg.inv(M)
    grad = n * theta @ J.T + e
    noise = math.sqrt(2 * eta * T) * xi @ psd_sqrt(C - B).T
    r = r - eta * grad - eta * r @ (C @ M_inv).T + noise
    theta = theta + eta * r @ M_inv.T
    return theta, r


# ---------------------------------------------------------------------------------------------
# The recursion against the explicit update
# ---------------------------------------------------------------------------------------------

CASES = {
    # α-parametrised friction, diagonal mass, a diagonal B̂ (half the minibatch noise's
    # η n² Iᵢᵢ/(2b) on θ₁, a third on θ₂), with replacement: τ ≈ 13 and 8, Σ_θθ 14% off (nJ)⁻¹
    "decay": dict(
        kwargs=dict(
            mass=[2.0, 0.5],
            momentum_decay=0.5,
            gradient_noise=[3.0, 1.0],
            step_size=h(0.01),
            batch_size=50,
        ),
        M=np.diag([2.0, 0.5]),
        C=0.5 / 0.01 * np.diag([2.0, 0.5]),
        B=np.diag([3.0, 1.0]),
        factor=1.0,
    ),
    # dense mass and friction, without replacement, T = 2 (β = n/2): τ ≈ 4.6 and 6.6,
    # Σ_θθ 44% off T (nJ)⁻¹ (39% from the step alone)
    "dense": dict(
        kwargs=dict(
            mass=[[1.0, 0.3], [0.3, 0.8]],
            friction=[[60.0, -10.0], [-10.0, 40.0]],
            step_size=h(0.015),
            batch_size=100,
            without_replacement=True,
            inverse_temperature=N / 2,
        ),
        M=np.array([[1.0, 0.3], [0.3, 0.8]]),
        C=np.array([[60.0, -10.0], [-10.0, 40.0]]),
        B=np.zeros((2, 2)),
        factor=(N - 100) / (N - 1),
    ),
}


def case_setup(name):
    case = CASES[name]
    kw = case["kwargs"]
    T = N / kw.get("inverse_temperature", N)
    noise_cov = N * N * case["factor"] / kw["batch_size"] * I2
    step = dict(
        n=N, J=J2, eta=math.sqrt(kw["step_size"] / N), M=case["M"], C=case["C"], B=case["B"], T=T
    )
    return kw, step, noise_cov


@pytest.mark.parametrize("name", sorted(CASES))
def test_recursion_is_the_explicit_update(name):
    """``F`` = the update's matrix on ``(θ, r)``; ``D`` = its noise covariance (from ``e, ξ``)."""
    kw, step, noise_cov = case_setup(name)
    F, D = sghmc_recursion(J2, num_data=N, I=I2, **kw)
    d = 2
    zero = np.zeros((2 * d, d))
    basis = np.eye(2 * d)
    # the update is linear in (θ, r, e, ξ): read off its matrix column by column
    theta, r = sghmc_step(basis[:, :d], basis[:, d:], zero, zero, **step)
    np.testing.assert_allclose(np.hstack([theta, r]).T, F, rtol=1e-12, atol=1e-12)
    zero = np.zeros((d, d))
    theta, r = sghmc_step(zero, zero, np.eye(d), zero, **step)
    G_e = np.hstack([theta, r]).T  # (2d, d): response to e
    theta, r = sghmc_step(zero, zero, zero, np.eye(d), **step)
    G_xi = np.hstack([theta, r]).T  # response to ξ
    expected = G_e @ noise_cov @ G_e.T + G_xi @ G_xi.T
    np.testing.assert_allclose(D, expected, rtol=1e-12, atol=1e-12 * np.max(np.abs(D)))
    np.testing.assert_array_equal(D, D.T)
    assert np.linalg.matrix_rank(D) == d  # θ noise = η M⁻¹ × r noise


def test_argument_forms_agree():
    """Scalars, diagonals and matrices; full data ignores ``I``; ``B̂`` can cancel ``I``."""
    common = dict(num_data=N, step_size=h(0.01))
    F1, D1 = sghmc_recursion(np.diag(J2), mass=2.0, friction=[5.0, 5.0], **common)
    F2, D2 = sghmc_recursion(
        np.diag(np.diag(J2)), mass=2 * np.eye(2), friction=5 * np.eye(2), **common
    )
    np.testing.assert_array_equal(F1, F2)
    np.testing.assert_array_equal(D1, D2)
    # the default friction is (α/η) M
    F3, D3 = sghmc_recursion(J2, mass=[2.0, 1.0], momentum_decay=0.3, **common)
    F4, D4 = sghmc_recursion(J2, mass=[2.0, 1.0], friction=[60.0, 30.0], **common)
    np.testing.assert_allclose(F3, F4, rtol=1e-14)
    np.testing.assert_allclose(D3, D4, rtol=1e-14)
    np.testing.assert_allclose(F3[2:, 2:], 0.7 * np.eye(2), rtol=1e-14)  # I - η C M⁻¹ = (1-α) I
    # batch_size = n (or None) is the full data: no gradient noise, I unused
    full = sghmc_recursion(J2, I=I2, batch_size=N, **common)
    for a, b in zip(full, sghmc_recursion(J2, **common), strict=True):
        np.testing.assert_array_equal(a, b)
    # so is control variates, at any batch size
    cv = sghmc_recursion(J2, batch_size=10, control_variates=True, **common)
    np.testing.assert_array_equal(cv[1], full[1])
    # B̂ = η n² I/(2bT) cancels the minibatch noise exactly (Chen et al.'s correction)
    b, eta = 100, 0.01
    B_hat = eta * N * N * np.diag(I2) / (2 * b)
    friction = 400.0
    _, D_noisy = sghmc_recursion(
        J2, I=np.diag(np.diag(I2)), batch_size=b, friction=friction, gradient_noise=B_hat, **common
    )
    _, D_exact = sghmc_recursion(J2, friction=friction, **common)
    np.testing.assert_allclose(D_noisy, D_exact, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Small-step limit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [N, N / 2])
def test_small_step_limit_is_the_posterior_and_the_kinetic_law(beta):
    """``Σ_θθ → T (nJ)⁻¹`` (error ``O(η²)``), ``Σ_rr → T M`` (error ``O(η)`` at fixed ``C``)."""
    T = N / beta
    M = np.array([[1.5, 0.2], [0.2, 0.7]])
    target = T * np.linalg.inv(N * J2)
    pos, mom = [], []
    for eta in (1e-3, 5e-4, 2.5e-4):
        p = sghmc_prediction(
            J2,
            num_data=N,
            step_size=h(eta),
            mass=M,
            friction=[20.0, 10.0],
            inverse_temperature=beta,
        )
        assert isinstance(p, SGHMCPrediction)
        pos.append(rel(p.position_covariance, target))
        mom.append(rel(p.momentum_covariance, T * M))
        np.testing.assert_array_equal(p.position_covariance, p.covariance[:2, :2])
        np.testing.assert_array_equal(p.momentum_covariance, p.covariance[2:, 2:])
    assert pos[-1] < 1e-3 and mom[-1] < 1e-2
    np.testing.assert_allclose(np.array(pos[:-1]) / pos[1:], 4.0, rtol=0.05)  # O(η²)
    np.testing.assert_allclose(np.array(mom[:-1]) / mom[1:], 2.0, rtol=0.1)  # O(η)


def test_default_friction_keeps_a_momentum_bias_of_order_alpha():
    """With ``C = (α/η) M`` the momentum step is the AR(1) ``r' = (1-α) r + ...``:
    ``Σ_rr → T M/(1 - α/2)`` as ``η → 0``, while ``Σ_θθ → T (nJ)⁻¹`` still."""
    alpha = 0.1
    p = sghmc_prediction(J2, num_data=N, step_size=h(2.5e-4), momentum_decay=alpha)
    np.testing.assert_allclose(p.momentum_covariance, np.eye(2) / (1 - alpha / 2), atol=1e-4)
    assert rel(p.position_covariance, np.linalg.inv(N * J2)) < 1e-4
    # every mode is underdamped at this step: the spectral radius is sqrt(1 - α)
    p = sghmc_prediction(J2, num_data=N, step_size=h(4e-3), momentum_decay=alpha)
    np.testing.assert_allclose(p.spectral_radius, math.sqrt(1 - alpha), rtol=1e-10)


# ---------------------------------------------------------------------------------------------
# Against a simulation of the explicit update
# ---------------------------------------------------------------------------------------------

CHAINS, BURN_IN, STEPS = 8000, 600, 2000


def simulate(name, seed):
    """Independent chains of the explicit update from ``z = 0`` with Gaussian ``e``.

    Returns per-chain means of ``z = (θ, r)`` ``(K, 2d)`` and of ``zzᵀ`` ``(K, 2d, 2d)`` over
    the ``STEPS`` draws after burn-in.
    """
    kw, step, noise_cov = case_setup(name)
    rng = np.random.default_rng(seed)
    L = np.linalg.cholesky(noise_cov)
    d = 2
    theta, r = np.zeros((CHAINS, d)), np.zeros((CHAINS, d))
    total, outer = np.zeros((CHAINS, 2 * d)), np.zeros((CHAINS, 2 * d, 2 * d))
    for t in range(BURN_IN + STEPS):
        e = rng.standard_normal((CHAINS, d)) @ L.T
        xi = rng.standard_normal((CHAINS, d))
        theta, r = sghmc_step(theta, r, e, xi, **step)
        if t >= BURN_IN:
            z = np.hstack([theta, r])
            total += z
            outer += z[:, :, None] * z[:, None, :]
    return total / STEPS, outer / STEPS


@pytest.fixture(scope="module", params=sorted(CASES))
def simulated(request):
    name = request.param
    kw, _, _ = case_setup(name)
    prediction = sghmc_prediction(J2, num_data=N, I=I2, **kw)
    means, outer = simulate(name, seed=sorted(CASES).index(name) + 11)
    temperature = N / kw.get("inverse_temperature", N)
    return dict(prediction=prediction, means=means, outer=outer, temperature=temperature)


def test_simulated_covariance_matches_the_prediction(simulated):
    p, outer = simulated["prediction"], simulated["outer"]
    estimate = outer.mean(axis=0)
    se = outer.std(axis=0, ddof=1) / math.sqrt(CHAINS)
    err = np.abs(estimate - p.covariance)
    assert np.all(err <= Z * se), f"|estimate - prediction| / se = {np.max(err / se):.2f}"
    scale = np.sqrt(np.outer(np.diag(p.covariance), np.diag(p.covariance)))
    assert np.max(se / scale) < 0.01  # a sharp test
    # ... which the small-step law T (nJ)⁻¹ (and T M) fails: the step's bias is visible
    small_step = simulated["temperature"] * np.linalg.inv(N * J2)
    assert rel(p.position_covariance, small_step) > 0.1
    bad = np.abs(estimate[:2, :2] - small_step) / se[:2, :2]
    assert np.max(bad) > 10 * Z


def test_simulated_autocorrelation_times_match_the_prediction(simulated):
    # Chain means of a stationary chain (mean 0): T·E[θ̄ᵢ²]/Σᵢᵢ equals T·Cov(θ̄)ᵢᵢ/Σᵢᵢ exactly
    # (iterate_average_covariance, → τᵢ as T → ∞); each estimate is a mean of K scaled χ²₁.
    p = simulated["prediction"]
    F, sigma = p.transition, p.covariance
    var = np.diag(p.position_covariance)
    finite = STEPS * np.diag(iterate_average_covariance(F, sigma, STEPS))[:2] / var
    estimate = STEPS * np.mean(simulated["means"][:, :2] ** 2, axis=0) / var
    se = finite * math.sqrt(2 / CHAINS)
    assert np.all(np.abs(estimate - finite) <= Z * se), (estimate, finite)
    assert np.all(np.abs(finite / p.autocorrelation_times - 1) < 0.02)
    # fully empirical: chain-mean variance over within-chain variance, against τ within 10%
    empirical = STEPS * np.mean(simulated["means"][:, :2] ** 2, axis=0)
    empirical /= np.mean(simulated["outer"][:, [0, 1], [0, 1]], axis=0)
    np.testing.assert_allclose(empirical, p.autocorrelation_times, rtol=0.1)
    # per-coordinate times are autocorrelation_times of (e_i, 0), and at most the worst
    V = np.hstack([np.eye(2), np.zeros((2, 2))])
    np.testing.assert_allclose(
        p.autocorrelation_times, autocorrelation_times(F, sigma, V), rtol=1e-12
    )
    assert np.all(p.autocorrelation_times <= p.worst_autocorrelation_time * (1 + 1e-12))
    v = np.concatenate([p.worst_direction, np.zeros(2)])
    np.testing.assert_allclose(
        autocorrelation_times(F, sigma, v), p.worst_autocorrelation_time, rtol=1e-10
    )


def test_prediction_solves_the_lyapunov_equation():
    p = sghmc_prediction(J2, num_data=N, I=I2, **CASES["dense"]["kwargs"])
    F, D, S = p.transition, p.noise, p.covariance
    np.testing.assert_allclose(S, F @ S @ F.T + D, atol=1e-12 * np.max(np.abs(S)))
    np.testing.assert_allclose(S, discrete_lyapunov(F, D), rtol=1e-12)
    assert p.spectral_radius == pytest.approx(np.max(np.abs(np.linalg.eigvals(F))), rel=1e-14)
    # brute-force worst IAT over θ-functionals: max over a fine grid of directions
    angles = np.linspace(0, np.pi, 2001)
    V = np.stack([np.cos(angles), np.sin(angles), 0 * angles, 0 * angles], axis=1)
    grid = autocorrelation_times(F, S, V)
    assert np.max(grid) <= p.worst_autocorrelation_time * (1 + 1e-12)
    assert np.max(grid) == pytest.approx(p.worst_autocorrelation_time, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Mass matching
# ---------------------------------------------------------------------------------------------


def stable_step(J, mass, alpha, fraction):
    lam_max = np.max(np.linalg.eigvals(np.linalg.solve(np.diag(mass), np.diag(J))).real)
    return fraction * math.sqrt(2 * (2 - alpha) / (N * lam_max))


def test_a_mass_matching_the_scales_mixes_faster():
    """``J = diag(100, 1)``: ``M = diag(J)/min(diag J)`` makes ``M⁻¹J = I``.

    With the default friction each coordinate's chain depends only on ``η² n Jᵢᵢ/Mᵢᵢ`` and
    ``α``, so the gain is in the step size: at the same fraction of each one's stability limit
    the matched mass mixes far faster. At the same ``η`` it gains nothing on the slow
    coordinate (identical IAT).
    """
    J = np.array([100.0, 1.0])
    alpha = 0.2
    matched, identity = J / J.min(), np.ones(2)
    preds = {}
    for label, mass in (("matched", matched), ("identity", identity)):
        eta = stable_step(J, mass, alpha, 0.5)
        preds[label] = sghmc_prediction(
            J, num_data=N, step_size=h(eta), mass=mass, momentum_decay=alpha
        )
    assert (
        preds["matched"].worst_autocorrelation_time
        < 0.2 * preds["identity"].worst_autocorrelation_time
    )
    # matched: both coordinates mix alike
    taus = preds["matched"].autocorrelation_times
    np.testing.assert_allclose(taus[0], taus[1], rtol=1e-8)
    # the same η (the identity mass's): the slow coordinate is unchanged
    eta = stable_step(J, identity, alpha, 0.5)
    same = sghmc_prediction(J, num_data=N, step_size=h(eta), mass=matched, momentum_decay=alpha)
    np.testing.assert_allclose(
        same.autocorrelation_times[1], preds["identity"].autocorrelation_times[1], rtol=1e-8
    )


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def test_friction_below_the_gradient_noise_is_rejected():
    with pytest.raises(ValueError, match="lower gradient_noise or raise the friction"):
        sghmc_recursion(J2, num_data=N, step_size=h(0.01), friction=5.0, gradient_noise=[6.0, 1.0])
    with pytest.raises(ValueError, match="positive semidefinite"):
        sghmc_prediction(
            J2, num_data=N, step_size=h(0.01), momentum_decay=0.1, gradient_noise=20.0
        )  # C = 10 I
    sghmc_recursion(J2, num_data=N, step_size=h(0.01), friction=5.0, gradient_noise=5.0)  # C = B̂


def test_minibatches_need_the_gradient_covariance():
    with pytest.raises(ValueError, match="pass I"):
        sghmc_prediction(J2, num_data=N, step_size=h(0.01), batch_size=10)
    sghmc_prediction(J2, num_data=N, step_size=h(0.01), batch_size=10, control_variates=True)
    with pytest.raises(ValueError, match="batch_size"):
        sghmc_recursion(J2, num_data=N, step_size=h(0.01), batch_size=N + 1, I=I2)


@pytest.mark.parametrize("alpha", [0.1, 0.5, 1.0, 1.5])
def test_unstable_step_is_rejected_at_the_predicted_bound(alpha):
    """With ``C = (α/η) M``: stable iff ``η² n λmax(M⁻¹J) < 2(2 - α)``."""
    mass = np.array([[1.5, 0.2], [0.2, 0.7]])
    lam_max = np.max(np.linalg.eigvals(np.linalg.solve(mass, J2)).real)
    bound = math.sqrt(2 * (2 - alpha) / (N * lam_max))
    common = dict(num_data=N, mass=mass, momentum_decay=alpha)
    assert sghmc_prediction(J2, step_size=h(0.999 * bound), **common).spectral_radius < 1
    with pytest.raises(ValueError, match=r"unstable.*Reduce step_size.*step_size < "):
        sghmc_prediction(J2, step_size=h(1.001 * bound), **common)
    # in the library's convention the bound is h λmax(M⁻¹J) < 2(2 - α)
    np.testing.assert_allclose(h(bound) * lam_max, 2 * (2 - alpha), rtol=1e-12)


def test_unstable_with_given_friction_and_bad_arguments():
    with pytest.raises(ValueError, match="Reduce step_size"):
        sghmc_prediction(J2, num_data=N, step_size=h(0.01), friction=500.0)  # η C = 5: overshoots
    with pytest.raises(ValueError, match="momentum_decay must be positive"):
        sghmc_recursion(J2, num_data=N, step_size=h(0.01), momentum_decay=0.0)
    with pytest.raises(ValueError, match="step_size must be positive"):
        sghmc_recursion(J2, num_data=N, step_size=h(0.0))
    with pytest.raises(ValueError, match="mass must be symmetric positive definite"):
        sghmc_recursion(J2, num_data=N, step_size=h(0.01), mass=[1.0, -1.0])
    with pytest.raises(ValueError, match="shape"):
        sghmc_recursion(J2, num_data=N, step_size=h(0.01), mass=np.ones(3))
    with pytest.raises(ValueError, match="singular"):
        sghmc_prediction(J2, num_data=N, step_size=h(0.01), inverse_temperature=math.inf)
