"""The measurements of a calibration and their coverage statistics.

A :class:`Calibration` holds, per method (targets first, then references), replicate and
parameter, the interval ends at every nominal level, the rank of the true value and the
Table 1 prediction of each interval's coverage, with the replicates that failed or warned
(:class:`Failure`). Its properties are the statistics of ``docs/calibration.md``: the
coverage of each level with its binomial standard error ``sqrt(p(1 - p)/R)``, the z-score of
the coverage against the nominal level, the mean width with its standard error and the
averaged prediction. :func:`concatenate` joins calibrations run on disjoint seeds.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from numpyro_sgmc.calibration import report
from numpyro_sgmc.calibration.sbc import RankTest, rank_test

__all__ = ["Calibration", "Failure", "concatenate"]

# the fields with a replicate axis after the method axis: (M, R, ...)
_BY_REPLICATE = ("lower", "upper", "ranks", "predicted", "rows", "seconds")


class Failure(NamedTuple):
    """A replicate that raised (or warned).

    :param str method: a target's label, a reference's name, or ``"simulate"``.
    :param int seed: the replicate's seed: ``simulate(seed)`` rebuilds its data.
    :param str message: the exception's or warning's class name and message.
    """

    method: str
    seed: int
    message: str


class Calibration(NamedTuple):
    """What :func:`~numpyro_sgmc.calibration.replicates.calibrate` measured, per method
    (targets, then references), replicate and parameter; ``NaN`` where a method did not run.

    :param tuple methods: the methods' labels, ``M`` of them.
    :param tuple names: ``site[i]`` of the ``d`` parameters checked (the true value's sites,
        sorted by name, raveled row-major).
    :param tuple levels: the nominal levels, ``L`` of them.
    :param seeds: ``(R,)`` the replicates' seeds.
    :param truth: ``(R, d)`` the true value of each replicate.
    :param lower: ``(M, R, L, d)`` lower interval ends (constrained values).
    :param upper: ``(M, R, L, d)`` upper interval ends.
    :param ranks: ``(M, R, d)`` rank of the true value among ``num_ranks - 1`` thinned draws.
    :param int num_ranks: possible ranks.
    :param predicted: ``(M, R, L, d)`` the Table 1 prediction of each coverage (``NaN``: none).
    :param rows: ``(M, R)`` the Table 1 row the tuner chose (``""`` where none).
    :param seconds: ``(M, R)`` wall time of each replicate's tuning and run (or reference).
    :param tuple failures: :class:`Failure` s that raised; those replicates are left out.
    :param tuple warnings: :class:`Failure` s that only warned; those replicates are counted.
    :param checked: ``(M, R)`` 1 where :func:`~numpyro_sgmc.check_run` passed the run, 0
        where it had findings, ``NaN`` where not run; ``None`` unless ``check=True``.
    """

    methods: tuple
    names: tuple
    levels: tuple
    seeds: np.ndarray
    truth: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    ranks: np.ndarray
    num_ranks: int
    predicted: np.ndarray
    rows: np.ndarray
    seconds: np.ndarray
    failures: tuple = ()
    warnings: tuple = ()
    checked: Optional[np.ndarray] = None

    @property
    def ran(self) -> np.ndarray:
        """``(M, R)`` bool: the method produced intervals on that replicate."""
        return np.all(np.isfinite(self.lower), axis=(2, 3))

    @property
    def num_valid(self) -> np.ndarray:
        """``(M,)`` replicates each method's coverage counts."""
        return self.ran.sum(axis=1)

    @property
    def covered(self) -> np.ndarray:
        """``(M, R, L, d)`` 1 where the interval holds the true value, 0 where not (or ``NaN``)."""
        truth = self.truth[None, :, None, :]
        inside = ((self.lower <= truth) & (truth <= self.upper)).astype(np.float64)
        return np.where(self.ran[:, :, None, None], inside, np.nan)

    @property
    def coverage(self) -> np.ndarray:
        """``(M, L, d)`` fraction of the method's replicates whose interval covers."""
        return _nanmean(self.covered, axis=1)

    @property
    def coverage_se(self) -> np.ndarray:
        """``(M, L, d)`` binomial standard error ``sqrt(p(1 - p)/R)`` of :attr:`coverage`."""
        return _binomial_se(self.coverage, self.num_valid)

    @property
    def z_scores(self) -> np.ndarray:
        """``(M, L, d)`` (coverage - nominal) in binomial standard errors ``sqrt(l(1 - l)/R)``."""
        levels = np.asarray(self.levels)[None, :, None]
        return (self.coverage - levels) / _binomial_se(levels, self.num_valid)

    @property
    def width(self) -> np.ndarray:
        """``(M, L, d)`` mean interval width over the method's replicates."""
        return _nanmean(self.upper - self.lower, axis=1)

    @property
    def width_se(self) -> np.ndarray:
        """``(M, L, d)`` standard error of :attr:`width` (its spread over replicates)."""
        return _mean_se(self.upper - self.lower, self.num_valid)

    @property
    def predicted_coverage(self) -> np.ndarray:
        """``(M, L, d)`` the Table 1 prediction averaged over the replicates that ran."""
        return _nanmean(np.where(self.ran[:, :, None, None], self.predicted, np.nan), axis=1)

    @property
    def check_passed(self) -> np.ndarray:
        """``(M,)`` fraction of each method's checked replicates that
        :func:`~numpyro_sgmc.check_run` passed (``NaN`` where none was checked)."""
        none = np.full((len(self.methods), 1), np.nan)
        return _nanmean(none if self.checked is None else self.checked, axis=1)

    def select(self, replicates) -> "Calibration":
        """The same measurements on some replicates only: a boolean mask or indices over
        :attr:`seeds` (e.g. those a NUTS reference ran on, to compare on the same data)."""
        return _select(self, np.arange(len(self.seeds))[replicates])

    def sbc(self, method: str = "posterior", bins: int = 10) -> RankTest:
        """:func:`~numpyro_sgmc.calibration.sbc.rank_test` of ``method``'s ranks (SBC when
        the true values were drawn from the prior and ``method`` is the posterior)."""
        return rank_test(self.ranks[_index(self, method)], self.num_ranks, bins, self.names)

    def table(self, level: Optional[float] = None) -> str:
        """:func:`~numpyro_sgmc.calibration.report.table` at ``level`` (default every level)."""
        return report.table(self, level)

    def __str__(self) -> str:
        return report.summary(self)


def concatenate(results) -> Calibration:
    """One :class:`Calibration` of the replicates of several (chunks of one calibration, e.g.
    run with different ``first_seed`` in parallel): same methods, parameters, levels and
    ``num_ranks``; distinct seeds."""
    results = list(results)
    if not results:
        raise ValueError("Nothing to concatenate.")
    first = results[0]
    for other in results[1:]:
        for field in ("methods", "names", "levels", "num_ranks"):
            if getattr(other, field) != getattr(first, field):
                raise ValueError(
                    f"Calibrations with different {field} cannot be joined: "
                    f"{getattr(first, field)} and {getattr(other, field)}."
                )
    seeds = np.concatenate([r.seeds for r in results])
    if len(set(seeds.tolist())) != len(seeds):
        raise ValueError("The calibrations share seeds: they are not chunks of one.")
    checked = None
    if any(r.checked is not None for r in results):
        checked = np.concatenate(
            [
                np.full((len(first.methods), len(r.seeds)), np.nan)
                if r.checked is None
                else r.checked
                for r in results
            ],
            axis=1,
        )
    return first._replace(
        seeds=seeds,
        truth=np.concatenate([r.truth for r in results]),
        **{k: np.concatenate([getattr(r, k) for r in results], axis=1) for k in _BY_REPLICATE},
        failures=sum((tuple(r.failures) for r in results), ()),
        warnings=sum((tuple(r.warnings) for r in results), ()),
        checked=checked,
    )


def _select(calibration: Calibration, idx) -> Calibration:
    """:meth:`Calibration.select` of the replicates at the indices ``idx``."""
    c = calibration
    kept = set(int(s) for s in c.seeds[idx])
    return c._replace(
        seeds=c.seeds[idx],
        truth=c.truth[idx],
        **{k: getattr(c, k)[:, idx] for k in _BY_REPLICATE},
        failures=tuple(f for f in c.failures if f.seed in kept),
        warnings=tuple(f for f in c.warnings if f.seed in kept),
        checked=None if c.checked is None else c.checked[:, idx],
    )


def _index(calibration: Calibration, method: str) -> int:
    """The position of ``method`` among the calibration's methods."""
    if method not in calibration.methods:
        raise ValueError(f"No method {method!r}; the methods are {calibration.methods}.")
    return calibration.methods.index(method)


def _binomial_se(p, num_valid) -> np.ndarray:
    """``sqrt(p(1 - p)/R)`` per method, ``R`` its valid replicates (at least 1)."""
    return np.sqrt(p * (1 - p) / np.maximum(num_valid, 1)[:, None, None])


def _mean_se(x, num_valid) -> np.ndarray:
    """``(M, ...)`` standard error of the mean over replicates (axis 1) of ``x``."""
    count = np.maximum(num_valid, 2)[:, None, None]
    centred = np.where(np.isfinite(x), x - _nanmean(x, 1)[:, None], 0.0)
    return np.sqrt(np.sum(centred**2, axis=1) / (count - 1) / count)


def _nanmean(x, axis):
    count = np.sum(np.isfinite(x), axis=axis)
    total = np.sum(np.where(np.isfinite(x), x, 0.0), axis=axis)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)
