"""Checks a kernel runs at ``init``, before the first step, and the warnings they give.

Each takes the prepared model's :class:`~numpyro_sgmc.data.model.ModelSpec` and the data as
arguments of a compiled function (never compiled-in constants), and either returns, raises a
``ValueError`` that names the problem and the fix, or warns (:mod:`numpyro_sgmc.diagnostics`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.util import not_jax_tracer

from numpyro_sgmc.compilation import one_shot_jit
from numpyro_sgmc.data.batches import batch_sampler
from numpyro_sgmc.data.files import file_backed, first_rows, rows_in_memory
from numpyro_sgmc.data.gradients import Centre, full_data_gradient, minibatch
from numpyro_sgmc.data.model import potential, split_args
from numpyro_sgmc.data.subsample import Batch, first_batch
from numpyro_sgmc.diagnostics import (
    CentreWarning,
    DataOrderWarning,
    PerformanceWarning,
    StepSizeWarning,
    warn,
)
from numpyro_sgmc.kernels.core import tree_all_finite

__all__ = [
    "StepCheck",
    "check_finite_start",
    "check_position",
    "check_row_order",
    "data_bytes",
    "warn_compiled_in_data",
    "warn_far_centre",
    "warn_progress_copies",
    "warn_step_size",
]

LARGE_DATA_BYTES = 2**24  # model arguments above this make NumPyro's defaults slow


def check_position(params, prototype: dict, batched: bool, what: str = "init_params"):
    """``params`` covers exactly the latent sites, each with its unconstrained shape."""
    if not isinstance(params, dict) or set(params) != set(prototype):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"{what} must be a dict over the latent sites {sorted(prototype)} "
            f"(unconstrained values); got {got}."
        )
    for name, value in params.items():
        want = jnp.shape(prototype[name])[1:] if batched else jnp.shape(prototype[name])
        have = jnp.shape(value)[1:] if batched else jnp.shape(value)
        if have != want:
            raise ValueError(
                f"{what}['{name}'] has shape {jnp.shape(value)}; the unconstrained site has "
                f"shape {want}" + (" after the leading chain axis." if batched else ".")
            )


@one_shot_jit(("spec", "structure", "batched"))
def _finite_at(spec, structure, batched, z, arrays):
    args, kwargs = structure.rebuild(arrays)
    batch = first_batch(spec.plates)
    value_and_grad = jax.value_and_grad(lambda z: potential(spec, z, batch, args, kwargs))
    one = lambda z: tree_all_finite(value_and_grad(z))  # noqa: E731
    return jax.vmap(one)(z) if batched else one(z)


def check_finite_start(spec, z, model_args, model_kwargs, batched: bool):
    """A given start must have a finite potential and gradient on the first batch."""
    arrays, structure = split_args(model_args, model_kwargs)
    finite = _finite_at(spec, structure, batched, z, first_rows(arrays, spec.plates))
    if not_jax_tracer(finite) and not np.all(finite):
        bad = np.flatnonzero(~np.atleast_1d(np.asarray(finite)))
        raise ValueError(
            "The potential or its gradient is not finite at the initial position"
            + (f" of chain(s) {bad.tolist()}" if batched else "")
            + ". init_params are unconstrained values: check they are in the support after "
            "the transform, and that the model's log-density is finite there."
        )


def _row_order_indices(plates, draws, rng_key) -> dict:
    """Plate -> ``(2, draws, b_p)`` indices: ``draws`` batches by ``"blocks"``, then as many
    by ``"without_replacement"``."""
    keys = random.split(rng_key, 2)

    def batches(method, key):
        sampler = batch_sampler(plates, method)
        return jax.vmap(lambda k: sampler.draw(sampler.init(k), k)[0].indices)(
            random.split(key, draws)
        )

    by_method = [
        batches(m, k) for m, k in zip(("blocks", "without_replacement"), keys, strict=True)
    ]
    return jax.tree.map(lambda *x: jnp.stack(x), *by_method)


def _gradient_spreads(spec, structure, z, indices, arrays):
    """``(2,)``: the total variance of the minibatch gradient over each method's batches."""
    args, kwargs = structure.rebuild(arrays)

    def flat(batch_indices):
        g = jax.grad(lambda z: potential(spec, z, Batch(batch_indices), args, kwargs))(z)
        return jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(g)])

    return jnp.sum(jnp.var(jax.vmap(jax.vmap(flat))(indices), axis=1), axis=-1)


@one_shot_jit(("spec", "structure", "draws"))
def _spread_ratio(spec, structure, draws, z, rng_key, arrays):
    spreads = _gradient_spreads(
        spec, structure, z, _row_order_indices(spec.plates, draws, rng_key), arrays
    )
    return spreads[0] / spreads[1]


_file_row_order_indices = one_shot_jit(("plates", "draws"))(_row_order_indices)
_file_gradient_spreads = one_shot_jit(("spec", "structure"))(_gradient_spreads)


def check_row_order(spec, z, rng_key, model_args, model_kwargs, kernel_name, draws=32):
    """Warn if blocks of rows give far noisier gradients than random batches at ``z``.

    On rows in random order the two have the same covariance, ``(n-b)/(n-1) I/b``; on
    ordered rows (sorted, grouped, in time order) a block is a biased sample of one region.
    """
    arrays, structure = split_args(model_args, model_kwargs)
    if any(file_backed(x) for x in arrays):  # the batches' rows read once, in file order
        indices = _file_row_order_indices(spec.plates, draws, rng_key)
        arrays, indices = rows_in_memory(arrays, spec.plates, indices)
        spreads = _file_gradient_spreads(spec, structure, z, indices, arrays)
        ratio = spreads[0] / spreads[1]
    else:
        ratio = _spread_ratio(spec, structure, draws, z, rng_key, arrays)
    if not_jax_tracer(ratio) and float(ratio) > 3.0:
        warn(
            f"{kernel_name}: with batch_sampling='blocks' the gradient noise is "
            f"{float(ratio):.3g} times that of random batches: the rows look ordered "
            "(sorted, grouped or in time order), so each block samples one region of the "
            "data. Shuffle them once, e.g. X, y = numpyro_sgmc.shuffle_rows(key, X, y), "
            "or use batch_sampling='with_replacement'.",
            DataOrderWarning,
        )


@one_shot_jit(("spec", "structure", "chunk_size"), rows=lambda spec, **_: spec.num_data)
def _centre_ratio(spec, structure, chunk_size, centre, rng_key, arrays):
    """``n|ḡ(θ̂)|² / (b·E|ĝ_B(θ̂) - ḡ(θ̂)|²)`` at one centre (4 batches, with replacement)."""
    args, kwargs = structure.rebuild(arrays)
    full = full_data_gradient(spec, centre, args, kwargs, chunk_size)
    estimator = minibatch(spec, "with_replacement")

    def noise(k):
        g, _ = estimator.estimate(estimator.init(k, centre, args, kwargs), centre, k, args, kwargs)
        return sum(
            jnp.sum((a - b) ** 2)
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(full), strict=True)
        )

    noise_sq = jnp.mean(jax.vmap(noise)(random.split(rng_key, 4)))
    return _ratio(spec, full, noise_sq)


def _ratio(spec, full, noise_sq):
    grad_sq = sum(jnp.sum(v**2) for v in jax.tree.leaves(full))
    tiny = jnp.finfo(noise_sq.dtype).tiny
    return grad_sq * spec.num_data / jnp.maximum(noise_sq * spec.batch_size, tiny)


@one_shot_jit(("plates",))
def _noise_batches(plates, rng_key):
    """Plate -> ``(4, b_p)``: the indices of :func:`_centre_ratio`'s 4 batches."""
    sampler = batch_sampler(plates, "with_replacement")
    return jax.vmap(lambda k: sampler.draw(sampler.init(k), k)[0].indices)(random.split(rng_key, 4))


@one_shot_jit(("spec", "structure", "batched"))
def _known_centre_ratio(spec, structure, batched, centre, indices, arrays):
    """:func:`_centre_ratio` at centres whose full-data gradient is known, on the rows of its
    4 batches (``indices`` their positions in ``arrays``)."""
    args, kwargs = structure.rebuild(arrays)

    def one(centre):
        def noise(batch_indices):
            g = jax.grad(lambda z: potential(spec, z, Batch(batch_indices), args, kwargs))(
                centre.position
            )
            return sum(
                jnp.sum((-a / spec.num_data - b) ** 2)
                for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(centre.gradient), strict=True)
            )

        return _ratio(spec, centre.gradient, jnp.mean(jax.vmap(noise)(indices)))

    return jax.vmap(one)(centre) if batched else one(centre)


def warn_far_centre(spec, centres, rng_key, model_args, model_kwargs, batched, kernel_name):
    """Warn if a control-variate centre is 10 posterior sds or more from a mode. ``centres``:
    positions, or a :class:`~numpyro_sgmc.data.gradients.Centre` whose gradient is known.

    At a mode ``ḡ(θ̂) = 0``; a posterior-typical centre has ``E|ḡ|² ≈ tr(I)/n`` while the batch
    noise has ``E|ĝ_B - ḡ|² = tr(I)/b``, so the ratio is about 1 or less near a mode.
    """
    if spec.batch_size == spec.num_data:
        return
    arrays, structure = split_args(model_args, model_kwargs)
    if isinstance(centres, Centre):  # the gradient known: only the batches' rows are read
        arrays, indices = rows_in_memory(arrays, spec.plates, _noise_batches(spec.plates, rng_key))
        ratios = _known_centre_ratio(spec, structure, batched, centres, indices, arrays)
    elif batched:
        one = partial(_centre_ratio, spec, structure, 65536)
        ratios = jax.vmap(one, (0, None, None))(centres, rng_key, arrays)
    else:
        ratios = _centre_ratio(spec, structure, 65536, centres, rng_key, arrays)
    if not_jax_tracer(ratios) and np.any(np.asarray(ratios) > 100.0):
        warn(
            f"{kernel_name}: the control-variate centre is far from a mode: "
            f"n·|ḡ(θ̂)|² / (b·|ĝ_B(θ̂) - ḡ(θ̂)|²) = {float(np.max(ratios)):.3g} (about 1 or "
            "less at a mode). Control variates only reduce the gradient noise near θ̂. "
            "Start the chain at the MAP (init_strategy=init_to_value(values=map_estimate) "
            "or init_params), or pass the MAP as ChainInit(centre=...).",
            CentreWarning,
        )


def data_bytes(model_args, model_kwargs) -> tuple:
    """Bytes of the model arguments that are concrete arrays, and bytes that are traced."""
    concrete = traced = 0
    for x in jax.tree.leaves((tuple(model_args), model_kwargs or {})):
        if not hasattr(x, "dtype"):
            continue
        nbytes = int(np.prod(jnp.shape(x))) * x.dtype.itemsize
        if not_jax_tracer(x):
            concrete += nbytes
        else:
            traced += nbytes
    return concrete, traced


def warn_compiled_in_data(concrete_bytes: int):
    """``MCMC(jit_model_args=False)``, NumPyro's default, closes its loop over the data."""
    if concrete_bytes > LARGE_DATA_BYTES:
        warn(
            f"The model arguments ({concrete_bytes / 2**20:.0f} MB) are compiled into the "
            "sampling loop as constants, which makes compilation slow (about 15 s for 400 MB "
            "here). Pass MCMC(..., jit_model_args=True, progress_bar=False) for data this "
            "large, or use numpyro_sgmc.run_kernel.",
            PerformanceWarning,
        )


def warn_progress_copies(traced_bytes: int):
    """``MCMC(jit_model_args=True)`` with its progress bar copies the data every draw."""
    if traced_bytes > LARGE_DATA_BYTES:
        warn(
            f"With jit_model_args=True, NumPyro's progress bar copies the model arguments "
            f"({traced_bytes / 2**20:.0f} MB) on every draw (about 0.15 s for 400 MB here). "
            "Pass MCMC(..., progress_bar=False) for data this large.",
            PerformanceWarning,
        )


class StepCheck(NamedTuple):
    """What a kernel's ``init`` found about a hand-set step size, at the chain's start
    (``kernel.step_check``).

    :param float step_size: ``h``.
    :param float lam_max: ``λmax(PJ)``, ``P`` the preconditioner ``Γ`` or ``M⁻¹``, ``J`` from
        about 2,000 rows (:func:`~numpyro_sgmc.kernels.curvature.curvature`).
    :param float noise_ratio: ``tr(PI)/tr(PJ)`` there (about 1 at the mode of a well-specified
        model).
    :param float stability: ``h·λmax(PJ)``.
    :param float bound: where the linearised chain turns unstable (4 for the first-order
        kernels, ``2(2 - α)`` for SGHMC with its default friction).
    :param float inflation: ``σ/σ* - 1``: how much larger the chain's stationary sd is
        predicted to be than its target's along the stiffest direction (discretisation and
        gradient noise, ``docs/theory.md`` §3, §5; the variance ratio is ``(σ/σ*)²``); ``nan``
        where there is no target (SGD).
    :param float suggested: a step with ``inflation ≤ 10%`` (``stability ≤ 1`` for SGD).
    """

    step_size: float
    lam_max: float
    noise_ratio: float
    stability: float
    bound: float
    inflation: float
    suggested: float


def warn_step_size(check: Optional["StepCheck"], kernel_name: str, inflation: bool = True):
    """A :class:`~numpyro_sgmc.diagnostics.StepSizeWarning` if ``check`` is past the stability
    bound or (with ``inflation``) predicts over 10% of inflation.

    A kernel that adapts its mass during warm-up (AdaSGHMC) passes ``inflation=False``: the
    check is made at the initial mass, and the kept draws run with the adapted one, whose
    law the initial mass does not predict; the stability bound still holds at the start."""
    if check is None or not math.isfinite(check.lam_max) or check.lam_max <= 0:
        return
    where = (
        f"{kernel_name}: step_size={check.step_size:.4g} gives h·λmax = {check.stability:.3g} "
        f"at the chain's start (λmax = {check.lam_max:.3g} from about 2,000 rows)"
    )
    fix = (
        f" A step of {check.suggested:.3g} keeps it within 10%; numpyro_sgmc.autotune chooses "
        "the step and corrects its bias."
    )
    if check.stability >= check.bound:
        warn(
            where + f", past the stability bound {check.bound:.3g}: the chain diverges or "
            "oscillates instead of sampling." + fix,
            StepSizeWarning,
        )
    elif inflation and check.inflation > 0.1:
        warn(
            where + f": along the stiffest direction the chain's stationary sd is predicted "
            f"{100 * check.inflation:.0f}% larger than the target's (a variance "
            f"{(1 + check.inflation) ** 2:.3g} times the target's; discretisation and gradient "
            "noise of the linearised chain, docs/theory.md §3)." + fix,
            StepSizeWarning,
        )
