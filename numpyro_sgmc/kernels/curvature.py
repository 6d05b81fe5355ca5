"""Curvature at a point, from Hessian-vector products on a batch of rows: ``λmax(PJ)``,
``tr(PJ)`` and the gradient-noise scale ``tr(PI)``.

``J = ∇²U(θ)/n`` is the curvature per datum of the potential and ``P`` a preconditioner
``Γ`` or an inverse mass ``M⁻¹``; ``h·λmax(PJ)`` is every kernel's stability number
(``docs/theory.md`` §3, §5). ``P`` is a scale (:mod:`numpyro_sgmc.scales`), passed with
``inverse=True`` for ``P = M⁻¹``. The power iteration runs on ``PJ`` (similar to the symmetric
``P^{1/2}JP^{1/2}``) and ends with the Rayleigh quotient ``vᵀJv / vᵀP⁻¹v``; the products use the
potential on a fixed random batch of rows (which the plates scale by ``n_p/m_p``, an unbiased
estimate of ``∇²U``), so ``J`` is never formed: ``O(iterations · m · d)``. The functions are
compiled once per model and batch shape.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_sgmc.compilation import one_shot_jit
from numpyro_sgmc.data.files import rows_in_memory
from numpyro_sgmc.data.gradients import minibatch
from numpyro_sgmc.data.model import potential, split_args
from numpyro_sgmc.data.subsample import Batch
from numpyro_sgmc.host import device_array, host_rng

__all__ = [
    "MARGIN",
    "Curvature",
    "curvature",
    "largest_eigenvalue",
    "random_rows",
]

MARGIN = 1.1
"""The factor :func:`largest_eigenvalue` raises ``λmax`` by, for the power iteration's
shortfall and the rows' noise."""


def random_rows(rng: np.random.Generator, plates, num_rows: int) -> Batch:
    """About ``num_rows`` uniform random rows (with replacement), split over the plates in
    proportion to their sizes, at least one per plate."""
    n = sum(p.size for p in plates)
    return Batch(
        {
            p.name: device_array(
                rng.integers(0, p.size, max(1, min(p.size, num_rows * p.size // n))), np.int32
            )
            for p in plates
        }
    )


def _products(scale, inverse):
    """``(P v, P⁻¹ v)`` for ``P`` = the scale, or its inverse."""
    if inverse:
        return scale.solve, scale.apply
    return scale.apply, scale.solve


def _batch_hvp(spec, structure, layout, position, batch, arrays):
    """``(flat, v -> J_B v)``: the flat ``position`` and the Hessian-vector product of the
    batch's potential per datum, ``∇²U_B/n``, there."""
    args, kwargs = structure.rebuild(arrays)
    flat = layout.ravel(position)

    def average(x):
        return potential(spec, layout.unravel(x), batch, args, kwargs) / spec.num_data

    return flat, lambda v: jax.jvp(jax.grad(average), (flat,), (v,))[1]


@one_shot_jit(("spec", "structure", "layout", "inverse", "iterations"))
def _power(spec, structure, layout, inverse, iterations, scale, position, batch, v, shift, arrays):
    """The power iteration on ``PJ - shift·I`` from ``v``; the Rayleigh quotient of ``PJ``."""
    _, hvp = _batch_hvp(spec, structure, layout, position, batch, arrays)
    apply, unapply = _products(scale, inverse)

    def body(_, v):
        w = apply(hvp(v)) - shift * v
        return w / jnp.linalg.norm(w)

    v = jax.lax.fori_loop(0, iterations, body, v / jnp.linalg.norm(v))
    return jnp.vdot(v, hvp(v)) / jnp.vdot(v, unapply(v))


def largest_eigenvalue(
    spec, layout, position, scale, rng_key, model_args, model_kwargs, num_rows=10000,
    iterations=50, inverse=False, rng=None, positive=False,
) -> float:  # fmt: skip
    """``λmax(PJ)`` at ``position`` (``J`` from about ``num_rows`` rows), raised by
    :data:`MARGIN` for the iteration's shortfall and the batch's noise: the one power iteration
    of the kernels' step checks, ``step_size="auto"`` and the autotuner.

    :param scale: ``P`` (or, with ``inverse=True``, ``P⁻¹``): a prepared scale.
    :param rng: the host generator of the rows and the start vector (default
        ``host_rng(rng_key)``; the autotuner passes its own named stream).
    :param bool positive: the largest eigenvalue rather than the one of largest magnitude:
        away from a strict minimum that can be negative (a saddle direction), ``λ₋``; a second
        iteration on ``PJ - λ₋I``, whose top eigenvalue is ``λmax - λ₋``, then finds ``λmax``.
    """
    rng = host_rng(rng_key) if rng is None else rng
    batch = random_rows(rng, spec.plates, num_rows)
    arrays, structure = split_args(model_args, model_kwargs)
    arrays, batch = rows_in_memory(arrays, spec.plates, batch)
    flat = layout.ravel(position)
    v = device_array(rng.standard_normal(flat.shape), flat.dtype)
    run = partial(
        _power, spec, structure, layout, bool(inverse), int(iterations), scale, position, batch, v
    )
    value = float(run(device_array(0.0, flat.dtype), arrays))
    if positive and value < 0:
        value = float(run(device_array(value, flat.dtype), arrays))
    return MARGIN * value


class Curvature(NamedTuple):
    """The curvature and gradient noise of a kernel's chain at a point (:func:`curvature`).

    :param float lam_max: ``λmax(PJ)`` (raised by 10%, as :func:`largest_eigenvalue`).
    :param float noise_ratio: ``tr(PI)/tr(PJ)``, ``I`` the covariance of the per-datum
        gradients there: about 1 at the mode of a well-specified model.
    """

    lam_max: float
    noise_ratio: float


@one_shot_jit(("spec", "structure", "layout", "inverse", "draws"))
def _traces(spec, structure, layout, inverse, draws, scale, position, batch, rng_key, arrays):
    """``tr(P J)`` by Rademacher probes and ``b · tr(P Cov(ĝ_B))`` over ``draws`` batches."""
    args, kwargs = structure.rebuild(arrays)
    flat, hvp = _batch_hvp(spec, structure, layout, position, batch, arrays)
    apply, _ = _products(scale, inverse)
    key_probes, key_batches = random.split(rng_key)
    probes = 2.0 * random.bernoulli(key_probes, 0.5, (8,) + flat.shape).astype(flat.dtype) - 1.0
    trace_j = jnp.mean(jax.vmap(lambda v: jnp.vdot(v, apply(hvp(v))))(probes))
    estimator = minibatch(spec, "with_replacement")

    def one(k):
        g, _ = estimator.estimate(
            estimator.init(k, position, args, kwargs), position, k, args, kwargs
        )
        return layout.ravel(g)

    grads = jax.vmap(one)(random.split(key_batches, draws))
    centred = grads - jnp.mean(grads, axis=0)
    trace_i = spec.batch_size * jnp.mean(jax.vmap(lambda g: jnp.vdot(g, apply(g)))(centred))
    return trace_j, trace_i * draws / (draws - 1)


def curvature(
    spec, layout, position, scale, rng_key, model_args, model_kwargs, num_rows=2048,
    inverse=False,
) -> Curvature:  # fmt: skip
    """``λmax(PJ)`` and ``tr(PI)/tr(PJ)`` at ``position``, from about ``num_rows`` rows and 32
    minibatches: what a kernel's step-size check needs (``numpyro_sgmc.kernels.checks``)."""
    lam = largest_eigenvalue(
        spec, layout, position, scale, rng_key, model_args, model_kwargs, num_rows,
        iterations=30, inverse=inverse,
    )  # fmt: skip
    batch = random_rows(host_rng(rng_key, 1), spec.plates, num_rows)
    arrays, structure = split_args(model_args, model_kwargs)
    arrays, batch = rows_in_memory(arrays, spec.plates, batch)
    trace_j, trace_i = _traces(
        spec, structure, layout, bool(inverse), 32, scale, position, batch, rng_key, arrays
    )
    ratio = float(trace_i) / float(trace_j) if float(trace_j) > 0 else float("nan")
    return Curvature(lam, ratio)
