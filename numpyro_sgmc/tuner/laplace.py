"""The local picture the autotuner works from: the mode, the information there, and how far
to trust them.

:func:`fit` takes the warm start's mode and

1. estimates ``J`` and ``I`` there (:func:`~numpyro_sgmc.tuner.fisher.information`), dense up to
   :data:`DENSE_MAX_DIM` parameters and diagonal above;
2. polishes the mode by damped Newton steps with the exact full-data gradient
   (:func:`newton_polish`), whose length in posterior sds is the convergence test, relative to
   the curvature;
3. controls the prediction's own error: the jackknife standard error of the predicted
   standard deviations (:meth:`~numpyro_sgmc.tuner.fisher.Information.jackknife`), from the rows
   used, is brought under ``tolerance`` by adding rows, up to all ``n`` (one chunked pass is
   cheap next to sampling); a diagonal ``J`` gets Hutchinson probes until its own error is
   small, and the correlations it leaves out are counted in the error;
4. estimates the noise control variates leave, at the law the chain samples
   (:func:`~numpyro_sgmc.tuner.fisher.control_variate_noise`);
5. checks that the log posterior is close to its local quadratic along the target's widest
   directions (:func:`linearity`), which is what every prediction assumes: separable classes
   (no finite mode), a boundary or a heavy tail are said, with numbers; and profiles the
   marginals of the parameters that few rows inform (:func:`thin_profiles`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from scipy.interpolate import PchipInterpolator

from numpyro_sgmc import host, scales
from numpyro_sgmc.compilation import one_shot_jit
from numpyro_sgmc.data.files import rows_in_memory
from numpyro_sgmc.data.model import SubsampledModel, potential, split_args
from numpyro_sgmc.data.passes import exact_gradient
from numpyro_sgmc.data.subsample import Batch
from numpyro_sgmc.data.validation import file_backed
from numpyro_sgmc.diagnostics import ConvergenceWarning, LinearizationWarning, warn
from numpyro_sgmc.kernels.curvature import random_rows
from numpyro_sgmc.scales import Diagonal, positive_definite
from numpyro_sgmc.theory import target_covariance
from numpyro_sgmc.tuner.fisher import (
    NotFinite,
    NotPositiveDefinite,
    control_variate_noise,
    debiased,
    exact_probes,
    information_of,
)
from numpyro_sgmc.tuner.options import AutotuneOptions
from numpyro_sgmc.tuner.rows import (
    CONTROL_VARIATE_ROWS,
    CORRELATION_ROWS,
    CORRELATION_ROWS_PER_PARAMETER,
    CURVATURE_CHECK_DIRECTIONS,
    CURVATURE_CHECK_WORK,
    EVERY_ROW_WORK,
    EXACT_DIAGONAL_PROBES,
    HEAVY_ROW_SHARE,
    LINEARITY_ROWS,
    LINEARITY_WORK,
    MAX_PROBES,
    NEWTON_ROWS,
    NEWTON_ROWS_PER_PARAMETER,
    PROBES,
    Stream,
    choose_rows,
    chosen_indices,
    sample_rows,
)
from numpyro_sgmc.tuner.rowsums import VMAP_ELEMENTS, curvature_along, datum_curvatures

__all__ = [
    "DENSE_MAX_DIM",
    "MISSED_LOG",
    "START_CURVATURES",
    "STEEP_RATIO",
    "THIN_PATHS",
    "THIN_SHARE",
    "THIN_STEPS",
    "THIN_WORK",
    "UNREACHED_SDS",
    "Correlations",
    "Fit",
    "NoModeReached",
    "Nonlinearity",
    "PolishNotSettled",
    "Problem",
    "continuation_error",
    "correlations",
    "far_from_gaussian",
    "fit",
    "linearity",
    "linearity_error",
    "mean_shift",
    "newton_polish",
    "prediction_error",
    "profile_moments",
    "profile_on_grid",
    "sample_misses",
    "thin_profiles",
    "thinly_informed",
    "unplaced_means",
]

# dense J, I and Γ up to this many parameters: O(d²) memory, d Hessian-vector products per
# chunk of rows, O(d³) Lyapunov solves
DENSE_MAX_DIM = 1000
"""Above this many parameters ``J``, ``I`` and ``Γ`` are diagonal (``dense=None``)."""

UNREACHED_SDS = 1.0
"""Posterior sds from the mode beyond which an unsettled polish leaves the predictions
without an error bar: ``check_run``'s own bound on a run's mean from the tuning's mode."""

STEEP_RATIO = 0.5
"""Where the Newton steps did not settle, a widest direction whose sd is under this share of
the quadratic's at the point they stopped is taken for no mode: a non-centred hierarchy of
200 groups of 50 rows stopped on its ridge with mu's sd 0.22x the quadratic's, and the kernel
tuned there diverged."""

VISITED_RISE = 4.5
"""A probe of the linearity profile whose potential has risen by at most this much (in nats:
a Gaussian's at 3 of its sds) is one a chain visits."""

START_CURVATURES = 24
"""The most estimates of ``J`` the Newton steps from the model's start make (``fit`` with
``must_settle``): from a start hundreds of sds away each long step gets a fresh one, a dozen
before the last few sds (a Poisson regression on raw covariates), where a heavy-tailed ``J``
may need more rows."""

SETTLING_SDS = 0.2
"""Distance to the mode (posterior sds) within which the Newton polish may take its last
step unconfirmed, where the steps' contraction predicts it lands within ``tol/4``."""

POLISH_TOL = 0.05
"""Distance to the mode (posterior sds) within which the Newton polish has settled
(:func:`newton_polish`'s default ``tol``); a last step this short where ``J + J_prior`` is
not positive definite says the gradient vanishes there: a saddle point."""


class Problem(NamedTuple):
    """What every step of the tuner reads.

    :param prepared: the model, prepared once (:func:`~numpyro_sgmc.data.model.prepare_model`).
    :param tuple model_args: its positional arguments (the data).
    :param dict model_kwargs: its keyword arguments.
    :param options: the checked :class:`~numpyro_sgmc.tuner.options.AutotuneOptions`
        (``None`` for a step that reads none: the run check's correlations).
    :param rng_key: the information key, whose named streams
        (:class:`~numpyro_sgmc.tuner.rows.Stream`) feed the rows and probes of every step.
    """

    prepared: SubsampledModel
    model_args: tuple
    model_kwargs: dict
    options: Optional[AutotuneOptions]
    rng_key: object


class NoModeReached(ValueError):
    """``fit`` found no mode where the Newton steps stopped short: ``J + J_prior`` not positive
    definite there, or terms not finite, at a point where the gradient does not vanish (not a
    saddle) and before any profile was measured. The mode may lie further on:
    :func:`~numpyro_sgmc.autotune` runs its optimizer longer where it ran it."""


class PolishNotSettled(Exception):
    """The Newton steps of ``fit(..., must_settle=True)`` did not settle at a mode (or failed
    on the way); the caller starts them from an optimizer's mode instead.

    :param float epochs: the passes over the data the attempt made (its Newton passes and its
        information rows as a share of ``n``), counted in the setup cost.
    """

    def __init__(self, epochs: float):
        super().__init__(f"the Newton steps did not settle after {epochs:.3g} epochs")
        self.epochs = epochs


class Fit(NamedTuple):
    """The mode, the information there and how far to trust them.

    :param dict mode: the polished mode (unconstrained).
    :param information: the :class:`~numpyro_sgmc.tuner.fisher.Information` there.
    :param float newton_step: the first Newton step's length, in posterior sds.
    :param int passes: passes over the data the Newton steps made (every evaluation of ``U``).
    :param prediction_error: ``(d,)`` relative standard error of the predicted standard
        deviations: the rows' sampling, for a diagonal ``J`` its probes and the correlations
        it leaves out, and the nonlinearity (:func:`linearity_error`).
    :param dict cv_noise: plate -> the per-datum covariance of the control-variate gradient's
        noise at the target law (a scale).
    :param list nonlinearity: the :class:`Nonlinearity` of each direction :func:`linearity`
        probed.
    :param int rows_visited: rows whose per-datum terms were computed, all passes together.
    :param correlations: for a diagonal ``J``, the :class:`Correlations` it leaves out
        (``None`` for a dense ``J``).
    :param exact: ``(x, ĝ)``, a point within the polish's tolerance of the mode and the
        full-data gradient ``ĝ = -∇U(x)/n`` a pass computed there (flat, float64).
    :param dict cv_noise_error: plate -> ``(d,)``, the relative standard error of
        ``cv_noise``'s diagonal (its probes').
    :param float unreached: where the polish did not settle, the length of its last step in
        posterior sds (0 where it did); above :data:`UNREACHED_SDS` the prediction error is
        infinite: nothing bounds a picture linearised that far from the mode.
    :param bool unreached_diagonal: whether that length is of a step of the diagonal of ``J``
        alone (the conjugate gradients on the Hessian failed): on correlated parameters it can
        be far from the distance to the mode.
    """

    mode: dict
    information: object
    newton_step: float
    passes: int
    prediction_error: np.ndarray
    cv_noise: dict
    nonlinearity: list
    rows_visited: int
    correlations: Optional[Correlations] = None
    exact: Optional[tuple] = None
    cv_noise_error: Optional[dict] = None
    unreached: float = 0.0
    unreached_diagonal: bool = False


def fit(problem: Problem, warm, weights, must_settle: bool = False) -> Fit:
    """The local picture for ``weights`` (module docstring).

    ``must_settle``: raise :class:`PolishNotSettled`, without a warning, where the Newton
    steps do not settle at a mode or fail on the way (``warm`` is then the model's start, not
    an optimizer's mode: :func:`~numpyro_sgmc.autotune` runs the optimizer and fits again).
    Where they stop short of a mode, :class:`NoModeReached`."""
    prepared, options = problem.prepared, problem.options
    n, d = prepared.num_data, prepared.layout.size
    dense = d <= DENSE_MAX_DIM if options.dense is None else bool(options.dense)
    kind = "dense" if dense else "diagonal"
    rows, probes, visited = options.num_rows, PROBES, 0

    def info_at(params, regularize=options.regularize, more_rows=False):
        nonlocal visited, rows, probes
        if more_rows and rows is not None:
            rows = None if 2 * rows >= n else 2 * rows
        while True:
            info = information_of(
                prepared, problem.rng_key, problem.model_args, problem.model_kwargs, params,
                num_rows=rows, kind=kind, regularize=regularize, num_probes=probes,
            )  # fmt: skip
            visited += info.num_rows
            if not must_settle:  # from the start, rows may be saturated (a logit of 10⁴)
                _refuse_non_smooth(info)
            # a diagonal of correlated parameters from random probes is noisy, and as the
            # Newton direction's preconditioner it stalls the conjugate gradients: exact
            if not _exact_diagonal_wanted(info, probes, d):
                break
            probes = d
        # J's rows seemed to miss curvature: every row's along the axes says whether they do
        return everywhere_if_missed(params, info)[0] if more_rows else info

    def everywhere_if_missed(params, info):
        """``(info, missed)``: ``J`` and ``I`` again from every row where the sample missed
        rows that carry an axis (:func:`sample_misses`) and every row costs at most
        ``EVERY_ROW_WORK``; ``missed`` is the check's finding where they do not."""
        nonlocal visited, rows
        missed = sample_misses(problem, params, info)
        visited += 0 if missed is None else n
        if missed is None or not np.any(missed > 0):
            return info, None
        if n * (d if kind == "dense" else min(probes, d)) > EVERY_ROW_WORK:
            return info, missed
        rows = None
        return info_at(params), None

    gradient = host.take(warm.gradient, warm.best)
    u = None if warm.potential is None else float(warm.potential[warm.best])
    # a sample's mode lies about sqrt(d (n/m - 1)) posterior sds from the data's
    apart = 0.0 if warm.sample_size is None else math.sqrt(d * (n / warm.sample_size - 1.0))
    # from the start, more estimates of J (START_CURVATURES), and no warning where they fail
    start = {"max_curvatures": START_CURVATURES, "warn_unsettled": False} if must_settle else {}
    try:
        mode, distance, passes, info, exact, settled, remaining, rough = newton_polish(
            problem, warm.member(warm.best), gradient, info_at, potential=u, distance=apart,
            **start,
        )  # fmt: skip
    except (FloatingPointError, ValueError):  # a J not finite, or not usable, on the way
        if not must_settle:
            raise
        settled, passes, rough = False, 0, False  # the passes before the failure: unknown
    if must_settle and not settled:
        raise PolishNotSettled(passes + visited / n)
    unreached = 0.0 if settled else remaining
    # steps that stopped short where the gradient vanishes: a saddle (newton_polish's warning)
    stationary = not settled and remaining <= POLISH_TOL
    with _no_mode_unless(settled, stationary):  # where the steps stopped short
        if info is None or info.regularization > 0 or options.regularize is not None:
            info = info_at(mode)  # the curvature at the mode, with the user's regularisation
        while True:
            error = prediction_error(info, weights)
            worst = float(np.max(error))
            noisy_probes = kind == "diagonal" and float(np.max(info.probe_error)) > 0.1
            if noisy_probes and probes < MAX_PROBES:
                probes *= 4
            elif worst > options.tolerance and info.num_rows < n:
                # the error falls as 1/sqrt(rows); a quarter more for the estimate's own noise.
                # The rows double (as many times as that asks): the count is a static shape of
                # the compiled sums, so new data of the same shapes, whose error asks for a
                # slightly different count, finds it compiled
                wanted = info.num_rows * (worst / options.tolerance) ** 2 * 1.25
                rows = min(n, info.num_rows * 2 ** math.ceil(math.log2(wanted / info.num_rows)))
            else:
                break
            info = info_at(mode)
        # (a picture linearised away from the mode states no error bar: nothing to correct)
        if unreached <= UNREACHED_SDS:
            checked, missed = everywhere_if_missed(mode, info)
            if missed is not None:  # every row costs too much: the miss is the error
                error = np.sqrt(error**2 + missed**2)
            elif checked is not info:
                info, error = checked, prediction_error(checked, weights)
        info = debiased(info)  # the rows' bias of K⁻¹ and S, from the same jackknife
        target = target_covariance(info.potential_curvature, info.I, weights, info.data_free)
        target = target * (1.0 / n)
        # as many rows as made J and I accurate: a few thousand miss the rare rows of large
        # curvature (raw covariates) that dominate the control-variate noise
        cv_rows = min(n, max(CONTROL_VARIATE_ROWS, info.num_rows))
        cv_noise, cv_noise_error = control_variate_noise(
            prepared, problem.rng_key, problem.model_args, problem.model_kwargs, mode, target,
            num_rows=cv_rows, kind=kind,
        )  # fmt: skip
        visited += cv_rows
        thin = thin_profiles(problem, mode, target, info)
        findings = linearity(
            problem, mode, target, exact=exact, data_free=info.data_free, information=info,
            profiled=thin,
        ) + thin  # fmt: skip
        # a thin level's profile stands for the widest direction along it (not probed again)
        probed = [f for f in findings if f.parameter is None or f.informing_rows > 0]
        flat = list(dict.fromkeys(f.label for f in probed if not math.isfinite(f.sd_ratio)))
        steep = [f for f in probed if f.sd_ratio < STEEP_RATIO]
        # the steps put the mode within a sd, yet the potential does not rise on one side, or
        # rises as no quadratic there does: no near-Gaussian mode, no kernel. Farther out, the
        # descent towards the mode explains the profile (a rise of ½t² - tm at distance m),
        # and the prediction goes without an error bar
        if (flat or steep) and not settled and unreached <= UNREACHED_SDS:
            if flat:
                raise ValueError(_no_mode(_NO_RISE.format(", ".join(flat))))
            f = min(steep, key=lambda f: f.sd_ratio)
            raise ValueError(_no_mode(_STEEP.format(f.label, 1.0 / f.sd_ratio)))
        error = np.sqrt(error**2 + linearity_error(findings, target) ** 2)
        if unreached > UNREACHED_SDS:  # a picture linearised away from the mode: no error bar
            error = np.full(d, np.inf)
        linked = None
        if kind == "diagonal":
            try:
                linked = correlations(problem, mode, info)
            except NotPositiveDefinite as error:
                if not settled:  # _no_mode_unless: where the steps stopped short
                    raise
                raise ValueError(_saddle(error.sites, _CONJUGATE)) from error
            visited += linked.num_rows
            error = with_correlations(error, linked, weights)
    return Fit(
        mode, info, distance, passes, error, cv_noise, findings, visited, linked, exact,
        cv_noise_error, unreached, rough and unreached > 0,
    )  # fmt: skip


def _refuse_non_smooth(info):
    """Raise a ``ValueError`` where a parameter's per-datum gradients vary over
    the rows (``I_jj > 0``) but their curvature is nil (the data part of ``J_jj`` under a
    millionth of ``I_jj``; for a smooth model the two are equal up to its misspecification):
    a Laplace or asymmetric-Laplace (quantile) likelihood, or an absolute or check loss,
    whose second derivative is zero at almost every row. The Newton steps, the predicted sds
    and the step bound are all built on that curvature: a Laplace regression's warm start
    stopped "2,360 sds from the mode" (in the prior's sds), and with a ridge the kernel
    diverged at every step. Not asked of the Newton steps from the model's start, where the
    rows of a smooth model can be saturated (a logistic regression's logits of ±10⁴ on raw
    covariates have a curvature that underflows to zero): a non-smooth model fails there and
    is refused at the optimizer's mode."""
    data_part = np.asarray(info.J.diagonal(), np.float64) - info.regularization
    spread = np.asarray(info.I.diagonal(), np.float64)
    prior = np.asarray(info.J_prior.diagonal(info.layout.size), np.float64)
    # a diagonal's random probes clip a noisy entry to zero; a nil curvature is nil on each
    exact = np.zeros(spread.size) if info.probe_error is None else info.probe_error
    # nil, not negative (a curvature of the wrong sign, as a network's hidden weights have
    # away from a mode, is no mode yet: the Newton steps and J + J_prior's check say so), and
    # for gradients that matter against the prior (a saturated tanh unit's are 1e-30)
    flat = np.flatnonzero((spread > prior) & (np.abs(data_part) <= 1e-6 * spread) & (exact == 0))
    if flat.size:
        names = info.layout.names()
        labels = ", ".join(names[j] for j in flat[:5])
        more = f" and {flat.size - 5} more" if flat.size > 5 else ""
        raise ValueError(
            f"autotune cannot tune this model: along {labels}{more} the log-likelihood's "
            "per-datum gradients vary over the rows, but its curvature is zero at almost every "
            "row (a non-smooth likelihood: a Laplace or asymmetric-Laplace (quantile) "
            "likelihood, an absolute or check loss). The tuner's Newton steps, predicted sds "
            "and step bound are built on that curvature. Sample the model with NUTS (on all "
            "the data), or write the likelihood smooth (a Student-t for robustness, a "
            "smoothed check loss for quantiles)."
        )


_NOT_POSITIVE = "J + J_prior is not positive definite in the direction of {}"
_NO_RISE = (
    "the log posterior does not rise on one side along {} (the LinearizationWarning above), "
    "so the step and batch tuned there would be for a curvature the posterior does not have"
)
_STEEP = (
    "the log posterior along {} is {:.2g}x narrower than its quadratic there (the "
    "LinearizationWarning above), so the step and batch tuned there would be for a curvature "
    "the posterior does not have"
)


def _exact_diagonal_wanted(info, probes, d) -> bool:
    """Whether a diagonal ``J`` from random probes is noisy (an error over 10%: correlated
    parameters, where the error is the off-diagonal mass over ``√K``) and the exact diagonal
    (:func:`~numpyro_sgmc.tuner.fisher.exact_probes` Hadamard probes) is affordable."""
    noisy = info.kind == "diagonal" and float(np.max(info.probe_error)) > 0.1
    return noisy and probes < d and exact_probes(d) <= EXACT_DIAGONAL_PROBES


@contextmanager
def _no_mode_unless(settled: bool, stationary: bool = False):
    """Where the polish did not settle, a ``J + J_prior`` not positive definite or terms not
    finite at the point it reached say there is no mode, not that the user's params are bad
    (the point is the tuner's own): :func:`_no_mode`; where the gradient vanishes there
    (``stationary``), a saddle: :func:`_saddle`."""
    try:
        yield
    except NotPositiveDefinite as error:
        if settled:
            raise
        if stationary:
            raise ValueError(_saddle(error.sites, _INDEFINITE)) from error
        raise NoModeReached(_no_mode(_NOT_POSITIVE.format(", ".join(error.sites)))) from error
    except NotFinite as error:
        if settled:
            raise
        raise NoModeReached(_no_mode(f"{error.what} are not finite")) from error


def _saddle(sites, how: str) -> str:
    """Why there is nothing to tune at where the polish stopped at a saddle point: the
    gradient zero, the curvature negative along ``sites`` (``how``: what showed it, the dense
    ``J + J_prior`` or, for a diagonal ``J``, which does not show it, :func:`correlations`)."""
    named = ", ".join(sites[:8]) + (f" and {len(sites) - 8} more" if len(sites) > 8 else "")
    return (
        "autotune found no mode to linearise at: the damped Newton steps settled where the "
        "gradient is zero, but the potential curves downwards there in the direction of "
        f"{named} ({how}): a saddle point, not a mode. A start on a symmetry of the model "
        "sits on one, and no gradient step leaves it: autotune's default start, the prior's "
        "mean (init_to_mean), puts a neural network's hidden units all the same, and a "
        "factor whose sign the likelihood does not see (a low-rank covariance's W in W Wᵀ, "
        "the a and b of a product a·b) at 0. A network's interchangeable and unused units "
        "give many modes and saddles besides: sample a network as a deep ensemble "
        "(numpyro_sgmc.bde, with step_size='auto') rather than through one Gaussian. For "
        "another model, start away from the symmetry: "
        "init_strategy=init_to_value(values=...) with those sites away from 0 (the posterior "
        "then has a mode and its mirror image; the run samples the one it starts at, which "
        "is right for what the sign does not change, such as W Wᵀ)."
    )


_INDEFINITE = "J + J_prior is not positive definite there"
_CONJUGATE = "the conjugate gradients on its Hessian met negative curvature"


def _no_mode(where: str) -> str:
    """Why there is nothing to tune at when the polish did not settle and, where it stopped,
    ``where`` holds (``_NOT_POSITIVE``, ``_NO_RISE``, terms not finite); the fixes."""
    return (
        "autotune found no mode to linearise at: the damped Newton steps after the warm start "
        "did not settle (the ConvergenceWarning above), and where they stopped "
        f"{where}. The tuner predicts a Gaussian at a mode, and this posterior is not "
        "near-Gaussian around any point they reached: a ridge, a funnel or a flat direction. "
        "Common causes: (1) a non-centred hierarchy (alpha = mu + tau * z) whose groups are "
        "observed by tens of rows or more: its posterior curves along the group scale; write "
        "it centred (alpha ~ Normal(mu, tau)), which is near-Gaussian when every group has "
        "many rows; (2) a centred hierarchy in which some groups are observed by a few rows "
        "each: those groups' effects and the group scale form a funnel, whose joint mode, "
        "if there is one, sits at a smaller scale than the posterior's mass: sample it with "
        "NUTS (on all the data); (3) a group scale that may be near zero (groups that differ "
        "less than their rows resolve, or a few groups) or a shrinkage prior (horseshoe, "
        "heavy-tailed local scales): its posterior piles up against zero in either form, "
        "with no Gaussian to tune for: sample it with NUTS, or fix or drop that scale; "
        "(4) separable classes or a flat likelihood: give these sites a more informative "
        "prior, or run the warm start longer (warm_start_epochs); (5) several modes (a "
        "mixture's exchangeable components): order the components (an ordered_vector of "
        "means) and start at the mode you want (init_strategy=init_to_value(values=...)), "
        "or sample it with NUTS; (6) a neural network, whose interchangeable and unused "
        "units give many modes and saddles: sample it as a deep ensemble "
        "(numpyro_sgmc.bde, with step_size='auto') rather than through one Gaussian."
    )


def prediction_error(info, weights) -> np.ndarray:
    """``(d,)`` relative standard error of the target's standard deviations from the rows'
    sampling (the jackknife) and, for a diagonal ``J``, its probes (the correlations a
    diagonal leaves out are :func:`correlations`'s, with their own error)."""
    free = info.data_free

    def sds(J, I):
        return np.sqrt(np.asarray(target_covariance(J, I, weights, free).diagonal(), np.float64))

    with np.errstate(invalid="ignore"):
        error = info.jackknife(sds) / sds(info.potential_curvature, info.I)
    # a replicate without one group's rows lost all curvature along a parameter (8 rows of one
    # class under a Cauchy prior, whose curvature is negative out there): those rows carry it
    error = np.where(np.isfinite(error), error, 1.0)
    if info.kind == "diagonal" and info.num_probes:
        error = np.sqrt(error**2 + (0.5 * info.probe_error) ** 2)
    return error


MISSED_LOG = 0.1
"""Where a sampled ``J``'s curvature along a checked direction is more than ``e^0.1`` (and four
of its jackknife errors) off every row's, its sample missed rows that carry that direction."""


def sample_misses(problem, mode, info) -> Optional[np.ndarray]:
    """Whether the rows behind ``info`` (a sample) miss some that carry a parameter: ``(d,)``,
    the relative error of each predicted sd that every row's curvature shows (zeros where
    nothing is off), or ``None`` where it was not checked.

    Along the coordinates whose sampled data curvature is least against the prior's
    (:data:`~numpyro_sgmc.tuner.rows.CURVATURE_CHECK_DIRECTIONS` of them), the data's exact
    curvature ``Σ_i e_jᵀ(-∇²l_i)e_j`` over every row (one pass,
    :func:`~numpyro_sgmc.tuner.rowsums.curvature_along`), with the prior's, is compared with
    the prediction's ``n (J + J_prior)_jj``. The jackknife cannot see rows that no group of
    the sample holds (a category of a few rows); this pass does. Off by more than
    :data:`MISSED_LOG` and four jackknife errors, the sd of ``θ_j`` is off by about
    ``√(predicted/exact)``. Axes, not the target's widest directions: those are chosen by the
    sample's own noise (at d = 120 from 10,000 rows the sample's curvature along them was
    10% under every row's, a bias the prediction's jackknife correction removes).
    Not checked where ``info`` used every row, where the data are read from files, or where
    the pass would cost more than
    :data:`~numpyro_sgmc.tuner.rows.CURVATURE_CHECK_WORK` row evaluations."""
    prepared = problem.prepared
    spec, layout, n = prepared.spec, prepared.layout, prepared.num_data
    d = layout.size
    arrays, structure = split_args(problem.model_args, problem.model_kwargs)
    k = min(d, CURVATURE_CHECK_DIRECTIONS)
    if info.num_rows >= n or n * k > CURVATURE_CHECK_WORK:
        return None
    if any(file_backed(x) for x in arrays):
        return None
    data = np.asarray(info.J.diagonal(d), np.float64)
    share = data / np.maximum(data + np.asarray(info.J_prior.diagonal(d), np.float64), 1e-300)
    basis = np.eye(d)[:, np.argsort(share, kind="stable")[:k]]  # (d, k), unit columns

    along = partial(_along_columns, basis=basis, n=n)
    chunk = 2 ** int(np.clip(math.floor(math.log2(VMAP_ELEMENTS / (k * d))), 10, 16))
    exact = curvature_along(
        spec, structure, layout, chunk, layout.ravel(mode),
        host.device_array(basis, jnp.result_type(float)), arrays,
    )  # fmt: skip
    ridge = n * info.regularization * np.sum(basis**2, axis=0)
    everywhere = np.asarray(exact, np.float64) + along(info.J_prior) + ridge
    predicted = along(info.potential_curvature)
    off = np.log(np.maximum(everywhere, 1e-300) / np.maximum(predicted, 1e-300))
    noise = info.jackknife(lambda K, _: np.log(np.maximum(along(K), 1e-300)))
    missed = np.abs(off) > np.maximum(MISSED_LOG, 4.0 * noise)
    factor = np.abs(np.exp(-0.5 * off) - 1.0) * missed
    return np.max(basis * factor, axis=1)


#: the least ``pᵀHp / pᵀDp`` along a conjugate-gradient direction that is not rounding: below
#: its negative, ``H`` is not positive definite (a saddle's is of order -1)
NEGATIVE_CURVATURE = 1e-4


class Correlations(NamedTuple):
    """What a diagonal ``J`` leaves out, per parameter (:func:`correlations`), in the
    Jacobi-scaled ``C = D^{-1/2} J D^{-1/2}``, ``D = diag(J)``, with eigenpairs ``(λ_k, v_k)``.

    :param inflation: ``(C⁻¹)_jj = J_jj (J⁻¹)_jj``, the variance inflation factor: the
        posterior variance over the diagonal's ``1/(n J_jj)`` (1 without correlations).
    :param inflation_error: its relative standard error (the probes).
    :param concentration: ``(C⁻²)_jj / (C⁻¹)_jj = Σ v_kj²/λ_k² / Σ v_kj²/λ_k``: the inverse
        of the effective eigenvalue of ``ΓJ`` that parameter ``j`` mixes at with ``Γ = D⁻¹``;
        its integrated autocorrelation time is ``4 c_j / h - 1`` iterations (``docs/theory.md``
        §3, "Mixing time").
    :param int num_rows: the rows the solves visited (the half sample's included).
    """

    inflation: np.ndarray
    inflation_error: np.ndarray
    concentration: np.ndarray
    num_rows: int


@one_shot_jit(("spec", "structure", "layout", "iterations"))
def _preconditioned_solves(spec, structure, layout, iterations, zf, diag, probes, batch, arrays):
    """``x_k = H⁻¹ D^{1/2} z_k`` for every probe ``z_k`` by Jacobi-preconditioned conjugate
    gradients on the rows' Hessian ``H = ∇²U_m(θ̂)`` (prior included; ``diag`` is ``D``, the
    diagonal of ``H``), the relative residuals, and the least curvature the search directions
    met, ``min pᵀHp / pᵀDp`` (negative: ``H`` is not positive definite, ``θ̂`` no mode) with its
    direction."""
    args, kwargs = structure.rebuild(arrays)
    grad = jax.grad(lambda x: potential(spec, layout.unravel(x), batch, args, kwargs))
    hvp = jax.vmap(lambda v: jax.jvp(grad, (zf,), (v,))[1])
    rhs = probes * jnp.sqrt(diag)
    tiny = jnp.finfo(zf.dtype).tiny
    x = rhs / diag
    r = rhs - hvp(x)
    p = r / diag
    rz = jnp.sum(r * p, axis=1)
    least = (jnp.full(rz.shape, jnp.inf, zf.dtype), p)
    first = jnp.sum(p * p * diag, axis=1)  # a converged solve's directions shrink to nothing

    def body(_, state):
        x, r, p, rz, least = state
        Ap = hvp(p)
        pAp, pDp = jnp.sum(p * Ap, axis=1), jnp.sum(p * p * diag, axis=1)
        met = jnp.where(pDp > 1e-12 * first, pAp / jnp.maximum(pDp, tiny), jnp.inf)
        lower = met < least[0]
        least = (jnp.where(lower, met, least[0]), jnp.where(lower[:, None], p, least[1]))
        alpha = rz / jnp.maximum(pAp, tiny)
        x = x + alpha[:, None] * p
        r = r - alpha[:, None] * Ap
        z = r / diag
        rz_new = jnp.sum(r * z, axis=1)
        return x, r, z + (rz_new / jnp.maximum(rz, tiny))[:, None] * p, rz_new, least

    x, r, _, _, least = lax.fori_loop(0, iterations, body, (x, r, p, rz, least))
    return x, jnp.linalg.norm(r, axis=1) / jnp.linalg.norm(rhs, axis=1), least


def correlations(problem, mode, info, max_rows=CORRELATION_ROWS, num_probes=PROBES,
                 iterations=60):  # fmt: skip
    """The :class:`Correlations` a diagonal ``J`` leaves out, by probes: with Rademacher
    ``z_k`` and ``x_k = H⁻¹D^{1/2}z_k`` (Jacobi-preconditioned conjugate gradients,
    ``H = nJ`` from the information's own rows up to twice a budget of
    ``max(max_rows, 8d)`` (:data:`~numpyro_sgmc.tuner.rows.CORRELATION_ROWS_PER_PARAMETER`),
    so that ``H`` and the diagonal ``D`` share their rows' sampling, else from a sample of the
    budget), ``E[x_kj z_kj] = (H⁻¹)_jj D_jj^{1/2}`` and ``E[x_kj²] = (H⁻¹DH⁻¹)_jj`` (Bekas,
    Kokiopoulou and Saad 2007, the stochastic diagonal estimator).
    ``O(num_probes · iterations)`` Hessian-vector products per row, ``O(num_probes · d)``
    memory.

    ``H`` from ``m < n`` rows is the full data's plus noise, and the inverse of a noisy matrix
    is too large on average (Jensen): for rows of a Wishart law ``E[Ĥ⁻¹] = H⁻¹ m/(m - d - 1)``,
    whose reciprocal falls linearly in ``1/m``. On a logistic regression with ``d = 2000``
    and ``n = 20,000`` the inflation from 10,000 rows was 1.36 times the full data's. So the
    solves run again on the sample's even and odd rows, and the reciprocal of each estimate
    is extrapolated to all ``n`` rows (Richardson, from ``1/m - 1/n`` for rows without
    replacement, ``1/m`` with): ``1/f = 1/f_m + κ(1/f_m - 1/f_{m/2})``, ``f_{m/2}`` the
    halves' mean and ``κ = 1 - m/n`` or 1. The error is the probes' jackknife and the rows'
    sampling, which the two halves' difference measures (pooled over the parameters)."""
    prepared = problem.prepared
    layout, spec, n = prepared.layout, prepared.spec, prepared.num_data
    zf = layout.ravel(mode)
    d = layout.size
    diag = n * np.asarray(info.potential_curvature.diagonal(), np.float64)
    rng = Stream.CORRELATION_PROBES.rng(problem.rng_key)
    probes = 2.0 * rng.integers(0, 2, (int(num_probes), d)) - 1.0
    budget = max(int(max_rows), CORRELATION_ROWS_PER_PARAMETER * d)
    if info.num_rows <= 2 * budget:  # the rows information_of chose for this key
        chosen = choose_rows(spec.plates, info.num_rows if info.num_rows < n else None,
                             problem.rng_key)  # fmt: skip
        rows = chosen_indices(spec.plates, chosen)
        kappa = 1.0 - info.num_rows / n  # without replacement: 0 on every row
    else:  # the same stream, after the probes, with replacement
        drawn = random_rows(rng, spec.plates, budget).indices
        rows = {k: np.asarray(v) for k, v in drawn.items()}
        kappa = 1.0
    # every row: H is the data's own. Else the sample and its two halves (even, odd rows)
    samples = [rows]
    if kappa > 0.0:
        samples += [
            {k: v[start::2] if len(v) > 1 else v for k, v in rows.items()} for start in (0, 1)
        ]  # fmt: skip
    arrays, structure = split_args(problem.model_args, problem.model_kwargs)
    cross, second = [], []
    for sample in samples:
        indices = {k: host.device_array(v, np.int32) for k, v in sample.items()}
        local, batch = rows_in_memory(arrays, spec.plates, Batch(indices))
        x, _, (met, direction) = _preconditioned_solves(
            spec, structure, layout, int(iterations), zf, host.device_array(diag, zf.dtype),
            host.device_array(probes, zf.dtype), batch, local,
        )  # fmt: skip
        met, worst = np.asarray(met, np.float64), int(np.argmin(np.asarray(met)))
        if met[worst] < -NEGATIVE_CURVATURE:  # the solves' curvature: H is not positive definite
            weights = np.abs(np.sqrt(diag) * np.asarray(direction[worst], np.float64))
            names = layout.names()
            sites = [names[k] for k in np.flatnonzero(weights >= 0.3 * np.max(weights))]
            raise NotPositiveDefinite(
                sites,
                f"the Hessian of the potential has curvature {met[worst]:.3g} (relative to its "
                f"diagonal) in the direction of {', '.join(sites[:8])}"
                + (f" and {len(sites) - 8} more" if len(sites) > 8 else ""),
            )
        x = np.asarray(x, np.float64)
        cross.append(x * probes * np.sqrt(diag))  # per probe: D_jj (H⁻¹)_jj, unbiased for H
        second.append(diag * x**2)  # per probe: (D^{1/2}H⁻¹DH⁻¹D^{1/2})_jj

    def reciprocals(means):  # 1/f of the sample and of each half
        return [1.0 / np.maximum(m, 1e-3) for m in means]

    def extrapolated(means):  # the reciprocals' Richardson step to every row
        g = reciprocals(means)
        if len(g) == 1:
            return 1.0 / g[0]
        return 1.0 / np.maximum((1.0 + kappa) * g[0] - kappa * 0.5 * (g[1] + g[2]), 1e-3)

    K = len(probes)
    means = [c.mean(axis=0) for c in cross]
    inflation = extrapolated(means)
    leave_one_out = extrapolated([(c.sum(axis=0) - c) / (K - 1) for c in cross])  # (K, d)
    error = np.sqrt((K - 1) * leave_one_out.var(axis=0)) / inflation
    if kappa > 0.0:  # the halves' difference: √2 a half's sd from the rows, √2 the sample's
        g = reciprocals(means)
        error = np.hypot(error, np.sqrt(np.mean((0.5 * (g[1] - g[2]) * inflation) ** 2)))
    concentration = np.maximum(
        extrapolated([c.mean(axis=0) for c in second]) / inflation, inflation
    )
    visited = sum(len(v) for sample in samples for v in sample.values())
    return Correlations(inflation, error, concentration, visited)


def with_correlations(error, linked: Correlations, weights) -> np.ndarray:
    """A diagonal ``J``'s relative sd ``error`` with what its :class:`Correlations` add: the
    probes' error of the inflation (half of it, on the sd), and for a target with a sandwich
    part (``weights[0] > 0``), whose correlations are bounded but not predicted, half the
    inflation's distance from 1."""
    error = np.sqrt(np.asarray(error) ** 2 + (0.5 * linked.inflation_error) ** 2)
    if weights[0] > 0:
        error = error + 0.5 * np.abs(linked.inflation - 1.0)
    return error


def newton_polish(
    problem,
    mode,
    gradient,
    info_at,
    max_passes=20,
    max_curvatures=12,
    tol=POLISH_TOL,
    potential=None,
    distance=0.0,
    warn_unsettled=True,
):
    """Damped Newton steps ``θ̂ + J⁻¹ḡ`` from the warm start's mode, with exact full-data
    gradients ``ḡ``: the convergence test of the warm start, relative to the curvature.

    The step's length in posterior sds, ``sqrt(n ḡᵀJ⁻¹ḡ)``, is the distance to the mode; the
    polish stops when it is below ``tol``, or when it is below :data:`SETTLING_SDS` and the
    contraction of the last step predicts the next within ``tol/4`` (that step is then taken
    without a pass: at ``n = 10⁹`` a third pass over the disk). Each step is shortened to the
    trust radius ``max(10, 3√d, 3·distance)`` sds (widened fourfold after a full step at the
    radius, narrowed to what was taken otherwise) and halved until the full-data potential ``U``
    is finite and has not risen (a backtracking line search: a Newton step can overshoot where
    the log posterior is far from quadratic, as a hierarchical scale's is). Where ``J`` is not
    positive definite (the mode not reached) it is lifted to the Levenberg–Marquardt ``J + rI``.
    ``J`` is re-estimated from the information rows (``info_at``) after a long or damped step,
    or when the steps stop shrinking by half; otherwise the same ``J`` is reused (a chord
    iteration: one pass over the data per step). Steps longer than 3 sds that swing back and
    forth without contracting (twice in a row a cosine below -0.5 with the last one) say
    ``J``'s rows miss curvature the data have: ``J`` is estimated again from twice the rows,
    outside the budget of estimates. A mode not reached in ``max_passes`` steps gets
    a :class:`~numpyro_sgmc.diagnostics.ConvergenceWarning` (unless not ``warn_unsettled``).

    :param potential: ``U`` at ``mode`` where known (the pass that gave ``gradient``); else
        one more pass computes it.
    :param float distance: how far, in posterior sds, ``mode`` is expected to be from the
        data's (a warm start on a row sample's mode), to trust a step that long.
    :param info_at: ``info_at(params, regularize, more_rows=False) -> Information``; a ``J``
        estimated near the mode whose step does not halve the distance is estimated again
        from twice the rows (heavy-tailed rows make a few thousand of them a poor ``J``).
    :return: ``(mode, distance, passes, information, exact, settled, remaining, rough)``:
        the polished mode,
        the length of the first step in posterior sds, the passes over the data (each
        evaluation of ``U`` on every row, the line searches' halvings included), the
        information at the mode (``None`` when the mode moved more than ``tol`` sds since it
        was estimated), ``(x, ĝ)``, the last point whose full-data gradient ``ĝ`` a pass
        computed (within :data:`SETTLING_SDS` of the mode; the mode itself if the polish stopped
        short), whether it settled within ``tol``, and the last step's length in posterior
        sds (how far from the mode it stopped), and whether a step of the diagonal of ``J``
        alone stood in for the Newton direction on the way (the lengths are then that step's).
    """
    prepared = problem.prepared
    layout, n = prepared.layout, prepared.num_data
    dtype = layout.ravel(mode).dtype
    x = np.asarray(layout.ravel(mode), np.float64)
    trust = max(10.0, 3.0 * math.sqrt(x.size), 3.0 * distance)
    g = np.asarray(layout.ravel(gradient), np.float64)
    steps, passes = 0, 0  # Newton steps taken; evaluations of U on every row
    if potential is None:
        spec, data = prepared.spec, (problem.model_args, problem.model_kwargs)
        potential, passes = float(exact_gradient(spec, mode, *data)[0]), 1
    u = potential
    info, curvatures, fresh = info_at(mode, "auto"), 1, True  # fresh: J estimated at x
    first, previous, previous_fresh, settled = None, math.inf, False, False
    rough = False  # a step of a diagonal J's own: its length is not the distance to the mode
    taken, swings = None, 0  # the last step taken; how many in a row reversed the one before
    while True:
        curvature = info.potential_curvature
        J = _levenberg_marquardt(curvature)
        exact = info.regularization == 0 and J is curvature
        step = np.asarray(J.solve(g))
        if info.kind == "diagonal":
            diagonal = step
            step = _newton_direction(problem, x, g, J, info.num_rows, step, dtype)
            rough = rough or step is diagonal
        distance = float(np.sqrt(max(n * float(g @ step), 0.0)))
        first = distance if first is None else first
        if exact and distance <= tol:
            settled = True
            break
        # the chord steps contract at a steady rate, measured by the last: a step predicted
        # to land within tol/4 of the mode is taken without a pass to confirm it
        contracts = math.isfinite(previous) and previous > 0  # 0: a stationary point
        predicted = distance * distance / previous if contracts else math.inf
        if exact and distance <= SETTLING_SDS and predicted <= tol / 4:
            settled = True
            break
        if steps == max_passes:
            break
        contracting = distance <= 0.5 * previous
        reverses = taken is not None and float(step @ taken) < -0.5 * float(
            np.linalg.norm(step) * np.linalg.norm(taken)
        )
        swings = swings + 1 if reverses and not contracting else 0
        if swings >= 2 and previous > 3.0 and info.num_rows < n:
            # long steps that swing back and forth: J's rows miss curvature the data have (a
            # category of 11 rows in 100,000, none among 10,000 sampled: J had only the prior
            # there, and 20 steps swung by ±4.5; one overshoot from far out is the
            # posterior's shape, as a hierarchy's scale's, and within 3 sds the rows double
            # where the steps do not contract). Twice the rows, outside the budget of
            # estimates: at most log2(n / rows) times
            info = info_at(_point(layout, x, dtype), "auto", more_rows=True)
            fresh, previous, taken, swings = True, math.inf, None, 0
            continue
        if curvatures < max_curvatures and not fresh:
            if not exact or distance > 3.0 or not contracting:
                info, curvatures, fresh = (
                    info_at(_point(layout, x, dtype), "auto"),
                    curvatures + 1,
                    True,
                )
                continue
        elif curvatures < max_curvatures and previous_fresh and not contracting:
            if previous <= 3.0 and info.num_rows < n:  # a J from nearby that does not contract
                info = info_at(_point(layout, x, dtype), "auto", more_rows=True)
                curvatures, previous = curvatures + 1, math.inf
                continue
        limited = distance > trust
        moved, evaluations = _line_search(
            problem, x, step * min(1.0, trust / max(distance, 1e-300)), u
        )
        steps, passes = steps + 1, passes + evaluations
        if moved is None:  # no step along J⁻¹ḡ lowers U, or U is not finite along it
            break
        taken = moved[0] - x
        x, u, g, fraction = moved
        if limited and fraction == 1.0:  # the quadratic held over the whole radius: widen it
            trust *= 4.0
        elif fraction < 1.0:
            trust = max(trust * fraction, 1.0)
        previous, previous_fresh, fresh = distance, fresh, False
    if not settled and warn_unsettled and not exact and distance <= tol:
        warn(
            f"The damped Newton steps reached a point where the gradient vanishes (the last "
            f"step {distance:.3g} sds long, in the metric of J + J_prior lifted by "
            "Levenberg–Marquardt) but J + J_prior is not positive definite there: a saddle "
            "or a ridge, not a mode (a neural network's interchangeable or unused units, a "
            "parameter the data do not identify). The predictions, which linearise the model "
            "at a mode, do not hold there.",
            ConvergenceWarning,
        )
    elif not settled and warn_unsettled:
        warn(
            f"The warm start stopped {first:.3g} posterior standard deviations from the mode, "
            f"and {steps} damped Newton steps did not reach it (the last still "
            f"{distance:.3g} sds long"
            + (
                "; these lengths are of steps of the diagonal of J alone, as conjugate "
                "gradients on the full Hessian did not converge: on correlated parameters "
                "they can be far from the distance to the mode"
                if rough
                else ""
            )
            + "): the predictions, which linearise the model at the mode, may be off. Run the "
            "warm start longer (warm_start_epochs), or check that the model has a finite mode.",
            ConvergenceWarning,
        )
    # the last step, from a J estimated where it started, is within tol of exact; it needs no
    # pass of its own: ∇U there follows from ∇U at x (linearity's anchor)
    mode = _point(layout, x + step if settled else x, dtype)
    fitted = info if settled and fresh else None
    return mode, first, passes, fitted, (x, g), settled, distance, rough


def _newton_direction(problem, x, g, J, num_rows, fallback, dtype, iterations=100):
    """``H⁻¹(nḡ)`` by Jacobi-preconditioned conjugate gradients on the Hessian of every row up
    to :data:`~numpyro_sgmc.tuner.rows.NEWTON_ROWS`, else of about ``num_rows`` rows (at least
    that many, and :data:`~numpyro_sgmc.tuner.rows.NEWTON_ROWS_PER_PARAMETER` ``d``) without
    replacement, preconditioned by the diagonal ``J``: a diagonal ``J`` alone is a poor Newton
    direction where the parameters are correlated. A Hessian from ``m`` rows is the data's
    with noise whose inverse has eigenvalues out to ``(1 - √(d/m))⁻²`` of the data's (the
    Marchenko–Pastur edge): 20,000 rows drawn with replacement at ``d = 2000`` made steps
    up to twice too long, which the line search halved, and 20 steps did not settle.
    ``fallback`` (the diagonal step) where the solve leaves more than a quarter of the
    gradient as residual or is not a descent direction (``H`` not positive definite away
    from the mode)."""
    prepared = problem.prepared
    layout, spec, n = prepared.layout, prepared.spec, prepared.num_data
    diag = n * np.asarray(J.diagonal(x.size), np.float64)
    m = max(min(num_rows, NEWTON_ROWS), NEWTON_ROWS_PER_PARAMETER * x.size)
    m = n if n <= NEWTON_ROWS else m
    chosen = choose_rows(spec.plates, m if m < n else None, problem.rng_key, Stream.NEWTON_ROWS)
    indices = chosen_indices(spec.plates, chosen)
    rows = Batch({k: host.device_array(v, np.int32) for k, v in indices.items()})
    arrays, structure = split_args(problem.model_args, problem.model_kwargs)
    arrays, rows = rows_in_memory(arrays, spec.plates, rows)
    step, residual, _ = _preconditioned_solves(
        spec, structure, layout, int(iterations), host.device_array(x, dtype),
        host.device_array(diag, dtype), host.device_array((n * g / np.sqrt(diag))[None], dtype),
        rows, arrays,
    )  # fmt: skip
    step = np.asarray(step[0], np.float64)
    # an inexact Newton step (Dembo, Eisenstat & Steihaug 1982): float32 conjugate gradients
    # stall at relative residuals of 1-6% on correlated parameters (ρ = 0.5, d = 300), where
    # the diagonal step that replaced them took the line search to 1/2048 of its length
    if not np.all(np.isfinite(step)) or float(residual[0]) > 0.25 or float(g @ step) <= 0:
        return fallback
    return step


def _point(layout, x, dtype) -> dict:
    return layout.unravel(host.device_array(x, dtype))


def _line_search(problem, x, step, u, halvings=12):
    """``((x + s, U, ḡ, 2^-k), evaluations)`` for the longest ``s = step/2^k`` with a finite
    ``U`` and gradient and ``U`` no more than float rounding above ``u`` (``None`` if there is
    none), and the passes over the data it made."""
    prepared = problem.prepared
    layout = prepared.layout
    dtype = layout.ravel(prepared.init_params).dtype
    slack = 1e-5 * abs(u) + 1e-3  # the float32 rounding of a sum of n terms, and then some
    for k in range(halvings):
        z = layout.unravel(host.device_array(x + step, dtype))
        value, g = exact_gradient(prepared.spec, z, problem.model_args, problem.model_kwargs)
        value, g = float(value), np.asarray(layout.ravel(g), np.float64)
        if math.isfinite(value) and np.all(np.isfinite(g)) and value <= u + slack:
            return (x + step, value, g, 0.5**k), k + 1
        step = step / 2
    return None, halvings


def _levenberg_marquardt(J):
    """``J`` itself when positive definite, else Fletcher's scaled ``J + rD``, ``D`` the
    magnitude of ``J``'s diagonal, with the smallest eigenvalue of the Jacobi-scaled matrix
    lifted to a hundredth of its largest (scale-free: parameters' units do not matter)."""
    if positive_definite(J, 1e-6):
        return J
    diag = np.abs(np.asarray(J.diagonal(), np.float64))
    diag = np.maximum(diag, 1e-12 * max(diag.max(), 1e-300))
    root = 1.0 / np.sqrt(diag)
    values = np.linalg.eigvalsh(np.asarray(J.as_matrix(), np.float64) * np.outer(root, root))
    ridge = 0.01 * max(values[-1], abs(values[0])) - values[0]
    return J + Diagonal(ridge * diag)


class Nonlinearity(NamedTuple):
    """The log posterior against its local quadratic along one direction of the target.

    :param direction: ``(d,)`` unit vector (flat order).
    :param str label: the parameter it is mostly along.
    :param float sd: the target's sd along it, ``σ = sqrt(vᵀΣv)``.
    :param steps: the points probed, in target sds from the mode (``-2, -1, 1, 2``).
    :param rises: ``U(θ̂ + tσv) - U(θ̂)`` at them, in units of the quadratic's ``½t²`` (the
        control-variate estimate from the rows): ``[2, 0.5, 0.5, 2]`` for a Gaussian.
    :param float profile_ratio: the sd of the one-dimensional profile ``exp(-U)`` along
        ``v`` over the quadratic's (``σ`` along a widest direction; on a marginal path, whose
        steps move ``θ_j`` by more than its sd, ``σ/√κ``: :func:`profile_moments`); ``inf``
        when it is not normalisable.
    :param float sd_ratio: the sd along ``v`` over ``σ`` once the other probed directions
        are integrated over too: the profile's, times the change of the conditional variance
        along ``v`` as the posterior moves along each other direction (a hierarchical mean's
        curvature changes with the group scale).
    :param float curvature_growth: the largest curvature in the probed directions at the
        probes along ``v`` that a chain visits (a rise of at most :data:`VISITED_RISE`), over
        the curvature at the mode: ``max_t λmax(H(0)⁻¹H(tσv))``, 1 for a Gaussian. A step
        tuned at the mode is that much closer to its stability bound there
        (:func:`~numpyro_sgmc.tuner.tuning.autotune` shortens it past a growth of 2).
    :param parameter: for the marginal path of a parameter with no per-datum gradient
        (:func:`linearity`), its index in the flat order, the rises with the Laplace term;
        ``None`` for one of the target's widest directions.
    :param variance_change: for a marginal path, ``(d,)``: every other parameter's local
        variance ``(∇²U_m)⁻¹_ii`` along it, fitted as ``1 + at + bt²`` in units of its value
        at the mode and averaged over the path's profile (``1 + a E[t] + b E[t²]``; 1 for the
        path's own parameter, whose marginal the profile gives); ``None`` where the profile
        is not normalisable or the Hessian not positive definite.
    :param float mean_shift: the profile's mean in steps ``t`` (:func:`profile_moments`):
        the posterior's mean lies near ``θ̂ + E[t]σv`` (for a marginal path, the parameter's
        marginal mean); 0 where the profile is not normalisable.
    :param float continuation_error: for a widest direction whose probes are far from a
        Gaussian's, the relative error of the profile's sd from its unknown shape beyond the
        probes (:func:`continuation_error`); for a thinly informed parameter's path, from its
        shape between them (:func:`profile_on_grid`); 0 otherwise.
    :param float informing_rows: for the marginal path of a parameter that few rows inform
        (:func:`thin_profiles`), about how many (the inverse of the heaviest row's share);
        0 otherwise.
    :param tuple covers: for the thinly informed path farthest from Gaussian, the thinly
        informed parameters beyond :data:`THIN_PATHS` that were not profiled: its error
        stands for theirs.
    """

    direction: np.ndarray
    label: str
    sd: float
    steps: np.ndarray
    rises: np.ndarray
    profile_ratio: float
    sd_ratio: float
    curvature_growth: float = 1.0
    parameter: Optional[int] = None
    variance_change: Optional[np.ndarray] = None
    mean_shift: float = 0.0
    continuation_error: float = 0.0
    informing_rows: float = 0.0
    covers: tuple = ()


@one_shot_jit(("spec", "structure", "layout"))
def _profiles(
    spec, structure, layout, zf, deltas, basis, batch, anchor, full_gradient, paths, arrays
):  # fmt: skip
    """At every ``δ``: ``U_m(θ̂+δ) - U_m(θ̂) - ∇U_m(θ̂)ᵀδ + ∇U(θ̂)ᵀδ``, the rows' estimate of
    the potential's rise with its linear part replaced by the exact one (a control variate),
    and the curvature ``Wᵀ∇²U_m(θ̂+δ)W`` in the probed directions ``W`` (``basis``, ``(d, k)``);
    the curvature at ``θ̂`` itself too (the same rows at every point, so differences are
    sharp). ``full_gradient`` is ``∇U`` at ``a = θ̂ + anchor``, and ``∇U(θ̂)`` is taken as
    ``∇U(a) + ∇U_m(θ̂) - ∇U_m(a)`` (exact for ``anchor = 0``; otherwise the rows' error in
    the gradient's change over a step within the Newton tolerance).

    ``paths``: ``(m,)`` parameter indices ``j``, the first ``m`` directions being their
    marginal paths (four probes each): ``½ log det`` of ``∇²U_m`` without ``j``'s row and
    column at those probes, less its value at ``θ̂`` (``(m, 4)``; NaN where ``∇²U_m`` is not
    positive definite), the Laplace term that turns a profile into a marginal; and every
    parameter's local variance ``(∇²U_m)⁻¹_ii`` there over its value at ``θ̂``
    (``(m, 4, d)``)."""
    args, kwargs = structure.rebuild(arrays)
    U = lambda x: potential(spec, layout.unravel(x), batch, args, kwargs)  # noqa: E731

    def at(x):  # U, ∇U and Wᵀ∇²U W at x, from one trace of the model
        def along(w):
            (value, grad), (_, hw) = jax.jvp(jax.value_and_grad(U), (x,), (w,))
            return value, grad, hw

        values, grads, hw = jax.vmap(along, in_axes=1, out_axes=(0, 0, 1))(basis)
        return values[0], grads[0], basis.T @ hw

    points = jnp.concatenate([zf[None], zf + deltas, (zf + anchor)[None]])
    values, grads, curvatures = jax.vmap(at)(points)
    rises = values[1:-1] - values[0] - deltas @ (grads[-1] - full_gradient)

    def log_det_without(x_j):  # log det H_{-j,-j} = log det H + log (H⁻¹)_jj, and diag H⁻¹
        x, j = x_j
        root = jnp.linalg.cholesky(jax.hessian(U)(x))  # NaN where not positive definite
        inverse_root = jax.scipy.linalg.solve_triangular(root, jnp.eye(x.shape[0]), lower=True)
        variances = jnp.sum(inverse_root**2, axis=0)  # diag (L Lᵀ)⁻¹ = diag L⁻ᵀL⁻¹
        return 2.0 * jnp.sum(jnp.log(jnp.diag(root))) + jnp.log(variances[j]), variances

    m, d = paths.shape[0], zf.shape[0]
    if m == 0:
        none = (jnp.zeros((0, 4), zf.dtype), jnp.zeros((0, 4, d), zf.dtype))
        return rises, curvatures[0], curvatures[1:-1], *none
    along = jnp.concatenate([jnp.zeros((m, 1, d), zf.dtype), deltas[: 4 * m].reshape(m, 4, d)], 1)
    # one full Hessian at a time: d of them in a vmap over every probe would hold m·5·d² values
    logs, variances = lax.map(
        log_det_without, ((zf + along).reshape(5 * m, d), jnp.repeat(paths, 5))
    )
    logs, variances = logs.reshape(m, 5), variances.reshape(m, 5, d)
    volume = 0.5 * (logs[:, 1:] - logs[:, :1])
    return rises, curvatures[0], curvatures[1:-1], volume, variances[:, 1:] / variances[:, :1]


def linearity(
    problem, mode, target, num_rows=LINEARITY_ROWS, exact=None, data_free=None, information=None,
    profiled=(),
) -> list:  # fmt: skip
    """The log posterior along the target's three widest directions, and the marginal paths
    of up to three parameters with no per-datum gradient, against the quadratic every
    prediction assumes (``docs/theory.md`` §4, "The local picture and its error").

    The marginal path of parameter ``j`` (for a dense target) is ``v ∝ Σe_j``: ``j`` moves
    by ``t`` of its sds and
    every other parameter to its conditional mean given it, so that the profile along ``v``
    is ``j``'s marginal for a Gaussian. A hierarchy's scale (``data_free``: set only by the
    prior) is where a posterior leaves its quadratic, and its marginal path need not be among
    the widest directions: a centred hierarchy of 200 groups with 50 rows each had its mean's
    sd 1.13x the prediction through the group scale's skew, unseen by the widest three (all
    group intercepts). The data-free parameters probed are those whose marginal variance most
    exceeds their conditional one (``Σ_jj (Σ⁻¹)_jj``).

    At ``t = ±1, ±2`` target sds from the mode along each direction ``v_k``, from
    ``num_rows`` rows: the potential's rise (its linear part exact) gives the profile's mean
    and sd along ``v_k`` (:func:`profile_moments`); the curvature in the probed directions
    gives how each other direction's conditional variance ``c_i(t)`` changes along ``v_k``
    (fitted as ``1 + at + bt²``), averaged over the profile: ``1 + a E[t] + b E[t²]``. Their
    product is :attr:`Nonlinearity.sd_ratio`. One more than 10% from 1 raises a
    :class:`~numpyro_sgmc.diagnostics.LinearizationWarning`; :func:`linearity_error` turns
    them into an error of every predicted sd.

    :param exact: ``(point, ĝ)``, the full-data gradient ``ĝ = -∇U/n`` (flat) at a point
        near the mode (the Newton polish's last), or ``None`` for one more pass at the mode.
    :param profiled: findings along other directions (:func:`thin_profiles`): a widest
        direction along one of them is not probed again (four probes see less of a thin
        level's skew than its own twelve).
    :param information: the :class:`~numpyro_sgmc.tuner.fisher.Information` behind
        ``target``. Where it used every row, so does the profile if that costs at most
        :data:`~numpyro_sgmc.tuner.rows.LINEARITY_WORK` row evaluations (or no more than
        ``num_rows`` sampled rows): a category of a few rows, absent from a sample, left its
        coefficient's profile the prior's quadratic. Above that, where the sample's data
        curvature along a probed direction is off the information's, the rows that carry a
        share of it join the sample and the profile is measured again.
    :return: a :class:`Nonlinearity` per direction.
    """
    prepared = problem.prepared
    layout, spec, n = prepared.layout, prepared.spec, prepared.num_data
    zf = layout.ravel(mode)
    names = layout.names()
    paths = _marginal_paths(target, data_free, 3)
    directions = [_unit(_column(target, j)) for j in paths]
    labels = [names[j] for j in paths]
    seen = directions + [f.direction for f in profiled]
    # then the three widest directions not along a path (the count is a static shape)
    for v in scales.principal_axes(target, 3 + len(paths) + len(profiled)):
        if len(directions) < 3 + len(paths) and all(abs(v @ u) < PARALLEL for u in seen):
            directions.append(v)
            labels.append(names[int(np.argmax(np.abs(v)))])
    k = len(directions)
    if k == 0:  # every direction profiled already (one parameter of a few rows)
        return []
    sd = _sds_along(target, directions)
    steps = np.array([-2.0, -1.0, 1.0, 2.0])
    deltas = np.concatenate([np.outer(steps * s, v) for v, s in zip(directions, sd, strict=True)])
    basis = np.stack(directions, axis=1) * sd
    if exact is None:
        _, g = exact_gradient(spec, mode, problem.model_args, problem.model_kwargs)
        exact = (np.asarray(zf, np.float64), np.asarray(layout.ravel(g), np.float64))
    anchor = np.asarray(exact[0], np.float64) - np.asarray(zf, np.float64)
    full = -n * np.asarray(exact[1], np.float64)  # ∇U = -n ĝ
    arrays, structure = split_args(problem.model_args, problem.model_kwargs)
    every_row = information is not None and information.num_rows >= n
    # per row: a value, gradient and k Hessian-vector products at 4k + 2 points, and a path's
    # full Hessian (d products) at each of its 5 points
    per_row = (4 * k + 2) * (k + 1) + 5 * len(paths) * layout.size
    if every_row and (n <= num_rows or n * per_row <= LINEARITY_WORK):
        batch = _every_row(spec.plates)
    else:
        batch = sample_rows(Stream.LINEARITY_ROWS, problem.rng_key, spec.plates, num_rows)

    def measured(batch):
        local, batch = rows_in_memory(arrays, spec.plates, batch)
        # in float64: the rises are a few nats of a potential of order n (at n = 10⁷ a float32
        # U has an ulp of 0.5 nats, and the profile was noise: "rises by 2.49, 1.25, 0.782,
        # 2.58")
        with jax.enable_x64(True):
            wide = partial(np.asarray, dtype=np.float64)
            return tuple(
                np.asarray(x, np.float64)
                for x in _profiles(
                    spec,
                    structure,
                    layout,
                    wide(zf),
                    wide(deltas),
                    wide(basis),
                    batch,
                    wide(anchor),
                    wide(full),
                    np.asarray(paths, np.int32),
                    local,
                )  # fmt: skip
            )

    rises, H0, H, volume, spread_along = measured(batch)
    sampled = every_row and _row_count(batch) < n and not any(file_backed(x) for x in arrays)
    if sampled and _rows_missed(information, basis, np.diag(H0)):
        heavier = _with_heavy_rows(spec, structure, layout, zf, basis, batch, arrays)
        if heavier is not batch:
            batch = heavier
            rises, H0, H, volume, spread_along = measured(batch)
    # along a marginal path the other parameters' spread changes too: the Laplace term makes
    # the profile the path parameter's marginal (where ∇²U_m is positive definite throughout)
    volume = np.where(np.all(np.isfinite(volume), axis=1, keepdims=True), volume, 0.0)
    rises = rises + np.concatenate([volume.ravel(), np.zeros(len(rises) - volume.size)])
    # in units of the rows' own quadratic ½t²σ²vᵀ∇²U_m v (the same rows: heavy-tailed rows
    # change the curvature estimate and the rises alike, and the ratio stays sharp)
    curvature = np.diag(H0)
    # no rows' quadratic to measure against: the mode is no mode along v (or the target's sd
    # along it overflows the potential); dividing would print rises of ±1e300
    unmeasured = ~(np.isfinite(curvature) & (curvature > 0))
    rises = rises.reshape(k, -1) / np.where(unmeasured, 1.0, curvature)[:, None]
    unmeasured |= ~np.all(np.isfinite(rises), axis=1)
    # a marginal path's steps move θ_j by more than its sd (v ∝ Σe_j is not an axis of Σ):
    # its profile is exp(-κ r(t)) with κ = σ²vᵀHv ≥ 1, the Gaussian's sd 1/√κ steps (on a
    # centred hierarchy's scale κ = 3.3: the profile read as exp(-r) put its marginal's mean
    # about right and its spread 1.8 times too wide); a widest direction's κ is about 1
    kappa = np.ones(k)
    kappa[: len(paths)] = np.where(unmeasured[: len(paths)], 1.0, curvature[: len(paths)])
    moments = [
        (0.0, math.inf) if bad else profile_moments(steps, r, kappa[i], marginal=i < len(paths))
        for i, (bad, r) in enumerate(zip(unmeasured, rises, strict=True))
    ]
    H = H.reshape(k, len(steps), k, k)
    conditional = _conditional_variances(H0, H)
    findings = []
    across = []  # per direction: the other direction whose move changes its variance most
    for i, (v, s, r) in enumerate(zip(directions, sd, rises, strict=True)):
        profile = moments[i][1] * math.sqrt(kappa[i])  # in the Gaussian's sds
        factor = profile**2
        changes = {}
        for j in range(k):
            if j != i and math.isfinite(factor) and math.isfinite(moments[j][1]):
                a, b = _quadratic_fit(steps, conditional[i, j])
                mean, spread = moments[j]
                changes[j] = max(1.0 + a * mean + b * (spread**2 + mean**2), 0.0)
                factor *= changes[j]
        moved = {j: abs(math.log(max(c, 1e-300))) for j, c in changes.items()}
        across.append(max(moved, key=moved.get, default=None))
        visited = [H[i, t] for t in range(len(steps)) if kappa[i] * r[t] <= VISITED_RISE]
        ratio, growth = float(np.sqrt(factor)), _growth(H0, visited)
        j, change = None, None
        if i < len(paths):
            j, change = paths[i], _variance_change(steps, spread_along[i], moments[i])
            if change is not None:  # the path's own marginal is the profile's (sd_ratio)
                change[j] = 1.0
        shift = moments[i][0] if math.isfinite(profile) else 0.0
        beyond = 0.0 if j is not None or unmeasured[i] else continuation_error(steps, r)
        findings.append(
            Nonlinearity(
                v, labels[i], float(s), steps, r, profile, ratio, growth, j, change, shift, beyond
            )
        )

    w = max(range(k), key=lambda j: _off(findings[j]))
    worst = findings[w]
    if _far(worst):
        profile = ", ".join(f"{r:.3g}" for r in worst.rises)
        unbounded = not math.isfinite(worst.sd_ratio)
        shape = (
            f"at -2, -1, +1, +2 sds from the mode it rises by {profile} where a Gaussian "
            "rises by 2, 0.5, 0.5, 2. "
            if not unmeasured[w]
            else f"the curvature of {_row_count(batch)} rows' potential along it is not "
            f"positive, or the potential is not finite 1 and 2 target sds ({worst.sd:.3g} in "
            "unconstrained units) from the mode. "
        )
        gaussian = 0.9 <= worst.profile_ratio <= 1.1 and worst.continuation_error <= 0.05
        funnel = gaussian and not unbounded and not 0.9 <= worst.sd_ratio <= 1.1
        if funnel and across[w] is not None:
            # a Gaussian profile: the ratio is the curvature changing across it (a funnel)
            shape += (
                "That profile is nearly a Gaussian's (its sd "
                f"{worst.profile_ratio:.2f}x the quadratic's), but the curvature along it "
                "changes as the posterior moves along the target's direction of "
                f"{labels[across[w]]} (a hierarchical mean's with its group scale, or a "
                "mixture component's location with its weight). "
            )
        marginal = worst.parameter is not None
        if marginal and unbounded and not unmeasured[w]:
            warn(
                f"The marginal posterior of {worst.label} (the log posterior along its marginal "
                "path, with the Laplace term for the other parameters' spread) has its mass "
                f"beyond the tuner's probes: {shape}Its mean lies more than {_REACH:g} steps "
                "from the joint mode the tuner linearises at, or it does not rise on one side. "
                "The joint mode of a centred hierarchy whose groups "
                "are each observed by few rows sits at a smaller group scale than the "
                "posterior's mass, and the Gaussian there does not describe the posterior: the "
                "predictions do not hold (report.prediction_error says 100% where this moves "
                "them), nor does the step tuned for them. With more rows per group the "
                "hierarchy is near-Gaussian; for groups this thinly observed, sample the model "
                "with NUTS, and check any run with check_run.",
                LinearizationWarning,
            )
            return findings
        warn(
            "The log posterior is far from its local quadratic along "
            + (
                f"the marginal path of {worst.label} (its marginal posterior, with the Laplace "
                "term for the other parameters' spread): "
                if marginal
                else f"the target's direction of {worst.label}: "
            )
            + shape
            + (
                ("The" if unmeasured[w] else "It does not rise on one side: the")
                + " posterior has no finite mode there "
                "(perfectly separable classes under a flat or heavy-tailed prior, a flat "
                "likelihood), or the warm start and Newton steps did not reach it; the "
                "predictions do not hold."
                if unbounded
                else f"The posterior's sd along it is about {worst.sd_ratio:.2f}x the "
                "quadratic's"
                + (
                    f", give or take {100 * worst.continuation_error:.0f}% for its shape beyond "
                    "the farthest probes"
                    if worst.continuation_error > 0.05
                    else ""
                )
                + ": the predictions, which linearise the model at the mode, are "
                "approximate there, and their stated error (report.prediction_error) counts "
                "this. A skewed hierarchical scale, a category of few rows, a constraint "
                "boundary, a heavy tail or a "
                "posterior with several modes (a mixture's components; the tuner sees the one "
                "its start led to) do this."
            ),
            LinearizationWarning,
        )
    return findings


PARALLEL = 0.95  # a marginal path this close to a probed direction (|cos|) adds nothing


def _rows_missed(information, basis, curvature) -> bool:
    """Whether the sample's data curvature along a column ``w`` of ``basis``, ``curvature``
    (``wᵀ∇²U_m w``, prior included) less ``n wᵀJ_prior w``, is more than ``e^0.4`` times off the
    information's ``n wᵀJw`` (four times the sampling noise of a direction that 100 rows
    carry; 24% was seen on 40 group intercepts of 1,250 rows each from 4,000 rows)."""
    along = partial(_along_columns, basis=basis, n=information.num_data)
    expected, prior = along(information.J), along(information.J_prior)
    data = curvature - prior
    ratio = np.maximum(data, 1e-300) / np.maximum(expected, 1e-300)
    return bool(np.any((expected > 0) & (np.abs(np.log(ratio)) > 0.4)))


def _along_columns(S, basis, n) -> np.ndarray:
    """``(k,)``: ``n wᵀSw`` for every column ``w`` of ``basis`` (``(d, k)``), in float64."""
    return n * np.sum(basis * scales.apply_rows(S, basis.T).T, axis=0)


def _with_heavy_rows(spec, structure, layout, zf, basis, batch, arrays) -> Batch:
    """``batch`` (uniform rows with replacement, each standing for ``n_p/m_p`` rows) with every
    row that carries at least :data:`~numpyro_sgmc.tuner.rows.HEAVY_ROW_SHARE` of the data's
    curvature along a column of ``basis`` added at weight 1, and its draws in the sample
    weighted 0: the rises stay unbiased, and a category of a few rows is in them whatever the
    sample. One pass of ``k`` Hessian-vector products per row (:func:`datum_curvatures`); the
    added rows are padded to a power of two (weight 0), so a few counts share a program."""
    wide, curvatures = np.asarray(basis, np.float32), {}
    for p in spec.plates:
        every = host.device_array(np.arange(p.size), np.int32)
        c = datum_curvatures(spec, structure, layout, p.name, zf, wide, every, arrays)
        curvatures[p.name] = np.maximum(np.asarray(c, np.float64), 0.0)
    total = np.maximum(sum(c.sum(axis=0) for c in curvatures.values()), 1e-300)
    heavy = {
        name: np.flatnonzero(np.max(c / total, axis=1) >= HEAVY_ROW_SHARE)
        for name, c in curvatures.items()
    }
    if not any(rows.size for rows in heavy.values()):
        return batch
    indices, weights = {}, {}
    for p in spec.plates:
        rows, sampled = heavy[p.name], np.asarray(batch.indices[p.name])
        pad = 2 ** max(3, math.ceil(math.log2(max(rows.size, 1)))) - rows.size
        if rows.size + pad + sampled.size >= p.size:  # no fewer than the plate's: every row
            indices[p.name] = host.device_array(np.arange(p.size), np.int32)
            weights[p.name] = host.device_array(np.ones(p.size), np.float32)
            continue
        drawn = np.where(np.isin(sampled, rows), 0.0, p.size / sampled.size)
        indices[p.name] = host.device_array(
            np.concatenate([rows, np.zeros(pad, np.int64), sampled]), np.int32
        )
        weights[p.name] = host.device_array(
            np.concatenate([np.ones(rows.size), np.zeros(pad), drawn]), np.float32
        )
    return Batch(indices, weights, 1.0)


def _every_row(plates) -> Batch:
    return Batch({p.name: host.device_array(np.arange(p.size), np.int32) for p in plates})


def _row_count(batch) -> int:
    return sum(int(np.size(i)) for i in batch.indices.values())


def _unit(v):
    return v / np.linalg.norm(v)


def _column(target, j: int) -> np.ndarray:
    """``Σe_j``, float64."""
    e = np.zeros(scales.size_of(target))
    e[j] = 1.0
    return np.asarray(target.apply(e), np.float64)


def _marginal_paths(target, data_free, count: int) -> list:
    """Up to ``count`` indices of the ``data_free`` parameters, those whose marginal variance
    most exceeds their conditional one first (``Σ_jj (Σ⁻¹)_jj``). None for a diagonal ``Σ``
    (above ``DENSE_MAX_DIM`` parameters): the paths' full Hessians would cost
    ``O(rows · d²)`` memory and ``O(d³)`` time each."""
    if data_free is None or not np.any(data_free) or not scales.is_dense(target):
        return []
    free = np.flatnonzero(data_free)
    matrix = np.asarray(target.matrix, np.float64)
    inflation = np.diag(matrix)[free] * np.diag(np.linalg.pinv(matrix))[free]
    free = free[np.argsort(-inflation, kind="stable")]
    return [int(j) for j in free[:count]]


def _growth(H0, curvatures) -> float:
    """``max λmax(H0⁻¹H)`` over ``curvatures`` (at least 1); 1 where ``H0`` is not positive
    definite (no quadratic to compare with: the findings say so)."""
    try:
        root = np.linalg.cholesky(H0)
    except np.linalg.LinAlgError:
        return 1.0
    growth = 1.0
    for H in curvatures:
        scaled = np.linalg.solve(root, np.linalg.solve(root, H).T)  # L⁻¹ H L⁻ᵀ
        if np.all(np.isfinite(scaled)):
            growth = max(growth, float(np.linalg.eigvalsh(0.5 * (scaled + scaled.T))[-1]))
    return growth


def _conditional_variances(H0, H):
    """``c[i, j, s] = [H(t_s v_j)⁻¹]_ii / [H(0)⁻¹]_ii`` from the probed curvatures."""
    base = np.diag(np.linalg.pinv(H0))
    k, num_steps = H.shape[0], H.shape[1]
    out = np.ones((k, k, num_steps))
    for j in range(k):
        for s in range(num_steps):
            out[:, j, s] = np.diag(np.linalg.pinv(H[j, s])) / np.maximum(base, 1e-300)
    return out


def _variance_change(steps, ratios, moments):
    """``(d,)``: ``1 + a E[t] + b E[t²]`` per parameter, ``1 + at + bt²`` the least-squares
    fit to its variance ratios ``(4, d)`` at ``steps`` and ``(E[t], sd[t])`` the profile's
    ``moments``; ``None`` if either is not finite."""
    mean, spread = moments
    if not (math.isfinite(spread) and np.all(np.isfinite(ratios))):
        return None
    design = np.stack([steps, steps**2], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, ratios - 1.0, rcond=None)
    return np.maximum(1.0 + a * mean + b * (spread**2 + mean**2), 0.0)


def _quadratic_fit(steps, values):
    """``(a, b)`` of the least-squares ``1 + at + bt²`` through ``(steps, values)``."""
    design = np.stack([steps, steps**2], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.asarray(values) - 1.0, rcond=None)
    return float(a), float(b)


def profile_moments(steps, rises, curvature=1.0, marginal=False) -> tuple:
    """``(mean, sd)`` in units of ``t`` of ``exp(-κ p(t))``, ``p`` the quartic through ``(0, 0)``
    and ``(steps, rises)`` on ``[-2, 2]``, continued beyond by its value, slope and
    (non-negative) curvature there; ``rises`` in units of the quadratic's ``½t²``, ``κ``
    (``curvature``) the quadratic's in nats: the Gaussian's sd is ``1/√κ``. ``sd = inf`` if
    that is not normalisable, or if a probe lies half a nat below the mode (the mode is
    elsewhere); on a ``marginal`` path, whose marginal need not peak at the joint mode, only if
    its mean lies more than ``_REACH`` (1.5) steps out (its mass beyond the probes). Where a
    side rises by more than ``_WALL`` one step out (a wall, which the quartic swings through
    far below zero), each side has its own curve (``_one_sided_profile``)."""
    if not marginal and np.min(rises) * curvature < -0.5:  # half a nat below: not a mode
        return 0.0, math.inf
    steps, rises = np.asarray(steps, np.float64), np.asarray(rises, np.float64)
    grid = np.linspace(-12.0, 12.0, 4801)
    if np.max(rises[np.abs(steps) == 1.0]) > _WALL:
        values = _one_sided_profile(steps, rises, grid)
        if values is None:
            return 0.0, math.inf
    else:
        t = np.concatenate([[0.0], steps])
        p = np.polynomial.Polynomial.fit(t, np.concatenate([[0.0], rises]), 4).convert()
        dp, d2p = p.deriv(), p.deriv(2)
        values = p(np.clip(grid, -2.0, 2.0))
        for edge, side in ((2.0, grid > 2.0), (-2.0, grid < -2.0)):
            x = np.abs(grid[side] - edge)
            slope, curve = dp(edge) * np.sign(edge), max(d2p(edge), 0.0)
            if slope <= 0 and curve == 0:
                return 0.0, math.inf
            values[side] = p(edge) + slope * x + 0.5 * curve * x**2
    mean, sd = _moments(grid, curvature * values)
    if marginal and abs(mean) > _REACH:
        return 0.0, math.inf
    return mean, sd


def _moments(grid, values) -> tuple:
    """``(mean, sd)`` of ``exp(-values)`` on ``grid``; ``(0, inf)`` where it falls far below
    the mode (no mode here)."""
    if np.min(values) < -20:
        return 0.0, math.inf
    w = np.exp(-(values - values.min()))
    w = w / w.sum()
    mean = float(w @ grid)
    return mean, float(np.sqrt(w @ (grid - mean) ** 2))


def continuation_error(steps, rises) -> float:
    """The relative error of a profile's sd (:func:`profile_moments`) from its shape beyond
    the probes at ``±2``: ``|sd' / sd - 1|`` with ``sd'`` the sd of the side-by-side
    quadratics through the probes (``_one_sided_profile``), 1 where those do not rise; 0
    where every rise is within 25% of a Gaussian's (``rises`` in units of ``½t²``).

    The quartic through four probes within two sds has one continuation, and a skew whose mass
    lies farther out is not in it: the coefficient of a one-hot level of 4 rows, all ``y =
    0``, had a profile sd of 1.004x the quadratic's from the quartic, 1.13x from the
    side-by-side quadratics, and 1.20x exactly (by quadrature)."""
    steps, rises = np.asarray(steps, np.float64), np.asarray(rises, np.float64)
    if np.max(np.abs(rises / (0.5 * steps**2) - 1.0)) <= _FAR:
        return 0.0
    _, sd = profile_moments(steps, rises)
    grid = np.linspace(-12.0, 12.0, 4801)
    values = _one_sided_profile(steps, rises, grid)
    if values is None or not math.isfinite(sd):
        return 1.0
    _, other = _moments(grid, values)
    return min(abs(other / sd - 1.0), 1.0) if math.isfinite(other) else 1.0


# a rise this far (relative) from a Gaussian's at a probe: the profile's shape beyond the
# probes is in question
_FAR = 0.25


# a marginal's mean further out than this many steps (of the probes' ±1, ±2) rests on the
# continuation past the last probe, not on the probes
_REACH = 1.5


# a rise one sd from the mode four times the quadratic's (2 nats): a wall on that side, as a
# prior-held coefficient of a class never seen with a covariate has (the probes' quartic
# through it swings far below zero between them)
_WALL = 2.0


def _one_sided_profile(steps, rises, grid):
    """``p`` on ``grid`` side by side, where one side is a wall: through ``(0, 0)``,
    ``(±1, r₁)`` and ``(±2, r₂)`` the quadratic ``au + bu²`` (``u = |t|``) where it does not
    fall on ``[0, 2]``, else the straight segments; beyond ``±2`` by its slope and curvature
    there. ``None`` where a side does not rise (no mode)."""
    values = np.empty_like(grid)
    for sign, side in ((1.0, grid >= 0), (-1.0, grid < 0)):
        r1, r2 = (float(rises[steps == sign * u][0]) for u in (1.0, 2.0))
        u = np.abs(grid[side])
        inner, outer = np.minimum(u, 2.0), np.maximum(u - 2.0, 0.0)
        b = (r2 - 2.0 * r1) / 2.0
        a = r1 - b
        # rising from 0 (a >= 0), or falling at 2 (no mode, below): the quadratic; a dip
        # then a steep rise, as through a wall, is drawn as the straight segments instead
        if a >= 0 or a + 4 * b <= 0:
            slope, curve = a + 4.0 * b, max(2.0 * b, 0.0)
            values[side] = a * inner + b * inner**2
        else:
            slope, curve = r2 - r1, 0.0
            values[side] = np.where(inner <= 1.0, r1 * inner, r1 + (r2 - r1) * (inner - 1.0))
        if slope <= 0 and curve == 0:
            return None
        values[side] += slope * outer + 0.5 * curve * outer**2
    return values


def linearity_error(findings, target) -> np.ndarray:
    """``(d,)`` the relative error of every predicted sd that the nonlinear directions
    imply: a direction ``v`` whose sd is ``ρ`` times the quadratic's changes parameter
    ``i``'s variance by ``(ρ² - 1) σ_v² v_i²``, relative to ``Σ_ii``; the marginal path of
    parameter ``j`` changes it by ``(ρ² - 1) Σ_ij²/Σ_jj`` (the share of ``θ_i``'s variance
    that ``θ_j`` carries), and moves it to where ``θ_j``'s marginal puts its mass, changing
    it by ``|c_i - 1|`` relative (:attr:`Nonlinearity.variance_change`: in a centred
    hierarchy the group intercepts' variances grow with the group scale). A widest
    direction's change counts twice its effect on the sd: those probes see the curvature's
    change along a few directions to second order, and the error they miss is of the same
    size; a marginal path's counts once, its Hessians covering every parameter (capped at
    1, i.e. 100%). A widest direction's variance change also counts ``2e`` for its profile's
    :attr:`Nonlinearity.continuation_error` ``e``."""
    variances = np.asarray(target.diagonal(), np.float64)
    error = np.zeros_like(variances)
    for f in findings:
        if f.parameter is None:
            ratio = abs(min(f.sd_ratio, 1e3) ** 2 - 1) + 2.0 * f.continuation_error
            change = ratio * f.sd**2 * f.direction**2
            error = error + change / np.maximum(variances, 1e-300)
            continue
        column = _column(target, f.parameter)
        ratio = abs(min(f.sd_ratio, 1e3) ** 2 - 1) + 2.0 * f.continuation_error
        change = ratio * column**2 / max(variances[f.parameter], 1e-300)
        if f.variance_change is not None:
            change = change + np.abs(f.variance_change - 1.0) * variances
        # the effect on the sd, once: a path's Hessians see every parameter
        error = error + 0.5 * change / np.maximum(variances, 1e-300)
        error[list(f.covers)] += 0.5 * ratio  # as thinly informed, not profiled: the same
    return np.minimum(error, 1.0)


def unplaced_means(findings, target) -> np.ndarray:
    """``(d,)`` bool: the parameters whose posterior mean the profiles cannot place. A
    marginal path whose profile is not normalisable within its probes (the marginal's mass
    beyond them: a centred hierarchy's scale over thinly observed groups) has no
    :attr:`Nonlinearity.mean_shift` (0 there): the path's parameter and those its steps move
    by a quarter of their sd or more (``σ|v_i| ≥ ¼ sqrt(Σ_ii)``) have their means somewhere
    along it, unknown how far."""
    sds = np.sqrt(np.asarray(target.diagonal(), np.float64))
    unplaced = np.zeros(sds.shape, bool)
    for f in findings:
        if f.parameter is not None and not np.isfinite(f.profile_ratio):
            unplaced |= f.sd * np.abs(np.asarray(f.direction, np.float64)) >= 0.25 * sds
    return unplaced


THIN_SHARE = 0.05
"""A parameter one of whose rows carries this share of the rows' gradient magnitudes or more
(:attr:`~numpyro_sgmc.tuner.fisher.Information.heaviest_share`: about 20 rows or fewer inform
it) has its marginal profiled by :func:`thin_profiles`."""

THIN_PATHS = 16
"""The most thinly informed parameters :func:`thin_profiles` profiles, thinnest first."""

THIN_STEPS = np.array([-8.0, -6.0, -4.0, -3.0, -2.0, -1.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0])
"""Where :func:`thin_profiles` probes, in target sds: a level of a few rows, all zero counts,
is held on one side by the prior alone, its mass reaching several sds out."""

THIN_WORK = 2**27
"""Row evaluations :func:`thin_profiles` may spend (each probe is a pass over every row)."""


def thinly_informed(information) -> np.ndarray:
    """Indices of the parameters that few rows inform, thinnest first: those whose heaviest
    row carries at least :data:`THIN_SHARE` of the rows' gradient magnitudes, where the
    information used every row (a sample's share says nothing of the rows it left out)."""
    share = information.heaviest_share
    if share is None or information.num_rows < information.num_data:
        return np.zeros(0, np.int64)
    thin = np.flatnonzero(share >= THIN_SHARE)
    return thin[np.argsort(-share[thin], kind="stable")]


def thin_profiles(problem, mode, target, information) -> list:
    """The marginal paths (``v ∝ Σe_j``, as in :func:`linearity`) of up to
    :data:`THIN_PATHS` parameters that few rows inform (:func:`thinly_informed`): a one-hot
    level of a category, a group's intercept. Their posterior is as far from Gaussian as a
    few rows' likelihood is, which the widest directions need not show: on a Poisson of 300
    levels, those of 1-4 rows had Laplace sds 0.81-0.99 of the exact ones, stated ±0.0%,
    before these profiles (``docs/theory.md`` §4).

    At :data:`THIN_STEPS` target sds along each path, the log posterior's exact rise over
    every row (float64; values only, so many probes cost less than the widest directions'
    four) gives the profile's mean and sd (:func:`profile_on_grid`), and its shape between
    the probes the sd's error. The few rows barely move the other parameters' curvature, so
    the profile is taken as the marginal (no Laplace term). Parameters beyond the cap are
    covered by the worst profile found (:attr:`Nonlinearity.covers`). None where the
    information used a sample of the rows, for file-backed data, or where a probe over
    every row would exceed :data:`THIN_WORK`.

    :return: a :class:`Nonlinearity` per profiled parameter (``informing_rows`` set).
    """
    prepared = problem.prepared
    layout, spec, n = prepared.layout, prepared.spec, prepared.num_data
    thin = thinly_informed(information)
    arrays, structure = split_args(problem.model_args, problem.model_kwargs)
    per_path = len(THIN_STEPS) + 4  # the probes and a Hessian-vector product
    count = min(len(thin), THIN_PATHS, THIN_WORK // (n * per_path))
    if count == 0 or any(file_backed(x) for x in arrays):
        return []
    paths, names = [int(j) for j in thin[:count]], layout.names()
    zf = np.asarray(layout.ravel(mode), np.float64)
    directions = np.stack([_unit(_column(target, j)) for j in paths])
    sd = _sds_along(target, directions)
    basis = (directions * sd[:, None]).T
    points = zf + (THIN_STEPS[None, :, None] * basis.T[:, None, :]).reshape(-1, zf.size)
    local, batch = rows_in_memory(arrays, spec.plates, _every_row(spec.plates))
    with jax.enable_x64(True):
        values, curvature = (
            np.asarray(x, np.float64)
            for x in _values_along(spec, structure, layout, zf, points, basis, batch, local)
        )
    kappa = np.where(np.isfinite(curvature) & (curvature > 0), curvature, np.nan)
    rises = (values[1:].reshape(count, -1) - values[0]) / kappa[:, None]
    findings = []
    for i, j in enumerate(paths):
        if np.all(np.isfinite(rises[i])):
            mean, spread, shape = profile_on_grid(THIN_STEPS, rises[i], kappa[i])
        else:  # no quadratic to measure against, or the potential overflows out there
            mean, spread, shape = 0.0, math.inf, 0.0
        ratio = spread * math.sqrt(kappa[i]) if math.isfinite(spread) else math.inf
        growth = _profile_growth(THIN_STEPS, rises[i], kappa[i])
        findings.append(
            Nonlinearity(
                directions[i], names[j], float(sd[i]), THIN_STEPS, rises[i], ratio, ratio,
                growth, j, mean_shift=mean, continuation_error=shape,
                informing_rows=1.0 / information.heaviest_share[j],
            )
        )  # fmt: skip
    worst = max(range(count), key=lambda i: _off(findings[i]))
    findings[worst] = findings[worst]._replace(covers=tuple(int(j) for j in thin[count:]))
    _warn_thin(findings, len(thin))
    return findings


def _profile_growth(steps, rises, kappa) -> float:
    """:attr:`Nonlinearity.curvature_growth` along one direction from its rises: the largest
    second difference (with the neighbouring probes, the mode included) at a probe a chain
    visits (a rise of at most :data:`VISITED_RISE`), in units of the quadratic's, at least 1.
    A level of one row and no events curves ``e^{σt}`` towards the data's side, ten-fold one
    sd out: the step is shortened there as for the widest directions."""
    t, r = _through_the_mode(steps, rises)
    growth = 1.0
    for i in range(1, len(t) - 1):
        if t[i] != 0 and kappa * r[i] <= VISITED_RISE:
            below, above = t[i] - t[i - 1], t[i + 1] - t[i]
            slopes = (r[i + 1] - r[i]) / above - (r[i] - r[i - 1]) / below
            growth = max(growth, 2.0 * slopes / (below + above))
    return float(growth)


def _through_the_mode(steps, rises) -> tuple:
    """``(t, r)``: the probes and ``(0, 0)``, in order of ``t``, float64."""
    t = np.concatenate([[0.0], np.asarray(steps, np.float64)])
    r = np.concatenate([[0.0], np.asarray(rises, np.float64)])
    order = np.argsort(t)
    return t[order], r[order]


def _sds_along(target, directions) -> np.ndarray:
    """``σ = sqrt(vᵀΣv)`` for every unit direction ``v``."""
    return np.sqrt(np.maximum([v @ np.asarray(target.apply(v)) for v in directions], 0.0))


def _off(f) -> float:
    """How far the sd along a finding may be from the quadratic's, in log."""
    return max(abs(math.log(max(f.sd_ratio, 1e-300))), math.log1p(f.continuation_error))


def _far(f) -> bool:
    """Whether the sd along a finding is, or may be, more than 10% from the quadratic's."""
    return _off(f) > math.log(1.1)


def far_from_gaussian(findings) -> Optional[Nonlinearity]:
    """The finding farthest from its quadratic where one is more than 10% from it (or may be,
    for its shape beyond the probes): what a
    :class:`~numpyro_sgmc.diagnostics.LinearizationWarning` says; ``None`` otherwise."""
    worst = max(findings, key=_off, default=None)
    return worst if worst is not None and _far(worst) else None


def _warn_thin(findings, thin: int):
    """One :class:`~numpyro_sgmc.diagnostics.LinearizationWarning` for the thinly informed
    parameters, naming the worst, where one is more than 10% from its quadratic."""
    worst = far_from_gaussian(findings)
    if worst is None:
        return
    off = sum(map(_far, findings))
    unprofiled = f" ({thin - len(findings)} more as thin, not profiled, are given its error)"
    if math.isfinite(worst.sd_ratio):
        give = worst.continuation_error > 0.05
        spread = (
            f"its sd is about {worst.sd_ratio:.2f}x the quadratic's"
            + f", give or take {100 * worst.continuation_error:.0f}%" * give
            + ". The predictions, which linearise the model at the mode, are approximate "
            "there, and their stated error (report.prediction_error) counts this; the run "
            "samples the posterior itself"
        )
    else:
        spread = (
            "its profile does not rise on one side, or its mass lies beyond the probes (8 sds "
            "out) there (a level whose rows are all of one class has no finite mode under a "
            "flat or heavy-tailed prior), and the predictions do not hold there "
            "(report.prediction_error says 100%)"
        )
    warn(
        f"{off} of the {len(findings)} parameters that few rows inform (a category's level of "
        "a few rows, a small group's intercept) have a marginal posterior far from Gaussian"
        f"{unprofiled * (thin > len(findings))}. The worst is {worst.label}, whose "
        f"heaviest row carries {100 / worst.informing_rows:.0f}% of its rows' gradient: "
        f"{spread}. Pooling thin levels, or a hierarchical prior on them, brings them nearer "
        "a Gaussian.",
        LinearizationWarning,
    )


def _evaluations(points, batch, **_) -> int:
    return (points.shape[0] + 1) * _row_count(batch)


@one_shot_jit(("spec", "structure", "layout"), rows=_evaluations)
def _values_along(spec, structure, layout, zf, points, basis, batch, arrays):
    """``U`` at ``zf`` and at every point (one pass over the batch's rows each), and
    ``wᵀ∇²U w`` at ``zf`` for every column ``w`` of ``basis``."""
    args, kwargs = structure.rebuild(arrays)
    U = lambda x: potential(spec, layout.unravel(x), batch, args, kwargs)  # noqa: E731
    values = lax.map(U, jnp.concatenate([zf[None], points]))
    curvature = lax.map(lambda w: w @ jax.jvp(jax.grad(U), (zf,), (w,))[1], basis.T)
    return values, curvature


def profile_on_grid(steps, rises, curvature=1.0) -> tuple:
    """``(mean, sd, shape)`` in units of ``t`` of ``exp(-κ p(t))``, ``p`` the quadratic ``½t²``
    plus the monotone cubic (PCHIP) through the rises' departures from it, through ``(0, 0)``
    and ``(steps, rises)`` (in units of the quadratic's ``½t²``: a Gaussian's is exact),
    continued beyond the outermost probes by the last interval's slope and (non-negative)
    change of slope; ``shape`` the relative change of the sd with straight segments between
    the probes instead, the error from the profile's unknown shape between them. ``sd = inf``
    where that is not normalisable or its mean lies beyond three quarters of the probes
    (its mass beyond them)."""
    t, r = _through_the_mode(steps, rises)
    reach = float(np.max(np.abs(t)))
    grid = np.linspace(-3 * reach, 3 * reach, 9601)
    inside = np.clip(grid, t[0], t[-1])
    moments = []
    residual = r - 0.5 * t**2  # interpolated as the rises' departure from a Gaussian's
    for between in (PchipInterpolator(t, residual), partial(np.interp, xp=t, fp=residual)):
        values = 0.5 * inside**2 + between(inside)
        for side, (a, b, c) in ((grid > t[-1], (-1, -2, -3)), (grid < t[0], (0, 1, 2))):
            slope = (r[a] - r[b]) / (t[a] - t[b])
            before = (r[b] - r[c]) / (t[b] - t[c])
            curve = max((slope - before) / abs(t[a] - t[c]) * 2.0 * np.sign(t[a] - t[b]), 0.0)
            x = np.abs(grid[side] - t[a])
            outward = slope * np.sign(t[a] - t[b])
            if outward <= 0 and curve == 0:
                return 0.0, math.inf, 0.0
            values[side] = r[a] + outward * x + 0.5 * curve * x**2
        mean, sd = _moments(grid, curvature * values)
        if not math.isfinite(sd) or abs(mean) > 0.75 * reach:
            return 0.0, math.inf, 0.0
        moments.append((mean, sd))
    (mean, sd), (_, linear) = moments
    return mean, sd, abs(linear / sd - 1.0)


def mean_shift(findings, d: int) -> np.ndarray:
    """``(d,)`` where the profiles put the posterior's mean from the mode, in unconstrained
    units: along each profiled direction ``v`` the shift ``E[t] σ v``
    (:attr:`Nonlinearity.mean_shift`), and per parameter the largest of them. On a marginal
    path that is the parameter's marginal mean, and every other parameter's mean given it
    (a centred hierarchy's group scale lies skewed above its joint mode, and the group
    intercepts spread with it); the directions overlap, so they are not added. Zeros for a
    near-Gaussian posterior."""
    shift = np.zeros(d)
    for f in findings:
        along = f.mean_shift * f.sd * np.asarray(f.direction, np.float64)
        shift = np.where(np.abs(along) > np.abs(shift), along, shift)
    return shift
