"""Gradient estimators on the average-gradient scale of ``shared/design/theory.md`` §1.

Every estimator returns ``ĝ(θ)``, an unbiased estimate of the average gradient
``-∇U(θ)/n`` (``U`` the full potential, ``n`` the number of data), as a pytree over the
unconstrained sites. ``potential_fn(position, batch, model_args, model_kwargs)`` is the
model's potential on a :class:`~numpyro_sgmc.subsample.Batch`, which NumPyro scales by
``n_p / b_p`` per plate, so ``-∇potential / n`` is the minibatch estimate

.. math::

    \\hat g(\\theta) = \\tfrac{1}{n}\\nabla\\log p_0(\\theta)
                     + \\tfrac{1}{b}\\textstyle\\sum_{i\\in B}\\nabla l(\\theta; X_i),

and the control-variate ("SGLD-FP", fixed-point) estimate around a centre ``θ̂`` is

.. math::

    \\hat g_{cv}(\\theta) = \\hat g(\\theta) - \\hat g(\\hat\\theta) + \\bar g(\\hat\\theta),

the same batch ``B`` in both minibatch terms and ``ḡ(θ̂) = -∇U(θ̂)/n`` the full-data average
gradient, computed once by :func:`full_data_gradient`. (The prior terms of the first two
cancel, which gives the formula of §1.) Reference: Baker, Fearnhead, Fox, Nemeth (2019),
"Control variates for stochastic gradient MCMC".
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_sgmc.subsample import Batch, num_data

__all__ = ["Centre", "control_variate_gradient", "full_data_gradient", "minibatch_gradient"]


class Centre(NamedTuple):
    """Control-variate centre.

    :param dict position: ``θ̂``, unconstrained.
    :param dict gradient: ``ḡ(θ̂) = -∇U(θ̂)/n``, the full-data average gradient at ``θ̂``.
    """

    position: dict
    gradient: dict


def minibatch_gradient(potential_fn: Callable, n: int) -> Callable:
    """The plain minibatch estimator ``ĝ(θ) = -∇Ũ(θ)/n``.

    :return: ``estimate(position, batch, model_args, model_kwargs, centre) -> ĝ``
        (``centre`` is ignored).
    """
    grad_potential = jax.grad(potential_fn)

    def estimate(position, batch, model_args, model_kwargs, centre=None):
        grad = grad_potential(position, batch, model_args, model_kwargs)
        return jax.tree.map(lambda g: -g / n, grad)

    return estimate


def control_variate_gradient(potential_fn: Callable, n: int) -> Callable:
    """The control-variate estimator ``ĝ(θ) - ĝ(θ̂) + ḡ(θ̂)`` around ``centre``.

    Both minibatch gradients share the batch and are computed in one vectorised pass.

    :return: ``estimate(position, batch, model_args, model_kwargs, centre) -> ĝ_cv``.
    """
    grad_potential = jax.grad(potential_fn)
    both_grads = jax.vmap(grad_potential, in_axes=(0, None, None, None))

    def estimate(position, batch, model_args, model_kwargs, centre: Centre):
        stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), position, centre.position)
        grads = both_grads(stacked, batch, model_args, model_kwargs)
        return jax.tree.map(lambda g, g0: (g[1] - g[0]) / n + g0, grads, centre.gradient)

    return estimate


def full_data_gradient(
    potential_fn: Callable,
    plates: dict,
    position: dict,
    model_args: tuple,
    model_kwargs: dict,
    chunk_size: int = 65536,
    axis_name: Optional[str] = None,
) -> dict:
    """The exact full-data average gradient ``-∇U(θ)/n``, in chunks of at most ``chunk_size``.

    Every plate is split into the same number ``C`` of contiguous chunks (the last one padded
    with weight-0 indices); chunk ``c`` is evaluated with each datum weighted 1 and the prior
    weighted ``1/C`` (:class:`~numpyro_sgmc.subsample.weight_data`), so the chunk gradients
    sum to the full gradient exactly. Memory is O(chunk_size) whatever ``n``.

    :param str axis_name: ``None`` on one device. Otherwise this runs on one shard inside
        :func:`jax.shard_map` over that mesh axis of ``D`` shards (:mod:`~numpyro_sgmc.sharding`):
        ``plates`` are the shard's (``n_p/D`` rows each), its chunks weight the prior
        ``1/(CD)``, and the shards' sums are added with :func:`jax.lax.psum`, so every shard
        returns the full-data gradient over all ``n = D·Σ_p n_p/D`` rows, the prior counted
        once.
    """
    num_shards = 1 if axis_name is None else lax.axis_size(axis_name)
    n = num_data(plates) * num_shards
    num_chunks = max(math.ceil(p.size / chunk_size) for p in plates.values())
    lengths = {name: math.ceil(p.size / num_chunks) for name, p in plates.items()}
    grad_potential = jax.grad(potential_fn)

    def chunk_gradient(c):
        indices, weights = {}, {}
        for name, p in plates.items():
            idx = c * lengths[name] + jnp.arange(lengths[name])
            valid = idx < p.size
            indices[name] = jnp.where(valid, idx, 0)
            weights[name] = valid.astype(jnp.result_type(float))
        batch = Batch(indices, weights, 1.0 / (num_chunks * num_shards))
        return grad_potential(position, batch, model_args, model_kwargs)

    if num_chunks == 1:
        total = chunk_gradient(0)
    else:

        def body(acc, c):
            return jax.tree.map(jnp.add, acc, chunk_gradient(c)), None

        zeros = jax.tree.map(jnp.zeros_like, position)
        total, _ = lax.scan(body, zeros, jnp.arange(num_chunks))
    if axis_name is not None:
        total = lax.psum(total, axis_name)
    return jax.tree.map(lambda g: -g / n, total)
