"""Stationary covariance of the linearised meta-algorithm (``shared/design/theory.md`` §3).

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
These are plain NumPy functions (float64), usable without a model.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import scipy.linalg

__all__ = ["discrete_lyapunov", "stationary_covariance"]


def discrete_lyapunov(F, D) -> np.ndarray:
    """Solve ``Σ = F Σ Fᵀ + D`` (needs every eigenvalue of ``F`` inside the unit circle)."""
    F, D = np.asarray(F, np.float64), np.asarray(D, np.float64)
    radius = np.max(np.abs(np.linalg.eigvals(F)))
    if radius >= 1:
        raise ValueError(
            f"The linearised chain is unstable: the spectral radius of I - A is {radius:.4g} >= 1. "
            "Reduce the step size (stability needs h * lambda_max(Gamma J) < 4)."
        )
    sigma = scipy.linalg.solve_discrete_lyapunov(F, D)
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
) -> np.ndarray:
    """Predicted stationary covariance ``Σ`` of the chain (discrete Lyapunov, theory §3).

    :param J: ``(d, d)`` curvature per datum of the potential at the mode, ``∇²U(θ̂)/n``
        (the theory's ``J`` plus the prior's curvature over ``n``).
    :param I: ``(d, d)`` covariance of the per-datum gradients ``∇l(θ̂; X_i)`` over the data
        (the minibatch noise is ``I/b`` per step, with replacement). Ignored with control
        variates.
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
    :return: ``(d, d)`` covariance of ``θ`` (not scaled by ``n``).
    """
    J = np.asarray(J, np.float64)
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
    F = np.eye(d) - 0.5 * h * gamma @ J
    D0 = np.zeros((d, d)) if math.isinf(beta) else (h / beta) * lam
    if not control_variates:
        D0 = D0 + noise * gamma @ np.asarray(I, np.float64) @ gamma.T
    if hessians is None:
        if control_variates:
            raise ValueError(
                "With control variates the gradient noise comes only from the per-datum "
                "Hessians: pass hessians=(n, d, d) array."
            )
        return discrete_lyapunov(F, D0)
    H = np.asarray(hessians, np.float64)
    H_bar = H.mean(axis=0)
    GH, GH_bar = gamma @ H, gamma @ H_bar  # (n, d, d), (d, d)

    def hessian_noise(sigma):
        spread = np.einsum("nij,jk,nlk->il", GH, sigma, GH) / H.shape[0]
        return noise * (spread - GH_bar @ sigma @ GH_bar.T)

    sigma = discrete_lyapunov(F, D0)
    for _ in range(max_iter):
        new = discrete_lyapunov(F, D0 + hessian_noise(sigma))
        if np.max(np.abs(new - sigma)) <= tol * np.max(np.abs(new)):
            return new
        sigma = new
    raise RuntimeError(
        "The Hessian noise term did not converge: the chain's gradient noise grows faster than "
        "its drift contracts (reduce the step size or increase the batch size)."
    )


def _as_matrix(p, d) -> np.ndarray:
    if p is None:
        return np.eye(d)
    p = np.asarray(p, np.float64)
    return np.diag(p) if p.ndim == 1 else p
