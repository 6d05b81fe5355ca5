"""Compare a run with the autotuner's prediction (``shared/design/theory.md`` §3).

:func:`check_run` takes the ``MCMC`` object after ``run`` and the
:class:`~numpyro_sgmc.autotune.TuningReport`, maps the draws back to the unconstrained space
the prediction lives in, and compares

* the covariance: relative Frobenius error ``‖Ĉ - Σ‖_F / ‖Σ‖_F`` and the ratio of the
  empirical to the predicted standard deviation of every parameter;
* the integrated autocorrelation time of every parameter: empirical (from NumPyro's
  effective sample size, ``τ̂ = C·T / ESS`` over ``C`` chains of ``T`` draws) against the
  prediction for the collected draws (every ``num_steps``-th iterate), also in epochs.

Both are Monte Carlo estimates: the report gives the standard error of each empirical
standard deviation, ``sd·sqrt(τ̂/(2·C·T))``, so a ratio can be judged against its noise.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from numpyro.diagnostics import effective_sample_size

__all__ = ["RunCheck", "check_run", "unconstrained_draws"]


class RunCheck(NamedTuple):
    """Empirical against predicted, per unconstrained parameter (order: ``names``).

    :param names: ``site[index]`` label of each parameter.
    :param covariance: ``(d, d)`` empirical covariance of the draws (unconstrained).
    :param predicted_covariance: ``(d, d)`` the report's prediction.
    :param float covariance_error: ``‖Ĉ - Σ‖_F / ‖Σ‖_F``.
    :param sd_ratio: ``(d,)`` empirical sd / predicted sd.
    :param sd_ratio_se: ``(d,)`` Monte Carlo standard error of each ratio.
    :param autocorrelation: ``(d,)`` empirical integrated autocorrelation time per draw.
    :param predicted_autocorrelation: ``(d,)`` the prediction per draw.
    :param float epochs_per_draw: epochs of gradient work per collected draw.
    :param int num_draws: draws used (all chains).
    """

    names: list
    covariance: np.ndarray
    predicted_covariance: np.ndarray
    covariance_error: float
    sd_ratio: np.ndarray
    sd_ratio_se: np.ndarray
    autocorrelation: np.ndarray
    predicted_autocorrelation: np.ndarray
    epochs_per_draw: float
    num_draws: int

    @property
    def autocorrelation_ratio(self) -> np.ndarray:
        """Empirical / predicted integrated autocorrelation time, per parameter."""
        return self.autocorrelation / self.predicted_autocorrelation

    def __str__(self) -> str:
        lines = [
            f"Run vs prediction ({self.num_draws} draws): relative Frobenius error of the "
            f"covariance {self.covariance_error:.3f}",
            f"  {'parameter':<16} {'sd pred':>10} {'sd run':>10} {'ratio':>7} {'± se':>6}"
            f" {'IAT pred':>9} {'IAT run':>9} {'ratio':>6} {'epochs':>8}",
        ]
        pred_sd = np.sqrt(np.diag(self.predicted_covariance))
        run_sd = np.sqrt(np.diag(self.covariance))
        for j, name in enumerate(self.names):
            lines.append(
                f"  {name:<16} {pred_sd[j]:10.4g} {run_sd[j]:10.4g} {self.sd_ratio[j]:7.3f} "
                f"{self.sd_ratio_se[j]:6.3f} {self.predicted_autocorrelation[j]:9.3g} "
                f"{self.autocorrelation[j]:9.3g} {self.autocorrelation_ratio[j]:6.2f} "
                f"{self.autocorrelation[j] * self.epochs_per_draw:8.3g}"
            )
        lines.append("  (IAT in draws; 'epochs' = empirical IAT in epochs of gradient work)")
        return "\n".join(lines)


def unconstrained_draws(samples: dict, report) -> np.ndarray:
    """``(C, T, d)`` unconstrained draws in the report's layout from grouped samples."""
    parts = []
    for name, *_ in report.layout:
        if name not in samples:
            raise KeyError(
                f"Site '{name}' is missing from the samples; check_run needs every latent site "
                "(run the kernel autotune returned, and do not drop sites)."
            )
        value = np.asarray(samples[name])
        z = np.asarray(jax.vmap(jax.vmap(report.transforms[name].inv))(value))
        parts.append(z.reshape(z.shape[:2] + (-1,)))
    return np.concatenate(parts, axis=-1).astype(np.float64)


def _names(layout) -> list:
    names = []
    for name, start, stop, shape in layout:
        if stop - start == 1 and len(shape) == 0:
            names.append(name)
        else:
            names.extend(f"{name}[{j}]" for j in range(stop - start))
    return names


def check_run(mcmc, report, *, print_table: bool = True) -> RunCheck:
    """Compare the draws of ``mcmc`` (after ``run``) with ``report``'s predictions.

    :param mcmc: a ``numpyro.infer.MCMC`` that ran the kernel :func:`autotune` returned, or
        the :class:`~numpyro_sgmc.runner.KernelRun` of :func:`~numpyro_sgmc.run_kernel`.
    :param report: its :class:`~numpyro_sgmc.autotune.TuningReport`.
    :param print_table: print the comparison table.
    """
    draws = unconstrained_draws(mcmc.get_samples(group_by_chain=True), report)
    thinning = int(getattr(mcmc, "thinning", 1))  # a kept draw is every thinning-th draw
    num_chains, num_draws, d = draws.shape
    if num_draws < 20:
        raise ValueError(f"check_run needs at least 20 draws per chain, got {num_draws}.")
    flat = draws.reshape(-1, d)
    covariance = np.atleast_2d(np.cov(flat, rowvar=False))
    predicted = np.asarray(report.covariance, np.float64)
    error = float(np.linalg.norm(covariance - predicted) / np.linalg.norm(predicted))
    ess = np.asarray(effective_sample_size(draws), np.float64)
    tau = num_chains * num_draws / ess
    ratio = np.sqrt(np.diag(covariance) / np.diag(predicted))
    result = RunCheck(
        names=_names(report.layout),
        covariance=covariance,
        predicted_covariance=predicted,
        covariance_error=error,
        sd_ratio=ratio,
        sd_ratio_se=ratio * np.sqrt(tau / (2.0 * num_chains * num_draws)),
        autocorrelation=tau,
        predicted_autocorrelation=report.autocorrelation_per_draw(thinning),
        epochs_per_draw=report.num_steps
        * thinning
        * report.gradient_evaluations_per_iteration
        / report.num_data,
        num_draws=num_chains * num_draws,
    )
    if print_table:
        print(result)
    return result
