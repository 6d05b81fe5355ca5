"""Predictions of the linearised meta-algorithm (``shared/design/theory.md`` §3–§4).

Near the mode ``θ̂`` the iteration ``θ' = θ + (h/2)Γĝ(θ) + sqrt(h/β)Λ^{1/2}ξ`` is the linear
recursion ``δ' = (I - A) δ + noise``, with

.. math::

    A = \\tfrac{h}{2}\\,\\Gamma J, \\qquad
    D = \\tfrac{h}{\\beta}\\Lambda
        + \\tfrac{h^2}{4b}\\,\\Gamma\\,[\\,I_g + M(\\Sigma)\\,]\\,\\Gamma,
    \\qquad M(\\Sigma) = \\tfrac{1}{n}\\textstyle\\sum_i H_i \\Sigma H_i - \\bar H \\Sigma \\bar H,

where ``I_g`` is the covariance of the per-datum gradients at ``θ̂`` (absent with control
variates) and ``M(Σ)`` the extra noise from the per-datum Hessians ``H_i`` (the term §3 says
to solve jointly). The stationary covariance solves the discrete Lyapunov equation
``Σ = (I - A) Σ (I - A)ᵀ + D``; for a quadratic log-likelihood this is exact, at any ``h``.
Its scaling limit is the continuous Lyapunov equation ``A Σ + Σ Aᵀ = D``.

What this module predicts from ``F = I - A``, ``Σ`` and ``D`` (all exact for the linear
recursion, theory §3):

* :func:`stationary_covariance` (discrete or continuous Lyapunov), :func:`discrete_lyapunov`,
  :func:`continuous_lyapunov`;
* :func:`mixing_time` (``4/(h λmin(ΓJ)) - 1`` iterations), :func:`autocorrelation_times`,
  :func:`worst_autocorrelation_time`, :func:`predicted_autocorrelation_times`;
* :func:`iterate_average_covariance` (exact, ``T`` iterates) and
  :func:`iterate_average_covariance_limit` (the theory's ``m``-epoch formula);
* Table 1 (theory §4) as data, :data:`TABLE_1` / :data:`ROWS`, with each row's target
  (:func:`row_target`), tuning (:func:`row_tuning`) and mixing time (:func:`row_mixing`);
* SGHMC (theory §5): its linearised ``(θ, r)`` recursion (:func:`sghmc_recursion`), and its
  stationary covariance and autocorrelation times (:func:`sghmc_prediction`).

These are plain NumPy/SciPy functions (float64), usable without a model. Matrices may be
given as ``(d, d)`` arrays or, where stated, as ``(d,)`` diagonals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import scipy.linalg

__all__ = [
    "MixingTime",
    "ROWS",
    "Row",
    "RowTuning",
    "SGHMCPrediction",
    "TABLE_1",
    "WorstAutocorrelation",
    "autocorrelation_times",
    "continuous_lyapunov",
    "discrete_lyapunov",
    "iterate_average_covariance",
    "iterate_average_covariance_limit",
    "mixing_time",
    "predicted_autocorrelation_times",
    "row_mixing",
    "row_target",
    "row_tuning",
    "sghmc_prediction",
    "sghmc_recursion",
    "stationary_covariance",
    "worst_autocorrelation_time",
]

_METHODS = ("discrete", "continuous")


# ---------------------------------------------------------------------------------------------
# Lyapunov equations and the stationary covariance (theory §3)
# ---------------------------------------------------------------------------------------------


def discrete_lyapunov(F, D) -> np.ndarray:
    """Solve ``Σ = F Σ Fᵀ + D`` (theory §3, "Stationary covariance, discrete").

    Needs every eigenvalue of ``F`` strictly inside the unit circle (a stationary chain);
    raises ``ValueError`` otherwise. The result is symmetrised.
    """
    F, D = np.asarray(F, np.float64), np.asarray(D, np.float64)
    radius = _spectral_radius(F)
    if radius >= 1:
        raise ValueError(
            f"The linearised chain is unstable: the spectral radius of I - A is {radius:.4g} >= 1. "
            "Reduce the step size (stability needs h * lambda_max(Gamma J) < 4)."
        )
    sigma = scipy.linalg.solve_discrete_lyapunov(F, D)
    return 0.5 * (sigma + sigma.T)


def continuous_lyapunov(A, D) -> np.ndarray:
    """Solve ``A Σ + Σ Aᵀ = D`` (theory §3, "Stationary covariance, continuous").

    The scaling limit of :func:`discrete_lyapunov` with ``F = I - A``: it drops the
    ``A Σ Aᵀ`` term, a relative ``O(h)`` error. Needs every eigenvalue of ``A`` to have a
    positive real part (an Ornstein–Uhlenbeck drift that contracts); raises ``ValueError``
    otherwise. The result is symmetrised.
    """
    A, D = np.asarray(A, np.float64), np.asarray(D, np.float64)
    smallest = float(np.min(np.linalg.eigvals(A).real))
    if smallest <= 0:
        raise ValueError(
            f"The drift matrix A has an eigenvalue with non-positive real part ({smallest:.4g}): "
            "the continuous-time chain does not contract, so A Sigma + Sigma A^T = D has no "
            "stationary (positive semidefinite) solution. A = (h/2) Gamma J needs Gamma and J "
            "positive definite."
        )
    sigma = scipy.linalg.solve_continuous_lyapunov(A, D)
    return 0.5 * (sigma + sigma.T)


def stationary_covariance(
    J,
    I,
    *,
    step_size: float,
    batch_size: int,
    num_data: int,
    inverse_temperature: Optional[float] = None,
    preconditioner=None,
    noise_preconditioner=None,
    hessians=None,
    control_variates: bool = False,
    batch_sampling: str = "with_replacement",
    tol: float = 1e-12,
    max_iter: int = 1000,
    method: str = "discrete",
) -> np.ndarray:
    """Predicted stationary covariance ``Σ`` of the chain (theory §3).

    With ``A = (h/2) Γ J`` and ``D = (h/β) Λ + (h²/(4b)) Γ [I + M(Σ)] Γ`` (the ``I`` term is
    absent with control variates, ``M(Σ)`` only when ``hessians`` are given; see the module
    docstring), ``method="discrete"`` solves ``Σ = (I - A) Σ (I - A)ᵀ + D`` (exact for a
    quadratic log-likelihood, at any ``h``) and ``method="continuous"`` solves
    ``A Σ + Σ Aᵀ = D`` (the scaling limit; relative error ``O(h)``, for ``Γ = J⁻¹`` and no
    Hessian term exactly the factor ``Σ_discrete = Σ_continuous / (1 - h/4)``). In both the
    Hessian term, which depends on ``Σ``, is solved by fixed-point iteration.

    :param J: ``(d, d)`` curvature per datum of the potential at the mode, ``∇²U(θ̂)/n``
        (the theory's ``J`` plus the prior's curvature over ``n``), or its ``(d,)`` diagonal.
    :param I: ``(d, d)`` covariance of the per-datum gradients ``∇l(θ̂; X_i)`` over the data
        (the minibatch noise is ``I/b`` per step, with replacement), or its ``(d,)`` diagonal.
        Ignored with control variates.
    :param step_size: ``h``.
    :param batch_size: ``b``.
    :param num_data: ``n``.
    :param inverse_temperature: ``β``; ``None`` for ``n``; ``math.inf`` for SGD.
    :param preconditioner: ``Γ`` as a ``(d, d)`` array or ``(d,)`` diagonal; ``None`` = identity.
    :param noise_preconditioner: ``Λ`` likewise; ``None`` for ``Λ = Γ``.
    :param hessians: optional ``(n, d, d)`` per-datum Hessians ``∇²l(θ̂; X_i)``, for the term
        ``M(Σ)`` (needed with control variates, a relative ``O(1/n)`` correction otherwise).
    :param control_variates: whether the chain uses the control-variate gradient.
    :param batch_sampling: ``"with_replacement"`` (noise ``I/b``) or ``"without_replacement"``
        (``b`` distinct indices per step: ``(n-b)/(n-1) · I/b``).
    :param tol: relative tolerance of the Hessian-term fixed point.
    :param max_iter: iterations of the Hessian-term fixed point.
    :param method: ``"discrete"`` (default; the predictor) or ``"continuous"`` (the limit).
    :return: ``(d, d)`` covariance of ``θ`` (not scaled by ``n``).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}.")
    solve = discrete_lyapunov if method == "discrete" else continuous_lyapunov
    J = _as_matrix(J, None)
    d = J.shape[0]
    h, b, n = float(step_size), int(batch_size), int(num_data)
    beta = float(n) if inverse_temperature is None else float(inverse_temperature)
    gamma = _as_matrix(preconditioner, d)
    lam = gamma if noise_preconditioner is None else _as_matrix(noise_preconditioner, d)
    if batch_sampling == "with_replacement":
        noise = h * h / (4 * b)
    elif batch_sampling == "without_replacement":
        noise = h * h / (4 * b) * (n - b) / (n - 1)
    else:
        raise ValueError(
            f"batch_sampling must be 'with_replacement' or 'without_replacement', got "
            f"{batch_sampling!r} (epochs have no i.i.d.-noise prediction)."
        )
    A = 0.5 * h * gamma @ J
    M = np.eye(d) - A if method == "discrete" else A
    D0 = np.zeros((d, d)) if math.isinf(beta) else (h / beta) * lam
    if not control_variates:
        D0 = D0 + noise * gamma @ _as_matrix(I, d) @ gamma.T
    if hessians is None:
        if control_variates:
            raise ValueError(
                "With control variates the gradient noise comes only from the per-datum "
                "Hessians: pass hessians=(n, d, d) array."
            )
        return solve(M, D0)
    H = np.asarray(hessians, np.float64)
    H_bar = H.mean(axis=0)
    GH, GH_bar = gamma @ H, gamma @ H_bar  # (n, d, d), (d, d)

    def hessian_noise(sigma):
        spread = (GH @ sigma @ GH.transpose(0, 2, 1)).mean(axis=0)  # batched: O(n d³)
        return noise * (spread - GH_bar @ sigma @ GH_bar.T)

    sigma = solve(M, D0)
    for _ in range(max_iter):
        new = solve(M, D0 + hessian_noise(sigma))
        if np.max(np.abs(new - sigma)) <= tol * np.max(np.abs(new)):
            return new
        sigma = new
    raise RuntimeError(
        "The Hessian noise term did not converge: the chain's gradient noise grows faster than "
        "its drift contracts (reduce the step size or increase the batch size)."
    )


# ---------------------------------------------------------------------------------------------
# Mixing and autocorrelation (theory §3, "Mixing time")
# ---------------------------------------------------------------------------------------------


class MixingTime(NamedTuple):
    """Mixing time of the linearised chain (theory §3, "Mixing time").

    ``iterations``: integrated autocorrelation time ``4/(h λmin(ΓJ)) - 1`` of the slowest
    linear functional; ``epochs``: ``iterations · b/n`` (``None`` without ``b`` and ``n``);
    ``slowest_direction``: unit ``v`` with ``vᵀ(ΓJ) = λmin vᵀ`` (a left eigenvector), the
    functional ``vᵀθ`` that mixes slowest.
    """

    iterations: float
    epochs: Optional[float]
    slowest_direction: np.ndarray


def mixing_time(
    J,
    *,
    step_size: float,
    preconditioner=None,
    batch_size: Optional[int] = None,
    num_data: Optional[int] = None,
) -> MixingTime:
    """Mixing time ``τ = 4/(h λmin(ΓJ)) - 1`` iterations (theory §3, "Mixing time").

    For a left eigenvector ``v`` of ``ΓJ`` with eigenvalue ``λ``, ``vᵀF = (1 - hλ/2) vᵀ`` for
    ``F = I - (h/2)ΓJ``, so ``vᵀδ`` is an AR(1) with coefficient ``μ = 1 - hλ/2`` whatever the
    noise, and its integrated autocorrelation time is ``(1 + μ)/(1 - μ) = 4/(hλ) - 1``; the
    largest is at ``λ = λmin``. This is exact for the linearised chain when ``ΓJ`` is
    diagonalisable with real spectrum (always when ``Γ`` and ``J`` are SPD); otherwise the real
    parts of the eigenvalues are used. It is the slowest *eigen*-functional; the worst case over
    all functionals can be larger for non-reversible tunings (:func:`worst_autocorrelation_time`).
    In epochs: ``τ · b/n`` (``4b/(n h λmin(ΓJ)) - b/n``).

    :param J: ``(d, d)`` curvature per datum (or ``(d,)`` diagonal).
    :param step_size: ``h``.
    :param preconditioner: ``Γ``, ``(d, d)`` or ``(d,)``; ``None`` = identity.
    :param batch_size: ``b`` (for ``epochs``).
    :param num_data: ``n`` (for ``epochs``).
    :raises ValueError: if ``h λmax(ΓJ) ≥ 4`` (the recursion diverges: ``|1 - hλ/2| ≥ 1``) or
        ``λmin(ΓJ) ≤ 0`` (no contraction).
    """
    J = _as_matrix(J, None)
    d = J.shape[0]
    h = float(step_size)
    if not h > 0:
        raise ValueError(f"step_size must be positive, got {step_size!r}.")
    GJ = _as_matrix(preconditioner, d) @ J
    values, vectors = np.linalg.eig(GJ.T)  # left eigenvectors of ΓJ
    real = values.real
    lam_min, lam_max = float(np.min(real)), float(np.max(real))
    if lam_min <= 0:
        raise ValueError(
            f"Gamma J has an eigenvalue with non-positive real part ({lam_min:.4g}): the chain "
            "does not contract along it (Gamma and J must be positive definite)."
        )
    radius = _spectral_radius(np.eye(d) - 0.5 * h * GJ)
    if h * lam_max >= 4 or radius >= 1:
        raise ValueError(
            f"The linearised chain is unstable: h * lambda_max(Gamma J) = {h * lam_max:.4g} "
            f"(spectral radius of I - (h/2) Gamma J = {radius:.4g}). The iteration "
            "delta' = (I - (h/2) Gamma J) delta contracts only if |1 - h lambda/2| < 1 for every "
            f"eigenvalue lambda, i.e. h * lambda_max(Gamma J) < 4: use step_size < "
            f"{4 / lam_max:.4g}."
        )
    iterations = 4.0 / (h * lam_min) - 1.0
    epochs = None
    if batch_size is not None and num_data is not None:
        epochs = iterations * int(batch_size) / int(num_data)
    direction = _unit(vectors[:, int(np.argmin(real))].real)
    return MixingTime(iterations, epochs, direction)


def _long_run_covariance(F, Sigma) -> np.ndarray:
    """``Σ + F(I-F)⁻¹Σ + Σ(I-F)⁻ᵀFᵀ = Σ_{k∈ℤ} Cov(δ_0, δ_k)`` (symmetric)."""
    d = F.shape[0]
    G = F @ np.linalg.solve(np.eye(d) - F, Sigma)  # Σ_{k≥1} F^k Σ
    M = Sigma + G + G.T
    return 0.5 * (M + M.T)


def autocorrelation_times(F, Sigma, directions=None):
    """Exact integrated autocorrelation times of linear functionals (theory §3, "Mixing time").

    For the stationary recursion ``δ' = F δ + ε`` (``ε`` uncorrelated over time) with
    stationary covariance ``Σ``, the lag-``k`` autocovariance of ``vᵀδ`` is ``vᵀ F^k Σ v``, so

    .. math::

        \\tau_v = 1 + 2\\sum_{k\\ge1}\\rho_v(k)
        = \\frac{v^\\top[\\Sigma + F(I-F)^{-1}\\Sigma + \\Sigma(I-F)^{-\\top}F^\\top]v}
               {v^\\top\\Sigma v}.

    The bracket is the long-run covariance, equal to ``(I-F)⁻¹ D (I-F)⁻ᵀ``.

    :param F: ``(d, d)`` transition matrix, spectral radius < 1 (for the meta-algorithm
        ``F = I - (h/2) Γ J``).
    :param Sigma: ``(d, d)`` stationary covariance (e.g. :func:`stationary_covariance`).
    :param directions: ``None`` for the coordinate axes (per-parameter IATs, the quantity to
        compare with empirical per-parameter IATs), a ``(d,)`` vector (returns a float) or
        ``(k, d)`` vectors, one per row (returns ``(k,)``).
    :return: ``(d,)``, float or ``(k,)`` autocorrelation times, in iterations.
    """
    F, Sigma = _check_recursion(F, Sigma)
    M = _long_run_covariance(F, Sigma)
    if directions is None:
        return np.diag(M) / np.diag(Sigma)
    V = np.asarray(directions, np.float64)
    if V.ndim == 1:
        return float(V @ M @ V / (V @ Sigma @ V))
    return np.einsum("ki,ij,kj->k", V, M, V) / np.einsum("ki,ij,kj->k", V, Sigma, V)


class WorstAutocorrelation(NamedTuple):
    """Largest integrated autocorrelation time over all linear functionals, and its ``v``."""

    time: float
    direction: np.ndarray


def worst_autocorrelation_time(F, Sigma) -> WorstAutocorrelation:
    """``max_v τ_v`` over all linear functionals ``vᵀδ`` (theory §3, "Mixing time").

    ``τ_v = vᵀMv / vᵀΣv`` with ``M`` the long-run covariance of :func:`autocorrelation_times`,
    so the maximum is the largest generalised eigenvalue of ``(M, Σ)``, i.e.
    ``λmax(Σ⁻¹ (I-F)⁻¹ D (I-F)⁻ᵀ)`` (the theory's ``λmax(Σ⁻¹A⁻¹DA⁻ᵀ)``). It equals
    :func:`mixing_time` for reversible chains (``FΣ`` symmetric, e.g. ``Γ = J⁻¹``) and can be
    larger otherwise. Needs ``Σ`` positive definite.

    :return: ``WorstAutocorrelation(time, direction)``, ``direction`` a unit vector.
    """
    F, Sigma = _check_recursion(F, Sigma)
    M = _long_run_covariance(F, Sigma)
    try:
        values, vectors = scipy.linalg.eigh(M, Sigma)
    except np.linalg.LinAlgError as err:
        raise ValueError("Sigma must be positive definite for the worst-case IAT.") from err
    return WorstAutocorrelation(float(values[-1]), _unit(vectors[:, -1]))


def predicted_autocorrelation_times(
    J,
    I,
    *,
    step_size: float,
    batch_size: int,
    num_data: int,
    inverse_temperature: Optional[float] = None,
    preconditioner=None,
    noise_preconditioner=None,
    hessians=None,
    control_variates: bool = False,
    batch_sampling: str = "with_replacement",
    directions=None,
):
    """Predicted per-parameter integrated autocorrelation times, in iterations (theory §3).

    Builds ``F = I - (h/2) Γ J`` and ``Σ`` from :func:`stationary_covariance` (discrete, the
    same arguments) and returns :func:`autocorrelation_times` ``(F, Σ, directions)``: by
    default the ``(d,)`` IATs of the coordinates ``θ_i``. With control variates the noise
    depends on ``δ`` but stays uncorrelated over time, so the formula is still exact.
    """
    J = _as_matrix(J, None)
    d = J.shape[0]
    sigma = stationary_covariance(
        J,
        I,
        step_size=step_size,
        batch_size=batch_size,
        num_data=num_data,
        inverse_temperature=inverse_temperature,
        preconditioner=preconditioner,
        noise_preconditioner=noise_preconditioner,
        hessians=hessians,
        control_variates=control_variates,
        batch_sampling=batch_sampling,
    )
    F = np.eye(d) - 0.5 * float(step_size) * _as_matrix(preconditioner, d) @ J
    return autocorrelation_times(F, sigma, directions)


# ---------------------------------------------------------------------------------------------
# Iterate averaging (theory §3, "Iterate averaging")
# ---------------------------------------------------------------------------------------------


def iterate_average_covariance(F, Sigma, num_iterations: int) -> np.ndarray:
    """Exact covariance of the mean of ``T`` consecutive stationary iterates (theory §3).

    For ``δ' = F δ + ε`` in stationarity (covariance ``Σ``), ``δ̄ = (1/T) Σ_{t<T} δ_t`` has

    .. math::

        \\mathrm{Cov}(\\bar\\delta) = \\tfrac{1}{T}\\Big[\\Sigma + G\\Sigma + \\Sigma G^\\top\\Big],
        \\quad G = \\sum_{k=1}^{T-1}\\big(1-\\tfrac{k}{T}\\big)F^k
          = F(I-F)^{-1} - \\tfrac{1}{T}F(I-F^T)(I-F)^{-2}.

    As ``T → ∞``, ``T·Cov(δ̄)`` tends to the long-run covariance ``(I-F)⁻¹D(I-F)⁻ᵀ``.

    :param F: ``(d, d)``, spectral radius < 1.
    :param Sigma: ``(d, d)`` stationary covariance.
    :param num_iterations: ``T ≥ 1``.
    """
    F, Sigma = _check_recursion(F, Sigma)
    T = int(num_iterations)
    if T < 1 or T != num_iterations:
        raise ValueError(f"num_iterations must be a positive integer, got {num_iterations!r}.")
    d = F.shape[0]
    eye = np.eye(d)
    R = np.linalg.inv(eye - F)
    G = F @ R - (F @ (eye - np.linalg.matrix_power(F, T)) @ R @ R) / T
    cov = (Sigma + G @ Sigma + Sigma @ G.T) / T
    return 0.5 * (cov + cov.T)


def iterate_average_covariance_limit(
    J, Q, S, *, c_h: float, c_b: float, num_epochs: float, preconditioner=None
) -> np.ndarray:
    """``n m Cov(θ̄)`` for SGD iterates averaged over ``m`` epochs (theory §3, "Iterate averaging").

    In the scaling limit (``h = c_h/n``, ``b = c_b n^𝔟``, ``𝔥 + 𝔟 = 1``, ``β = ∞``) the
    iterates are an Ornstein–Uhlenbeck process in epoch time with drift
    ``(c_h/(2c_b)) ΓJ``, and a window of ``m`` epochs started from stationarity gives

    .. math::

        n m\\,\\mathrm{Cov}(\\bar\\theta) = S - \\frac{4c_b^2}{c_h^2 m}\\Big[(\\Gamma J)^{-2}
            \\big(I - e^{-\\frac{c_h m}{2c_b}\\Gamma J}\\big) Q + \\text{transpose}\\Big],

    ``Q = nΣ`` the stationary covariance, ``S = J⁻¹IJ⁻¹`` (the long-run covariance of SGD for
    any ``Γ``). Tends to ``S`` as ``m → ∞``. For row F (``Γ = J⁻¹``, ``c_h = 4c_b``, ``Q = S``)
    it is ``S[1 - (1 - e^{-2m})/(2m)]``: ``0.568 S`` at ``m = 1``, ``0.938 S`` at ``m = 8``.

    :param J: ``(d, d)`` (or ``(d,)``) curvature per datum.
    :param Q: ``(d, d)`` ``n × `` stationary covariance of the iterates.
    :param S: ``(d, d)`` sandwich ``J⁻¹IJ⁻¹``.
    :param c_h: step-size constant; ``c_b``: batch-size constant (only ``c_h/c_b = hn/b``
        matters).
    :param num_epochs: ``m > 0`` (need not be an integer).
    :param preconditioner: ``Γ``; ``None`` = identity.
    :return: ``(d, d)`` matrix ``n m Cov(θ̄)``.
    """
    J = _as_matrix(J, None)
    d = J.shape[0]
    c_h, c_b, m = float(c_h), float(c_b), float(num_epochs)
    for name, value in (("c_h", c_h), ("c_b", c_b), ("num_epochs", m)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}.")
    GJ = _as_matrix(preconditioner, d) @ J
    GJ_inv = np.linalg.inv(GJ)
    decay = np.eye(d) - scipy.linalg.expm(-(c_h * m / (2 * c_b)) * GJ)
    term = GJ_inv @ GJ_inv @ decay @ _as_matrix(Q, d)
    out = _as_matrix(S, d) - (4 * c_b**2 / (c_h**2 * m)) * (term + term.T)
    return 0.5 * (out + out.T)


# ---------------------------------------------------------------------------------------------
# Table 1 (theory §4)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One row of theory §4's Table 1; every field is the display string of that table."""

    name: str
    algorithm: str
    drift: str  # Γ
    noise: str  # Λ
    scaling: str
    constants: str
    target: str  # n·Cov → Q
    mixing: str  # epochs
    description: str


TABLE_1 = (
    Row("P1", "SGLD", "I", "I", "h·n/b → 0, β = n", "", "J⁻¹",
        "4b/(n h λmin(J)) (grows with n)",
        "Plain SGLD: samples the posterior only as h·n/b → 0, so ever more epochs per "
        "mixing time, and pays the condition number of J."),
    Row("P2", "preconditioned SGLD", "J⁻¹", "J⁻¹", "h·n/b → 0, β = n", "", "J⁻¹",
        "4b/(n h) (grows with n)",
        "SGLD preconditioned by J⁻¹: no condition-number penalty, but still h·n/b → 0."),
    Row("P3", "SGLD-FP", "I", "I", "h = c_h/n, β = n", "", "J⁻¹", "4c_b/(c_h λmin(J))",
        "SGLD with control variates at the mode: the posterior at a fixed number of epochs "
        "per mixing time; pays the condition number of J."),
    Row("P4", "preconditioned SGLD-FP", "J⁻¹", "J⁻¹", "h = c_h/n, β = n", "", "J⁻¹",
        "4c_b/c_h",
        "Control variates and J⁻¹ preconditioning: the posterior, 4c_b/c_h epochs per "
        "mixing time."),
    Row("P5", "preconditioned SGD", "I⁻¹", "–", "h = c_h/n, β = ∞", "c_h = 4c_b", "J⁻¹",
        "1/λmin(I⁻¹J)",
        "SGD preconditioned by the inverse gradient covariance: its minibatch noise alone "
        "gives the posterior-like J⁻¹ (natural-gradient SGD as a sampler)."),
    Row("B", "bagged posterior", "J⁻¹", "J⁻¹", "h = c_h/n, β = n/w", "c_h = 4w c_b",
        "w (S + J⁻¹)", "1/w",
        "Minibatch noise plus injected noise: the BayesBag (bagged posterior) covariance."),
    Row("F", "local fiducial (sandwich)", "J⁻¹", "–", "h = c_h/n, β = ∞", "c_h = 4c_b", "S",
        "1",
        "SGD preconditioned by J⁻¹: its minibatch noise gives the sandwich S = J⁻¹IJ⁻¹, the "
        "frequentist covariance, robust to misspecification; one epoch per mixing time."),
    Row("G", "interpolation", "J⁻¹", "J⁻¹", "h = c_h/n, β = n/w₂", "c_h = 4w₁c_b",
        "w₁S + w₂J⁻¹", "1/w₁",
        "Interpolates between the sandwich (w₂ = 0) and J⁻¹: covariance w₁S + w₂J⁻¹."),
    Row("A", "iterate average", "any", "–", "h = c_h/n, β = ∞", "m epochs",
        "Cov(θ̄) ≈ S/(nm)", "–",
        "The average of SGD iterates over m epochs: n m Cov(θ̄) → S for any Γ (an estimator, "
        "not a sampler; see iterate_average_covariance_limit for finite m)."),
)  # fmt: skip

ROWS = {row.name: row for row in TABLE_1}

_FIXED_STEP = ("P5", "B", "F", "G")  # rows whose constants fix c_h/c_b
_FREE_STEP = ("P1", "P2", "P3", "P4")  # rows that need c_h


class RowTuning(NamedTuple):
    """The kernel settings of one Table 1 row (theory §4) at given ``b`` and ``n``.

    ``preconditioner`` (``Γ``) and ``noise_preconditioner`` (``Λ``; ``None`` when ``β = ∞``)
    are ``(d, d)`` arrays; ``inverse_temperature`` is ``math.inf`` for SGD; ``stochastic``
    is ``True`` when noise is injected (SGLD-type, ``β < ∞``); ``target`` is the row's
    asymptotic ``Q = lim n·Cov`` (:func:`row_target`).
    """

    row: str
    step_size: float
    inverse_temperature: float
    preconditioner: np.ndarray
    noise_preconditioner: Optional[np.ndarray]
    control_variates: bool
    stochastic: bool
    target: np.ndarray


def _row(name) -> Row:
    try:
        return ROWS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown Table 1 row {name!r}; the rows are {', '.join(ROWS)}.") from None


def _weights(name, weight, weights, *, for_tuning=False):
    """Validated ``w`` (row B) or ``(w₁, w₂)`` (row G); ``None`` for the other rows."""
    if weight is not None and name != "B":
        raise ValueError(f"weight is a parameter of row B only, not of row {name}.")
    if weights is not None and name != "G":
        raise ValueError(f"weights are parameters of row G only, not of row {name}.")
    if name == "B":
        w = 1.0 if weight is None else float(weight)
        if not w >= 0 or (for_tuning and w == 0):
            raise ValueError(
                f"Row B needs weight w {'> 0' if for_tuning else '>= 0'} (its step size is "
                f"h = 4wb/n), got {weight!r}."
            )
        return w
    if name == "G":
        if weights is None:
            raise ValueError("Row G needs weights=(w1, w2): its target is w1 S + w2 J^-1.")
        w1, w2 = (float(w) for w in weights)
        if not (w1 >= 0 and w2 >= 0) or w1 == w2 == 0:
            raise ValueError(
                f"Row G needs weights w1, w2 >= 0, not both zero; got {tuple(weights)!r}."
            )
        if for_tuning and w1 == 0:
            raise ValueError(
                "Row G with w1 = 0 has step size h = 4 w1 b/n = 0 and never mixes; for the "
                "target w2 J^-1 use row P4 (control variates) with inverse_temperature n/w2."
            )
        return w1, w2
    return None


def row_target(name: str, J, I, *, weight=None, weights=None) -> np.ndarray:
    """The asymptotic target ``Q = lim n·Cov`` of a Table 1 row (theory §4).

    ``P1``–``P5``: ``J⁻¹``; ``B``: ``w (S + J⁻¹)`` (``weight`` ``w``, default 1);
    ``F``: ``S``; ``G``: ``w₁ S + w₂ J⁻¹`` (``weights=(w₁, w₂)``, required); ``A``: ``S``
    (the limit of ``n m Cov(θ̄)``). ``S = J⁻¹ I J⁻¹``.

    :param J: ``(d, d)`` (or ``(d,)``) curvature per datum.
    :param I: ``(d, d)`` (or ``(d,)``) per-datum gradient covariance.
    :raises ValueError: unknown row; negative weights, or ``w₁ = w₂ = 0``; a weight given to a
        row that has none.
    """
    _row(name)
    w = _weights(name, weight, weights)
    J = _as_matrix(J, None)
    J_inv = _sym(np.linalg.inv(J))
    if name in ("P1", "P2", "P3", "P4", "P5"):
        return J_inv
    S = _sym(J_inv @ _as_matrix(I, J.shape[0]) @ J_inv)
    if name == "B":
        return w * (S + J_inv)
    if name == "G":
        return w[0] * S + w[1] * J_inv
    return S  # F, A


def row_tuning(
    name: str,
    J,
    I,
    *,
    batch_size: int,
    num_data: int,
    c_b: Optional[float] = None,
    c_h: Optional[float] = None,
    weight: Optional[float] = None,
    weights=None,
) -> RowTuning:
    """The step size, temperature and preconditioners of a Table 1 row (theory §4).

    The constants are exact statements about ``h n / b``. Linearised, ``n·Σ`` tends to the
    solution ``Q`` of theory §3's continuous equation, which with ``A = (h/2)ΓJ`` reads

    .. math::

        \\Gamma J\\,Q + Q\\,(\\Gamma J)^\\top
            = \\frac{h n}{2b}\\,\\Gamma I \\Gamma + \\frac{2n}{\\beta}\\Lambda

    (the ``I`` term absent with control variates), and with ``h = c_h n^{-𝔥}``,
    ``b = c_b n^{𝔟}``, ``𝔥 + 𝔟 = 1``, ``hn/b = c_h/c_b``. So this function sets
    ``h = (c_h/c_b) · b/n``; ``c_b`` defaults to ``b`` (a fixed batch size, 𝔟 = 0), giving
    ``h = c_h/n``. Per row (``S = J⁻¹IJ⁻¹``):

    * ``F``: ``Γ = J⁻¹``, ``β = ∞``: ``2Q = (hn/2b) S``, so ``Q = S`` iff ``h = 4b/n``.
    * ``B``: ``Γ = Λ = J⁻¹``, ``β = n/w``: ``Q = (hn/4b) S + w J⁻¹``; ``h = 4wb/n``.
    * ``G``: ``Γ = Λ = J⁻¹``, ``β = n/w₂``: ``Q = (hn/4b) S + w₂ J⁻¹``; ``h = 4w₁b/n``.
    * ``P5``: ``Γ = I⁻¹``, ``β = ∞``: ``I⁻¹J Q + Q J I⁻¹ = (hn/2b) I⁻¹`` is solved by
      ``Q = J⁻¹`` iff ``h = 4b/n``.
    * ``P4``/``P3``: control variates, ``Γ = Λ = J⁻¹`` / ``Γ = Λ = I_d``, ``β = n``:
      ``ΓJQ + QJΓ = 2Γ`` so ``Q = J⁻¹`` for any ``c_h`` (required). The per-datum Hessian
      term adds a relative ``O(h/b)`` (negligible at ``h = c_h/n``).
    * ``P2``/``P1``: no control variates, ``Γ = Λ = J⁻¹`` / ``I_d``, ``β = n``, ``c_h``
      required: ``Q = J⁻¹`` only as ``hn/b = c_h/c_b → 0`` (for P2, ``Q = J⁻¹ + (c_h/4c_b) S``).
    * ``A``: the SGD chain whose iterates are averaged: by default row F's (``Γ = J⁻¹``,
      ``h = 4b/n``); any ``c_h`` may be given (the average targets ``S`` for every ``c_h``).

    :param name: a row of :data:`TABLE_1`: ``P1``–``P5``, ``B``, ``F``, ``G``, ``A``.
    :param J: ``(d, d)`` (or ``(d,)``) curvature per datum at the mode.
    :param I: ``(d, d)`` (or ``(d,)``) per-datum gradient covariance at the mode.
    :param batch_size: ``b``; ``num_data``: ``n``.
    :param c_b: batch-size constant (default ``b``); only ``c_h/c_b`` matters.
    :param c_h: step-size constant; required for P1–P4, optional for A, and not accepted for
        P5, B, F, G (their constants fix it).
    :param weight: ``w`` of row B (default 1, must be > 0).
    :param weights: ``(w₁, w₂)`` of row G (``w₁ > 0``, ``w₂ ≥ 0``).
    :raises ValueError: unknown row, missing or superfluous constants, invalid weights.
    """
    _row(name)
    w = _weights(name, weight, weights, for_tuning=True)
    J = _as_matrix(J, None)
    d = J.shape[0]
    b, n = int(batch_size), int(num_data)
    if b < 1 or n < 1:
        raise ValueError(f"batch_size and num_data must be positive, got {b}, {n}.")
    c_b = float(b) if c_b is None else float(c_b)
    if not c_b > 0:
        raise ValueError(f"c_b must be positive, got {c_b!r}.")
    if name in _FIXED_STEP and c_h is not None:
        raise ValueError(
            f"Row {name} fixes its step-size constant ({ROWS[name].constants}); do not pass c_h."
        )
    if name in _FREE_STEP and c_h is None:
        raise ValueError(f"Row {name} needs c_h (its step size is h = c_h/n).")
    if c_h is not None and not float(c_h) > 0:
        raise ValueError(f"c_h must be positive, got {c_h!r}.")
    # h n / b = c_h / c_b, from each row's constants (docstring)
    if name in ("P5", "F") or (name == "A" and c_h is None):
        ratio = 4.0
    elif name == "B":
        ratio = 4.0 * w
    elif name == "G":
        ratio = 4.0 * w[0]
    else:  # P1-P4, A with c_h
        ratio = float(c_h) / c_b
    step_size = ratio * b / n
    eye = np.eye(d)
    if name in ("P1", "P3"):
        gamma = eye
    elif name == "P5":
        gamma = _sym(np.linalg.inv(_as_matrix(I, d)))
    else:
        gamma = _sym(np.linalg.inv(J))
    if name in ("P1", "P2", "P3", "P4"):
        beta = float(n)
    elif name == "B":
        beta = n / w
    elif name == "G" and w[1] > 0:
        beta = n / w[1]
    else:  # SGD: P5, F, A, G with w2 = 0
        beta = math.inf
    stochastic = not math.isinf(beta)
    return RowTuning(
        row=name,
        step_size=step_size,
        inverse_temperature=beta,
        preconditioner=gamma,
        noise_preconditioner=gamma.copy() if stochastic else None,
        control_variates=name in ("P3", "P4"),
        stochastic=stochastic,
        target=row_target(name, J, I, weight=weight, weights=weights),
    )


def row_mixing(
    name: str,
    J,
    I,
    *,
    batch_size: int,
    num_data: int,
    c_b: Optional[float] = None,
    c_h: Optional[float] = None,
    weight: Optional[float] = None,
    weights=None,
) -> MixingTime:
    """Mixing time of a Table 1 row's chain (theory §3–§4): :func:`mixing_time` at its tuning.

    Exact for the linearised chain: ``4/(h λmin(ΓJ)) - 1`` iterations, i.e. the table's
    epochs minus ``b/n`` (F: ``1 - b/n``; B: ``1/w - b/n``; G: ``1/w₁ - b/n``; P5:
    ``1/λmin(I⁻¹J) - b/n``; P4: ``4c_b/c_h - b/n``; ...). Row A's chain is row F's by default.
    Arguments as :func:`row_tuning`.
    """
    tuning = row_tuning(
        name,
        J,
        I,
        batch_size=batch_size,
        num_data=num_data,
        c_b=c_b,
        c_h=c_h,
        weight=weight,
        weights=weights,
    )
    return mixing_time(
        J,
        step_size=tuning.step_size,
        preconditioner=tuning.preconditioner,
        batch_size=batch_size,
        num_data=num_data,
    )


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _as_matrix(p, d) -> np.ndarray:
    """``None`` → ``I_d``; ``(d,)`` → ``diag``; ``(d, d)`` as is (float64)."""
    if p is None:
        return np.eye(d)
    p = np.asarray(p, np.float64)
    return np.diag(p) if p.ndim == 1 else p


def _sym(x) -> np.ndarray:
    return 0.5 * (x + x.T)


def _spectral_radius(F) -> float:
    return float(np.max(np.abs(np.linalg.eigvals(F))))


def _unit(v) -> np.ndarray:
    """``v/‖v‖`` with its largest-magnitude entry positive."""
    v = np.asarray(v, np.float64)
    v = v / np.linalg.norm(v)
    return -v if v[np.argmax(np.abs(v))] < 0 else v


def _check_recursion(F, Sigma):
    F, Sigma = np.asarray(F, np.float64), np.asarray(Sigma, np.float64)
    radius = _spectral_radius(F)
    if radius >= 1:
        raise ValueError(
            f"The recursion delta' = F delta + noise is not stationary: the spectral radius of F "
            f"is {radius:.4g} >= 1 (for F = I - (h/2) Gamma J this needs "
            "h * lambda_max(Gamma J) < 4)."
        )
    return F, Sigma


# ---------------------------------------------------------------------------------------------
# SGHMC (theory §5)
# ---------------------------------------------------------------------------------------------


def sghmc_recursion(
    J,
    *,
    num_data: int,
    step_size: float,
    mass=None,
    friction=None,
    momentum_decay: float = 0.1,
    gradient_noise=None,
    inverse_temperature: Optional[float] = None,
    I=None,
    batch_size: Optional[int] = None,
    without_replacement: bool = False,
    control_variates: bool = False,
):
    """SGHMC linearised at the mode: ``z' = F z + ε`` for ``z = (θ - θ̂, r)`` (theory §5).

    The kernel (Chen, Fox & Guestrin 2014, "Stochastic gradient Hamiltonian Monte Carlo",
    ICML; ``numpyro_sgmc.kernels.sghmc``) makes, with ``ξ ~ N(0, I_d)``,

    .. math::

        \\begin{aligned}
        r' &= r - \\eta\\,\\nabla\\tilde U(\\theta) - \\eta\\,C M^{-1} r
              + \\sqrt{2\\eta T}\\,(C - \\hat B)^{1/2}\\,\\xi, \\\\
        \\theta' &= \\theta + \\eta\\,M^{-1} r',
        \\end{aligned}

    ``T = n/β`` the temperature (``β = n``: the posterior). Linearised,
    ``∇Ũ(θ) ≈ n J (θ - θ̂) + e`` with ``Cov(e) = n² I/b`` (times ``(n-b)/(n-1)`` without
    replacement; ``e = 0`` with control variates or the full data). With
    ``u = -η e + sqrt(2ηT)(C - B̂)^{1/2} ξ`` and ``K = η C M⁻¹``, substituting ``r'`` into
    ``θ'`` gives

    .. math::

        F = \\begin{pmatrix} I - \\eta^2 n\\,M^{-1}J & \\eta M^{-1}(I - K) \\\\
                             -\\eta n\\,J & I - K \\end{pmatrix},
        \\qquad
        \\mathrm{Cov}(\\varepsilon) = G\\,\\mathrm{Cov}(u)\\,G^\\top,\\quad
        G = \\begin{pmatrix}\\eta M^{-1} \\\\ I\\end{pmatrix},\\quad
        \\mathrm{Cov}(u) = \\frac{\\eta^2 n^2}{b} I + 2\\eta T\\,(C - \\hat B).

    ``ε`` is singular (rank ``d``: the ``θ`` noise is ``η M⁻¹`` times the ``r`` noise) and
    uncorrelated over time (a fresh batch each step). With control variates the per-datum
    Hessian noise term of theory §3 is neglected. For a quadratic log-likelihood the recursion
    is exact at any ``η``.

    :param J: ``(d, d)`` curvature per datum of the potential at the mode, ``∇²U(θ̂)/n``, or
        its ``(d,)`` diagonal.
    :param num_data: ``n``.
    :param step_size: ``η`` (on the potential scale).
    :param mass: ``M`` (SPD): ``None`` = identity, a scalar, a ``(d,)`` diagonal or ``(d, d)``.
    :param friction: ``C`` likewise (scalar, ``(d,)`` or ``(d, d)``); ``None`` for
        ``C = (α/η) M``, so that ``η C M⁻¹ = α I``.
    :param momentum_decay: ``α`` of the default friction, in ``(0, 2)`` (typically ``≤ 1``).
    :param gradient_noise: ``B̂`` (scalar, ``(d,)`` or ``(d, d)``); ``None`` = 0. ``C - B̂``
        must be positive semidefinite. ``B̂ = η n² I/(2bT)`` cancels the minibatch noise in
        ``Cov(u)`` exactly.
    :param inverse_temperature: ``β``; ``None`` for ``n`` (``T = 1``); ``math.inf`` gives
        ``T = 0`` (SGD with momentum).
    :param I: ``(d, d)`` (or ``(d,)``) covariance of the per-datum gradients at ``θ̂``.
        Required for minibatches (``batch_size < num_data``) unless ``control_variates``.
    :param batch_size: ``b``; ``None`` or ``num_data``: the full data (no gradient noise).
    :param without_replacement: ``b`` distinct indices per step (noise factor
        ``(n-b)/(n-1)``) instead of ``b`` independent ones.
    :param control_variates: whether the gradient uses control variates at ``θ̂`` (``e ≈ 0``).
    :return: ``(F, D)``, both ``(2d, 2d)``, ordered ``(θ, r)``.
    :raises ValueError: ``C - B̂`` not positive semidefinite, ``M`` not positive definite,
        ``I`` missing with minibatches, non-positive ``η``, ``n``, ``b`` or ``α``.
    """
    J = _as_matrix(J, None)
    d = J.shape[0]
    n, eta = int(num_data), float(step_size)
    if n < 1:
        raise ValueError(f"num_data must be positive, got {num_data!r}.")
    if not eta > 0:
        raise ValueError(f"step_size must be positive, got {step_size!r}.")
    beta = float(n) if inverse_temperature is None else float(inverse_temperature)
    if not beta > 0:
        raise ValueError(f"inverse_temperature must be positive, got {inverse_temperature!r}.")
    temperature = 0.0 if math.isinf(beta) else n / beta
    M = _as_square(mass, d, "mass")
    if np.min(np.linalg.eigvalsh(_sym(M))) <= 0:
        raise ValueError("mass must be symmetric positive definite.")
    M_inv = np.linalg.inv(M)
    if friction is None:
        alpha = float(momentum_decay)
        if not alpha > 0:
            raise ValueError(
                f"momentum_decay must be positive (the friction is C = (momentum_decay / "
                f"step_size) M), got {momentum_decay!r}."
            )
        C = (alpha / eta) * M
    else:
        C = _as_square(friction, d, "friction")
    B = (
        np.zeros((d, d))
        if gradient_noise is None
        else _as_square(gradient_noise, d, "gradient_noise")
    )
    diffusion = _sym(C - B)
    lowest = float(np.min(np.linalg.eigvalsh(diffusion)))
    if lowest < -1e-12 * max(1.0, float(np.max(np.abs(diffusion)))):
        raise ValueError(
            f"friction - gradient_noise (C - B_hat) must be positive semidefinite: its smallest "
            f"eigenvalue is {lowest:.4g}. The injected noise is sqrt(2 eta T (C - B_hat)) xi, so "
            "lower gradient_noise or raise the friction (momentum_decay)."
        )
    b = n if batch_size is None else int(batch_size)
    if not 1 <= b <= n:
        raise ValueError(f"batch_size must be in [1, num_data={n}], got {batch_size!r}.")
    cov_u = 2.0 * eta * temperature * diffusion
    if b < n and not control_variates:
        if I is None:
            raise ValueError(
                f"With minibatches (batch_size={b} < num_data={n}) and no control variates the "
                "gradient noise has covariance n^2 I / b: pass I, the per-datum gradient "
                "covariance at the mode (or control_variates=True)."
            )
        factor = (n - b) / (n - 1) if without_replacement else 1.0
        cov_u = cov_u + (eta * eta * n * n * factor / b) * _as_matrix(I, d)
    eye = np.eye(d)
    decay = eye - eta * C @ M_inv  # I - K
    F = np.block(
        [
            [eye - eta * eta * n * M_inv @ J, eta * M_inv @ decay],
            [-eta * n * J, decay],
        ]
    )
    G = np.vstack([eta * M_inv, eye])
    return F, _sym(G @ cov_u @ G.T)


class SGHMCPrediction(NamedTuple):
    """Stationary law and mixing of linearised SGHMC (theory §5; :func:`sghmc_prediction`).

    ``covariance``: ``(2d, 2d)`` stationary covariance of ``z = (θ - θ̂, r)``;
    ``position_covariance`` / ``momentum_covariance``: its ``(d, d)`` ``θ`` and ``r`` blocks;
    ``transition`` / ``noise``: ``F`` and ``D = Cov(ε)`` of :func:`sghmc_recursion`;
    ``spectral_radius``: of ``F`` (< 1); ``autocorrelation_times``: ``(d,)`` integrated
    autocorrelation times ``1 + 2Σ_{k≥1}ρ(k)`` of the coordinates ``θ_i``, in iterations
    (may be < 1: SGHMC's autocorrelations can be negative); ``worst_autocorrelation_time``:
    the largest over all linear functionals ``vᵀθ`` of the position, attained at the unit
    vector ``worst_direction``.
    """

    covariance: np.ndarray
    position_covariance: np.ndarray
    momentum_covariance: np.ndarray
    transition: np.ndarray
    noise: np.ndarray
    spectral_radius: float
    autocorrelation_times: np.ndarray
    worst_autocorrelation_time: float
    worst_direction: np.ndarray


def sghmc_prediction(J, **kwargs) -> SGHMCPrediction:
    """Predicted stationary covariance and autocorrelation times of SGHMC (theory §5).

    Builds ``(F, D)`` with :func:`sghmc_recursion` (same keyword arguments) and solves the
    ``2d × 2d`` discrete Lyapunov equation ``Σ = F Σ Fᵀ + D`` (exact for the linear recursion,
    at any step size). As ``η → 0`` at fixed ``C``, ``Σ_θθ → T (nJ)⁻¹`` and ``Σ_rr → T M``
    (the law ``∝ exp(-(U(θ) + rᵀM⁻¹r/2)/T)``; Chen, Fox & Guestrin 2014); at finite ``η``
    the discretisation bias is in ``Σ``.

    The integrated autocorrelation time of ``vᵀθ`` is that of ``(v, 0)ᵀz``:
    ``τ_v = vᵀL_θθv / vᵀΣ_θθv`` with ``L`` the long-run covariance
    ``Σ + F(I-F)⁻¹Σ + Σ(I-F)⁻ᵀFᵀ`` (as :func:`autocorrelation_times`), so the per-coordinate
    times are exact and the worst over functionals of ``θ`` is the largest generalised
    eigenvalue of ``(L_θθ, Σ_θθ)`` (the momentum is not a sampled quantity).

    Stability: with the default friction ``C = (α/η) M`` each eigenmode of ``M⁻¹J``
    (eigenvalue ``λ``) is a 2 × 2 recursion with trace ``2 - α - η²nλ`` and determinant
    ``1 - α``, stable iff ``0 < α < 2`` and ``η² n λ < 2(2 - α)``; so the step size must be
    below ``sqrt(2(2 - α)/(n λmax(M⁻¹J)))``. The spectral radius is then ``sqrt(1 - α)`` for
    the underdamped modes (``(2 - α - η²nλ)² < 4(1 - α)``).

    :raises ValueError: as :func:`sghmc_recursion`; the chain is unstable (spectral radius of
        ``F`` ≥ 1); ``Σ_θθ`` singular (no noise at all).
    """
    F, D = sghmc_recursion(J, **kwargs)
    d = F.shape[0] // 2
    radius = _spectral_radius(F)
    if radius >= 1:
        hint = ""
        if kwargs.get("friction") is None:
            alpha = float(kwargs.get("momentum_decay", 0.1))
            n = int(kwargs["num_data"])
            M_inv_J = np.linalg.solve(_as_square(kwargs.get("mass"), d, "mass"), _as_matrix(J, d))
            lam_max = float(np.max(np.linalg.eigvals(M_inv_J).real))
            if 0 < alpha < 2 and lam_max > 0:
                bound = math.sqrt(2 * (2 - alpha) / (n * lam_max))
                hint = (
                    f" With C = (momentum_decay / step_size) M stability needs "
                    f"step_size^2 n lambda_max(M^-1 J) < 2 (2 - momentum_decay), i.e. "
                    f"step_size < {bound:.4g}."
                )
            else:
                hint = " momentum_decay must be in (0, 2)."
        raise ValueError(
            f"The linearised chain is unstable: the spectral radius of the SGHMC transition F is "
            f"{radius:.4g} >= 1. Reduce step_size (or the friction).{hint}"
        )
    sigma = discrete_lyapunov(F, D)
    L = _long_run_covariance(F, sigma)
    s_pos, l_pos = sigma[:d, :d], L[:d, :d]
    try:
        values, vectors = scipy.linalg.eigh(l_pos, s_pos)
    except np.linalg.LinAlgError as err:
        raise ValueError(
            "The stationary position covariance is singular (no injected or gradient noise): "
            "the autocorrelation times are undefined."
        ) from err
    return SGHMCPrediction(
        covariance=sigma,
        position_covariance=_sym(s_pos),
        momentum_covariance=_sym(sigma[d:, d:]),
        transition=F,
        noise=D,
        spectral_radius=radius,
        autocorrelation_times=autocorrelation_times(
            F, sigma, np.hstack([np.eye(d), np.zeros((d, d))])
        ),
        worst_autocorrelation_time=float(values[-1]),
        worst_direction=_unit(vectors[:, -1]),
    )


def _as_square(p, d, name) -> np.ndarray:
    """``None`` → ``I_d``; scalar → ``p I_d``; ``(d,)`` → ``diag``; ``(d, d)`` as is."""
    if p is None:
        return np.eye(d)
    p = np.asarray(p, np.float64)
    if p.ndim == 0:
        return float(p) * np.eye(d)
    out = np.diag(p) if p.ndim == 1 else p
    if out.shape != (d, d):
        raise ValueError(f"{name} must be a scalar, ({d},) or ({d}, {d}); got shape {p.shape}.")
    return out
