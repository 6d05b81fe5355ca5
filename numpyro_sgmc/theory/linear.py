"""Predictions of the linearised chain (``docs/theory.md`` §3), on scales.

Near the mode ``θ̂`` one iteration of ``θ' = θ + (h/2)Γĝ(θ) + sqrt(h/β)Λ^{1/2}ξ`` is the
linear recursion ``δ' = F δ + ε`` with

.. math::

    F = I - \\tfrac{h}{2}\\,\\Gamma J, \\qquad
    \\mathrm{Cov}(\\varepsilon) = D(\\Sigma) = \\tfrac{h}{\\beta}\\Lambda
        + \\tfrac{h^2}{4}\\,\\Gamma\\, C_g(\\Sigma)\\,\\Gamma^\\top,

``C_g`` the covariance of the gradient estimate ``ĝ`` in one step (:class:`GradientNoise`:
``I/b`` for minibatches, plus the per-datum-Hessian term ``M(Σ)/b`` that control variates
leave, which depends on ``Σ``). The stationary covariance solves the discrete Lyapunov
equation ``Σ = F Σ Fᵀ + D(Σ)`` (exact for a quadratic log-likelihood at any ``h``); its
scaling limit is the continuous equation ``A Σ + Σ Aᵀ = D`` with ``A = I - F``. Every
argument is a scale (:mod:`numpyro_sgmc.scales`) or an array (``(d,)`` diagonal, ``(d, d)``
dense) and every matrix result a scale, so a diagonal problem stays ``O(d)``.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import numpy as np

from numpyro_sgmc import scales
from numpyro_sgmc.scales import Dense, Diagonal, as_scale

__all__ = [
    "GradientNoise",
    "LinearChain",
    "MixingTime",
    "WorstAutocorrelation",
    "autocorrelation_times",
    "continuous_lyapunov",
    "discrete_lyapunov",
    "gradient_noise",
    "hessian_spread",
    "iterate_average_covariance",
    "iterate_average_covariance_limit",
    "langevin_sd_ratio",
    "linear_chain",
    "mixing_time",
    "stationary",
    "stationary_covariance",
    "worst_autocorrelation_time",
]

METHODS = ("discrete", "continuous")


def discrete_lyapunov(F, D):
    """``Σ`` with ``Σ = F Σ Fᵀ + D`` (``docs/theory.md`` §3, "Stationary covariance,
    discrete"); raises ``ValueError`` if the recursion is unstable."""
    d = _size(F, D)
    return scales.discrete_lyapunov(as_scale(F, d), as_scale(D, d))


def continuous_lyapunov(A, D):
    """``Σ`` with ``A Σ + Σ Aᵀ = D`` (the scaling limit of :func:`discrete_lyapunov` with
    ``F = I - A``: it drops ``A Σ Aᵀ``, a relative ``O(h)``); raises ``ValueError`` unless
    every eigenvalue of ``A`` has a positive real part."""
    d = _size(A, D)
    return scales.continuous_lyapunov(as_scale(A, d), as_scale(D, d))


class GradientNoise(NamedTuple):
    """The covariance of the gradient estimate ``ĝ`` in one step, as a function of ``Σ``:
    ``C_g(Σ) = factor · (constant + spread(Σ))``.

    :param constant: the part that does not depend on ``Σ`` (``I`` for minibatches; ``None``
        with control variates).
    :param spread: ``Σ -> M(Σ)``, the per-datum-Hessian term (:func:`hessian_spread`), or
        ``None``.
    :param float factor: ``1/b`` with replacement, ``(n-b)/((n-1)b)`` without.
    """

    constant: Optional[object]
    spread: Optional[Callable]
    factor: float

    def __call__(self, sigma):
        parts = [p for p in (self.constant, None if self.spread is None else self.spread(sigma))]
        parts = [p for p in parts if p is not None]
        if not parts:
            return sigma * 0.0
        total = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        return total * self.factor


def gradient_noise(
    I=None,
    *,
    batch_size: int,
    num_data: Optional[int] = None,
    hessians=None,
    control_variates: bool = False,
    batch_sampling: str = "with_replacement",
) -> GradientNoise:
    """The :class:`GradientNoise` of a minibatch (``I/b``) or control-variate estimate.

    :param I: ``(d, d)`` or ``(d,)`` covariance of the per-datum gradients at ``θ̂``
        (ignored with control variates).
    :param batch_size: ``b``.
    :param num_data: ``n`` (for ``batch_sampling="without_replacement"``).
    :param hessians: optional ``(m, d, d)`` per-datum Hessians ``∇²l(θ̂; X_i)`` for the term
        ``M(Σ)`` (needed with control variates, a relative ``O(1/n)`` correction otherwise), or
        a callable ``Σ -> M(Σ)``.
    :param batch_sampling: ``"with_replacement"`` or ``"without_replacement"``.
    """
    b = int(batch_size)
    if batch_sampling == "with_replacement":
        factor = 1.0 / b
    elif batch_sampling == "without_replacement":
        n = int(num_data)
        factor = (n - b) / ((n - 1) * b)
    else:
        raise ValueError(
            f"batch_sampling must be 'with_replacement' or 'without_replacement', got "
            f"{batch_sampling!r} (epochs have no i.i.d.-noise prediction)."
        )
    spread = hessians if hessians is None or callable(hessians) else hessian_spread(hessians)
    if control_variates:
        if spread is None:
            raise ValueError(
                "With control variates the gradient noise comes only from the per-datum "
                "Hessians: pass hessians=(n, d, d) array."
            )
        return GradientNoise(None, spread, factor)
    return GradientNoise(None if I is None else as_scale(I), spread, factor)


def hessian_spread(hessians) -> Callable:
    """``Σ -> M(Σ) = (1/m)Σ_i H_i Σ H_i - H̄ Σ H̄`` from ``(m, d, d)`` per-datum Hessians
    (``docs/theory.md`` §3's control-variate term), dense."""
    H = np.asarray(hessians, np.float64)
    H_bar = H.mean(axis=0)

    def spread(sigma):
        S = np.asarray(sigma.as_matrix(), np.float64)
        total = (H @ S @ H.transpose(0, 2, 1)).mean(axis=0) - H_bar @ S @ H_bar.T  # O(m d³)
        return Dense(0.5 * (total + total.T))

    return spread


class LinearChain(NamedTuple):
    """The linearised chain ``δ' = F δ + ε``, ``Cov(ε) = injected + G C_g(Σ) Gᵀ``.

    :param drift: ``F = I - (h/2)ΓJ``.
    :param injected: ``(h/β)Λ`` (zero for SGD).
    :param gain: ``G = (h/2)Γ``.
    :param noise: the :class:`GradientNoise` ``C_g``.
    """

    drift: object
    injected: object
    gain: object
    noise: GradientNoise

    def noise_covariance(self, sigma):
        """``D(Σ)``."""
        G = self.gain
        return self.injected + G @ self.noise(sigma) @ G.T


def linear_chain(
    J,
    *,
    step_size: float,
    noise: GradientNoise,
    inverse_temperature: float,
    preconditioner=None,
    noise_preconditioner=None,
) -> LinearChain:
    """The :class:`LinearChain` of a tuning (``Λ = Γ`` unless ``noise_preconditioner``)."""
    d = _size(J, preconditioner, noise_preconditioner)
    J = as_scale(J, d)
    h, beta = float(step_size), float(inverse_temperature)
    gamma = as_scale(preconditioner, d)
    lam = gamma if noise_preconditioner is None else as_scale(noise_preconditioner, d)
    injected = lam * 0.0 if math.isinf(beta) else lam * (h / beta)
    drift = _eye(d) - (gamma @ J) * (0.5 * h)
    return LinearChain(drift, injected, gamma * (0.5 * h), noise)


def stationary(chain: LinearChain, method: str = "discrete", tol=1e-12, max_iter=1000):
    """The stationary covariance of ``chain``: ``Σ = FΣFᵀ + D(Σ)`` (or, ``"continuous"``,
    ``AΣ + ΣAᵀ = D(Σ)``); a ``Σ``-dependent gradient noise is solved by fixed-point
    iteration."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if method == "discrete":
        solve = scales.discrete_lyapunov
        M = chain.drift
    else:
        solve = scales.continuous_lyapunov
        M = _eye(len(chain.drift)) - chain.drift
    sigma = solve(M, chain.noise_covariance(chain.injected * 0.0))
    if chain.noise.spread is None:
        return sigma
    for _ in range(max_iter):
        new = solve(M, chain.noise_covariance(sigma))
        if scales.max_abs(new - sigma) <= tol * scales.max_abs(new):
            return new
        sigma = new
    raise RuntimeError(
        "The Hessian noise term did not converge: the chain's gradient noise grows faster than "
        "its drift contracts (reduce the step size or increase the batch size)."
    )


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
    method: str = "discrete",
):
    """Predicted stationary covariance ``Σ`` of a tuning (``docs/theory.md`` §3).

    ``D = (h/β)Λ + (h²/(4b))Γ[I + M(Σ)]Γ`` (the ``I`` term absent with control variates,
    ``M(Σ)`` only when ``hessians`` are given). ``method="discrete"`` solves
    ``Σ = (I - A)Σ(I - A)ᵀ + D`` (exact for a quadratic log-likelihood, at any ``h``),
    ``"continuous"`` solves ``AΣ + ΣAᵀ = D`` (relative error ``O(h)``; for ``Γ = J⁻¹`` and no
    Hessian term exactly ``Σ_discrete = Σ_continuous / (1 - h/4)``).

    :param J: curvature per datum of the potential at the mode, ``∇²U(θ̂)/n`` (scale or array).
    :param I: covariance of the per-datum gradients at the mode (ignored with control
        variates).
    :param step_size: ``h``; ``batch_size``: ``b``; ``num_data``: ``n``.
    :param inverse_temperature: ``β``; ``None`` for ``n``; ``math.inf`` for SGD.
    :param preconditioner: ``Γ``; ``None`` = identity.
    :param noise_preconditioner: ``Λ``; ``None`` for ``Λ = Γ``.
    :param hessians: ``(m, d, d)`` per-datum Hessians, or ``Σ -> M(Σ)``
        (:func:`gradient_noise`).
    :param control_variates: whether the chain uses the control-variate gradient.
    :param batch_sampling: ``"with_replacement"`` (noise ``I/b``) or
        ``"without_replacement"`` (``(n-b)/(n-1) · I/b``).
    :param method: ``"discrete"`` (default, the predictor) or ``"continuous"`` (the limit).
    :return: the covariance of ``θ`` (not scaled by ``n``), a scale.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    d = _size(J, I, preconditioner)
    noise = gradient_noise(
        None if I is None or control_variates else as_scale(I, d),
        batch_size=batch_size,
        num_data=num_data,
        hessians=hessians,
        control_variates=control_variates,
        batch_sampling=batch_sampling,
    )
    chain = linear_chain(
        J,
        step_size=step_size,
        noise=noise,
        inverse_temperature=float(num_data if inverse_temperature is None else inverse_temperature),
        preconditioner=as_scale(preconditioner, d),
        noise_preconditioner=noise_preconditioner,
    )
    return stationary(chain, method)


def langevin_sd_ratio(step_size: float, lam: float, noise: float, batch_size: int, beta: float):
    """``σ/σ*``: the stationary sd of the first-order chain along an eigenvector ``v`` of
    ``ΓJ`` (eigenvalue ``λ``) over its target's, ``1/sqrt(βλ)`` (``docs/theory.md`` §3).

    Whitened by ``Γ``, the chain along ``v`` is ``δ' = (1 - hλ/2)δ + (h/2)e + sqrt(h/β)ξ``
    with ``Var(e) = i/b``, ``i = vᵀΓ^{1/2} I Γ^{1/2}v`` the per-datum gradient variance along
    ``v`` (``noise``; 0 with control variates). Its stationary variance is
    ``(h i/(4b) + 1/β) / (λ(1 - hλ/4))``, so

    .. math::

        \\frac{\\sigma}{\\sigma_*} = \\sqrt{\\frac{1 + h\\beta i/(4b)}{1 - h\\lambda/4}},

    exact for a quadratic log-likelihood at any stable ``h`` (``hλ < 4``; ``inf`` past it)
    when ``v`` is also an eigenvector of ``Γ^{1/2}IΓ^{1/2}`` (``I ∝ J``, as for a well-specified
    model near its mode); otherwise :func:`stationary_covariance` is exact and this leaves out
    the noise that ``e`` shares with the other directions. The variance ratio is its square: a
    law whose variance is 4 times the target's is 100% wider, not 300%.
    """
    h, lam = float(step_size), float(lam)
    if h * lam >= 4:
        return math.inf
    noise_term = h * float(beta) * float(noise) / (4 * int(batch_size))
    return math.sqrt((1 + noise_term) / (1 - h * lam / 4))


class MixingTime(NamedTuple):
    """Mixing time of the linearised chain (``docs/theory.md`` §3, "Mixing time").

    ``iterations``: integrated autocorrelation time ``4/(h λmin(ΓJ)) - 1`` of the slowest
    linear functional; ``epochs``: ``iterations · b/n`` (``None`` without ``b`` and ``n``);
    ``slowest_direction``: unit ``v`` with ``vᵀ(ΓJ) = λmin vᵀ``.
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
    """Mixing time ``τ = 4/(h λmin(ΓJ)) - 1`` iterations (``docs/theory.md`` §3).

    For a left eigenvector ``v`` of ``ΓJ`` with eigenvalue ``λ``, ``vᵀF = (1 - hλ/2) vᵀ``, so
    ``vᵀδ`` is an AR(1) with coefficient ``μ = 1 - hλ/2`` whatever the noise, and its
    integrated autocorrelation time is ``(1 + μ)/(1 - μ) = 4/(hλ) - 1``, largest at
    ``λ = λmin``. In epochs: ``τ · b/n``. This is the slowest *eigen*-functional; the worst
    case over all functionals can be larger for non-reversible tunings
    (:func:`worst_autocorrelation_time`).

    :raises ValueError: ``h λmax(ΓJ) ≥ 4`` (the recursion diverges) or ``λmin(ΓJ) ≤ 0``.
    """
    d = _size(J, preconditioner)
    h = float(step_size)
    if not h > 0:
        raise ValueError(f"step_size must be positive, got {step_size!r}.")
    GJ = as_scale(preconditioner, d) @ as_scale(J, d)
    if not scales.is_dense(GJ):
        real = np.asarray(GJ.values, np.float64)
        vectors = np.eye(d)
    else:
        values, vectors = np.linalg.eig(np.asarray(GJ.matrix, np.float64).T)  # left of ΓJ
        real = values.real
    lam_min, lam_max = float(np.min(real)), float(np.max(real))
    if lam_min <= 0:
        raise ValueError(
            f"Gamma J has an eigenvalue with non-positive real part ({lam_min:.4g}): the chain "
            "does not contract along it (Gamma and J must be positive definite)."
        )
    radius = scales.spectral_radius(_eye(d) - GJ * (0.5 * h))
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
    return MixingTime(iterations, epochs, _unit(np.real(vectors[:, int(np.argmin(real))])))


def long_run_covariance(F, sigma):
    """``Σ + F(I-F)⁻¹Σ + Σ(I-F)⁻ᵀFᵀ = Σ_{k∈ℤ} Cov(δ_0, δ_k)`` (symmetric)."""
    d = len(F)
    G = F @ (_eye(d) - F).inverse() @ sigma
    total = sigma + G + G.T
    return scales.symmetrized(total)


def autocorrelation_times(F, sigma, directions=None):
    """Exact integrated autocorrelation times of linear functionals (``docs/theory.md`` §3).

    For the stationary recursion ``δ' = F δ + ε`` with stationary covariance ``Σ``, the lag-``k``
    autocovariance of ``vᵀδ`` is ``vᵀ F^k Σ v``, so

    .. math::

        \\tau_v = 1 + 2\\sum_{k\\ge1}\\rho_v(k)
        = \\frac{v^\\top[\\Sigma + F(I-F)^{-1}\\Sigma + \\Sigma(I-F)^{-\\top}F^\\top]v}
               {v^\\top\\Sigma v}.

    :param F: transition matrix, spectral radius < 1.
    :param sigma: its stationary covariance.
    :param directions: ``None`` for the coordinate axes (``(d,)`` per-parameter times), a
        ``(d,)`` vector (a float) or ``(k, d)`` vectors (``(k,)``).
    """
    F, sigma = _check_recursion(F, sigma)
    M = long_run_covariance(F, sigma)
    if directions is None:
        return np.asarray(M.diagonal(), np.float64) / np.asarray(sigma.diagonal(), np.float64)
    V = np.asarray(directions, np.float64)
    Mm, Sm = np.asarray(M.as_matrix()), np.asarray(sigma.as_matrix())
    if V.ndim == 1:
        return float(V @ Mm @ V / (V @ Sm @ V))
    return np.einsum("ki,ij,kj->k", V, Mm, V) / np.einsum("ki,ij,kj->k", V, Sm, V)


class WorstAutocorrelation(NamedTuple):
    """Largest integrated autocorrelation time over all linear functionals, and its ``v``."""

    time: float
    direction: np.ndarray


def worst_autocorrelation_time(F, sigma) -> WorstAutocorrelation:
    """``max_v τ_v`` over all linear functionals ``vᵀδ`` (``docs/theory.md`` §3).

    The largest generalised eigenvalue of (long-run covariance, ``Σ``), i.e.
    ``λmax(Σ⁻¹ (I-F)⁻¹ D (I-F)⁻ᵀ)``. It equals :func:`mixing_time` for reversible chains and
    can be larger otherwise. Needs ``Σ`` positive definite.
    """
    F, sigma = _check_recursion(F, sigma)
    M = long_run_covariance(F, sigma)
    try:
        values, vectors = scales.generalized_eigh(M, sigma)
    except np.linalg.LinAlgError as err:
        raise ValueError("Sigma must be positive definite for the worst-case IAT.") from err
    return WorstAutocorrelation(float(values[-1]), _unit(vectors[:, -1]))


def iterate_average_covariance(F, sigma, num_iterations: int):
    """Exact covariance of the mean of ``T`` consecutive stationary iterates (§3).

    .. math::

        \\mathrm{Cov}(\\bar\\delta) = \\tfrac{1}{T}\\Big[\\Sigma + G\\Sigma + \\Sigma G^\\top\\Big],
        \\quad G = \\sum_{k=1}^{T-1}\\big(1-\\tfrac{k}{T}\\big)F^k
          = F(I-F)^{-1} - \\tfrac{1}{T}F(I-F^T)(I-F)^{-2}.

    As ``T → ∞``, ``T·Cov(δ̄)`` tends to the long-run covariance ``(I-F)⁻¹D(I-F)⁻ᵀ``.
    """
    F, sigma = _check_recursion(F, sigma)
    T = int(num_iterations)
    if T < 1 or T != num_iterations:
        raise ValueError(f"num_iterations must be a positive integer, got {num_iterations!r}.")
    eye = _eye(len(F))
    R = (eye - F).inverse()
    G = F @ R - (F @ (eye - scales.matrix_power(F, T)) @ R @ R) * (1.0 / T)
    cov = (sigma + G @ sigma + sigma @ G.T) * (1.0 / T)
    return scales.symmetrized(cov)


def iterate_average_covariance_limit(
    J, Q, S, *, c_h: float, c_b: float, num_epochs: float, preconditioner=None
):
    """``n m Cov(θ̄)`` for SGD iterates averaged over ``m`` epochs (§3, "Iterate averaging").

    .. math::

        n m\\,\\mathrm{Cov}(\\bar\\theta) = S - \\frac{4c_b^2}{c_h^2 m}\\Big[(\\Gamma J)^{-2}
            \\big(I - e^{-\\frac{c_h m}{2c_b}\\Gamma J}\\big) Q + \\text{transpose}\\Big],

    ``Q = nΣ``, ``S = J⁻¹IJ⁻¹``. For row F (``Γ = J⁻¹``, ``c_h = 4c_b``, ``Q = S``) it is
    ``S[1 - (1 - e^{-2m})/(2m)]``: ``0.568 S`` at ``m = 1``, ``0.938 S`` at ``m = 8``.
    """
    d = _size(J, Q, S)
    c_h, c_b, m = float(c_h), float(c_b), float(num_epochs)
    for name, value in (("c_h", c_h), ("c_b", c_b), ("num_epochs", m)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}.")
    GJ = as_scale(preconditioner, d) @ as_scale(J, d)
    GJ_inv = GJ.inverse()
    decay = _eye(d) - scales.expm(GJ * (-(c_h * m / (2 * c_b))))
    term = GJ_inv @ GJ_inv @ decay @ as_scale(Q, d)
    out = as_scale(S, d) - (term + term.T) * (4 * c_b**2 / (c_h**2 * m))
    return scales.symmetrized(out)


# ---- helpers --------------------------------------------------------------------------------


def _size(*xs) -> int:
    for x in xs:
        d = scales.size_of(x)
        if d is not None:
            return d
    raise ValueError("Cannot tell the dimension d: give J as a (d,) or (d, d) array or a scale.")


def _eye(d: int) -> Diagonal:
    return Diagonal(np.ones(int(d)))


def _unit(v) -> np.ndarray:
    """``v/‖v‖`` with its largest-magnitude entry positive."""
    v = np.asarray(v, np.float64)
    v = v / np.linalg.norm(v)
    return -v if v[np.argmax(np.abs(v))] < 0 else v


def _check_recursion(F, sigma):
    d = _size(F, sigma)
    F, sigma = as_scale(F, d), as_scale(sigma, d)
    radius = scales.spectral_radius(F)
    if radius >= 1:
        raise ValueError(
            f"The recursion delta' = F delta + noise is not stationary: the spectral radius of F "
            f"is {radius:.4g} >= 1 (for F = I - (h/2) Gamma J this needs "
            "h * lambda_max(Gamma J) < 4)."
        )
    return F, sigma
