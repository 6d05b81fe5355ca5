"""``numpyro_sgmc.theory`` against brute force (``shared/design/theory.md`` §3–§4).

No models: every formula is checked against a brute-force sum, a direct linear solve or a
float64 NumPy simulation of the recursion it describes (many independent chains, Monte Carlo
tolerances from the spread between chains).
"""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg

from numpyro_sgmc import theory
from numpyro_sgmc.theory import (
    ROWS,
    TABLE_1,
    MixingTime,
    Row,
    RowTuning,
    autocorrelation_times,
    continuous_lyapunov,
    discrete_lyapunov,
    iterate_average_covariance,
    iterate_average_covariance_limit,
    mixing_time,
    predicted_autocorrelation_times,
    row_mixing,
    row_target,
    row_tuning,
    stationary_covariance,
    worst_autocorrelation_time,
)

N_, B_ = 10_000, 100  # the row checks (d = 4): n, b
ROW_NAMES = ("P1", "P2", "P3", "P4", "P5", "B", "F", "G", "A")
# z = 5 Monte Carlo standard errors: a false alarm in one of ~100 comparisons has probability
# ~ 100 * 6e-7
Z = 5.0


def spd(rng, eigenvalues):
    q, _ = np.linalg.qr(rng.standard_normal((len(eigenvalues), len(eigenvalues))))
    return (q * np.asarray(eigenvalues)) @ q.T


@pytest.fixture(scope="module")
def info():
    """A random SPD ``J`` and a different SPD ``I`` (sandwich far from ``J⁻¹``)."""
    rng = np.random.default_rng(20240601)
    J = spd(rng, [0.5, 1.0, 2.0, 4.0])
    I = spd(rng, [0.3, 1.5, 2.5, 6.0])
    J_inv = np.linalg.inv(J)
    S = J_inv @ I @ J_inv
    assert np.linalg.norm(S - J_inv) / np.linalg.norm(J_inv) > 0.5
    return J, I, S


def rel(x, y):
    return np.linalg.norm(x - y) / np.linalg.norm(y)


def brute_iat(F, Sigma, v, lags=4000):
    """``1 + 2 Σ_{k=1}^{lags} vᵀF^kΣv / vᵀΣv`` by explicit matrix powers."""
    total, Fk = 0.0, np.eye(len(v))
    for _ in range(lags):
        Fk = Fk @ F
        total += v @ Fk @ Sigma @ v
    return 1 + 2 * total / (v @ Sigma @ v)


def simulate_linear(F, D, *, chains, burn_in, steps, seed):
    """``δ' = Fδ + N(0, D)`` from ``δ = 0``, many independent chains, float64.

    Returns per-chain statistics over the ``steps`` draws after burn-in: the means ``(K, d)``
    and the averages of ``δδᵀ``, ``(K, d, d)``.
    """
    rng = np.random.default_rng(seed)
    L = np.linalg.cholesky(D)
    d = F.shape[0]
    x = np.zeros((chains, d))
    total, outer = np.zeros((chains, d)), np.zeros((chains, d, d))
    for t in range(burn_in + steps):
        x = x @ F.T + rng.standard_normal((chains, d)) @ L.T
        if t >= burn_in:
            total += x
            outer += x[:, :, None] * x[:, None, :]
    return total / steps, outer / steps


def assert_within_mc(estimate, se, expected, label):
    err = np.abs(np.asarray(estimate) - np.asarray(expected))
    assert np.all(err <= Z * np.asarray(se)), (
        f"{label}: |estimate - prediction| / se = {np.max(err / se):.2f} > {Z}"
    )


# ---------------------------------------------------------------------------------------------
# Lyapunov equations
# ---------------------------------------------------------------------------------------------


def test_continuous_lyapunov_solves_its_equation():
    rng = np.random.default_rng(1)
    A = spd(rng, [0.2, 1.0, 3.0]) @ spd(rng, [0.5, 1.0, 2.0])  # non-symmetric, real spectrum > 0
    D = spd(rng, [1.0, 2.0, 3.0])
    sigma = continuous_lyapunov(A, D)
    np.testing.assert_allclose(A @ sigma + sigma @ A.T, D, atol=1e-12)
    # direct Kronecker solve of (I⊗A + A⊗I) vec Σ = vec D
    kron = np.kron(np.eye(3), A) + np.kron(A, np.eye(3))
    direct = np.linalg.solve(kron, D.reshape(-1, order="F")).reshape(3, 3, order="F")
    np.testing.assert_allclose(sigma, direct, atol=1e-12)
    np.testing.assert_array_equal(sigma, sigma.T)


@pytest.mark.parametrize("bad", [[1.0, -0.1], [1.0, 0.0]])
def test_continuous_lyapunov_needs_a_contracting_drift(bad):
    with pytest.raises(ValueError, match="non-positive real part"):
        continuous_lyapunov(np.diag(bad), np.eye(2))


def test_discrete_lyapunov_solves_its_equation_and_rejects_unstable():
    rng = np.random.default_rng(2)
    F = np.eye(3) - 0.3 * spd(rng, [0.2, 1.0, 3.0]) @ spd(rng, [0.5, 1.0, 2.0])
    D = spd(rng, [1.0, 2.0, 3.0])
    sigma = discrete_lyapunov(F, D)
    np.testing.assert_allclose(F @ sigma @ F.T + D, sigma, atol=1e-12)
    with pytest.raises(ValueError, match="unstable"):
        discrete_lyapunov(np.diag([0.5, -1.0]), np.eye(2))


def test_stationary_covariance_default_is_the_discrete_lyapunov_solution(info):
    # backward compatibility: the default method is the old (discrete) predictor
    J, I, _ = info
    h, b, n, beta = 0.3, 10, 1000, 500.0
    gamma = np.linalg.inv(spd(np.random.default_rng(3), [0.5, 1.0, 1.5, 2.0]))
    lam = np.diag([0.5, 1.0, 2.0, 0.7])
    got = stationary_covariance(
        J,
        I,
        step_size=h,
        batch_size=b,
        num_data=n,
        inverse_temperature=beta,
        preconditioner=gamma,
        noise_preconditioner=lam,
    )
    F = np.eye(4) - 0.5 * h * gamma @ J
    D = h * h / (4 * b) * gamma @ I @ gamma + (h / beta) * lam
    np.testing.assert_allclose(got, discrete_lyapunov(F, D), rtol=1e-12)
    explicit = stationary_covariance(
        J,
        I,
        step_size=h,
        batch_size=b,
        num_data=n,
        inverse_temperature=beta,
        preconditioner=gamma,
        noise_preconditioner=lam,
        method="discrete",
    )
    np.testing.assert_array_equal(got, explicit)


def test_diagonal_arguments_equal_their_matrices():
    J, I, gamma, lam = (
        np.array(v) for v in ([1.0, 2.0, 3.0], [2.0, 0.5, 1.0], [0.5, 1.0, 0.25], [1.0, 2.0, 3.0])
    )
    for method in ("discrete", "continuous"):
        common = dict(step_size=0.2, batch_size=5, num_data=100, method=method)
        diag = stationary_covariance(J, I, preconditioner=gamma, noise_preconditioner=lam, **common)
        full = stationary_covariance(
            np.diag(J),
            np.diag(I),
            preconditioner=np.diag(gamma),
            noise_preconditioner=np.diag(lam),
            **common,
        )
        np.testing.assert_allclose(diag, full, rtol=1e-14)
    np.testing.assert_allclose(
        mixing_time(J, step_size=0.1, preconditioner=gamma).iterations,
        mixing_time(np.diag(J), step_size=0.1, preconditioner=np.diag(gamma)).iterations,
    )


def test_unknown_method_lists_the_options(info):
    J, I, _ = info
    with pytest.raises(ValueError, match="discrete.*continuous"):
        stationary_covariance(J, I, step_size=0.1, batch_size=1, num_data=10, method="euler")


@pytest.mark.parametrize("h", [0.04, 0.5, 2.0, 3.5])
@pytest.mark.parametrize("beta", [math.inf, 50.0])
def test_continuous_and_discrete_differ_by_exactly_one_minus_h_over_4_for_inverse_J(info, h, beta):
    J, I, _ = info
    common = dict(
        step_size=h,
        batch_size=10,
        num_data=1000,
        inverse_temperature=beta,
        preconditioner=np.linalg.inv(J),
    )
    discrete = stationary_covariance(J, I, **common)
    continuous = stationary_covariance(J, I, method="continuous", **common)
    np.testing.assert_allclose(discrete, continuous / (1 - h / 4), rtol=1e-10)


@pytest.mark.parametrize("h", [0.01, 0.05, 0.2])
def test_continuous_and_discrete_differ_by_O_h_in_general(info, h):
    # In the basis Γ^{-1/2} (where (h/2)Γ^{1/2}JΓ^{1/2} = diag(a)) the two solutions are
    # D̃_ij/(a_i + a_j - a_i a_j) and D̃_ij/(a_i + a_j): their ratio - 1 is c/(1-c) with
    # c = a_i a_j/(a_i + a_j) in [h λmin(ΓJ)/4, h λmax(ΓJ)/4], so with x = h λmax(ΓJ)/4:
    # h λmin(ΓJ)/4 <= ‖Γ^{-1/2}(Σ_d - Σ_c)Γ^{-1/2}‖_F / ‖Γ^{-1/2}Σ_cΓ^{-1/2}‖_F <= x/(1-x).
    J, I, _ = info
    gamma = spd(np.random.default_rng(4), [0.3, 1.0, 2.0, 5.0])
    common = dict(
        step_size=h,
        batch_size=10,
        num_data=1000,
        preconditioner=gamma,
        noise_preconditioner=np.diag([1.0, 2.0, 0.5, 1.0]),
    )
    discrete = stationary_covariance(J, I, **common)
    continuous = stationary_covariance(J, I, method="continuous", **common)
    w = np.linalg.inv(scipy.linalg.sqrtm(gamma).real)
    spectrum = np.linalg.eigvals(gamma @ J).real
    x = h * np.max(spectrum) / 4
    error = rel(w @ discrete @ w, w @ continuous @ w)
    assert h * np.min(spectrum) / 4 <= error <= x / (1 - x)  # first order in h, no smaller
    assert rel(discrete, continuous) <= 2 * x / (1 - x)


def hessian_term(H, gamma, sigma, h, b):
    """``(h²/(4b)) Γ[(1/n)Σ_i H_iΣH_i - H̄ΣH̄]Γ`` by an explicit loop."""
    spread = sum(Hi @ sigma @ Hi for Hi in H) / len(H)
    H_bar = H.mean(axis=0)
    return h * h / (4 * b) * gamma @ (spread - H_bar @ sigma @ H_bar) @ gamma.T


@pytest.mark.parametrize("method", ["discrete", "continuous"])
@pytest.mark.parametrize("control_variates", [True, False])
def test_hessian_term_fixed_point_solves_the_joint_equation(info, method, control_variates):
    J, I, _ = info
    rng = np.random.default_rng(5)
    X = rng.standard_normal((50, 4)) * rng.exponential(1.0, (50, 1))
    H = -np.einsum("ni,nj->nij", X, X)
    J = -H.mean(axis=0)
    h, b, n, beta = 0.8, 5, 50, 50.0
    gamma = np.linalg.inv(J)
    sigma = stationary_covariance(
        J,
        I,
        step_size=h,
        batch_size=b,
        num_data=n,
        hessians=H,
        preconditioner=gamma,
        control_variates=control_variates,
        method=method,
    )
    D = (h / beta) * gamma + hessian_term(H, gamma, sigma, h, b)
    if not control_variates:
        D = D + h * h / (4 * b) * gamma @ I @ gamma
    A = 0.5 * h * gamma @ J
    if method == "discrete":
        residual = (np.eye(4) - A) @ sigma @ (np.eye(4) - A).T + D - sigma
    else:
        residual = A @ sigma + sigma @ A.T - D
    assert np.max(np.abs(residual)) <= 1e-10 * np.max(np.abs(sigma))
    without = stationary_covariance(
        J,
        I,
        step_size=h,
        batch_size=b,
        num_data=n,
        preconditioner=gamma,
        method=method,
        hessians=np.broadcast_to(-J, (3, 4, 4)),
        control_variates=control_variates,
    )
    assert rel(sigma, without) > 0.05  # the term matters at this step size


# ---------------------------------------------------------------------------------------------
# Simulation of the linear recursion and of minibatch chains
# ---------------------------------------------------------------------------------------------


CHAINS, STEPS = 16384, 1000


@pytest.fixture(scope="module")
def p5_chain(info):
    """Non-reversible linear chain: Γ = I⁻¹, Λ = diag(1/J_ii), β = n; 16384 chains x 1000 draws."""
    J, I, _ = info
    gamma = np.linalg.inv(I)
    lam = 1 / np.diag(J)
    lam_min = np.min(np.linalg.eigvals(gamma @ J).real)
    h = 4 / (41 * lam_min)  # slowest IAT 40 iterations (h λmax(ΓJ) = 2.7 < 4)
    common = dict(
        step_size=h, batch_size=B_, num_data=N_, preconditioner=gamma, noise_preconditioner=lam
    )
    sigma = stationary_covariance(J, I, **common)
    F = np.eye(4) - 0.5 * h * gamma @ J
    D = h * h / (4 * B_) * gamma @ I @ gamma + h / N_ * np.diag(lam)
    means, outer = simulate_linear(F, D, chains=CHAINS, burn_in=400, steps=STEPS, seed=6)
    return dict(J=J, I=I, h=h, F=F, D=D, sigma=sigma, means=means, outer=outer, common=common)


def test_simulated_covariance_matches_the_discrete_prediction(p5_chain):
    per_chain, sigma = p5_chain["outer"], p5_chain["sigma"]  # independent chains
    estimate = per_chain.mean(axis=0)
    se = per_chain.std(axis=0, ddof=1) / math.sqrt(CHAINS)
    assert_within_mc(estimate, se, sigma, "stationary covariance")
    assert np.max(se / np.sqrt(np.outer(np.diag(sigma), np.diag(sigma)))) < 0.005  # sharp test


def test_simulated_autocorrelation_times_match_the_predictions(p5_chain):
    # Chain means of a stationary Gaussian chain (mean 0): T·E[x̄²]/Var(x) is exactly
    # T·iterate_average_covariance/Σ (and → τ as T → ∞); each estimate is a mean of K scaled
    # χ²₁ variables, relative standard error sqrt(2/K).
    F, sigma = p5_chain["F"], p5_chain["sigma"]
    K, T = CHAINS, STEPS
    mix = mixing_time(
        p5_chain["J"], step_size=p5_chain["h"], preconditioner=p5_chain["common"]["preconditioner"]
    )
    worst = worst_autocorrelation_time(F, sigma)
    V = np.vstack([np.eye(4), mix.slowest_direction, worst.direction])
    finite = T * np.einsum("ki,ij,kj->k", V, iterate_average_covariance(F, sigma, T), V)
    finite /= np.einsum("ki,ij,kj->k", V, sigma, V)
    means = p5_chain["means"] @ V.T  # (K, 6)
    estimate = T * np.mean(means**2, axis=0) / np.einsum("ki,ij,kj->k", V, sigma, V)
    assert_within_mc(estimate, finite * math.sqrt(2 / K), finite, "IAT from chain means")
    # the infinite-window predictions, which the finite window approaches within ~2τ²/T
    tau = np.concatenate([autocorrelation_times(F, sigma), [mix.iterations, worst.time]])
    np.testing.assert_allclose(tau[-2], 40.0, rtol=1e-12)
    assert np.all(np.abs(finite / tau - 1) < 2 * np.max(tau) / T)
    np.testing.assert_allclose(
        tau[:4],
        predicted_autocorrelation_times(p5_chain["J"], p5_chain["I"], **p5_chain["common"]),
        rtol=1e-12,
    )
    assert worst.time >= mix.iterations


def simulate_minibatch(
    X, r, *, h, b, beta, gamma, lam, control_variates, chains, burn_in, steps, seed
):
    """The meta-algorithm on ``l(θ; x, y) = -(y - xᵀθ)²/2`` in ``δ = θ - θ̂`` (exactly linear):
    per-datum gradient ``x_i r_i - x_i x_iᵀ δ``; with control variates ``-x_i x_iᵀ δ``.
    Returns per-chain time averages of ``δδᵀ``, ``(chains, d, d)``."""
    rng = np.random.default_rng(seed)
    n, d = X.shape
    noise = np.linalg.cholesky(lam) * math.sqrt(h / beta)
    delta = np.zeros((chains, d))
    acc = np.zeros((chains, d, d))
    for t in range(burn_in + steps):
        idx = rng.integers(0, n, size=(chains, b))
        Xb = X[idx]  # (K, b, d)
        resid = -np.einsum("kbd,kd->kb", Xb, delta)
        if not control_variates:
            resid = resid + r[idx]
        g = np.einsum("kbd,kb->kd", Xb, resid) / b
        delta = delta + 0.5 * h * g @ gamma.T + rng.standard_normal((chains, d)) @ noise.T
        if t >= burn_in:
            acc += np.einsum("ki,kj->kij", delta, delta)
    return acc / steps


@pytest.mark.parametrize("control_variates", [False, True])
def test_minibatch_chain_matches_the_prediction_with_its_hessian_term(control_variates):
    # Least squares is exactly quadratic, so the discrete prediction (with the per-datum
    # Hessian term H_i = -x_i x_iᵀ) is exact; heavy-tailed x makes that term large.
    rng = np.random.default_rng(7)
    n, d, b = 200, 3, 5
    X = rng.standard_normal((n, d)) * rng.exponential(1.0, (n, 1)) + [0.5, 0.0, -0.3]
    y = X @ [1.0, -1.0, 0.5] + rng.standard_normal(n) * (0.5 + np.abs(X[:, 0]))
    theta_hat = np.linalg.lstsq(X, y, rcond=None)[0]
    r = y - X @ theta_hat
    J = X.T @ X / n
    g = X * r[:, None]
    I = g.T @ g / n
    H = -np.einsum("ni,nj->nij", X, X)
    gamma = np.linalg.inv(J)
    lam = np.diag(1 / np.diag(J))
    h, beta = 0.2, (float(n) if control_variates else 2.0 * n)
    sigma = stationary_covariance(
        J,
        I,
        step_size=h,
        batch_size=b,
        num_data=n,
        hessians=H,
        inverse_temperature=beta,
        preconditioner=gamma,
        noise_preconditioner=lam,
        control_variates=control_variates,
    )
    per_chain = simulate_minibatch(
        X,
        r,
        h=h,
        b=b,
        beta=beta,
        gamma=gamma,
        lam=lam,
        control_variates=control_variates,
        chains=4096,
        burn_in=100,
        steps=600,
        seed=8,
    )
    estimate = per_chain.mean(axis=0)
    se = per_chain.std(axis=0, ddof=1) / math.sqrt(per_chain.shape[0])
    assert_within_mc(estimate, se, sigma, f"minibatch chain, control_variates={control_variates}")
    without = stationary_covariance(
        J,
        I,
        step_size=h,
        batch_size=b,
        num_data=n,
        inverse_temperature=beta,
        preconditioner=gamma,
        noise_preconditioner=lam,
        control_variates=control_variates,
        hessians=np.broadcast_to(-J, (1, d, d)),
    )
    # the simulation can tell the Hessian term apart (it is many standard errors)
    assert np.max(np.abs(np.diag(sigma - without)) / np.diag(se)) > 3 * Z


# ---------------------------------------------------------------------------------------------
# Mixing and autocorrelation times
# ---------------------------------------------------------------------------------------------


def test_autocorrelation_times_equal_brute_force_sums(info):
    J, I, _ = info
    rng = np.random.default_rng(9)
    gamma = spd(rng, [0.3, 1.0, 2.0, 5.0])
    h = 0.1
    F = np.eye(4) - 0.5 * h * gamma @ J
    sigma = stationary_covariance(
        J, I, step_size=h, batch_size=10, num_data=1000, preconditioner=gamma
    )
    V = rng.standard_normal((3, 4))
    lags = int(60 / (0.5 * h * np.min(np.linalg.eigvals(gamma @ J).real)))  # |F^k| < e^-60
    expected_axes = [brute_iat(F, sigma, e, lags) for e in np.eye(4)]
    np.testing.assert_allclose(autocorrelation_times(F, sigma), expected_axes, rtol=1e-9)
    expected = [brute_iat(F, sigma, v, lags) for v in V]
    np.testing.assert_allclose(autocorrelation_times(F, sigma, V), expected, rtol=1e-9)
    assert isinstance(autocorrelation_times(F, sigma, V[0]), float)
    np.testing.assert_allclose(autocorrelation_times(F, sigma, V[0]), expected[0], rtol=1e-9)
    # the long-run covariance identity behind the worst case: M = (I-F)⁻¹ D (I-F)⁻ᵀ
    D = sigma - F @ sigma @ F.T
    R = np.linalg.inv(np.eye(4) - F)
    M = R @ D @ R.T
    worst = worst_autocorrelation_time(F, sigma)
    np.testing.assert_allclose(
        worst.time, np.max(np.linalg.eigvals(np.linalg.solve(sigma, M)).real), rtol=1e-10
    )
    v = worst.direction
    np.testing.assert_allclose(v @ M @ v / (v @ sigma @ v), worst.time, rtol=1e-10)
    np.testing.assert_allclose(np.linalg.norm(v), 1.0)
    many = rng.standard_normal((2000, 4))
    assert np.all(autocorrelation_times(F, sigma, many) <= worst.time * (1 + 1e-12))


def test_mixing_time_is_the_iat_of_the_left_eigenvector_for_any_noise(info):
    # Row P5's ΓJ = I⁻¹J is not symmetric: the slowest functional is a left eigenvector.
    J, I, _ = info
    gamma = np.linalg.inv(I)
    h = 0.2
    mix = mixing_time(J, step_size=h, preconditioner=gamma, batch_size=B_, num_data=N_)
    lam_min = np.min(np.linalg.eigvals(gamma @ J).real)
    assert isinstance(mix, MixingTime)
    np.testing.assert_allclose(mix.iterations, 4 / (h * lam_min) - 1, rtol=1e-12)
    np.testing.assert_allclose(mix.epochs, mix.iterations * B_ / N_, rtol=1e-12)
    v = mix.slowest_direction
    np.testing.assert_allclose(v @ gamma @ J, lam_min * v, atol=1e-12)
    F = np.eye(4) - 0.5 * h * gamma @ J
    rng = np.random.default_rng(10)
    for noise in (np.eye(4), spd(rng, [0.1, 1.0, 2.0, 9.0])):
        sigma = discrete_lyapunov(F, noise)
        np.testing.assert_allclose(autocorrelation_times(F, sigma, v), mix.iterations, rtol=1e-10)
    values, right = np.linalg.eig(gamma @ J)
    u = right[:, np.argmin(values.real)].real
    sigma = discrete_lyapunov(F, np.eye(4))
    assert abs(autocorrelation_times(F, sigma, u) / mix.iterations - 1) > 0.01  # not the right one
    assert mixing_time(J, step_size=h, preconditioner=gamma).epochs is None


def test_worst_autocorrelation_time_equals_mixing_time_for_reversible_tunings(info):
    J, I, _ = info
    h = 0.3
    J_inv = np.linalg.inv(J)
    # Γ = J⁻¹: F is a multiple of the identity, every functional has the same IAT
    sigma = stationary_covariance(
        J, I, step_size=h, batch_size=10, num_data=1000, preconditioner=J_inv
    )
    F = (1 - h / 2) * np.eye(4)
    mix = mixing_time(J, step_size=h, preconditioner=J_inv)
    np.testing.assert_allclose(mix.iterations, 4 / h - 1, rtol=1e-12)
    np.testing.assert_allclose(
        worst_autocorrelation_time(F, sigma).time, mix.iterations, rtol=1e-10
    )
    np.testing.assert_allclose(autocorrelation_times(F, sigma), mix.iterations, rtol=1e-10)
    # Langevin with Γ = Λ and no gradient noise: reversible only in the continuous limit, so
    # the worst case approaches the mixing time as h → 0 (relative gap O(h))
    for h in (0.05, 0.005):
        F = np.eye(4) - 0.5 * h * J
        sigma = discrete_lyapunov(F, h * np.eye(4))
        gap = worst_autocorrelation_time(F, sigma).time / mixing_time(J, step_size=h).iterations
        assert 1 - 1e-12 <= gap <= 1 + h * np.max(np.linalg.eigvalsh(J))


def test_worst_autocorrelation_time_exceeds_mixing_time_for_a_non_reversible_tuning():
    # 2-d: Γ = diag(1, 1/10) does not commute with J, Λ = diag(1, 10) ≠ Γ (theory §3 reports
    # 1.65x in another 2-d example; here 1.43x)
    c, s = math.cos(0.1), math.sin(0.1)
    R = np.array([[c, -s], [s, c]])
    J = R @ np.diag([1.0, 10.0]) @ R.T
    gamma = np.diag([1.0, 0.1])
    h = 0.01 / np.max(np.linalg.eigvals(gamma @ J).real)
    F = np.eye(2) - 0.5 * h * gamma @ J
    sigma = discrete_lyapunov(F, h * np.diag([1.0, 10.0]))
    worst = worst_autocorrelation_time(F, sigma)
    mix = mixing_time(J, step_size=h, preconditioner=gamma)
    assert worst.time > 1.4 * mix.iterations
    angles = np.linspace(0, np.pi, 20001)
    V = np.stack([np.cos(angles), np.sin(angles)], -1)
    np.testing.assert_allclose(np.max(autocorrelation_times(F, sigma, V)), worst.time, rtol=1e-6)
    np.testing.assert_allclose(
        autocorrelation_times(F, sigma, mix.slowest_direction), mix.iterations, rtol=1e-10
    )


def test_mixing_time_stability_errors(info):
    J, _, _ = info
    lam_max = np.max(np.linalg.eigvalsh(J))
    mixing_time(J, step_size=0.999 * 4 / lam_max)
    with pytest.raises(ValueError, match="lambda_max.*< 4"):
        mixing_time(J, step_size=4 / lam_max)
    with pytest.raises(ValueError, match="non-positive"):
        mixing_time(np.diag([1.0, -1.0]), step_size=0.1)
    with pytest.raises(ValueError, match="not stationary"):
        autocorrelation_times(np.diag([0.5, 1.0]), np.eye(2))
    with pytest.raises(ValueError, match="not stationary"):
        iterate_average_covariance(np.diag([0.5, -1.2]), np.eye(2), 10)


# ---------------------------------------------------------------------------------------------
# Iterate averaging
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 2, 7, 50, 300])
def test_iterate_average_covariance_equals_the_brute_force_sum(info, T):
    J, I, _ = info
    gamma = spd(np.random.default_rng(11), [0.3, 1.0, 2.0, 5.0])
    F = np.eye(4) - 0.05 * gamma @ J
    sigma = discrete_lyapunov(F, gamma @ I @ gamma)
    G, Fk = np.zeros((4, 4)), np.eye(4)
    for k in range(1, T):
        Fk = Fk @ F
        G += (1 - k / T) * Fk
    R = np.linalg.inv(np.eye(4) - F)
    closed = F @ R - F @ (np.eye(4) - np.linalg.matrix_power(F, T)) @ R @ R / T
    np.testing.assert_allclose(closed, G, atol=1e-11 * max(1.0, np.max(np.abs(G))))
    expected = (sigma + G @ sigma + sigma @ G.T) / T
    np.testing.assert_allclose(
        iterate_average_covariance(F, sigma, T),
        expected,
        rtol=1e-9,
        atol=1e-14 * np.max(np.abs(sigma)),
    )
    if T == 1:
        np.testing.assert_allclose(iterate_average_covariance(F, sigma, 1), sigma, rtol=1e-12)


def test_iterate_average_covariance_tends_to_the_long_run_covariance(info):
    J, I, _ = info
    F = np.eye(4) - 0.05 * J
    sigma = discrete_lyapunov(F, I)
    R = np.linalg.inv(np.eye(4) - F)
    long_run = R @ I @ R.T
    T = 10**7
    assert rel(T * iterate_average_covariance(F, sigma, T), long_run) < 1e-4
    with pytest.raises(ValueError, match="positive integer"):
        iterate_average_covariance(F, sigma, 0)


@pytest.mark.parametrize("m, value", [(1, 0.568), (8, 0.938)])
def test_row_f_averaging_numbers(info, m, value):
    J, I, S = info
    c_b = 100.0
    got = iterate_average_covariance_limit(
        J, S, S, c_h=4 * c_b, c_b=c_b, num_epochs=m, preconditioner=np.linalg.inv(J)
    )
    factor = 1 - (1 - math.exp(-2 * m)) / (2 * m)
    np.testing.assert_allclose(got, factor * S, rtol=1e-10, atol=1e-12 * np.max(np.abs(S)))
    assert round(factor, 3) == value


@pytest.mark.parametrize("row", ["F", "P5", "generic"])
@pytest.mark.parametrize("m", [1, 8])
def test_averaging_limit_matches_the_exact_discrete_average(info, row, m):
    # n m Cov(θ̄) from the exact discrete formula (T = m n/b iterates, Σ discrete) against
    # the theory's limit (Q = nΣ_continuous); the gap is O(h) = O(c_h/n) and shrinks with n.
    J, I, S = info
    gamma = {
        "F": np.linalg.inv(J),
        "P5": np.linalg.inv(I),
        "generic": spd(np.random.default_rng(12), [0.3, 1.0, 2.0, 3.0]),
    }[row]
    errors = []
    for n in (10_000, 100_000):
        h = 4 * B_ / n
        common = dict(
            step_size=h,
            batch_size=B_,
            num_data=n,
            inverse_temperature=math.inf,
            preconditioner=gamma,
        )
        sigma = stationary_covariance(J, I, **common)
        Q = n * stationary_covariance(J, I, method="continuous", **common)
        F = np.eye(4) - 0.5 * h * gamma @ J
        exact = n * m * iterate_average_covariance(F, sigma, m * n // B_)
        limit = iterate_average_covariance_limit(
            J, Q, S, c_h=4 * B_, c_b=B_, num_epochs=m, preconditioner=gamma
        )
        errors.append(rel(exact, limit))
        assert errors[-1] <= h * np.max(np.linalg.eigvals(gamma @ J).real)
    assert errors[1] < errors[0] / 5
    # and m → ∞ gives S for any Γ
    far = iterate_average_covariance_limit(
        J, Q, S, c_h=4 * B_, c_b=B_, num_epochs=1e6, preconditioner=gamma
    )
    assert rel(far, S) < 1e-4


# ---------------------------------------------------------------------------------------------
# Table 1
# ---------------------------------------------------------------------------------------------


def test_table_1_rows():
    assert tuple(r.name for r in TABLE_1) == ROW_NAMES
    assert all(ROWS[r.name] is r for r in TABLE_1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ROWS["F"].target = "J⁻¹"
    assert isinstance(ROWS["F"], Row)
    assert (ROWS["F"].drift, ROWS["F"].noise, ROWS["F"].target) == ("J⁻¹", "–", "S")
    assert ROWS["G"].constants == "c_h = 4w₁c_b"
    assert set(theory.__all__) >= {
        "continuous_lyapunov",
        "mixing_time",
        "TABLE_1",
        "row_tuning",
        "iterate_average_covariance_limit",
        "autocorrelation_times",
    }
    assert all(hasattr(theory, name) for name in theory.__all__)


def test_table_1_strings_are_those_of_the_design_document():
    here = Path(__file__).resolve()
    docs = [p / "shared/design/theory.md" for p in here.parents]
    doc = next((p for p in docs if p.is_file()), None)
    if doc is None:
        pytest.skip("shared/design/theory.md is not available")
    lines = doc.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## 4. Table 1"))
    table = [line for line in lines[start:] if line.startswith("| ")][1:]  # skip the header
    rows = {}
    for line in table[: len(TABLE_1)]:
        cells = [c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = tuple(cells)
    for row in TABLE_1:
        assert rows[row.name] == dataclasses.astuple(row)[:8]


def test_row_targets(info):
    J, I, S = info
    J_inv = np.linalg.inv(J)
    for name in ("P1", "P2", "P3", "P4", "P5"):
        np.testing.assert_allclose(row_target(name, J, I), J_inv, rtol=1e-12)
    np.testing.assert_allclose(row_target("F", J, I), S, rtol=1e-12)
    np.testing.assert_allclose(row_target("A", J, I), S, rtol=1e-12)
    np.testing.assert_allclose(row_target("B", J, I), S + J_inv, rtol=1e-12)
    np.testing.assert_allclose(row_target("B", J, I, weight=0.5), 0.5 * (S + J_inv), rtol=1e-12)
    np.testing.assert_allclose(
        row_target("G", J, I, weights=(0.3, 0.9)), 0.3 * S + 0.9 * J_inv, rtol=1e-12
    )
    np.testing.assert_allclose(
        row_target("F", np.diag(J), np.diag(I)), np.diag(np.diag(I) / np.diag(J) ** 2), rtol=1e-12
    )


def test_row_errors(info):
    J, I, _ = info
    tune = dict(batch_size=B_, num_data=N_)
    with pytest.raises(ValueError, match="P1, P2, P3, P4, P5, B, F, G, A"):
        row_target("X", J, I)
    with pytest.raises(ValueError, match="P1, P2, P3, P4, P5, B, F, G, A"):
        row_tuning("f", J, I, **tune)
    with pytest.raises(ValueError, match="weight"):
        row_target("B", J, I, weight=-0.1)
    with pytest.raises(ValueError, match="weight"):
        row_tuning("B", J, I, weight=0.0, **tune)  # h = 4wb/n = 0
    with pytest.raises(ValueError, match="not both zero"):
        row_target("G", J, I, weights=(0.0, 0.0))
    with pytest.raises(ValueError, match="w1, w2 >= 0"):
        row_tuning("G", J, I, weights=(0.5, -0.5), **tune)
    with pytest.raises(ValueError, match="w1 = 0"):
        row_tuning("G", J, I, weights=(0.0, 1.0), **tune)
    with pytest.raises(ValueError, match="needs weights"):
        row_target("G", J, I)
    with pytest.raises(ValueError, match="row B only"):
        row_target("F", J, I, weight=1.0)
    with pytest.raises(ValueError, match="row G only"):
        row_tuning("B", J, I, weights=(1.0, 1.0), **tune)
    with pytest.raises(ValueError, match="needs c_h"):
        row_tuning("P4", J, I, **tune)
    with pytest.raises(ValueError, match="fixes its step-size constant"):
        row_tuning("F", J, I, c_h=400.0, **tune)
    np.testing.assert_allclose(row_target("G", J, I, weights=(0.0, 1.0)), np.linalg.inv(J))


ROW_KW = {
    "P1": dict(c_h=1.0),
    "P2": dict(c_h=1.0),
    "P3": dict(c_h=200.0),
    "P4": dict(c_h=200.0),
    "B": dict(weight=0.7),
    "G": dict(weights=(0.6, 0.8)),
}


def row_covariance(J, I, t, method, hessians=None):
    if t.control_variates and hessians is None:
        hessians = np.broadcast_to(-J, (8,) + J.shape)  # no spread: no Hessian noise term
    return N_ * stationary_covariance(
        J,
        I,
        step_size=t.step_size,
        batch_size=B_,
        num_data=N_,
        inverse_temperature=t.inverse_temperature,
        preconditioner=t.preconditioner,
        noise_preconditioner=t.noise_preconditioner,
        control_variates=t.control_variates,
        hessians=hessians if t.control_variates else None,
        method=method,
    )


@pytest.mark.parametrize("name", ROW_NAMES)
def test_each_row_tuning_targets_its_q(info, name):
    J, I, S = info
    J_inv = np.linalg.inv(J)
    t = row_tuning(name, J, I, batch_size=B_, num_data=N_, **ROW_KW.get(name, {}))
    assert isinstance(t, RowTuning) and t.row == name
    np.testing.assert_allclose(
        t.target,
        row_target(
            name,
            J,
            I,
            **{k: v for k, v in ROW_KW.get(name, {}).items() if k in ("weight", "weights")},
        ),
    )
    continuous = row_covariance(J, I, t, "continuous")
    if name in ("P1", "P2"):
        # h n/b = c_h/c_b = 0.01 > 0: the gradient-noise bias that vanishes as h n/b → 0
        ratio = t.step_size * N_ / B_
        gamma = t.preconditioner
        bias = ratio * continuous_lyapunov(gamma @ J, 0.5 * gamma @ I @ gamma)
        np.testing.assert_allclose(continuous, J_inv + bias, rtol=1e-8)
        if name == "P2":
            np.testing.assert_allclose(bias, ratio / 4 * S, rtol=1e-8)
        # the bias is linear in h n/b: a hundred times smaller c_h, a hundred times smaller bias
        smaller = row_tuning(name, J, I, batch_size=B_, num_data=N_, c_h=0.01)
        np.testing.assert_allclose(
            rel(row_covariance(J, I, smaller, "continuous"), t.target),
            rel(continuous, t.target) / 100,
            rtol=1e-6,
        )
    else:
        assert rel(continuous, t.target) < 1e-8
    # the discrete prediction is within O(h): the Γ^{-1/2}-basis bound x/(1-x),
    # x = h λmax(ΓJ)/4 (see test_continuous_and_discrete_differ_by_O_h_in_general)
    discrete = row_covariance(J, I, t, "discrete")
    w = np.linalg.inv(scipy.linalg.sqrtm(t.preconditioner).real)
    x = t.step_size * np.max(np.linalg.eigvals(t.preconditioner @ J).real) / 4
    assert rel(w @ discrete @ w, w @ continuous @ w) <= x / (1 - x) * (1 + 1e-9)
    if name in ("B", "F", "G", "A", "P4", "P2"):  # Γ = J⁻¹: exactly the factor (1 - h/4)⁻¹
        np.testing.assert_allclose(discrete, continuous / (1 - t.step_size / 4), rtol=1e-9)


@pytest.mark.parametrize("name", ["P3", "P4"])
def test_control_variate_rows_hessian_term_is_negligible(info, name):
    # With per-datum Hessian spread the target moves by a relative O(h/b) (h = c_h/n).
    J, I, _ = info
    rng = np.random.default_rng(13)
    X = rng.standard_normal((500, 4)) * rng.exponential(1.0, (500, 1))
    H = -np.einsum("ni,nj->nij", X, X)
    J = -H.mean(axis=0)
    deviation = []
    for c_h in (200.0, 100.0):
        t = row_tuning(name, J, I, batch_size=B_, num_data=N_, c_h=c_h)
        deviation.append(rel(row_covariance(J, I, t, "continuous", hessians=H), t.target))
    assert 0 < deviation[0] < 1e-2  # heavy-tailed x: kurtosis ~ 40 times h/(4b) = 5e-5
    np.testing.assert_allclose(deviation[0] / deviation[1], 2.0, rtol=1e-2)  # first order in h


def test_row_constants(info):
    J, I, _ = info
    tune = dict(batch_size=B_, num_data=N_)
    J_inv, I_inv = np.linalg.inv(J), np.linalg.inv(I)
    f = row_tuning("F", J, I, **tune)
    assert (f.step_size, f.inverse_temperature, f.stochastic) == (4 * B_ / N_, math.inf, False)
    assert f.noise_preconditioner is None and not f.control_variates
    np.testing.assert_allclose(f.preconditioner, J_inv, rtol=1e-12)
    b = row_tuning("B", J, I, weight=0.7, **tune)
    assert b.step_size == pytest.approx(4 * 0.7 * B_ / N_) and b.stochastic
    assert b.inverse_temperature == pytest.approx(N_ / 0.7)
    np.testing.assert_allclose(b.noise_preconditioner, J_inv, rtol=1e-12)
    g = row_tuning("G", J, I, weights=(0.6, 0.8), **tune)
    assert g.step_size == pytest.approx(4 * 0.6 * B_ / N_)
    assert g.inverse_temperature == pytest.approx(N_ / 0.8)
    g0 = row_tuning("G", J, I, weights=(1.0, 0.0), **tune)  # w₂ = 0: row F
    assert (g0.step_size, g0.inverse_temperature, g0.stochastic) == (f.step_size, math.inf, False)
    p5 = row_tuning("P5", J, I, **tune)
    assert p5.step_size == 4 * B_ / N_ and not p5.stochastic
    np.testing.assert_allclose(p5.preconditioner, I_inv, rtol=1e-12)
    p4 = row_tuning("P4", J, I, c_h=200.0, **tune)
    assert p4.step_size == pytest.approx(200.0 / N_) and p4.control_variates
    assert p4.inverse_temperature == N_ and p4.stochastic
    p3 = row_tuning("P3", J, I, c_h=200.0, c_b=50.0, **tune)  # h = (c_h/c_b) b/n
    assert p3.step_size == pytest.approx(4 * B_ / N_) and p3.control_variates
    np.testing.assert_array_equal(p3.preconditioner, np.eye(4))
    a = row_tuning("A", J, I, **tune)
    assert (a.step_size, a.inverse_temperature) == (f.step_size, math.inf)
    assert row_tuning("A", J, I, c_h=50.0, **tune).step_size == pytest.approx(50.0 / N_)
    assert not row_tuning("P2", J, I, c_h=1.0, **tune).control_variates


def test_row_mixing_times_are_the_tables_in_epochs(info):
    J, I, _ = info
    tune = dict(batch_size=B_, num_data=N_)
    lam_min = np.min(np.linalg.eigvalsh(J))
    lam_min_p5 = np.min(np.linalg.eigvals(np.linalg.inv(I) @ J).real)
    c_h = 200.0
    h12 = 1.0 / N_
    expected = {  # the table's epochs; the exact linearised chain has b/n less
        "P1": (4 * B_ / (N_ * h12 * lam_min), dict(c_h=1.0)),
        "P2": (4 * B_ / (N_ * h12), dict(c_h=1.0)),
        "P3": (4 * B_ / (c_h * lam_min), dict(c_h=c_h)),
        "P4": (4 * B_ / c_h, dict(c_h=c_h)),
        "P5": (1 / lam_min_p5, {}),
        "B": (1 / 0.7, dict(weight=0.7)),
        "F": (1.0, {}),
        "G": (1 / 0.6, dict(weights=(0.6, 0.8))),
        "A": (1.0, {}),
    }
    for name, (epochs, kw) in expected.items():
        mix = row_mixing(name, J, I, **tune, **kw)
        np.testing.assert_allclose(mix.epochs, epochs - B_ / N_, rtol=1e-10, err_msg=name)
