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

* the **intervals**: equal-tailed intervals of the *constrained* draws (their quantiles) at
  each nominal level. Quantiles commute with the elementwise monotone transforms of
  constrained sites (``exp``, ``sigmoid``, affine), so for those sites the coverage is the
  same as that of the unconstrained draws' intervals; only the widths depend on the scale;
* whether each interval **covers** the true value, hence the coverage of every level with its
  binomial standard error ``sqrt(p(1 - p)/R)``;
* the **rank** of the true value among ``num_ranks - 1`` draws thinned to near independence
  (spaced ``≈ ess/num_ranks`` autocorrelation times apart). When the true value is drawn from
  the prior and the data from the model (:func:`prior_simulator`), the posterior's ranks are
  uniform: simulation-based calibration (Talts, Betancourt, Simpson, Vehtari & Gelman 2018,
  *Validating Bayesian inference algorithms with simulation-based calibration*). At a fixed
  true value the local fiducial target's ranks are uniform when it is calibrated at every
  level (the rank is a confidence distribution's probability integral transform);
* the **Table 1 prediction** of each coverage: the chain's draws are ``N(θ̂, Σ)`` with ``Σ``
  the report's predicted covariance, and the mode ``θ̂`` is spread ``N(θ*, S/n)`` over data
  sets (the sandwich of ``docs/theory.md`` §1), so a level-``l`` interval of coordinate ``i``
  covers with probability ``2Φ(z_l ρ_i) - 1``, ``ρ_i² = Σ_ii / (S_ii/n)`` (mapped to the
  constrained coordinates by the delta method). For the sandwich ``ρ = 1``; for the posterior
  ``ρ² = (J⁻¹)_ii / S_ii``; for the bagged posterior at ``w = 1``, ``ρ² = 1 + (J⁻¹)_ii / S_ii``:
  it over-covers by design, up to 99.4% at nominal 95% for a well-specified model.

A replicate whose simulation, tuning, run or reference raises is a failure, kept with its
message (:attr:`Calibration.failures`) and left out of that method's coverage; warnings
(divergences, a mode not reached) are kept too and the replicate counted. With
``check=True`` every target's run also goes through :func:`~numpyro_sgmc.check_run`, the
last step of the recipe, and whether it passed is kept (:attr:`Calibration.checked`).

The *true value* of a misspecified model is the pseudo-true parameter, the minimiser of the
Kullback–Leibler divergence from the data-generating process (the limit of the mode as ``n``
grows): the user's process defines it, and the user supplies it.

References (the classical or sandwich standard errors of a maximum-likelihood fit, a
bootstrap, NUTS) are callables returning draws or distributions; they are summarised the
same way, on the same data sets. The plots (:func:`plot_coverage`, :func:`plot_ranks`,
:func:`plot_widths`) need matplotlib, imported when first called.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Callable, NamedTuple, Optional

import jax
import numpy as np
from jax import random
from numpyro import handlers
from scipy import stats
from tqdm.auto import tqdm

from numpyro_sgmc.data.model import Layout
from numpyro_sgmc.data.subsample import full_data
from numpyro_sgmc.running.runner import run_kernel
from numpyro_sgmc.tuner.check import check_run
from numpyro_sgmc.tuner.tuning import autotune

__all__ = [
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

LEVELS = (0.5, 0.8, 0.95)
DEFAULT_TARGETS = ("posterior", "bagged", "local_fiducial")
_EARLY_STOP = 5  # first replicates on which a method failed without ever running: set-up


class Failure(NamedTuple):
    """A replicate that raised (or warned).

    :param str method: a target's label, a reference's name, or ``"simulate"``.
    :param int seed: the replicate's seed: ``simulate(seed)`` rebuilds its data.
    :param str message: the exception's or warning's class name and message.
    """

    method: str
    seed: int
    message: str


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


class Calibration(NamedTuple):
    """What :func:`calibrate` measured, per method (targets first, then references),
    replicate and parameter (``docs/theory.md``, "Which target when"). Arrays carry ``NaN``
    where a method did not run or failed.

    :param tuple methods: the methods' labels, ``M`` of them.
    :param tuple names: ``site`` or ``site[i]`` of each of the ``d`` parameters checked (the
        true value's sites, sorted by name, raveled row-major).
    :param tuple levels: the nominal levels, ``L`` of them.
    :param seeds: ``(R,)`` the replicates' seeds.
    :param truth: ``(R, d)`` the true value of each replicate.
    :param lower: ``(M, R, L, d)`` lower interval ends (constrained values).
    :param upper: ``(M, R, L, d)`` upper interval ends.
    :param ranks: ``(M, R, d)`` rank of the true value among the ``num_ranks - 1`` thinned
        draws (for a distribution: ``⌊num_ranks · cdf(truth)⌋``).
    :param int num_ranks: possible ranks.
    :param predicted: ``(M, R, L, d)`` the Table 1 prediction of each interval's coverage
        probability (module docstring); ``NaN`` for references.
    :param rows: ``(M, R)`` the Table 1 row the tuner chose (``""`` for references and for
        replicates that did not run).
    :param seconds: ``(M, R)`` wall time of each replicate's tuning and run (or reference).
    :param tuple failures: :class:`Failure` s that raised; those replicates are left out.
    :param tuple warnings: :class:`Failure` s that only warned; those replicates are counted.
    :param checked: ``(M, R)`` with ``check=True``: 1 where
        :func:`~numpyro_sgmc.check_run` passed the run, 0 where it had findings (kept in
        :attr:`warnings` as ``RunCheckWarning`` s), ``NaN`` where it was not run (references,
        failures, ``check=False``); ``None`` when no replicate was checked.
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
        """``(M, R, L, d)`` 1 where the interval contains the true value, 0 where not, ``NaN``
        where the method did not run."""
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
        p = self.coverage
        return np.sqrt(p * (1 - p) / np.maximum(self.num_valid, 1)[:, None, None])

    @property
    def z_scores(self) -> np.ndarray:
        """``(M, L, d)`` (coverage - nominal) in binomial standard errors at the nominal level,
        ``sqrt(l(1 - l)/R)``: within ±2 is "within binomial error of nominal"."""
        levels = np.asarray(self.levels)[None, :, None]
        se = np.sqrt(levels * (1 - levels) / np.maximum(self.num_valid, 1)[:, None, None])
        return (self.coverage - levels) / se

    @property
    def width(self) -> np.ndarray:
        """``(M, L, d)`` mean interval width over the method's replicates."""
        return _nanmean(self.upper - self.lower, axis=1)

    @property
    def width_se(self) -> np.ndarray:
        """``(M, L, d)`` standard error of :attr:`width` (its spread over replicates)."""
        widths = self.upper - self.lower
        count = np.maximum(self.num_valid, 2)[:, None, None]
        centred = np.where(np.isfinite(widths), widths - _nanmean(widths, 1)[:, None], 0.0)
        return np.sqrt(np.sum(centred**2, axis=1) / (count - 1) / count)

    @property
    def predicted_coverage(self) -> np.ndarray:
        """``(M, L, d)`` the Table 1 prediction averaged over the replicates that ran."""
        return _nanmean(np.where(self.ran[:, :, None, None], self.predicted, np.nan), axis=1)

    def select(self, replicates) -> "Calibration":
        """The same measurements on some replicates only: a boolean mask or indices over
        :attr:`seeds` (e.g. those a NUTS reference ran on, to compare on the same data)."""
        idx = np.arange(len(self.seeds))[replicates]
        kept = set(int(s) for s in self.seeds[idx])
        return self._replace(
            seeds=self.seeds[idx],
            truth=self.truth[idx],
            lower=self.lower[:, idx],
            upper=self.upper[:, idx],
            ranks=self.ranks[:, idx],
            predicted=self.predicted[:, idx],
            rows=self.rows[:, idx],
            seconds=self.seconds[:, idx],
            failures=tuple(f for f in self.failures if f.seed in kept),
            warnings=tuple(f for f in self.warnings if f.seed in kept),
            checked=None if self.checked is None else self.checked[:, idx],
        )

    @property
    def check_passed(self) -> np.ndarray:
        """``(M,)`` fraction of each method's checked replicates that
        :func:`~numpyro_sgmc.check_run` passed (``NaN`` where none was checked)."""
        if self.checked is None:
            return np.full(len(self.methods), np.nan)
        return _nanmean(self.checked, axis=1)

    def sbc(self, method: str = "posterior", bins: int = 10) -> RankTest:
        """:func:`rank_test` of ``method``'s ranks: simulation-based calibration when the true
        values were drawn from the prior (:func:`prior_simulator`) and ``method`` is the
        posterior."""
        return rank_test(self.ranks[self._index(method)], self.num_ranks, bins, self.names)

    def _index(self, method: str) -> int:
        if method not in self.methods:
            raise ValueError(f"No method {method!r}; the methods are {self.methods}.")
        return self.methods.index(method)

    def table(self, level: Optional[float] = None) -> str:
        """The coverage table: per method and parameter, coverage ± binomial se, the Table 1
        prediction in brackets and the mean width, at ``level`` (default every level)."""
        levels = self.levels if level is None else (level,)
        coverage, se, pred, width = (
            self.coverage,
            self.coverage_se,
            self.predicted_coverage,
            self.width,
        )
        label = max(len(m) for m in self.methods)
        lines = []
        for lv in levels:
            k = self.levels.index(lv)
            lines.append(
                f"{100 * lv:g}% intervals: coverage ± binomial se [Table 1 prediction] mean width"
            )
            lines.append(
                " " * (label + 7)
                + "".join(f"{n:<30}" for n in self.names)
                + "   row, median s/replicate"
            )
            for m, method in enumerate(self.methods):
                cells = []
                for i in range(len(self.names)):
                    p = pred[m, k, i]
                    shown = f"[{p:.3f}]" if np.isfinite(p) else " " * 7
                    cells.append(
                        f"{coverage[m, k, i]:.3f}±{se[m, k, i]:.3f} {shown} {width[m, k, i]:<9.4g}"
                    )
                passed = self.check_passed[m]
                lines.append(
                    f"{method:<{label}} R={self.num_valid[m]:<4d}"
                    + "".join(f"{c:<30}" for c in cells)
                    + f"   {_rows(self.rows[m])}, {_median(self.seconds[m]):.2f}"
                    + (f", check_run passed {100 * passed:.0f}%" if np.isfinite(passed) else "")
                )
            lines.append("")
        return "\n".join(lines).rstrip()

    def __str__(self) -> str:
        lines = [self.table()]
        for kind, found in (("failed", self.failures), ("warned", self.warnings)):
            if found:
                lines.append(f"{len(found)} replicate runs {kind}:")
                lines.extend(f"  {f.method}, seed {f.seed}: {f.message}" for f in found[:10])
                if len(found) > 10:
                    lines.append(f"  ... and {len(found) - 10} more")
        return "\n".join(lines)


def _rows(rows) -> str:
    names, counts = np.unique([r for r in rows if r], return_counts=True)
    if not len(names):
        return "-"
    return ", ".join(
        f"{n}" if len(names) == 1 else f"{n}×{c}" for n, c in zip(names, counts, strict=True)
    )


def _median(x) -> float:
    x = np.asarray(x)[np.isfinite(x)]
    return float(np.median(x)) if len(x) else math.nan


def _nanmean(x, axis):
    count = np.sum(np.isfinite(x), axis=axis)
    total = np.sum(np.where(np.isfinite(x), x, 0.0), axis=axis)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _label(spec) -> str:
    if isinstance(spec, str):
        return spec
    extras = [f"{k}={spec[k]}" for k in ("weight", "weights") if k in spec]
    return spec["target"] + (f" ({', '.join(extras)})" if extras else "")


def _target_options(targets) -> list:
    options = []
    for spec in targets:
        if isinstance(spec, str):
            options.append((spec, {"target": spec}))
        elif isinstance(spec, dict) and "target" in spec:
            options.append((_label(spec), dict(spec)))
        else:
            raise TypeError(
                "Each target is a name ('posterior', 'bagged', 'local_fiducial', 'sandwich', "
                "'mix') or a dict of autotune keyword arguments with a 'target' key, e.g. "
                f"{{'target': 'mix', 'weights': (0.5, 0.5)}}; got {spec!r}."
            )
    return options


def _ravel_truth(sites: Layout, truth: dict) -> np.ndarray:
    """The true value as one flat float64 vector in ``sites``' order."""
    if set(truth) != {s[0] for s in sites.sites}:
        raise ValueError(
            f"The true value's sites changed between replicates: {sorted(truth)} against "
            f"{[s[0] for s in sites.sites]}."
        )
    return np.concatenate(
        [np.asarray(truth[name], np.float64).reshape(-1) for name, *_ in sites.sites]
    )


def _summary(values: dict, sites: Layout, truth, levels, num_ranks, method):
    """Interval ends ``(L, d)`` and ranks ``(d,)`` of one method on one replicate; ``values``
    maps each site to draws (leading sample axis) or a distribution with ``ppf`` and
    ``cdf``."""
    lower, upper, ranks = [], [], []
    tails = np.array([(1 - lv) / 2 for lv in levels])
    for name, start, stop, shape in sites.sites:
        if name not in values:
            raise ValueError(
                f"{method}: site {name!r} of the true value is not among its draws "
                f"({sorted(values)}); the true value names sites of the model."
            )
        value, t = values[name], truth[start:stop]
        if hasattr(value, "ppf") and hasattr(value, "cdf"):
            lo = np.stack([np.reshape(value.ppf(q), -1) for q in tails])
            hi = np.stack([np.reshape(value.ppf(1 - q), -1) for q in tails])
            u = np.reshape(value.cdf(np.reshape(t, shape)), -1)
            rank = np.minimum(np.floor(num_ranks * u), num_ranks - 1)
        else:
            x = np.asarray(value, np.float64)
            x = x.reshape(x.shape[0], -1)
            if x.shape[1] != stop - start:
                raise ValueError(
                    f"{method}: site {name!r} has draws of shape {np.shape(value)[1:]}, the "
                    f"true value {shape}."
                )
            lo = np.quantile(x, tails, axis=0)
            hi = np.quantile(x, 1 - tails, axis=0)
            thinned = x[np.linspace(0, x.shape[0] - 1, num_ranks - 1).round().astype(int)]
            rank = np.sum(thinned < t, axis=0)
        lower.append(lo)
        upper.append(hi)
        ranks.append(rank)
    return np.concatenate(lower, 1), np.concatenate(upper, 1), np.concatenate(ranks)


def _block(scale, start, stop) -> np.ndarray:
    """The ``[start:stop, start:stop]`` block of a scale over the unconstrained vector."""
    if hasattr(scale, "matrix"):
        return np.asarray(scale.matrix, np.float64)[start:stop, start:stop]
    return np.diag(np.asarray(scale.diagonal(stop), np.float64)[start:stop])


def _predicted_ratio(report, sites: Layout) -> np.ndarray:
    """``(d,)`` ``ρ_i``: the chain's predicted sd over the mode's sampling sd ``sqrt(S_ii/n)``
    in the constrained coordinates of the true value's sites (delta method at the mode);
    ``NaN`` for sites that are not latent sample sites of the report."""
    n = report.num_data
    layout = {name: (start, stop, shape) for name, start, stop, shape in report.layout.sites}
    sandwich = report.information.sandwich
    ratio = np.full(sites.size, np.nan)
    for name, start, stop, _ in sites.sites:
        if name not in layout or name not in report.transforms:
            continue
        u0, u1, ushape = layout[name]
        transform = report.transforms[name]
        z = np.asarray(report.mode[name], np.float64).reshape(-1)

        def flat(u, transform=transform, ushape=ushape):
            return jax.numpy.reshape(transform(jax.numpy.reshape(u, ushape)), -1)

        G = np.asarray(jax.jacobian(flat)(z), np.float64).reshape(stop - start, u1 - u0)
        chain = np.einsum("ij,jk,ik->i", G, _block(report.covariance, u0, u1), G)
        estimator = np.einsum("ij,jk,ik->i", G, _block(sandwich, u0, u1), G) / n
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio[start:stop] = np.sqrt(chain / estimator)
    return ratio


def _caught(caught) -> list:
    return [f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught]


def calibrate(
    model: Callable,
    simulate: Callable,
    truth: Optional[dict],
    rng_key,
    *,
    targets=DEFAULT_TARGETS,
    num_replicates: int = 200,
    references: Optional[dict] = None,
    levels=LEVELS,
    ess: float = 1000,
    num_ranks: int = 100,
    autotune_kwargs: Optional[dict] = None,
    model_kwargs: Optional[dict] = None,
    check: bool = False,
    first_seed: int = 0,
    progress: bool = True,
) -> Calibration:
    """Coverage, widths and ranks of every target's intervals over ``num_replicates``
    simulated data sets (module docstring; ``docs/theory.md``, "Which target when").

    Replicate seed ``r = 0, ..., R - 1`` (plus ``first_seed``) simulates ``simulate(r)``, then
    for each target runs ``autotune(model, key, *data, **target)`` and
    ``run_kernel(kernel, key, *data, num_samples=report.draws_for(ess),
    num_warmup=report.draws_for(10))``, with keys folded from ``rng_key`` and ``r``; each
    reference is called on the same data. Replicates run one after another (each data set
    gets its own tuning, which is not one vectorisable computation); data sets of one shape
    share every compiled function, so after the first replicate each costs about a second per
    target for a small model. Chunks of seeds (``first_seed``) run in parallel processes and
    :func:`concatenate` joins them. A bar shows the replicates done and the failures so far.

    **Example** (the over-dispersed counts of the calibration page, at a smaller size)::

        import jax
        import jax.numpy as jnp
        import numpy as np
        import numpyro
        import numpyro.distributions as dist
        from numpyro_sgmc import calibration

        def model(X, y=None):
            theta = numpyro.sample("theta", dist.Normal(0, 10).expand([2]).to_event(1))
            with numpyro.plate("data", X.shape[0], subsample_size=100):
                Xb = numpyro.subsample(X, event_dim=1)
                yb = None if y is None else numpyro.subsample(y, event_dim=0)
                numpyro.sample("y", dist.Poisson(jnp.exp(Xb @ theta)), obs=yb)

        def simulate(seed):  # negative binomial counts: the Poisson likelihood is misspecified
            rng = np.random.default_rng(seed)
            X = np.column_stack([np.ones(2000), rng.standard_normal(2000)])
            mean = np.exp(X @ np.array([0.5, 0.3]))
            y = rng.negative_binomial(0.7, 0.7 / (0.7 + mean))
            return jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32)

        result = calibration.calibrate(
            model, simulate, {"theta": np.array([0.5, 0.3])}, jax.random.key(0),
            targets=("posterior", "local_fiducial"), num_replicates=4, progress=False,
        )
        print(result)  # coverage ± se [predicted], widths, rows, failures

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param simulate: ``simulate(seed) -> data``, the positional arguments of ``model`` for one
        data set, from the user's data-generating process (which need not be the model); with
        ``truth=None``, ``simulate(seed) -> (truth, data)`` (e.g. :func:`prior_simulator`).
    :param dict truth: site -> true (constrained) value; for a misspecified model the
        pseudo-true parameter (module docstring). Its sites are the parameters checked (any
        site in the draws, deterministic sites included).
    :param rng_key: PRNG key of the tunings, runs and references.
    :param targets: target names, or dicts of :func:`~numpyro_sgmc.autotune` keyword
        arguments with a ``"target"`` key (``{"target": "mix", "weights": (0.5, 0.5)}``).
    :param int num_replicates: ``R``.
    :param dict references: name -> ``fn(key, *data)`` returning site -> draws (leading sample
        axis) or a distribution with vectorised ``ppf`` and ``cdf`` (a frozen
        ``scipy.stats`` distribution, e.g. ``norm(mle, se)`` for a Wald interval); or name ->
        ``(fn, seeds)`` to run it on those replicates only (an expensive reference, e.g.
        NUTS, on a subset).
    :param levels: nominal levels of the equal-tailed intervals.
    :param float ess: effective draws per run (``report.draws_for(ess)`` draws).
    :param int num_ranks: ranks are counted among ``num_ranks - 1`` thinned draws; at most
        ``ess``, so that they are near-independent.
    :param dict autotune_kwargs: passed to every ``autotune`` call (a target's own dict wins).
    :param dict model_kwargs: the model's keyword arguments.
    :param bool check: run :func:`~numpyro_sgmc.check_run` on every target's run (the rest of
        the recipe; about the cost of the tuner's information step more per run) and record
        whether it passed (:attr:`Calibration.checked`): do the replicates it flags miss
        more often?
    :param int first_seed: the replicates' seeds are ``first_seed, ..., first_seed + R - 1``:
        chunks of one calibration run in separate processes or machines (each with the same
        ``rng_key``) and :func:`concatenate` joins them.
    :param bool progress: show the progress bar.
    :return: a :class:`Calibration`.
    """
    options = _target_options(targets)
    references = {
        name: (ref, None) if callable(ref) else (ref[0], {int(k) for k in ref[1]})
        for name, ref in (references or {}).items()
    }
    methods = tuple(label for label, _ in options) + tuple(references)
    if len(set(methods)) != len(methods):
        raise ValueError(f"Method labels must be distinct, got {methods}.")
    if not methods:
        raise ValueError("Nothing to calibrate: give at least one target or reference.")
    if not (isinstance(num_replicates, (int, np.integer)) and num_replicates >= 1):
        raise ValueError(f"num_replicates must be a positive int, got {num_replicates!r}.")
    levels = tuple(float(lv) for lv in levels)
    if not all(0 < lv < 1 for lv in levels):
        raise ValueError(f"Levels must be in (0, 1), got {levels}.")
    if not 2 <= num_ranks <= ess:
        raise ValueError(
            f"num_ranks={num_ranks} must be at least 2 and at most ess={ess}, so that the "
            "thinned draws are near-independent."
        )
    autotune_kwargs = dict(autotune_kwargs or {})
    model_kwargs = dict(model_kwargs or {})
    M, R, L = len(methods), int(num_replicates), len(levels)

    sites, arrays = None, None
    failures, warned = [], []
    seeds = int(first_seed) + np.arange(R)
    rows = np.full((M, R), "", dtype=object)
    seconds = np.full((M, R), np.nan)
    checked = np.full((M, R), np.nan)
    never_ran = np.zeros(M, int)  # failures of each method before its first success

    bar = tqdm(seeds.tolist(), desc="calibration", unit="replicate", disable=not progress)
    for r, seed in enumerate(bar):
        key = random.fold_in(rng_key, seed)
        try:
            data = simulate(seed)
            if truth is None:
                truth_r, data = data
            else:
                truth_r = truth
            data = tuple(data)
        except Exception as error:  # noqa: BLE001 - a failed replicate is a finding, kept
            failures.append(Failure("simulate", seed, f"{type(error).__name__}: {error}"))
            never_ran[never_ran >= 0] += 1
            _early_stop(never_ran, ("simulate",) * M, failures)
            bar.set_postfix(failed=len(failures))
            continue
        if sites is None:
            sites = Layout.of(truth_r)
            d = sites.size
            arrays = {
                "truth": np.full((R, d), np.nan),
                "lower": np.full((M, R, L, d), np.nan),
                "upper": np.full((M, R, L, d), np.nan),
                "ranks": np.full((M, R, d), np.nan),
                "predicted": np.full((M, R, L, d), np.nan),
            }
        true_flat = _ravel_truth(sites, truth_r)
        arrays["truth"][r] = true_flat
        for m, method in enumerate(methods):
            if m >= len(options) and not _runs_on(references[method][1], seed):
                continue
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    if m < len(options):
                        values, report, passed = _run_target(
                            model, random.fold_in(key, m), data, ess, model_kwargs,
                            {**autotune_kwargs, **options[m][1]}, check,
                        )  # fmt: skip
                        checked[m, r] = passed
                    else:
                        values = references[method][0](random.fold_in(key, m), *data)
                        report = None
                except Exception as error:  # noqa: BLE001 - kept as a failure
                    failures.append(Failure(method, seed, f"{type(error).__name__}: {error}"))
                    never_ran[m] += never_ran[m] >= 0
                    values = None
            warned.extend(Failure(method, seed, message) for message in _caught(caught))
            if values is None:  # it raised
                continue
            lower, upper, ranks = _summary(values, sites, true_flat, levels, num_ranks, method)
            arrays["lower"][m, r], arrays["upper"][m, r] = lower, upper
            arrays["ranks"][m, r] = ranks
            seconds[m, r] = time.perf_counter() - start
            never_ran[m] = -1
            if report is not None:
                rows[m, r] = report.row
                z = stats.norm.ppf(0.5 + np.asarray(levels) / 2)[:, None]
                ratio = _predicted_ratio(report, sites)[None, :]
                arrays["predicted"][m, r] = 2 * stats.norm.cdf(z * ratio) - 1
        _early_stop(never_ran, methods, failures)
        bar.set_postfix(failed=len(failures))
    bar.close()
    if sites is None:
        raise RuntimeError("Every simulation failed: " + "; ".join(f.message for f in failures))
    return Calibration(
        methods,
        tuple(sites.names()),
        levels,
        seeds,
        arrays["truth"],
        arrays["lower"],
        arrays["upper"],
        arrays["ranks"],
        int(num_ranks),
        arrays["predicted"],
        rows,
        seconds,
        tuple(failures),
        tuple(warned),
        checked if check else None,
    )


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
    by_replicate = ("lower", "upper", "ranks", "predicted", "rows", "seconds")
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
        **{k: np.concatenate([getattr(r, k) for r in results], axis=1) for k in by_replicate},
        failures=sum((tuple(r.failures) for r in results), ()),
        warnings=sum((tuple(r.warnings) for r in results), ()),
        checked=checked,
    )


def _runs_on(seeds, seed: int) -> bool:
    return seeds is None or seed in seeds


def _early_stop(never_ran, methods, failures: list) -> None:
    """Raise when a method failed on its first ``_EARLY_STOP`` replicates: a set-up error."""
    stuck = [m for m, count in enumerate(never_ran) if count >= _EARLY_STOP]
    if stuck:
        method = methods[stuck[0]]
        messages = sorted({f.message for f in failures if f.method == method})
        raise RuntimeError(
            f"{method!r} failed on its first {_EARLY_STOP} replicates without running once; "
            "this looks like a set-up error, not the data: " + " | ".join(messages)
        )


def _run_target(model, key, data, ess, model_kwargs, options, check):
    """``autotune``, ``run_kernel`` and, with ``check``, ``check_run``: the draws, the report
    and whether the check passed (``NaN`` unchecked)."""
    key_tune, key_run = random.split(key)
    kernel, report = autotune(model, key_tune, *data, model_kwargs=model_kwargs, **options)
    run = run_kernel(
        kernel,
        key_run,
        *data,
        num_samples=report.draws_for(ess),
        num_warmup=report.draws_for(10),
        model_kwargs=model_kwargs,
    )
    passed = math.nan
    if check:
        passed = float(check_run(run, report, print_table=False).passed)
    return run.get_samples(), report, passed


def prior_simulator(
    model: Callable,
    covariates: Callable,
    rng_key,
    *,
    observed: str,
    model_kwargs: Optional[dict] = None,
) -> Callable:
    """A ``simulate`` for :func:`calibrate` with ``truth=None``: simulation-based calibration.

    ``simulate(seed)`` takes ``covariates(seed)`` (the model's positional arguments before the
    observation), draws every latent site from the prior and the site ``observed`` from the
    model on all rows (:class:`~numpyro_sgmc.data.subsample.full_data`), with the key
    ``fold_in(rng_key, seed)``, and returns ``(truth, covariates + (y,))``: the observation
    is appended as the last positional argument, as in ``model(X, y=None)``.

    :param model: the NumPyro model.
    :param covariates: ``covariates(seed) -> tuple`` of the arguments before the observation.
    :param rng_key: PRNG key of the prior draws.
    :param str observed: the name of the observed sample site.
    :param dict model_kwargs: the model's keyword arguments.
    :return: ``simulate(seed) -> (truth, data)``.
    """
    model_kwargs = dict(model_kwargs or {})

    def simulate(seed: int):
        args = tuple(covariates(seed))
        seeded = handlers.seed(full_data(model), random.fold_in(rng_key, seed))
        trace = handlers.trace(seeded).get_trace(*args, **model_kwargs)
        if observed not in trace:
            raise ValueError(f"The model has no site {observed!r}; its sites: {list(trace)}.")
        truth = {
            name: np.asarray(site["value"])
            for name, site in trace.items()
            if site["type"] == "sample" and not site["is_observed"] and name != observed
        }
        return truth, args + (trace[observed]["value"],)

    return simulate


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "The calibration plots need matplotlib: pip install matplotlib (or the package's "
            "'examples' extra: pip install 'numpyro-sgmc[examples]')."
        ) from error
    return plt


def _methods(calibration: Calibration, methods) -> list:
    methods = calibration.methods if methods is None else tuple(methods)
    return [calibration._index(m) for m in methods]


def plot_coverage(calibration: Calibration, methods=None, ncols: int = 4, title=None):
    """Coverage against nominal, one panel per parameter: for each nominal level, each
    method's coverage minus the nominal level in percentage points, with error bars of two
    binomial standard errors, over a grey band ``± 2 sqrt(l(1 - l)/R)`` in which a calibrated
    method's coverage falls 95% of the time. Targets are dots, references squares.

    :param calibration: a :class:`Calibration`.
    :param methods: the methods to show (default all).
    :param int ncols: panels per row.
    :param str title: the figure's title.
    :return: the matplotlib ``Figure``.
    """
    plt = _pyplot()
    index = _methods(calibration, methods)
    d = len(calibration.names)
    ncols = min(ncols, d)
    nrows = math.ceil(d / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.0 * ncols, 2.9 * nrows + 0.5), squeeze=False, sharey=True
    )
    levels = np.asarray(calibration.levels)
    R = np.max(calibration.num_valid[index])
    band = 200 * np.sqrt(levels * (1 - levels) / max(R, 1))
    x = np.arange(len(levels))
    offsets = np.linspace(-0.33, 0.33, len(index)) if len(index) > 1 else [0.0]
    for i, ax in enumerate(axes.flat):
        if i >= d:
            ax.set_visible(False)
            continue
        ax.bar(x, 2 * band, bottom=-band, width=0.84, color="0.88", label="±2 se at nominal")
        ax.axhline(0.0, color="0.4", lw=0.8)
        for k, m in enumerate(index):
            target = any(calibration.rows[m])
            ax.errorbar(
                x + offsets[k],
                100 * (calibration.coverage[m, :, i] - levels),
                yerr=200 * calibration.coverage_se[m, :, i],
                fmt="o" if target else "s",
                mfc=None if target else "white",
                ms=4,
                capsize=2,
                color=f"C{k % 10}",
                label=calibration.methods[m],
            )
        ax.set_title(calibration.names[i], fontsize=10)
        ax.set_xticks(x, [f"{100 * lv:g}%" for lv in levels])
        ax.set_xlabel("nominal level")
        if i % ncols == 0:
            ax.set_ylabel("coverage − nominal (points)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    rows = math.ceil(len(labels) / 5)
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 * rows / nrows + 0.02, 1, 1))
    return fig


def plot_ranks(calibration: Calibration, method: str = "posterior", bins: int = 10, ncols=4):
    """Histograms of ``method``'s ranks, one panel per parameter, with the expected count
    ``R/bins`` and its 99% binomial band (SBC, Talts et al. 2018); the chi-square p-value of
    :meth:`Calibration.sbc` in each title.

    :param calibration: a :class:`Calibration`.
    :param str method: the method whose ranks to show.
    :param int bins: bins of the ranks (must divide ``num_ranks``).
    :param int ncols: panels per row.
    :return: the matplotlib ``Figure``.
    """
    plt = _pyplot()
    test = calibration.sbc(method, bins)
    d = len(test.names)
    ncols = min(ncols, d)
    nrows = math.ceil(d / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.8 * nrows), squeeze=False)
    R = test.num_replicates
    lo, hi = stats.binom.ppf([0.005, 0.995], R, 1 / bins)
    for i, ax in enumerate(axes.flat):
        if i >= d:
            ax.set_visible(False)
            continue
        ax.axhspan(lo, hi, color="0.85")
        ax.axhline(R / bins, color="0.4", lw=0.8)
        ax.bar(np.arange(bins), test.counts[i], width=0.9, color="C0")
        ax.set_title(f"{test.names[i]}  (p = {test.p_value[i]:.2f})", fontsize=10)
        ax.set_xticks([])
        ax.set_xlabel(f"rank bin ({calibration.num_ranks} ranks)")
    fig.suptitle(f"{method}: ranks of the true value, R = {R}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_widths(calibration: Calibration, level: float = 0.95, methods=None, relative_to=None):
    """Mean interval width at ``level`` per parameter and method (bars with two standard
    errors), absolute or divided by method ``relative_to``'s.

    :param calibration: a :class:`Calibration`.
    :param float level: one of the calibration's levels.
    :param methods: the methods to show (default all).
    :param str relative_to: a method to divide by (default: absolute widths).
    :return: the matplotlib ``Figure``.
    """
    plt = _pyplot()
    index = _methods(calibration, methods)
    k = calibration.levels.index(level)
    width, se = calibration.width[:, k], calibration.width_se[:, k]
    ylabel = f"mean {100 * level:g}% interval width"
    if relative_to is not None:
        base = width[calibration._index(relative_to)]
        width, se = width / base, se / base
        ylabel += f" / {relative_to}'s"
    d = len(calibration.names)
    fig, ax = plt.subplots(figsize=(min(12.0, 2.0 + 0.3 * d * len(index)), 3.2))
    step = 0.8 / len(index)
    for j, m in enumerate(index):
        ax.bar(
            np.arange(d) + (j - (len(index) - 1) / 2) * step,
            width[m],
            width=step,
            yerr=2 * se[m],
            capsize=2,
            label=calibration.methods[m],
        )
    if relative_to is not None:
        ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xticks(np.arange(d))
    ax.set_xticklabels(calibration.names)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
