"""One step of the meta-algorithm of ``shared/design/theory.md`` §2, on pytrees.

.. math::

    \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
              + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d)

``h`` is the step size on the average-gradient scale, ``ĝ`` an estimate of ``-∇U/n``
(:mod:`numpyro_sgmc.gradients`), ``β`` the inverse temperature and ``Γ``, ``Λ`` the drift and
noise preconditioners (:mod:`numpyro_sgmc.preconditioners`). ``β = n`` and ``Γ = Λ`` is
preconditioned SGLD for the posterior, the familiar
``θ' = θ - (ε/2) Γ ∇Ũ(θ) + sqrt(ε) Γ^{1/2} ξ`` with ``ε = h/n`` (Welling & Teh 2011);
``β = ∞`` is SGD.
"""

from __future__ import annotations

import jax
from jax import random
from jax.flatten_util import ravel_pytree

from numpyro_sgmc import preconditioners

__all__ = ["langevin_step", "sgd_step"]


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
