"""One step of each integrator, on the flattened parameters (``docs/theory.md`` §2, §5).

An integrator is an ``(init, step)`` pair (:class:`Integrator`) with one signature for every
kernel: ``init(rng_key, position, params) -> momentum`` and
``step(rng_key, position, momentum, gradient, params) -> (position, momentum)``, where
``position`` and ``gradient`` are flat ``(d,)`` vectors (:class:`~numpyro_sgmc.data.model.Layout`
order), ``gradient`` the estimate ``ĝ`` of the average gradient ``-∇U/n``
(:mod:`numpyro_sgmc.data.gradients`), and ``params`` the per-chain values, which live in the chain
state (step size, preconditioners, mass, friction) so that every chain can have its own.

**One step-size convention.** Every kernel's ``step_size`` is ``h`` on the average-gradient
scale: the dimensionless stability number of every kernel is ``h·λmax(PJ)``, ``P`` its
preconditioner (``Γ``) or inverse mass (``M⁻¹``) and ``J`` the curvature per datum, and Table 1
writes its tunings as ``h = c_h/n``. The learning rate on the scale of the full potential
``U`` (SGLD's ``ε`` in ``θ - (ε/2)∇Ũ``, SGHMC's ``η_lr`` in the momentum form of Chen, Fox &
Guestrin 2014) is ``h/n``; Chen et al.'s SGHMC step ``ε`` is ``η = sqrt(h/n)``.

* :func:`langevin` (SGLD, SGLD-FP, SGD): the meta-algorithm

  .. math::

      \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
                + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d),

  ``β = ∞`` is SGD (no noise). Its momentum is ``()``.
* :func:`sghmc`: stochastic gradient Hamiltonian Monte Carlo (Chen, Fox & Guestrin 2014) with
  ``η = sqrt(h/n)`` and ``∇Ũ = -n ĝ``,

  .. math::

      r' = r - \\eta\\nabla\\tilde U(\\theta) - \\eta\\, C M^{-1} r
           + \\sqrt{2\\eta T}\\,(C - \\hat B)^{1/2}\\xi, \\qquad
      \\theta' = \\theta + \\eta\\, M^{-1} r'.

  From rest the position moves by ``h M⁻¹ ĝ`` (SGLD's drift is ``(h/2)Γĝ``), and with the
  default friction ``C = (α/η) M`` (:func:`~numpyro_sgmc.theory.sghmc.default_friction`:
  every momentum decays by ``α`` per step) it is stable iff ``h·λmax(M⁻¹J) < 2(2 - α)``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
from jax import random

from numpyro_sgmc.scales import factored

__all__ = [
    "Integrator",
    "LangevinParams",
    "SGHMCParams",
    "langevin",
    "sghmc",
    "sghmc_params",
]


class Integrator(NamedTuple):
    """``init(rng_key, position, params) -> momentum``;
    ``step(rng_key, position, momentum, gradient, params) -> (position, momentum)``."""

    init: Callable
    step: Callable


class LangevinParams(NamedTuple):
    """Per-chain values of :func:`langevin`.

    :param step_size: ``h``.
    :param preconditioner: ``Γ``, a prepared scale (:func:`numpyro_sgmc.scales.prepare`).
    :param noise_preconditioner: ``Λ``, a prepared scale.
    """

    step_size: Any
    preconditioner: Any
    noise_preconditioner: Any


def langevin(inverse_temperature: float) -> Integrator:
    """``θ' = θ + (h/2)Γĝ + sqrt(h/β)Λ^{1/2}ξ`` (module docstring); ``β = ∞``: no noise."""
    beta = float(inverse_temperature)

    def init(rng_key, position, params):
        return ()

    def step(rng_key, position, momentum, gradient, params):
        h = params.step_size
        moved = position + 0.5 * h * params.preconditioner.apply(gradient)
        if math.isinf(beta):
            return moved, momentum
        xi = random.normal(rng_key, position.shape, position.dtype)
        return moved + jnp.sqrt(h / beta) * params.noise_preconditioner.apply_sqrt(xi), momentum

    return Integrator(init, step)


class SGHMCParams(NamedTuple):
    """Per-chain values of :func:`sghmc` (build them with :func:`sghmc_params`).

    :param step_size: ``h`` (``η = sqrt(h/n)``).
    :param mass: ``M``, a prepared scale.
    :param friction: ``C``, a prepared scale.
    :param gradient_noise: ``B̂``, a prepared scale, or ``None`` for 0.
    :param diffusion: ``2ηT(C - B̂)``, a prepared scale (its square root scales the noise).
    """

    step_size: Any
    mass: Any
    friction: Any
    gradient_noise: Any
    diffusion: Any


def sghmc_params(step_size, num_data, temperature, mass, friction, gradient_noise, d):
    """:class:`SGHMCParams` from ``h``, ``n``, ``T`` and prepared ``M``, ``C``, ``B̂``
    (``gradient_noise`` ``None`` for 0): the diffusion ``2ηT(C - B̂)`` is formed once."""
    eta = jnp.sqrt(step_size / num_data)
    excess = friction if gradient_noise is None else friction - gradient_noise
    diffusion = factored((2.0 * temperature) * eta * excess)  # factored once, not every step
    return SGHMCParams(step_size, mass, friction, gradient_noise, diffusion)


def sghmc(num_data: int, temperature: float) -> Integrator:
    """SGHMC with the momentum carried in the state (module docstring); ``temperature``
    ``T = n/β`` (1 for the posterior, 0 for heavy-ball SGD)."""
    n, T = int(num_data), float(temperature)

    def init(rng_key, position, params):
        """``r ~ N(0, T M)``."""
        xi = random.normal(rng_key, position.shape, position.dtype)
        return math.sqrt(T) * params.mass.apply_sqrt(xi)

    def step(rng_key, position, momentum, gradient, params):
        eta = jnp.sqrt(params.step_size / n)
        damping = eta * params.friction.apply(params.mass.solve(momentum))
        momentum = momentum + eta * n * gradient - damping
        if T > 0:
            xi = random.normal(rng_key, position.shape, position.dtype)
            momentum = momentum + params.diffusion.apply_sqrt(xi)
        return position + eta * params.mass.solve(momentum), momentum

    return Integrator(init, step)
