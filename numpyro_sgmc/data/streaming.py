"""Batches read from file-backed data ahead of the steps that use them.

A chain's batches are a function of its key and its batch sampler's state alone
(:mod:`~numpyro_sgmc.data.gradients`): step ``t`` splits the key in three and draws its
indices with the second (:mod:`~numpyro_sgmc.data.batches`), whatever the position. So the
indices of the next ``S`` steps can be drawn before the steps run, by a small compiled program
of the key splits and the sampler only (:func:`batch_indices`). :class:`RowFeed` gathers those
rows of every per-row argument on the host (for ``batch_sampling="blocks"`` one ``preadv`` of
each batch's consecutive rows, :class:`BlockFile`; for the random samplers ``np.take`` on a
mapping that reads a page per row, :func:`~numpyro_sgmc.data.files.random_access`), stacks
them as ``(S, b_p, ...)`` and puts them on the device; the runner's compiled chunk then runs
the ``S`` steps with :func:`~numpyro_sgmc.data.gradients.minibatch` on fed rows, step ``t`` on the
``t``-th batch. The draws are those of the run on the same data in memory, for the same key
(the same batches, noise and updates, up to the order of floating-point sums).

A feed holds the batches of a fixed number of steps (whole draws, at most
:data:`FEED_BYTES`; the warm-up's last feed ends with it), so the chunk program compiles
once; the runner's chunks run on windows of the current feed, as many draws as take
``CHUNK_SECONDS``, while a background thread reads the next feed (NumPy's gather and the page
faults release the GIL). The reads cost no sampling time while they are faster than the
steps. What stays in memory: the non-per-row arguments, two feeds, and the pages of the file
the operating system caches.

The tuner's passes over a sample of rows read their rows once per pass
(:func:`~numpyro_sgmc.data.files.rows_in_memory`), and its passes over every row read them in
host chunks (:mod:`~numpyro_sgmc.data.passes`).

Before any of these, :func:`check_batch_rows_only` refuses a model that reads its per-row
arguments as a whole (which a fed step would compute from the batch alone); between feeds,
:meth:`RowFeed.check_files` refuses a file written to during the run.
"""

from __future__ import annotations

import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from numpyro_sgmc.data.batches import batch_sampler
from numpyro_sgmc.data.files import (
    FedRows,
    fed_rows,
    file_backed,
    random_access,
    read_rows,
    take_rows,
)
from numpyro_sgmc.data.gradients import sampler_state
from numpyro_sgmc.data.model import potential
from numpyro_sgmc.data.subsample import first_batch
from numpyro_sgmc.data.validation import file_position, zarr_array, zarr_version
from numpyro_sgmc.host import empty_aligned

__all__ = [
    "FEED_BYTES",
    "RowFeed",
    "batch_indices",
    "check_batch_rows_only",
    "check_file_rows",
    "refuse_in_mcmc",
    "runner",
]

FEED_BYTES = 2**26
"""Bytes of rows one feed holds (64 MB), or one kept draw's (``thinning`` draws) if more."""

_RUNNER = contextvars.ContextVar("numpyro_sgmc_runner", default=False)


@contextmanager
def runner():
    """Marks a kernel ``init`` as :func:`~numpyro_sgmc.run_kernel`'s (file-backed data
    allowed)."""
    token = _RUNNER.set(True)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def refuse_in_mcmc(name: str, model_args, model_kwargs):
    """A kernel's ``init`` outside :func:`~numpyro_sgmc.run_kernel` refuses file-backed data:
    ``MCMC`` passes every argument whole to its compiled loop (on an accelerator, a copy of
    the file in device memory; on CPU, random page reads from the file at every step)."""
    if _RUNNER.get():
        return
    leaves = jax.tree.leaves((tuple(model_args), dict(model_kwargs or {})))
    found = [x for x in leaves if file_backed(x)]
    if found:
        shapes = ", ".join(str(x.shape) for x in found)
        raise ValueError(
            f"A model argument is file-backed, a memory map or a zarr array (shape {shapes}). "
            "numpyro.infer.MCMC takes in-memory arrays: it hands every argument whole to its "
            "compiled loop. Run "
            f"this {name} kernel with numpyro_sgmc.run_kernel(kernel, key, *data, "
            "num_samples=...), which reads each batch's rows from the file on a background "
            "thread (or load the data into memory: np.array(X))."
        )


def _filename(x):
    """The file of the memory map ``x`` is (a view of), or ``None``."""
    position = file_position(x)
    return None if position is None else position[0]


def _stat(filename):
    try:
        found = os.stat(filename)
    except OSError:
        return None
    return found.st_ino, found.st_size, found.st_mtime_ns


def check_file_rows(spec, structure, arrays, z):
    """:func:`check_batch_rows_only` where any argument is file-backed and its per-row
    arguments are known (:func:`fed_rows`; otherwise they are read in place, and
    :func:`~numpyro_sgmc.run_kernel` refuses them by name)."""
    if not any(file_backed(x) for x in arrays):
        return
    try:
        fed = fed_rows(arrays, spec.plates)
    except ValueError:
        return
    check_batch_rows_only(spec, structure, arrays, fed, z)


@partial(jax.jit, static_argnames=("spec", "structure", "fed"))
def _potentials(spec, structure, fed, z, arrays, alone, within):
    """``(Ũ(z), ∇Ũ(z))`` on the batch of rows ``alone`` (the fed arguments cut to them), and
    on the same rows as the first of ``within`` (longer arrays of which they are the first
    rows). The gradient too: at a start where the data do not enter ``Ũ`` (coefficients at
    their prior mean of zero), its value is the same on any rows."""

    def on(rows):
        leaves = list(arrays)
        for k, r in zip(fed.leaves, rows, strict=True):
            leaves[k] = r
        args, kwargs = structure.rebuild(leaves)
        u, g = jax.value_and_grad(
            lambda z: potential(spec, z, first_batch(spec.plates), args, kwargs)
        )(z)
        return jnp.concatenate([u[None]] + [jnp.ravel(v) for v in jax.tree.leaves(g)])

    return on(alone), on(within)


def check_batch_rows_only(spec, structure, arrays, fed: FedRows, z):
    """The model reads its per-row arguments only at its batch's rows.

    A fed step gives the model only the batch's rows; a model that also uses its per-row
    arguments as a whole (``X.mean(0)`` to standardise them, ``y.max()``) would then compute
    those from the batch. ``Ũ`` and ``∇Ũ`` at ``z`` on the first ``b_p`` rows alone and on the
    same rows followed by ``b_p`` others (the next rows, or the same rows plus one) must agree.

    :raises ValueError: naming the arguments, the two values and the fix.
    """
    batch = {p.name: p.batch_size for p in spec.plates}
    alone, within = [], []
    for k, name in zip(fed.leaves, fed.plates, strict=True):
        x, b = arrays[k], batch[name]
        rows = read_rows(x, 0, b)
        other = read_rows(x, b, 2 * b) if x.shape[0] >= 2 * b else None
        if other is None or np.array_equal(other, rows):
            other = rows + np.ones((), rows.dtype) if rows.dtype.kind in "fc" else rows[::-1]
        alone.append(jax.device_put(rows))
        within.append(jax.device_put(np.concatenate([rows, other])))
    leaves = tuple(None if k in fed.leaves else jax.device_put(a) if isinstance(a, np.ndarray)
                   else a for k, a in enumerate(arrays))  # fmt: skip
    found = _potentials(spec, structure, fed, z, leaves, alone, within)
    first, second = (np.asarray(u, np.float64) for u in found)
    if not np.allclose(first, second, rtol=1e-5, atol=1e-5):
        u1, u2 = first[0], second[0]
        g1, g2 = np.linalg.norm(first[1:]), np.linalg.norm(second[1:])
        raise ValueError(
            "The model uses its per-row arguments beyond its batch's rows: on one batch its "
            f"potential is {u1:.6g} and its gradient's norm {g1:.6g} given those rows alone, "
            f"{u2:.6g} and {g2:.6g} given them among other rows (a statistic of the whole "
            "argument, such as X.mean(0) or y.max(), in the model). With file-backed data "
            "the tuner and run_kernel give the model only the rows of each batch. Compute "
            "such statistics once, outside the model, and pass them as arguments (in chunks "
            "for a file), or load the data into memory and use numpyro.infer.MCMC."
        )


@partial(jax.jit, static_argnames=("plates", "method", "length", "batched"))
def batch_indices(plates, method, length, batched, steps, rng_key, state):
    """The indices of the next ``steps`` (at most ``length``) steps of each chain, and the
    key and sampler state after them: the key splits of
    :func:`~numpyro_sgmc.kernels.core.build_kernel`'s ``step`` and the sampler's draws, without
    the steps. Returns ``(indices, rng_key, state)``, ``indices`` plate -> ``(length, b_p)``
    (chain axis first when ``batched``); the steps past ``steps`` repeat the last key."""
    sampler = batch_sampler(plates, method)

    def one(rng_key, state):
        def body(carry, t):
            key, state = carry
            key_next, key_gradient, _ = random.split(key, 3)
            batch, state_next = sampler.draw(state, key_gradient)
            carry = lax.cond(t < steps, lambda: (key_next, state_next), lambda: carry)
            return carry, batch.indices

        (rng_key, state), indices = lax.scan(body, (rng_key, state), np.arange(length))
        return indices, rng_key, state

    return jax.vmap(one)(rng_key, state) if batched else one(rng_key, state)


READ_THREADS = 8
"""Threads of the block reads of one feed: a read waits on the disk, not on the CPU (measured
on this project's machine beyond RAM: 3,700 blocks of 40 kB a second from one thread, 12,000
from eight)."""


class BlockFile:
    """Contiguous runs of rows of a file-backed, C-contiguous array, read with ``preadv``.

    A read asks the operating system for exactly the run's bytes, where a page fault in the
    memory map would read ahead of it (``read_ahead_kb``, up to megabytes for a batch of
    kilobytes): what ``batch_sampling="blocks"`` needs from a file beyond RAM.

    :param x: the array (:meth:`of` says whether one qualifies).
    """

    def __init__(self, x):
        filename, self.start = file_position(x)
        self.rows, self.row_bytes = x.shape[0], x[:1].nbytes
        self.fd = os.open(filename, os.O_RDONLY)

    @staticmethod
    def of(x):
        """A :class:`BlockFile` for ``x``, or ``None`` (in memory, or rows not contiguous)."""
        if file_position(x) is None or not x.flags.c_contiguous or not x.size:
            return None
        return BlockFile(x) if hasattr(os, "preadv") else None

    def read(self, out, first: int):
        """Rows ``first, first + 1, ...`` (wrapping after the last) into ``out`` (``(b, ...)``,
        C-contiguous)."""
        b = out.shape[0]
        head = min(b, self.rows - first)
        self._read(out[:head], self.start + first * self.row_bytes)
        if head < b:
            self._read(out[head:], self.start)

    def _read(self, out, offset: int):
        view = memoryview(out).cast("B")
        while len(view):
            got = os.preadv(self.fd, [view], offset)
            if got <= 0:
                raise OSError(f"The data file ended {len(view)} bytes early: was it truncated?")
            view, offset = view[got:], offset + got

    def close(self):
        os.close(self.fd)


class RowFeed:
    """The rows of each coming chunk's batches, read from the host arrays on a background
    thread (module docstring).

    :param spec: the model's :class:`~numpyro_sgmc.data.model.ModelSpec`.
    :param str method: the kernel's ``batch_sampling``.
    :param arrays: the model arguments' arrays (host or device), as
        :func:`~numpyro_sgmc.data.model.split_args` gives them.
    :param FedRows fed: which of them to feed (:func:`fed_rows`).
    :param int num_chains: chains of the run.
    :param bool batched: whether the state has a chain axis.
    :param int num_steps: iterations per draw; a feed holds whole draws.
    :param int thinning: draws per kept draw; a feed holds whole kept draws.
    """

    def __init__(self, spec, method, arrays, fed, num_chains, batched, num_steps, thinning):
        self.plates, self.method, self.fed, self.batched = spec.plates, method, fed, batched
        # a memory map stays one, a zarr array is read by rows
        self.sources = [arrays[k] if zarr_array(arrays[k]) else np.asarray(arrays[k])
                        for k in fed.leaves]  # fmt: skip
        batch = {p.name: p.batch_size for p in spec.plates}
        per_step = num_chains * sum(
            batch[name] * x[:1].nbytes for name, x in zip(fed.plates, self.sources, strict=True)
        )
        self.draw_bytes = per_step * num_steps
        self.draws = max(1, FEED_BYTES // max(1, self.draw_bytes) // thinning) * thinning
        self.length = self.draws * num_steps  # steps per feed: every feed has this shape
        self.num_steps = num_steps
        files = {_filename(x) for x in self.sources} - {None}
        self.files = {f: _stat(f) for f in files}
        # a zarr array is read anew at every feed: each read is checked against its version
        self.versions = [zarr_version(x) if zarr_array(x) else None for x in self.sources]
        if method != "blocks":  # scattered rows: a page each, without the kernel's read-ahead
            self.sources = [
                random_access(x, num_chains * self.length * batch[name])
                for name, x in zip(fed.plates, self.sources, strict=True)
            ]
        self.blocks = [BlockFile.of(x) if method == "blocks" else None for x in self.sources]
        self.readers = None
        if any(self.blocks):
            self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="numpyro_sgmc-read")
        self.key = self.state = self.sizes = self.next = None
        self.current, self.offset, self.size = (), 0, 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="numpyro_sgmc-rows")

    def start(self, state, warmup_draws: int, draws: int):
        """Read on from ``state`` (a kernel state, chain axis first when batched), for a run
        of ``draws`` more draws of which the first ``warmup_draws`` are warm-up. The warm-up's
        last feed ends with it, so that every later feed holds whole kept draws."""
        self.key, self.state = state.rng_key, sampler_state(state.estimator)
        self.sizes = self._sizes(warmup_draws, draws)
        self.current, self.offset = (), 0
        self.next = self._read()

    def window(self) -> tuple:
        """``(rows, offset, available)``: the feed the next chunk runs on, the draw of it to
        start at, and the draws left in it (the next feed's read starts when this one is
        taken)."""
        if self.offset == self.size and self.next is not None:
            (self.current, self.size), self.offset = self.next.result(), 0
            self.check_files()
            self.next = self._read()
        return self.current, self.offset, self.size - self.offset

    def check_files(self):
        """A file written to in place during the run is an error: its later batches would be
        of other data than the earlier ones. (A file deleted or replaced by another is not:
        the memory map still reads the data it was opened on.) A zarr array on a local store
        is checked after each feed's read (``_gather``), any change an error."""
        for filename, before in self.files.items():
            now = _stat(filename)
            if now is None or before is None or now[0] != before[0]:
                continue
            if now != before:
                raise ValueError(
                    f"The file '{filename}' was written to during the run (its size or "
                    "modification time changed): its later batches would be of other data "
                    "than the earlier ones. Leave data files unchanged while a run reads them; "
                    "write changed data to a new file and run on it."
                )

    def consume(self, draws: int):
        """Count ``draws`` of the current feed as run."""
        self.offset += draws

    def _sizes(self, warmup_draws, draws):
        for left in (warmup_draws, draws - warmup_draws):
            while left > 0:
                size = min(self.draws, left)
                left -= size
                yield size

    def _read(self):
        """A future of the next feed and its draws, or ``None`` after the last."""
        draws = next(self.sizes, None)
        if draws is None:
            return None
        steps = draws * self.num_steps
        indices, self.key, self.state = batch_indices(
            self.plates, self.method, self.length, self.batched, steps, self.key, self.state
        )
        return self.pool.submit(lambda: (self._gather(indices, steps), draws))

    def _gather(self, indices, steps):
        """The feed's rows of every fed argument, read into buffers that the CPU backend takes
        in place (:func:`~numpyro_sgmc.host.empty_aligned`); the steps past ``steps`` are
        left unread."""
        out, used = [], {}
        for name, source, block in zip(self.fed.plates, self.sources, self.blocks, strict=True):
            if name not in used:  # the steps this read is for, of every chain
                idx = np.asarray(indices[name])
                used[name] = idx[:, :steps] if self.batched else idx[:steps]
            idx = used[name]
            lead = (idx.shape[0], self.length) if self.batched else (self.length,)
            dtype = jax.dtypes.canonicalize_dtype(source.dtype)
            rows = empty_aligned(lead + idx.shape[-1:] + tuple(source.shape[1:]), dtype)
            part = rows[:, :steps] if self.batched else rows[:steps]
            if block is not None and dtype == source.dtype:
                self._blocks(block, idx, part)
            else:  # a cast, or random rows
                part[...] = take_rows(source, idx.reshape(-1)).reshape(part.shape)
            out.append(jax.device_put(rows))
        for source, version in zip(self.sources, self.versions, strict=True):
            if version is not None and zarr_version(source) != version:
                raise ValueError(
                    f"The zarr array at '{version[1]}' changed during the run (the count, size "
                    "or modification time of its files): a zarr array is read anew for every "
                    "feed of batches, so its later batches would be of other data than the "
                    "earlier ones, or of its fill value where chunks were deleted. Leave the "
                    "data unchanged while a run reads them; write changed data to a new array "
                    "and run on it."
                )
        return tuple(out)

    def _blocks(self, block, idx, out):
        """The batches' rows into ``out``, one read per batch: a ``"blocks"`` batch is
        consecutive rows (wrapping after the last) by construction
        (:func:`~numpyro_sgmc.data.batches.batch_sampler`). The batches are split over the
        reading threads (a task per batch would cost more than a cached read)."""
        batches = list(np.ndindex(idx.shape[:-1]))

        def read(share):
            for k in share:
                where = batches[k]
                block.read(out[where], int(idx[where + (0,)]))

        list(self.readers.map(read, np.array_split(np.arange(len(batches)), READ_THREADS)))

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.readers is not None:
            self.readers.shutdown(wait=True)
        for block in self.blocks:
            if block is not None:
                block.close()
