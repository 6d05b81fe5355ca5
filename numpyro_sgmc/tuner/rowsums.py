"""Sums over the rows of a plate, in chunks and groups: the compiled passes behind
:mod:`numpyro_sgmc.tuner.fisher`.

How the per-datum terms are isolated. With a :class:`~numpyro_sgmc.data.subsample.Batch` carrying
per-index weights ``w`` and a ``global_weight`` ``g`` the potential is
``U(z; w, g) = -Σ_i w_i l(z; X_i) + g·(global terms)``, linear in ``w``. So for a chunk of rows
``Σ_i w_i (-∇²l_i) = ∇²[U(w, g=0) - U(w=0, g=0)]`` and
``∇l_i = -[∇U(w=e_i, g=0) - ∇U(w=0, g=0)]``: every global term (prior, Jacobians) cancels
exactly, and nothing here writes a likelihood by hand.

A pass visits ``count`` rows in ``C`` chunks (a ``lax.scan``, the last chunk padded with
weight-0 rows), so memory is ``O(chunk · d)`` for the per-datum gradients plus the sums, whatever
``n``. Chunk ``c`` belongs to group ``c mod G``: the sums are kept per group, which is what the
jackknife error of :meth:`~numpyro_sgmc.tuner.fisher.Information.jackknife` needs. The passes are
module-level functions of the model's :class:`~numpyro_sgmc.data.model.ModelSpec` (static) and the
data (arguments), so a second call on data of the same shapes compiles nothing.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_sgmc.compilation import one_shot_jit
from numpyro_sgmc.data.model import chunked_batches, potential
from numpyro_sgmc.data.subsample import Batch

__all__ = [
    "PlateSums",
    "curvature_along",
    "datum_curvatures",
    "fisher_diagonal",
    "global_terms",
    "plate_sums",
    "probe_spread",
]

GROUPS = 8  # jackknife groups of rows
# elements of the largest intermediate one vmapped slice may hold (per-datum gradients, probes)
VMAP_ELEMENTS = 2**22


class PlateSums(NamedTuple):
    """Per-group sums over the rows of one plate (group axis first), as NumPy float64.

    :param hessian: ``Σ_i w_i (-∇²l_i)`` per group: ``(G, d, d)``, or, diagonal, ``(G, K, d)``
        Hutchinson terms ``v_k ⊙ (Σ_i -∇²l_i) v_k`` per probe ``k``.
    :param gradient: ``Σ_i (∇l_i - shift)`` per group, ``(G, d)``.
    :param outer: ``Σ_i (∇l_i - shift)(∇l_i - shift)ᵀ`` per group, ``(G, d, d)`` or ``(G, d)``.
    :param count: rows per group, ``(G,)``.
    :param shift: the first chunk's mean gradient (a one-pass, centred covariance), ``(d,)``.
    :param bool finite: whether every per-datum gradient was finite.
    :param magnitude: ``Σ_i |∇l_i|`` per parameter, ``(d,)``.
    :param peak: ``max_i |∇l_i|`` per parameter, ``(d,)``: the heaviest row's share of
        :attr:`magnitude` says how few rows inform a parameter
        (:attr:`~numpyro_sgmc.tuner.fisher.Information.heaviest_share`).
    """

    hessian: np.ndarray
    gradient: np.ndarray
    outer: np.ndarray
    count: np.ndarray
    shift: np.ndarray
    finite: bool
    magnitude: np.ndarray
    peak: np.ndarray


def weights_batch(spec, name, idx, w):
    """A batch with rows ``idx`` (weights ``w``) of plate ``name`` and none of the others."""
    dtype = jnp.result_type(float)
    others = [p.name for p in spec.plates if p.name != name]
    indices = {q: jnp.zeros(1, jnp.int32) for q in others}
    weights = {q: jnp.zeros(1, dtype) for q in others}
    if name is not None:
        indices[name], weights[name] = idx, w
    return Batch(indices, weights, 0.0)


def flat_potential(spec, structure, layout, zf, batch, arrays):
    args, kwargs = structure.rebuild(arrays)
    return potential(spec, layout.unravel(zf), batch, args, kwargs)


def _kahan(acc, x):
    """Compensated summation, so float32 sums over many chunks keep float32 accuracy."""
    total, comp = acc
    y = jax.tree.map(jnp.subtract, x, comp)
    t = jax.tree.map(jnp.add, total, y)
    comp = jax.tree.map(lambda t, s, y: (t - s) - y, t, total, y)
    return t, comp


def _probe_terms(fn, zf, probes):
    """Hutchinson terms ``v ⊙ (∇²fn) v`` for every probe ``v``: ``(K, d)``."""
    grad_fn = jax.grad(fn)

    def one(v):
        return v * jax.jvp(grad_fn, (zf,), (v,))[1]

    return _bounded_map(one, probes, zf.shape[0])


def _bounded_map(fn, xs, width: int):
    """``fn`` over the leading axis of ``xs``, vmapped in slices whose intermediates of
    ``width`` elements per item hold at most :data:`VMAP_ELEMENTS` values."""
    inner = max(1, min(xs.shape[0], VMAP_ELEMENTS // max(width, 1)))
    if inner >= xs.shape[0]:
        return jax.vmap(fn)(xs)
    return lax.map(fn, xs, batch_size=inner)


def _quadratic_forms(grad_fn, zf, basis):
    """``(k,)``: ``wᵀ∇(grad_fn)(zf)w`` for every column ``w`` of ``basis`` (``(d, k)``), a
    Hessian-vector product each."""
    return jax.vmap(lambda w: w @ jax.jvp(grad_fn, (zf,), (w,))[1], in_axes=1)(basis)


def _datum_gradients(spec, structure, layout, name, zf, idx, arrays):
    """``∇l(z; X_row)`` for every row of ``idx``: ``(len(idx), d)``."""
    dtype = zf.dtype
    U = lambda z, batch: flat_potential(spec, structure, layout, z, batch, arrays)  # noqa: E731
    base = jax.grad(U)(zf, weights_batch(spec, name, jnp.zeros(1, jnp.int32), jnp.zeros(1, dtype)))

    def one(row):  # -[∇U(w = e_row, g = 0) - ∇U(w = 0, g = 0)]
        return base - jax.grad(U)(zf, weights_batch(spec, name, row[None], jnp.ones(1, dtype)))

    return _bounded_map(one, idx, zf.shape[0])


@one_shot_jit(("spec", "structure", "layout", "name"), rows=lambda idx, **_: idx.shape[0])
def datum_curvatures(spec, structure, layout, name, zf, basis, idx, arrays):
    """``(len(idx), k)``: ``w_kᵀ(-∇²l(z; X_row))w_k`` for every row of plate ``name`` in
    ``idx`` and every column ``w_k`` of ``basis`` (``(d, k)``): each row's curvature along
    the directions ``w_k``."""
    dtype = zf.dtype
    U = lambda z, batch: flat_potential(spec, structure, layout, z, batch, arrays)  # noqa: E731
    base = weights_batch(spec, name, jnp.zeros(1, jnp.int32), jnp.zeros(1, dtype))

    def one(row):
        batch = weights_batch(spec, name, row[None], jnp.ones(1, dtype))
        grad = jax.grad(lambda z: U(z, batch) - U(z, base))
        return _quadratic_forms(grad, zf, basis)

    return _bounded_map(one, idx, zf.shape[0] * basis.shape[1])


@one_shot_jit(("spec", "structure", "layout", "chunk"), rows=lambda spec, **_: spec.num_data)
def curvature_along(spec, structure, layout, chunk, zf, basis, arrays):
    """``(k,)``: ``Σ_i w_kᵀ(-∇²l(z; X_i))w_k`` over every row of every plate, for each column
    ``w_k`` of ``basis`` (``(d, k)``): the data's exact curvature along ``w_k``, in chunks of
    ``chunk`` rows (a Hessian-vector product each per direction, no per-row output)."""
    dtype = zf.dtype
    num_chunks, batch_of = chunked_batches(spec.plates, chunk)
    U = lambda z, batch: flat_potential(spec, structure, layout, z, batch, arrays)  # noqa: E731
    base = weights_batch(spec, None, None, None)  # every weight 0: U(w = 0, g = 0)

    def body(total, c):
        batch = batch_of(c)._replace(global_weight=jnp.zeros((), dtype))
        grad = jax.grad(lambda z: U(z, batch) - U(z, base))
        return total + _quadratic_forms(grad, zf, basis), None

    total, _ = lax.scan(body, jnp.zeros(basis.shape[1], dtype), jnp.arange(num_chunks))
    return total


@one_shot_jit(("spec", "structure", "layout"))
def fisher_diagonal(spec, structure, layout, zf, rows, arrays):
    """``Σ_p (n_p/n) mean_{i∈rows_p} (∇l_i)²``: the empirical Fisher information's diagonal per
    datum at ``zf``, over the rows ``rows`` (plate name -> indices)."""
    n = spec.num_data
    total = jnp.zeros_like(zf)
    for p in spec.plates:
        g = _datum_gradients(spec, structure, layout, p.name, zf, rows[p.name], arrays)
        total = total + (p.size / n) * jnp.mean(g**2, axis=0)
    return total


@one_shot_jit(("spec", "structure", "layout", "kind"))
def global_terms(spec, structure, layout, kind, zf, probes, arrays):
    """Gradient and curvature (``(d, d)``, or Hutchinson terms ``(K, d)``) of the global
    terms (prior, Jacobians, global observations): ``U(w=0, g=1)``."""
    batch = weights_batch(spec, None, None, None)._replace(global_weight=1.0)
    fn = lambda z: flat_potential(spec, structure, layout, z, batch, arrays)  # noqa: E731
    curvature = jax.hessian(fn)(zf) if kind == "dense" else _probe_terms(fn, zf, probes)
    return jax.grad(fn)(zf), curvature


def _chunking(count: int, chunk: int) -> tuple:
    """``(num_chunks, length)``: at least one chunk per jackknife group when rows allow."""
    num_chunks = max(math.ceil(count / chunk), min(GROUPS, count))
    return num_chunks, math.ceil(count / num_chunks)


@one_shot_jit(
    ("spec", "structure", "layout", "kind", "name", "count", "full", "chunk"),
    rows=lambda count, **_: count,
)
def _sums(spec, structure, layout, kind, name, count, full, chunk, zf, rows, probes, arrays):
    dtype, d = zf.dtype, zf.shape[0]
    num_chunks, length = _chunking(count, chunk)
    U = lambda z, batch: flat_potential(spec, structure, layout, z, batch, arrays)  # noqa: E731
    base = weights_batch(spec, name, jnp.zeros(1, jnp.int32), jnp.zeros(1, dtype))

    def chunk_of(c):
        pos = c * length + jnp.arange(length)
        valid = pos < count
        pos = jnp.where(valid, pos, 0)
        idx = pos if full else rows[pos]
        w = valid.astype(dtype)
        batch = weights_batch(spec, name, idx, w)
        return idx, w, lambda z: U(z, batch) - U(z, base)  # -Σ_i w_i l(z; X_i)

    def body(acc, c):
        sums, comp, finite, shift, (magnitude, peak) = acc
        idx, w, data_part = chunk_of(c)
        if kind == "dense":
            hess = jax.hessian(data_part)(zf)
        else:
            hess = _probe_terms(data_part, zf, probes)
        grads = _datum_gradients(spec, structure, layout, name, zf, idx, arrays)
        # the first chunk's mean gradient centres the one-pass covariance (chunk 0 has rows)
        first = jnp.sum(grads * w[:, None], 0) / jnp.maximum(jnp.sum(w), 1.0)
        shift = jnp.where(c == 0, first, shift)
        dg = (grads - shift) * w[:, None]
        outer = dg.T @ dg if kind == "dense" else jnp.sum(dg**2, 0)
        g = c % GROUPS
        part = (hess, jnp.sum(dg, 0), outer, jnp.sum(w))
        sums, comp = _kahan(
            (sums, comp), jax.tree.map(lambda a, x: jnp.zeros_like(a).at[g].set(x), sums, part)
        )
        size = jnp.abs(grads) * w[:, None]
        magnitude, peak = magnitude + jnp.sum(size, 0), jnp.maximum(peak, jnp.max(size, 0))
        finite = finite & jnp.all(jnp.isfinite(grads))
        return (sums, comp, finite, shift, (magnitude, peak)), None

    K = 0 if probes is None else probes.shape[0]
    shapes = ((d, d) if kind == "dense" else (K, d), (d,), (d, d) if kind == "dense" else (d,), ())
    zeros = tuple(jnp.zeros((GROUPS,) + s, dtype) for s in shapes)
    sizes = (jnp.zeros(d, dtype), jnp.zeros(d, dtype))
    start = (zeros, zeros, jnp.array(True), jnp.zeros(d, dtype), sizes)
    (sums, _, finite, shift, sizes), _ = lax.scan(body, start, jnp.arange(num_chunks))
    return sums, shift, finite, sizes


def plate_sums(
    spec, structure, layout, kind, name, count, full, chunk, zf, rows, probes, arrays
) -> PlateSums:
    """The per-group sums over ``count`` rows of plate ``name`` (all when ``full``, else the
    row indices ``rows``), as NumPy float64."""
    (hess, grad, outer, counts), shift, finite, sizes = _sums(
        spec, structure, layout, kind, name, count, full, chunk, zf, rows, probes, arrays
    )
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    sums = (hess, grad, outer, counts, shift)
    return PlateSums(*map(as64, sums), bool(finite), *map(as64, sizes))


def _spread_work(zf, deltas, rows, **_) -> int:
    """The probes' gradient evaluations times ``d`` over 16: ``rows`` for :func:`one_shot_jit`.
    Compiled at level 0 the probes of a logistic regression (d = 10, 16 probes of 10,000 rows:
    1.7·10⁶) compile 0.2 s faster and run a few ms slower; those of a 45-parameter hierarchy
    (64 probes, 2.9·10⁷) 0.4 s faster and 0.12 s slower, and of 200 groups (2,000 rows per
    probe, d = 205) 11 s against 4.4 s: quick up to 2²² (``QUICK_ROWS`` 2¹⁸ times 16)."""
    evaluations = (deltas.shape[0] + 1) * rows.shape[0] if rows.ndim == 1 else 2 * rows.size
    return evaluations * zf.shape[0] // 16


@one_shot_jit(("spec", "structure", "layout", "kind", "name"), rows=_spread_work)
def _spread(spec, structure, layout, kind, name, zf, deltas, rows, arrays):
    d = zf.shape[0]

    def centred(g, base):  # ∇l_i(θ̂ + δ) - ∇l_i(θ̂), less its mean over the rows
        u = g - base
        return u - jnp.mean(u, 0)

    def moments(u):  # this probe's Cov_i[∇l_i(θ̂ + δ) - ∇l_i(θ̂)] and its diagonal
        diagonal = jnp.mean(u**2, 0)
        return (u.T @ u / u.shape[0] if kind == "dense" else diagonal), diagonal

    def grads(z, idx):
        return _datum_gradients(spec, structure, layout, name, z, idx, arrays)

    zeros = (jnp.zeros((d, d) if kind == "dense" else d, zf.dtype), jnp.zeros(d, zf.dtype))
    if rows.ndim == 1:  # the same rows for every probe: ∇l_i(θ̂) once, the model traced once

        def shared(carry, k_delta):  # step 0 (δ = 0) keeps ∇l_i(θ̂) as the base
            base, per_row, acc, squares = carry
            k, delta = k_delta
            g = grads(zf + delta, rows)
            base = jnp.where(k == 0, g, base)
            u = centred(g, base)
            part, diagonal = moments(u)  # zero at step 0
            return (base, per_row + u**2, acc + part, squares + diagonal**2), None

        steps = (
            jnp.arange(deltas.shape[0] + 1),
            jnp.concatenate([jnp.zeros((1, d), zf.dtype), deltas]),
        )
        empty = jnp.zeros((rows.shape[0], d), zf.dtype)
        (_, per_row, acc, squares), _ = lax.scan(shared, (empty, empty) + zeros, steps)
        # each row's share of the diagonal, over the probes: its spread over rows is the
        # rows' sampling error of the diagonal
        rows_variance = jnp.var(per_row / deltas.shape[0], axis=0)
    else:  # rows of its own per probe: ∇l_i at θ̂ and θ̂ + δ_k, one trace vmapped over both

        def own(carry, delta_rows):
            acc, squares = carry
            delta, idx = delta_rows
            base, g = jax.vmap(grads, (0, None))(jnp.stack([zf, zf + delta]), idx)
            part, diagonal = moments(centred(g, base))
            return (acc + part, squares + diagonal**2), None

        (acc, squares), _ = lax.scan(own, zeros, (deltas, rows))
        rows_variance = jnp.zeros(d, zf.dtype)
    return acc / deltas.shape[0], squares / deltas.shape[0], rows_variance


def probe_spread(spec, structure, layout, kind, name, zf, deltas, rows, arrays) -> tuple:
    """``(M̂, e, r)``: ``M̂ = mean_k Cov_{i∈S_k}[∇l_i(θ̂ + δ_k) - ∇l_i(θ̂)]`` over rows ``S_k``
    of plate ``name`` and the probes ``deltas`` (``(K, d)``, drawn from the law the chain
    samples): the per-datum-Hessian noise that control variates leave,
    ``M(Σ) = (1/n)Σ_i H_iΣH_i - H̄ΣH̄`` of ``docs/theory.md`` §3 when the gradient is linear
    over the probes, and the exact noise of the estimate at those points when it is not.
    ``rows``: ``(R,)``, the same rows for every probe, or ``(K, m)``, rows of its own per
    probe. ``(d, d)``, or its diagonal. ``e`` and ``r``: ``(d,)``, standard errors of ``M̂``'s
    diagonal relative to it. ``e`` from the spread of the probes' own estimates (for random
    probes; with rows of their own it counts the rows' sampling too); ``r``, with the same
    rows for every probe, from the spread over the rows of each row's share: the rows'
    sampling, as if of infinitely many (zeros with rows of their own)."""
    out, squares, rows_variance = _spread(
        spec, structure, layout, kind, name, zf, deltas, rows, arrays
    )
    out, squares = np.asarray(out, np.float64), np.asarray(squares, np.float64)
    mean = np.diag(out) if kind == "dense" else out
    probes = np.sqrt(np.maximum(squares - mean**2, 0.0) / deltas.shape[0])
    sampling = np.sqrt(np.asarray(rows_variance, np.float64) / rows.shape[-1])

    def relative(e):
        return np.where(mean > 0, e / np.where(mean > 0, mean, 1.0), 0.0)

    return out, relative(probes), relative(sampling)
