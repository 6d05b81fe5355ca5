"""Values made on the host for compiled functions, without a compiled program of their own.

JAX compiles every eager operation once per shape: a key split, an ``astype``, a ``jnp.ones``
or ``x[0]`` each costs a small XLA program (0.02–0.25 s on 2 cores) in a first call, and a
tuner's prelude made of them cost seconds. Here the same values are made with NumPy and
moved to the device with ``jax.device_put``, which compiles nothing (``jnp.asarray`` of a
NumPy array compiles a ``stage`` program per shape), nor does
:func:`jax.random.wrap_key_data`. Row choices, probes and keys drawn on the host are
reproducible for a key on every machine, as NumPy's generators are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

__all__ = [
    "device_array",
    "empty_aligned",
    "host_rng",
    "key_batch",
    "key_seed",
    "split_key",
    "take",
    "unstack_keys",
]


def key_seed(rng_key) -> list:
    """The integers of a JAX PRNG key (typed or raw), as a NumPy seed."""
    return [int(v) for v in _words(rng_key).ravel()]


def host_rng(rng_key, *tags: int) -> np.random.Generator:
    """A NumPy generator determined by ``rng_key`` and ``tags``: the row choices and probes of
    the tuner are drawn on the host (they are index and probe arrays passed to compiled
    functions), reproducibly for a key and without a compiled op per draw."""
    return np.random.default_rng(key_seed(rng_key) + [int(t) for t in tags])


def split_key(rng_key, num: int, *tags: int) -> list:
    """``num`` independent keys from ``rng_key`` (and ``tags``), as a list of single keys.

    Drawn by NumPy's generator from the key's integers (its ``SeedSequence`` hashes them, so
    nearby keys give unrelated streams) and wrapped as keys like ``rng_key`` (typed, of its
    implementation, or raw): unlike :func:`jax.random.split` and indexing its result, nothing
    compiles. The keys are not :func:`jax.random.split`'s, which a trace could reproduce: this
    is for keys that are never traced (the tuner's), not for a chain's key, which a ``pmap``
    over chains traces.
    """
    raw = _words(rng_key)
    words = host_rng(rng_key, 0x5EED, *tags).integers(0, 2**32, (num,) + raw.shape, np.uint32)
    return [_wrap(w, rng_key) for w in words]


def key_batch(rng_key, num: int = 0):
    """``split_key``'s keys as one batch (shape ``(num,)``); with ``num = 0``, ``rng_key``
    itself as a batch of one (``rng_key[None]`` compiles a program)."""
    if num == 0:  # a chain's key, traced in a pmap over chains
        if isinstance(rng_key, jax.core.Tracer):
            return rng_key[None]
        return _wrap(_words(rng_key)[None], rng_key)
    raw = _words(rng_key)
    words = host_rng(rng_key, 0x5EED).integers(0, 2**32, (num,) + raw.shape, np.uint32)
    return _wrap(words, rng_key)


def unstack_keys(keys) -> list:
    """The keys of a batch of keys, as a list of single keys: indexing the batch (``keys[0]``)
    compiles a ``dynamic_slice`` and a ``squeeze``."""
    if isinstance(keys, jax.core.Tracer):  # a pmap over chains: sliced in its trace
        return list(keys)
    return [_wrap(w, keys) for w in _words(keys)]


def take(tree, index: int = 0):
    """Member ``index`` of every leaf's leading axis, sliced on the host (``v[0]`` of a device
    array compiles two programs); traced leaves are sliced as they are."""

    def member(v):
        if isinstance(v, jax.core.Tracer):
            return v[index]
        return jax.device_put(np.asarray(v)[index])

    return jax.tree.map(member, tree)


def device_array(x, dtype=None) -> jax.Array:
    """``jnp.asarray(x, dtype)`` without its program: ``x`` as a device array of ``dtype``
    (JAX's canonical one: float32 and int32 unless float64 is enabled), converted by NumPy on
    the host (``jnp.asarray`` compiles a ``stage`` or ``convert_element_type`` program per
    shape). A device array of that dtype is returned as it is, a traced one converted."""
    dtype = None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)
    if isinstance(x, jax.core.Tracer):
        return jnp.asarray(x, dtype)
    if isinstance(x, jax.Array) and (dtype is None or x.dtype == dtype):
        return x
    return jax.device_put(np.asarray(x, dtype=dtype))


ALIGN_BYTES = 64
"""Alignment of a host buffer that JAX's CPU backend takes in place."""


def empty_aligned(shape, dtype) -> np.ndarray:
    """An uninitialised NumPy array whose data start :data:`ALIGN_BYTES`-aligned.
    ``jax.device_put`` on CPU takes such an array in place (it keeps a reference), where it
    copies an unaligned one: 22 ms for a 28 MB feed of rows on this project's machine, against
    0.4 ms aligned. Write the array before putting it, not after."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + ALIGN_BYTES, np.uint8)
    skip = -raw.ctypes.data % ALIGN_BYTES
    return raw[skip : skip + size].view(dtype).reshape(shape)


def _typed(keys) -> bool:
    return jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)


def _words(keys) -> np.ndarray:
    """The key data (``uint32``, the implementation's words last) of typed or raw keys."""
    return np.asarray(random.key_data(keys) if _typed(keys) else keys)


def _wrap(words, like):
    """``words`` as keys like ``like``: typed of its implementation, or raw."""
    if _typed(like):
        return random.wrap_key_data(words, impl=random.key_impl(like))
    return jax.device_put(words)
