"""Batch index samplers: O(b) time and memory per step, whatever the data size ``n``.

Each sampler is an ``(init, draw)`` pair (as optax's transformations): ``init(rng_key)``
gives its state, ``draw(state, rng_key)`` a :class:`~numpyro_sgmc.data.subsample.Batch` of indices
for every subsample plate and the next state.

* ``"with_replacement"`` (default): ``b`` independent uniform indices; the gradient noise
  has covariance ``I/b`` (``docs/theory.md`` §2).
* ``"without_replacement"``: ``b`` distinct indices per step; covariance
  ``(1 - (b-1)/(n-1)) I/b``.
* ``"epochs"``: random reshuffling: each epoch visits every datum at most once, in a fresh
  random order (``⌊n/b⌋`` steps per epoch; the ``n mod b`` data last in that epoch's order
  wait for the next one). Consecutive batches are then dependent, so the i.i.d.-noise
  predictions of ``docs/theory.md`` §3 are only approximate for it.
* ``"blocks"``: ``b`` consecutive rows from a uniform random start (wrapping around). Every
  row is in a batch with probability ``b/n``, so the estimate is unbiased for any row order,
  and reading contiguous memory is much faster than gathering random rows once the data
  outgrow the CPU caches (about 3x at 400 MB here). Its noise is that of a random batch
  (``"without_replacement"``) only if the rows are in random order: shuffle them once with
  :func:`shuffle_rows`; the kernels warn when the rows look ordered. Even then the noise
  covariance of one fixed order differs from a random batch's by about ``sqrt(2b/n)``
  (relative), since only ``n/b`` blocks are nearly independent: use it for ``n/b`` in the
  thousands and up, where it matters.

Distinct indices without ``arange(n)``: a keyed pseudo-random permutation of ``[0, n)`` — an
8-round Feistel network on ``2k ≥ log2 n`` bits with cycle walking (Black & Rogaway 2002,
"Ciphers with arbitrary finite domains") — maps ``b`` distinct positions to ``b`` distinct
indices in O(b).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp
from jax import lax, random

from numpyro_sgmc.data.subsample import Batch

__all__ = [
    "BATCH_SAMPLING",
    "BatchSampler",
    "EpochState",
    "batch_sampler",
    "permuted_index",
    "shuffle_rows",
]

BATCH_SAMPLING = ("with_replacement", "without_replacement", "epochs", "blocks")
"""The ``batch_sampling`` modes every kernel accepts."""


class BatchSampler(NamedTuple):
    """``init(rng_key) -> state``; ``draw(state, rng_key) -> (Batch, state)``."""

    init: Callable
    draw: Callable


class EpochState(NamedTuple):
    """State of the ``"epochs"`` sampler.

    :param key: fixed per chain; epoch ``e``'s order is the permutation keyed by
        ``fold_in(key, e)``.
    :param step: number of batches drawn so far.
    """

    key: jnp.ndarray
    step: jnp.ndarray


_ROUNDS = 8  # 4 suffice for large domains; tiny ones (n ~ 10) need 8 for pairwise uniformity


def _mix(x):
    """A 32-bit integer hash (the "lowbias32" finaliser of C. Wellons)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def permuted_index(rng_key, position, n: int):
    """``π(position)`` for a pseudo-random permutation ``π`` of ``[0, n)`` keyed by ``rng_key``.

    ``position`` is an integer array with entries in ``[0, n)``; distinct positions give
    distinct indices. Requires ``n <= 2**31`` (int32 indices).
    """
    if not 1 <= n <= 2**31:
        raise ValueError(f"permuted_index supports 1 <= n <= 2**31, got n={n}.")
    bits = max(2, math.ceil(math.log2(n)))
    half = (bits + 1) // 2
    mask = jnp.uint32((1 << half) - 1)
    round_keys = random.bits(rng_key, (_ROUNDS,), jnp.uint32)

    def feistel(x):
        left, right = x >> half, x & mask
        for r in range(_ROUNDS):
            left, right = right, left ^ (_mix(right ^ round_keys[r]) & mask)
        return (left << half) | right

    x = feistel(jnp.asarray(position).astype(jnp.uint32))
    # cycle walking: leave [n, 2^(2·half)) by applying the permutation again
    x = lax.while_loop(lambda x: jnp.any(x >= n), lambda x: jnp.where(x >= n, feistel(x), x), x)
    return x.astype(jnp.int32)


def shuffle_rows(rng_key, *arrays):
    """The arrays with their rows (leading axis) in one common random order.

    O(n) time and one copy of the data, once: what ``batch_sampling="blocks"`` needs.
    """
    sizes = {jnp.shape(a)[0] for a in arrays}
    if len(sizes) != 1:
        raise ValueError(f"shuffle_rows needs arrays with the same number of rows, got {sizes}.")
    order = random.permutation(rng_key, sizes.pop())
    shuffled = tuple(jnp.take(a, order, axis=0) for a in arrays)
    return shuffled[0] if len(shuffled) == 1 else shuffled


def _plate_keys(rng_key, plates):
    return zip(random.split(rng_key, len(plates)), plates, strict=True)


def batch_sampler(
    plates: tuple, method: str = "with_replacement", shard_axis: Optional[str] = None
) -> BatchSampler:
    """The batch sampler ``method`` (one of :data:`BATCH_SAMPLING`) for ``plates`` (a tuple of
    :class:`~numpyro_sgmc.data.subsample.SubsamplePlate`, sorted by name).

    A plate whose batch size equals its size always gets ``arange(n)``: the full data.

    :param str shard_axis: ``None`` for one device. Otherwise the sampler draws one shard's
        indices inside :func:`jax.shard_map` over this mesh axis
        (:mod:`~numpyro_sgmc.data.sharding`):
        ``plates`` are then the shard's (``n_p/D`` rows, batch ``b_p/D``), the state and the key
        are the same on every shard, and shard ``d`` folds ``d`` into the key
        (:func:`jax.random.fold_in`), so the ``D`` shards draw independent batches, each of its
        own rows, in O(b/D). With ``D = 1`` the key is used as is: the draws are the
        single-device sampler's.
    """
    if method not in BATCH_SAMPLING:
        raise ValueError(
            f"Unknown batch_sampling {method!r}; choose one of {', '.join(BATCH_SAMPLING)}."
        )

    def shard_key(rng_key):
        if shard_axis is None or lax.axis_size(shard_axis) == 1:
            return rng_key
        return random.fold_in(rng_key, lax.axis_index(shard_axis))

    def indices(plate, key, step=None):
        """Indices for one plate; ``key`` is per step, or per chain with the epoch ``step``."""
        n, b = plate.size, plate.batch_size
        if b == n:
            return jnp.arange(n)
        if method == "with_replacement":
            return random.randint(key, (b,), 0, n)
        if method == "without_replacement":
            return permuted_index(key, jnp.arange(b), n)
        if method == "blocks":
            return (random.randint(key, (), 0, n) + jnp.arange(b)) % n
        epoch, position = step // (n // b), step % (n // b)
        return permuted_index(random.fold_in(key, epoch), position * b + jnp.arange(b), n)

    if method != "epochs":

        def init(rng_key):
            return ()

        def draw(state, rng_key):
            keys = _plate_keys(shard_key(rng_key), plates)
            return Batch({p.name: indices(p, k) for k, p in keys}), state

        return BatchSampler(init, draw)

    def init(rng_key):
        return EpochState(rng_key, jnp.zeros((), jnp.int32))

    def draw(state, rng_key):
        keys = _plate_keys(shard_key(state.key), plates)
        batch = {p.name: indices(p, k, state.step) for k, p in keys}
        return Batch(batch), state._replace(step=state.step + 1)

    return BatchSampler(init, draw)
