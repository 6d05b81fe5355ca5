"""Bad input, caught before anything compiles: array-likes, option values and the data.

Every entry point that takes data (a kernel's ``init`` under ``numpyro.infer.MCMC``,
:func:`~numpyro_sgmc.run_kernel`, :func:`~numpyro_sgmc.autotune`) passes the model arguments
through :func:`as_arrays` once: pandas objects, lists of numbers and NumPy arrays of any
numeric dtype become NumPy arrays of JAX's dtype (``float32``, ``int32`` by default), so that
no compiled call converts them again. :func:`~numpyro_sgmc.data.model.prepare_model` then checks
the data once, on the model's first trace, with :func:`nonfinite_data` (one chunked pass:
a NaN or an infinite value makes the gradient of every batch that holds it non-finite,
``docs/theory.md`` §1, unless the model masks it: ``numpyro_sgmc.data.model.check_data``
tries its potential on a batch of those rows). The rows of the data are checked against the
plates: the first trace reports per-row arguments of unequal lengths with
:func:`unequal_rows`, and
:func:`check_indexed_rows` refuses a plate whose indices, used by the model itself
(``X[idx]``), never reach some rows of the arrays they index. The option checks
(:func:`positive_int`, :func:`positive_number`, ...) reject a wrong type or an out-of-range
value with the argument's name.

Every message names the argument, the problem and the fix; ``docs/bad-input.md`` lists them.
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
import math
import mmap
import os
import weakref
from contextlib import contextmanager
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.handlers import seed, substitute
from numpyro.infer.initialization import init_to_uniform
from numpyro.primitives import Messenger
from numpyro.util import not_jax_tracer

from numpyro_sgmc.compilation import one_shot_jit
from numpyro_sgmc.data.subsample import subsample_indices

__all__ = [
    "NonFiniteRows",
    "SameArray",
    "argument_labels",
    "arrays_version",
    "as_arrays",
    "check_indexed_rows",
    "check_types",
    "empty_arguments",
    "file_backed",
    "file_checks_deferred",
    "memory_mapped",
    "no_unknown_keywords",
    "nonfinite_data",
    "nonfinite_row_indices",
    "nonnegative_int",
    "number_in",
    "positive_int",
    "positive_number",
    "record_file_counts",
    "refuse_nonfinite",
    "row_counts",
    "unequal_rows",
    "zarr_array",
]

_CHUNK_ELEMENTS = 2**22  # entries per chunk of the host pass over NumPy data (16 MB of float32)
_DEVICE_CHUNK_ELEMENTS = 2**20  # and of the compiled pass over a JAX array (4 MB of float32)


# ---- option values ------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def positive_int(name: str, value, allow_none: bool = False):
    """``value`` as an ``int`` ``>= 1`` (or ``None`` when ``allow_none``); else a ``TypeError``
    (not an integer) or a ``ValueError`` (out of range) naming ``name``."""
    if value is None and allow_none:
        return None
    if not _is_int(value):
        raise TypeError(
            f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}."
        )
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def no_unknown_keywords(function: str, unknown: dict):
    """A ``TypeError`` for keyword arguments ``function`` does not take, which a user of
    ``MCMC.run(key, X, offset=...)`` passes for the model: it names ``model_kwargs``."""
    if unknown:
        names = ", ".join(f"'{k}'" for k in unknown)
        example = ", ".join(f"'{k}': ..." for k in unknown)
        raise TypeError(
            f"{function}() got keyword argument(s) {names} that are not its options. The "
            f"model's keyword arguments go in model_kwargs: {function}(..., "
            f"model_kwargs={{{example}}})."
        )


def nonnegative_int(name: str, value):
    """``value`` as an ``int`` ``>= 0``; else a ``TypeError`` or ``ValueError`` naming ``name``."""
    if not _is_int(value):
        raise TypeError(f"{name} must be a non-negative int, got {value!r}.")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}.")
    return int(value)


def positive_number(name: str, value, allow_none: bool = False, allow_inf: bool = False):
    """``value`` as a ``float`` ``> 0`` (finite unless ``allow_inf``), or ``None`` when
    ``allow_none``; a string, a bool or an array is a ``TypeError`` naming ``name``."""
    if value is None and allow_none:
        return None
    if not _is_number(value):
        raise TypeError(
            f"{name} must be a positive number{' or None' if allow_none else ''}, got {value!r}."
        )
    x = float(value)
    if not (x > 0 and (allow_inf or math.isfinite(x))):
        raise ValueError(
            f"{name} must be positive{'' if allow_inf else ' and finite'}, got {value!r}."
        )
    return x


def number_in(name: str, value, low: float, high: float):
    """``value`` as a ``float`` in the open interval ``(low, high)``."""
    if not _is_number(value):
        raise TypeError(f"{name} must be a number in ({low:g}, {high:g}), got {value!r}.")
    x = float(value)
    if not low < x < high:
        raise ValueError(f"{name} must be in ({low:g}, {high:g}), got {value!r}.")
    return x


# ---- array-likes ----------------------------------------------------------------------------


def _model_function(model: Callable) -> Callable:
    """The user's function under NumPyro handlers (``seed(model)``, ``condition(model)``...)."""
    while isinstance(model, Messenger) and model.fn is not None:
        model = model.fn
    return model


def argument_labels(model: Callable, model_args: tuple, model_kwargs: dict) -> tuple:
    """``(positional, keyword)``: how a message names each model argument, e.g.
    ``"argument 'X' (position 0)"``, from the model's signature where it has one."""
    try:
        parameters = list(inspect.signature(_model_function(model)).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = []
    for k in range(len(model_args)):
        p = parameters[k] if k < len(parameters) else None
        named = p is not None and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        positional.append(f"argument '{p.name}' (position {k})" if named else f"argument {k}")
    keyword = {name: f"argument '{name}'" for name in model_kwargs}
    return tuple(positional), keyword


def _labelled(model: Callable, model_args: tuple, model_kwargs: dict) -> list:
    """``[(label, value), ...]`` for every model argument, positional then keyword."""
    positional, keyword = argument_labels(model, model_args, model_kwargs)
    return list(zip(positional, model_args, strict=True)) + [
        (keyword[k], v) for k, v in model_kwargs.items()
    ]


def _is_pandas(x) -> bool:
    return type(x).__module__.split(".")[0] == "pandas"


def _to_numpy(x, label: str) -> np.ndarray:
    """One array-like (pandas, a list of numbers, an object with ``__array__``) as NumPy."""
    if _is_pandas(x) and hasattr(x, "to_numpy"):
        numbers = _pandas_numbers(x)
        if numbers is not None:
            return numbers
        columns = getattr(x, "columns", None)
        what = ""
        if columns is not None:
            bad = [str(c) for c in x.select_dtypes(exclude=["number", "bool"]).columns]
            what = f" (non-numeric columns {bad})"
        elif str(x.dtype) == "category":
            what = " (categorical: its integer codes, x.cat.codes.to_numpy(), index group effects)"
        raise TypeError(
            f"Model {label} is a pandas {type(x).__name__} that is not numeric{what}. The "
            "kernels need numbers: encode categories as integers or one-hot columns "
            "(e.g. pd.get_dummies) and drop the text columns."
        )
    return np.asarray(x)


def _pandas_numbers(x) -> Optional[np.ndarray]:
    """A pandas object's numbers in the dtype NumPy gives its columns (integer group indices
    stay integers), or ``None`` where a column is not numeric. Where a nullable column holds
    ``pd.NA``: ``float64`` with NaN there (:func:`nonfinite_data` reports it)."""
    dtypes = list(x.dtypes) if hasattr(x, "columns") else [x.dtype]
    try:  # a nullable dtype (Int64, boolean, Float64) names its NumPy one, a sparse one its values
        numpy_dtypes = [
            np.dtype(getattr(d, "numpy_dtype", getattr(d, "subtype", d))) for d in dtypes
        ]
    except TypeError:  # category, string: not NumPy's
        return None
    if any(d.kind not in "biuf" for d in numpy_dtypes):
        return None
    try:
        if bool(np.asarray(x.isna()).any()):
            return np.asarray(x.to_numpy(dtype=np.float64, na_value=np.nan))
        return np.asarray(x.to_numpy(dtype=np.result_type(*numpy_dtypes)))
    except (TypeError, ValueError):  # an interval's bounds are numbers, the interval is not
        return None


def _canonical(x: np.ndarray, label: str) -> np.ndarray:
    """A numeric NumPy array in JAX's dtype (``float32`` for ``float64`` unless x64 is on)."""
    if x.dtype.kind not in "biufc":
        raise TypeError(
            f"Model {label} has dtype {x.dtype} ({_KINDS.get(x.dtype.kind, 'not numeric')}); "
            "the kernels need a numeric array. Convert it to numbers first (encode categories "
            "as integers or one-hot columns, parse dates into numbers)."
        )
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype == dtype:
        return x
    copy = x.size * np.dtype(dtype).itemsize
    if memory_mapped(x) and copy > _CAST_SHARE * physical_memory():
        raise ValueError(
            f"Model {label} is a memory map of dtype {x.dtype} and {x.nbytes / 2**30:.3g} GiB; "
            f"JAX computes in {np.dtype(dtype).name}, and casting it reads the whole file into "
            f"memory ({copy / 2**30:.3g} GiB, more than {_CAST_SHARE:.0%} of this machine's "
            f"{physical_memory() / 2**30:.3g} GiB). Write it once in {np.dtype(dtype).name}: "
            "numpyro_sgmc.shuffle_to_disk(key, {'X': X, ...}, directory) writes the JAX "
            "dtypes (and the random order batch_sampling='blocks' needs)."
        )
    return x.astype(dtype)


_CAST_SHARE = 0.5  # a cast copy of a memory map larger than this share of RAM is refused


def physical_memory() -> float:
    """This machine's RAM in bytes (``inf`` where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return math.inf


def zarr_array(x) -> bool:
    """Whether ``x`` is a zarr array (zarr 3's ``zarr.Array``, on any store), told without
    importing zarr (an optional dependency)."""
    return type(x).__module__.startswith("zarr.") and hasattr(x, "oindex")


def zarr_version(x):
    """A key for the bytes of the zarr array ``x`` on a local store: its directory, the count,
    total size and latest modification time of the files under it, its shape and dtype;
    ``None`` on other stores (their contents are not stat-able here)."""
    root = getattr(x.store, "root", None)
    if root is None:
        return None
    directory = os.path.normpath(os.path.join(os.fspath(root), x.path))
    count = size = latest = 0
    for folder, _, names in os.walk(directory):
        for name in names:
            try:
                found = os.stat(os.path.join(folder, name))
            except OSError:
                return None
            count, size = count + 1, size + found.st_size
            latest = max(latest, found.st_mtime_ns)
    return ("zarr", directory, count, size, latest, tuple(x.shape), np.dtype(x.dtype).str)


def file_backed(x) -> bool:
    """Whether ``x`` is a NumPy array backed by a memory-mapped file
    (``np.load(path, mmap_mode="r")``, ``np.lib.format.open_memmap``, or a view of one), or a
    zarr array (:mod:`~numpyro_sgmc.data.files`)."""
    return (isinstance(x, np.ndarray) and memory_mapped(x)) or zarr_array(x)


def memory_mapped(x: np.ndarray) -> bool:
    """Whether ``x`` (or an array it is a view of) is backed by a memory-mapped file."""
    while x is not None:
        if isinstance(x, np.memmap) or isinstance(getattr(x, "base", None), mmap.mmap):
            return True
        x = x.base if isinstance(x.base, np.ndarray) else None
    return False


def _file_map(x):
    """The :class:`numpy.memmap` of a file that ``x`` is (a view of), or ``None``: the one on
    the mapping itself, whose ``offset`` is its first byte's in the file (a view of a memmap
    is a memmap too, with the same ``offset``)."""
    while isinstance(x, np.ndarray):
        if isinstance(x, np.memmap) and x.filename and isinstance(x.base, mmap.mmap):
            return x
        x = x.base
    return None


def file_position(x):
    """``(file name, offset)``: the file ``x`` is (a view of) a memory map of, and the offset
    of ``x``'s first element in it; ``None`` for data in memory."""
    base = _file_map(x)
    if base is None:
        return None
    moved = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return os.fspath(base.filename), base.offset + moved


def _file_version(x):
    """A key for the bytes of the file-backed array ``x``: its file (inode, size, mtime), its
    first byte's offset there, shape, strides and dtype (a zarr array's :func:`zarr_version`);
    ``None`` for data in memory."""
    if zarr_array(x):
        return zarr_version(x)
    position = file_position(x)
    if position is None:
        return None
    try:
        found = os.stat(position[0])
    except OSError:
        return None
    file = (found.st_ino, found.st_size, found.st_mtime_ns)
    return position + file + (x.shape, x.strides, x.dtype.str)


SMALL_BYTES = 2**20
"""NumPy arrays in memory up to this size are identified by their values
(:func:`arrays_version`)."""


def _nothing():
    return None


class SameArray:
    """A live JAX array, equal only to itself: JAX arrays are immutable, so the same object
    holds the same values. It keeps no reference (a weak one) and pickles as equal to
    nothing."""

    __slots__ = ("ref",)

    def __init__(self, x):
        self.ref = weakref.ref(x)

    def __eq__(self, other):
        return isinstance(other, SameArray) and self.ref() is not None and self.ref() is other.ref()

    def __hash__(self):
        return id(self.ref())

    def __reduce__(self):
        return _gone, ()


def _gone():
    found = SameArray.__new__(SameArray)
    found.ref = _nothing
    return found


def arrays_version(arrays) -> Optional[tuple]:
    """A key for the values of ``arrays``, or ``None`` where one would cost a pass over
    them. Each array is file-backed (its :func:`_file_version`), a JAX array
    (:class:`SameArray`) or a NumPy array of at most :data:`SMALL_BYTES` (a digest of its
    bytes). Equal keys mean equal values; a large NumPy array in memory has none (it may
    change in place, and hashing it costs a pass)."""
    key = []
    for x in arrays:
        version = _file_version(x) if isinstance(x, np.ndarray) or zarr_array(x) else None
        if version is None and not not_jax_tracer(x):
            return None
        if version is None and isinstance(x, jax.Array):
            version = SameArray(x)
        if version is None:
            if np.size(x) * np.dtype(x.dtype).itemsize > SMALL_BYTES:
                return None
            value = np.ascontiguousarray(x)
            version = (value.shape, value.dtype.str, hashlib.blake2b(value.tobytes()).digest())
        key.append(version)
    return tuple(key)


def on_device(model_args, model_kwargs) -> tuple:
    """``(model_args, model_kwargs)`` with every top-level NumPy array in memory larger than
    :data:`SMALL_BYTES` put on the device once: a compiled call copies a NumPy argument anew
    (on CPU too, unless it is 64-byte aligned), and the tuner's dozens of calls on 10⁸ rows in
    memory (4.4 GB) spent 88 of their 143 s copying it. File-backed arrays stay on the host,
    read by rows where used. A floating-point array's data check is made here, on the host
    copy, and kept for the device copy (:func:`nonfinite_data` then runs no program of its
    own: a reduction over a device array compiled one per shape)."""

    def put(x):
        if isinstance(x, np.ndarray) and x.nbytes > SMALL_BYTES and not file_backed(x):
            copy = jax.device_put(x)
            if np.issubdtype(x.dtype, np.inexact):
                key = id(copy)
                _PUT_COUNTS[key] = _count_nonfinite_host(x)
                weakref.finalize(copy, _PUT_COUNTS.pop, key, None)
            return copy
        return x

    return tuple(put(x) for x in model_args), {k: put(v) for k, v in model_kwargs.items()}


_KINDS = {"O": "Python objects", "U": "strings", "S": "bytes", "M": "dates", "m": "durations"}


def _convert(x, label: str):
    if isinstance(x, jax.Array) or not not_jax_tracer(x):
        return x
    if isinstance(x, np.ndarray):
        return _canonical(x, label)
    if zarr_array(x):  # file-backed: read by rows where used, in JAX's dtypes
        if np.dtype(x.dtype).kind not in "biufc":
            _canonical(np.empty(0, x.dtype), label)
        return x
    if isinstance(x, list):
        try:
            array = np.asarray(x)
        except ValueError:  # ragged: not an array
            return x
        return _canonical(array, label) if array.dtype.kind in "biufc" and array.ndim else x
    if hasattr(x, "__array__") and not isinstance(x, np.generic):
        _refuse_large_store(x, label)
        return _canonical(_to_numpy(x, label), label)
    return x


def _refuse_large_store(x, label: str):
    """An array-like that is not a NumPy array or a zarr array (h5py, tensorstore, dask) becomes
    one by reading it whole; one larger than half the machine's memory is refused instead."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if _is_pandas(x) or shape is None or dtype is None:
        return
    try:
        size = math.prod(int(s) for s in shape) * np.dtype(dtype).itemsize
    except TypeError:  # not a NumPy dtype
        return
    if size > _CAST_SHARE * physical_memory():
        raise ValueError(
            f"Model {label} is a {type(x).__module__}.{type(x).__name__} of {size / 2**30:.3g} "
            f"GiB; the kernels read NumPy arrays, memory-mapped .npy files and zarr arrays by "
            f"rows, and this would be read whole into memory (more than {_CAST_SHARE:.0%} of "
            f"this machine's {physical_memory() / 2**30:.3g} GiB). Write it once to .npy files, "
            "in chunks: numpyro_sgmc.shuffle_to_disk(key, {'X': X, ...}, directory) reads any "
            "array that slices by rows and returns the memory maps to pass instead."
        )


def as_arrays(model: Callable, model_args, model_kwargs) -> tuple:
    """``(model_args, model_kwargs)`` with every array-like top-level argument converted once.

    A pandas ``DataFrame``/``Series``, a list of numbers (nested lists: a rectangular array)
    or anything with ``__array__`` becomes a NumPy array; a NumPy array of a dtype JAX does not
    use (``float64``, ``int64`` without x64) is cast to JAX's (``float32``, ``int32``), which
    JAX would otherwise do on every compiled call. JAX arrays, tuples, dicts and scalars are
    left as they are.

    :raises TypeError: an argument of strings, dates or Python objects (a non-numeric column).
    """
    model_args = tuple(model_args)
    model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
    positional, keyword = argument_labels(model, model_args, model_kwargs)
    args = tuple(_convert(x, label) for x, label in zip(model_args, positional, strict=True))
    kwargs = {k: _convert(v, keyword[k]) for k, v in model_kwargs.items()}
    return args, kwargs


def check_types(model: Callable, model_args: tuple, model_kwargs: dict):
    """Reject the array-likes :func:`as_arrays` converts, where nothing converted them: the
    compiled functions that take the data cannot take a pandas object."""
    labelled = _labelled(model, model_args, model_kwargs)
    for label, x in labelled:
        if _is_pandas(x):
            raise TypeError(
                f"Model {label} is a pandas {type(x).__name__}; pass a NumPy array "
                "(x.to_numpy()), or run through MCMC, run_kernel or autotune, which convert it."
            )
        if isinstance(x, np.ndarray) and x.dtype.kind not in "biufc":
            _canonical(x, label)


# ---- the data -----------------------------------------------------------------------------


@jax.jit
def _nonfinite_rows(x):
    """``(rows with a non-finite entry, the first of them)`` along the leading axis, in one
    reduction (for an array sharded over several devices: each reduces its own rows)."""
    bad = ~jnp.all(jnp.reshape(jnp.isfinite(x), (x.shape[0], -1)), axis=1)
    return jnp.sum(bad), jnp.argmax(bad)


@one_shot_jit(("rows",), rows=lambda x, rows: x.shape[0])
def _nonfinite_rows_chunked(x, rows):
    """:func:`_nonfinite_rows` over chunks of ``rows`` rows, so that no temporary of the
    array's size is made (the whole-array reduction materialises ``isfinite(x)``)."""
    n = x.shape[0]
    flat = jnp.reshape(x, (n, -1))

    def body(c, carry):
        count, first = carry
        start = jnp.minimum(c * rows, n - rows)  # the last chunk overlaps the one before it
        index = start + jnp.arange(rows)
        chunk = lax.dynamic_slice_in_dim(flat, start, rows)
        bad = ~jnp.all(jnp.isfinite(chunk), axis=1) & (index >= c * rows)
        first = jnp.minimum(first, jnp.min(jnp.where(bad, index, n)))
        return count + jnp.sum(bad), first

    return lax.fori_loop(0, -(-n // rows), body, (jnp.zeros((), jnp.int32), jnp.int32(n)))


def _count_nonfinite(x) -> tuple:
    """``(count, first)`` of rows with a NaN or an infinite entry, in one pass over ``x``:
    chunks of NumPy data on the host; one fused reduction for a JAX array where it lies."""
    if x.ndim == 0:
        finite = bool(np.isfinite(np.asarray(x)))
        return (0, 0) if finite else (1, 0)
    if x.shape[0] == 0 or x.size == 0:
        return 0, 0
    if not isinstance(x, jax.Array):
        version = _file_version(x)
        if version is None:
            return _count_nonfinite_host(x)
        # a file is read once per version of it (autotune, run_kernel and check_run each
        # check their data; beyond RAM each pass is a read of the whole file from disk)
        if version not in _FILE_COUNTS:
            if _DEFERRED.get():  # a pass over every row will check it: its first rows now
                first = _count_nonfinite_host(x[:_FIRST_ROWS])
                if not first[0]:
                    return first
            _FILE_COUNTS[version] = _count_nonfinite_host(x)
        return _FILE_COUNTS[version]
    if id(x) in _PUT_COUNTS:  # a copy on_device made, checked on the host
        return _PUT_COUNTS[id(x)]
    rows = max(1, _DEVICE_CHUNK_ELEMENTS // max(1, x.size // x.shape[0]))
    # eagerly, also when called under an outer trace (MCMC's pmap over chains) with the
    # data a concrete constant of it
    with jax.ensure_compile_time_eval():
        if len(x.sharding.device_set) > 1 or rows >= x.shape[0]:
            count, first = _nonfinite_rows(x)
        else:
            count, first = _nonfinite_rows_chunked(x, rows)
    return int(count), (int(first) if count else 0)


_FILE_COUNTS = {}  # _file_version -> (count, first) of non-finite rows
_PUT_COUNTS = {}  # id of a live device copy made by on_device -> its host copy's counts
_DEFERRED = contextvars.ContextVar("numpyro_sgmc_file_checks_deferred", default=False)
_FIRST_ROWS = 2**16  # rows of a file checked at once where its check is deferred


@contextmanager
def file_checks_deferred():
    """Within it, :func:`nonfinite_data` checks only the first rows of a file not yet
    checked (those a model's first trace and start evaluate): the caller will read every row
    in a full pass (:mod:`~numpyro_sgmc.data.passes`), which checks them on the way and
    records what it found (:func:`record_file_counts`), and then calls
    :func:`nonfinite_data` again, at no cost. Beyond RAM this saves a read of the file."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def record_file_counts(x, counts: tuple):
    """``(count, first)`` of the rows of the file-backed ``x`` with a NaN or an infinite entry,
    found by a pass that read all of them: its data check needs no pass of its own."""
    version = _file_version(x) if isinstance(x, np.ndarray) or zarr_array(x) else None
    if version is not None:
        _FILE_COUNTS[version] = tuple(counts)


def _count_nonfinite_host(x) -> tuple:
    """:func:`_count_nonfinite` of NumPy data, in chunks on the host."""
    rows = max(1, _CHUNK_ELEMENTS // max(1, x.size // x.shape[0]))
    count, first = 0, None
    for start in range(0, x.shape[0], rows):
        chunk = x[start : start + rows]
        bad = ~np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1)
        found = int(np.count_nonzero(bad))
        if found and first is None:
            first = start + int(np.argmax(bad))
        count += found
    return count, (0 if first is None else first)


def _keep_hint(name: str, ndim: int) -> str:
    if ndim <= 1:
        return f"keep = np.isfinite({name})"
    if ndim == 2:
        return f"keep = np.isfinite({name}).all(axis=1)"
    return f"keep = np.isfinite({name}).reshape(len({name}), -1).all(axis=1)"


class NonFiniteRows(NamedTuple):
    """A model argument (or an entry of one) with rows that hold a NaN or an infinite value."""

    label: str  # "argument 'y' (position 1)", with the entry's path if it is one
    value: object  # the array
    count: int  # rows with a non-finite entry
    first: int  # the first of them


def nonfinite_data(
    model: Callable, model_args: tuple, model_kwargs: dict, files_only=False
) -> list:
    """Every floating-point array among the model arguments with non-finite rows, as
    :class:`NonFiniteRows` (one chunked pass; ``files_only``: the file-backed ones, after
    :func:`file_checks_deferred`). Traced arguments (inside a ``jit``) are not checked."""
    found = []
    for label, value in _labelled(model, model_args, model_kwargs):
        for path, x in jax.tree_util.tree_flatten_with_path(value)[0]:
            if not hasattr(x, "dtype") or not not_jax_tracer(x):
                continue
            if not jnp.issubdtype(x.dtype, jnp.inexact):
                continue
            if files_only and not file_backed(x):
                continue
            count, first = _count_nonfinite(x)
            if count:
                where = label + (f", entry {jax.tree_util.keystr(path)}" if path else "")
                found.append(NonFiniteRows(where, x, count, first))
    return found


def refuse_nonfinite(found: NonFiniteRows, why: str = ""):
    """Raise the data check's ``ValueError`` for ``found``; ``why``: what the model's potential
    did on a batch of those rows, where that was tried."""
    x = found.value
    name = found.label.split("'")[1] if "'" in found.label else "x"
    rows = x.shape[0] if x.ndim else 1
    cause = why or "A non-finite datum makes the gradient of every batch that holds it non-finite"
    raise ValueError(
        f"Model {found.label} has NaN or infinite values in {found.count} of its {rows} rows "
        f"(the first at row {found.first}). {cause}, so the kernels would reject those steps "
        "(a biased chain) and the optimizer of autotune would diverge; no step size fixes it. "
        f"Drop those rows from every per-row array before sampling, e.g. "
        f"`{_keep_hint(name, x.ndim)}` and pass X[keep], y[keep], impute the missing values "
        "(e.g. with each column's mean), or mask them in the model: `d.mask(seen)` replaces "
        "them before the log density (a `jnp.where` over a log density computed on them "
        "leaves its gradient NaN)."
    )


def nonfinite_row_indices(x, first: int, limit: int) -> np.ndarray:
    """Up to ``limit`` indices of the rows of ``x`` with a non-finite entry, from ``first`` on
    (read in host chunks until that many are found)."""
    rows = max(1, _CHUNK_ELEMENTS // max(1, math.prod(x.shape[1:])))
    found = []
    for start in range(first, x.shape[0], rows):
        chunk = np.asarray(x[start : start + rows])
        bad = ~np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1)
        found.extend(start + np.flatnonzero(bad)[: limit - len(found)])
        if len(found) >= limit:
            break
    return np.asarray(found, np.int64)


def empty_arguments(model: Callable, model_args: tuple, model_kwargs: dict) -> Optional[str]:
    """The model arguments with no rows (leading dimension 0), as a phrase, or ``None``."""
    labelled = _labelled(model, model_args, model_kwargs)
    empty = [
        f"{label} has shape {tuple(np.shape(x))}"
        for label, x in labelled
        if hasattr(x, "shape") and np.ndim(x) >= 1 and np.shape(x)[0] == 0
    ]
    return "; ".join(empty) if empty else None


# ---- rows of the data and the plates --------------------------------------------------------


def row_counts(model: Callable, model_args: tuple, model_kwargs: dict) -> tuple:
    """``((label, rows), ...)``: the leading dimension of every top-level array argument."""
    return tuple(
        (label, int(np.shape(x)[0]))
        for label, x in _labelled(model, model_args, model_kwargs)
        if hasattr(x, "shape") and np.ndim(x) >= 1
    )


def _name(label: str) -> str:
    return label.split("'")[1] if "'" in label else "X"


def unequal_rows(plate_name: str, size: int, what: str, rows: int, counts: tuple):
    """The message for an array that ``numpyro.subsample`` takes in plate ``plate_name`` (of
    ``size`` rows) with ``rows`` rows along the plate's axis, when other arguments have the
    plate's ``size`` rows (``counts``: :func:`row_counts`): the per-row arrays differ in
    length, which a plate sized by ``X.shape[0]`` cannot fix. ``None`` when no argument has
    ``size`` rows (the plate's size is then what is wrong)."""
    fitting = [label for label, n in counts if n == size and label != what]
    if not fitting:
        return None
    others = ", ".join(fitting)
    keep = ", ".join(f"{_name(label)}[keep]" for label in [*fitting, what] if "'" in label)
    return (
        f"Plate '{plate_name}' has size {size}, the number of rows of {others}, but "
        f"{what}, which numpyro.subsample takes in that plate, has {rows} rows: the per-row "
        "arrays of a plate must have the same number of rows. Check the step that loads, "
        "filters or splits the data: it must keep the same rows of every per-row array"
        + (f" (e.g. {keep} with one mask keep)." if keep else ".")
    )


def _leaves(model: Callable, model_args: tuple, model_kwargs: dict) -> tuple:
    """``(leaves, treedef, labels)`` of the model arguments; ``labels[k]`` names leaf ``k``
    when it is an array (``None`` otherwise)."""
    positional, keyword = argument_labels(model, model_args, model_kwargs)
    flat, treedef = jax.tree_util.tree_flatten_with_path((tuple(model_args), dict(model_kwargs)))
    leaves, labels = [], []
    for path, x in flat:
        leaves.append(x)
        if not isinstance(x, (np.ndarray, jax.Array)) or np.ndim(x) < 1:
            labels.append(None)
            continue
        top = positional[path[1].idx] if path[0].idx == 0 else keyword[path[1].key]
        rest = jax.tree_util.keystr(path[2:])
        labels.append(top + (f", entry {rest}" if rest else ""))
    return leaves, treedef, labels


def _sub_jaxpr(eqn):
    """The jaxpr an equation calls with its own inputs (``jit``, ``custom_jvp_call``, ...)."""
    for key in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(key)
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns") and len(sub.invars) == len(eqn.invars):
            return sub
    return None


def _interval(op: str, spans: list):
    """The range ``(low, high)`` of ``op``'s output from its inputs' ranges (``None``:
    unknown), for the integer arithmetic that turns a plate's indices into an array's; a
    comparison's range is ``(0, 1)`` unless its outcome is sure."""
    if op in ("convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "copy"):
        return spans[0]
    if any(r is None for r in spans):
        return None
    if op in ("concatenate", "max", "min"):
        lows, highs = zip(*spans, strict=True)
        if op == "max":
            return max(lows), max(highs)
        return (min(lows), min(highs)) if op == "min" else (min(lows), max(highs))
    if op not in ("add", "sub", "mul", "neg", "lt", "le", "gt", "ge") or len(spans) > 2:
        return None
    (a, b), (c, d) = spans[0], spans[-1]
    if op == "neg":
        return -b, -a
    if op in ("add", "sub", "mul"):
        ends = {"add": (a + c, b + d), "sub": (a - d, b - c)}.get(op)
        return ends or (min(a * c, a * d, b * c, b * d), max(a * c, a * d, b * c, b * d))
    sure = {"lt": (b < c, a >= d), "le": (b <= c, a > d), "gt": (a > d, b <= c),
            "ge": (a >= d, b < c)}[op]  # fmt: skip
    return (1, 1) if sure[0] else (0, 0) if sure[1] else (0, 1)


def _plate_gathers(jaxpr, spans: dict, sources: dict, found: list):
    """Walk ``jaxpr`` with ``spans``, the range of every integer variable computed from a
    plate's indices by arithmetic (not the values an array holds at them, as ``alpha[g[idx]]``
    with a per-row group ``g``), and ``sources``, the model arguments' leaf numbers; append
    ``(leaf, rows, highest index)`` to ``found`` for every gather along axis 0 of an argument
    at indices of known range."""

    def span(v):
        if hasattr(v, "val"):  # a Literal
            value = np.asarray(v.val)
            integer = value.ndim == 0 and value.dtype.kind in "iub"
            return (int(value), int(value)) if integer else None
        return spans.get(v)

    for eqn in jaxpr.eqns:
        ins = eqn.invars
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            inner = {w: span(v) for w, v in zip(sub.invars, ins, strict=True) if span(v)}
            inner_sources = {
                w: sources[v]
                for w, v in zip(sub.invars, ins, strict=True)
                if not hasattr(v, "val") and v in sources
            }
            _plate_gathers(sub, inner, inner_sources, found)
            for o, w in zip(eqn.outvars, sub.outvars, strict=True):
                if not hasattr(w, "val") and inner.get(w) is not None:
                    spans[o] = inner[w]
            continue
        op = eqn.primitive.name
        if op == "gather":
            operand, where = ins[0], span(ins[1])
            axis0 = eqn.params["dimension_numbers"].start_index_map == (0,)
            if where is not None and axis0 and not hasattr(operand, "val"):
                if operand in sources:
                    found.append((sources[operand], operand.aval.shape[0], where[1]))
            continue
        if op == "select_n":
            pred, cases = span(ins[0]), [span(v) for v in ins[1:]]
            if pred is not None and pred[0] == pred[1]:
                picked = cases[pred[0]]
            elif all(c is not None for c in cases):
                picked = (min(c[0] for c in cases), max(c[1] for c in cases))
            else:
                picked = None
        else:
            picked = _interval(op, [span(v) for v in ins]) if ins else None
        if picked is not None and len(eqn.outvars) == 1:
            spans[eqn.outvars[0]] = picked
        if op in ("convert_element_type", "copy", "device_put") and not hasattr(ins[0], "val"):
            if ins[0] in sources:
                sources[eqn.outvars[0]] = sources[ins[0]]


def check_indexed_rows(model: Callable, plates: tuple, names, model_args, model_kwargs):
    """A subsample plate whose indices the model uses itself (``X[idx]``) reaches every row of
    the data arguments it indexes.

    ``numpyro.plate("data", 2500, subsample_size=100)`` over arrays of 5,000 rows draws its
    indices from the first 2,500 only, and scales the batch by ``2500/b``: half the data are
    never seen, and nothing fails. The model is traced once to a jaxpr with the plate's
    indices and the array arguments as inputs, and the range of the indices (``[0, n_p)``) is
    carried through the integer arithmetic on them (``idx + 1``, JAX's wrapping of negative
    indices); every gather along axis 0 of an argument at indices of known range tells the
    highest row the plate reaches in it. An argument with rows beyond all of them is refused.
    Values looked up with the indices (``alpha[g[idx]]`` with a per-row group ``g``) and
    arguments the indices do not index (a ``(d,)`` prior scale, a per-group table) are not
    compared, nor are traced arguments (inside a ``jit``) or models that cannot be traced
    abstractly.

    :raises ValueError: naming the plate, its size, the arguments and their rows, the rows
        never used and the fix.
    """
    leaves, treedef, labels = _leaves(model, model_args, model_kwargs)
    if not all(not_jax_tracer(x) for x in leaves):
        return
    arrays = [k for k, label in enumerate(labels) if label is not None]
    sizes = {p.name: p for p in plates}
    for name in names:
        plate = sizes[name]

        def traced(idx, *values, plate=plate):
            flat = list(leaves)
            for k, v in zip(arrays, values, strict=True):
                flat[k] = v
            args, kwargs = jax.tree.unflatten(treedef, flat)
            with subsample_indices(indices={plate.name: idx}):
                substitute(seed(model, 0), substitute_fn=init_to_uniform)(*args, **kwargs)

        idx = jax.ShapeDtypeStruct((plate.batch_size,), jnp.int32)
        values = [jax.ShapeDtypeStruct(np.shape(leaves[k]), leaves[k].dtype) for k in arrays]
        try:
            closed = jax.make_jaxpr(traced)(idx, *values)
        except Exception:  # a model that needs concrete data: nothing to check
            continue
        jaxpr = closed.jaxpr
        found = []
        sources = {v: arrays[k] for k, v in enumerate(jaxpr.invars[1:])}
        _plate_gathers(jaxpr, {jaxpr.invars[0]: (0, plate.size - 1)}, sources, found)
        # rows past the highest index the plate's indices reach in an argument are never used
        # (an index past its end is _check_indexing's error); the lagged y[idx] and
        # y[idx + 1] of a plate of n - 1 rows reach them all
        reach = {}  # leaf -> (rows, the highest index any gather of it reaches)
        for k, rows, high in found:
            reach[k] = (rows, max(high, reach.get(k, (rows, high))[1]))
        unused = sorted((k, r, h) for k, (r, h) in reach.items() if 0 <= h < r - 1)
        if unused:
            rows, high = max(r for _, r, _ in unused), max(h for _, _, h in unused)
            named = ", ".join(f"{labels[k]} of {r} rows" for k, r, _ in unused)
            b = plate.batch_size
            raise ValueError(
                f"Subsample plate '{plate.name}' has size {plate.size}, but the model indexes "
                f"{named} with its indices, which reach row {high} at most: rows {high + 1} "
                f"to {rows - 1} are never used, and each batch is scaled by {plate.size}/{b} "
                f"instead of {rows}/{b}. A subsample plate's size is the number of rows of the "
                f"data it indexes: declare numpyro.plate('{plate.name}', "
                f"{_name(labels[unused[0][0]])}.shape[0], subsample_size={b}); to use part of "
                "the data, pass only that part."
            )
