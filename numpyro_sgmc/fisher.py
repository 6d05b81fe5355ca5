"""Information matrices at a mode: ``J``, ``I`` and the sandwich ``S``, from the model's own plates.

Notation of ``shared/design/theory.md`` §1 (``U(θ) = -log p0(θ) - Σ_i l(θ; X_i)``): at the mode
``θ̂`` (unconstrained coordinates ``z``, flattened in :func:`~numpyro_sgmc.preconditioners.
flat_layout` order)

.. math::

    J = -\\tfrac{1}{n}\\textstyle\\sum_i \\nabla^2 l(\\hat\\theta; X_i), \\qquad
    I = \\tfrac{1}{n}\\textstyle\\sum_i (\\nabla l_i - \\bar g)(\\nabla l_i - \\bar g)^T, \\qquad
    S = J^{-1} I J^{-1},

and ``J_prior = ∇²(-log p0)(θ̂)/n`` collects every term outside the subsample plates (prior,
log-det-Jacobians of the constraining transforms, global observations), so that
``∇²U(θ̂)/n = J + J_prior`` is the curvature the predictor of §3 uses (``A = (h/2) Γ J`` with
this ``J``; ``D ∝ Γ I Γ / b``; ``n Cov → S`` for row F of §4).

How the per-datum terms are isolated. With a :class:`~numpyro_sgmc.subsample.Batch` carrying
per-index weights ``w`` and a ``global_weight`` ``g`` the potential is

.. math::

    U(z; w, g) = -\\textstyle\\sum_i w_i\\, l(z; X_i) + g\\,(\\text{global terms})
                 \\;[+\\ \\text{terms NumPyro does not scale}],

linear in ``w``. So for a chunk of rows ``Σ_i w_i (-∇²l_i) = ∇²[U(w, g=0) - U(w=0, g=0)]``
and ``∇l_i = -[∇U(w=e_i, g=0) - ∇U(w=0, g=0)]``: every global term (prior, Jacobians) cancels
exactly, whether or not NumPyro scales it, and nothing here writes a likelihood by hand.
``J_prior = ∇²U(w=0, g=1)/n``.

Full data is processed in chunks of at most ``chunk_size`` rows per plate (``lax.scan``, the last
chunk padded with weight-0 rows), so memory is ``O(chunk_size · d²)`` (dense) or
``O(chunk_size · d)`` (diagonal) whatever ``n``.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from jax.flatten_util import ravel_pytree
from numpyro.infer.initialization import init_to_uniform

from numpyro_sgmc.preconditioners import flat_layout
from numpyro_sgmc.subsample import Batch, initialize, num_data, split_args

__all__ = ["Information", "information", "per_datum_hessians"]

# J + J_prior counts as singular when its smallest eigenvalue is below this fraction of its
# largest: 1e-8 in float64; in float32 eigenvalues that small are rounding noise, so 10·eps
_RTOL = 1e-8
_RTOL32 = 10 * float(np.finfo(np.float32).eps)
# elements of the largest intermediate one vmapped slice may hold (per-datum gradients, probes)
_VMAP_ELEMENTS = 2**22


class Information(NamedTuple):
    """``J``, ``J_prior``, ``I`` at ``params`` (theory §1, §3); every array numpy float64.

    Matrices are ``(d, d)`` for ``kind="dense"`` and their diagonals ``(d,)`` for
    ``kind="diagonal"`` (then ``J`` and ``J_prior`` are Hutchinson estimates with
    ``num_probes`` probes; ``I`` is exact on the rows used).

    :param J: ``-(1/n) Σ_i ∇²_z l(z; X_i)``, plus ``regularization`` times the identity.
    :param J_prior: ``∇²(U - data part)(z) / n``: prior, Jacobians, global observations.
    :param I: ``Σ_p (n_p/n) Cov_p``, ``Cov_p`` the covariance over the data of plate ``p`` of
        the per-datum gradients ``∇_z l(z; X_i)`` (each plate centred on its own mean).
    :param mean_gradient: ``ĝ = -∇U(z)/n`` (prior included), from the rows used.
    :param int num_data: ``n = Σ_p n_p``.
    :param int num_rows: ``m``, the rows used (``n``, or a uniform subsample).
    :param dict plates: plate name -> :class:`~numpyro_sgmc.subsample.SubsamplePlate`.
    :param dict plate_covariances: plate name -> ``Cov_p``.
    :param list layout: :func:`~numpyro_sgmc.preconditioners.flat_layout` of ``params``.
    :param float regularization: ridge added to ``J`` (0.0 if none).
    :param int num_probes: Hutchinson probes behind a diagonal ``J`` (0 for dense).
    """

    J: np.ndarray
    J_prior: np.ndarray
    I: np.ndarray
    mean_gradient: np.ndarray
    num_data: int
    num_rows: int
    plates: dict
    plate_covariances: dict
    layout: list
    regularization: float
    num_probes: int = 0

    @property
    def kind(self) -> str:
        """``"dense"`` or ``"diagonal"``."""
        return "dense" if np.ndim(self.J) == 2 else "diagonal"

    @property
    def potential_curvature(self) -> np.ndarray:
        """``J + J_prior = ∇²U/n``: what the predictor of theory §3 calls ``J``."""
        return self.J + self.J_prior

    @property
    def sandwich(self) -> np.ndarray:
        """``S = J⁻¹ I J⁻¹``, ``J`` the :attr:`potential_curvature` (elementwise if diagonal)."""
        Jc = self.potential_curvature
        if self.kind == "diagonal":
            return self.I / Jc**2
        left = np.linalg.solve(Jc, self.I)
        S = np.linalg.solve(Jc, left.T).T
        return 0.5 * (S + S.T)

    @property
    def condition_numbers(self) -> dict:
        """``{"J": ..., "I": ...}``: largest over smallest eigenvalue (diagonal entry).

        ``"J"`` is that of the :attr:`potential_curvature`; ``inf`` where the smallest is <= 0.
        """
        return {"J": _condition(self.potential_curvature), "I": _condition(self.I)}

    @property
    def mode_distance(self) -> float:
        """``sqrt(n ĝᵀ (J + J_prior)⁻¹ ĝ)``: the Newton step to the mode in posterior sds.

        About ``sqrt(d)`` or less when ``params`` is at the mode of a subsample of the data,
        and 0 at the exact full-data mode.
        """
        g, Jc = self.mean_gradient, self.potential_curvature
        step = g / Jc if self.kind == "diagonal" else np.linalg.solve(Jc, g)
        return float(np.sqrt(max(self.num_data * float(g @ step), 0.0)))

    def gradient_noise(self, batch_size=None) -> np.ndarray:
        """Covariance of the minibatch average gradient ``ĝ`` of one step (with replacement).

        ``Σ_p (n_p/n)² Cov_p / b_p`` (theory §2-§3: ``I/b`` for a single plate).

        :param batch_size: ``None`` for the plates' own batch sizes, an int for every plate, or
            a dict ``{plate: b_p}`` (plates left out keep their own).
        """
        n = self.num_data
        total = 0.0
        for name, plate in self.plates.items():
            if batch_size is None:
                b = plate.batch_size
            elif isinstance(batch_size, dict):
                unknown = set(batch_size) - set(self.plates)
                if unknown:
                    raise ValueError(
                        f"batch_size names plate(s) {sorted(unknown)}; the subsample plates "
                        f"are {sorted(self.plates)}."
                    )
                b = batch_size.get(name, plate.batch_size)
            else:
                b = batch_size
            if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
                raise ValueError(f"batch size for plate '{name}' must be a positive int, got {b!r}")
            total = total + (plate.size / n) ** 2 * self.plate_covariances[name] / b
        return np.asarray(total, np.float64)

    def unflatten(self, vec) -> dict:
        """Site name -> array for a flat ``(..., d)`` vector (the last axis in layout order)."""
        vec = np.asarray(vec)
        lead = vec.shape[:-1]
        return {
            name: vec[..., start:stop].reshape(lead + tuple(shape))
            for name, start, stop, shape in self.layout
        }

    def summary(self) -> str:
        """A short printable report."""
        d = int(np.shape(self.J)[0])
        cond = self.condition_numbers
        rows = "all" if self.num_rows == self.num_data else "uniform subsample"
        lines = [
            f"Information ({self.kind}, d={d}, sites {[s for s, *_ in self.layout]})",
            f"  data: n={self.num_data} in plate(s) "
            + ", ".join(f"{k} ({p.size})" for k, p in self.plates.items())
            + f"; rows used m={self.num_rows} ({rows})",
            f"  condition numbers: J+J_prior {cond['J']:.4g}, I {cond['I']:.4g}",
            f"  regularization (ridge added to J): {self.regularization:.4g}",
            f"  Newton step to the mode: {self.mode_distance:.3g} posterior sd",
        ]
        if self.kind == "diagonal":
            lines.append(
                f"  diag(J), diag(J_prior): Hutchinson estimates, {self.num_probes} probes"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _condition(M) -> float:
    M = np.asarray(M, np.float64)
    vals = M if M.ndim == 1 else np.linalg.eigvalsh(0.5 * (M + M.T))
    lo, hi = float(np.min(vals)), float(np.max(vals))
    return float("inf") if lo <= 0 else hi / lo


def _key_seed(key) -> list:
    if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = random.key_data(key)
    return [int(v) for v in np.asarray(key).ravel()]


def _rows_per_plate(plates: dict, num_rows: int) -> dict:
    """``m_p`` proportional to ``n_p`` (largest remainders), at least 2 and at most ``n_p``."""
    n = num_data(plates)
    names = list(plates)
    quota = np.array([num_rows * plates[k].size / n for k in names])
    m = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - m))[: num_rows - int(m.sum())]:
        m[i] += 1
    return {k: int(min(max(mk, 2), plates[k].size)) for k, mk in zip(names, m, strict=True)}


def _kahan(acc, x):
    """Compensated summation, so float32 sums over many chunks keep float32 accuracy."""
    total, comp = acc
    y = jax.tree.map(jnp.subtract, x, comp)
    t = jax.tree.map(jnp.add, total, y)
    comp = jax.tree.map(lambda t, s, y: (t - s) - y, t, total, y)
    return t, comp


def _site_names(layout, flat_indices) -> list:
    out = []
    for k in flat_indices:
        for name, start, stop, shape in layout:
            if start <= k < stop:
                if len(shape) == 0:
                    out.append(name)
                else:
                    idx = np.unravel_index(k - start, shape)
                    out.append(f"{name}[{', '.join(str(int(i)) for i in idx)}]")
    return out


def _ridge_for(lo: float, hi: float, rtol: float) -> float:
    """Smallest ``r >= 0`` with ``lo + r >= rtol · (hi + r)``."""
    if lo >= rtol * hi and hi > 0:
        return 0.0
    r = (rtol * hi - lo) / (1.0 - rtol)
    if hi + r <= 0:  # all eigenvalues equal and <= 0: no scale to be relative to
        r = -lo + max(abs(lo), np.finfo(np.float64).tiny)
    return float(max(r, 0.0))


def information(
    model: Callable,
    *model_args,
    params: dict,
    rng_key=None,
    num_rows: Optional[int] = None,
    kind: str = "dense",
    chunk_size: int = 1024,
    regularize=None,
    num_probes: int = 64,
    init_strategy=init_to_uniform,
    **model_kwargs,
) -> Information:
    """``J``, ``J_prior`` and ``I`` of ``model`` at ``params`` (theory §1 and §3).

    .. math::

        J = -\\tfrac{1}{n}\\textstyle\\sum_i \\nabla^2 l(z; X_i),\\quad
        J_{prior} = \\nabla^2(U - \\text{data part})(z)/n,\\quad
        I = \\textstyle\\sum_p \\tfrac{n_p}{n}\\,\\mathrm{Cov}_{i\\in p}\\,\\nabla l(z; X_i),

    in unconstrained coordinates ``z``; ``S = (J + J_prior)⁻¹ I (J + J_prior)⁻¹`` is
    :attr:`Information.sandwich`. The per-datum terms come from the model's subsample plate(s)
    by weighting the data (see the module docstring), so priors, Jacobians of constraining
    transforms and global observations never enter ``J`` or ``I``.

    :param model: a NumPyro model with at least one subsample plate (as for the kernels).
    :param model_args: the model's positional arguments (the data).
    :param dict params: unconstrained values at the mode, site -> array (no chain axis), e.g.
        from an optimiser or :attr:`SubsampledModel.init_params`.
    :param rng_key: key for the row subsample, the Hutchinson probes and NumPyro's tracing
        (default ``PRNGKey(0)``); the result is deterministic given it.
    :param num_rows: ``None`` for all ``n`` rows; else a uniform subsample without replacement
        of about ``num_rows`` rows, split over the plates in proportion to ``n_p`` (at least 2
        per plate). Within a plate of ``m_p`` of ``n_p`` rows the sums are scaled by
        ``n_p/m_p`` (``J`` unbiased) and the covariance uses ``(n_p - 1)/(n_p (m_p - 1))``
        (unbiased for the full-data ``Cov_p``; ``1/n_p`` when ``m_p = n_p``).
    :param kind: ``"dense"`` (``(d, d)`` matrices, exact Hessians) or ``"diagonal"`` (``(d,)``,
        never forms a ``d × d`` matrix; for large ``d``). Diagonal ``J`` and ``J_prior`` are
        **estimates**: Hutchinson's ``diag(H) ≈ (1/K) Σ_k v_k ⊙ H v_k`` with ``K = num_probes``
        Rademacher probes ``v_k`` and Hessian-vector products, entry ``j`` having standard
        error ``sqrt(Σ_{k≠j} H_jk² / K)`` (exact when ``H`` is diagonal); diagonal ``I`` is
        exact (mean squared centred per-datum gradients).
    :param int chunk_size: rows per chunk; memory is ``O(chunk_size · d²)`` (dense) or
        ``O(chunk_size · d)`` plus one model evaluation per probe (diagonal).
    :param regularize: ``None`` (raise if ``J + J_prior`` is not positive definite), a ridge
        ``r >= 0`` added to ``J``, or ``"auto"``: the smallest ridge with
        ``λmin >= rtol · λmax`` (``rtol = 1e-8``; in float32 ``10 eps ≈ 1.2e-6``, below which
        eigenvalues of a float32 Hessian are rounding noise). The ridge is reported in
        :attr:`Information.regularization`.
    :param int num_probes: Hutchinson probes (``kind="diagonal"`` only).
    :param init_strategy: passed to :func:`~numpyro_sgmc.subsample.initialize` (only used to
        build the potential; the values are ``params``).
    :param model_kwargs: the model's keyword arguments.
    :raises ValueError: no subsample plate (from :mod:`numpyro_sgmc.subsample`); ``params`` not
        matching the latent sites; non-finite gradients or Hessians; ``J + J_prior`` not
        positive definite and ``regularize`` not given.

    Computation is in the default float dtype (float32 unless x64 is enabled), jit-compiled,
    with compensated (Kahan) sums over chunks; results are numpy float64.
    """
    if kind not in ("dense", "diagonal"):
        raise ValueError(f"kind must be 'dense' or 'diagonal', got {kind!r}")
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if kind == "diagonal" and (not isinstance(num_probes, (int, np.integer)) or num_probes < 1):
        raise ValueError(f"num_probes must be a positive int, got {num_probes!r}")
    rng_key = random.PRNGKey(0) if rng_key is None else rng_key
    key_init, key_rows, key_probes = random.split(rng_key, 3)

    prep = initialize(key_init, model, model_args, model_kwargs, init_strategy=init_strategy)
    plates = dict(sorted(prep.plates.items()))
    n = num_data(plates)
    dtype = jnp.result_type(float)
    params = _check_params(params, prep.init_params, dtype)
    layout = flat_layout(params)
    zflat, unravel = ravel_pytree(params)
    d = int(zflat.shape[0])
    dynamic, rebuild = split_args(model_args, model_kwargs)
    potential_fn = prep.potential_fn

    # rows per plate: None = all of them (indices built inside the jitted scan, O(chunk))
    if num_rows is None or num_rows >= n:
        rows = {name: None for name in plates}
    else:
        if not isinstance(num_rows, (int, np.integer)) or num_rows < 1:
            raise ValueError(f"num_rows must be None or a positive int, got {num_rows!r}")
        gen = np.random.default_rng(_key_seed(key_rows))
        rows = {}
        for name, m_p in _rows_per_plate(plates, int(num_rows)).items():
            size = plates[name].size
            # Generator.choice without replacement uses a hash set (O(m)) for m << n
            rows[name] = None if m_p == size else np.sort(gen.choice(size, m_p, replace=False))
    used = {name: plates[name].size if r is None else len(r) for name, r in rows.items()}

    probes = None
    if kind == "diagonal":
        probes = (2 * random.bernoulli(key_probes, 0.5, (num_probes, d)) - 1).astype(dtype)

    def one_row(name):  # a weight-0 row of every plate but the given one
        return {q: jnp.zeros(1, jnp.int32) for q in plates if q != name}

    def zero_weights(name):
        return {q: jnp.zeros(1, dtype) for q in plates if q != name}

    base_batch = Batch(one_row(None), zero_weights(None), 0.0)
    global_batch = Batch(one_row(None), zero_weights(None), 1.0)

    def potential(zf, batch, args):
        margs, mkwargs = rebuild(args)
        return potential_fn(unravel(zf), batch, margs, mkwargs)

    def diag_hessian(fn, zf, probes):
        """Hutchinson: mean over probes of v ⊙ (∇²fn) v."""
        grad_fn = jax.grad(fn)

        def one(v):
            return v * jax.jvp(grad_fn, (zf,), (v,))[1]

        inner = max(1, min(num_probes, _VMAP_ELEMENTS // max(d, 1)))
        if inner >= num_probes:
            return jnp.mean(jax.vmap(one)(probes), axis=0)
        return jnp.mean(lax.map(one, probes, batch_size=inner), axis=0)

    def global_terms(zf, probes, args):
        fn = lambda z: potential(z, global_batch, args)  # noqa: E731
        grad = jax.grad(fn)(zf)
        curv = jax.hessian(fn)(zf) if kind == "dense" else diag_hessian(fn, zf, probes)
        return grad, curv

    def plate_terms(name, count, full, zf, row_array, probes, args):
        """Sums over the ``count`` rows of plate ``name`` in chunks (jitted per plate)."""
        num_chunks = math.ceil(count / chunk_size)
        length = math.ceil(count / num_chunks)
        others_idx, others_w = one_row(name), zero_weights(name)
        base_grad = jax.grad(potential)(zf, base_batch, args)
        inner = max(1, min(length, _VMAP_ELEMENTS // max(d, 1)))

        def datum_gradient(row):  # ∇l(z; X_row) = -[∇U(w = e_row, g = 0) - ∇U(w = 0, g = 0)]
            batch = Batch(
                {name: row[None], **others_idx}, {name: jnp.ones(1, dtype), **others_w}, 0.0
            )
            return base_grad - jax.grad(potential)(zf, batch, args)

        def chunk(c):
            pos = c * length + jnp.arange(length)
            valid = pos < count
            pos = jnp.where(valid, pos, 0)
            idx = pos if full else row_array[pos]
            w = valid.astype(dtype)
            batch = Batch({name: idx, **others_idx}, {name: w, **others_w}, 0.0)

            def data_part(z):  # -Σ_i w_i l(z; X_i): every global term cancels
                return potential(z, batch, args) - potential(z, base_batch, args)

            return idx, w, data_part

        # shift every gradient by the mean of the first chunk: a centred, one-pass covariance
        _, w0, data_part0 = chunk(0)
        shift = -jax.grad(data_part0)(zf) / jnp.sum(w0)

        def body(acc, c):
            sums, comp, finite = acc
            idx, w, data_part = chunk(c)
            if kind == "dense":
                hess = jax.hessian(data_part)(zf)
            else:
                hess = diag_hessian(data_part, zf, probes)
            if inner >= length:
                grads = jax.vmap(datum_gradient)(idx)
            else:
                grads = lax.map(datum_gradient, idx, batch_size=inner)
            dg = (grads - shift) * w[:, None]
            outer = dg.T @ dg if kind == "dense" else jnp.sum(dg**2, 0)
            sums, comp = _kahan((sums, comp), (hess, jnp.sum(dg, 0), outer))
            return (sums, comp, finite & jnp.all(jnp.isfinite(grads))), None

        square = (d, d) if kind == "dense" else (d,)
        zeros = (jnp.zeros(square, dtype), jnp.zeros(d, dtype), jnp.zeros(square, dtype))
        init = (zeros, zeros, jnp.array(True))
        (sums, _, finite), _ = lax.scan(body, init, jnp.arange(num_chunks))
        return sums, shift, finite

    global_grad, global_curv = jax.jit(global_terms)(zflat, probes, dynamic)
    global_grad = np.asarray(global_grad, np.float64)
    global_curv = np.asarray(global_curv, np.float64)
    _check_finite([global_grad, global_curv], "the prior / global terms")

    J = np.zeros((d, d) if kind == "dense" else (d,))
    mean_grad = -global_grad / n
    covariances = {}
    for name, plate in plates.items():
        size, count, full = plate.size, used[name], rows[name] is None
        fn = jax.jit(
            lambda zf, r, p, a, _n=name, _c=count, _f=full: plate_terms(_n, _c, _f, zf, r, p, a)
        )
        row_array = None if full else jnp.asarray(rows[name], jnp.int32)
        (hess, sg, outer), shift, finite = fn(zflat, row_array, probes, dynamic)
        hess, sg, outer, shift = (np.asarray(x, np.float64) for x in (hess, sg, outer, shift))
        if not bool(finite):
            _check_finite([np.array(np.nan)], f"the per-datum gradients of plate '{name}'")
        _check_finite([hess, sg, outer, shift], f"the per-datum terms of plate '{name}'")
        delta = sg / count  # mean gradient minus shift
        mean_p = shift + delta
        if kind == "dense":
            centred = outer - count * np.outer(delta, delta)
            centred = 0.5 * (centred + centred.T)
        else:
            centred = np.maximum(outer - count * delta**2, 0.0)
        factor = 0.0 if count < 2 else (size - 1) / (size * (count - 1))
        covariances[name] = centred * factor
        J += hess * (size / count) / n
        mean_grad = mean_grad + (size / n) * mean_p

    J_prior = global_curv / n
    if kind == "dense":
        J, J_prior = 0.5 * (J + J.T), 0.5 * (J_prior + J_prior.T)
    I = sum((plates[k].size / n) * covariances[k] for k in plates)
    rtol = _RTOL if dtype == jnp.float64 else _RTOL32
    ridge = _regularize(J, J_prior, regularize, rtol, layout)
    if ridge:
        J = J + (ridge * np.eye(d) if kind == "dense" else ridge)
    return Information(
        J=J,
        J_prior=J_prior,
        I=np.asarray(I, np.float64),
        mean_gradient=np.asarray(mean_grad, np.float64),
        num_data=n,
        num_rows=int(sum(used.values())),
        plates=plates,
        plate_covariances=covariances,
        layout=layout,
        regularization=float(ridge),
        num_probes=int(num_probes) if kind == "diagonal" else 0,
    )


def per_datum_hessians(
    model: Callable,
    *model_args,
    params: dict,
    rng_key=None,
    num_rows: int = 2000,
    init_strategy=init_to_uniform,
    **model_kwargs,
) -> np.ndarray:
    """``(m, d, d)`` per-datum Hessians ``H_i = ∇²_z l(z; X_i)`` of ``m`` rows at ``params``.

    What theory §3's control-variate noise term ``M(Σ) = (1/n)Σ_i H_i Σ H_i - H̄ Σ H̄`` needs
    (:func:`numpyro_sgmc.theory.stationary_covariance`'s ``hessians``). The rows are a uniform
    subsample without replacement (all rows when ``num_rows >= n``), split over the plates in
    proportion to ``n_p``, so the sample estimates the pooled average over all data. Each
    ``H_i`` is the weight derivative of the model's own plate (module docstring):
    ``H_i = -∇²[U(w = e_i, g = 0) - U(w = 0, g = 0)]``. Dense, so for small ``d`` only.
    """
    if not isinstance(num_rows, (int, np.integer)) or num_rows < 1:
        raise ValueError(f"num_rows must be a positive int, got {num_rows!r}")
    rng_key = random.PRNGKey(0) if rng_key is None else rng_key
    key_init, key_rows = random.split(rng_key)
    prep = initialize(key_init, model, model_args, model_kwargs, init_strategy=init_strategy)
    plates = dict(sorted(prep.plates.items()))
    dtype = jnp.result_type(float)
    zflat, unravel = ravel_pytree(_check_params(params, prep.init_params, dtype))
    dynamic, rebuild = split_args(model_args, model_kwargs)
    gen = np.random.default_rng(_key_seed(key_rows))
    counts = _rows_per_plate(plates, min(int(num_rows), num_data(plates)))

    def potential(zf, batch, args):
        margs, mkwargs = rebuild(args)
        return prep.potential_fn(unravel(zf), batch, margs, mkwargs)

    def plate_hessians(name, rows, args):
        zero_idx = {q: jnp.zeros(1, jnp.int32) for q in plates}
        zero_w = {q: jnp.zeros(1, dtype) for q in plates}
        base = Batch(zero_idx, zero_w, 0.0)

        def datum(row):
            batch = Batch({**zero_idx, name: row[None]}, {**zero_w, name: jnp.ones(1, dtype)}, 0.0)
            return -jax.hessian(lambda z: potential(z, batch, args) - potential(z, base, args))(
                zflat
            )

        return lax.map(datum, rows, batch_size=min(256, rows.shape[0]))

    out = []
    for name, m_p in counts.items():
        size = plates[name].size
        rows = np.arange(size) if m_p == size else np.sort(gen.choice(size, m_p, replace=False))
        fn = jax.jit(lambda r, a, _n=name: plate_hessians(_n, r, a))
        out.append(np.asarray(fn(jnp.asarray(rows, jnp.int32), dynamic), np.float64))
    hessians = np.concatenate(out)
    _check_finite([hessians], "the per-datum Hessians")
    return hessians


def _check_params(params, prototype, dtype) -> dict:
    if not isinstance(params, dict) or set(params) != set(prototype):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"params must be a dict over the latent sites {sorted(prototype)} (unconstrained "
            f"values at the mode); got {got}."
        )
    out = {}
    for name, value in params.items():
        value = jnp.asarray(value, dtype)
        want = jnp.shape(prototype[name])
        if value.shape != want:
            raise ValueError(
                f"params['{name}'] has shape {value.shape}; the unconstrained site has shape "
                f"{want} (one point, no chain axis)."
            )
        out[name] = value
    return out


def _check_finite(arrays, what):
    if not all(np.all(np.isfinite(a)) for a in arrays):
        raise ValueError(
            f"information: {what} are not finite at params. params are probably not at a "
            "mode, or the model's log-density (or its derivatives) is not finite there: pass "
            "unconstrained values (e.g. log(sigma), not sigma) at which the potential is finite, "
            "such as the result of an optimiser."
        )


def _regularize(J, J_prior, regularize, rtol, layout) -> float:
    """The ridge to add to ``J`` (0.0 if none), or raise if ``J + J_prior`` is singular."""
    if regularize is not None and not (
        isinstance(regularize, str)
        and regularize == "auto"
        or (isinstance(regularize, (int, float, np.floating)) and regularize >= 0)
    ):
        raise ValueError(f"regularize must be None, a ridge >= 0 or 'auto'; got {regularize!r}")
    Jc = J + J_prior
    if Jc.ndim == 2:
        vals, vecs = np.linalg.eigh(Jc)
        lo, hi = float(vals[0]), float(vals[-1])
        weights = np.abs(vecs[:, 0])
    else:
        lo, hi = float(np.min(Jc)), float(np.max(Jc))
        weights = (Jc == lo).astype(float)
    if regularize == "auto":
        return _ridge_for(lo, hi, rtol)
    ridge = 0.0 if regularize is None else float(regularize)
    if lo + ridge > rtol * (hi + ridge) and hi + ridge > 0:
        return ridge
    sites = _site_names(layout, np.flatnonzero(weights >= 0.3 * np.max(weights)))
    what = "smallest eigenvalue" if Jc.ndim == 2 else "smallest diagonal entry"
    prefix = (
        f"J + J_prior (∇²U/n at params) is not positive definite: {what} {lo:.3g} "
        f"(largest {hi:.3g})"
        if regularize is None
        else f"J + J_prior plus the ridge regularize={ridge:g} is still not positive "
        f"definite: {what} {lo + ridge:.3g} (largest {hi + ridge:.3g})"
    )
    raise ValueError(
        prefix + f", in the direction of {', '.join(sites)}. The data (and prior) do not "
        "identify these parameters at params. Fixes: use more data rows (num_rows=None uses "
        "all), a proper prior on these sites, check params is a mode (not a saddle), or pass "
        "regularize=<ridge> (added to J) or regularize='auto' (the smallest ridge with "
        f"λmin >= {rtol:.2g}·λmax)."
        + (
            " A diagonal J is a Hutchinson estimate: noisy entries can also be lifted with "
            "more num_probes."
            if Jc.ndim == 1
            else ""
        )
    )
