"""SGHMC linearised at the mode: the ``2d × 2d`` recursion and its predictions (§5).

The kernel (:class:`~numpyro_sgmc.SGHMC`; Chen, Fox & Guestrin 2014) makes, with
``η = sqrt(h/n)`` and ``ξ ~ N(0, I_d)``,

.. math::

    r' = r - \\eta\\,\\nabla\\tilde U(\\theta) - \\eta\\,C M^{-1} r
          + \\sqrt{2\\eta T}\\,(C - \\hat B)^{1/2}\\,\\xi, \\qquad
    \\theta' = \\theta + \\eta\\,M^{-1} r'.

Linearised, ``∇Ũ(θ) ≈ n J (θ - θ̂) + e`` with ``Cov(e) = n² I/b`` (``e ≈ 0`` with control
variates), ``z = (θ - θ̂, r)`` is the linear recursion ``z' = F z + ε``; its stationary
covariance is a ``2d × 2d`` discrete Lyapunov solve and its long-run covariance gives the
autocorrelation times (``docs/theory.md`` §5). Dense (``O(d³)``): for the predictions' sizes.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
import scipy.linalg

from numpyro_sgmc.scales import Dense, Diagonal, as_scale, is_sized
from numpyro_sgmc.theory.linear import _unit, autocorrelation_times, long_run_covariance

__all__ = ["SGHMCPrediction", "default_friction", "sghmc_prediction", "sghmc_recursion"]


def default_friction(momentum_decay: float, step_size, num_data: int, mass, d: int):
    """``C = (α/η) M`` with ``η = sqrt(h/n)``: ``η C M⁻¹ = α I``, so every coordinate's
    momentum decays by the same factor ``1 - α`` per step (Springenberg et al. 2016's
    choice). NumPy when ``step_size`` is a Python number (the predictions), JAX otherwise."""
    factor = momentum_decay / (step_size / num_data) ** 0.5
    if not is_sized(mass):  # the identity
        ones = np.ones(d) if isinstance(factor, float) else jnp.ones(d)
        return Diagonal(ones * factor)
    return mass * factor


def _sym(x) -> np.ndarray:
    return 0.5 * (x + x.T)


def _matrix(p, d, name) -> np.ndarray:
    """``None`` → ``I``; scalar → ``p I``; ``(d,)`` → ``diag``; ``(d, d)`` or a scale."""
    m = np.asarray(as_scale(p, d).as_matrix(), np.float64)
    if m.shape != (d, d):
        raise ValueError(f"{name} must be a scalar, ({d},) or ({d}, {d}); got shape {m.shape}.")
    return m


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
    """``(F, D)`` of the linearised SGHMC chain ``z' = F z + ε``, ``z = (θ - θ̂, r)``.

    With ``u = -η e + sqrt(2ηT)(C - B̂)^{1/2} ξ`` and ``K = η C M⁻¹``, substituting ``r'`` into
    ``θ'`` gives

    .. math::

        F = \\begin{pmatrix} I - \\eta^2 n\\,M^{-1}J & \\eta M^{-1}(I - K) \\\\
                             -\\eta n\\,J & I - K \\end{pmatrix},
        \\qquad
        \\mathrm{Cov}(\\varepsilon) = G\\,\\mathrm{Cov}(u)\\,G^\\top,\\quad
        G = \\begin{pmatrix}\\eta M^{-1} \\\\ I\\end{pmatrix},\\quad
        \\mathrm{Cov}(u) = \\frac{\\eta^2 n^2}{b} I + 2\\eta T\\,(C - \\hat B).

    ``ε`` has rank ``d`` and is uncorrelated over time; with control variates the
    per-datum-Hessian noise term is neglected. For a quadratic log-likelihood the recursion is
    exact at any step size.

    :param J: curvature per datum of the potential at the mode (scale or array).
    :param num_data: ``n``.
    :param step_size: ``h`` (``η = sqrt(h/n)``).
    :param mass: ``M`` (SPD): ``None`` = identity, a scalar, ``(d,)``, ``(d, d)`` or a scale.
    :param friction: ``C`` likewise; ``None`` for ``C = (α/η) M``
        (:func:`~default_friction`).
    :param momentum_decay: ``α`` of the default friction, in ``(0, 2)``.
    :param gradient_noise: ``B̂`` likewise; ``None`` = 0. ``C - B̂`` must be PSD.
    :param inverse_temperature: ``β``; ``None`` for ``n`` (``T = 1``); ``math.inf``: ``T = 0``.
    :param I: per-datum gradient covariance at ``θ̂``; required for minibatches
        (``batch_size < num_data``) unless ``control_variates``.
    :param batch_size: ``b``; ``None`` or ``num_data``: the full data.
    :param without_replacement: ``b`` distinct indices per step (noise factor ``(n-b)/(n-1)``).
    :param control_variates: whether the gradient uses control variates at ``θ̂``.
    :return: ``(F, D)``, both ``(2d, 2d)`` NumPy arrays, ordered ``(θ, r)``.
    """
    d = len(as_scale(J)) if not hasattr(J, "as_matrix") else len(J)
    J = _matrix(J, d, "J")
    n, h = int(num_data), float(step_size)
    if n < 1:
        raise ValueError(f"num_data must be positive, got {num_data!r}.")
    if not h > 0:
        raise ValueError(f"step_size must be positive, got {step_size!r}.")
    eta = math.sqrt(h / n)
    beta = float(n) if inverse_temperature is None else float(inverse_temperature)
    if not beta > 0:
        raise ValueError(f"inverse_temperature must be positive, got {inverse_temperature!r}.")
    temperature = 0.0 if math.isinf(beta) else n / beta
    M = _matrix(mass, d, "mass")
    if np.min(np.linalg.eigvalsh(_sym(M))) <= 0:
        raise ValueError("mass must be symmetric positive definite.")
    M_inv = np.linalg.inv(M)
    if friction is None:
        if not float(momentum_decay) > 0:
            raise ValueError(
                f"momentum_decay must be positive (the friction is C = (momentum_decay / eta) "
                f"M), got {momentum_decay!r}."
            )
        C = _matrix(default_friction(float(momentum_decay), h, n, as_scale(M, d), d), d, "C")
    else:
        C = _matrix(friction, d, "friction")
    B = np.zeros((d, d)) if gradient_noise is None else _matrix(gradient_noise, d, "gradient_noise")
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
        cov_u = cov_u + (eta * eta * n * n * factor / b) * _matrix(I, d, "I")
    eye = np.eye(d)
    decay = eye - eta * C @ M_inv  # I - K
    F = np.block([[eye - eta * eta * n * M_inv @ J, eta * M_inv @ decay], [-eta * n * J, decay]])
    G = np.vstack([eta * M_inv, eye])
    return F, _sym(G @ cov_u @ G.T)


class SGHMCPrediction(NamedTuple):
    """Stationary law and mixing of linearised SGHMC (:func:`sghmc_prediction`).

    ``covariance``: ``(2d, 2d)`` stationary covariance of ``z = (θ - θ̂, r)``;
    ``position_covariance`` / ``momentum_covariance``: its ``θ`` and ``r`` blocks;
    ``transition`` / ``noise``: ``F`` and ``D``; ``spectral_radius`` of ``F``;
    ``autocorrelation_times``: ``(d,)`` integrated autocorrelation times of the coordinates
    ``θ_i``, in iterations (may be < 1: SGHMC's autocorrelations can be negative);
    ``worst_autocorrelation_time``: the largest over all functionals ``vᵀθ``, at the unit
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
    """Predicted stationary covariance and autocorrelation times of SGHMC (§5).

    Builds ``(F, D)`` with :func:`sghmc_recursion` (same keyword arguments) and solves
    ``Σ = F Σ Fᵀ + D`` (exact for the linear recursion, at any step size). As ``h → 0`` at
    fixed ``C``, ``Σ_θθ → T (nJ)⁻¹`` and ``Σ_rr → T M``. The autocorrelation time of ``vᵀθ`` is
    that of ``(v, 0)ᵀz``. With the default friction each eigenmode ``λ`` of ``M⁻¹J`` is a
    2 × 2 recursion with trace ``2 - α - hλ`` and determinant ``1 - α``: stable iff
    ``0 < α < 2`` and ``h λ < 2(2 - α)``.

    :raises ValueError: as :func:`sghmc_recursion`; an unstable chain (with the step-size
        bound when the default friction is used); ``Σ_θθ`` singular (no noise at all).
    """
    F, D = sghmc_recursion(J, **kwargs)
    d = F.shape[0] // 2
    radius = float(np.max(np.abs(np.linalg.eigvals(F))))
    if radius >= 1:
        hint = ""
        if kwargs.get("friction") is None:
            alpha = float(kwargs.get("momentum_decay", 0.1))
            M_inv_J = np.linalg.solve(_matrix(kwargs.get("mass"), d, "mass"), _matrix(J, d, "J"))
            lam_max = float(np.max(np.linalg.eigvals(M_inv_J).real))
            if 0 < alpha < 2 and lam_max > 0:
                hint = (
                    f" With C = (momentum_decay / eta) M stability needs step_size * "
                    f"lambda_max(M^-1 J) < 2 (2 - momentum_decay), i.e. step_size < "
                    f"{2 * (2 - alpha) / lam_max:.4g}."
                )
            else:
                hint = " momentum_decay must be in (0, 2)."
        raise ValueError(
            f"The linearised chain is unstable: the spectral radius of the SGHMC transition F is "
            f"{radius:.4g} >= 1. Reduce step_size (or the friction).{hint}"
        )
    sigma = scipy.linalg.solve_discrete_lyapunov(F, D)
    sigma = _sym(sigma)
    L = np.asarray(long_run_covariance(Dense(F), Dense(sigma)).matrix)
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
