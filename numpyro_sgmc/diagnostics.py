"""What can go wrong, and how the library says so: its warnings and divergence reports.

Every warning the library raises is a subclass of :class:`SGMCWarning`, so one filter
silences them all (``warnings.simplefilter("ignore", numpyro_sgmc.diagnostics.SGMCWarning)``)
and one makes them errors. A step whose gradient estimate or proposed position is not finite is
rejected by the kernels (:mod:`numpyro_sgmc.kernels.core`); the first rejection of a chain
raises a :class:`DivergenceWarning` from inside the compiled loop, through a host callback
that only runs on that draw, naming the iteration at which it happened.
"""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "CentreWarning",
    "ConvergenceWarning",
    "DataOrderWarning",
    "DivergenceWarning",
    "InterruptWarning",
    "LinearizationWarning",
    "PerformanceWarning",
    "RunCheckWarning",
    "SGMCWarning",
    "StepSizeWarning",
    "divergence_message",
    "report_new_divergences",
    "user_stacklevel",
    "warn",
]


class SGMCWarning(UserWarning):
    """Base class of every warning of numpyro-sgmc."""


class DivergenceWarning(SGMCWarning, RuntimeWarning):
    """A chain produced a non-finite gradient or position; the step was rejected."""


class InterruptWarning(SGMCWarning):
    """A run was interrupted (Ctrl-C): it stopped and kept the draws made so far."""


class CentreWarning(SGMCWarning):
    """The control-variate centre is far from a mode of the potential."""


class DataOrderWarning(SGMCWarning):
    """``batch_sampling="blocks"`` on rows that are not in random order."""


class PerformanceWarning(SGMCWarning):
    """A setting makes the sampling loop handle the data in O(n) per draw or compile."""


class ConvergenceWarning(SGMCWarning):
    """The optimizer stopped before the mode (the gradient there is too large)."""


class LinearizationWarning(SGMCWarning):
    """The log posterior is far from the quadratic every prediction assumes (separable data,
    a boundary, a heavy tail): the tuner's predictions do not hold."""


class RunCheckWarning(SGMCWarning):
    """:func:`~numpyro_sgmc.check_run` found a run that disagrees with the prediction, with
    the information recomputed from fresh rows, or with itself across chains."""


class StepSizeWarning(SGMCWarning):
    """A hand-set step size is past the stability bound, or widens the law by over 10%."""


def user_stacklevel() -> int:
    """``stacklevel`` for :func:`warnings.warn` that points at the user's code.

    The first frame, above the caller of this function, outside numpyro, numpyro_sgmc and jax.
    """
    frame, level = inspect.currentframe(), 0
    while frame is not None:
        package = frame.f_globals.get("__name__", "").split(".")[0]
        if level > 0 and package not in ("numpyro", "numpyro_sgmc", "jax"):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def warn(message: str, category) -> None:
    """``warnings.warn`` pointed at the user's code."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


def divergence_message(kernel_name: str, step_size, iteration, num_chains, num_steps=None) -> str:
    """The :class:`DivergenceWarning` text: ``iteration`` is the first rejected iteration
    (warm-up included), in draw ``ceil(iteration / num_steps)`` when ``num_steps`` is given."""
    where = f"iteration {int(iteration)} (warm-up included"
    if num_steps is not None:
        draw = -(-int(iteration) // int(num_steps))
        where += f"; in draw {draw}, of {int(num_steps)} iterations each"
    return (
        f"{kernel_name}: {int(num_chains)} chain(s) diverged for the first time, at {where}): "
        "a non-finite gradient estimate or position. Such steps are "
        "rejected: the chain stays at its last finite position and the draw is flagged in "
        f"the 'diverging' field. With finite data, the step size (step_size={step_size}) is "
        "the likely cause: the linearised chain is only stable while h * lambda_max(Gamma J) "
        "< 4 for the first-order kernels and h * lambda_max(M^-1 J) < 2 (2 - momentum_decay) "
        "for SGHMC (docs/theory.md §3, §5); reduce step_size, precondition with an estimate "
        "of J^-1, or let numpyro_sgmc.autotune choose it. A kernel autotune chose diverges "
        "where the posterior is far from the Gaussian it was tuned for (its warnings say "
        "where): re-tune with a smaller max_step, or sample the model with NUTS."
    )


def report_new_divergences(
    old_count, new_count, first_iteration, kernel_name: str, step_size, num_steps=None
) -> jax.Array:
    """Warn once per chain, from inside the compiled loop, when it first diverges.

    ``old_count``/``new_count`` are the chains' ``num_diverging`` before and after a draw
    (scalars, or one entry per chain) and ``first_iteration`` their ``divergence_iteration``.
    Returns ``new_count`` unchanged, routed through the callback branch so that the callback
    is part of the computation.

    The callback is a :func:`jax.pure_callback` in a :func:`jax.lax.cond` branch taken only
    on a first divergence: unlike :func:`jax.debug.callback` it adds no effect to the
    compiled step, which keeps JAX's fast dispatch path (an effect costs ~0.1-1 ms per
    dispatched draw, measured on CPU).
    """
    newly = (old_count == 0) & (new_count > 0)
    count = jnp.sum(newly)
    iteration = jnp.min(jnp.where(newly, first_iteration, jnp.iinfo(jnp.int32).max))

    def emit(total):
        def host(i, k):
            warnings.warn(
                divergence_message(kernel_name, step_size, i, k, num_steps),
                DivergenceWarning,
                stacklevel=2,
            )
            return np.zeros((), np.int32)

        zero = jax.pure_callback(
            host, jax.ShapeDtypeStruct((), jnp.int32), iteration, count, vmap_method="sequential"
        )
        return total + zero.astype(total.dtype)

    return lax.cond(count > 0, emit, lambda total: total, new_count)
