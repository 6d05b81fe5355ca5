"""Gradient estimators on the average-gradient scale of ``docs/theory.md`` §1.

An estimator is an ``(init, estimate)`` pair (:class:`Estimator`, as optax's
transformations): ``init(rng_key, centre, model_args, model_kwargs)`` gives its state,
``estimate(state, position, rng_key, model_args, model_kwargs)`` returns ``(ĝ, state)`` with
``ĝ(θ)`` an unbiased estimate of the average gradient ``-∇U(θ)/n`` as a dict over the
unconstrained sites. The batch is a deterministic function of the state and the key, so two
calls with the same state and key see the same batch.

* :func:`minibatch`: ``ĝ(θ) = -∇Ũ(θ)/n``, NumPyro scaling the batch by ``n_p / b_p``,

  .. math::

      \\hat g(\\theta) = \\tfrac{1}{n}\\nabla\\log p_0(\\theta)
                       + \\tfrac{1}{b}\\textstyle\\sum_{i\\in B}\\nabla l(\\theta; X_i);

* :func:`control_variates` wraps any estimator: around a centre ``θ̂``

  .. math::

      \\hat g_{cv}(\\theta) = \\hat g(\\theta) - \\hat g(\\hat\\theta) + \\bar g(\\hat\\theta),

  the same batch in both terms and ``ḡ(θ̂) = -∇U(θ̂)/n`` the full-data gradient, computed once
  at ``init`` (:func:`full_data_gradient`); the prior terms cancel, which gives the formula of
  §1 (Baker, Fearnhead, Fox & Nemeth 2019, "Control variates for stochastic gradient MCMC").

The data-parallel estimator over sharded data is :func:`numpyro_sgmc.data.sharding.minibatch`,
which :func:`control_variates` wraps the same way.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_sgmc.data.batches import batch_sampler
from numpyro_sgmc.data.model import ModelSpec, chunked_batches, potential
from numpyro_sgmc.data.subsample import first_batch

__all__ = [
    "Centre",
    "ControlVariateState",
    "Estimator",
    "batch_gradient",
    "control_variates",
    "full_data_gradient",
    "full_data_sums",
    "minibatch",
    "sampler_state",
]


class Estimator(NamedTuple):
    """``init(rng_key, centre, model_args, model_kwargs) -> state``;
    ``estimate(state, position, rng_key, model_args, model_kwargs) -> (ĝ, state)``.

    ``centre`` is a position, or a :class:`Centre` whose gradient is already known."""

    init: Callable
    estimate: Callable


class Centre(NamedTuple):
    """Control-variate centre.

    :param dict position: ``θ̂``, unconstrained.
    :param dict gradient: ``ḡ(θ̂) = -∇U(θ̂)/n``, the full-data average gradient at ``θ̂``.
    """

    position: dict
    gradient: dict


class ControlVariateState(NamedTuple):
    """State of :func:`control_variates`: the wrapped estimator's state and the centre."""

    inner: Any
    centre: Centre


def batch_gradient(spec: ModelSpec) -> Callable:
    """``gradient(position, batch, model_args, model_kwargs) -> -∇Ũ(position)/n`` on ``batch``."""
    n = spec.num_data
    grad_potential = jax.grad(
        lambda z, batch, args, kwargs: potential(spec, z, batch, args, kwargs)
    )

    def gradient(position, batch, model_args, model_kwargs):
        grad = grad_potential(position, batch, model_args, model_kwargs)
        return jax.tree.map(lambda g: -g / n, grad)

    return gradient


def minibatch(
    spec: ModelSpec, batch_sampling: str = "with_replacement", fed_rows: bool = False
) -> Estimator:
    """The minibatch estimator ``ĝ(θ) = -∇Ũ(θ)/n``, batches drawn by ``batch_sampling``
    (:mod:`~numpyro_sgmc.data.batches`, O(b) per step). Its state is the batch sampler's.

    :param bool fed_rows: the per-row model arguments given to ``estimate`` hold only the
        batch's ``b_p`` rows, in the order the sampler drew their indices
        (:mod:`~numpyro_sgmc.data.streaming` reads them from a file ahead of the steps), and
        the model runs on all of them, each plate still scaled by ``n_p / b_p``. The sampler
        still draws, from the same state and key, so its state (``"epochs"``) advances as in
        memory; its indices are those the rows were read at.
    """
    sampler = batch_sampler(spec.plates, batch_sampling)
    gradient = batch_gradient(spec)

    def init(rng_key, centre, model_args, model_kwargs):
        return sampler.init(rng_key)

    def estimate(state, position, rng_key, model_args, model_kwargs):
        batch, state = sampler.draw(state, rng_key)
        if fed_rows:  # the arguments are the batch's rows: the model runs on all of them
            batch = first_batch(spec.plates)
        return gradient(position, batch, model_args, model_kwargs), state

    return Estimator(init, estimate)


def sampler_state(estimator_state):
    """The batch sampler's state within a kernel's estimator state (:func:`minibatch`, or it
    inside :func:`control_variates`)."""
    if isinstance(estimator_state, ControlVariateState):
        return estimator_state.inner
    return estimator_state


def control_variates(estimator: Estimator, full_gradient: Callable) -> Estimator:
    """``ĝ(θ) - ĝ(θ̂) + ḡ(θ̂)`` around the centre given to ``init`` (module docstring).

    :param estimator: any :class:`Estimator`; both of its evaluations share one batch and run
        as one vectorised pass.
    :param full_gradient: ``full_gradient(position, model_args, model_kwargs) -> -∇U/n``,
        exact (e.g. :func:`full_data_gradient`), evaluated once at ``init`` unless ``init``
        is given a :class:`Centre` (the tuner's, whose pass computed it).
    """

    def init(rng_key, centre, model_args, model_kwargs):
        if not isinstance(centre, Centre):
            centre = Centre(centre, full_gradient(centre, model_args, model_kwargs))
        inner = estimator.init(rng_key, centre.position, model_args, model_kwargs)
        return ControlVariateState(inner, centre)

    def estimate(state, position, rng_key, model_args, model_kwargs):
        both = jax.tree.map(lambda a, b: jnp.stack([a, b]), position, state.centre.position)
        grads, inner = jax.vmap(estimator.estimate, (None, 0, None, None, None), (0, None))(
            state.inner, both, rng_key, model_args, model_kwargs
        )
        g = jax.tree.map(lambda g, g0: g[0] - g[1] + g0, grads, state.centre.gradient)
        return g, state._replace(inner=inner)

    return Estimator(init, estimate)


def full_data_gradient(
    spec: ModelSpec,
    position: dict,
    model_args: tuple,
    model_kwargs: dict,
    chunk_size: int = 65536,
    axis_name: Optional[str] = None,
    rows: Optional[tuple] = None,
) -> dict:
    """The exact full-data average gradient ``-∇U(θ)/n``, in chunks of at most ``chunk_size``.

    Every plate is split into the same number ``C`` of contiguous chunks (the last padded with
    weight-0 rows); chunk ``c`` is evaluated with each datum weighted 1 and the prior weighted
    ``1/C`` (:func:`~numpyro_sgmc.data.model.chunked_batches`), so the chunk gradients sum to the
    full gradient exactly. Memory is O(chunk_size) whatever ``n``.

    :param str axis_name: ``None`` on one device. Otherwise this runs on one shard inside
        :func:`jax.shard_map` over that mesh axis of ``D`` shards
        (:mod:`~numpyro_sgmc.data.sharding`): ``rows`` are the shard's plates (``n_p/D`` rows), its
        chunks weight the prior ``1/(CD)``, and the shards' sums are added with
        :func:`jax.lax.psum`, so every shard returns the gradient over all rows, the prior
        counted once.
    :param tuple rows: the plates to sum over; default ``spec.plates`` (all rows).
    """
    _, total = full_data_sums(spec, position, model_args, model_kwargs, chunk_size, axis_name, rows)
    return jax.tree.map(lambda g: -g / spec.num_data, total)


def full_data_sums(spec, position, model_args, model_kwargs, chunk_size, axis_name=None, rows=None):
    """``(U(θ), ∇U(θ))`` over all rows, chunk by chunk (:func:`full_data_gradient`)."""
    num_shards = 1 if axis_name is None else lax.axis_size(axis_name)
    rows = spec.plates if rows is None else rows
    num_chunks, batch_of = chunked_batches(rows, chunk_size, num_shards)
    value_and_grad = jax.value_and_grad(
        lambda z, batch: potential(spec, z, batch, model_args, model_kwargs)
    )

    def body(acc, c):
        return jax.tree.map(jnp.add, acc, value_and_grad(position, batch_of(c))), None

    if axis_name is None:  # the scan starts from zeros: the model is lowered once
        shapes = jax.eval_shape(value_and_grad, position, batch_of(0))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total, _ = lax.scan(body, zeros, jnp.arange(num_chunks))
        return total
    # on a shard the first chunk starts the sum: its types carry shard_map's varying axes,
    # zeros do not
    total = value_and_grad(position, batch_of(0))
    if num_chunks > 1:
        total, _ = lax.scan(body, total, jnp.arange(1, num_chunks))
    return lax.psum(total, axis_name)
