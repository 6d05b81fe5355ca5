"""Check a run against its prediction and against evidence the prediction did not use.

:func:`check_run` takes the ``MCMC`` object after ``run`` (or a
:class:`~numpyro_sgmc.running.runner.KernelRun`) and the
:class:`~numpyro_sgmc.tuner.report.TuningReport`,
maps the draws back to the unconstrained space the prediction lives in, and compares three
estimates of every parameter's standard deviation, each with its own error:

* the **run**'s, whose Monte Carlo standard error is ``sd·sqrt(τ̂/(2N))`` (``τ̂`` the
  integrated autocorrelation time from NumPyro's effective sample size, ``N`` the draws);
* the **prediction**'s, whose error the tuner estimated from the rows it used
  (``report.prediction_error``, ``docs/theory.md`` §4, "The local picture and its error");
* an **independent** one: ``J`` and ``I`` recomputed from fresh rows at the run's own mean,
  turned into the target the same way, with its own jackknife error. A prediction built from
  unrepresentative rows (heavy-tailed gradients) or at a point the run does not visit (a mode
  not reached, data of another size) disagrees with it, even when the run matches the
  prediction.

Two of them disagreeing by more than their errors allow (and a 1% floor for the
linearisation, whose error is ``O(n^{-1/2})``) is a finding; so is a split R-hat above 1.05, a
run whose mean is more than a posterior sd from where the tuning expects it (the mode it
linearised at, moved by the skew its profiles measure: ``docs/theory.md`` §4, "The posterior's
mean"), and rejected (divergent) steps. Findings are printed with their causes and raised as a
:class:`~numpyro_sgmc.diagnostics.RunCheckWarning`; ``RunCheck.passed`` is ``False``. The
integrated autocorrelation times are compared with the prediction's too (per draw and in
epochs), as information: they decide the cost, not the answer.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import numpy as np
from jax import random
from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
from scipy import stats

from numpyro_sgmc.data import validation
from numpyro_sgmc.diagnostics import RunCheckWarning, warn
from numpyro_sgmc.scales import is_dense
from numpyro_sgmc.theory import target_covariance
from numpyro_sgmc.tuner.fisher import debiased, information_of
from numpyro_sgmc.tuner.laplace import (
    UNREACHED_SDS,
    Problem,
    correlations,
    linearity_error,
    mean_shift,
    prediction_error,
    unplaced_means,
    with_correlations,
)

__all__ = ["RunCheck", "check_run", "unconstrained_draws"]

# relative error allowed on top of the estimates' own: the linearised predictions hold to
# O(n^{-1/2}), and a chain's law differs from its linearisation by as much
_FLOOR = 0.01
_R_HAT = 1.05
_MEAN_OFFSET = 1.0  # posterior sds between the run's mean and where the tuning expects it
# the share of the profiles' expected mean shift allowed as its error: a skew read from four
# probes per direction (a group scale's marginal mean: 1.455 sds predicted, the run 1.454)
_SHIFT_ERROR = 0.25
_FRESH_KEY = 0x5EED  # rows for the independent estimate, unrelated to the tuner's
_SHOWN = 20  # parameters listed in the table when there are more
# a reference sd known only to worse than this cannot be the basis of a pass: the check says so
_CHECKABLE = 0.2


class RunCheck(NamedTuple):
    """The run against the prediction and the independent estimate, per unconstrained
    parameter (order: ``names``); relative errors are one standard error.

    :param names: ``site[index]`` label of each parameter.
    :param covariance: the run's covariance, ``(d, d)``; ``(d,)`` variances for a diagonal
        report.
    :param predicted_covariance: the report's, in the same form.
    :param float covariance_error: ``‖Ĉ - Σ‖_F / ‖Σ‖_F`` (of the variances for a diagonal
        report).
    :param sd_ratio: ``(d,)`` run sd / predicted sd.
    :param run_error: ``(d,)`` relative Monte Carlo standard error of the run's sds.
    :param prediction_error: ``(d,)`` relative standard error of the predicted sds.
    :param sd_independent: ``(d,)`` the sds the run should have by the independent estimate
        (``None`` when it was not made).
    :param independent_error: ``(d,)`` its relative standard error.
    :param mean_offset: ``(d,)`` (run mean - tuning mode) / run sd.
    :param expected_offset: ``(d,)`` the same for the posterior's mean as the tuner's
        profiles place it (:func:`~numpyro_sgmc.tuner.laplace.mean_shift`; a skewed
        posterior's mean is not at its mode); zeros where the posterior is near-Gaussian,
        and where the profiles cannot place it (a marginal whose mass lies beyond the probes:
        those means are in ``unchecked``, not compared).
    :param r_hat: ``(d,)`` split R-hat over the chains.
    :param autocorrelation: ``(d,)`` empirical integrated autocorrelation time per draw.
    :param predicted_autocorrelation: ``(d,)`` the prediction per draw.
    :param float epochs_per_draw: epochs of gradient work per collected draw.
    :param int num_draws: draws used (all chains).
    :param int num_diverging: rejected iterations (all chains).
    :param list findings: what is wrong, each with its numbers and cause; empty if nothing.
    :param list notes: what limits the check (short runs, a noisy prediction, no data).
    :param list unchecked: why some sds could not be checked (every reference for them has an
        error above 20%), or some means (the tuner cannot place them); empty if all were.
    """

    names: list
    covariance: np.ndarray
    predicted_covariance: np.ndarray
    covariance_error: float
    sd_ratio: np.ndarray
    run_error: np.ndarray
    prediction_error: np.ndarray
    sd_independent: Optional[np.ndarray]
    independent_error: Optional[np.ndarray]
    mean_offset: np.ndarray
    expected_offset: np.ndarray
    r_hat: np.ndarray
    autocorrelation: np.ndarray
    predicted_autocorrelation: np.ndarray
    epochs_per_draw: float
    num_draws: int
    num_diverging: int
    findings: list
    notes: list
    unchecked: list

    @property
    def passed(self) -> bool:
        """No findings and every sd checked: the run, the prediction and the independent
        estimate agree within their errors (each reference to 20% or better), the chains
        agree with each other, and no step was rejected."""
        return not self.findings and not self.unchecked

    @property
    def status(self) -> str:
        """``"FAILED"`` (findings), ``"CANNOT CHECK"`` (no findings, but some sd had no
        reference within 20%) or ``"PASSED"``."""
        return "FAILED" if self.findings else "CANNOT CHECK" if self.unchecked else "PASSED"

    @property
    def sd_ratio_se(self) -> np.ndarray:
        """``(d,)`` Monte Carlo standard error of :attr:`sd_ratio` (the run's alone)."""
        return self.sd_ratio * self.run_error

    @property
    def autocorrelation_ratio(self) -> np.ndarray:
        """Empirical / predicted integrated autocorrelation time, per parameter."""
        return self.autocorrelation / self.predicted_autocorrelation

    def __str__(self) -> str:
        return _table(self)

    def _worst(self) -> np.ndarray:
        z = np.abs(self.sd_ratio - 1) / _combined(self.run_error, self.prediction_error)
        if self.sd_independent is not None:
            run_sd = np.sqrt(_diagonal(self.covariance))
            ratio = run_sd / self.sd_independent
            z = np.maximum(z, np.abs(ratio - 1) / _combined(self.run_error, self.independent_error))
        return np.maximum(z, np.abs(self.mean_offset - self.expected_offset))


def _table(check) -> str:
    """The printed check: one row per parameter (the worst when there are many)."""
    pred_sd = np.sqrt(_diagonal(check.predicted_covariance))
    run_sd = np.sqrt(_diagonal(check.covariance))
    indep = check.sd_independent is not None
    lines = [
        f"Run check ({check.num_draws} draws): {check.status}; "
        f"relative Frobenius error of the covariance {check.covariance_error:.3f}",
        f"  {'parameter':<14} {'sd pred':>9} {'± %':>5} {'sd run':>9} {'± %':>5}"
        + (f" {'sd indep':>9} {'± %':>5}" if indep else "")
        + f" {'run/pred':>8} {'R-hat':>6} {'IAT pred':>8} {'IAT run':>8} {'epochs':>7}",
    ]
    order = np.argsort(-check._worst())[:_SHOWN] if len(check.names) > _SHOWN else None
    rows = range(len(check.names)) if order is None else sorted(order)
    for j in rows:
        line = (
            f"  {check.names[j]:<14} {pred_sd[j]:9.4g} {100 * check.prediction_error[j]:5.1f}"
            f" {run_sd[j]:9.4g} {100 * check.run_error[j]:5.1f}"
        )
        if indep:
            line += f" {check.sd_independent[j]:9.4g} {100 * check.independent_error[j]:5.1f}"
        line += (
            f" {check.sd_ratio[j]:8.3f} {check.r_hat[j]:6.3f}"
            f" {check.predicted_autocorrelation[j]:8.3g} {check.autocorrelation[j]:8.3g}"
            f" {check.autocorrelation[j] * check.epochs_per_draw:7.3g}"
        )
        lines.append(line)
    if order is not None:
        lines.append(f"  ({len(check.names) - len(order)} more parameters; the worst shown)")
    lines.append("  (± %: one standard error; IAT in draws; epochs: empirical IAT in epochs)")
    lines += [f"  FINDING: {f}" for f in check.findings]
    lines += [f"  CANNOT CHECK: {f}" for f in check.unchecked]
    lines += [f"  note: {f}" for f in check.notes]
    return "\n".join(lines)


def unconstrained_draws(samples: dict, report) -> np.ndarray:
    """``(C, T, d)`` unconstrained draws in the report's layout from grouped samples."""
    parts = []
    for name, *_ in report.layout.sites:
        if name not in samples:
            raise KeyError(
                f"Site '{name}' is missing from the samples; check_run needs every latent site "
                "(run the kernel autotune returned, and do not drop sites)."
            )
        value = np.asarray(samples[name])
        z = np.asarray(jax.vmap(jax.vmap(report.transforms[name].inv))(value))
        parts.append(z.reshape(z.shape[:2] + (-1,)))
    return np.concatenate(parts, axis=-1).astype(np.float64)


def check_run(
    mcmc,
    report,
    *,
    independent: bool = True,
    model_args: Optional[tuple] = None,
    model_kwargs: Optional[dict] = None,
    rng_key=None,
    print_table: bool = True,
) -> RunCheck:
    """Check the draws of ``mcmc`` (after ``run``) against ``report``'s prediction and an
    independent estimate (module docstring).

    :param mcmc: a ``numpyro.infer.MCMC`` that ran the kernel :func:`autotune` returned, or
        the :class:`~numpyro_sgmc.running.runner.KernelRun` of :func:`~numpyro_sgmc.run_kernel`.
    :param report: its :class:`~numpyro_sgmc.tuner.report.TuningReport`.
    :param bool independent: recompute ``J`` and ``I`` from fresh rows at the run's mean (as
        many rows as the tuner used: about the cost of the tuner's information step).
    :param model_args: the data the run used; default the ones ``mcmc`` ran on.
    :param model_kwargs: the keyword arguments it used; default likewise.
    :param rng_key: PRNG key for the fresh rows (default a fixed key unrelated to the
        tuner's rows).
    :param print_table: print the table and the findings.
    :return: a :class:`RunCheck`; findings also raise a
        :class:`~numpyro_sgmc.diagnostics.RunCheckWarning`.
    """
    draws = unconstrained_draws(mcmc.get_samples(group_by_chain=True), report)
    thinning = int(getattr(mcmc, "thinning", 1))  # a kept draw is every thinning-th draw
    num_chains, num_draws, d = draws.shape
    if num_draws < 20:
        raise ValueError(f"check_run needs at least 20 draws per chain, got {num_draws}.")
    run = _statistics(draws, report)
    names = report.layout.names()
    critical = float(stats.norm.isf(0.005 / d))  # two-sided, 1% over all d parameters
    num_diverging = _diverging(mcmc)
    findings, notes = [], []
    findings += _disagreement(
        names, run.run_sd / run.pred_sd, run.run_error, run.pred_error, critical, "the run",
        "the prediction",
        "The run does not sample the law the tuner predicted: a chain that is not stationary "
        "yet (more warmup), a step the linearisation does not describe (the posterior is far "
        "from Gaussian here), or a kernel changed after tuning.",
    )  # fmt: skip
    kernel, args, kwargs = _run_inputs(mcmc, model_args, model_kwargs)
    indep_sd = indep_error = None
    if kernel is not None and kernel.num_data is not None and kernel.num_data != report.num_data:
        findings.append(
            f"The run used n = {kernel.num_data} rows, the tuning n = {report.num_data}: the "
            "step, temperature and preconditioner are those of the tuning data (the posterior "
            "narrows as 1/n). Run autotune on the data you sample."
        )
    elif independent and (args is None or kernel is None or kernel.prepared is None):
        notes.append(
            "no independent estimate: the run's data are not known here (pass model_args= and "
            "model_kwargs=)."
        )
    elif independent:
        fresh = _independent(kernel.prepared, report, run.mean, args, kwargs, rng_key)
        own_rows = report.information.num_rows >= report.num_data
        at_mode = None
        if own_rows and not isinstance(fresh, str):  # the same rows at the tuner's mode
            mode = np.asarray(report.layout.ravel(report.mode), np.float64)
            at_mode = _independent(kernel.prepared, report, mode, args, kwargs, rng_key)
        if isinstance(fresh, str) or isinstance(at_mode, str):
            findings.append(fresh if isinstance(fresh, str) else at_mode)
        else:
            # the chain's known gap to its own target (the discretisation, for rows without
            # exact noise) carries over to the independent target
            report_target = np.sqrt(np.asarray(report.target_covariance.diagonal(), np.float64))
            gap = run.pred_sd / report_target
            target_sd, indep_error = fresh
            indep_sd = target_sd * gap
            at_mode = None if at_mode is None else (at_mode[0] * gap, at_mode[1])
            findings += _independent_findings(
                names, run, indep_sd, indep_error, critical, bool(findings), at_mode
            )
    findings += _chain_findings(names, run, critical, num_chains * num_draws, num_diverging)
    unchecked = (
        []
        if findings
        else _unchecked(names, report, run.pred_error, indep_error) + _unplaced(names, run)
    )
    _limits(notes, report, names, run.run_error, run.pred_error, run.ess, bool(unchecked))
    if indep_error is not None and report.information.num_rows >= report.num_data:
        notes.append(
            "the fresh-rows estimate is not independent in its rows: the tuner used all "
            f"{report.num_data} rows, so J and I are recomputed from the same rows, at the "
            "tuner's mode (against the prediction: the same unless the data differ) and at the "
            "run's mean (against the run, with the change between the two points as its error)."
        )
    result = RunCheck(
        names=names,
        covariance=run.covariance,
        predicted_covariance=run.predicted,
        covariance_error=run.covariance_error,
        sd_ratio=run.run_sd / run.pred_sd,
        run_error=run.run_error,
        prediction_error=run.pred_error,
        sd_independent=indep_sd,
        independent_error=indep_error,
        mean_offset=run.offset,
        expected_offset=run.expected_offset,
        r_hat=run.r_hat,
        autocorrelation=run.tau,
        predicted_autocorrelation=report.autocorrelation_per_draw(thinning),
        epochs_per_draw=report.num_steps
        * thinning
        * report.gradient_evaluations_per_iteration
        / report.num_data,
        num_draws=num_chains * num_draws,
        num_diverging=num_diverging,
        findings=findings,
        notes=notes,
        unchecked=unchecked,
    )
    if print_table:
        print(result)
    if findings:
        warn("check_run: " + " | ".join(findings), RunCheckWarning)
    elif unchecked:
        warn("check_run cannot check: " + " | ".join(unchecked), RunCheckWarning)
    return result


def _unchecked(names, report, pred_error, indep_error) -> list:
    """Why sds whose every reference (the prediction, the fresh-rows estimate) is known only
    to worse than ``_CHECKABLE`` cannot be checked, with what dominates the error."""
    best = pred_error if indep_error is None else np.minimum(pred_error, indep_error)
    loose = best > _CHECKABLE
    if not loose.any():
        return []
    j = int(np.argmax(np.where(loose, best, -np.inf)))
    nonlinear = linearity_error(report.nonlinearity, report.target_covariance)
    if report.mode_distance > UNREACHED_SDS:
        cause = (
            f"the mode not reached: {report.unsettled()} (the ConvergenceWarning); run the "
            "warm start longer (warm_start_epochs), or with more information rows (num_rows)"
        )
    elif nonlinear[j] >= 0.5 * pred_error[j]:
        cause = (
            "the posterior's distance from a Gaussian along the directions the tuner probed "
            "(a category with few rows, a skewed scale, a boundary), so that no Laplace "
            "picture predicts these sds to 20%; compare the run with NUTS on the same data (a "
            "subsample's posterior is another, wider one), or reparameterise where that is "
            "the cause (a non-centred or log scale; for a mixture, ordered components started "
            "at the mode you want)"
        )
    else:
        cause = (
            "the information rows' sampling (a thin category or heavy-tailed per-datum "
            "gradients); re-tune with num_rows=None (all rows) or a smaller tolerance"
        )
    fresh = "" if indep_error is None else f", the fresh-rows estimate ±{100 * indep_error[j]:.3g}%"
    return [
        f"{int(loose.sum())} of {len(names)} sds {'has' if loose.sum() == 1 else 'have'} no "
        f"reference within ±"
        f"{100 * _CHECKABLE:.0f}% (worst {names[j]}: the prediction ±{100 * pred_error[j]:.3g}%"
        f"{fresh}); the run's sds there are neither confirmed nor refuted. The error is "
        f"dominated by {cause}."
    ]


def _unplaced(names, run) -> list:
    """Why the means the tuner's profiles cannot place (a marginal's mass beyond its probes,
    the ``LinearizationWarning``) are not compared: nothing says where they should be."""
    if not run.unplaced.any():
        return []
    j = int(np.argmax(np.where(run.unplaced, np.abs(run.offset), -np.inf)))
    count = int(run.unplaced.sum())
    return [
        f"{count} of {len(names)} means {'has' if count == 1 else 'have'} no reference "
        f"(worst {names[j]}, {run.offset[j]:+.3g} posterior sds from the mode the tuning "
        "linearised at): the tuner found a marginal's mass beyond its probes (the "
        "LinearizationWarning), so it cannot say where these means lie; the run's means "
        "there are neither confirmed nor refuted. Compare the run with NUTS on the same data."
    ]


class _RunStatistics(NamedTuple):
    """What the draws say, in the report's form (dense or diagonal), per parameter."""

    covariance: np.ndarray
    predicted: np.ndarray
    covariance_error: float
    run_sd: np.ndarray
    pred_sd: np.ndarray
    run_error: np.ndarray
    pred_error: np.ndarray
    ess: np.ndarray
    tau: np.ndarray
    mean: np.ndarray
    offset: np.ndarray
    expected_offset: np.ndarray
    unplaced: np.ndarray
    r_hat: np.ndarray
    num_draws: int


def _statistics(draws, report) -> _RunStatistics:
    """The run's moments, mixing and Monte Carlo errors from ``(C, T, d)`` draws."""
    num_chains, num_draws, d = draws.shape
    total = num_chains * num_draws
    flat = draws.reshape(-1, d)
    if is_dense(report.covariance):
        covariance = np.atleast_2d(np.cov(flat, rowvar=False))
        predicted = np.asarray(report.covariance.as_matrix(), np.float64)
    else:  # a diagonal report: d may be 10⁴, so variances only
        covariance = flat.var(axis=0, ddof=1)
        predicted = np.asarray(report.covariance.diagonal(), np.float64)
    run_sd = np.sqrt(_diagonal(covariance))
    ess = np.asarray(effective_sample_size(draws), np.float64)
    # an ESS that is not positive (draws that alternate about their mean, or do not move)
    # has no Monte Carlo error: its sds are compared with nothing (_chain_findings says why)
    tau = np.where(np.isfinite(ess) & (ess > 0), total / np.where(ess > 0, ess, 1.0), np.inf)
    mean = flat.mean(axis=0)
    return _RunStatistics(
        covariance=covariance,
        predicted=predicted,
        covariance_error=float(np.linalg.norm(covariance - predicted) / np.linalg.norm(predicted)),
        run_sd=run_sd,
        pred_sd=np.sqrt(_diagonal(predicted)),
        run_error=np.sqrt(tau / (2.0 * total)),
        pred_error=(
            np.zeros(d) if report.prediction_error is None else np.asarray(report.prediction_error)
        ),
        ess=ess,
        tau=tau,
        mean=mean,
        offset=(mean - np.asarray(report.layout.ravel(report.mode), np.float64)) / run_sd,
        expected_offset=mean_shift(report.nonlinearity, d) / np.where(run_sd > 0, run_sd, np.inf),
        unplaced=unplaced_means(report.nonlinearity, report.target_covariance),
        r_hat=np.asarray(split_gelman_rubin(draws), np.float64),
        num_draws=total,
    )


def _independent_findings(names, run, indep_sd, indep_error, critical, found, at_mode) -> list:
    """The prediction, then (if nothing was found yet) the run, against the sds the run should
    have by the target from fresh rows (``indep_sd``, at the run's mean).

    When those rows are the tuner's own (it used all of them), ``at_mode`` is the same
    estimate at the tuner's mode, ``(sd, error)``. Against the prediction it isolates the
    data: equal where the run's data are the tuner's, different where they are not. The
    estimate at the run's mean differs from it only by the point, and the run's mean is itself
    a Monte Carlo estimate: the run is compared with it with that point effect,
    ``|indep/mode - 1|``, added to its error (on raw covariate scales the information moves by
    several percent within the run's Monte Carlo error of the mean)."""
    at = "the information from fresh rows at the "
    reference_sd, reference_error, reference = (
        (indep_sd, indep_error, at + "run's mean") if at_mode is None
        else (*at_mode, at + "tuner's mode")
    )  # fmt: skip
    findings = _disagreement(
        names, run.pred_sd / reference_sd, run.pred_error, reference_error, critical,
        "the prediction", reference,
        "The prediction is built from J and I that do not represent the data: its "
        "rows missed heavy-tailed per-datum gradients, or its mode is not where the "
        "posterior is, or the run's data are not the tuner's. A run that matches the "
        "prediction samples the wrong law. Re-tune with a smaller tolerance, or "
        "num_rows=None (all rows), on the data you sample.",
    )  # fmt: skip
    if found or findings:
        return findings
    error = indep_error
    if at_mode is not None:
        error = np.sqrt(indep_error**2 + (indep_sd / at_mode[0] - 1) ** 2)
    return _disagreement(
        names, run.run_sd / indep_sd, run.run_error, error, critical, "the run",
        at + "run's mean",
        "The run's law is not the target computed where the run is: the posterior "
        "is far from Gaussian, so the Laplace picture at one point describes neither.",
    )  # fmt: skip


def _chain_findings(names, run, critical, total, num_diverging) -> list:
    """The run's own evidence: its mean against where the tuning expects it (the mode, moved
    by the profiles' skew), split R-hat across chains, rejected steps."""
    findings = []
    unmixed = np.isinf(run.tau)  # an ESS not positive or not finite (_statistics)
    if unmixed.any():
        j, count = int(np.flatnonzero(unmixed)[0]), int(unmixed.sum())
        findings.append(
            f"The effective sample size of {names[j]} is {run.ess[j]:.3g} (not positive or "
            f"not finite for {count} of {len(names)} parameters): successive draws alternate "
            "about their mean, as a chain does whose step is at or past the linear stability bound "
            "(h·λmax(ΓJ) ≥ 2 oscillates, 4 diverges), or they do not move. Such draws are not "
            "from the target: use the tuned step, or a smaller one."
        )
    miss = np.abs(run.offset - run.expected_offset) - critical * np.sqrt(run.tau / total)
    far = (miss > _MEAN_OFFSET + _SHIFT_ERROR * np.abs(run.expected_offset)) & ~run.unplaced
    if far.any():
        j = int(np.argmax(np.where(far, miss, -np.inf)))
        expected = run.expected_offset[j]
        where = (
            f", where the tuner's profiles put its posterior mean {expected:+.3g} "
            f"(± {_SHIFT_ERROR * abs(expected):.2g}) for the skew"
            if abs(expected) >= 0.05
            else ""
        )
        findings.append(
            f"The run's mean is {run.offset[j]:+.3g} posterior sds from the mode the tuning "
            f"linearised at{where} ({names[j]}; {int(far.sum())} parameters over "
            f"{_MEAN_OFFSET:g} sd from where the tuner expects their means): the warm start "
            "did not reach the mode, the posterior is more skewed than the tuner's profiles "
            "show (or they found no peak: the LinearizationWarning), or the chain drifts (no "
            "finite mode). The predictions do not hold there."
        )
    r_hat = run.r_hat
    if total >= 4 and np.nanmax(r_hat) > _R_HAT:
        j = int(np.nanargmax(r_hat))
        findings.append(
            f"Split R-hat up to {r_hat[j]:.3f} ({names[j]}; {int(np.sum(r_hat > _R_HAT))} "
            f"parameters over {_R_HAT}): the chains, started from draws of the predicted law, "
            "disagree with each other or drift. Run longer, or look for several modes."
        )
    if num_diverging:
        findings.append(
            f"{num_diverging} iterations were rejected as divergent (non-finite gradient or "
            "position): the draws near them are not from the target. Lower the step size."
        )
    return findings


def _diagonal(c):
    return np.diag(c) if np.ndim(c) == 2 else np.asarray(c)


def _combined(*errors):
    return np.sqrt(sum(np.asarray(e) ** 2 for e in errors) + _FLOOR**2)


def _disagreement(names, ratio, error_a, error_b, critical, a, b, cause) -> list:
    """A finding if ``ratio = sd_a/sd_b`` is further from 1 than the errors allow."""
    z = (ratio - 1) / _combined(error_a, error_b)
    bad = np.abs(z) > critical
    if not bad.any():
        return []
    j = int(np.argmax(np.abs(z)))
    larger = a if error_a[j] >= error_b[j] else b
    return [
        f"{a.capitalize()} and {b} disagree on {int(bad.sum())} of {len(names)} sds (worst "
        f"{names[j]}: ratio {ratio[j]:.3f}, errors ±{100 * error_a[j]:.2g}% ({a}) and "
        f"±{100 * error_b[j]:.2g}% ({b}), the larger {larger}'s; |z| = {abs(z[j]):.1f} > "
        f"{critical:.1f}). {cause}"
    ]


def _limits(notes, report, names, run_error, pred_error, ess, unchecked):
    """What keeps the check from being sharper, and the fix (a prediction error that leaves
    sds unchecked is said there, not here)."""
    if np.max(run_error) > 0.05 and np.all(np.isfinite(run_error)):
        notes.append(
            f"the run's Monte Carlo error (up to ±{100 * np.max(run_error):.2g}% on an sd, min "
            f"ESS {np.min(ess):.0f}) is the larger one: the check cannot see errors below "
            "about 3x that; report.draws_for(1000) draws per chain bring it to ±2.2% or less."
        )
    if np.max(pred_error) > 0.05 and not unchecked:
        nonlinear = linearity_error(report.nonlinearity, report.target_covariance)
        j = int(np.argmax(pred_error))
        if report.mode_distance > UNREACHED_SDS:
            notes.append(
                f"the prediction has no error bar: {report.unsettled()} (the "
                "ConvergenceWarning), so the run was checked against the fresh-rows estimate at "
                "its own mean only; re-tune with a longer warm start (warm_start_epochs) or "
                "more information rows (num_rows) for a prediction to check it against."
            )
        elif nonlinear[j] >= 0.5 * pred_error[j]:
            notes.append(
                f"the prediction's own error is large (up to ±{100 * pred_error[j]:.2g}%, "
                f"{names[j]}) because the posterior is not Gaussian there: the prediction is a "
                "Laplace approximation, and the run, which samples the posterior itself (to its "
                "step's discretisation error), is the better estimate of those sds."
            )
        else:
            notes.append(
                f"the prediction's own error is large (up to ±{100 * pred_error[j]:.2g}%, "
                f"{names[j]}): re-tune with more information rows (a smaller tolerance, or "
                "num_rows=None)."
            )


def _diverging(mcmc) -> int:
    count = getattr(mcmc, "num_diverging", None)
    if count is None:
        state = getattr(mcmc, "last_state", None)
        count = getattr(state, "num_diverging", 0)
    return int(np.sum(np.asarray(count)))


def _run_inputs(mcmc, model_args, model_kwargs):
    """The kernel and the data the run used (``MCMC`` keeps them after ``run``)."""
    kernel = getattr(mcmc, "sampler", None)
    args = getattr(mcmc, "model_args", None)
    kwargs = getattr(mcmc, "model_kwargs", None)
    if args is None:  # numpyro.infer.MCMC: run() stores its arguments
        args, kwargs = getattr(mcmc, "_args", None), getattr(mcmc, "_kwargs", None)
    args = args if model_args is None else tuple(model_args)
    kwargs = (kwargs or {}) if model_kwargs is None else dict(model_kwargs)
    if not hasattr(kernel, "prepared"):
        kernel = None
    if kernel is not None and args is not None:  # as the kernel converted them (pandas, lists)
        args, kwargs = validation.as_arrays(kernel.subsampled_model, args, kwargs)
    return kernel, args, kwargs


def _independent(prepared, report, mean, args, kwargs, rng_key):
    """``(target sd, its relative error)`` from fresh rows at the run's mean, or a finding."""
    info0 = report.information
    rows = info0.num_rows if info0.num_rows < report.num_data else None
    key = random.key(_FRESH_KEY) if rng_key is None else rng_key
    dtype = np.asarray(report.layout.ravel(report.mode)).dtype
    params = report.layout.unravel(np.asarray(mean, dtype))
    try:
        info = information_of(
            prepared, key, args, kwargs, params, num_rows=rows, kind=info0.kind,
            regularize="auto", num_probes=max(info0.num_probes, 1),
        )  # fmt: skip
    except ValueError as err:
        return (
            "The information at the run's mean cannot be computed, so the run is not where a "
            f"Laplace picture holds: {err}"
        )
    info = debiased(info)
    target = target_covariance(info.potential_curvature, info.I, report.weights, info.data_free)
    sd = np.sqrt(np.asarray(target.diagonal(), np.float64) / report.num_data)
    # a Laplace picture at another point shares the nonlinearity the tuner measured
    nonlinear = linearity_error(report.nonlinearity, report.target_covariance)
    error = np.sqrt(prediction_error(info, report.weights) ** 2 + nonlinear**2)
    if info.kind == "diagonal":  # what a diagonal J leaves out, from fresh rows and probes
        problem = Problem(prepared, args, kwargs, None, key)
        try:
            linked = correlations(problem, params, info)
        except ValueError as err:  # its Hessian curves down there: no Laplace picture
            return (
                "The correlations at the run's mean cannot be measured, so the run is not "
                f"where a Laplace picture holds: {err}"
            )
        sd, error = sd * np.sqrt(linked.inflation), with_correlations(error, linked, report.weights)
    return sd, error
