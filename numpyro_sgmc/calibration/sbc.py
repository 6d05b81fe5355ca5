"""Rank statistics: is a method's rank of the true value uniform?

Simulation-based calibration (Talts, Betancourt, Simpson, Vehtari & Gelman 2018, *Validating
Bayesian inference algorithms with simulation-based calibration*): when the true value is drawn
from the prior and the data from the model, the rank of the true value among independent
posterior draws is uniform on ``0, ..., num_ranks - 1``; at a fixed true value, so is a
calibrated confidence distribution's (the rank is its probability integral transform).
:func:`rank_test` is Pearson's chi-square test of that uniformity over equal bins, per
parameter; :meth:`~numpyro_sgmc.calibration.coverage.Calibration.sbc` applies it to one
method's ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy import stats

__all__ = ["RankTest", "rank_test"]


class RankTest(NamedTuple):
    """A chi-square test that ranks are uniform, per parameter.

    :param tuple names: the parameters.
    :param counts: ``(d, bins)`` replicates whose rank fell in each of ``bins`` equal bins.
    :param statistic: ``(d,)`` Pearson's ``Σ (count - R/bins)² / (R/bins)``.
    :param int dof: ``bins - 1``.
    :param p_value: ``(d,)`` the chi-square tail probability of ``statistic``.
    :param int num_ranks: possible ranks ``0, ..., num_ranks - 1``.
    :param int num_replicates: ``R``, the ranks counted.
    """

    names: tuple
    counts: np.ndarray
    statistic: np.ndarray
    dof: int
    p_value: np.ndarray
    num_ranks: int
    num_replicates: int

    def __str__(self) -> str:
        lines = [
            f"rank uniformity: chi-square on {self.dof + 1} bins of {self.num_ranks} ranks, "
            f"R = {self.num_replicates}"
        ]
        for name, row, s, p in zip(
            self.names, self.counts, self.statistic, self.p_value, strict=True
        ):
            lines.append(
                f"  {name:<14} χ² = {s:6.2f} (dof {self.dof}), p = {p:.3f}   counts "
                + " ".join(str(int(c)) for c in row)
            )
        return "\n".join(lines)


def rank_test(ranks, num_ranks: int, bins: int = 10, names=None) -> RankTest:
    """Pearson's chi-square test of uniformity of integer ranks in ``0, ..., num_ranks - 1``.

    :param ranks: ``(R, d)`` ranks (``NaN`` rows are dropped per parameter).
    :param int num_ranks: the number of possible ranks; ``bins`` must divide it, so that every
        bin holds as many ranks and has the same expected count ``R/bins`` (keep it at least 5).
    :param int bins: equal-width bins of the ranks.
    :param names: parameter labels (default ``0, 1, ...``).
    :return: a :class:`RankTest`.
    """
    ranks = np.asarray(ranks, np.float64)
    if ranks.ndim == 1:
        ranks = ranks[:, None]
    if num_ranks % bins:
        raise ValueError(f"bins={bins} must divide num_ranks={num_ranks} (equal bins).")
    d = ranks.shape[1]
    names = tuple(str(i) for i in range(d)) if names is None else tuple(names)
    counts = np.zeros((d, bins), np.int64)
    statistic, p_value = np.full(d, np.nan), np.full(d, np.nan)
    valid = np.isfinite(ranks)
    for i in range(d):
        r = ranks[valid[:, i], i]
        counts[i] = np.bincount((r // (num_ranks // bins)).astype(int), minlength=bins)
        if len(r):
            expected = len(r) / bins
            statistic[i] = np.sum((counts[i] - expected) ** 2) / expected
            p_value[i] = stats.chi2.sf(statistic[i], bins - 1)
    return RankTest(
        names, counts, statistic, bins - 1, p_value, int(num_ranks), int(valid.any(1).sum())
    )
