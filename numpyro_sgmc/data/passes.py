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
  takes the file whole. The rows are cut into host chunks of at most :data:`CHUNK_BYTES`,
  each of parts of at most ``chunk_size`` rows; one compiled program evaluates a chunk (a
  scan over its parts) while a background thread prepares the next (``_ChunkReader``:
  a ``.npy`` file's chunk is a view of the map whose pages are read ahead; a zarr array's is
  read into memory), and the chunks' sums are added on the host in float64 (at ``n = 10⁸`` a
  float32 sum of the potential was 880 nats off). Memory holds two chunks whatever ``n``, and
  an accelerator receives one chunk at a time instead of a copy of the file. Measured on
  this project's machine, a pass over 10⁸ rows (4.4 GB, beyond the page cache): 3.3 s, as
  fast as one compiled program over the whole memory map (3.1-3.6 s).

The chunk program also counts each chunk's rows with a NaN or an infinite value, so a pass
over a file is its data check too (``numpyro_sgmc.data.validation.record_file_counts``):
``autotune``'s first pass replaces the check's own pass over the file, and a non-finite row
found there raises the data check's message, with the row.
"""

from __future__ import annotations

import math
import mmap
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
from numpyro_sgmc.data.model import ModelSpec, check_data, potential, split_args
from numpyro_sgmc.data.subsample import Batch

__all__ = ["CHUNK_BYTES", "exact_gradient", "streams"]

CHUNK_BYTES = 2**24
"""Bytes of per-row arguments one chunk of a pass over file-backed data holds (16 MB)."""

TOUCH_THREADS = 2
"""Threads reading a chunk's pages of a ``.npy`` file ahead of its evaluation: one thread's
page faults read a file beyond the page cache at 0.57 GB/s on this project's machine, two at
0.95 GB/s (the kernel's read-ahead around each fault)."""

ALIGN = 64
"""Rows a part's length is a multiple of: every chunk of a memory map then starts 64-byte
aligned where the file's data do, which JAX's CPU backend reads in place."""


class _Chunks(NamedTuple):
    """A pass's partition of file-backed data: ``count`` host chunks of ``parts`` parts each,
    ``lengths`` rows of each plate per part (plate name -> rows; a chunk holds ``parts``
    times that)."""

    count: int
    parts: int
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
    memory; a NumPy float64 from files (the chunks added in float64: over 10⁸ rows the
    float32 sum of a potential of 6.9·10⁷ nats was 880 nats off) and for several points.

    :raises ValueError: a file-backed argument with NaN or infinite rows (the data check's
        message, :func:`~numpyro_sgmc.data.model.check_data`).
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
    total, bad = None, {k: [0, None] for k in fed.leaves}  # non-finite rows: count, first
    lengths = [chunks.parts * chunks.lengths[name] for name in fed.plates]  # rows per chunk
    pending = None  # the chunk in flight: its sums are read once the next one is dispatched
    try:
        with ThreadPoolExecutor(1) as pool:
            ahead = pool.submit(reader.read, 0)
            for c in range(chunks.count):
                rows, weights = ahead.result()
                if c + 1 < chunks.count:
                    ahead = pool.submit(reader.read, c + 1)
                found = _chunk_sums(
                    spec, structure, fed, batched, chunks.parts, position, rest, rows, weights,
                    np.float32(1.0 / (chunks.count * chunks.parts)),
                )  # fmt: skip
                if pending is not None:
                    total = _added(total, bad, *pending)
                pending = ([c * n for n in lengths], found)
        total = _added(total, bad, *pending)
    finally:
        reader.close()
    _record(
        arrays, bad, model_args, model_kwargs, spec, host.take(position) if batched else position
    )
    value, grad = total
    dtype = jax.tree.leaves(position)[0].dtype
    grad = jax.tree.map(lambda g: jnp.asarray(-g / spec.num_data, dtype), grad)
    return (value if batched else value.item()), grad


def _added(total, bad, starts, found):
    """``total`` plus a chunk's sums (in float64); its non-finite rows added to ``bad``, the
    first at its row in the file (the chunk starts at row ``starts[j]`` of argument ``j``)."""
    sums, (counts, firsts) = found
    for k, start, count, first in zip(bad, starts, np.asarray(counts), np.asarray(firsts),
                                      strict=True):  # fmt: skip
        seen = bad[k]
        seen[0] += int(count)
        if count and seen[1] is None:
            seen[1] = start + int(first)
    sums = jax.tree.map(lambda v: np.asarray(v, np.float64), sums)
    return sums if total is None else jax.tree.map(np.add, total, sums)


def _record(arrays, bad, model_args, model_kwargs, spec, z):
    """The non-finite rows of every file a pass read whole, for the data check; its error
    if any, unless the model masks them at ``z`` (:func:`~numpyro_sgmc.data.model.check_data`)."""
    for k, (count, first) in bad.items():
        validation.record_file_counts(arrays[k], (count, 0 if first is None else first))
    if any(count for count, _ in bad.values()):
        check_data(spec, z, model_args, model_kwargs)


def _partition(spec, arrays, fed: FedRows, chunk_size: int) -> _Chunks:
    """Parts of at most ``chunk_size`` rows (what a compiled step holds, as in memory,
    :func:`~numpyro_sgmc.data.model.chunked_batches`), as many to a host chunk as fit in
    :data:`CHUNK_BYTES` (one read, one call of the chunk program, which scans its parts)."""
    row_bytes = {p.name: 0 for p in spec.plates}
    for k, name in zip(fed.leaves, fed.plates, strict=True):
        x = arrays[k]
        row_bytes[name] += math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize
    parts = max(
        max(math.ceil(p.size / chunk_size) for p in spec.plates),
        math.ceil(sum(p.size * row_bytes[p.name] for p in spec.plates) / CHUNK_BYTES),
    )
    part_bytes = sum(math.ceil(p.size / parts) * row_bytes[p.name] for p in spec.plates)
    per_chunk = max(1, min(parts, CHUNK_BYTES // max(part_bytes, 1)))
    count = math.ceil(parts / per_chunk)
    parts = count * per_chunk
    # parts of whole multiples of 64 rows: every chunk of a memory map starts 64-byte
    # aligned where the file's data do, which JAX's CPU backend then reads in place
    lengths = {p.name: ALIGN * math.ceil(p.size / parts / ALIGN) for p in spec.plates}
    return _Chunks(count, per_chunk, lengths)


class _ChunkReader:
    """Chunk ``c``'s rows of every per-row argument, as ``(parts, rows, ...)``, on the device,
    padded to the chunk's length with the plate's last row (weight 0); each row's weight.

    A ``.npy`` file's chunk is a view of its memory map, 64-byte aligned
    (:func:`_partition`), whose pages :data:`TOUCH_THREADS` threads read into the page cache
    while the chunk before it is evaluated: JAX's CPU backend then reads the view in place,
    an accelerator gets a copy of the chunk. A zarr array's chunk is read into memory."""

    def __init__(self, arrays, fed: FedRows, chunks: _Chunks):
        self.fed, self.chunks = fed, chunks
        self.arrays = {k: arrays[k] for k in fed.leaves}
        self.touching = ThreadPoolExecutor(TOUCH_THREADS)
        self.sizes = {name: arrays[k].shape[0] for k, name in zip(*fed, strict=True)}

    def read(self, c: int):
        rows, weights = [], {}
        parts = self.chunks.parts
        for name, size in self.sizes.items():
            length = parts * self.chunks.lengths[name]
            valid = np.clip(size - c * length, 0, length)
            weights[name] = (np.arange(length) < valid).astype(np.float32).reshape(parts, -1)
        for k, name in zip(self.fed.leaves, self.fed.plates, strict=True):
            x, length = self.arrays[k], parts * self.chunks.lengths[name]
            start = c * length
            stop = min(start + length, x.shape[0])
            chunk = self._rows(x, start, stop)
            if len(chunk) < length:  # the last chunk: padded with the last row, weight 0
                last = read_rows(x, x.shape[0] - 1, x.shape[0])
                chunk = np.concatenate([chunk, np.repeat(last, length - len(chunk), axis=0)])
            rows.append(chunk.reshape((parts, -1) + chunk.shape[1:]))
        return jax.device_put((tuple(rows), weights))

    def _rows(self, x, start, stop):
        """A memory map's view, its pages read into the page cache here (JAX's CPU backend
        then reads it in place), else the rows read into memory."""
        if not isinstance(x, np.ndarray) or x.dtype != jax.dtypes.canonicalize_dtype(x.dtype):
            return read_rows(x, start, stop)
        view = x[start:stop]
        if view.size and view.flags.c_contiguous:
            pages = view.reshape(-1)[:: max(1, mmap.PAGESIZE // view.itemsize)]
            list(self.touching.map(np.sum, np.array_split(pages, TOUCH_THREADS)))
        return view

    def close(self):
        self.touching.shutdown()


@one_shot_jit(
    ("spec", "structure", "fed", "batched", "parts"),
    rows=lambda spec, **_: spec.num_data,
    fused=True,
)
def _chunk_sums(spec, structure, fed, batched, parts, position, rest, rows, weights,
                global_weight):  # fmt: skip
    """``((U_c, ∇U_c), non-finite rows)`` of one host chunk, a scan over its ``parts``
    (leading axis of ``rows`` and ``weights``): in each, the per-row arguments are the part's
    rows, the batch every one of them, each weighted (0 for padding), the prior weighted
    ``global_weight``; and :func:`_nonfinite` of the chunk's rows."""

    def sums(part_rows, part_weights):
        leaves = list(rest)
        for k, r in zip(fed.leaves, part_rows, strict=True):
            leaves[k] = r
        args, kwargs = structure.rebuild(leaves)
        indices = {n: jnp.arange(w.shape[0]) for n, w in part_weights.items()}
        batch = Batch(indices, part_weights, global_weight)
        value_and_grad = jax.value_and_grad(lambda z: potential(spec, z, batch, args, kwargs))
        return jax.vmap(value_and_grad)(position) if batched else value_and_grad(position)

    def body(total, part):
        return jax.tree.map(jnp.add, total, sums(*part)), None

    shapes = jax.eval_shape(sums, *jax.tree.map(lambda v: v[0], (rows, weights)))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, _ = jax.lax.scan(body, zeros, (rows, weights))
    return total, _nonfinite(fed, rows, weights)


def _nonfinite(fed, rows, weights):
    """Per fed argument, ``(count, first)``: its rows in the chunk (weight > 0) with a NaN or
    an infinite entry, and the index in the chunk of the first of them."""
    counts, firsts = [], []
    for r, name in zip(rows, fed.plates, strict=True):
        valid = jnp.ravel(weights[name]) > 0
        flat = jnp.reshape(r, (valid.shape[0], -1))
        finite = jnp.all(jnp.isfinite(flat), axis=1) if jnp.issubdtype(r.dtype, jnp.inexact) \
            else jnp.ones_like(valid)  # fmt: skip
        bad = valid & ~finite
        counts.append(jnp.sum(bad))
        firsts.append(jnp.argmax(bad))
    return jnp.stack(counts), jnp.stack(firsts)


@one_shot_jit(("spec", "structure", "chunk_size"), rows=lambda spec, **_: spec.num_data, fused=True)
def _in_memory(spec, structure, chunk_size, position, arrays):
    """The pass over data in memory: one program, the chunks scanned."""
    args, kwargs = structure.rebuild(arrays)
    value, total = full_data_sums(spec, position, args, kwargs, chunk_size)
    return value, jax.tree.map(lambda g: -g / spec.num_data, total)
