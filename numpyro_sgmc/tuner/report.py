"""What the autotuner chose and predicts: :class:`TuningReport`.

The report holds the tuning (the Table 1 row and its ``h``, ``b``, ``β``, ``Γ``, ``Λ``), the
prediction (the stationary covariance from the discrete Lyapunov equation, the per-parameter
autocorrelation times, the mixing time) and its cost in epochs, with the information
(``J``, ``I``) and the warm start it was built from (``docs/theory.md`` §3–§4).
:func:`~numpyro_sgmc.check_run` compares a run with it.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from numpyro_sgmc import scales
from numpyro_sgmc.theory import autocorrelation_times
from numpyro_sgmc.tuner.laplace import UNREACHED_SDS

__all__ = ["TuningReport", "describe"]


class TuningReport(NamedTuple):
    """What :func:`~numpyro_sgmc.autotune` chose and predicts; matrices are scales
    (:mod:`numpyro_sgmc.scales`) over the flat unconstrained parameters (``layout``).

    :param str row: the Table 1 row; ``algorithm`` the kernel's class name.
    :param str target: the target's name; ``weights`` its ``(w₁, w₂)``; ``num_data``: ``n``.
    :param step_size: ``h``; ``batch_size``: ``b`` per plate (a dict); ``inverse_temperature``:
        ``β`` (``inf`` for SGD); ``preconditioner``: ``Γ``; ``noise_preconditioner``: ``Λ``
        (``None`` for SGD); ``control_variates``: whether the kernel uses them.
    :param int num_steps: iterations per MCMC draw given to the kernel.
    :param target_covariance: ``Σ_t = Q/n``; ``covariance`` the predicted stationary one
        (both unconstrained).
    :param constrained_covariance: the prediction mapped to the constrained latent sites by
        the delta method, ``(d, d)`` array (``None`` for a diagonal prediction).
    :param autocorrelation_iterations: ``(d,)`` each unconstrained parameter's predicted
        integrated autocorrelation time, in iterations; ``mixing_iterations`` the worst over
        all linear functionals, ``mixing_epochs`` the same in epochs of gradient work.
    :param int gradient_evaluations_per_iteration: ``b``, or ``2b`` with control variates.
    :param float setup_epochs: passes over the data before sampling (warm start, information
        rows, Newton passes, the control-variate centre).
    :param float newton_step: the first Newton step's length from the warm start's mode (or
        the start itself, where ``warm_start.num_epochs`` is 0), in posterior sds;
        ``mode_distance``: how far from the mode the Newton steps stopped, in posterior sds,
        where they did not settle (0 where they did; ``Fit.unreached`` of
        :mod:`~numpyro_sgmc.tuner.laplace`); ``mode_distance_diagonal``: whether that length
        is of a step of ``J``'s diagonal alone (conjugate gradients on the Hessian failed),
        which on correlated parameters can be far from the distance to the mode.
    :param dict mode: unconstrained mode (``init_params`` for ``MCMC.run``); ``constrained_mode``
        the same in constrained space.
    :param information: the :class:`~numpyro_sgmc.tuner.fisher.Information` at the mode;
        ``warm_start`` the :class:`~numpyro_sgmc.tuner.warmstart.WarmStart` run.
    :param layout: the :class:`~numpyro_sgmc.data.model.Layout` of the unconstrained vector.
    :param list constrained_layout: ``[(site, start, stop, shape)]`` of the constrained sites.
    :param dict transforms: site -> the transform from unconstrained to constrained values.
    :param list alternatives: ``(row, mixing_epochs or message)`` of every row considered.
    :param prediction_error: ``(d,)`` relative standard error of the predicted sds
        (:attr:`~numpyro_sgmc.tuner.laplace.Fit.prediction_error`, and what the
        control-variate noise's estimate leaves in the run's:
        :func:`~numpyro_sgmc.tuner.tuning.noise_estimate_error`).
    :param list nonlinearity: the :class:`~numpyro_sgmc.tuner.laplace.Nonlinearity` of the
        marginal paths of the parameters with no per-datum gradient and of the target's
        widest directions.
    :param correlations: for a diagonal ``J``, the :class:`~numpyro_sgmc.tuner.laplace.Correlations`
        it leaves out, which inflate ``covariance`` and slow ``drift`` (``None`` if dense).
    """

    row: str
    algorithm: str
    target: str
    weights: tuple
    step_size: float
    batch_size: dict
    inverse_temperature: float
    preconditioner: object
    noise_preconditioner: Optional[object]
    control_variates: bool
    num_steps: int
    target_covariance: object
    covariance: object
    constrained_covariance: Optional[np.ndarray]
    autocorrelation_iterations: np.ndarray
    mixing_iterations: float
    mixing_epochs: float
    gradient_evaluations_per_iteration: int
    setup_epochs: float
    newton_step: float
    num_data: int
    mode: dict
    constrained_mode: dict
    information: object
    warm_start: object
    layout: object
    constrained_layout: list
    transforms: dict
    alternatives: list = []
    prediction_error: Optional[np.ndarray] = None
    nonlinearity: list = []
    correlations: Optional[object] = None
    mode_distance: float = 0.0
    mode_distance_diagonal: bool = False

    @property
    def drift(self):
        """``F = I - (h/2)ΓJ``: the linearised chain ``δ' = Fδ + noise`` (§3). For a diagonal
        ``J``, each parameter's effective ``1 - (h/2)/c_j``, ``c_j`` its concentration on the
        slow directions the diagonal leaves out
        (:class:`~numpyro_sgmc.tuner.laplace.Correlations`)."""
        return _drift(self)

    def autocorrelation_per_draw(self, thinning: int = 1) -> np.ndarray:
        """Predicted per-parameter integrated autocorrelation time of the collected draws.

        A kept draw is every ``k = num_steps · thinning``-th iterate, so the lag-``j``
        autocovariance is that of lag ``j·k`` iterations:
        ``theory.autocorrelation_times(F^k, Σ)``.
        """
        Fk = scales.matrix_power(self.drift, self.num_steps * int(thinning))
        return autocorrelation_times(Fk, self.covariance)

    def draws_for(self, ess: float) -> int:
        """Draws (per chain, ``num_samples``) for an effective sample size ``ess`` of every
        parameter."""
        return int(math.ceil(ess * float(np.max(self.autocorrelation_per_draw()))))

    def epochs_for(self, ess: float) -> float:
        """Epochs of gradient work (per chain) for an effective sample size ``ess``."""
        iterations = self.draws_for(ess) * self.num_steps
        return iterations * self.gradient_evaluations_per_iteration / self.num_data

    def total_epochs(self, ess: float) -> float:
        """Setup plus sampling epochs (per chain) for an effective sample size ``ess``."""
        return self.setup_epochs + self.epochs_for(ess)

    @property
    def predicted_sd(self) -> np.ndarray:
        """``(d,)`` predicted standard deviation of each unconstrained parameter."""
        return np.sqrt(np.asarray(self.covariance.diagonal(), np.float64))

    def unsettled(self) -> str:
        """Where the Newton steps stopped short of the mode, in words (``mode_distance``)."""
        if self.mode_distance_diagonal:
            return (
                "the tuner's Newton steps did not settle (their last step, of the diagonal of "
                f"J alone, was {self.mode_distance:.3g} sds long: the distance to the mode "
                "itself is unknown)"
            )
        return (
            f"the tuner's Newton steps stopped {self.mode_distance:.3g} posterior sds from the mode"
        )

    def __str__(self) -> str:
        return describe(self)


def _drift(report: TuningReport):
    """:attr:`TuningReport.drift`."""
    if report.correlations is not None:
        rate = 1.0 / np.asarray(report.correlations.concentration, np.float64)
        return scales.Diagonal(1.0 - 0.5 * report.step_size * rate)
    F = report.preconditioner @ report.information.potential_curvature
    return scales.Diagonal(np.ones(report.layout.size)) - F * (0.5 * report.step_size)


def describe(report: TuningReport) -> str:
    """The printable report: the tuning, the predicted mixing and its error, the rows
    considered, the predicted sds and the draws an ESS of 1000 needs."""
    b = ", ".join(f"{k}: {v}" for k, v in report.batch_size.items())
    w1, w2 = report.weights
    info = report.information
    lines = [
        f"Autotuned {report.algorithm} (Table 1 row {report.row}) for target '{report.target}' "
        f"(Q = {w1:g}·S + {w2:g}·J⁻¹), n = {report.num_data}",
        f"  step size h = {report.step_size:.4g}, batch size b = {b}, "
        f"inverse temperature β = {report.inverse_temperature:.6g}, "
        f"control variates: {report.control_variates}, {report.num_steps} iterations per draw",
        f"  predicted mixing: {report.mixing_iterations:.3g} iterations = "
        f"{report.mixing_epochs:.3g} epochs; per-draw autocorrelation time "
        f"{report.autocorrelation_per_draw().max():.3g}",
        f"  information ({info.kind}) from {info.num_rows} rows: "
        f"cond(J) = {info.condition_numbers['J']:.3g}, "
        f"cond(I) = {info.condition_numbers['I']:.3g}; " + _newton_line(report),
    ]
    if info.inverse_bias:
        lines.append(
            f"  J⁻¹ and S from {info.num_rows} rows corrected for their bias (an inverse from "
            f"rows is too large: by {100 * info.inverse_bias:.2g}% on the median variance here)"
        )
    if report.mode_distance > UNREACHED_SDS:
        lines.append(
            f"  prediction error: unknown: {report.unsettled()}, and a picture linearised "
            "there bounds nothing"
        )
    elif report.prediction_error is not None:
        lines.append(
            f"  prediction error: predicted sds within "
            f"±{100 * np.max(report.prediction_error):.2g}% (one standard error: the "
            "information rows, the distance from a Gaussian and the control-variate noise's "
            "estimate)"
        )
    free = info.data_free
    if np.any(free):
        names = sorted(
            {n.split("[")[0] for n, f in zip(report.layout.names(), free, strict=True) if f}
        )
        lines.append(
            f"  no per-datum gradient: {', '.join(names)} (I = 0 there; their uncertainty "
            "is the conditional posterior's, docs/theory.md §4)"
        )
    target_sd = np.sqrt(np.asarray(report.target_covariance.diagonal(), np.float64))
    thin = [f for f in report.nonlinearity if f.informing_rows > 0]
    if thin:
        lines.append(_thin_line(thin, target_sd))
    for f in report.nonlinearity:
        if f.informing_rows > 0:
            continue
        if not math.isfinite(f.sd_ratio) and f.parameter is not None:
            lines.append(
                f"  the marginal of {f.label} has its mass beyond the probes, far to one side of "
                "the mode (the LinearizationWarning); the predictions do not hold there"
            )
        elif not math.isfinite(f.sd_ratio):
            lines.append(
                f"  no mode along {f.label}: the log posterior does not rise on one side of the "
                "point the tuner linearised at, or was not measured there (the "
                "LinearizationWarning); the predictions do not hold along it"
            )
        elif not 0.95 <= f.sd_ratio <= 1.05 or f.continuation_error > 0.05:
            beyond = (
                f", give or take {100 * f.continuation_error:.0f}% for its shape beyond the probes"
                if f.continuation_error > 0.05
                else ""
            )
            lines.append(
                f"  far from Gaussian along {'the marginal of ' * (f.parameter is not None)}"
                f"{f.label}: the posterior's sd along it is about "
                f"{f.sd_ratio:.3g}x the quadratic's{beyond} (counted in the error)"
            )
        if math.isfinite(f.sd_ratio) and f.parameter is not None:
            shift = _marginal_shift(f, target_sd)
            if abs(shift) >= 0.5:
                lines.append(
                    f"  the marginal of {f.label} is skewed: its mean lies {abs(shift):.3g} sds "
                    f"{'above' if shift > 0 else 'below'} the mode (check_run expects a run's "
                    "mean there)"
                )
    others = [(r, why) for r, why in report.alternatives if r != report.row]
    for r, why in others:
        cost = f"mixes in {why:.3g} epochs" if isinstance(why, float) else why
        lines.append(f"  row {r}: {cost}")
    lines.append("  predicted sd (unconstrained):")
    sd = report.predicted_sd
    for name, start, stop, _ in report.layout.sites:
        values = " ".join(f"{v:.4g}" for v in sd[start:stop][:8])
        more = " ..." if stop - start > 8 else ""
        lines.append(f"    {name:<20} {values}{more}")
    lines.append(
        f"  ESS 1000 needs {report.draws_for(1000)} draws = {report.epochs_for(1000):.3g} epochs "
        f"of sampling, after {report.setup_epochs:.3g} epochs of setup"
    )
    return "\n".join(lines)


def _newton_line(report: TuningReport) -> str:
    """Where the Newton steps started: the model's start (no optimizer ran) or Adam's mode."""
    if report.warm_start is not None and report.warm_start.num_epochs == 0:
        return f"Newton steps from the start, the first {report.newton_step:.2g} posterior sd long"
    return f"warm-start mode moved {report.newton_step:.2g} posterior sd by a Newton step"


def _thin_line(thin: list, target_sd) -> str:
    """One line for the profiles of the parameters that few rows inform."""
    ratios = [f.sd_ratio for f in thin if math.isfinite(f.sd_ratio)]
    shifts = [abs(_marginal_shift(f, target_sd)) for f in thin if math.isfinite(f.sd_ratio)]
    unplaced = len(thin) - len(ratios)
    covered = sum(len(f.covers) for f in thin)
    line = f"  {len(thin)} parameters that few rows inform, profiled"
    if ratios:
        line += (
            f": sds {min(ratios):.3g}-{max(ratios):.3g}x the quadratic's, means up to "
            f"{max(shifts):.2g} sds from the mode (counted in the error; check_run expects "
            "a run's means there)"
        )
    if unplaced:
        line += f"; {unplaced} with their mass beyond the probes (the predictions do not hold)"
    if covered:
        line += f"; {covered} more as thin, not profiled, are given the worst one's error"
    return line


def _marginal_shift(f, target_sd) -> float:
    """Where a marginal path's profile puts its parameter's mean, in its target sds."""
    return f.mean_shift * f.sd * f.direction[f.parameter] / target_sd[f.parameter]
