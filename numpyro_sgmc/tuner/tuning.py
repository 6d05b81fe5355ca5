"""The autotuner: from a named target to a ready kernel, a prediction and its cost.

``autotune(model, rng_key, *data, target=...)`` runs ``docs/theory.md`` §3–§4 on any NumPyro
model with a subsample plate; the model is traced once and passed down:

1. **start**: on at most :data:`~numpyro_sgmc.tuner.rows.WARM_START_SAMPLE_ROWS` rows with at
   most :data:`NEWTON_START_MAX_DIM` parameters and one restart, the model's start itself (its
   init strategy's, the prior mean by default, or ``init_params``;
   :func:`~numpyro_sgmc.tuner.warmstart.start_point_of`), from which the Newton steps of
   step 2 go to the mode; where they do not settle, and otherwise, the **warm start**
   (:func:`~numpyro_sgmc.tuner.warmstart.warm_start`): Adam to the mode ``θ̂``, in each
   parameter's natural scale, from the same start (by default
   :data:`WARM_START_EPOCHS`, then, on up to that many rows, :data:`LONGER_WARM_START_EPOCHS`
   more from where it stopped if the Newton steps from there stop short of a mode); above
   :data:`~numpyro_sgmc.tuner.rows.WARM_START_SAMPLE_ROWS` rows on a uniform sample of that
   many (with ``batch_sampling="blocks"``, rows in random order, in
   :data:`~numpyro_sgmc.tuner.rows.WARM_START_BLOCKS` runs of consecutive rows: from a file,
   a few reads), whose mode the Newton steps of step 2 carry to the data's;
2. **the local picture** (:func:`~numpyro_sgmc.tuner.laplace.fit`): ``J``, ``I``, ``S = J⁻¹IJ⁻¹`` at
   the mode polished by Newton steps, with rows added until the prediction's own error is
   under ``tolerance``, the control-variate noise, and a check that the quadratic holds;
3. **tuning**: the target is a mix ``Q = w₁S + w₂J⁻¹`` and every row of Table 1 that reaches
   it (:func:`~numpyro_sgmc.theory.rows_reaching`) is tuned (:func:`~numpyro_sgmc.theory.tune`)
   at the largest stable step, ``h·λmax(ΓJ) ≤ max_step``, and the batch size that row
   prefers; a row that cannot serve (a singular ``I`` for P5, a target it cannot reach) is
   dropped, and the cheapest in epochs per mixing time is kept;
4. **prediction**: the stationary covariance (unconstrained, and constrained by the delta
   method), the per-parameter autocorrelation times and the mixing time, in a
   :class:`~numpyro_sgmc.tuner.report.TuningReport`.

**Step-size bound.** ``h·λmax(ΓJ) ≤ max_step`` (default 1). Linear stability needs ``< 4``;
at ``hλ = 1`` every direction contracts by at least 1/2 per iteration without the
sign-alternating oscillation that sets in at ``hλ > 2``, which leaves a factor 4 for ``J``
varying over the posterior and for its estimate, and keeps the control-variate noise, which
grows as ``h²/b``, a small part of the injected noise.

**Batch size.** With control variates the mixing time in iterations does not depend on ``b``,
so those rows take the smallest batch (down to ``min_batch_size``) whose gradient noise is at
most half of what the target needs (at most ``1/(2g²)`` of it along a direction whose
curvature grows ``g``-fold where a chain goes: :func:`tail_noise_fraction`) and whose noise
estimate moves no sd of the run by more than ``tolerance`` (:func:`noise_estimate_error`), and
a larger one than the model's when even that is too noisy; rows F, B, G mix in ``1/w₁``
epochs whatever ``b`` and keep the model's batch, halved while the step bound needs it.

Cost is counted in gradient evaluations per datum (epochs): ``b`` per iteration, ``2b`` with
control variates.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.initialization import init_to_mean, init_to_value

from numpyro_sgmc import host, scales, theory
from numpyro_sgmc.data import validation
from numpyro_sgmc.data.files import MAX_DRAW_BYTES
from numpyro_sgmc.data.model import (
    Layout,
    check_data,
    constrained,
    data_version,
    prepare_model,
    split_args,
)
from numpyro_sgmc.kernels import SGD, SGLD, SGLDFP
from numpyro_sgmc.kernels.curvature import largest_eigenvalue
from numpyro_sgmc.kernels.shell import Tuned
from numpyro_sgmc.scales import Diagonal
from numpyro_sgmc.theory import InfeasibleTuning, rows_reaching, target_weights
from numpyro_sgmc.theory.linear import GradientNoise
from numpyro_sgmc.tuner.fisher import plate_noise
from numpyro_sgmc.tuner.laplace import (
    DENSE_MAX_DIM,
    NoModeReached,
    PolishNotSettled,
    Problem,
    far_from_gaussian,
    fit,
)
from numpyro_sgmc.tuner.options import AutotuneOptions
from numpyro_sgmc.tuner.report import TuningReport
from numpyro_sgmc.tuner.rows import (
    INFORMATION_ROWS,
    WARM_START_BLOCKS,
    WARM_START_RUNS_SHARE,
    WARM_START_SAMPLE_ROWS,
    Stream,
    halvings,
)
from numpyro_sgmc.tuner.warmstart import WarmStart, start_point_of, warm_start_of

__all__ = [
    "NEWTON_START_MAX_DIM",
    "LONGER_WARM_START_EPOCHS",
    "WARM_START_EPOCHS",
    "AutotuneOptions",
    "autotune",
    "noise_estimate_error",
]


WARM_START_EPOCHS = 5.0
"""Epochs of the warm start's Adam where ``warm_start_epochs`` is not given."""

LONGER_WARM_START_EPOCHS = 45.0
"""Epochs more of Adam, from where its first :data:`WARM_START_EPOCHS` stopped, where
``warm_start_epochs`` is not given, the data have at most
:data:`~numpyro_sgmc.tuner.rows.WARM_START_SAMPLE_ROWS` rows, and the fit from there finds no
mode because its Newton steps stopped short of one
(:class:`~numpyro_sgmc.tuner.laplace.NoModeReached`: not a saddle, not a profile measured far
from Gaussian, which more epochs do not change). A Weibull regression on raw covariates (an
age in years, an income in dollars; n = 5·10⁴) stopped 243 posterior sds from its mode after
5 epochs, 20 Newton steps did not reach it, and ``J + J_prior`` was not positive definite
where they stopped; after 50 epochs they settle."""

NEWTON_START_MAX_DIM = 1000
"""The most parameters for which :func:`autotune` tries Newton steps from the start itself
before an optimizer (``warm_start_epochs=None``)."""


class Choice(NamedTuple):
    """The target, the chosen row's candidate, every row considered, the setup cost, and the
    error the control-variate noise's estimate leaves in the run's sds
    (:func:`noise_estimate_error`)."""

    target: str
    weights: tuple
    best: object
    alternatives: list
    setup_epochs: float
    noise_error: np.ndarray


class Candidate(NamedTuple):
    """One row's tuning with its prediction and cost."""

    tuning: theory.Tuning
    batch_size: dict
    autocorrelation: np.ndarray
    mixing_iterations: float
    mixing_epochs: float
    cost: int


def autotune(
    model: Callable,
    rng_key,
    *model_args,
    target: str = "posterior",
    weight: Optional[float] = None,
    weights=None,
    warm: Optional[WarmStart] = None,
    batch_size=None,
    row: Optional[str] = None,
    warm_start_epochs: Optional[float] = None,
    learning_rate: float = 0.05,
    num_restarts: int = 1,
    num_rows: Optional[int] = INFORMATION_ROWS,
    dense: Optional[bool] = None,
    regularize=None,
    max_step: float = 1.0,
    min_batch_size: int = 32,
    num_steps: Optional[int] = None,
    batch_sampling: str = "with_replacement",
    tolerance: float = 0.02,
    init_strategy=init_to_mean,
    init_params: Optional[dict] = None,
    model_kwargs: Optional[dict] = None,
    **unknown,
):
    """Choose ``(row, h, b, β, Γ, Λ)`` for ``target`` and return ``(kernel, report)``.

    **Example** (a logistic regression on 20,000 simulated rows, then the run's check)::

        import jax
        import numpyro
        import numpyro.distributions as dist
        from numpyro.infer import MCMC
        from numpyro_sgmc import autotune, check_run

        def model(X, y=None):
            theta = numpyro.sample("theta", dist.Normal(0, 10).expand([3]).to_event(1))
            with numpyro.plate("data", X.shape[0], subsample_size=100):
                logits = numpyro.subsample(X, event_dim=1) @ theta
                yb = None if y is None else numpyro.subsample(y, event_dim=0)
                numpyro.sample("y", dist.Bernoulli(logits=logits), obs=yb)

        X = jax.random.normal(jax.random.key(0), (20_000, 3))
        y = 1.0 * jax.random.bernoulli(jax.random.key(1), jax.nn.sigmoid(X.sum(axis=1)))
        kernel, report = autotune(model, jax.random.key(2), X, y, target="posterior")
        mcmc = MCMC(kernel, num_warmup=20, num_samples=report.draws_for(ess=500))
        mcmc.run(jax.random.key(3), X, y)
        check_run(mcmc, report)

    The keywords after ``warm`` are the options, documented field by field in
    :class:`~numpyro_sgmc.tuner.options.AutotuneOptions`: ``batch_size`` and ``row``; the warm
    start's ``warm_start_epochs``, ``learning_rate``, ``num_restarts``, ``init_strategy`` and
    ``init_params``; the information's ``num_rows``, ``dense``, ``regularize`` and
    ``tolerance``; the kernel's ``max_step``, ``min_batch_size``, ``num_steps`` and
    ``batch_sampling``.

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param rng_key: PRNG key for the warm start and the information subsample.
    :param model_args: the data, as for ``MCMC.run``.
    :param target: ``"posterior"``, ``"bagged"``, ``"local_fiducial"`` (= ``"sandwich"``) or
        ``"mix"`` (:func:`~numpyro_sgmc.theory.target_weights`).
    :param weight: ``w`` of ``"bagged"`` / ``"local_fiducial"`` / tempered ``"posterior"``.
    :param weights: ``(w₁, w₂)`` of ``"mix"``.
    :param warm: a :class:`~numpyro_sgmc.tuner.warmstart.WarmStart` to reuse (its best restart).
    :param dict model_kwargs: the model's keyword arguments.
    :param unknown: none taken: a ``TypeError`` that names ``model_kwargs`` (``MCMC.run``
        passes its keyword arguments to the model; ``autotune`` has options of its own).
    :return: ``(kernel, report)``: a kernel for ``numpyro.infer.MCMC`` that starts at the mode,
        and a :class:`~numpyro_sgmc.tuner.report.TuningReport`.
    """
    validation.no_unknown_keywords("autotune", unknown)
    weights = target_weights(target, weight, weights)
    options = AutotuneOptions(
        batch_size, row, warm_start_epochs, learning_rate, num_restarts, num_rows, dense,
        regularize, max_step, min_batch_size, num_steps, batch_sampling, tolerance,
        init_strategy, init_params,
    ).check()  # fmt: skip
    model_args, model_kwargs = validation.as_arrays(model, model_args, model_kwargs)
    # the user's arrays identify the data for the run (Tuned.centre), and hold no device copy
    data = data_version(model_args, model_kwargs)
    model_args, model_kwargs = validation.on_device(model_args, model_kwargs)
    key_prepare, key_warm, key_info = host.split_key(rng_key, 3)
    # files are checked for non-finite rows by the warm start's pass over every row, not by a
    # pass of their own (numpyro_sgmc.data.passes); the check after it is then free
    prepared = None
    try:
        with validation.file_checks_deferred():
            prepared = prepare_model(
                host.key_batch(key_prepare, options.num_restarts),
                model,
                model_args,
                model_kwargs,
                batch_size=options.batch_size,
                init_strategy=options.init_strategy,
            )
            _check_rows_for(prepared.plates, weights)
            # the tuner's own start (not the user's WarmStart), at the default epochs, on rows
            # few enough that another 20 Newton passes over them cost little
            longer = warm is None and options.warm_start_epochs is None and _few_rows(prepared)
            from_start = warm is None and _newton_from_start(prepared, options)
            if from_start:
                warm = start_point_of(prepared, model_args, model_kwargs, options.init_params)
            elif warm is None:
                warm = _optimise_to_mode(prepared, key_warm, model_args, model_kwargs, options)
    except FloatingPointError:  # non-finite rows in the warm start's sample: say which
        if prepared is not None:
            start = host.take(prepared.init_params)
            check_data(prepared.spec, start, model_args, model_kwargs)
        raise
    check_data(prepared.spec, warm.member(0), model_args, model_kwargs)
    problem = Problem(
        prepared._replace(init_params=warm.member(0)), model_args, model_kwargs, options, key_info
    )
    local, abandoned = None, 0.0
    if from_start:
        try:
            local = fit(problem, warm, weights, must_settle=True)
        except PolishNotSettled as stop:  # Adam to the mode first; the attempt's epochs count
            abandoned = stop.epochs + warm.num_restarts
            warm = _optimise_to_mode(prepared, key_warm, model_args, model_kwargs, options)
            problem = problem._replace(prepared=prepared._replace(init_params=warm.member(0)))
    if local is None and longer:
        local, warm, problem, spent = _fit_or_optimise_longer(
            problem, warm, weights, key_warm, model_args, model_kwargs, options
        )
        abandoned += spent
    if local is None:
        local = fit(problem, warm, weights)
    candidates, alternatives = _candidates(problem, local, weights)
    best = min(candidates, key=lambda c: c.mixing_epochs)
    noise_error = noise_estimate_error(best.tuning, _noise_relative_error(local))
    n = problem.prepared.num_data
    # the optimizer's epochs (none from the start), then a pass for the exact gradient at
    # each restart's mode (or the start)
    setup = abandoned + warm.num_epochs + warm.num_restarts + local.passes
    setup += local.rows_visited / n
    # the centre's full-data gradient, unless the run can take the tuner's (Tuned.centre)
    setup += 1.0 if best.tuning.control_variates and data is None else 0.0
    choice = Choice(target, weights, best, alternatives, setup, noise_error)
    return _build(problem, local, warm, choice, data)


def _fit_or_optimise_longer(problem, warm, weights, rng_key, model_args, model_kwargs, options):
    """``(local, warm, problem, epochs)``: the fit from Adam's default epochs, or, where it
    finds no mode because the Newton steps stopped short of one (:class:`NoModeReached`: not a
    saddle, not a profile measured far from Gaussian), ``local = None`` and the warm start of
    :data:`LONGER_WARM_START_EPOCHS` more from where Adam stopped, for the fit to start from
    (``epochs``: the first Adam's, now spent). The first attempt's warnings are said, under the
    caller's filters, only where it stands. Where the longer run's loss turns non-finite, the
    fit starts where it was."""
    local = None
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            local = fit(problem, warm, weights)
    except NoModeReached:
        said.clear()  # the attempt's warnings go with it
    finally:
        for w in said:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if local is not None:
        return local, warm, problem, 0.0
    prepared = problem.prepared
    stopped = prepared._replace(init_params=warm.params)
    try:
        longer = _optimise_to_mode(
            stopped, rng_key, model_args, model_kwargs, options, LONGER_WARM_START_EPOCHS
        )
    except FloatingPointError:
        return None, warm, problem, 0.0
    problem = problem._replace(prepared=prepared._replace(init_params=longer.member(0)))
    return None, longer, problem, warm.num_epochs + warm.num_restarts


def _newton_from_start(prepared, options) -> bool:
    """Whether to try Newton steps from the model's start instead of Adam first: the default
    ``warm_start_epochs=None``, one restart, at most :data:`NEWTON_START_MAX_DIM` parameters
    and at most :data:`~numpyro_sgmc.tuner.rows.WARM_START_SAMPLE_ROWS` rows (on more, Adam
    runs on a sample of them, and every Newton step is a pass over all of them).

    From the start of a near-Gaussian posterior the damped steps reach the mode in a few
    passes (a logistic regression at ``n = 10⁵``: 7.6 epochs of setup in all; the models of
    ``benchmarks/user_models.py``: 8-30), and a first call then compiles no optimizer loop
    (its largest program: 0.7 s of a 2.4 s compilation at ``n = 10⁵``;
    ``benchmarks/README.md``). Where they do not settle in 20 steps, Adam runs and the steps
    start again from its mode."""
    if options.warm_start_epochs is not None or options.num_restarts != 1:
        return False
    return prepared.layout.size <= NEWTON_START_MAX_DIM and _few_rows(prepared)


def _few_rows(prepared) -> bool:
    """At most :data:`~numpyro_sgmc.tuner.rows.WARM_START_SAMPLE_ROWS` rows: Adam runs on
    all of them, and a Newton step's pass over them costs about an epoch of Adam."""
    return sum(p.size for p in prepared.plates) <= WARM_START_SAMPLE_ROWS


def _optimise_to_mode(
    prepared, rng_key, model_args, model_kwargs, options, more_epochs=None
) -> WarmStart:
    """The warm start's Adam (:func:`~numpyro_sgmc.tuner.warmstart.warm_start_of`) with the
    options' epochs, learning rate, restarts and start, on a row sample above
    :data:`~numpyro_sgmc.tuner.rows.WARM_START_SAMPLE_ROWS` rows; with ``more_epochs``, that
    many from ``prepared``'s ``init_params`` (where an earlier run stopped). No convergence
    check: the Newton steps of the fit measure the same distance with the ``J`` estimated
    there anyway."""
    blocks = WARM_START_BLOCKS if options.batch_sampling == "blocks" else None
    epochs = WARM_START_EPOCHS if options.warm_start_epochs is None else options.warm_start_epochs
    start = options.init_params if more_epochs is None else None
    return warm_start_of(
        prepared, rng_key, model_args, model_kwargs, more_epochs or epochs, options.num_restarts,
        options.learning_rate, init_params=start, check=False, rescale=True,
        max_rows=_warm_sample_rows(prepared.plates, model_args, model_kwargs, blocks),
        sample_blocks=blocks,
    )  # fmt: skip


def _warm_sample_rows(plates, model_args, model_kwargs, blocks) -> int:
    """Rows of the warm start's sample: :data:`~numpyro_sgmc.tuner.rows.WARM_START_SAMPLE_ROWS`;
    in runs of rows (``blocks``: a few reads from a file, however many rows) a
    :data:`~numpyro_sgmc.tuner.rows.WARM_START_RUNS_SHARE` of them, up to
    ``MAX_DRAW_BYTES`` of rows. A sample's mode lies about ``sqrt(n/m)`` times a constant
    posterior sds from the data's, and each Newton pass shrinks that by the error of ``J``
    (about 3% from 10⁴ rows at ``d = 10``): from ``n/32`` rows two passes reach the mode to
    0.05 sds, where from 2²⁰ rows at ``n = 10⁸`` a third pass was needed."""
    if blocks is None:
        return WARM_START_SAMPLE_ROWS
    sizes = {p.size for p in plates}
    arrays, _ = split_args(model_args, model_kwargs)
    row_bytes = sum(
        math.prod(np.shape(a)[1:]) * np.dtype(a.dtype).itemsize
        for a in arrays
        if np.ndim(a) and np.shape(a)[0] in sizes
    )
    share = int(sum(sizes) * WARM_START_RUNS_SHARE)
    return max(WARM_START_SAMPLE_ROWS, min(share, MAX_DRAW_BYTES // max(row_bytes, 1)))


def noise_estimate_error(tuning, relative: np.ndarray) -> np.ndarray:
    """``(d,)``: the relative error of the run's sds that the control-variate noise's estimate
    leaves, given the estimate's relative standard error on each parameter's diagonal
    (``relative``: the rows' sampling, and for random probes their spread;
    :func:`~numpyro_sgmc.tuner.fisher.control_variate_noise`).

    The injected noise is what the target needs less the gradient noise's estimate
    (``docs/theory.md`` §3), so a relative error ``ε_j`` in the estimate moves the
    stationary variance of parameter ``j`` by ``φ_j ε_j``, with ``φ_j`` the share of the need
    that the gradient noise supplies, ``1 - (h/β) Λ_jj / (Σ_t - FΣ_tFᵀ)_jj``: ``½ φ_j ε_j`` on
    an sd. With 300 group intercepts each seen by about one row of a batch of 400, 64 random
    probes left ``ε ≈ 18%`` at ``φ ≈ 0.4``, and the run's sds were 3.5% from the prediction
    parameter by parameter (up to 12%)."""
    if not tuning.control_variates or math.isinf(tuning.inverse_temperature):
        return np.zeros(len(relative))
    needed, injected = _noise_need(tuning)
    share = np.clip(1.0 - np.asarray(injected.diagonal()) / np.asarray(needed.diagonal()), 0, 1)
    return 0.5 * share * relative


def _noise_need(tuning) -> tuple:
    """``(Σ_t - FΣ_tFᵀ, (h/β)Λ)``: the noise per step the target needs, and what is injected
    (the rest is the gradient noise's estimate), as scales."""
    target, drift = tuning.target, tuning.drift
    needed = scales.symmetrized(target - drift @ target @ drift.T)
    return needed, tuning.noise_preconditioner * (tuning.step_size / tuning.inverse_temperature)


def tail_noise_fraction(tuning, direction) -> float:
    """The share of the noise the target needs along ``direction`` ``v`` that the
    control-variate gradient noise supplies: ``1 - (h/β)vᵀΛv / vᵀ(Σ_t - FΣ_tFᵀ)v`` (0 without
    control variates).

    The control-variate noise grows with the distance from the mode (the per-datum gradients'
    differences from there), so the chain ``δ' = Fδ + ξ(δ)`` has multiplicative noise, whose
    stationary law has power-law tails (Kesten): at ``F = ½`` and a share ``φ`` of the need,
    ``E|F + √(¾φ) z|^α = 1`` puts the tail exponent ``α`` near 4 at ``φ = ½``, near 8 at
    ``φ = 0.2``. Where the curvature grows away from the mode, a rare excursion down such a
    tail reaches where the step is past its stability bound and the chain is thrown out: a
    Student-t regression with its degrees of freedom learned, on Gaussian data (``log ν``'s
    curvature 1.8 times the mode's 2 sds below), ran off to ``ν → 0`` in 5 of 8 chains at
    ``φ = 0.47``, 1 of 4 at ``φ = 0.23``, none at ``φ = 0.12``."""
    if not tuning.control_variates or math.isinf(tuning.inverse_temperature):
        return 0.0
    v = np.asarray(direction, np.float64)
    needed, injected = (float(v @ np.asarray(m.apply(v))) for m in _noise_need(tuning))
    return max(0.0, 1.0 - injected / needed) if needed > 0 else 0.0


def _noise_relative_error(fit) -> np.ndarray:
    """The control-variate noise estimate's relative error per parameter, the largest over
    the plates (:func:`noise_estimate_error`)."""
    d = fit.prediction_error.shape[0]
    errors = list((fit.cv_noise_error or {}).values())
    return np.max(np.stack(errors), axis=0) if errors else np.zeros(d)


def _check_rows_for(plates, weights):
    """A target with a sandwich part (``w₁ > 0``) needs ``I``, the covariance of the per-datum
    gradients, which a plate of one row cannot estimate."""
    short = [p for p in plates if p.size < 2]
    if weights[0] > 0 and short:
        p = short[0]
        raise ValueError(
            f"This target has a sandwich part (w1 = {weights[0]:g} of S = J⁻¹IJ⁻¹), which needs "
            "I, the covariance of the per-datum gradients, and plate "
            f"'{p.name}' has {p.size} row: a covariance needs at least two rows. Use "
            "target='posterior' (J⁻¹ needs no I), or more data."
        )


def _lam_max(problem, fit) -> Callable:
    """``gamma -> λmax(ΓJ)``: exact for a dense ``J``, by power iteration for a diagonal one
    (:func:`~numpyro_sgmc.kernels.curvature.largest_eigenvalue`, on its own stream)."""
    J = fit.information.potential_curvature
    if scales.is_dense(J):
        return lambda gamma: scales.relative_size(J, gamma.inverse())  # λmax(ΓJ)
    prepared = problem.prepared
    rows = problem.options.num_rows or prepared.num_data
    dtype = prepared.layout.ravel(fit.mode).dtype
    return lambda gamma: largest_eigenvalue(
        prepared.spec, prepared.layout, fit.mode, Diagonal(jnp.asarray(gamma.values, dtype)),
        problem.rng_key, problem.model_args, problem.model_kwargs, rows,
        rng=Stream.POWER_ITERATION.rng(problem.rng_key),
    )  # fmt: skip


def _candidates(problem, fit, weights):
    """Every row that reaches the target, tuned; rows that cannot serve are reported, not
    fatal."""
    names = rows_reaching(weights)
    row = problem.options.row
    if row is not None:
        if row not in names:
            raise ValueError(
                f"Row {row!r} of Table 1 does not reach this target (w1={weights[0]:g}, "
                f"w2={weights[1]:g}); the rows that do: {names}."
            )
        names = [row]
    lam_max = _lam_max(problem, fit)
    out, alternatives = [], []
    for name in names:
        try:
            candidate = _tune_row(theory.ROWS[name], problem, fit, weights, lam_max)
        except InfeasibleTuning as err:
            alternatives.append((name, f"not usable: {err}"))
            continue
        out.append(candidate)
        alternatives.append((name, candidate.mixing_epochs))
    if not out:
        raise ValueError(
            "No row of Table 1 can reach this target here:\n"
            + "\n".join(f"  {name}: {why}" for name, why in alternatives)
        )
    return out, alternatives


def _tune_row(row, problem, fit, weights, lam_max) -> Candidate:
    """One row's tuning at the batch it prefers, its prediction and cost (module docstring):
    a free step (:attr:`~numpyro_sgmc.theory.Row.step`) at the stability bound, with the
    smallest quiet batch; a fixed one (:func:`~numpyro_sgmc.theory.step_rule`) at the model's
    batch, halved while the bound needs it."""
    info, options = fit.information, problem.options
    J, I, n = info.potential_curvature, info.I, problem.prepared.num_data
    plates = problem.prepared.plates
    batch = {p.name: p.batch_size for p in plates}
    gamma = theory.preconditioner(row, J, I, info.data_free)
    # where the curvature grows more than twofold over what a chain visits (a wall of data on
    # one side of a thinly observed coefficient), a step at the bound at the mode is past it
    # there: the chain is thrown across the posterior (docs/theory.md §3)
    growth = max((f.curvature_growth for f in fit.nonlinearity), default=1.0)
    top = lam_max(gamma) * max(1.0, growth / 2.0)

    def attempt(batch, step_size=None):
        noise = plate_noise(plates, fit.cv_noise, batch)
        if not row.control_variates:
            noise = plate_noise(plates, info.plate_covariances, batch) + noise
        return theory.tune(
            row.name, J, I, batch_size=sum(batch.values()), num_data=n, weights=weights,
            noise=GradientNoise(noise, None, 1.0), step_size=step_size, data_free=info.data_free,
        )  # fmt: skip

    if row.step == "free":
        h = options.max_step / top
        tuning, batch = _smallest_quiet_batch(
            lambda b: attempt(b, h),
            batch,
            options.min_batch_size,
            plates,
            options.tolerance,
            _noise_relative_error(fit),
            fit.nonlinearity,
        )
    else:
        for candidate in halvings(batch, 1):
            h = theory.step_rule(row, sum(candidate.values()), n, weights)
            if h * top <= options.max_step:
                batch = candidate
                break
        else:
            raise InfeasibleTuning(
                f"its step h = {h:.3g} at the smallest batch is past the bound h·λmax(ΓJ) <= "
                f"max_step = {options.max_step:g}."
            )
        if not row.stochastic and all(batch[p.name] >= p.size for p in plates):
            raise InfeasibleTuning(
                f"a batch of every row (b = n = {n}) gives the exact gradient, so SGD has no "
                "noise to sample with; a row with injected noise can."
            )
        far = far_from_gaussian(fit.nonlinearity)
        if not row.stochastic and weights[1] > 0 and far is not None:
            # SGD's law is the posterior only through the Gaussian picture: on one rate from
            # 1 event in 30 rows its runs were 0.70-0.78 of the exact sd, and P4's right
            raise InfeasibleTuning(
                "its only noise is the gradient's, whose law is the posterior's only where "
                f"that is near Gaussian, and it is not along {far.label} (the "
                "LinearizationWarning); a row with injected noise samples the posterior itself."
            )
        tuning = attempt(batch)
        _check_reaches(tuning, row.name, fit.correlations)
    cov, F = tuning.covariance, tuning.drift
    tau = theory.autocorrelation_times(F, cov)
    worst = theory.worst_autocorrelation_time(F, cov).time
    cost = 2 * sum(batch.values()) if tuning.control_variates else sum(batch.values())
    return Candidate(tuning, batch, tau, worst, worst * cost / n, cost)


def _smallest_quiet_batch(attempt, batch, smallest, plates, tolerance, relative, nonlinearity):
    """The smallest batch (halving from the model's, down to ``smallest`` per plate) whose
    control-variate noise is at most half the noise the target needs (and along a probed
    direction whose curvature grows ``g``-fold where a chain goes, at most ``1/(2g²)`` of it:
    :func:`tail_noise_fraction`), and whose estimate (of ``relative`` error) moves no sd of
    the run by more than ``tolerance`` (:func:`noise_estimate_error`); else the model's batch
    doubled until it is, up to the data, where the gradient is exact (no noise):
    ``(tuning, batch)``."""
    growing = [f for f in nonlinearity if f.curvature_growth > 1.0]

    def quiet(tuning):
        moved = noise_estimate_error(tuning, relative).max()
        if tuning.noise_fraction > 0.5 or moved > tolerance:
            return False
        return all(
            tail_noise_fraction(tuning, f.direction) <= 0.5 / f.curvature_growth**2 for f in growing
        )

    best = None
    for candidate in halvings(batch, smallest):
        try:
            tuning = attempt(candidate)
        except InfeasibleTuning:
            break
        if not quiet(tuning):
            break
        best = (tuning, candidate)
    sizes = {p.name: p.size for p in plates}
    while best is None:
        batch = {k: min(2 * b, sizes[k]) for k, b in batch.items()}
        if batch == sizes:  # full-data gradients: quiet whatever the target
            return attempt(batch), batch
        try:
            tuning = attempt(batch)
        except InfeasibleTuning:
            continue
        if quiet(tuning):
            best = (tuning, batch)
    return best


def _check_reaches(tuning, name, linked=None, tolerance=0.05):
    """A natural-noise row's prediction must be its target (to ``tolerance``): one whose noise
    cannot be shaped (SGD) misses a target with a part the gradient noise does not supply.

    On a diagonal ``J`` (``linked``, its :class:`~numpyro_sgmc.tuner.laplace.Correlations`)
    the target has the correlations put back (its variances times the inflation), and SGD's
    law has not: its noise, shaped like ``I``, preconditioned by a diagonal ``Γ`` gives
    ``Σ ∝ Γ`` where ``I = J`` (``ΓJΣ + ΣJΓ = hΓIΓ/b``), each variance short of the posterior's
    by the correlations' share. On equicorrelated covariates (``ρ = 0.5``, ``d = 300``) the
    run's sds were 0.71 of the posterior's."""
    cov, target = np.asarray(tuning.covariance.diagonal()), np.asarray(tuning.target.diagonal())
    if linked is not None:
        target = target * linked.inflation
    off = float(np.max(np.abs(np.sqrt(cov / target) - 1)))
    if off > tolerance:
        raise InfeasibleTuning(
            f"row {name}'s law misses the target's sd by {100 * off:.0f}% in some direction "
            f"(more than {100 * tolerance:.0f}%): its gradient noise is not shaped like the "
            "target there (parameters with no per-datum gradient get none, the per-datum "
            "Hessians add their own, and with a diagonal preconditioner it leaves out the "
            "correlations)."
        )


_REPORTED = (
    "row",
    "step_size",
    "inverse_temperature",
    "preconditioner",
    "noise_preconditioner",
    "control_variates",
)
"""The :class:`~numpyro_sgmc.theory.Tuning` fields the report carries as they are."""


def _build(problem, fit, warm, choice, data):
    """The kernel of the chosen tuning, started at the mode, and its report; ``data``: the
    :func:`~numpyro_sgmc.data.model.data_version` of the data (``Tuned``)."""
    tuning, best, options = choice.best.tuning, choice.best, problem.options
    prepared, args, kwargs = problem.prepared, problem.model_args, problem.model_kwargs
    covariance, target = tuning.covariance, tuning.target
    autocorrelation, mixing = best.autocorrelation, best.mixing_iterations
    linked = fit.correlations
    if linked is not None:  # a diagonal J: the correlations it leaves out, put back
        # into the target, and into the law of a row with injected noise (Langevin's law is
        # the posterior whatever Γ); SGD's law keeps Γ's shape (_check_reaches)
        if not math.isinf(tuning.inverse_temperature):
            covariance = Diagonal(np.asarray(covariance.values) * linked.inflation)
        target = Diagonal(np.asarray(target.values) * linked.inflation)
        drift = Diagonal(1.0 - 0.5 * tuning.step_size / linked.concentration)
        autocorrelation = theory.autocorrelation_times(drift, covariance)
        mixing = float(np.max(autocorrelation))
    num_steps = options.num_steps
    if num_steps is None:
        num_steps = max(1, int(round(mixing / 4)))
    latent = prepared.latent_sites
    # as a batch of one: the warm start's program for its (default) single restart; device
    # arrays: a model may index a latent site with traced data (``alpha[group]``)
    one = jax.tree.map(lambda v: np.asarray(v)[None], fit.mode)
    dense = scales.is_dense(covariance)
    jacobian = prepared.layout if dense or prepared.layout.size <= DENSE_MAX_DIM else None
    constrained_mode, jac = constrained(
        prepared.spec, one, args, kwargs, prepared.per_datum_sites, True, jacobian
    )
    constrained_mode = host.take(constrained_mode)
    batch_size = best.batch_size
    common = dict(
        batch_size=batch_size if len(batch_size) > 1 else next(iter(batch_size.values())),
        preconditioner=tuning.preconditioner,
        num_steps=num_steps,
        batch_sampling=options.batch_sampling,
        init_strategy=init_to_value(values={k: constrained_mode[k] for k in latent}),
    )  # the chains start from draws of the predicted law (Tuned.draws)
    if math.isinf(tuning.inverse_temperature):
        cls, noise = SGD, {}
    else:
        cls = SGLDFP if tuning.control_variates else SGLD
        noise = dict(
            inverse_temperature=tuning.inverse_temperature,
            noise_preconditioner=tuning.noise_preconditioner,
        )
    kernel = cls(prepared.spec.model, tuning.step_size, **noise, **common)
    mode = prepared.layout.ravel(fit.mode)
    tuned = Tuned(prepared.plates, prepared.layout, mode, covariance, fit.exact, data)
    kernel = kernel.with_tuning(tuned)
    report = TuningReport(
        **{field: getattr(tuning, field) for field in _REPORTED},
        algorithm=type(kernel).__name__,
        target=choice.target,
        weights=choice.weights,
        batch_size=batch_size,
        num_steps=num_steps,
        target_covariance=target,
        covariance=covariance,
        constrained_covariance=_delta_method(jac, covariance) if dense else None,
        autocorrelation_iterations=autocorrelation,
        mixing_iterations=mixing,
        mixing_epochs=mixing * best.cost / prepared.num_data,
        gradient_evaluations_per_iteration=best.cost,
        setup_epochs=choice.setup_epochs,
        newton_step=fit.newton_step,
        prediction_error=np.hypot(fit.prediction_error, choice.noise_error),
        nonlinearity=fit.nonlinearity,
        num_data=prepared.num_data,
        mode=fit.mode,
        constrained_mode=constrained_mode,
        information=fit.information,
        warm_start=warm,
        layout=prepared.layout,
        constrained_layout=list(Layout.of({k: constrained_mode[k] for k in latent}).sites),
        transforms=prepared.transforms,
        alternatives=choice.alternatives,
        correlations=linked,
        mode_distance=fit.unreached,
        mode_distance_diagonal=fit.unreached_diagonal,
    )
    return kernel, report


def _delta_method(jacobian, covariance) -> np.ndarray:
    """The covariance of the constrained latent sites, ``Jac Σ Jacᵀ``, from the Jacobian at the
    mode (a batch of one, ``data.model.constrained``) and a dense ``Σ``."""
    jac = np.asarray(jacobian, np.float64)[0]
    return jac @ np.asarray(covariance.matrix) @ jac.T
