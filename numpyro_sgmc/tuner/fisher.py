"""Information matrices at a mode: ``J``, ``I`` and the sandwich ``S``, with their own error.

Notation of ``docs/theory.md`` §1 (``U(θ) = -log p0(θ) - Σ_i l(θ; X_i)``): at the mode ``θ̂``
(unconstrained coordinates, flattened in :class:`~numpyro_sgmc.data.model.Layout` order)

.. math::

    J = -\\tfrac{1}{n}\\textstyle\\sum_i \\nabla^2 l(\\hat\\theta; X_i), \\qquad
    I = \\tfrac{1}{n}\\textstyle\\sum_i (\\nabla l_i - \\bar g)(\\nabla l_i - \\bar g)^T, \\qquad
    S = J^{-1} I J^{-1},

and ``J_prior = ∇²(-log p0)(θ̂)/n`` collects every term outside the subsample plates (prior,
log-det-Jacobians, global observations), so that ``∇²U(θ̂)/n = J + J_prior`` is the curvature
the predictions use. The per-datum terms come from the model's own plates by weighting the data
(:mod:`numpyro_sgmc.tuner.rowsums`), so nothing here writes a likelihood by hand.

**The estimate's own error.** From ``m < n`` rows, ``J`` and ``I`` are estimates. The rows are
visited in ``G = 8`` groups, and :meth:`Information.jackknife` gives the standard error of any
function of ``(J, I)`` (a predicted covariance, its standard deviations) from the
leave-one-group-out estimates, times the finite-population factor ``sqrt(1 - m/n)``: zero
when every row is used. The same estimates measure the bias of ``(J + J_prior)⁻¹`` and of the
sandwich from ``m`` rows, which :func:`debiased` removes. A diagonal ``J`` is a Hutchinson
estimate; its probes' own error is ``Information.probe_error``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from numpyro_sgmc import host, scales
from numpyro_sgmc.data import validation
from numpyro_sgmc.data.files import first_rows, rows_in_memory
from numpyro_sgmc.data.model import Layout, num_data, prepare_model, split_args
from numpyro_sgmc.scales import Dense, Diagonal
from numpyro_sgmc.theory.linear import GradientNoise
from numpyro_sgmc.tuner.rows import (
    CONTROL_VARIATE_ROWS,
    PROBES,
    Stream,
    batch_sizes,
    choose_rows,
    chosen_indices,
)
from numpyro_sgmc.tuner.rowsums import global_terms, plate_sums, probe_spread

__all__ = [
    "Information",
    "NotPositiveDefinite",
    "control_variate_noise",
    "exact_probes",
    "information",
    "information_of",
    "sylvester_columns",
]

KINDS = ("dense", "diagonal")
# J + J_prior counts as singular when its smallest eigenvalue is below this fraction of its
# largest: 1e-8 in float64; in float32 eigenvalues that small are rounding noise, so 10·eps
_RTOL = 1e-8
_RTOL32 = 10 * float(np.finfo(np.float32).eps)


class Information(NamedTuple):
    """``J``, ``J_prior``, ``I`` at ``params`` (``docs/theory.md`` §1, §3), as scales (NumPy
    float64): :class:`~numpyro_sgmc.Dense` for ``kind="dense"``, :class:`~numpyro_sgmc.Diagonal`
    for ``kind="diagonal"`` (then ``J`` and ``J_prior`` are Hutchinson estimates with
    ``num_probes`` probes; ``I`` is exact on the rows used).

    :param J: ``-(1/n) Σ_i ∇²_z l(z; X_i)``, plus ``regularization`` times the identity.
    :param J_prior: ``∇²(U - data part)(z) / n``: prior, Jacobians, global observations.
    :param I: ``Σ_p (n_p/n) Cov_p``, ``Cov_p`` the covariance over plate ``p`` of the
        per-datum gradients ``∇_z l(z; X_i)``.
    :param mean_gradient: ``(d,)`` ``ĝ = -∇U(z)/n`` (prior included), from the rows used.
    :param int num_data: ``n = Σ_p n_p``.
    :param int num_rows: ``m``, the rows used (``n``, or a uniform subsample).
    :param tuple plates: the model's :class:`~numpyro_sgmc.data.subsample.SubsamplePlate` s.
    :param dict plate_covariances: plate name -> ``Cov_p`` (a scale).
    :param layout: the :class:`~numpyro_sgmc.data.model.Layout` of the parameters.
    :param float regularization: ridge added to ``J`` (0.0 if none).
    :param int num_probes: Hutchinson probes behind a diagonal ``J`` (0 for dense).
    :param tuple replicates: the leave-one-group-out ``(J, I)`` of the jackknife.
    :param probe_error: ``(d,)`` standard error of a diagonal ``J`` from its probes,
        relative to ``J + J_prior`` (zeros for dense).
    :param float inverse_bias: where :func:`debiased` corrected ``J`` and ``I``, the median over
        parameters of the relative bias it removed from ``(J + J_prior)⁻¹``'s diagonal (0
        where it did not).
    :param heaviest_share: ``(d,)`` per parameter, the largest share of the rows'
        ``Σ_i |∇_j l_i|`` that one row carries, over the rows used (0 where no row has a
        gradient in it): at least ``1/k`` for a parameter that ``k`` rows inform, a one-hot
        level of a category or a group's intercept
        (:func:`~numpyro_sgmc.tuner.laplace.thinly_informed`). Absolute values, not squares:
        the squared residuals of 300 Poisson rows gave one row 5% of them.
    """

    J: object
    J_prior: object
    I: object
    mean_gradient: np.ndarray
    num_data: int
    num_rows: int
    plates: tuple
    plate_covariances: dict
    layout: Layout
    regularization: float
    num_probes: int = 0
    replicates: tuple = ()
    probe_error: Optional[np.ndarray] = None
    inverse_bias: float = 0.0
    heaviest_share: Optional[np.ndarray] = None

    @property
    def kind(self) -> str:
        """``"dense"`` or ``"diagonal"``."""
        return "dense" if scales.is_dense(self.J) else "diagonal"

    @property
    def potential_curvature(self):
        """``J + J_prior = ∇²U/n``: what the predictions of ``docs/theory.md`` §3 call ``J``."""
        return self.J + self.J_prior

    @property
    def sandwich(self):
        """``S = J⁻¹ I J⁻¹``, ``J`` the :attr:`potential_curvature`."""
        return sandwich(self.potential_curvature, self.I)

    @property
    def data_free(self) -> np.ndarray:
        """``(d,)`` bool: the parameters with no per-datum gradient (``I`` and the data part of
        ``J`` are zero there): hierarchical means and scales, set only by the prior."""
        return (np.asarray(self.I.diagonal()) == 0) & (np.asarray(self.J.diagonal()) <= 0)

    @property
    def condition_numbers(self) -> dict:
        """``{"J": ..., "I": ...}``: largest over smallest eigenvalue (``inf`` if ≤ 0)."""
        return {
            "J": scales.condition_number(self.potential_curvature),
            "I": scales.condition_number(self.I),
        }

    @property
    def mode_distance(self) -> float:
        """``sqrt(n ĝᵀ (J + J_prior)⁻¹ ĝ)``: the Newton step to the mode in posterior sds."""
        g = self.mean_gradient
        step = np.asarray(self.potential_curvature.solve(g))
        return float(np.sqrt(max(self.num_data * float(g @ step), 0.0)))

    def jackknife(self, f: Callable) -> np.ndarray:
        """Standard error of ``f(J + J_prior, I)`` (an array) from the rows' sampling: the
        grouped jackknife over the leave-one-group-out estimates, times ``sqrt(1 - m/n)``
        (zero when every row is used; zero without replicates)."""
        return _jackknife(self, f)

    def gradient_noise(self, batch_size=None, spread: Optional[Callable] = None) -> GradientNoise:
        """The covariance of the minibatch gradient ``ĝ`` of one step (with replacement),
        ``Σ_p (n_p/n)² Cov_p / b_p`` (``I/b`` for a single plate; :func:`plate_noise`), as a
        :class:`~numpyro_sgmc.theory.GradientNoise`; ``spread`` adds the per-datum-Hessian
        term ``M(Σ)/b``.

        :param batch_size: ``None`` for the plates' own batch sizes, an int for every plate,
            or ``{plate: b_p}``.
        """
        sizes = batch_sizes(self.plates, batch_size)
        total = plate_noise(self.plates, self.plate_covariances, sizes)
        if spread is None:
            return GradientNoise(total, None, 1.0)
        b = sum(sizes.values())
        return GradientNoise(total * b, spread, 1.0 / b)

    def unflatten(self, vec) -> dict:
        """Site name -> array for a flat ``(..., d)`` vector."""
        return {k: np.asarray(v) for k, v in self.layout.unravel(jnp.asarray(vec)).items()}

    def summary(self) -> str:
        """A short printable report (:func:`summary`)."""
        return summary(self)

    def __str__(self) -> str:
        return self.summary()


def _jackknife(info: Information, f: Callable) -> np.ndarray:
    """:meth:`Information.jackknife`."""
    value = np.asarray(f(info.potential_curvature, info.I), np.float64)
    fpc = max(0.0, 1.0 - info.num_rows / info.num_data)
    if not info.replicates or fpc == 0:
        return np.zeros_like(value)
    reps = np.stack([np.asarray(f(J + info.J_prior, I), np.float64) for J, I in info.replicates])
    G = len(reps)
    var = (G - 1) / G * np.sum((reps - reps.mean(axis=0)) ** 2, axis=0)
    return np.sqrt(var * fpc)


def summary(info: Information) -> str:
    """A short printable report of ``info``: its kind and size, the rows used, the condition
    numbers, the ridge, the Newton step to the mode and, for a diagonal ``J``, its probes."""
    cond = info.condition_numbers
    rows = "all" if info.num_rows == info.num_data else "uniform subsample"
    lines = [
        f"Information ({info.kind}, d={info.layout.size}, sites "
        f"{[s for s, *_ in info.layout.sites]})",
        f"  data: n={info.num_data} in plate(s) "
        + ", ".join(f"{p.name} ({p.size})" for p in info.plates)
        + f"; rows used m={info.num_rows} ({rows})",
        f"  condition numbers: J+J_prior {cond['J']:.4g}, I {cond['I']:.4g}",
        f"  regularization (ridge added to J): {info.regularization:.4g}",
        f"  Newton step to the mode: {info.mode_distance:.3g} posterior sd",
    ]
    if info.inverse_bias:
        lines.append(
            "  (J + J_prior)⁻¹ from m rows corrected for its bias (an inverse from m rows is "
            f"{100 * info.inverse_bias:.2g}% too large on the median variance)"
        )
    if info.kind == "diagonal":
        worst = float(np.max(info.probe_error)) if info.probe_error is not None else 0.0
        lines.append(
            f"  diag(J), diag(J_prior): Hutchinson estimates, {info.num_probes} probes "
            f"(largest relative error {worst:.2g})"
        )
    return "\n".join(lines)


def debiased(info: Information) -> Information:
    """``info`` with a dense ``J`` and ``I`` whose ``K⁻¹`` and ``S = K⁻¹IK⁻¹`` (``K = J +
    J_prior``) are the grouped jackknife's bias-corrected estimates of the full data's. The
    inverse of a Hessian from ``m`` of ``n`` rows is too large on average, by ``c(1/m - 1/n)``
    to first order (for Wishart rows ``m/(m - d - 1)``: 5% on the variances at ``d = 1000``,
    ``m = 20,000``, where the jackknife's standard error is a fifth of that), and ``S`` is
    biased too, by that twice and by the rows' ``J`` and ``I`` moving together (+3.5% on a
    heteroscedastic regression's variances at ``d = 200``, ``m = 5000``). The ``G``
    leave-one-group-out estimates ``f_g``, each from ``m(G - 1)/G`` rows, measure the slope
    ``c`` (Quenouille's jackknife, with the finite-population factor):

    .. math::

        f_c = f - (G - 1)(1 - m/n)\\,(\\bar f_g - f), \\qquad f \\in \\{K^{-1}, S\\},

    then ``K = (K⁻¹)_c⁻¹`` and ``I = K S_c K``: every target ``w₁S + w₂K⁻¹`` is corrected.
    Each plate's ``Cov_p`` moves by the same ``ΔI`` (so that ``I = Σ_p (n_p/n) Cov_p`` still
    holds), which corrects SGD's law, shaped by them, alike. The rows and columns of the
    parameters with no per-datum gradient stay zero in ``J`` and ``I`` (their curvature is
    the prior's, exact). Unchanged for a diagonal ``J`` (its ``1/J_jj`` is biased by
    ``O(1/m)`` alone; what it leaves out is
    :func:`~numpyro_sgmc.tuner.laplace.correlations`'s, extrapolated there), on every row, or
    where a corrected estimate is not positive (semi)definite."""
    fpc = 1.0 - info.num_rows / info.num_data
    if info.kind != "dense" or fpc <= 0 or not info.replicates:
        return info
    prior = np.asarray(info.J_prior.matrix, np.float64)
    inverse = np.linalg.inv(np.asarray(info.potential_curvature.matrix, np.float64))
    S = inverse @ np.asarray(info.I.matrix, np.float64) @ inverse
    left_out = []
    for J, I in info.replicates:
        inverse_g = np.linalg.inv(np.asarray(J.matrix, np.float64) + prior)
        left_out.append((inverse_g, inverse_g @ np.asarray(I.matrix, np.float64) @ inverse_g))
    slope = (len(left_out) - 1) * fpc
    bias = slope * (np.mean([a for a, _ in left_out], axis=0) - inverse)
    inverse_c = _symmetric(inverse - bias)
    S_c = _symmetric(S - slope * (np.mean([b for _, b in left_out], axis=0) - S))
    if np.linalg.eigvalsh(inverse_c)[0] <= 0 or not _semidefinite(S_c):
        return info
    free = info.data_free
    K = _symmetric(np.linalg.inv(inverse_c))
    J_c, I_c = K - prior, _symmetric(K @ S_c @ K)
    for M in (J_c, I_c):
        M[free, :], M[:, free] = 0.0, 0.0
    shift = I_c - np.asarray(info.I.matrix, np.float64)
    plates = {
        k: np.asarray(v.matrix, np.float64) + shift for k, v in info.plate_covariances.items()
    }
    if not all(_semidefinite(C) for C in plates.values()):
        return info
    relative = float(np.median(np.diagonal(bias) / np.diagonal(inverse)))
    return info._replace(
        J=Dense(J_c),
        I=Dense(I_c),
        plate_covariances={k: Dense(C) for k, C in plates.items()},
        inverse_bias=relative,
    )


def _symmetric(M: np.ndarray) -> np.ndarray:
    return 0.5 * (M + M.T)


def _semidefinite(M: np.ndarray) -> bool:
    values = np.linalg.eigvalsh(M)
    return bool(values[0] >= -1e-8 * max(values[-1], 0.0))


def sandwich(J, I):
    """``S = J⁻¹ I J⁻¹`` (symmetrised)."""
    J_inv = J.inverse()
    return scales.symmetrized(J_inv @ I @ J_inv)


def plate_noise(plates, covariances: dict, batch: dict):
    """``Σ_p (n_p/n)² C_p / b_p``: the per-step noise of the minibatch gradient over plates,
    with ``b_p = batch[p]``. A plate whose batch is all its rows adds none: every batch sampler
    gives it ``arange(n_p)`` (:func:`~numpyro_sgmc.data.batches.batch_sampler`), an exact sum."""
    n = num_data(plates)
    total = None
    for p in plates:
        weight = 0.0 if batch[p.name] >= p.size else (p.size / n) ** 2 / batch[p.name]
        part = covariances[p.name] * weight
        total = part if total is None else total + part
    return total


def information(
    model: Callable,
    rng_key,
    *model_args,
    params: dict,
    num_rows: Optional[int] = None,
    kind: str = "dense",
    chunk_size: int = 1024,
    regularize=None,
    num_probes: int = PROBES,
    model_kwargs: Optional[dict] = None,
) -> Information:
    """``J``, ``J_prior`` and ``I`` of ``model`` at ``params`` (``docs/theory.md`` §1 and §3).

    .. math::

        J = -\\tfrac{1}{n}\\textstyle\\sum_i \\nabla^2 l(z; X_i),\\quad
        J_{prior} = \\nabla^2(U - \\text{data part})(z)/n,\\quad
        I = \\textstyle\\sum_p \\tfrac{n_p}{n}\\,\\mathrm{Cov}_{i\\in p}\\,\\nabla l(z; X_i),

    in unconstrained coordinates ``z``; ``S = (J + J_prior)⁻¹ I (J + J_prior)⁻¹`` is
    :attr:`Information.sandwich`.

    :param model: a NumPyro model with at least one subsample plate (as for the kernels).
    :param rng_key: key for the row subsample and the Hutchinson probes.
    :param model_args: the model's positional arguments (the data; pandas objects, lists and
        NumPy arrays are converted once, ``numpyro_sgmc.data.validation.as_arrays``).
    :param dict params: unconstrained values at the mode, site -> array (no chain axis).
    :param num_rows: ``None`` for all ``n`` rows; else a uniform subsample without replacement
        of about ``num_rows`` rows, split over the plates in proportion to ``n_p`` (at least 2
        per plate); sums are scaled by ``n_p/m_p`` and the covariance uses
        ``(n_p - 1)/(n_p (m_p - 1))`` (unbiased for the full-data ``Cov_p``).
    :param kind: ``"dense"`` (``(d, d)``, exact Hessians) or ``"diagonal"`` (``(d,)``, never a
        ``d × d`` matrix; ``J`` by Hutchinson's ``diag(H) ≈ (1/K) Σ_k v_k ⊙ H v_k`` with
        ``K = num_probes`` Rademacher probes, raised to 0 where the probes' noise puts it below, as
        the data part of ``J`` is positive semi-definite at a mode; with ``num_probes >= d``
        exactly, by the ``K = 2^⌈log₂ d⌉`` columns of a Sylvester Hadamard matrix, which are
        orthogonal; ``I`` exact).
    :param int chunk_size: rows per chunk.
    :param regularize: ``None`` (raise if ``J + J_prior`` is not positive definite), a ridge
        ``r >= 0`` added to ``J``, or ``"auto"``: the smallest ridge with
        ``λmin >= rtol · λmax`` (``rtol = 1e-8``; in float32 ``10 eps ≈ 1.2e-6``).
    :param int num_probes: Hutchinson probes (``kind="diagonal"`` only); ``d`` or more: the
        exact diagonal (:func:`exact_probes` Hadamard probes).
    :param dict model_kwargs: the model's keyword arguments.
    :raises ValueError: no subsample plate; ``params`` not matching the latent sites; non-finite
        gradients or Hessians; ``J + J_prior`` not positive definite and ``regularize`` not
        given.
    """
    model_args, model_kwargs = validation.as_arrays(model, model_args, model_kwargs)
    prepared = prepare_model(rng_key, model, model_args, model_kwargs)
    return information_of(
        prepared, rng_key, model_args, model_kwargs, params, num_rows, kind, chunk_size,
        regularize, num_probes,
    )  # fmt: skip


def information_of(
    prepared,
    rng_key,
    model_args,
    model_kwargs,
    params,
    num_rows=None,
    kind="dense",
    chunk_size=1024,
    regularize=None,
    num_probes=PROBES,
) -> Information:
    """:func:`information` on a prepared model (:func:`~numpyro_sgmc.data.model.prepare_model`)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be 'dense' or 'diagonal', got {kind!r}")
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if kind == "diagonal" and (not isinstance(num_probes, (int, np.integer)) or num_probes < 1):
        raise ValueError(f"num_probes must be a positive int, got {num_probes!r}")
    spec, layout, plates = prepared.spec, prepared.layout, prepared.plates
    n, d = spec.num_data, layout.size
    dtype = jnp.result_type(float)
    zf = layout.ravel(check_params(params, prepared, dtype))
    arrays, structure = split_args(model_args, model_kwargs)
    rows = choose_rows(plates, num_rows, rng_key)
    probes, exact = None, kind == "diagonal" and num_probes >= d
    if exact:  # Hadamard columns: v_k ⊙ Hv_k averages to diag(H) exactly
        probes = host.device_array(sylvester_columns(exact_probes(d), np.arange(d)), dtype)
    elif kind == "diagonal":
        signs = Stream.HUTCHINSON_PROBES.rng(rng_key).integers(0, 2, (int(num_probes), d))
        probes = host.device_array(2 * signs - 1, dtype)
    global_grad, global_curv = global_terms(
        spec, structure, layout, kind, zf, probes, first_rows(arrays, plates)
    )
    global_grad, global_curv = (np.asarray(x, np.float64) for x in (global_grad, global_curv))
    _check_finite([global_grad, global_curv], "the prior / global terms")
    sums = {}
    for p in plates:
        full = rows[p.name] is None
        count = p.size if full else len(rows[p.name])
        rows_arrays, r = rows_in_memory(arrays, plates, {p.name: rows[p.name]})
        r = None if full else host.device_array(r[p.name], np.int32)
        sums[p.name] = plate_sums(
            spec, structure, layout, kind, p.name, count, full, int(chunk_size), zf, r, probes,
            rows_arrays,
        )  # fmt: skip
        if not sums[p.name].finite:
            _check_finite([np.array(np.nan)], f"the per-datum gradients of plate '{p.name}'")
        _check_finite(list(sums[p.name][:5]), f"the per-datum terms of plate '{p.name}'")
    J, I, covariances, mean_grad, probe_terms = _assemble(plates, sums, n, kind)
    mean_grad = mean_grad - global_grad / n
    # symmetric as J is (a float32 Hessian is not, to rounding, and the eigenvalues of the
    # sum then took the general solver: 281 of 474 s in 46 estimates at d = 843)
    J_prior = _symmetric(global_curv) / n if kind == "dense" else global_curv.mean(axis=0) / n
    wrap = Dense if kind == "dense" else Diagonal
    probe_error = np.zeros(d)
    if kind == "diagonal" and not exact:
        # v_k ⊙ Hv_k over K probes: its spread across probes is the estimate's own error
        terms = probe_terms + global_curv / n
        probe_error = terms.std(axis=0, ddof=1) / np.sqrt(len(terms))
        probe_error = probe_error / np.maximum(np.abs(terms.mean(axis=0)), 1e-300)
    rtol = _RTOL if dtype == jnp.float64 else _RTOL32
    ridge = _regularize(wrap(J), wrap(J_prior), regularize, rtol, layout)
    ridge_matrix = ridge * (np.eye(d) if kind == "dense" else np.ones(d))
    replicates = tuple(
        (wrap(Jg + ridge_matrix), wrap(Ig)) for Jg, Ig in _leave_one_out(plates, sums, n, kind)
    )
    return Information(
        J=wrap(J + ridge_matrix),
        J_prior=wrap(J_prior),
        I=wrap(I),
        mean_gradient=mean_grad,
        num_data=n,
        num_rows=int(sum(s.count.sum() for s in sums.values())),
        plates=plates,
        plate_covariances={k: wrap(v) for k, v in covariances.items()},
        layout=layout,
        regularization=float(ridge),
        num_probes=(exact_probes(d) if exact else int(num_probes)) if kind == "diagonal" else 0,
        replicates=replicates,
        probe_error=probe_error,
        heaviest_share=_heaviest_share(sums),
    )


def _heaviest_share(sums: dict) -> np.ndarray:
    """:attr:`Information.heaviest_share` from the plates' sums."""
    total = sum(s.magnitude for s in sums.values())
    peak = np.max([s.peak for s in sums.values()], axis=0)
    return np.where(total > 0, np.minimum(peak / np.where(total > 0, total, 1.0), 1.0), 0.0)


def _moments(sums, size, n, kind, drop=None):
    """``J``'s data part, ``Cov_p`` and the mean gradient of one plate (``drop``: a group left
    out)."""
    keep = np.ones(len(sums.count), bool)
    if drop is not None:
        keep[drop] = False
    count = float(sums.count[keep].sum())
    hess = sums.hessian[keep].sum(axis=0)
    if kind == "diagonal":  # the mean over probes; the data part of J is PSD at a mode
        hess = np.maximum(hess.mean(axis=0), 0.0)
    delta = sums.gradient[keep].sum(axis=0) / count  # mean gradient minus the shift
    outer = sums.outer[keep].sum(axis=0)
    if kind == "dense":
        centred = outer - count * np.outer(delta, delta)
        centred = 0.5 * (centred + centred.T)
    else:
        centred = np.maximum(outer - count * delta**2, 0.0)
    factor = 0.0 if count < 2 else (size - 1) / (size * (count - 1))
    return hess * (size / count) / n, centred * factor, sums.shift + delta, count


def _assemble(plates, sums, n, kind):
    J, I, covariances, mean = 0.0, 0.0, {}, 0.0
    probe_terms = 0.0
    for p in plates:
        Jp, cov, mean_p, count = _moments(sums[p.name], p.size, n, kind)
        J, I, mean = J + Jp, I + (p.size / n) * cov, mean + (p.size / n) * mean_p
        covariances[p.name] = cov
        if kind == "diagonal":
            probe_terms = probe_terms + sums[p.name].hessian.sum(axis=0) * (p.size / count) / n
    if kind == "dense":
        J = 0.5 * (J + J.T)
    return J, I, covariances, mean, probe_terms


def _leave_one_out(plates, sums, n, kind):
    """``(J, I)`` with each row group left out in turn (groups that hold rows); a plate whose
    rows are all in that group (a plate of one row: every row used, no sampling error) keeps
    them."""
    groups = len(next(iter(sums.values())).count)
    out = []
    for g in range(groups):
        if all(s.count[g] == 0 for s in sums.values()):
            continue
        J, I = 0.0, 0.0
        for p in plates:
            s = sums[p.name]
            drop = g if s.count.sum() > s.count[g] else None
            Jp, cov, _, _ = _moments(s, p.size, n, kind, drop=drop)
            J, I = J + Jp, I + (p.size / n) * cov
        out.append((0.5 * (J + J.T) if kind == "dense" else J, I))
    return out if len(out) > 1 else []


def exact_probes(d: int) -> int:
    """The probes of an exact diagonal of ``d`` parameters: ``2^⌈log₂ d⌉`` Hadamard columns."""
    return 1 << (d - 1).bit_length()


def sylvester_columns(rows: int, columns) -> np.ndarray:
    """``(rows, len(columns))`` float64: the ``columns`` of the Sylvester Hadamard matrix of
    ``rows`` (a power of 2) rows, ``H_kj = (-1)^{popcount(k & j)}``, built column by column
    (a whole matrix of 8192 rows would take half a gigabyte). Distinct columns are orthogonal
    (``Σ_k H_kj H_kl = rows·δ_jl``)."""
    x = np.bitwise_and.outer(np.arange(rows, dtype=np.uint32), np.asarray(columns, np.uint32))
    for shift in (16, 8, 4, 2, 1):  # the parity of the set bits
        x ^= x >> np.uint32(shift)
    return 1.0 - 2.0 * (x & np.uint32(1)).astype(np.float64)


def control_variate_noise(prepared, rng_key, model_args, model_kwargs, params, covariance,
                          num_rows=CONTROL_VARIATE_ROWS, num_probes=PROBES,
                          kind="dense") -> tuple:  # fmt: skip
    """Per plate, ``M̂_p = mean_k Cov_{i∈p}[∇l_i(θ̂ + δ_k) - ∇l_i(θ̂)]`` with ``E[δδᵀ] = Σ``: the
    covariance of the control-variate gradient's noise, per datum, over the law ``Σ`` the chain
    samples (:func:`~numpyro_sgmc.tuner.rowsums.probe_spread`). Its per-step noise is
    ``Σ_p (n_p/n)² M̂_p / b_p`` (:func:`plate_noise`). With ``d <= num_probes`` the probes are
    ``Σ^{1/2}s_k`` for the ``K = 2^⌈log₂(d+1)⌉`` sign vectors ``s_k`` of a Sylvester Hadamard
    design (``Σ_k s_k s_kᵀ = K I``: exact for a linear gradient), each one posterior sd along
    every direction, where a draw of ``N(0, Σ)`` lies; ``√d`` sds along one direction at a
    time, where the gradient is far from linear, put a 40-group hierarchy's intercepts' noise
    up to 30% off and the run's sds 10% off the prediction. Above, ``num_probes``
    draws of ``N(0, Σ)`` (relative error ``√(2/K)``), each on rows of its own where the
    ``R = num_rows`` rows exceed ``m =`` :data:`~numpyro_sgmc.tuner.rows.CONTROL_VARIATE_ROWS`:
    ``K`` windows of ``max(m, ⌈R/K⌉)`` rows of one permutation of them, so that every row is
    used by a probe or more, at ``max(Km, R)`` rather than ``KR`` row evaluations (the error
    it states then counts the windows' sampling too). ``O(probes · rows · d)`` work (``d²``
    for ``kind="dense"``), and ``O(rows · d)`` memory (``d²`` more for dense).

    :param covariance: ``Σ``, a scale.
    :return: ``(noise, error)``: plate name -> a scale (``Dense`` or ``Diagonal`` by
        ``kind``), and plate name -> ``(d,)`` the standard error of its diagonal relative to
        it: the rows' sampling (from the spread of the rows' shares, times ``√(1 - R/n_p)``),
        and for random probes their spread.
    """
    spec, layout, plates = prepared.spec, prepared.layout, prepared.plates
    dtype = jnp.result_type(float)
    zf = layout.ravel(check_params(params, prepared, dtype))
    d = layout.size
    if d <= num_probes:
        # without the all-ones column: each direction is probed at +1 and -1 sd equally often
        xi = sylvester_columns(1 << d.bit_length(), np.arange(1, d + 1))
    else:
        xi = Stream.CONTROL_VARIATE_PROBES.rng(rng_key).standard_normal((int(num_probes), d))
    # Σ^{1/2} ξ_k, NumPy float64: the probes are made on the host
    deltas = host.device_array(scales.apply_rows(covariance.sqrt(), xi), dtype)
    arrays, structure = split_args(model_args, model_kwargs)
    rows = chosen_indices(plates, choose_rows(plates, min(int(num_rows), spec.num_data), rng_key))
    wrap = Dense if kind == "dense" else Diagonal
    windows = Stream.CONTROL_VARIATE_WINDOWS.rng(rng_key)
    out, errors = {}, {}
    for p in plates:
        rows_arrays, r = rows_in_memory(arrays, plates, {p.name: rows[p.name]})
        local = r[p.name]
        if d > num_probes and len(local) > CONTROL_VARIATE_ROWS:
            local = _probe_windows(windows, local, len(xi), CONTROL_VARIATE_ROWS)
        spread, probe_error, rows_error = probe_spread(
            spec, structure, layout, kind, p.name, zf, deltas,
            host.device_array(local, np.int32), rows_arrays,
        )  # fmt: skip
        _check_finite([spread], f"the control-variate noise terms of plate '{p.name}'")
        out[p.name] = wrap(0.5 * (spread + spread.T) if kind == "dense" else spread)
        rows_error = rows_error * np.sqrt(max(0.0, 1.0 - local.shape[-1] / p.size))
        errors[p.name] = rows_error if d <= num_probes else np.hypot(probe_error, rows_error)
    return out, errors


def _probe_windows(rng: np.random.Generator, rows: np.ndarray, probes: int, m: int):
    """``(probes, max(m, ⌈R/probes⌉))``: probe ``k``'s rows, the ``k``-th window of one random
    permutation of the ``R`` rows ``rows`` (cyclic), each window sorted (a gather in order)."""
    m = max(m, -(-len(rows) // probes))
    order = rows[rng.permutation(len(rows))]
    at = (np.arange(probes)[:, None] * m + np.arange(m)) % len(rows)
    return np.sort(order[at], axis=1)


def check_params(params, prepared, dtype) -> dict:
    """``params`` as arrays of ``dtype``, one point over the latent sites, shapes checked."""
    shapes = {s: shape for s, _, _, shape in prepared.layout.sites}
    if not isinstance(params, dict) or set(params) != set(shapes):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"params must be a dict over the latent sites {sorted(shapes)} (unconstrained "
            f"values at the mode); got {got}."
        )
    out = {}
    for name, value in params.items():
        value = jnp.asarray(value, dtype)
        if value.shape != tuple(shapes[name]):
            raise ValueError(
                f"params['{name}'] has shape {value.shape}; the unconstrained site has shape "
                f"{tuple(shapes[name])} (one point, no chain axis)."
            )
        out[name] = value
    return out


class NotFinite(ValueError):
    """Terms of the information are not finite at the point given; ``what``: which."""

    def __init__(self, what, message):
        super().__init__(message)
        self.what = what


def _check_finite(arrays, what):
    if not all(np.all(np.isfinite(a)) for a in arrays):
        raise NotFinite(
            what,
            f"information: {what} are not finite at params. params are probably not at a "
            "mode, or the model's log-density (or its derivatives) is not finite there: pass "
            "unconstrained values (e.g. log(sigma), not sigma) at which the potential is finite, "
            "such as the result of an optimiser.",
        )


def _ridge_for(lo: float, hi: float, rtol: float) -> float:
    """Smallest ``r >= 0`` with ``lo + r >= rtol · (hi + r)``."""
    if lo >= rtol * hi and hi > 0:
        return 0.0
    r = (rtol * hi - lo) / (1.0 - rtol)
    if hi + r <= 0:  # all eigenvalues equal and <= 0: no scale to be relative to
        r = -lo + max(abs(lo), np.finfo(np.float64).tiny)
    return float(max(r, 0.0))


class NotPositiveDefinite(ValueError):
    """``J + J_prior`` is not positive definite; ``sites``: the parameters of its smallest
    eigenvector's largest entries."""

    def __init__(self, sites, message):
        super().__init__(message)
        self.sites = sites


def _regularize(J, J_prior, regularize, rtol, layout) -> float:
    """The ridge to add to ``J`` (0.0 if none), or raise if ``J + J_prior`` is singular.

    Positive definiteness is judged on the Jacobi-scaled matrix
    (:func:`~numpyro_sgmc.scales.positive_definite`), so parameters on very different scales
    (a covariate in units 10⁴ times another's) are not mistaken for unidentified ones."""
    if regularize is not None and not (
        isinstance(regularize, str)
        and regularize == "auto"
        or (isinstance(regularize, (int, float, np.floating)) and regularize >= 0)
    ):
        raise ValueError(f"regularize must be None, a ridge >= 0 or 'auto'; got {regularize!r}")
    Jc = J + J_prior
    d = len(Jc)
    ridge = float(regularize) if isinstance(regularize, (int, float, np.floating)) else 0.0
    M = Jc + Diagonal(np.full(d, ridge)) if ridge else Jc
    if scales.positive_definite(M, rtol):
        return ridge
    values = np.asarray(Jc.eigenvalues(), np.float64)
    if regularize == "auto":
        return max(_ridge_for(float(values.min()), float(values.max()), rtol), 0.0)
    names = layout.names()
    diag = np.asarray(M.diagonal(), np.float64)
    if np.any(~(diag > 0)):
        weights = (~(diag > 0)).astype(float)
        what = f"diagonal entries <= 0 (smallest {diag.min():.3g})"
    else:
        root = 1.0 / np.sqrt(diag)
        scaled = np.asarray(M.as_matrix(), np.float64) * np.outer(root, root)
        vals, vecs = np.linalg.eigh(scaled)
        weights = np.abs(vecs[:, 0])
        what = (
            f"smallest eigenvalue {vals[0]:.3g} of its correlation-scaled form (largest "
            f"{vals[-1]:.3g})"
        )
    sites = [names[k] for k in np.flatnonzero(weights >= 0.3 * np.max(weights))]
    prefix = (
        f"J + J_prior (∇²U/n at params) is not positive definite: {what}"
        if regularize is None
        else f"J + J_prior plus the ridge regularize={ridge:g} is still not positive "
        f"definite: {what}"
    )
    raise NotPositiveDefinite(
        sites,
        prefix + f", in the direction of {', '.join(sites)}. The data (and prior) do not "
        "identify these parameters at params. Fixes: use more data rows (num_rows=None uses "
        "all), a proper prior on these sites, check params is a mode (not a saddle), or pass "
        "regularize=<ridge> (added to J) or regularize='auto' (the smallest ridge with "
        f"λmin >= {rtol:.2g}·λmax).",
    )
