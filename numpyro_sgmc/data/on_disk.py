"""A shuffled copy of data on disk, in bounded memory: contiguous blocks become random batches.

``batch_sampling="blocks"`` reads ``b`` consecutive rows per step, which from a memory-mapped
file is one sequential read instead of ``b`` scattered ones (from a file larger than RAM, a
page of 4 KiB for each row of a few dozen bytes). Its batches are random batches only if the
rows are in random order, and :func:`~numpyro_sgmc.data.batches.shuffle_rows` needs the data
in memory. :func:`shuffle_to_disk` writes the shuffled copy with a bounded buffer instead, by
the two-pass shuffle of Rao (1961) and Sandelius (1962):

1. read the rows in chunks, in order, and append each row to one of ``K`` bucket files
   chosen uniformly at random;
2. read each bucket (of about ``n/K`` rows, sized to fit the buffer), permute it uniformly,
   and append it to the output.

The output is a uniformly random permutation of the rows (each of the ``n!`` orders has the
same probability: the buckets' sizes and contents are those of a uniform permutation cut
into ``K`` consecutive pieces), the same one for every array. It costs two sequential reads
and two sequential writes of the data; the buckets take as much disk as the data until the
second pass removes them. The files are written in the dtypes JAX computes in, so that a
``float64`` source is not cast (a copy in memory) on every use.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Mapping, Union

import jax
import numpy as np
from tqdm.auto import tqdm

from numpyro_sgmc import host

__all__ = ["shuffle_to_disk"]

_BUCKET_FILL = 0.25  # a bucket's expected size, as a share of the buffer (its size varies)


def shuffle_to_disk(
    rng_key,
    arrays: Union[Mapping[str, object], tuple, list],
    directory: Union[str, os.PathLike],
    memory_bytes: int = 2**30,
    progress: bool = True,
    overwrite: bool = False,
    jax_dtypes: bool = True,
):
    """Write the arrays with their rows (leading axis) in one common random order to
    ``directory/<name>.npy``, using at most about ``memory_bytes`` of memory, and return them
    memory-mapped (read-only).

    :param rng_key: JAX PRNG key: the order (the same for the same key and data).
    :param arrays: ``{name: array}`` (or a sequence, named ``arr_0``, ``arr_1``, ...), each
        with the same number of rows: NumPy arrays, memory maps
        (``np.load(path, mmap_mode="r")``), or anything NumPy can slice in row ranges
        (zarr, h5py datasets).
    :param directory: where the ``.npy`` files are written (created if missing). The buckets
        of the first pass are written in a temporary folder inside it: it needs free space
        about twice the data's size.
    :param int memory_bytes: the buffer: a quarter of it for the rows read at a time in the
        first pass (with their copies in bucket order and cast), a bucket of a quarter of it
        on average in the second.
    :param bool progress: show a bar of the rows read, both passes together.
    :param bool overwrite: replace files already in ``directory``.
    :param bool jax_dtypes: write each array in the dtype JAX computes in (``float32`` for
        ``float64``, ``int32`` for ``int64``, unless x64 is on), so that the kernels use the
        files as they are; a cast copy of a large memory map is refused
        (``numpyro_sgmc.data.validation``). ``False`` keeps the arrays' own dtypes.
    :return: ``{name: np.memmap}`` (a tuple for a sequence), rows in the shuffled order.
    :raises ValueError: arrays of different lengths, a buffer smaller than a row, or integers
        that the ``int32`` of ``jax_dtypes`` cannot hold.
    :raises FileExistsError: an output file exists and ``overwrite`` is false.
    """
    named = _named(arrays)
    n = _num_rows(named)
    dtypes = {
        name: jax.dtypes.canonicalize_dtype(a.dtype) if jax_dtypes else np.dtype(a.dtype)
        for name, a in named.items()
    }
    row_bytes = sum(_row_bytes(a) for a in named.values())
    if memory_bytes < 8 * row_bytes:
        raise ValueError(
            f"memory_bytes={memory_bytes} is smaller than 8 rows of the data ({row_bytes} bytes "
            "each, all arrays together): give a buffer of at least a few megabytes."
        )
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    targets = {name: os.path.join(directory, f"{name}.npy") for name in named}
    existing = [path for path in targets.values() if os.path.exists(path)]
    if existing and not overwrite:
        raise FileExistsError(
            f"{existing[0]} exists: shuffle_to_disk does not replace files unless "
            "overwrite=True (or write to another directory)."
        )
    # a chunk, its rows in bucket order and their cast: three copies, within the buffer
    chunk_rows = max(1, int(memory_bytes // (4 * row_bytes)))
    num_buckets = max(1, math.ceil(n * row_bytes / (_BUCKET_FILL * memory_bytes)))
    rng = host.host_rng(rng_key)
    work = tempfile.mkdtemp(prefix=".shuffle-", dir=directory)
    bar = tqdm(total=2 * n, unit="row", unit_scale=True, disable=not progress, desc="shuffle")
    try:
        sizes = _scatter(named, n, dtypes, rng, num_buckets, chunk_rows, work, bar)
        written = _gather(named, dtypes, rng, sizes, work, bar)
        for name, path in written.items():
            os.replace(path, targets[name])  # each file appears whole or not at all
    finally:
        bar.close()
        shutil.rmtree(work, ignore_errors=True)
    out = {name: np.load(path, mmap_mode="r") for name, path in targets.items()}
    return tuple(out.values()) if not isinstance(arrays, Mapping) else out


def _named(arrays) -> dict:
    if isinstance(arrays, Mapping):
        named = dict(arrays)
    elif isinstance(arrays, (tuple, list)):
        named = {f"arr_{k}": a for k, a in enumerate(arrays)}
    else:
        raise TypeError(
            "shuffle_to_disk takes {name: array} or a sequence of arrays, got "
            f"{type(arrays).__name__}: pass e.g. {{'X': X, 'y': y}}."
        )
    if not named:
        raise ValueError("shuffle_to_disk got no arrays.")
    for name in named:
        if not (isinstance(name, str) and name and os.sep not in name and name[0] != "."):
            raise ValueError(f"{name!r} cannot name a file: use names such as 'X' and 'y'.")
    return named


def _num_rows(named) -> int:
    lengths = {name: int(np.shape(a)[0]) if np.ndim(a) else None for name, a in named.items()}
    if None in lengths.values():
        scalar = next(name for name, m in lengths.items() if m is None)
        raise ValueError(f"Array {scalar!r} has no rows (it is a scalar).")
    if len(set(lengths.values())) != 1:
        shown = ", ".join(f"{name}: {m}" for name, m in lengths.items())
        raise ValueError(
            f"shuffle_to_disk needs arrays with the same number of rows, got {shown}: the "
            "rows are shuffled together, row i of every array staying with row i of the others."
        )
    return next(iter(lengths.values()))


def _row_bytes(a) -> int:
    return int(np.dtype(a.dtype).itemsize * math.prod(np.shape(a)[1:]))


def _cast(rows, dtype, name, start) -> np.ndarray:
    """``rows`` in ``dtype`` (C-contiguous); integers that do not fit are an error."""
    cast = np.ascontiguousarray(rows, dtype=dtype)
    if rows.dtype.kind in "iu" and cast.dtype != rows.dtype and not np.array_equal(cast, rows):
        raise ValueError(
            f"Array {name!r} holds integers beyond {dtype} (from row {start} on), the dtype "
            "JAX computes in: pass jax_dtypes=False to keep its dtype (and enable x64 in JAX), "
            "or store smaller values (indices, codes)."
        )
    return cast


def _scatter(named, n, dtypes, rng, num_buckets, chunk_rows, work, bar) -> np.ndarray:
    """First pass: each row, in its array's output dtype, to a uniformly random bucket file;
    the buckets' row counts."""
    sizes = np.zeros(num_buckets, np.int64)
    files = {
        (name, k): open(os.path.join(work, f"{name}.{k}"), "wb")
        for name in named
        for k in range(num_buckets)
    }
    try:
        for start in range(0, n, chunk_rows):
            stop = min(n, start + chunk_rows)
            bucket = rng.integers(0, num_buckets, stop - start)
            order = np.argsort(bucket, kind="stable")
            counts = np.bincount(bucket, minlength=num_buckets)
            edges = np.concatenate([[0], np.cumsum(counts)])
            for name, array in named.items():
                rows = _cast(np.asarray(array[start:stop])[order], dtypes[name], name, start)
                for k in np.flatnonzero(counts):
                    files[name, k].write(rows[edges[k] : edges[k + 1]].tobytes())
            sizes += counts
            bar.update(stop - start)
    finally:
        for f in files.values():
            f.close()
    return sizes


def _gather(named, dtypes, rng, sizes, work, bar) -> dict:
    """Second pass: each bucket permuted uniformly and appended to the output files (in
    ``work``, renamed into place by the caller)."""
    n = int(sizes.sum())
    paths = {name: os.path.join(work, f"{name}.npy") for name in named}
    outputs = {
        name: np.lib.format.open_memmap(
            paths[name], mode="w+", dtype=dtypes[name], shape=(n, *np.shape(array)[1:])
        )
        for name, array in named.items()
    }
    position = 0
    for k, size in enumerate(sizes):
        permutation = rng.permutation(int(size))
        for name, array in named.items():
            bucket = os.path.join(work, f"{name}.{k}")
            rows = np.fromfile(bucket, dtype=dtypes[name]).reshape(int(size), *np.shape(array)[1:])
            outputs[name][position : position + size] = rows[permutation]
            os.remove(bucket)
        position += int(size)
        bar.update(int(size))
    for out in outputs.values():
        out.flush()
    del outputs
    return paths
