"""The replicates of a calibration: simulate, tune, run, summarise, keep what failed.

:func:`calibrate` runs, for replicate seed ``r = first_seed, ..., first_seed + R - 1``,
``simulate(r)`` (the user's data-generating process, or :func:`prior_simulator` for
simulation-based calibration), then for each target ``autotune(model, key, *data,
**target)`` and ``run_kernel(kernel, key, *data, num_samples=report.draws_for(ess),
num_warmup=report.draws_for(10))`` (with ``check=True`` also
:func:`~numpyro_sgmc.check_run`), with keys folded from ``rng_key`` and ``r``, and calls each
reference on the same data. Of every method's draws it keeps the equal-tailed intervals of
the *constrained* draws (their quantiles) at each nominal level, the rank of the true value
among ``num_ranks - 1`` draws thinned to near independence (spaced ``≈ ess/num_ranks``
autocorrelation times apart) and, for a target, the Table 1 prediction of each interval's
coverage (:mod:`~numpyro_sgmc.calibration.prediction`). Quantiles commute with the
elementwise monotone transforms of constrained sites (``exp``, ``sigmoid``, affine), so for
those sites the coverage is that of the unconstrained draws' intervals; only the widths depend
on the scale.

Replicates run one after another (each data set gets its own tuning, which is not one
vectorisable computation); data sets of one shape share every compiled function, so after the
first replicate each costs about a second per target for a small model. Chunks of seeds
(``first_seed``) run in parallel processes and
:func:`~numpyro_sgmc.calibration.coverage.concatenate` joins them. A replicate whose
simulation, tuning, run or reference raises is a failure, kept with its message and left out
of that method's coverage; warnings are kept and the replicate counted; a method that fails
on its first five replicates without running once stops the calibration (a set-up error, not
the data).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Callable, NamedTuple, Optional

import numpy as np
from jax import random
from numpyro import handlers
from tqdm.auto import tqdm

from numpyro_sgmc.calibration.coverage import Calibration, Failure
from numpyro_sgmc.calibration.prediction import predicted_coverage
from numpyro_sgmc.data.first_trace import failing_site
from numpyro_sgmc.data.model import Layout
from numpyro_sgmc.data.subsample import full_data
from numpyro_sgmc.running.runner import run_kernel
from numpyro_sgmc.tuner.check import check_run
from numpyro_sgmc.tuner.tuning import autotune

__all__ = ["DEFAULT_TARGETS", "LEVELS", "calibrate", "prior_simulator"]

LEVELS = (0.5, 0.8, 0.95)
DEFAULT_TARGETS = ("posterior", "bagged", "local_fiducial")
_EARLY_STOP = 5  # first replicates on which a method failed without ever running: set-up


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
    simulated data sets (module docstring; ``docs/theory.md``, "Which target when"). A bar
    shows the replicates done and the failures so far.

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
        pseudo-true parameter (:mod:`numpyro_sgmc.calibration`). Its sites are the parameters
        checked (any site in the draws, deterministic sites included).
    :param rng_key: PRNG key of the tunings, runs and references.
    :param targets: target names, or dicts of :func:`~numpyro_sgmc.autotune` keyword
        arguments with a ``"target"`` key (``{"target": "mix", "weights": (0.5, 0.5)}``).
    :param int num_replicates: ``R``.
    :param dict references: name -> ``fn(key, *data)`` returning site -> draws (leading sample
        axis) or a distribution with vectorised ``ppf`` and ``cdf`` (a frozen ``scipy.stats``
        distribution, e.g. ``norm(mle, se)`` for a Wald interval); or name -> ``(fn, seeds)``
        to run it on those replicates only (an expensive reference, e.g. NUTS, on a subset).
    :param levels: nominal levels of the equal-tailed intervals.
    :param float ess: effective draws per run (``report.draws_for(ess)`` draws).
    :param int num_ranks: ranks are counted among ``num_ranks - 1`` thinned draws; at most
        ``ess``, so that they are near-independent.
    :param dict autotune_kwargs: passed to every ``autotune`` call (a target's own dict wins).
    :param dict model_kwargs: the model's keyword arguments.
    :param bool check: run :func:`~numpyro_sgmc.check_run` on every target's run (about the
        cost of the tuner's information step more per run) and record whether it passed
        (:attr:`~numpyro_sgmc.calibration.coverage.Calibration.checked`).
    :param int first_seed: the replicates' seeds are ``first_seed, ..., first_seed + R - 1``:
        chunks of one calibration run in separate processes (each with the same ``rng_key``)
        and :func:`~numpyro_sgmc.calibration.coverage.concatenate` joins them.
    :param bool progress: show the progress bar.
    :return: a :class:`~numpyro_sgmc.calibration.coverage.Calibration`.
    """
    setup = _setup(
        model, targets, references, num_replicates, levels, ess, num_ranks, autotune_kwargs,
        model_kwargs, check,
    )  # fmt: skip
    seeds = int(first_seed) + np.arange(setup.num_replicates)
    log = _Log([], [], np.zeros(len(setup.labels), int))
    record = None
    bar = tqdm(seeds.tolist(), desc="calibration", unit="replicate", disable=not progress)
    for r, seed in enumerate(bar):
        record = _replicate(setup, record, log, r, seed, simulate, truth, rng_key)
        bar.set_postfix(failed=len(log.failures))
    bar.close()
    if record is None:
        raise RuntimeError("Every simulation failed: " + "; ".join(f.message for f in log.failures))
    return record.calibration(setup, seeds, log)


class _Setup(NamedTuple):
    """What every replicate runs: the model and its methods, targets first, then references."""

    model: Callable
    labels: tuple
    options: tuple  # autotune keyword arguments of each target (autotune_kwargs merged in)
    references: tuple  # (fn(key, *data), the seeds it runs on or None) of each reference
    num_replicates: int
    levels: tuple
    ess: float
    num_ranks: int
    model_kwargs: dict
    check: bool


class _Log(NamedTuple):
    """What went wrong so far: the failures and warnings, and per method the failures before
    its first success (``-1`` once it has run)."""

    failures: list
    warned: list
    never_ran: np.ndarray


class _Record(NamedTuple):
    """The arrays :func:`calibrate` fills replicate by replicate (``NaN`` until measured)."""

    sites: Layout
    truth: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    ranks: np.ndarray
    predicted: np.ndarray
    rows: np.ndarray
    seconds: np.ndarray
    checked: np.ndarray

    @classmethod
    def empty(cls, sites: Layout, M: int, R: int, L: int) -> "_Record":
        d = sites.size
        return cls(
            sites=sites,
            truth=np.full((R, d), np.nan),
            lower=np.full((M, R, L, d), np.nan),
            upper=np.full((M, R, L, d), np.nan),
            ranks=np.full((M, R, d), np.nan),
            predicted=np.full((M, R, L, d), np.nan),
            rows=np.full((M, R), "", dtype=object),
            seconds=np.full((M, R), np.nan),
            checked=np.full((M, R), np.nan),
        )

    def calibration(self, setup: _Setup, seeds, log: _Log) -> Calibration:
        fields = self._asdict()
        sites, checked = fields.pop("sites"), fields.pop("checked")
        return Calibration(
            methods=setup.labels,
            names=tuple(sites.names()),
            levels=setup.levels,
            seeds=seeds,
            num_ranks=int(setup.num_ranks),
            failures=tuple(log.failures),
            warnings=tuple(log.warned),
            checked=checked if setup.check else None,
            **fields,
        )


def _setup(
    model, targets, references, num_replicates, levels, ess, num_ranks, autotune_kwargs,
    model_kwargs, check,
) -> _Setup:  # fmt: skip
    """The methods and settings of :func:`calibrate`, checked."""
    options = _target_options(targets)
    references = {
        name: (ref, None) if callable(ref) else (ref[0], {int(k) for k in ref[1]})
        for name, ref in (references or {}).items()
    }
    labels = tuple(label for label, _ in options) + tuple(references)
    if len(set(labels)) != len(labels):
        raise ValueError(f"Method labels must be distinct, got {labels}.")
    if not labels:
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
    return _Setup(
        model, labels, tuple({**autotune_kwargs, **o} for _, o in options),
        tuple(references.values()), int(num_replicates), levels, ess, num_ranks,
        dict(model_kwargs or {}), bool(check),
    )  # fmt: skip


def _replicate(setup, record, log, r, seed, simulate, truth, rng_key):
    """Replicate ``r``: simulate its data, then run every method on them into ``record``
    (created on the first data set, whose true value fixes the parameters' layout)."""
    key = random.fold_in(rng_key, seed)
    try:
        data = simulate(seed)
        truth_r, data = data if truth is None else (truth, data)
        data = tuple(data)
    except Exception as error:  # noqa: BLE001 - a failed replicate is a finding, kept
        log.failures.append(Failure("simulate", seed, f"{type(error).__name__}: {error}"))
        log.never_ran[log.never_ran >= 0] += 1
        _early_stop(log.never_ran, ("simulate",) * len(setup.labels), log.failures)
        return record
    if record is None:
        M, L = len(setup.labels), len(setup.levels)
        record = _Record.empty(Layout.of(truth_r), M, setup.num_replicates, L)
    record.truth[r] = _ravel_truth(record.sites, truth_r)
    for m in range(len(setup.labels)):
        _measure(setup, record, log, m, r, seed, random.fold_in(key, m), data)
    _early_stop(log.never_ran, setup.labels, log.failures)
    return record


def _measure(setup: _Setup, record: _Record, log: _Log, m, r, seed, key, data) -> None:
    """Method ``m`` on replicate ``r``: its intervals, ranks, Table 1 prediction, row, time and
    check into ``record``; what it raised into ``log.failures`` (the replicate is then left
    out of its coverage), what it warned into ``log.warned`` (the replicate is counted)."""
    target, label = m < len(setup.options), setup.labels[m]
    if not target and not _runs_on(setup.references[m - len(setup.options)][1], seed):
        return
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if target:
                values, report, passed = _run_target(setup, key, data, setup.options[m])
            else:
                values, report = setup.references[m - len(setup.options)][0](key, *data), None
        except Exception as error:  # noqa: BLE001 - kept as a failure
            log.failures.append(Failure(label, seed, f"{type(error).__name__}: {error}"))
            log.never_ran[m] += log.never_ran[m] >= 0
            values = None
    log.warned.extend(Failure(label, seed, message) for message in _caught(caught))
    if values is None:  # it raised
        return
    lower, upper, ranks = _summary(
        values, record.sites, record.truth[r], setup.levels, setup.num_ranks, label
    )
    record.lower[m, r], record.upper[m, r], record.ranks[m, r] = lower, upper, ranks
    record.seconds[m, r] = time.perf_counter() - start
    log.never_ran[m] = -1
    if report is not None:
        record.checked[m, r] = passed
        record.rows[m, r] = report.row
        record.predicted[m, r] = predicted_coverage(report, record.sites, setup.levels)


def _run_target(setup: _Setup, key, data, options: dict):
    """``autotune``, ``run_kernel`` and, with ``check``, ``check_run``: the draws, the report
    and whether the check passed (``NaN`` unchecked)."""
    key_tune, key_run = random.split(key)
    kwargs = setup.model_kwargs
    kernel, report = autotune(setup.model, key_tune, *data, model_kwargs=kwargs, **options)
    run = run_kernel(
        kernel,
        key_run,
        *data,
        num_samples=report.draws_for(setup.ess),
        num_warmup=report.draws_for(10),
        model_kwargs=kwargs,
    )
    passed = math.nan
    if setup.check:
        passed = float(check_run(run, report, print_table=False).passed)
    return run.get_samples(), report, passed


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


def _caught(caught) -> list:
    return [f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught]


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
        try:
            trace = handlers.trace(seeded).get_trace(*args, **model_kwargs)
        except NotImplementedError as err:
            raise ValueError(
                f"Site '{failing_site(err)[0]}' has a distribution with no sampler (an "
                "ImproperUniform's flat prior, say), so simulation-based calibration cannot "
                "draw it from its "
                "prior: give it a proper prior, or pass calibrate a simulate that returns "
                "(truth, data) from a process of your own."
            ) from err
        if observed not in trace:
            raise ValueError(f"The model has no site {observed!r}; its sites: {list(trace)}.")
        truth = {
            name: np.asarray(site["value"])
            for name, site in trace.items()
            if site["type"] == "sample" and not site["is_observed"] and name != observed
        }
        return truth, args + (trace[observed]["value"],)

    return simulate
