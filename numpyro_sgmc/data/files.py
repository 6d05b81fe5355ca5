"""File-backed model arguments: which they are, and their rows read into memory.

A model argument is file-backed when it is a NumPy memory map of a file
(``np.load(path, mmap_mode="r")``, ``np.lib.format.open_memmap``, or a view of one) or a zarr
array (zarr 3, ``zarr.open_array(path, mode="r")``: chunked and compressed, on any store). Its
per-row arguments (:func:`fed_rows`) are read by the rows a program uses, never handed whole
to a compiled program (on an accelerator that would be a copy of the file in device memory):

* a row sample (the warm start's epochs, the information rows, the rows of the Newton solves,
  the checks' rows) by :func:`rows_in_memory`, each distinct row once per pass, in file
  order, sparse rows through a mapping without read-ahead (:func:`random_access`). Evaluated
  in place, each random row of a file beyond RAM is a page fault that reads ahead a block of
  neighbours (measured: the warm start's 5 epochs on a sample of 10⁶ rows read a 4.4 GB file
  from disk again and again for over 5 minutes);
* the first batch (a model's start, its constrained values, the prior's terms) by
  :func:`first_rows`;
* every row in chunks, by :mod:`~numpyro_sgmc.data.passes` (full-data passes) and
  :mod:`~numpyro_sgmc.data.streaming` (the sampler's batches).
"""

from __future__ import annotations

import math
import mmap
from typing import NamedTuple

import jax
import numpy as np

from numpyro_sgmc.data.subsample import Batch
from numpyro_sgmc.data.validation import file_backed, file_position, zarr_array

__all__ = [
    "MAX_DRAW_BYTES",
    "SPARSE_GAP",
    "FedRows",
    "check_zarr_arguments",
    "fed_rows",
    "file_backed",
    "first_rows",
    "random_access",
    "read_rows",
    "rows_in_memory",
    "take_rows",
]

MAX_DRAW_BYTES = 2**28
"""Rows of one draw (``num_steps`` batches), or of one gather of a tuner's row sample
(:func:`rows_in_memory`), above which the data are read in place."""


def _jax_dtype(rows: np.ndarray) -> np.ndarray:
    """Rows read from a file in JAX's dtype (a zarr array of ``float64`` is cast by chunk; a
    memory map of another dtype than JAX's has been refused or cast whole,
    ``numpyro_sgmc.data.validation.as_arrays``)."""
    dtype = jax.dtypes.canonicalize_dtype(rows.dtype)
    return rows if rows.dtype == dtype else rows.astype(dtype)


def read_rows(x, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``x``, in memory: one contiguous read."""
    return _jax_dtype(np.asarray(x[start:stop]))


def take_rows(x, rows) -> np.ndarray:
    """The rows ``rows`` (integer indices, any order) of ``x``, in memory: a zarr array reads
    the chunks that hold them; a memory map gathers them, each page through a mapping without
    read-ahead where they are sparse (:func:`random_access`)."""
    rows = np.asarray(rows)
    if zarr_array(x):
        return _jax_dtype(np.asarray(x.oindex[rows]))
    return _jax_dtype(np.take(np.asarray(random_access(x, len(rows))), rows, axis=0))


SPARSE_GAP = 2**16
"""Bytes of file per row read (on average) above which a gather reads each row's page alone."""


def random_access(x, num_rows: int):
    """``x`` for a gather of about ``num_rows`` scattered rows: where they are sparse in its
    file (more than :data:`SPARSE_GAP` bytes apart on average), the same data through a
    mapping of its own advised ``MADV_RANDOM``, so that a page fault reads that page alone.
    On the user's mapping the kernel reads ahead around each fault (``read_ahead_kb``: 128 KB
    to 8 MB), and a gather of 1,024 rows from a 4.4 GB file beyond RAM read 3.8 GB. ``x``
    itself for data in memory, dense rows, or a platform without ``madvise``."""
    position = file_position(x)
    if position is None or not hasattr(mmap, "MADV_RANDOM") or min(x.strides, default=0) < 0:
        return x
    if x.nbytes < SPARSE_GAP * max(num_rows, 1):
        return x
    filename, start = position
    with open(filename, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_RANDOM)
    return np.ndarray(x.shape, x.dtype, buffer=mapped, offset=start, strides=x.strides)


class FedRows(NamedTuple):
    """Which model-argument arrays a run feeds row by row.

    :param tuple leaves: positions (in :func:`~numpyro_sgmc.data.model.split_args`'s
        arrays) of the arguments whose rows are a subsample plate's.
    :param tuple plates: the plate name of each of them.
    """

    leaves: tuple
    plates: tuple


def fed_rows(arrays, plates) -> FedRows:
    """The arrays to feed: those with as many rows as a subsample plate has data (each plate's
    data are its per-row arguments, as for sharded data, :mod:`~numpyro_sgmc.data.sharding`).

    :raises ValueError: two plates of the same size (the rows would be ambiguous), or a plate
        of which no argument has its rows.
    """
    sizes = {}
    for p in plates:
        if p.size in sizes:
            raise ValueError(
                f"Subsample plates '{sizes[p.size]}' and '{p.name}' both have {p.size} rows, so "
                "the per-row arguments of file-backed data are ambiguous. Load the data of one "
                "of them into memory, or run the model with numpyro.infer.MCMC on in-memory "
                "arrays."
            )
        sizes[p.size] = p.name
    leaves, names = [], []
    for k, x in enumerate(arrays):
        name = sizes.get(np.shape(x)[0]) if np.ndim(x) else None
        if name is not None:
            leaves.append(k)
            names.append(name)
    for p in plates:
        if p.name not in names:
            raise ValueError(
                f"Subsample plate '{p.name}' ({p.size} rows) has no model argument with "
                f"{p.size} rows; with file-backed data the per-row arguments are fed one "
                "batch at a time, found by their number of rows."
            )
    return FedRows(tuple(leaves), tuple(names))


def rows_in_memory(arrays: tuple, plates: tuple, indices):
    """``(arrays, indices)`` for a compiled pass over the rows ``indices`` (plate name -> integer
    indices, or ``None`` for every row; or a :class:`~numpyro_sgmc.data.subsample.Batch`, whose
    indices are replaced) of file-backed data: every per-row argument of a plate
    (:func:`fed_rows`) replaced by its rows at the distinct indices, read once and in file
    order, and the indices by their positions among them (every row: the whole argument read
    into memory, the indices left ``None``). The pass computes what it computes
    in place (the model's plates keep their sizes, ``data_indexed_model``). The rows are
    padded to as many as there are indices, so a pass compiles once per sample size.

    Data in memory, per-row arguments whose plate is ambiguous (two plates of one size), and
    memory maps' rows of more than :data:`MAX_DRAW_BYTES` are returned as they are (read in
    place); a zarr array's rows are always read.
    """
    if isinstance(indices, Batch):
        arrays, rows = rows_in_memory(arrays, plates, indices.indices)
        return arrays, indices._replace(indices=rows)
    if not any(file_backed(x) for x in arrays):
        return arrays, indices
    try:
        fed = fed_rows(arrays, plates)
    except ValueError:
        return arrays, indices
    leaves, out, taken = list(arrays), dict(indices), {}
    for name, rows in indices.items():
        if name not in fed.plates:
            continue
        own = [arrays[k] for k, p in zip(*fed, strict=True) if p == name]
        row_bytes = sum(x[:1].nbytes for x in own)
        # a memory map too large to copy is read in place; a zarr array cannot be
        bound = math.inf if any(zarr_array(x) for x in own) else MAX_DRAW_BYTES
        if rows is None:  # every row, in memory where they are few
            if own[0].shape[0] * row_bytes <= bound:
                taken[name] = slice(None)
            continue
        flat = np.asarray(rows).ravel()
        if flat.size * row_bytes > bound:  # a sample near the whole data
            continue
        distinct, position = np.unique(flat, return_inverse=True)
        taken[name] = np.pad(distinct, (0, flat.size - distinct.size), mode="edge")
        out[name] = position.reshape(np.shape(rows)).astype(np.int32)
    for k, name in zip(fed.leaves, fed.plates, strict=True):
        if isinstance(taken.get(name), slice):
            leaves[k] = np.array(read_rows(arrays[k], 0, arrays[k].shape[0]))  # not a np.memmap
        elif name in taken:
            leaves[k] = take_rows(arrays[k], taken[name])
    return tuple(leaves), out


def first_rows(arrays: tuple, plates: tuple) -> tuple:
    """``arrays`` with each file-backed per-row argument (:func:`fed_rows`) cut to its plate's
    first ``b_p`` rows, read into memory: all that a program on the first batch
    (:func:`~numpyro_sgmc.data.subsample.first_batch`) or on no rows (the prior's terms) reads
    of it. The plates keep their sizes (``data_indexed_model``), so the program computes what
    it computes on the whole argument. As :func:`rows_in_memory`, data in memory, ambiguous
    plates and memory maps' rows of more than :data:`MAX_DRAW_BYTES` are left as they are.
    A plate's per-row arguments are cut together, those in memory too: a memory-mapped ``X``
    cut beside a whole ``y`` in memory gave the plate two lengths."""
    if not any(file_backed(x) for x in arrays):
        return arrays
    try:
        fed = fed_rows(arrays, plates)
    except ValueError:
        return arrays
    batch = {p.name: p.batch_size for p in plates}
    leaves = list(arrays)
    for name in set(fed.plates):
        own = [k for k, p in zip(*fed, strict=True) if p == name]
        row_bytes = sum(arrays[k][:1].nbytes for k in own)
        small = batch[name] * row_bytes <= MAX_DRAW_BYTES
        if any(file_backed(arrays[k]) for k in own) and (
            small or any(zarr_array(arrays[k]) for k in own)
        ):
            for k in own:
                leaves[k] = np.array(read_rows(arrays[k], 0, batch[name]))
    return tuple(leaves)


def check_zarr_arguments(arrays: tuple, plates: tuple):
    """Zarr arrays are read by rows of a subsample plate, so each must be one's per-row
    argument (:func:`fed_rows`).

    :raises ValueError: a zarr array with no plate of its length (a table the model uses
        whole), or two plates of one size.
    """
    found = [k for k, x in enumerate(arrays) if zarr_array(x)]
    if not found:
        return
    fed = fed_rows(arrays, plates)
    for k in found:
        if k not in fed.leaves:
            shape = tuple(arrays[k].shape)
            raise ValueError(
                f"A zarr array of shape {shape} is not the data of a subsample plate (none has "
                f"{shape[0] if shape else 0} rows). The kernels read zarr arrays by the rows of "
                "a plate's batches and passes, never whole; pass an argument the model uses "
                "whole (a table of group-level values, say) as a NumPy array: np.asarray(z[:])."
            )
