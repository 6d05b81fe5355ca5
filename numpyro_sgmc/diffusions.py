"""One step of the meta-algorithm (``shared/design/theory.md`` §2) and of SGHMC (§5), on pytrees.

.. math::

    \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
              + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d)

``h`` is the step size on the average-gradient scale, ``ĝ`` an estimate of ``-∇U/n``
(:mod:`numpyro_sgmc.gradients`), ``β`` the inverse temperature and ``Γ``, ``Λ`` the drift and
noise preconditioners (:mod:`numpyro_sgmc.preconditioners`). ``β = n`` and ``Γ = Λ`` is
preconditioned SGLD for the posterior, the familiar
``θ' = θ - (ε/2) Γ ∇Ũ(θ) + sqrt(ε) Γ^{1/2} ξ`` with ``ε = h/n`` (Welling & Teh 2011);
``β = ∞`` is SGD.

:func:`sghmc_step` is the second-order update of §5 (Chen, Fox & Guestrin 2014), with a momentum
``r`` carried from step to step.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import random
from jax.flatten_util import ravel_pytree

from numpyro_sgmc import preconditioners

__all__ = ["langevin_step", "sgd_step", "sghmc_step"]


def sgd_step(position: dict, avg_grad: dict, step_size: float, preconditioner) -> dict:
    """``θ' = θ + (h/2) Γ ĝ(θ)``: the meta-algorithm at ``β = ∞``."""
    drift = preconditioners.apply(preconditioner, avg_grad)
    return jax.tree.map(lambda x, g: x + 0.5 * step_size * g, position, drift)


def langevin_step(
    rng_key,
    position: dict,
    avg_grad: dict,
    step_size: float,
    inverse_temperature,
    preconditioner,
    noise_preconditioner,
) -> dict:
    """``θ' = θ + (h/2) Γ ĝ(θ) + sqrt(h/β) Λ^{1/2} ξ``."""
    flat, unravel = ravel_pytree(position)
    xi = unravel(random.normal(rng_key, flat.shape, flat.dtype))
    noise = preconditioners.apply_sqrt(noise_preconditioner, xi)
    scale = (step_size / inverse_temperature) ** 0.5
    moved = sgd_step(position, avg_grad, step_size, preconditioner)
    return jax.tree.map(lambda x, e: x + scale * e, moved, noise)


def sghmc_step(
    rng_key,
    position: dict,
    momentum: dict,
    avg_grad: dict,
    step_size: float,
    num_data: int,
    temperature,
    mass,
    friction: Optional[dict] = None,
    momentum_decay: float = 0.1,
    gradient_noise: Optional[dict] = None,
) -> tuple[dict, dict]:
    """One SGHMC step (``shared/design/theory.md`` §5):

    .. math::

        r' = r - \\eta\\,\\nabla\\tilde U(\\theta) - \\eta\\, C M^{-1} r
             + \\sqrt{2\\eta T}\\,(C - \\hat B)^{1/2}\\xi, \\qquad
        \\theta' = \\theta + \\eta\\, M^{-1} r',

    with ``∇Ũ(θ) = -n ĝ(θ)`` from the average-gradient estimate ``ĝ`` and ``T`` the temperature
    (1 for the posterior).

    :param position: ``θ``.
    :param momentum: ``r``.
    :param avg_grad: ``ĝ(θ)``, an estimate of ``-∇U/n`` (:mod:`numpyro_sgmc.gradients`).
    :param step_size: ``η``, on the scale of the full potential ``U``.
    :param num_data: ``n``.
    :param temperature: ``T``; ``0`` removes the noise (SGD with heavy-ball momentum).
    :param mass: ``M``: a prepared :class:`~numpyro_sgmc.Identity`,
        :class:`~numpyro_sgmc.Diagonal` or :class:`~numpyro_sgmc.Dense`.
    :param friction: diagonal ``C`` (site -> positive scalar or array); ``None`` for
        ``C = (α/η) M``, which makes ``η C M⁻¹ = α I``: every coordinate's momentum decays by
        the same factor ``1 - α`` per step.
    :param momentum_decay: ``α`` (used when ``friction`` is ``None``).
    :param gradient_noise: diagonal ``B̂`` (site -> non-negative scalar or array) or ``None``
        for 0. Needs a diagonal ``M`` when ``friction`` is ``None``. Where ``C - B̂`` is
        negative the injected noise is zero (the kernel checks it at ``init``).
    :return: ``(θ', r')``.
    """
    flat, unravel = ravel_pytree(position)
    xi = unravel(random.normal(rng_key, flat.shape, flat.dtype))
    if friction is None:
        damping = jax.tree.map(lambda r: momentum_decay * r, momentum)
        if gradient_noise is None:
            # 2ηT(C - 0) = 2Tα M
            scale = (2.0 * temperature * momentum_decay) ** 0.5
            noise = jax.tree.map(lambda e: scale * e, preconditioners.apply_sqrt(mass, xi))
        else:
            m = preconditioners.diagonal(mass, position)
            noise = {
                k: jnp.sqrt(
                    jnp.maximum(
                        2.0 * temperature * (momentum_decay * m[k] - step_size * gradient_noise[k]),
                        0.0,
                    )
                )
                * xi[k]
                for k in xi
            }
    else:
        velocity = preconditioners.apply_inverse(mass, momentum)
        damping = {k: step_size * friction[k] * velocity[k] for k in velocity}
        b = gradient_noise if gradient_noise is not None else dict.fromkeys(xi, 0.0)
        noise = {
            k: jnp.sqrt(jnp.maximum(2.0 * step_size * temperature * (friction[k] - b[k]), 0.0))
            * xi[k]
            for k in xi
        }
    new_momentum = jax.tree.map(
        lambda r, g, c, e: r + step_size * num_data * g - c + e, momentum, avg_grad, damping, noise
    )
    velocity = preconditioners.apply_inverse(mass, new_momentum)
    new_position = jax.tree.map(lambda x, v: x + step_size * v, position, velocity)
    return new_position, new_momentum
