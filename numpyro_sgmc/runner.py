"""Run a kernel in one compiled loop whose only copy of the data is the caller's.

``numpyro.infer.MCMC`` is the way to run the kernels, but for data that fill the machine it
costs a second copy of them: with ``jit_model_args=True`` its compiled loop carries the model
arguments and returns them with the last state, so XLA writes them to a fresh buffer (a
transient copy of the whole data set, measured here at 1.0× the data); with
``jit_model_args=False`` it compiles them into the loop as constants (compile time and memory
growing with ``n``). :func:`run_kernel` takes the data as arguments of one jitted function and
never returns them, so a run needs the data once plus O(draws · d).

It runs the same ``kernel.init`` and ``kernel.sample`` as ``MCMC`` (so, for the same key, the
same chain), vectorised over ``num_chains`` chains, and returns a :class:`KernelRun` whose
``get_samples`` matches ``MCMC.get_samples`` (so :func:`~numpyro_sgmc.check_run` takes it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax, random

from numpyro_sgmc.kernels.base import SGMCKernel
from numpyro_sgmc.subsample import split_args

__all__ = ["KernelRun", "run_kernel"]


class KernelRun(NamedTuple):
    """What :func:`run_kernel` returns.

    :param dict samples: constrained draws, site -> ``(num_chains, num_samples, ...)``.
    :param last_state: the kernel's state after the last draw (chain axis first when
        ``num_chains > 1``).
    :param num_diverging: ``(num_chains,)`` rejected iterations per chain.
    :param int thinning: draws per kept draw (as ``MCMC.thinning``).
    """

    samples: dict
    last_state: Any
    num_diverging: np.ndarray
    thinning: int = 1

    def get_samples(self, group_by_chain: bool = False) -> dict:
        """The draws, as ``MCMC.get_samples``: chains concatenated unless ``group_by_chain``."""
        if group_by_chain:
            return self.samples
        return {k: v.reshape((-1,) + v.shape[2:]) for k, v in self.samples.items()}


def _check_count(name, value, smallest):
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < smallest:
        raise ValueError(f"{name} must be at least {smallest}, got {value}.")


def run_kernel(
    kernel: SGMCKernel,
    rng_key,
    *model_args,
    num_samples: int,
    num_warmup: int = 0,
    thinning: int = 1,
    num_chains: int = 1,
    init_params=None,
    progress_bar: bool = False,
    **model_kwargs,
) -> KernelRun:
    """Run ``kernel`` for ``num_warmup + num_samples · thinning`` draws in one compiled loop.

    The arguments mean what they mean for ``numpyro.infer.MCMC`` and its ``run``; each draw is
    ``kernel.num_steps`` iterations of the update.

    :param kernel: a kernel of this package (SGLD, SGLDFP, SGD, SGHMC, AdaSGHMC or one
        returned by :func:`~numpyro_sgmc.autotune`).
    :param rng_key: PRNG key; chain ``k`` uses ``random.split(rng_key, num_chains)[k]``.
    :param model_args: the model's data, passed to the compiled loop as arguments.
    :param int num_samples: draws kept.
    :param int num_warmup: draws run first and not kept.
    :param int thinning: keep every ``thinning``-th draw.
    :param int num_chains: chains, vectorised in one loop.
    :param init_params: as for ``MCMC.run`` (a dict, or a :class:`~numpyro_sgmc.ChainInit`).
    :param bool progress_bar: show the kernel's epoch progress bar
        (:class:`~numpyro_sgmc.progress.EpochProgress`: about 100 updates in all).
    :param model_kwargs: the model's keyword arguments.
    :return: a :class:`KernelRun`.
    """
    if not isinstance(kernel, SGMCKernel):
        raise TypeError(
            f"run_kernel runs the kernels of numpyro_sgmc, got {type(kernel).__name__}; run "
            "other kernels with numpyro.infer.MCMC."
        )
    _check_count("num_samples", num_samples, 1)
    _check_count("num_warmup", num_warmup, 0)
    _check_count("thinning", thinning, 1)
    _check_count("num_chains", num_chains, 1)
    previous = kernel.progress_draws
    if progress_bar:
        kernel.progress_draws = num_warmup + num_samples * thinning
    try:
        keys = rng_key if num_chains == 1 else random.split(rng_key, num_chains)
        init_state = kernel.init(keys, num_warmup, init_params, model_args, model_kwargs)
        data, rebuild = split_args(model_args, model_kwargs)

        @jax.jit
        def loop(state, data):
            args, kwargs = rebuild(data)
            postprocess = kernel.postprocess_fn(args, kwargs)  # the data as arguments here too

            def draw(state, _):
                return kernel.sample(state, args, kwargs), None

            state, _ = lax.scan(draw, state, length=num_warmup)

            def keep(state, _):
                state, _ = lax.scan(draw, state, length=thinning)
                z = getattr(state, kernel.sample_field)
                return state, (postprocess(z) if num_chains == 1 else jax.vmap(postprocess)(z))

            return lax.scan(keep, state, length=num_samples)

        last_state, samples = loop(init_state, data)
    finally:
        kernel.progress_draws = previous
    samples = jax.tree.map(
        lambda x: np.asarray(x)[None] if num_chains == 1 else np.swapaxes(np.asarray(x), 0, 1),
        samples,
    )
    num_diverging = np.atleast_1d(np.asarray(last_state.num_diverging))
    return KernelRun(samples, last_state, num_diverging, thinning)
