"""The autotuner: from a named target to a ready kernel, a prediction and its cost.

``autotune(model, rng_key, *data, target=...)`` runs ``docs/theory.md`` §3–§4 on any NumPyro
model with a subsample plate; the model is traced once and passed down:

1. **warm start** (:func:`~numpyro_sgmc.tuner.warmstart.warm_start`): Adam to the mode ``θ̂``, in
   each parameter's natural scale, from the model's init strategy (the prior median by
   default) or ``init_params``;
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
most half of what the target needs, and a larger one than the model's when even that is too
noisy; rows F, B, G mix in ``1/w₁`` epochs whatever ``b`` and keep the model's batch, halved
while the step bound needs it.

Cost is counted in gradient evaluations per datum (epochs): ``b`` per iteration, ``2b`` with
control variates.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.infer.initialization import init_to_mean, init_to_value

from numpyro_sgmc import scales, theory
from numpyro_sgmc.data import validation
from numpyro_sgmc.data.batches import BATCH_SAMPLING
from numpyro_sgmc.data.model import Layout, constrain, constrained, prepare_model, split_args
from numpyro_sgmc.kernels import SGD, SGLD, SGLDFP
from numpyro_sgmc.kernels.curvature import largest_eigenvalue
from numpyro_sgmc.kernels.shell import Tuned
from numpyro_sgmc.scales import Dense, Diagonal
from numpyro_sgmc.theory import InfeasibleTuning, rows_reaching, target_weights
from numpyro_sgmc.theory.linear import GradientNoise
from numpyro_sgmc.tuner.fisher import plate_noise
from numpyro_sgmc.tuner.laplace import Problem, fit
from numpyro_sgmc.tuner.report import TuningReport
from numpyro_sgmc.tuner.warmstart import WarmStart, warm_start_of

__all__ = ["AutotuneOptions", "autotune"]


class AutotuneOptions(NamedTuple):
    """The autotuner's options (the keyword arguments of :func:`autotune`), checked once."""

    batch_size: object
    row: Optional[str]
    warm_start_epochs: float
    learning_rate: float
    num_restarts: int
    num_rows: Optional[int]
    dense: Optional[bool]
    regularize: object
    max_step: float
    min_batch_size: int
    num_steps: Optional[int]
    batch_sampling: str
    tolerance: float
    init_strategy: Callable
    init_params: Optional[dict]

    def check(self) -> "AutotuneOptions":
        """Every option's type and range: a ``TypeError`` or ``ValueError`` that names it."""
        checked = self._replace(
            max_step=validation.number_in(
                "max_step (the bound on h·λmax(ΓJ))", self.max_step, 0, 4
            ),
            num_restarts=validation.positive_int("num_restarts", self.num_restarts),
            min_batch_size=validation.positive_int("min_batch_size", self.min_batch_size),
            learning_rate=validation.positive_number("learning_rate", self.learning_rate),
            warm_start_epochs=validation.positive_number(
                "warm_start_epochs", self.warm_start_epochs
            ),
            tolerance=validation.number_in("tolerance", self.tolerance, 0, 1),
            num_rows=validation.positive_int("num_rows", self.num_rows, allow_none=True),
            num_steps=validation.positive_int("num_steps", self.num_steps, allow_none=True),
        )
        if self.dense is not None and not isinstance(self.dense, (bool, np.bool_)):
            raise TypeError(f"dense must be None, True or False, got {self.dense!r}.")
        if self.batch_sampling not in BATCH_SAMPLING:
            raise ValueError(
                f"Unknown batch_sampling {self.batch_sampling!r}; choose one of "
                f"{', '.join(BATCH_SAMPLING)}."
            )
        if not callable(self.init_strategy):
            raise TypeError(
                f"init_strategy must be a NumPyro init strategy, got {self.init_strategy!r}."
            )
        if self.row is not None and self.row not in theory.ROWS:
            raise ValueError(
                f"Unknown Table 1 row {self.row!r}; the rows are {', '.join(theory.ROWS)}."
            )
        return checked


class Choice(NamedTuple):
    """The target, the chosen row's candidate, every row considered, and the setup cost."""

    target: str
    weights: tuple
    best: object
    alternatives: list
    setup_epochs: float


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
    warm_start_epochs: float = 5,
    learning_rate: float = 0.05,
    num_restarts: int = 1,
    num_rows: Optional[int] = 10000,
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

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param rng_key: PRNG key for the warm start and the information subsample.
    :param model_args: the data, as for ``MCMC.run``.
    :param target: ``"posterior"``, ``"bagged"``, ``"local_fiducial"`` (= ``"sandwich"``) or
        ``"mix"`` (:func:`~numpyro_sgmc.theory.target_weights`).
    :param weight: ``w`` of ``"bagged"`` / ``"local_fiducial"`` / tempered ``"posterior"``.
    :param weights: ``(w₁, w₂)`` of ``"mix"``.
    :param warm: a :class:`~numpyro_sgmc.tuner.warmstart.WarmStart` to reuse (its best restart).
    :param batch_size: ``b`` (int or ``{plate: int}``); default the plates' ``subsample_size``.
    :param row: force a row of Table 1 that reaches the target; default the cheapest.
    :param warm_start_epochs: epochs of the warm start.
    :param learning_rate: the warm start's Adam learning rate.
    :param num_restarts: warm-start restarts (the best is kept).
    :param num_rows: rows for ``J`` and ``I`` to start with (``None``: all ``n``); more are
        added until the prediction's own error is under ``tolerance``.
    :param dense: dense ``J``/``Γ`` (default when ``d ≤ 1000``,
        :data:`~numpyro_sgmc.tuner.laplace.DENSE_MAX_DIM`) or diagonal.
    :param regularize: for a ``J`` that is not positive definite
        (:func:`~numpyro_sgmc.tuner.fisher.information`).
    :param max_step: the bound on ``h·λmax(ΓJ)`` (module docstring).
    :param min_batch_size: the smallest batch per plate the control-variate rows try.
    :param num_steps: iterations per draw; default about a quarter of the predicted mixing
        time.
    :param batch_sampling: the kernel's ``batch_sampling``. The predictions assume batches
        drawn with replacement; the others have a gradient noise smaller by ``(n - b)/(n - 1)``.
    :param tolerance: the largest relative standard error of the predicted standard
        deviations allowed from the rows used for ``J`` and ``I`` (default 2%).
    :param init_strategy: where the warm start begins: a NumPyro init strategy (default the
        prior mean, which keeps ``exp`` finite on raw covariate scales; a strategy that finds
        no finite point falls back to the prior mean, then to the unconstrained zeros).
    :param dict init_params: or unconstrained starting values (with a leading restart axis for
        several restarts).
    :param dict model_kwargs: the model's keyword arguments.
    :return: ``(kernel, report)``: a kernel for ``numpyro.infer.MCMC`` that starts at the mode,
        and a :class:`~numpyro_sgmc.tuner.report.TuningReport`.
    """
    weights = target_weights(target, weight, weights)
    options = AutotuneOptions(
        batch_size, row, warm_start_epochs, learning_rate, num_restarts, num_rows, dense,
        regularize, max_step, min_batch_size, num_steps, batch_sampling, tolerance,
        init_strategy, init_params,
    ).check()  # fmt: skip
    model_args, model_kwargs = validation.as_arrays(model, model_args, model_kwargs)
    key_prepare, key_warm, key_info = random.split(rng_key, 3)
    prepared = prepare_model(
        random.split(key_prepare, options.num_restarts),
        model,
        model_args,
        model_kwargs,
        batch_size=options.batch_size,
        init_strategy=options.init_strategy,
    )
    if warm is None:
        # no convergence check: the Newton steps of the fit measure the same distance with
        # the J estimated there anyway
        warm = warm_start_of(
            prepared, key_warm, model_args, model_kwargs, options.warm_start_epochs,
            options.num_restarts, options.learning_rate, init_params=options.init_params,
            check=False, rescale=True,
        )  # fmt: skip
    problem = Problem(
        prepared._replace(init_params=warm.member(0)), model_args, model_kwargs, options, key_info
    )
    local = fit(problem, warm, weights)
    candidates, alternatives = _candidates(problem, local, weights)
    best = min(candidates, key=lambda c: c.mixing_epochs)
    n = problem.prepared.num_data
    setup = warm.num_epochs + local.passes + local.rows_visited / n
    setup += 1.0 if best.tuning.control_variates else 0.0  # the centre's full-data gradient
    choice = Choice(target, weights, best, alternatives, setup)
    return _build(problem, local, warm, choice)


def _halvings(batch: dict, smallest: int):
    """``batch`` (plate -> b), then halved together while every plate stays ``>= smallest``."""
    yield batch
    while all(b // 2 >= smallest for b in batch.values()):
        batch = {k: b // 2 for k, b in batch.items()}
        yield batch


def _lam_max(problem, fit) -> Callable:
    """``gamma -> λmax(ΓJ)``: exact for a dense ``J``, by power iteration for a diagonal one."""
    J = fit.information.potential_curvature
    if isinstance(J, Dense):
        return lambda gamma: scales.relative_size(J, gamma.inverse())  # λmax(ΓJ)
    prepared = problem.prepared
    rows = problem.options.num_rows or prepared.num_data
    dtype = prepared.layout.ravel(fit.mode).dtype
    return lambda gamma: largest_eigenvalue(
        prepared.spec, prepared.layout, fit.mode, Diagonal(jnp.asarray(gamma.values, dtype)),
        problem.rng_key, problem.model_args, problem.model_kwargs, rows,
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
            candidate = _tune_row(name, problem, fit, weights, lam_max)
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


def _tune_row(name, problem, fit, weights, lam_max) -> Candidate:
    """One row's tuning at the batch it prefers, its prediction and cost (module docstring)."""
    info, options = fit.information, problem.options
    J, I, n = info.potential_curvature, info.I, problem.prepared.num_data
    plates = problem.prepared.plates
    row = theory.ROWS[name]
    batch = {p.name: p.batch_size for p in plates}
    free = info.data_free
    if row.estimator == "control_variates":
        h = options.max_step / lam_max(J.inverse())

        def attempt(batch):
            noise = GradientNoise(plate_noise(plates, fit.cv_noise, batch), None, 1.0)
            return theory.tune(
                name, J, I, batch_size=sum(batch.values()), num_data=n, weights=weights,
                noise=noise, step_size=h, data_free=free,
            )  # fmt: skip

        tuning, batch = _smallest_quiet_batch(attempt, batch, options.min_batch_size, plates)
    else:
        gamma = theory.preconditioner(name, J, I, free)
        top = lam_max(gamma)
        w1 = 1.0 if name == "P5" else weights[0]
        for candidate in _halvings(batch, 1):
            if 4 * w1 * sum(candidate.values()) / n * top <= options.max_step:
                batch = candidate
                break
        else:
            raise InfeasibleTuning(
                f"its step h = 4b/n at the smallest batch is past the bound h·λmax(ΓJ) <= "
                f"max_step = {options.max_step:g}."
            )
        minibatch = plate_noise(plates, info.plate_covariances, batch)
        noise = GradientNoise(minibatch + plate_noise(plates, fit.cv_noise, batch), None, 1.0)
        tuning = theory.tune(
            name, J, I, batch_size=sum(batch.values()), num_data=n, weights=weights,
            noise=noise, data_free=free,
        )  # fmt: skip
        _check_reaches(tuning, name)
    cov, F = tuning.covariance, tuning.drift
    tau = theory.autocorrelation_times(F, cov)
    worst = theory.worst_autocorrelation_time(F, cov).time
    cost = 2 * sum(batch.values()) if tuning.control_variates else sum(batch.values())
    return Candidate(tuning, batch, tau, worst, worst * cost / n, cost)


def _smallest_quiet_batch(attempt, batch, smallest, plates):
    """The smallest batch (halving from the model's, down to ``smallest`` per plate) whose
    control-variate noise is at most half the noise the target needs; the model's batch
    doubled (up to the data) when even it is too noisy: ``(tuning, batch)``."""
    best = None
    for candidate in _halvings(batch, smallest):
        try:
            tuning = attempt(candidate)
        except InfeasibleTuning:
            break
        if tuning.noise_fraction > 0.5:
            break
        best = (tuning, candidate)
    sizes = {p.name: p.size for p in plates}
    while best is None:
        batch = {k: min(2 * b, sizes[k]) for k, b in batch.items()}
        try:
            tuning = attempt(batch)
        except InfeasibleTuning:
            tuning = None
        if tuning is not None and tuning.noise_fraction <= 0.5:
            best = (tuning, batch)
        elif all(b == sizes[k] for k, b in batch.items()):
            raise InfeasibleTuning("even full-data gradients leave too much noise.")
    return best


def _check_reaches(tuning, name, tolerance=0.05):
    """A natural-noise row's prediction must be its target (to ``tolerance``): one whose noise
    cannot be shaped (SGD) misses a target with a part the gradient noise does not supply."""
    cov, target = np.asarray(tuning.covariance.diagonal()), np.asarray(tuning.target.diagonal())
    off = float(np.max(np.abs(np.sqrt(cov / target) - 1)))
    if off > tolerance:
        raise InfeasibleTuning(
            f"row {name}'s law misses the target's sd by {100 * off:.0f}% in some direction "
            f"(more than {100 * tolerance:.0f}%): its gradient noise is not shaped like the "
            "target there (parameters with no "
            "per-datum gradient get none, and the per-datum Hessians add their own)."
        )


def _build(problem, fit, warm, choice):
    """The kernel of the chosen tuning, started at the mode, and its report."""
    tuning, best, options = choice.best.tuning, choice.best, problem.options
    prepared, args, kwargs = problem.prepared, problem.model_args, problem.model_kwargs
    covariance, target = tuning.covariance, tuning.target
    autocorrelation, mixing = best.autocorrelation, best.mixing_iterations
    linked = fit.correlations
    if linked is not None:  # a diagonal J: the correlations it leaves out, put back
        covariance = Diagonal(np.asarray(covariance.values) * linked.inflation)
        target = Diagonal(np.asarray(target.values) * linked.inflation)
        drift = Diagonal(1.0 - 0.5 * tuning.step_size / linked.concentration)
        autocorrelation = theory.autocorrelation_times(drift, covariance)
        mixing = float(np.max(autocorrelation))
    num_steps = options.num_steps
    if num_steps is None:
        num_steps = max(1, int(round(mixing / 4)))
    latent = prepared.latent_sites
    # JAX arrays: a model may index a latent site with traced data (``alpha[group]``)
    constrained_mode = jax.tree.map(
        jnp.asarray, constrained(prepared.spec, fit.mode, args, kwargs, prepared.per_datum_sites)
    )
    batch_size = best.batch_size
    common = dict(
        batch_size=batch_size if len(batch_size) > 1 else next(iter(batch_size.values())),
        preconditioner=tuning.preconditioner,
        num_steps=num_steps,
        batch_sampling=options.batch_sampling,
        init_strategy=init_to_value(values={k: constrained_mode[k] for k in latent}),
    )  # the chains start from draws of the predicted law (Tuned.draws)
    model = prepared.spec.model
    if math.isinf(tuning.inverse_temperature):
        kernel = SGD(model, tuning.step_size, **common)
    else:
        cls = SGLDFP if tuning.control_variates else SGLD
        kernel = cls(
            model,
            tuning.step_size,
            inverse_temperature=tuning.inverse_temperature,
            noise_preconditioner=tuning.noise_preconditioner,
            **common,
        )
    kernel._tuned = Tuned(prepared.plates, prepared.layout.ravel(fit.mode), covariance)
    report = TuningReport(
        row=tuning.row,
        algorithm=type(kernel).__name__,
        target=choice.target,
        weights=choice.weights,
        step_size=tuning.step_size,
        batch_size=batch_size,
        inverse_temperature=tuning.inverse_temperature,
        preconditioner=tuning.preconditioner,
        noise_preconditioner=tuning.noise_preconditioner,
        control_variates=tuning.control_variates,
        num_steps=num_steps,
        target_covariance=target,
        covariance=covariance,
        constrained_covariance=_delta_method(problem, fit.mode, covariance),
        autocorrelation_iterations=autocorrelation,
        mixing_iterations=mixing,
        mixing_epochs=mixing * best.cost / prepared.num_data,
        gradient_evaluations_per_iteration=best.cost,
        setup_epochs=choice.setup_epochs,
        newton_step=fit.newton_step,
        prediction_error=fit.prediction_error,
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
    )
    return kernel, report


def _delta_method(problem, mode, covariance):
    """The covariance of the constrained latent sites, ``Jac Σ Jacᵀ`` (dense ``Σ`` only)."""
    if not isinstance(covariance, Dense):
        return None
    prepared = problem.prepared
    arrays, structure = split_args(problem.model_args, problem.model_kwargs)
    jac = _jacobian(
        prepared.spec, structure, prepared.layout, tuple(prepared.latent_sites),
        prepared.layout.ravel(mode), arrays,
    )  # fmt: skip
    jac = np.asarray(jac, np.float64)
    return jac @ np.asarray(covariance.matrix) @ jac.T


@partial(jax.jit, static_argnames=("spec", "structure", "layout", "latent"))
def _jacobian(spec, structure, layout, latent, zf, arrays):
    """``∂(constrained latent values)/∂z`` at ``zf`` (flat), compiled once per model."""
    args, kwargs = structure.rebuild(arrays)

    def flat(x):
        values = constrain(spec, layout.unravel(x), args, kwargs)
        return jnp.concatenate([jnp.ravel(values[name]) for name in latent])

    return jax.jacfwd(flat)(zf)
