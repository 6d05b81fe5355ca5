"""Calibration you can show: interval coverage and rank statistics for every target.

The targets of :func:`~numpyro_sgmc.autotune` differ only when the model is misspecified
(``docs/theory.md``, "Which target when"): then the posterior's credible sets are not
confidence sets, while the local fiducial distribution ``N(θ̂, S/n)`` (the sandwich) is, and
the bagged posterior ``N(θ̂, w(S + J⁻¹)/n)`` covers at least as well (Müller 2013, *Risk of
Bayesian inference in misspecified models, and the sandwich covariance matrix*; Huggins &
Miller, *Reproducible model selection using bagged posteriors* (BayesBag); Negrea, Yang, Feng,
Roy & Huggins, *Tuning stochastic gradient algorithms for statistical inference via
large-sample asymptotics*). :func:`calibrate` checks it on the user's own model and
data-generating process: it simulates ``R`` data sets, runs the autotuned recipe for every
target on each (``autotune``, then :func:`~numpyro_sgmc.run_kernel` for ``ess`` effective
draws), and records, per target and parameter,

* the **intervals**: equal-tailed intervals of the *constrained* draws at each nominal level;
* whether each interval **covers** the true value, hence the coverage of every level with its
  binomial standard error ``sqrt(p(1 - p)/R)``;
* the **rank** of the true value among ``num_ranks - 1`` thinned draws. When the true value
  is drawn from the prior and the data from the model (:func:`prior_simulator`), the
  posterior's ranks are uniform: simulation-based calibration (Talts, Betancourt, Simpson,
  Vehtari & Gelman 2018, *Validating Bayesian inference algorithms with simulation-based
  calibration*). At a fixed true value the local fiducial target's ranks are uniform when it
  is calibrated at every level;
* the **Table 1 prediction** of each coverage, ``2Φ(z_l ρ_i) - 1`` with ``ρ_i`` the chain's
  predicted sd over the mode's sampling sd (:mod:`~numpyro_sgmc.calibration.prediction`).

The *true value* of a misspecified model is the pseudo-true parameter, the minimiser of the
Kullback–Leibler divergence from the data-generating process (the limit of the mode as ``n``
grows): the user's process defines it, and the user supplies it. References (the classical or
sandwich standard errors of a maximum-likelihood fit, a bootstrap, NUTS) are callables
returning draws or distributions; they are summarised the same way, on the same data sets.

The modules: :mod:`~numpyro_sgmc.calibration.replicates` (:func:`calibrate`,
:func:`prior_simulator`: the replicates and what failed), :mod:`~numpyro_sgmc.calibration.coverage`
(:class:`Calibration`, its coverage statistics, :func:`concatenate`),
:mod:`~numpyro_sgmc.calibration.prediction` (the Table 1 prediction of a coverage),
:mod:`~numpyro_sgmc.calibration.sbc` (:func:`rank_test`), :mod:`~numpyro_sgmc.calibration.report`
(the coverage table as text) and :mod:`~numpyro_sgmc.calibration.plots` (:func:`plot_coverage`,
:func:`plot_ranks`, :func:`plot_widths`; they need matplotlib, imported when first called).
"""

from numpyro_sgmc.calibration.coverage import Calibration, Failure, concatenate
from numpyro_sgmc.calibration.plots import plot_coverage, plot_ranks, plot_widths
from numpyro_sgmc.calibration.replicates import (
    DEFAULT_TARGETS,
    LEVELS,
    calibrate,
    prior_simulator,
)
from numpyro_sgmc.calibration.report import _median, _rows  # noqa: F401 - benchmarks' tables
from numpyro_sgmc.calibration.sbc import RankTest, rank_test

__all__ = [
    "DEFAULT_TARGETS",
    "LEVELS",
    "Calibration",
    "Failure",
    "RankTest",
    "calibrate",
    "concatenate",
    "plot_coverage",
    "plot_ranks",
    "plot_widths",
    "prior_simulator",
    "rank_test",
]
