"""The functional core of every kernel: ``build_kernel(estimator, integrator, adaptation)``.

A kernel is a pure ``(init, step)`` pair over a typed :class:`SGMCState`, composed from

* a gradient estimator (:mod:`numpyro_sgmc.data.gradients`): ``ĝ``, an unbiased estimate of the
  average gradient ``-∇U/n`` (``docs/theory.md`` §1);
* an integrator (:mod:`numpyro_sgmc.kernels.diffusions`): Langevin (SGLD, SGLD-FP, SGD) or SGHMC;
* optionally an adaptation (:mod:`numpyro_sgmc.kernels.adaptation`): the iterate average or
  AdaSGHMC's mass.

It runs without ``numpyro.infer.MCMC`` (blackjax's pattern)::

    kernel = build_kernel(estimator, integrator, layout)
    state = kernel.init(rng_key, position, params, model_args, model_kwargs)
    state = kernel.step(state, model_args, model_kwargs)     # one iteration

A step whose gradient estimate or proposed position is not finite, or whose position leaves
the support after the constraining transforms (``valid``), is rejected: the chain stays where
it was, ``num_diverging`` counts the rejection and ``divergence_iteration`` keeps the
iteration of the first one. :class:`~numpyro_sgmc.kernels.shell.SGMCKernel` wraps the core
for ``MCMC``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax, random

from numpyro_sgmc.data.model import Layout

__all__ = ["Kernel", "SGMCState", "build_kernel", "draw", "tree_all_finite"]


class SGMCState(NamedTuple):
    """State of one stochastic-gradient chain.

    :param i: iterations so far (warm-up included).
    :param dict z: the position, unconstrained (NumPyro's ``sample_field``).
    :param momentum: the integrator's momentum, flat ``(d,)`` (SGHMC's ``r``); ``()`` for the
        first-order kernels.
    :param params: this chain's parameters (step size, preconditioners or mass, friction):
        :class:`~numpyro_sgmc.kernels.diffusions.LangevinParams` or
        :class:`~numpyro_sgmc.kernels.diffusions.SGHMCParams`.
    :param estimator: the gradient estimator's state (batch sampler; control-variate centre).
    :param adaptation: the adaptation's state, or ``None``.
    :param rng_key: key for the next iteration.
    :param grad_norm: Euclidean norm of the last gradient estimate ``ĝ``.
    :param num_diverging: rejected iterations so far.
    :param diverging: whether an iteration of the last draw was rejected.
    :param divergence_iteration: the iteration (``i`` after it) of the first rejection; -1 if
        none.
    :param interrupted: whether the run was interrupted (Ctrl-C) before this draw, which was
        then skipped (:class:`~numpyro_sgmc.data.progress.RunWatch`).
    :param next_check: the iteration of the next host check for an interrupt in ``MCMC.run``.
    """

    i: Any
    z: dict
    momentum: Any
    params: Any
    estimator: Any
    adaptation: Any
    rng_key: Any
    grad_norm: Any
    num_diverging: Any
    diverging: Any
    divergence_iteration: Any
    interrupted: Any
    next_check: Any


class Kernel(NamedTuple):
    """``init(rng_key, position, params, model_args, model_kwargs, centre=None) -> state``;
    ``step(state, model_args, model_kwargs) -> state``."""

    init: Callable
    step: Callable


def tree_all_finite(tree) -> jax.Array:
    """Whether every entry of a pytree is finite."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def build_kernel(
    estimator,
    integrator,
    layout: Layout,
    adaptation=None,
    valid: Optional[Callable] = None,
) -> Kernel:
    """The pure ``(init, step)`` pair of one chain (module docstring).

    :param estimator: a :class:`~numpyro_sgmc.data.gradients.Estimator`.
    :param integrator: a :class:`~numpyro_sgmc.kernels.diffusions.Integrator`.
    :param layout: the flat order of the parameters.
    :param adaptation: an :class:`~numpyro_sgmc.kernels.adaptation.Adaptation`, or ``None``.
    :param valid: ``valid(position, model_args, model_kwargs) -> bool``, an extra acceptance
        condition (finite constrained values); ``None`` accepts every finite step.
    """

    def init(rng_key, position, params, model_args, model_kwargs, centre=None):
        key, key_estimator, key_momentum = random.split(rng_key, 3)
        centre = position if centre is None else centre
        estimator_state = estimator.init(key_estimator, centre, model_args, model_kwargs)
        flat = layout.ravel(position)
        state = SGMCState(
            i=jnp.zeros((), jnp.int32),
            z=position,
            momentum=integrator.init(key_momentum, flat, params),
            params=params,
            estimator=estimator_state,
            adaptation=None,
            rng_key=key,
            grad_norm=jnp.zeros((), flat.dtype),
            num_diverging=jnp.zeros((), jnp.int32),
            diverging=jnp.array(False),
            divergence_iteration=jnp.array(-1, jnp.int32),
            interrupted=jnp.array(False),
            next_check=jnp.zeros((), jnp.int32),
        )
        return state if adaptation is None else adaptation.init(state)

    def step(state, model_args, model_kwargs):
        key, key_gradient, key_noise = random.split(state.rng_key, 3)
        grad, estimator_state = estimator.estimate(
            state.estimator, state.z, key_gradient, model_args, model_kwargs
        )
        gradient = layout.ravel(grad)
        position = layout.ravel(state.z)
        proposal, momentum = integrator.step(
            key_noise, position, state.momentum, gradient, state.params
        )
        z = layout.unravel(proposal)
        accepted = tree_all_finite((gradient, proposal, momentum))
        if valid is not None:
            accepted = accepted & valid(z, model_args, model_kwargs)
        i = state.i + 1
        keep = lambda new, old: jnp.where(accepted, new, old)  # noqa: E731
        first = jnp.where(
            (state.divergence_iteration < 0) & ~accepted, i, state.divergence_iteration
        )
        state = state._replace(
            i=i,
            z=jax.tree.map(keep, z, state.z),
            momentum=jax.tree.map(keep, momentum, state.momentum),
            estimator=estimator_state,
            rng_key=key,
            grad_norm=jnp.linalg.norm(gradient),
            num_diverging=state.num_diverging + (~accepted).astype(state.num_diverging.dtype),
            divergence_iteration=first,
        )
        return state if adaptation is None else adaptation.update(state, gradient, accepted)

    return Kernel(init, step)


def draw(kernel: Kernel, num_steps: int):
    """``draw(state, model_args, model_kwargs)``: ``num_steps`` iterations in one compiled
    loop, ``diverging`` set when any of them was rejected."""

    def run(state, model_args, model_kwargs):
        start = state.num_diverging
        if num_steps == 1:
            state = kernel.step(state, model_args, model_kwargs)
        else:
            state = lax.fori_loop(
                0, num_steps, lambda _, s: kernel.step(s, model_args, model_kwargs), state
            )
        return state._replace(diverging=state.num_diverging > start)

    return run
