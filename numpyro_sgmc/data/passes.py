"""Full-data passes: the exact potential and gradient over every row.

A pass computes ``(U(θ), -∇U(θ)/n)`` at one point or at several at once (the warm start's
restarts), for the Newton polish, the warm start's modes, the linearity profile's anchor and
the control variates' centre. Every plate is split into the same number ``C`` of contiguous
chunks, each row weighted 1 and the prior ``1/C``
(:func:`~numpyro_sgmc.data.model.chunked_batches`), so that the chunks' potentials sum to ``U``
exactly.

* **Data in memory**: one compiled program over the arrays, a scan over the chunks
  (:func:`~numpyro_sgmc.data.gradients.full_data_gradient`).
* **File-backed data** (:func:`~numpyro_sgmc.data.files.file_backed`): no compiled program
  takes the file. A background thread reads the next chunk's rows of every per-row argument
  (:func:`~numpyro_sgmc.data.files.fed_rows`) as one contiguous slice each, while one
  compiled program of a chunk's shape evaluates the chunk before it; the chunks' sums are
  added on the host in float64. Memory holds two chunks (:data:`CHUNK_BYTES` each, or
  ``chunk_size`` rows if fewer), whatever ``n``, and an accelerator receives one chunk at a
  time instead of a copy of the file.

Each chunk read from a file is checked for NaN and infinite rows on the way, so a pass over a
file is also its data check (``numpyro_sgmc.data.validation.record_file_counts``): the
tuner's first pass replaces the check's own pass over the file, and a non-finite row found
there raises the data check's message, with the row.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_sgmc import host
from numpyro_sgmc.compilation import one_shot_jit
from numpyro_sgmc.data import validation
from numpyro_sgmc.data.files import FedRows, fed_rows, file_backed, read_rows
from numpyro_sgmc.data.gradients import full_data_sums
from numpyro_sgmc.data.model import ModelSpec, potential, split_args
from numpyro_sgmc.data.subsample import Batch

__all__ = ["CHUNK_BYTES", "exact_gradient", "streams"]

CHUNK_BYTES = 2**24
"""Bytes of per-row arguments one chunk of a pass over file-backed data holds (16 MB)."""


class _Chunks(NamedTuple):
    """A pass's partition of file-backed data: ``count`` chunks, ``lengths`` rows of each
    plate per chunk (plate name -> rows)."""

    count: int
    lengths: dict


def streams(arrays, plates) -> bool:
    """Whether a pass over these arrays reads them in host chunks: some argument is
    file-backed and the per-row arguments of every plate are known
    (:func:`~numpyro_sgmc.data.files.fed_rows`; otherwise the files are read in place)."""
    if not any(file_backed(x) for x in arrays):
        return False
    try:
        fed_rows(arrays, plates)
    except ValueError:
        return False
    return True


def exact_gradient(spec: ModelSpec, position: dict, model_args, model_kwargs, chunk_size=65536,
                   batched: bool = False):  # fmt: skip
    """``(U(θ), -∇U(θ)/n)`` over every row (module docstring). ``batched``: ``position`` has a
    leading axis of points, and both results gain it (one pass for all of them).

    The gradient is a JAX array of the position's dtype. ``U`` is one too for one point in
    memory; a NumPy float64 from files (the chunks added in float64: at ``n = 10⁹`` a float32
    potential's rounding is tens of nats) and for several points.

    :raises ValueError: a file-backed argument with NaN or infinite rows (the data check's
        message, ``numpyro_sgmc.data.validation.check_finite_data``).
    """
    arrays, structure = split_args(model_args, model_kwargs)
    if not streams(arrays, spec.plates):  # one program of one point (a program less)
        if not batched:
            return _in_memory(spec, structure, int(chunk_size), position, arrays)
        points = range(jax.tree.leaves(position)[0].shape[0])
        found = [
            _in_memory(spec, structure, int(chunk_size), host.take(position, k), arrays)
            for k in points
        ]
        values = np.array([float(u) for u, _ in found])
        stacked = lambda *g: host.device_array(np.stack([np.asarray(v) for v in g]))  # noqa: E731
        return values, jax.tree.map(stacked, *(g for _, g in found))
    fed = fed_rows(arrays, spec.plates)
    chunks = _partition(spec, arrays, fed, int(chunk_size))
    rest = tuple(None if k in fed.leaves else a for k, a in enumerate(arrays))
    reader = _ChunkReader(arrays, fed, chunks)
    total = None
    pending = None  # the chunk in flight: its sums are read once the next one is dispatched
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(reader.read, 0)
        for c in range(chunks.count):
            rows, weights = ahead.result()
            if c + 1 < chunks.count:
                ahead = pool.submit(reader.read, c + 1)
            sums = _chunk_sums(
                spec, structure, fed, batched, position, rest, rows, weights,
                np.float32(1.0 / chunks.count),
            )  # fmt: skip
            if pending is not None:
                total = _added(total, pending)
            pending = sums
    total = _added(total, pending)
    reader.record(model_args, model_kwargs, spec)
    value, grad = total
    dtype = jax.tree.leaves(position)[0].dtype
    grad = jax.tree.map(lambda g: jnp.asarray(-g / spec.num_data, dtype), grad)
    return (value if batched else value.item()), grad


def _added(total, sums):
    sums = jax.tree.map(lambda s: np.asarray(s, np.float64), sums)
    return sums if total is None else jax.tree.map(np.add, total, sums)


def _partition(spec, arrays, fed: FedRows, chunk_size: int) -> _Chunks:
    """As many chunks as :func:`~numpyro_sgmc.data.model.chunked_batches` makes of
    ``chunk_size`` rows, or more where a chunk's rows would exceed :data:`CHUNK_BYTES`."""
    row_bytes = {p.name: 0 for p in spec.plates}
    for k, name in zip(fed.leaves, fed.plates, strict=True):
        x = arrays[k]
        row_bytes[name] += math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize
    count = max(
        max(math.ceil(p.size / chunk_size), math.ceil(p.size * row_bytes[p.name] / CHUNK_BYTES))
        for p in spec.plates
    )
    return _Chunks(count, {p.name: math.ceil(p.size / count) for p in spec.plates})


class _ChunkReader:
    """Chunk ``c``'s rows of every per-row argument, padded to the chunk's length with the
    plate's last row (weight 0), and its rows' weights; the NaN and infinite rows seen."""

    def __init__(self, arrays, fed: FedRows, chunks: _Chunks):
        self.arrays, self.fed, self.chunks = arrays, fed, chunks
        self.bad = {k: [0, None] for k in fed.leaves}  # leaf -> [count, first row]
        self.sizes = {name: None for name in fed.plates}
        for k, name in zip(fed.leaves, fed.plates, strict=True):
            self.sizes[name] = arrays[k].shape[0]

    def read(self, c: int):
        rows, weights = [], {}
        for name, size in self.sizes.items():
            length = self.chunks.lengths[name]
            start = c * length
            valid = np.clip(size - start, 0, length)
            weights[name] = (np.arange(length) < valid).astype(np.float32)
        for k, name in zip(self.fed.leaves, self.fed.plates, strict=True):
            x, length = self.arrays[k], self.chunks.lengths[name]
            start = c * length
            chunk = read_rows(x, start, start + length)
            self._check(k, chunk, start)
            if len(chunk) < length:  # the last chunk: padded with the last row, weight 0
                last = read_rows(x, x.shape[0] - 1, x.shape[0])
                chunk = np.concatenate([chunk] + [last] * (length - len(chunk)))
            rows.append(chunk)
        return tuple(rows), weights

    def _check(self, k, chunk, start):
        if chunk.dtype.kind not in "fc" or not len(chunk):
            return
        bad = ~np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1)
        found = int(np.count_nonzero(bad))
        if found:
            seen = self.bad[k]
            seen[0] += found
            if seen[1] is None:
                seen[1] = start + int(np.argmax(bad))

    def record(self, model_args, model_kwargs, spec):
        """The counts of every file read whole, for the data check; its error if any."""
        for k in self.fed.leaves:
            count, first = self.bad[k]
            validation.record_file_counts(self.arrays[k], (count, first or 0))
        if any(count for count, _ in self.bad.values()):
            validation.check_finite_data(spec.model, model_args, model_kwargs)


@one_shot_jit(("spec", "structure", "fed", "batched"), rows=lambda spec, **_: spec.num_data)
def _chunk_sums(spec, structure, fed, batched, position, rest, rows, weights, global_weight):
    """``(U_c, ∇U_c)`` of one chunk: the per-row arguments are the chunk's rows, the batch
    every one of them, each weighted (0 for padding), the prior weighted ``global_weight``."""
    leaves = list(rest)
    for k, r in zip(fed.leaves, rows, strict=True):
        leaves[k] = r
    args, kwargs = structure.rebuild(leaves)
    batch = Batch({n: jnp.arange(w.shape[0]) for n, w in weights.items()}, weights, global_weight)
    value_and_grad = jax.value_and_grad(lambda z: potential(spec, z, batch, args, kwargs))
    return jax.vmap(value_and_grad)(position) if batched else value_and_grad(position)


@one_shot_jit(("spec", "structure", "chunk_size"), rows=lambda spec, **_: spec.num_data)
def _in_memory(spec, structure, chunk_size, position, arrays):
    """The pass over data in memory: one program, the chunks scanned."""
    args, kwargs = structure.rebuild(arrays)
    value, total = full_data_sums(spec, position, args, kwargs, chunk_size)
    return value, jax.tree.map(lambda g: -g / spec.num_data, total)
