"""Run a kernel in compiled chunks whose only copy of the data is the caller's.

``numpyro.infer.MCMC`` is the way to run the kernels, but for data that fill the machine it
costs a second copy of them: with ``jit_model_args=True`` its compiled loop returns the model
arguments with the last state (a transient copy of the whole data set); with
``jit_model_args=False`` it compiles them into the loop as constants. :func:`run_kernel` takes
the data as arguments of one compiled function and never returns them, so a run needs the
data once plus O(draws · d). The function is a module-level function of the kernel's static
description, so a second run with data of the same shapes compiles nothing.

It runs the same ``kernel.init`` and draws as ``MCMC`` (for the same key, the same chain),
vectorised over ``num_chains`` chains, and returns a :class:`KernelRun` whose ``get_samples``
matches ``MCMC.get_samples`` (so :func:`~numpyro_sgmc.check_run` takes it).

**Chunks.** The compiled function runs a given number of draws, so the run is a Python loop
over chunks of about ``CHUNK_SECONDS`` (0.25 s) each (the number of draws per chunk follows the
measured speed; the draws do not depend on it). Between two chunks Python can act:

* Ctrl-C stops the run within about a chunk and returns the draws made so far
  (``run.interrupted``), with an :class:`~numpyro_sgmc.diagnostics.InterruptWarning` that
  says how many;
* ``previous=run`` continues a run where it stopped: the continued run's draws are those of
  one long run for the same key;
* ``checkpoint=directory`` writes the state and the draws there every ``checkpoint_every``
  kept draws, so that a killed process loses at most that many; :func:`load_run` reads them
  back, to be continued.

**Same run.** A continuation, in memory or from a checkpoint, must run on what the run ran
on: the run's :func:`~numpyro_sgmc.running.checkpoint.fingerprint` (the model's sites and
shapes, the kernel's tuning, the data's shapes and a hash of 64 rows of each argument) is
compared with what is given, and a difference is refused by name. The checkpoint files and
their checksums are :mod:`numpyro_sgmc.running.checkpoint`'s.
"""

from __future__ import annotations

import inspect
import math
import os
import time
import warnings
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from numpyro_sgmc.data import files, streaming, validation
from numpyro_sgmc.data.model import constrain, split_args, total_batch
from numpyro_sgmc.data.progress import EpochProgress, interrupts
from numpyro_sgmc.diagnostics import (
    CentreWarning,
    DivergenceWarning,
    InterruptWarning,
    divergence_message,
    warn,
)
from numpyro_sgmc.kernels.shell import SGMCKernel
from numpyro_sgmc.running.checkpoint import (
    CheckpointWriter,
    concatenate,
    data_fingerprint,
    differences,
    fingerprint,
    read,
    sets_scales,
)

__all__ = ["CHUNK_SECONDS", "KernelRun", "completed_samples", "load_run", "run_kernel"]

CHUNK_SECONDS = 0.25  # sampling time per compiled chunk: the delay of a Ctrl-C
_CHUNK_ROWS = 2**14  # kept draws held on the device per chunk at most
_CHUNK_BYTES = 2**23  # and at most this many bytes of them (8 MB)


class KernelRun(NamedTuple):
    """What :func:`run_kernel` returns.

    :param dict samples: constrained draws, site -> ``(num_chains, num_samples, ...)``.
    :param last_state: the kernel's state after the last draw (chain axis first when
        ``num_chains > 1``).
    :param num_diverging: ``(num_chains,)`` rejected iterations per chain.
    :param int thinning: draws per kept draw (as ``MCMC.thinning``).
    :param sampler: the kernel that ran (as ``MCMC.sampler``).
    :param tuple model_args: the data it ran on; ``model_kwargs`` the keyword arguments
        (what :func:`~numpyro_sgmc.check_run` recomputes the information from).
    :param int num_warmup: the warm-up draws the run asked for.
    :param int num_draws: draws made, warm-up included (of every chain).
    :param bool interrupted: whether Ctrl-C stopped it before the draws it asked for.
    :param config: the kernel's static description, which a continuation runs.
    :param dict fingerprint: what the run ran on (model, tuning, data;
        :func:`~numpyro_sgmc.running.checkpoint.fingerprint`), which a continuation must match.
    """

    samples: dict
    last_state: Any
    num_diverging: np.ndarray
    thinning: int = 1
    sampler: Any = None
    model_args: tuple = ()
    model_kwargs: dict = {}
    num_warmup: int = 0
    num_draws: int = 0
    interrupted: bool = False
    config: Any = None
    fingerprint: Optional[dict] = None

    @property
    def num_samples(self) -> int:
        """Kept draws per chain."""
        return int(next(iter(self.samples.values())).shape[1]) if self.samples else 0

    @property
    def num_chains(self) -> int:
        return int(np.size(self.num_diverging))

    def get_samples(self, group_by_chain: bool = False) -> dict:
        """The draws, as ``MCMC.get_samples``: chains concatenated unless ``group_by_chain``."""
        if group_by_chain:
            return self.samples
        return {k: v.reshape((-1,) + v.shape[2:]) for k, v in self.samples.items()}


@partial(
    jax.jit,
    static_argnames=("build", "config", "structure", "num_steps", "batched", "size", "fed"),
)
def _chunk(
    build, config, structure, num_steps, batched, size, fed, state, num_warmup, num_kept,
    thinning, offset, arrays, rows,
):  # fmt: skip
    """``num_warmup`` draws, then ``num_kept`` kept draws (each the last of ``thinning``
    draws), constrained, in the first rows of a buffer of ``size`` rows. The counts are
    arguments, not constants: one compilation serves every chunk and every run of a kernel
    on data of the same shapes.

    ``fed``: the positions in ``arrays`` of the arguments fed row by row
    (:mod:`~numpyro_sgmc.data.streaming`; ``None`` there), and ``rows`` their rows, one batch
    per step (``(steps, b_p, ...)``, chain axis first when ``batched``): draw ``j`` of the
    chunk runs on the batches ``(offset + j)·num_steps`` to ``(offset + j + 1)·num_steps - 1``."""
    kernel = build(config)
    axes = tuple(0 if k in fed else None for k in range(len(arrays)))

    def on_chains(fn):  # fn(state or z, arrays) of one chain
        return jax.vmap(fn, (0, axes)) if batched else fn

    def at(t):  # the arrays of step t of the chunk
        t = t + offset * num_steps
        leaves = list(arrays)
        for k, r in zip(fed, rows, strict=True):
            leaves[k] = lax.dynamic_index_in_dim(r, t, axis=int(batched), keepdims=False)
        return tuple(leaves)

    def one_step(s, leaves):
        args, kwargs = structure.rebuild(leaves)
        return kernel.step(s, args, kwargs)

    def one_value(z, leaves):
        if not config.check_support:  # identity transforms, no deterministic site: z itself
            return z  # (no trace of the model to lower and compile)
        args, kwargs = structure.rebuild(leaves)
        return constrain(config.spec, z, args, kwargs, exclude=config.exclude)

    step, values = on_chains(one_step), on_chains(one_value)

    def advance(d, state):  # draw d of the chunk (kernels.core.draw, on the chunk's batches)
        start = state.num_diverging
        state = lax.fori_loop(0, num_steps, lambda j, s: step(s, at(d * num_steps + j)), state)
        return state._replace(diverging=state.num_diverging > start)

    state = lax.fori_loop(0, num_warmup, advance, state)
    shapes = jax.eval_shape(values, state.z, at(0))
    buffer = jax.tree.map(lambda x: jnp.zeros((size,) + x.shape, x.dtype), shapes)

    def keep(k, carry):
        state, buffer = carry
        first = num_warmup + k * thinning
        state = lax.fori_loop(first, first + thinning, advance, state)
        value = values(state.z, at((first + thinning) * num_steps - 1))
        return state, jax.tree.map(lambda b, v: b.at[k].set(v), buffer, value)

    return lax.fori_loop(0, num_kept, keep, (state, buffer))


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
    model_kwargs=None,
    previous: Optional[KernelRun] = None,
    checkpoint=None,
    checkpoint_every: Optional[int] = None,
    **unknown,
) -> KernelRun:
    """Run ``kernel`` for ``num_warmup + num_samples · thinning`` draws in compiled chunks.

    The arguments mean what they mean for ``numpyro.infer.MCMC`` and its ``run``; each draw is
    ``kernel.num_steps`` iterations of the update. Ctrl-C stops the run within about
    ``CHUNK_SECONDS`` (0.25 s) and returns the draws made so far (module docstring).

    :param kernel: a kernel of this package (SGLD, SGLDFP, SGD, SGHMC, AdaSGHMC, or one
        returned by :func:`~numpyro_sgmc.autotune`).
    :param rng_key: PRNG key; chain ``k`` uses ``random.split(rng_key, num_chains)[k]``.
        ``None`` with ``previous``.
    :param model_args: the model's data, passed to the compiled chunks as arguments (pandas
        objects, lists and NumPy arrays are converted once,
        ``numpyro_sgmc.data.validation.as_arrays``).
    :param int num_samples: draws kept (by this call).
    :param int num_warmup: draws run first and not kept.
    :param int thinning: keep every ``thinning``-th draw.
    :param int num_chains: chains, vectorised in one loop.
    :param init_params: as for ``MCMC.run`` (a dict, or a :class:`~numpyro_sgmc.ChainInit`).
    :param bool progress_bar: show the kernel's epoch progress bar
        (:class:`~numpyro_sgmc.data.progress.EpochProgress`), moved after every chunk.
    :param dict model_kwargs: the model's keyword arguments.
    :param previous: a :class:`KernelRun` of this kernel to continue (its last state, the
        rest of its warm-up, its thinning and chains) on the same data (the same shapes and
        the same values in the rows its fingerprint hashes): the result holds its draws
        followed by ``num_samples`` more, the draws of one long run.
    :param checkpoint: a directory to write the state and the draws to (created if needed);
        :func:`load_run` reads it back.
    :param int checkpoint_every: kept draws between two checkpoints (with ``checkpoint``);
        also one at the end of warm-up and every ``checkpoint_every · thinning`` warm-up
        draws.
    :param unknown: none taken: a ``TypeError`` that names ``model_kwargs``.
    :return: a :class:`KernelRun`.
    :raises ValueError: ``previous`` of another kernel, or on other data (the message says
        which argument and what differs: shape, dtype or rows).
    """
    validation.no_unknown_keywords("run_kernel", unknown)
    if not isinstance(kernel, SGMCKernel):
        raise TypeError(
            f"run_kernel runs the kernels of numpyro_sgmc, got {type(kernel).__name__}; run "
            "other kernels with numpyro.infer.MCMC."
        )
    num_samples = validation.nonnegative_int("num_samples", num_samples)
    if previous is None and num_samples < 1:
        raise ValueError("num_samples must be at least 1, got 0.")
    num_warmup = validation.nonnegative_int("num_warmup", num_warmup)
    thinning = validation.positive_int("thinning", thinning)
    num_chains = validation.positive_int("num_chains", num_chains)
    if not isinstance(progress_bar, (bool, np.bool_)):
        raise TypeError(f"progress_bar must be True or False, got {progress_bar!r}.")
    if (checkpoint is None) != (checkpoint_every is None):
        raise ValueError(
            "checkpoint (a directory) and checkpoint_every (kept draws between two "
            "checkpoints) go together; pass both or neither."
        )
    if checkpoint is not None:
        checkpoint = os.fspath(checkpoint)
        checkpoint_every = validation.positive_int("checkpoint_every", checkpoint_every)
    model = kernel.subsampled_model
    model_args, model_kwargs = validation.as_arrays(model, model_args, model_kwargs)
    # large NumPy data reach the device once, not on each compiled call of the start and the
    # chunks; the KernelRun keeps the caller's arrays, not a second copy
    args, kwargs = validation.on_device(model_args, model_kwargs)
    owned = not interrupts.installed()  # kernel.init installs the Ctrl-C handler for MCMC
    try:
        if previous is None:
            run = _start(kernel, rng_key, args, kwargs, num_warmup, thinning, num_chains,
                         init_params)  # fmt: skip
        else:
            given = dict(num_warmup=num_warmup, thinning=thinning, num_chains=num_chains)
            run = _continued(kernel, rng_key, previous, args, kwargs, given, init_params)
        run = run._replace(model_args=tuple(model_args), model_kwargs=model_kwargs)
        arrays, structure = split_args(args, kwargs)
        return _sample(kernel, run, structure, arrays, num_samples, progress_bar, checkpoint,
                       checkpoint_every)  # fmt: skip
    finally:
        if owned:
            interrupts.disarm()


def _start(kernel, rng_key, model_args, model_kwargs, num_warmup, thinning, num_chains, init):
    """A :class:`KernelRun` of no draws at the kernel's initial state."""
    if rng_key is None:
        raise TypeError("rng_key must be a PRNG key (None only with previous=...).")
    keys = rng_key if num_chains == 1 else random.split(rng_key, num_chains)
    with streaming.runner():  # file-backed data allowed
        state = kernel.init(keys, num_warmup, init, model_args, model_kwargs)
    found = fingerprint(kernel, kernel.config, state.params, sets_scales(init), model_args,
                        model_kwargs)  # fmt: skip
    return KernelRun(
        {}, state, np.zeros(num_chains, np.int64), thinning, kernel, tuple(model_args),
        model_kwargs, num_warmup, 0, False, kernel.config, found,
    )  # fmt: skip


def _continued(kernel, rng_key, previous, model_args, model_kwargs, given, init_params):
    """``previous`` checked as the start of a continuation on these data."""
    if not isinstance(previous, KernelRun):
        raise TypeError(f"previous must be a KernelRun, got {type(previous).__name__}.")
    if previous.sampler is not kernel:
        raise ValueError("previous was run by another kernel: continue it with its own.")
    if rng_key is not None:
        raise ValueError(
            "A continuation draws its randomness from previous.last_state: pass rng_key=None "
            "(a different key would not give the draws of one long run)."
        )
    settings = dict(num_warmup=0, thinning=previous.thinning, num_chains=previous.num_chains)
    defaults = dict(num_warmup=0, thinning=1, num_chains=1)
    for name, value in given.items():
        if value not in (settings[name], defaults[name]):
            raise ValueError(
                f"A continuation keeps previous's {name} ({settings[name]}), got {name}={value}:"
                " leave it out (the rest of previous's warm-up, if any, runs first)."
            )
    if init_params is not None:
        raise ValueError("init_params do not apply to a continuation: it starts at previous.")
    # the kernel is previous's, so only the data can differ from the run's
    data = data_fingerprint(kernel.subsampled_model, model_args, model_kwargs)
    found = differences(previous.fingerprint, dict(previous.fingerprint, data=data))
    if found:
        raise ValueError(
            f"previous ran on other data: {'; '.join(found)}. A continuation needs data of the "
            "same shapes and values as the run's (previous.model_args, previous.model_kwargs)."
        )
    return previous._replace(model_args=tuple(model_args), model_kwargs=model_kwargs)


class _Schedule:
    """Draws per chunk: one first (compilation), then what takes :data:`CHUNK_SECONDS` at
    the speed of the last chunk, growing at most fourfold from one chunk to the next."""

    def __init__(self):
        self.units, self.timed = 1, False

    def next(self, limit: int) -> int:
        return max(1, min(self.units, limit))

    def record(self, units: int, seconds: float):
        if not self.timed:  # the first chunk compiled: its time says nothing of the speed
            self.timed, self.units = True, 2
            return
        rate = units / max(seconds, 1e-6)
        self.units = max(1, min(int(rate * CHUNK_SECONDS), 4 * self.units))


def _sample(kernel, run, structure, arrays, num_samples, progress_bar, checkpoint, every):
    """The chunk loop of :func:`run_kernel` from ``run``, for ``num_samples`` more kept draws:
    the rest of the warm-up, then the kept draws, a checkpoint every ``every`` of them. With
    file-backed data each chunk's batches are read while the chunk before it runs
    (:mod:`~numpyro_sgmc.data.streaming`)."""
    config, thinning, batched = run.config, run.thinning, run.num_chains > 1
    warmup_left = max(0, run.num_warmup - run.num_draws)
    asked = run.num_draws + warmup_left + num_samples * thinning
    size = _buffer_rows(config, structure, batched, run.last_state.z, arrays)
    feed = _row_feed(kernel, config, arrays, run)
    fed = () if feed is None else feed.fed.leaves
    if feed is not None:  # the chunks take the batches' rows, not the data
        arrays = tuple(None if k in fed else a for k, a in enumerate(arrays))
        config = config._replace(fed_rows=True)
        feed.start(run.last_state, warmup_left, asked - run.num_draws)
    # small NumPy data too reach the device once, not once per chunk
    arrays = tuple(jax.device_put(a) if isinstance(a, np.ndarray) else a for a in arrays)
    progress = _progress_bar(kernel, config, asked) if progress_bar else None
    writer = None if checkpoint is None else CheckpointWriter(checkpoint, _settings(kernel, run))
    period = None if every is None else every * thinning  # draws between two checkpoints
    state, draws = run.last_state, run.num_draws
    parts = [run.samples] if run.samples else []
    schedule, interrupted = _Schedule(), False
    plan = _Plan(warmup_left, num_samples, thinning, period, size)
    if not interrupts.installed():  # kernel.init armed it: a Ctrl-C since then counts
        interrupts.arm()
    interrupts.start()
    try:
        while not plan.finished:
            if interrupts.poll():
                interrupted = True
                break
            rows, offset, available = (), 0, math.inf
            if feed is not None:  # the rows of the next draws (the feed after reads on)
                rows, offset, available = feed.window()
            n_warm, n_kept = chunk = plan.next(schedule, available)
            units = n_warm + n_kept * thinning
            start = time.perf_counter()
            state, buffer = _chunk(
                kernel.family.build, config, structure, kernel.num_steps, batched, size, fed,
                state, n_warm, n_kept, thinning, offset, arrays, rows,
            )  # fmt: skip
            jax.block_until_ready(state)
            schedule.record(units, time.perf_counter() - start)
            due = plan.done(chunk)
            if feed is not None:
                feed.consume(units)
            draws += units
            if n_kept:
                parts.append(jax.tree.map(partial(_to_host, n_kept, batched), buffer))
            if progress is not None:
                progress.advance(_first(state.i))
            if writer is not None and due:
                writer.write(state, parts, draws, finished=False)
    finally:
        interrupts.stop()
        if progress is not None:
            progress.close()
        if feed is not None:
            feed.close()
    if writer is not None and (plan.pending or interrupted or not parts):
        writer.write(state, parts, draws, finished=not interrupted)
    result = run._replace(
        samples=concatenate(parts),
        last_state=state,
        num_diverging=np.atleast_1d(np.asarray(state.num_diverging)),
        num_draws=draws,
        interrupted=interrupted,
    )
    _warn_divergences(kernel, run, result)
    if interrupted:
        warn(
            f"run_kernel: interrupted (Ctrl-C) after {draws} of {asked} draws (warm-up "
            f"included): the KernelRun holds the {result.num_samples} kept draws made so far "
            "(per chain). Continue it with run_kernel(kernel, None, *run.model_args, "
            f"num_samples={num_samples - plan.kept}, previous=run).",
            InterruptWarning,
        )
    return result


class _Plan:
    """The chunks of a run as ``(warm-up draws, kept draws)``: the warm-up first, then the kept
    draws, each chunk as long as the :class:`_Schedule` says, at most ``size`` kept draws (the
    chunk's buffer), and none across a checkpoint (every ``period`` draws) or the end of
    warm-up."""

    def __init__(self, warmup_left: int, num_samples: int, thinning: int, period, size: int):
        self.warmup_left, self.num_samples, self.thinning = warmup_left, num_samples, thinning
        self.period, self.size = period, size
        self.kept = self.pending = 0  # kept draws run; draws since the last checkpoint

    @property
    def finished(self) -> bool:
        return not (self.warmup_left or self.kept < self.num_samples)

    def next(self, schedule, available=math.inf):
        """The next chunk, of at most ``available`` draws (what a feed of rows has left)."""
        room = math.inf if self.period is None else self.period - self.pending
        if self.warmup_left:
            return schedule.next(min(self.warmup_left, room, available)), 0
        limit = min(self.num_samples - self.kept, self.size, room // self.thinning,
                    available // self.thinning)  # fmt: skip
        return 0, max(1, min(limit, schedule.next(limit * self.thinning) // self.thinning))

    def done(self, chunk) -> bool:
        """Count ``chunk`` as run; whether a checkpoint is due after it (``period`` draws
        since the last, or the end of warm-up)."""
        n_warm, n_kept = chunk
        self.warmup_left -= n_warm
        self.kept += n_kept
        self.pending += n_warm + n_kept * self.thinning
        due = self.pending == self.period or bool(n_warm and not self.warmup_left)
        if due:
            self.pending = 0
        return due


def _row_feed(kernel, config, arrays, run):
    """A :class:`~numpyro_sgmc.data.streaming.RowFeed` for file-backed data (``None`` for data
    in memory, or where one draw's rows would exceed ``MAX_DRAW_BYTES``: a full batch of a
    large memory map, read in place; refused for a zarr array). The kernel's ``init`` has
    checked that the model reads only its batch's rows
    (:func:`~numpyro_sgmc.data.streaming.check_file_rows`)."""
    if not any(files.file_backed(a) for a in arrays) or config.shards is not None:
        return None
    fed = files.fed_rows(arrays, config.spec.plates)
    feed = streaming.RowFeed(config.spec, config.batch_sampling, arrays, fed, run.num_chains,
                             run.num_chains > 1, kernel.num_steps, run.thinning)  # fmt: skip
    if feed.draw_bytes > files.MAX_DRAW_BYTES:
        feed.close()
        if any(validation.zarr_array(arrays[k]) for k in fed.leaves):
            raise ValueError(
                f"One draw of this kernel reads {feed.draw_bytes / 2**20:.0f} MB of rows "
                f"({kernel.num_steps} steps of its batches), more than one feed holds "
                f"({files.MAX_DRAW_BYTES / 2**20:.0f} MB), and a zarr array is only read by "
                "rows into memory. Use a smaller batch_size or num_steps, or write the data "
                "to .npy files (numpyro_sgmc.shuffle_to_disk), whose memory maps a draw this "
                "large reads in place."
            )
        return None
    return feed


def _first(x) -> int:
    """The first chain's value of a per-chain counter."""
    return int(np.ravel(np.asarray(x))[0])


def _buffer_rows(config, structure, batched, z, arrays) -> int:
    """Kept draws a chunk holds on the device: :data:`_CHUNK_ROWS`, or fewer where they
    would take more than :data:`_CHUNK_BYTES` (the buffer is filled and copied to the host
    once per chunk). It does not depend on the run's length, so that every run of a kernel
    on data of the same shapes shares the compiled chunk."""

    def constrained(z, arrays):
        args, kwargs = structure.rebuild(arrays)
        one = partial(constrain, config.spec, model_args=args, model_kwargs=kwargs)
        one = partial(one, exclude=config.exclude)
        return jax.vmap(one)(z) if batched else one(z)

    shapes = jax.eval_shape(constrained, z, arrays)
    per_draw = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    return max(1, min(_CHUNK_ROWS, _CHUNK_BYTES // max(1, per_draw)))


def _progress_bar(kernel, config, num_draws) -> EpochProgress:
    return EpochProgress(
        num_draws * kernel.num_steps,
        iterations_per_epoch=config.spec.num_data / total_batch(config.spec.plates),
        desc=f"{type(kernel).__name__} ",
    )


def _to_host(rows, batched, buffer):
    """The first ``rows`` kept draws of a chunk as NumPy, chain axis first (the buffer is
    copied whole and cut on the host: a slice on the device would compile once per length)."""
    x = np.asarray(buffer)[:rows].copy()  # not a view that would keep the whole buffer
    return np.swapaxes(x, 0, 1) if batched else x[None]


def _warn_divergences(kernel, before, after):
    """A :class:`~numpyro_sgmc.diagnostics.DivergenceWarning` for the chains that diverged
    for the first time in this call."""
    new = (after.num_diverging > 0) & (np.atleast_1d(before.num_diverging) == 0)
    if not np.any(new):
        return
    first = np.atleast_1d(np.asarray(after.last_state.divergence_iteration))[new]
    warn(
        divergence_message(
            type(kernel).__name__,
            kernel.step_size_label,
            int(np.min(first)),
            int(np.sum(new)),
            kernel.num_steps,
        ),
        DivergenceWarning,
    )


# ---- checkpoints --------------------------------------------------------------------------


def _settings(kernel, run) -> dict:
    """What every checkpoint of ``run`` records besides its state and draws."""
    return dict(
        kernel=type(kernel).__name__,
        num_warmup=run.num_warmup,
        thinning=run.thinning,
        num_chains=run.num_chains,
        fingerprint=run.fingerprint,
    )


def load_run(
    checkpoint, kernel: SGMCKernel, *model_args, model_kwargs=None, previous_checkpoint=False
) -> KernelRun:
    """The :class:`KernelRun` a checkpoint directory of :func:`run_kernel` holds, to continue
    with ``run_kernel(kernel, None, *model_args, num_samples=..., previous=run)``.

    ``kernel`` and the data are those of the run that wrote it: the checkpoint's fingerprint
    (:func:`~numpyro_sgmc.running.checkpoint.fingerprint`) is compared with theirs. The kernel
    is initialised on them once, for the state's structure and its compiled description; the
    state itself is the checkpoint's. Every file is checked against the checksum the
    checkpoint's metadata records.

    :param bool previous_checkpoint: read the checkpoint before the last one (kept until the
        next is complete), e.g. when the last one is damaged.
    :raises FileNotFoundError: no checkpoint in the directory.
    :raises ~numpyro_sgmc.running.checkpoint.CheckpointError: a file of the checkpoint missing
        or damaged (the message names it and says whether the previous checkpoint is intact).
    :raises ValueError: a checkpoint of another kernel, model, tuning or data (the message
        says what differs).
    """
    directory = os.fspath(checkpoint)
    saved = read(directory, previous=bool(previous_checkpoint))
    meta = saved.body
    if meta["kernel"] != type(kernel).__name__:
        raise ValueError(
            f"The checkpoint in {directory!r} is of a {meta['kernel']} run; got a "
            f"{type(kernel).__name__} kernel."
        )
    model = kernel.subsampled_model
    try:
        inspect.signature(model).bind(*model_args, **(model_kwargs or {}))
    except TypeError as err:  # a checkpoint holds the draws, not the data
        raise TypeError(
            f"load_run(checkpoint, kernel, *model_args, model_kwargs=...) takes the data the run "
            f"ran on, as run_kernel did: the model says {err}."
        ) from None
    except ValueError:  # no signature to bind (a C-implemented callable)
        pass
    model_args, model_kwargs = validation.as_arrays(model, model_args, model_kwargs)
    num_chains = int(meta["num_chains"])
    keys = random.key(0) if num_chains == 1 else random.split(random.key(0), num_chains)
    with warnings.catch_warnings(), streaming.runner():  # a template: not where the run stopped
        warnings.simplefilter("ignore", CentreWarning)
        template = kernel.init(keys, int(meta["num_warmup"]), None, model_args, model_kwargs)
    now = fingerprint(kernel, kernel.config, template.params, False, model_args, model_kwargs)
    found = differences(meta["fingerprint"], now)
    if found:
        raise ValueError(
            f"The checkpoint in {directory!r} is of another run: {'; '.join(found)}. load_run "
            "continues a run on the model, kernel settings and data it ran on."
        )
    state = _restored(template, saved.leaves)
    return KernelRun(
        saved.samples, state, np.atleast_1d(np.asarray(state.num_diverging)),
        int(meta["thinning"]), kernel, tuple(model_args), model_kwargs,
        int(meta["num_warmup"]), int(meta["num_draws"]), not meta["finished"], kernel.config,
        meta["fingerprint"],
    )  # fmt: skip


def _restored(template, values):
    """The state of ``template``'s structure with the checkpoint's leaf ``values``."""
    leaves, treedef = jax.tree.flatten(template)
    if len(values) != len(leaves):
        raise ValueError(
            f"The checkpoint's state has {len(values)} arrays, this kernel's {len(leaves)}: it "
            "was written by another kind of kernel or model."
        )
    restored = []
    for like, value in zip(leaves, values, strict=True):
        if jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key):
            value = random.wrap_key_data(value, impl=random.key_impl(like))
        else:
            value = jnp.asarray(value, like.dtype)
        if value.shape != like.shape:
            raise ValueError(
                f"The checkpoint's state has an array of shape {value.shape} where this kernel "
                f"on these data has {like.shape}: it was written for data of other shapes."
            )
        restored.append(value)
    return jax.tree.unflatten(treedef, restored)


def completed_samples(mcmc, group_by_chain: bool = False) -> dict:
    """The draws an ``MCMC.run`` of these kernels made before a Ctrl-C stopped it.

    After an interrupt, ``MCMC`` still returns ``num_samples`` draws per chain; those after
    the interrupt repeat the last state and are flagged in the ``interrupted`` field
    (:class:`~numpyro_sgmc.data.progress.RunWatch`). This drops them: each chain's draws before it,
    concatenated (or, with ``group_by_chain``, cut to the shortest chain's).
    """
    fields = mcmc.get_extra_fields(group_by_chain=True)
    if "interrupted" not in fields:
        raise ValueError(
            "completed_samples takes an MCMC run of the kernels of numpyro_sgmc (their draws "
            "carry the 'interrupted' field)."
        )
    made = np.sum(~np.asarray(fields["interrupted"]), axis=1)
    samples = mcmc.get_samples(group_by_chain=True)
    if group_by_chain:
        return {k: v[:, : int(made.min())] for k, v in samples.items()}
    return {
        k: jnp.concatenate([v[c, : int(made[c])] for c in range(len(made))])
        for k, v in samples.items()
    }
