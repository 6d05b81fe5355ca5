"""Adaptations: ``(init, update)`` pairs that run alongside a kernel's step.

``init(state) -> state`` sets the chain state's ``adaptation`` field (and may change its
per-chain parameters); ``update(state, gradient, accepted) -> state`` runs after every
iteration, with the flat gradient estimate ``ĝ`` of that iteration and whether the step was
accepted (finite). Two are used by the kernels:

* :func:`iterate_average` (SGD): the running mean of the iterates after warm-up, whose
  covariance after ``m`` epochs approaches ``S/(nm)`` (``docs/theory.md`` §3, Table 1 row A);
* :func:`mass_adaptation` (AdaSGHMC; Springenberg, Klein, Falkner & Hutter 2016): during
  warm-up, a diagonal mass from an exponential moving average of the squared gradient of the
  potential, then frozen.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp

from numpyro_sgmc.scales import Diagonal

__all__ = ["Adaptation", "IterateAverage", "MassAdaptation", "iterate_average", "mass_adaptation"]


class Adaptation(NamedTuple):
    """``init(state) -> state``; ``update(state, gradient, accepted) -> state``."""

    init: Callable
    update: Callable


class IterateAverage(NamedTuple):
    """:param dict average: mean of the iterates after warm-up (restarts when warm-up ends)."""

    average: dict


def iterate_average(num_warmup_steps: int) -> Adaptation:
    """The running mean ``θ̄`` of the iterates after the first ``num_warmup_steps``."""

    def init(state):
        return state._replace(adaptation=IterateAverage(state.z))

    def update(state, gradient, accepted):
        count = jnp.maximum(state.i - num_warmup_steps, 1)  # i counts the step just taken
        average = {k: a + (state.z[k] - a) / count for k, a in state.adaptation.average.items()}
        return state._replace(adaptation=IterateAverage(average))

    return Adaptation(init, update)


class MassAdaptation(NamedTuple):
    """AdaSGHMC's running statistics.

    :param square_gradient: ``(d,)`` exponential moving average of ``(∇Ũ)²``.
    :param count: number of averaged gradients (for the bias correction).
    """

    square_gradient: jnp.ndarray
    count: jnp.ndarray


def mass_adaptation(
    window: float, num_warmup_steps: int, num_data: int, rebuild: Callable
) -> Adaptation:
    """AdaSGHMC's diagonal mass (Springenberg et al. 2016), adapted during warm-up.

    .. math::

        \\hat v \\leftarrow (1 - \\kappa)\\,\\hat v + \\kappa\\,(\\nabla\\tilde U)^2,
        \\qquad \\kappa = 1/\\text{window},
        \\qquad M = \\mathrm{diag}(\\hat v^{1/2}) / \\min_i \\hat v_i^{1/2},

    with Adam's bias correction of ``v̂``. Dividing by the smallest entry (the normalisation
    of ``docs/theory.md`` §6) keeps every effective step at most the identity mass's, so
    ``step_size`` means the same as for SGHMC with a §6 mass. When ``M`` changes the momentum
    is rescaled with it, ``r ← (M_new/M_old)^{1/2} r``, which keeps its law ``N(0, T M)``.

    :param rebuild: ``rebuild(params, mass) -> params``, the SGHMC parameters for a new mass
        (the default friction ``C = (α/η) M`` follows the mass).
    """
    kappa = 1.0 / float(window)

    def init(state):
        d = state.momentum.shape[-1]
        mass = Diagonal(jnp.broadcast_to(jnp.asarray(state.params.mass.diagonal(d)), (d,)))
        stats = MassAdaptation(jnp.zeros(d, state.momentum.dtype), jnp.zeros((), jnp.int32))
        return state._replace(params=rebuild(state.params, mass), adaptation=stats)

    def update(state, gradient, accepted):
        adapting = accepted & (state.i <= num_warmup_steps)
        stats = state.adaptation
        square = jnp.where(
            adapting,
            (1 - kappa) * stats.square_gradient + kappa * (num_data * gradient) ** 2,
            stats.square_gradient,
        )
        count = stats.count + adapting.astype(stats.count.dtype)
        correction = 1.0 - (1.0 - kappa) ** jnp.maximum(count, 1)
        root = jnp.sqrt(jnp.maximum(square / correction, jnp.finfo(square.dtype).tiny))
        old = state.params.mass.values
        new = jnp.where(adapting, root / jnp.min(root), old)
        return state._replace(
            params=rebuild(state.params, Diagonal(new)),
            momentum=state.momentum * jnp.sqrt(new / old),
            adaptation=MassAdaptation(square, count),
        )

    return Adaptation(init, update)
