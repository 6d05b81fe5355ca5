"""The models users bring, through the plain recipe only, against references; and each way the
tuner used to fail on them silently, now flagged or right (``tests/user_models.py``).

The recipe: ``autotune`` → ``MCMC(num_samples=report.draws_for(1000))`` → ``check_run``. The
achieved unconstrained sds must be within 10% of the reference (NUTS, the exact float64
sandwich, or a float64 Laplace approximation at n ≫ d); with ESS ≈ 1000 per chain over two
chains the Monte Carlo error of an sd is about 1.6%, so 10% is six standard errors, and a
factor-2 error in a variance (41% in an sd) would fail by far.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.diagnostics import effective_sample_size
from numpyro.handlers import reparam
from numpyro.infer import MCMC, init_to_uniform
from numpyro.infer.reparam import LocScaleReparam
from user_models import (
    MODELS,
    hierarchical_logistic,
    laplace64,
    logistic,
    make_hierarchical,
    make_nb2,
    make_overdispersed,
    make_thin_levels,
    make_unequal_groups,
    make_weibull_raw,
    make_wide_logistic,
    nb2_raw,
    nuts_draws,
    nuts_reference,
    one_hot_poisson,
    poisson_raw,
    sandwich64,
    softmax_with_reference,
    thin_class,
    unequal_groups_poisson,
    weibull_raw,
)

from numpyro_sgmc import SGLD, autotune, check_run, run_kernel, theory
from numpyro_sgmc.data.model import prepare_model
from numpyro_sgmc.diagnostics import (
    ConvergenceWarning,
    LinearizationWarning,
    RunCheckWarning,
    StepSizeWarning,
)
from numpyro_sgmc.tuner.check import unconstrained_draws
from numpyro_sgmc.tuner.laplace import mean_shift, profile_moments


def run_recipe(model, args, kwargs, seed=0, run_seed=None, ess=1000, **tune):
    """The plain recipe, two chains of ``report.draws_for(ess)`` draws: ``(report, check,
    achieved unconstrained sds)``; the run's key is ``run_seed`` (default ``seed + 100``)."""
    kernel, report = autotune(model, jax.random.key(seed), *args, model_kwargs=kwargs, **tune)
    mcmc = MCMC(
        kernel,
        num_warmup=10,
        num_samples=report.draws_for(ess),
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(seed + 100 if run_seed is None else run_seed), *args, **kwargs)
    check = check_run(mcmc, report, print_table=False)
    draws = unconstrained_draws(mcmc.get_samples(group_by_chain=True), report)
    return report, check, draws.reshape(-1, draws.shape[-1]).std(axis=0)


def recipe(case, seed=0, **tune):
    """The plain recipe on ``case``'s data: ``(report, check, achieved sds, reference sds)``."""
    args, kwargs = case.make(seed)
    report, check, achieved = run_recipe(case.model, args, kwargs, seed, target=case.target, **tune)
    ref = case.reference(args, kwargs)
    reference = np.concatenate([np.ravel(ref[site]) for site, *_ in report.layout.sites])
    return report, check, achieved, reference


@pytest.mark.slow  # 30-120 s each
@pytest.mark.parametrize("name", list(MODELS))
def test_recipe_matches_the_reference(name):
    case = MODELS[name]
    report, check, achieved, reference = recipe(case)
    ratio = achieved / reference
    assert np.all(np.abs(ratio - 1) < 0.10), (name, ratio, report.layout.names())
    assert check.passed, check
    # the prediction is right within its own stated error (three of them, plus the 10%)
    predicted = report.predicted_sd / reference
    assert np.all(np.abs(predicted - 1) < 0.10 + 3 * report.prediction_error), predicted


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_overdispersed_counts_sandwich_over_seeds(seed):
    _, check, achieved, reference = recipe(MODELS["poisson_sandwich"], seed=seed)
    assert np.all(np.abs(achieved / reference - 1) < 0.10), achieved / reference
    assert check.passed, check


def test_rows_that_need_the_inverse_of_I_are_dropped_with_the_reason():
    """A hierarchical mean and scale have no per-datum gradient: I is singular, so P5
    (Γ = I⁻¹) cannot serve; the error says so, and the autotuner drops the row."""
    J = np.array([[2.0, 0.3, 0.0], [0.3, 1.0, 0.0], [0.0, 0.0, 0.5]])
    I = np.diag([1.5, 0.8, 0.0])
    free = np.array([False, False, True])
    with pytest.raises(theory.InfeasibleTuning, match="1 parameter.*no per-datum gradient"):
        theory.tune("P5", J, I, batch_size=10, num_data=1000, data_free=free)
    tuning = theory.tune("P4", J, I, batch_size=10, num_data=1000, data_free=free, step_size=1.0)
    assert np.all(np.isfinite(np.asarray(tuning.covariance)))


def test_a_random_start_on_raw_covariates_falls_back_to_a_finite_one():
    """init_to_uniform on raw covariate scales (an income in dollars) overflows ``exp``; the
    model is prepared from the prior means instead."""
    (X, y), _ = make_overdispersed(n=2000)
    prepared = prepare_model(jax.random.key(0), poisson_raw, (X, y), {}, None, init_to_uniform)
    flat = np.asarray(prepared.layout.ravel(prepared.init_params))
    assert np.all(np.isfinite(flat)) and np.all(flat == 0.0)


@pytest.mark.slow  # 18 s: the quick suite's budget
def test_a_prior_draw_that_overflows_the_first_trace_is_not_an_error():
    """NB2 on raw covariates: for key 2 the N(0, 10²) prior draw overflows ``exp(X @ beta)``
    and NumPyro's plain trace raises "Gamma distribution got invalid rate parameter"; the
    first trace takes only the model's structure from such a draw, and MCMC.run starts at a
    finite point and samples."""
    (X, y), _ = make_nb2(n=2000)
    key = jax.random.key(2)
    with pytest.raises(ValueError, match="invalid rate parameter"):
        numpyro.handlers.trace(numpyro.handlers.seed(nb2_raw, key)).get_trace(X, y)
    prepared = prepare_model(key, nb2_raw, (X, y), {}, None, init_to_uniform)
    assert {"beta", "alpha"} <= set(prepared.init_params)
    assert np.all(np.isfinite(np.asarray(prepared.layout.ravel(prepared.init_params))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepSizeWarning)
        mcmc = MCMC(SGLD(nb2_raw, 1e-7), num_warmup=0, num_samples=20, progress_bar=False)
        mcmc.run(key, X, y)
    assert all(np.all(np.isfinite(np.asarray(v))) for v in mcmc.get_samples().values())


@pytest.mark.slow  # about 20 s
def test_a_hierarchy_of_200_groups_starts_at_its_mode():
    """Centred group intercepts, 200 groups: at the start the groups are equal, so the prior's
    curvature along ``log τ`` is nearly zero and its warm-start scale was 18 times the
    posterior's: Adam ended 3·10⁵ sds from the mode (2·10⁶ at n = 10⁵, at ``τ ≈ 2000``), and
    20 Newton steps did not reach it. With the scale capped the warm start ends near the mode
    and the polish settles there (the simulated group spread is 0.7). By default Newton steps
    try the start itself first (here they did not settle in 20 steps, and Adam ran) and reach
    the same mode either way."""
    args, kwargs = make_hierarchical(0, n=40_000, num_groups=200)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        _, report = autotune(hierarchical_logistic, jax.random.key(0), *args, model_kwargs=kwargs,
                             warm_start_epochs=5)  # fmt: skip
        _, start = autotune(hierarchical_logistic, jax.random.key(0), *args, model_kwargs=kwargs)
    assert report.newton_step < 100  # 2.1e6 before
    assert 0.55 < float(np.exp(report.mode["tau"])) < 0.85  # the mode is unconstrained
    if start.warm_start.num_epochs:  # Adam after the steps from the start: both counted
        assert start.setup_epochs > report.setup_epochs + 10
    sds = report.predicted_sd
    moved = np.abs(np.asarray(start.layout.ravel(start.mode) - report.layout.ravel(report.mode)))
    assert np.max(moved / sds) < 0.05, np.max(moved / sds)


@pytest.mark.slow  # about 20 s each
@pytest.mark.parametrize(
    "rows_per_group, where",
    [(200, "not positive definite in the direction of"), (50, "narrower than its quadratic there")],
)
def test_a_non_centred_hierarchy_of_well_observed_groups_is_refused_naming_the_fix(
    rows_per_group, where
):
    """The same 200 groups non-centred by NumPyro's ``LocScaleReparam(centered=0)``
    (``alpha = mu + tau * z``): the posterior is a ridge curving along ``tau`` (each group's
    ``z`` is pinned to ``alpha_j / tau``), whose joint mode is held far out by the
    prior on ``tau``. The polish does not settle. With 200 rows a group, where it stops ``J``
    is not positive definite; with 50, ``J`` is, but along ``mu`` the log posterior is 4.6x
    narrower than its quadratic there, every row's profile says (4,000 sampled rows said it
    did not rise on one side; a kernel tuned there diverged, its sd of mu 14,800 against
    NUTS's 0.055). The error says so and names the centred form (it used to name more rows or
    a ridge, which cannot help)."""
    noncentred = reparam(hierarchical_logistic, config={"alpha": LocScaleReparam(centered=0)})
    args, kwargs = make_hierarchical(0, n=200 * rows_per_group, num_groups=200)
    with warnings.catch_warnings(), pytest.raises(ValueError) as error:
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", LinearizationWarning)
        autotune(noncentred, jax.random.key(0), *args, model_kwargs=kwargs)
    message = str(error.value)
    assert "found no mode" in message and where in message
    assert "non-centred hierarchy" in message and "alpha ~ Normal(mu, tau)" in message


@pytest.mark.slow  # NUTS: about 2 minutes
def test_a_hierarchy_of_200_groups_matches_nuts():
    """The plain recipe on 200 centred groups at n = 10⁵ (205 parameters) against NUTS: every
    unconstrained sd within 15%, their median within 4%, and ``check_run`` passes (NUTS's
    4000 draws and ours have Monte Carlo errors of about 2% each on an sd)."""
    args, kwargs = make_hierarchical(0, n=100_000, num_groups=200)
    report, check, achieved = run_recipe(hierarchical_logistic, args, kwargs, run_seed=1)
    assert check.passed
    ref = nuts_reference(hierarchical_logistic, args, kwargs)
    reference = np.concatenate([np.ravel(ref[site]) for site, *_ in report.layout.sites])
    ratio = achieved / reference
    assert np.all(np.abs(ratio - 1) < 0.15) and abs(np.median(ratio) - 1) < 0.04, ratio


@pytest.mark.slow  # 17 s: the quick suite's 10 minutes
def test_a_centred_hierarchy_of_thinly_observed_groups_is_said_to_be_far_from_gaussian():
    """200 centred groups of 50 rows: the joint mode collapses the group scale, and the run's
    mean of tau lay 2.88 posterior sds above it while the widest directions (group
    intercepts) looked Gaussian: mu's sd was 1.13x the prediction stated ±0.02%. Along tau's
    marginal path, with the Laplace term for the intercepts' spread, the marginal peaks past
    two sds out: the tuner says so and states no error bar for mu and tau."""
    args, kwargs = make_hierarchical(0, n=10_000, num_groups=200)
    with pytest.warns(LinearizationWarning) as caught:
        _, report = autotune(hierarchical_logistic, jax.random.key(0), *args, model_kwargs=kwargs)
    message = " ".join(str(w.message) for w in caught)
    assert "The marginal posterior of tau" in message and "beyond the tuner's probes" in message
    assert "centred hierarchy whose groups are each observed by few rows" in message
    tau = next(f for f in report.nonlinearity if f.label == "tau")
    assert tau.parameter is not None and not np.isfinite(tau.sd_ratio)
    names = report.layout.names()
    assert report.prediction_error[names.index("mu")] == 1.0
    assert report.prediction_error[names.index("tau")] == 1.0


@pytest.mark.slow  # about a minute
def test_a_centred_hierarchy_with_groups_of_a_few_rows_is_refused_or_said_far_from_gaussian():
    """400 centred Poisson groups of 2 to 1,000 rows (176 of them of 2-3 rows, n = 20,000):
    the thin groups' effects and the scale form a funnel. Depending on where the Newton steps
    stop (the CPU's rounding decides), the tuner refuses, or tunes and says the scale's marginal
    lies beyond its probes; either way it names the cause and NUTS. The refusal used to list,
    first, "write it centred", which this hierarchy already is."""
    args, kwargs = make_unequal_groups()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            autotune(unequal_groups_poisson, jax.random.key(0), *args, model_kwargs=kwargs)
        except ValueError as error:
            message = str(error)
            assert "found no mode" in message, message
            assert "a centred hierarchy in which some groups are observed by a few rows" in message
            assert "sample it with NUTS" in message
            return
    message = " ".join(str(w.message) for w in caught if w.category is LinearizationWarning)
    assert "centred hierarchy whose groups are each observed by few rows" in message, message
    assert "sample the model with NUTS" in message


@pytest.mark.slow  # about 30 s
def test_a_weibull_regression_on_raw_covariates_runs_through_the_plain_recipe():
    """Censored Weibull times with an age in years and an income in dollars: Adam's default
    5 epochs stopped 243 posterior sds from the mode, 20 Newton steps did not reach it, and
    autotune refused the model (no mode: J + J_prior not positive definite) though its
    float64 Hessian at the mode is positive definite. Adam now runs 45 epochs more from there,
    and the run matches the float64 Laplace (2 chains, ESS 1000 each: ±2.2% an sd; its Newton
    steps from the tuner's mode: from the prior mean they do not reach it either)."""
    args, kwargs = make_weibull_raw()
    report, check, achieved = run_recipe(weibull_raw, args, kwargs)
    assert check.passed, check
    ref = laplace64(weibull_raw, args, kwargs, start=report.mode)
    reference = np.concatenate([np.ravel(ref[site]) for site, *_ in report.layout.sites])
    ratio = achieved / reference
    assert np.all(np.abs(ratio - 1) < 0.1) and abs(np.median(ratio) - 1) < 0.04, ratio


@pytest.mark.slow  # NUTS: about a minute
def test_the_marginal_path_of_a_group_scale_puts_the_skew_in_the_stated_error():
    """200 centred groups of 100 rows: tau's marginal lies about a sd above the joint mode,
    and the sds whose conditional variances grow with tau are wider than the Gaussian at the
    mode says (NUTS: mu 1.10x, the intercepts 1.015x on average). Without the marginal path
    the prediction stated ±0.01% on mu and under 1% on the intercepts; now mu's stated error
    (19%) covers what NUTS finds, the intercepts' (1.1% on average) most of it, and the
    median stays under 5%. The same path puts tau's marginal mean where NUTS's is."""
    args, kwargs = make_hierarchical(0, n=20_000, num_groups=200)
    _, report = autotune(hierarchical_logistic, jax.random.key(0), *args, model_kwargs=kwargs)
    ref = nuts_draws(hierarchical_logistic, args, kwargs)
    draws = np.concatenate([ref[site].reshape(4000, -1) for site, *_ in report.layout.sites], 1)
    reference = draws.std(axis=0)
    miss, error = np.abs(np.log(report.predicted_sd / reference)), report.prediction_error
    names = report.layout.names()
    mu = names.index("mu")
    assert 0.05 < error[mu] and miss[mu] <= error[mu], (miss[mu], error[mu])
    alpha = [k for k, name in enumerate(names) if name.startswith("alpha")]
    # the intercepts' common shift (NUTS's Monte Carlo error averages out over 200 of them)
    # is seen, though not in full: the straight path puts tau's marginal 0.84 sds out where the
    # run's mean is 1.42 (docs/theory.md §4); without the paths it was stated as 0.5%
    shift = abs(np.mean(np.log(report.predicted_sd / reference)[alpha]))
    assert 0.005 < np.mean(error[alpha]) and shift <= 2 * np.mean(error[alpha]), (
        shift,
        np.mean(error[alpha]),
    )
    # each sd: NUTS's 4000 draws leave about 1.3% on one; the largest of 205 within 5 of them
    assert np.all(miss <= error + 0.065), (miss - error).max()
    assert np.median(error) < 0.05, np.median(error)
    # the skew: tau's marginal mean about 1.5 sds above the joint mode (NUTS's Monte Carlo
    # error on it about 0.05 sds), which check_run expects a run's mean at
    tau = names.index("tau")
    mode = np.asarray(report.layout.ravel(report.mode), np.float64)
    offset = (draws.mean(axis=0) - mode) / reference
    expected = mean_shift(report.nonlinearity, len(names)) / reference
    assert 1.0 < offset[tau] and abs(expected[tau] - offset[tau]) < 0.25 * offset[tau], (
        expected[tau],
        offset[tau],
    )


@pytest.mark.slow  # about a minute
def test_a_run_whose_group_scale_is_skewed_as_predicted_passes_its_check():
    """The same 200 centred groups of 100 rows: the run's tau mean lies 1.45 sds above the
    joint mode, and check_run failed it as "far from the mode" (a right run: NUTS's mean is
    there too, the test above). It expects the run's mean where the marginal path's profile
    puts it, and passes. With 50 rows per group the marginal's mass lies beyond the probes:
    the tuner cannot place tau's mean, and the check says it cannot check it, where it used to
    fail the run on it (right there: tau's mean 2.9 sds from NUTS's; wrong on crossed effects of
    50 items and 200 users, n = 2·10⁴, whose run matched NUTS's sds and means to 0.1 sd)."""
    args, kwargs = make_hierarchical(0, n=20_000, num_groups=200)
    report, check, _ = run_recipe(hierarchical_logistic, args, kwargs)
    tau = report.layout.names().index("tau")
    assert check.mean_offset[tau] > 1.0 and check.expected_offset[tau] > 1.0, check
    assert check.passed, check
    assert "the marginal of tau is skewed: its mean lies" in str(report)
    args, kwargs = make_hierarchical(0, n=10_000, num_groups=200)
    with pytest.warns(LinearizationWarning, match="beyond the tuner's probes"):
        report, check, _ = run_recipe(hierarchical_logistic, args, kwargs)
    assert abs(check.expected_offset[tau]) < 0.1 and check.mean_offset[tau] > 1.0, check
    assert check.status == "CANNOT CHECK" and not check.findings, check.findings
    assert any("no reference (worst tau" in u and "cannot say where these means lie" in u
               for u in check.unchecked), check.unchecked  # fmt: skip


def hierarchical_poisson(X, group, y=None, num_groups=20):
    """Poisson counts with centred group log-rates."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    alpha = numpyro.sample("alpha", dist.Normal(mu, tau).expand([num_groups]).to_event(1))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=200):
        Xb = numpyro.subsample(X, event_dim=1)
        gb = numpyro.subsample(group, event_dim=0)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Poisson(jnp.exp(alpha[gb] + Xb @ beta)), obs=yb)


@pytest.mark.slow  # about a minute
def test_many_groups_get_a_batch_whose_noise_estimate_holds():
    """300 Poisson groups at n = 10⁵ (304 parameters): at the batch of 400 that halving
    reached, each group's intercept was seen by about one row per batch, the gradient noise
    supplied 40% of what the target needs, and the 64 random probes' estimate of it was
    18% off per group: the run's sds were 3.5% from the prediction, group by group (up to
    12%), where Monte Carlo allows 1.3%, and check_run failed. The tuner now takes a batch
    whose estimate moves no sd by more than its tolerance (1600 here)."""
    rng = np.random.default_rng(0)
    n, groups = 100_000, 300
    X = rng.standard_normal((n, 2)).astype(np.float32)
    group = rng.integers(0, groups, n)
    rate = np.exp(rng.normal(0.5, 0.5, groups)[group] + X @ np.array([0.3, -0.2]))
    args, kwargs = (X, group, rng.poisson(rate).astype(np.float32)), {"num_groups": groups}
    report, check, achieved = run_recipe(hierarchical_poisson, args, kwargs, run_seed=10, ess=1500)
    assert check.passed
    ratio = achieved / report.predicted_sd
    alpha = [k for k, name in enumerate(report.layout.names()) if name.startswith("alpha")]
    # Monte Carlo alone: 1/sqrt(2 ESS) = 1.3% for ESS 3000
    assert ratio[alpha].std() < 0.02 and abs(np.median(ratio[alpha]) - 1) < 0.01, ratio


@pytest.mark.slow  # about a minute
def test_an_extreme_group_of_a_hierarchy_gets_the_noise_its_chain_sees():
    """40 groups of 1250 rows, P4 at h = 1 with a batch of 50 (about one row of each group per
    batch): the gradient noise supplies a third of what each intercept's target needs. Its
    estimate probed every intercept √45 sds out, where the logistic's gradient is far from
    linear; for the group at p = 0.15 it was 30% high, the injected noise short by a tenth of
    the need, and the run's sd of that intercept 0.90-0.94 of the prediction (NUTS: 1.02),
    which check_run rightly failed. Probed one sd along every direction, the noise is the
    chain's, and the run matches the prediction within its Monte Carlo error (ESS 4000:
    1.1%), group by group."""
    args, kwargs = make_hierarchical(0, n=50_000, num_groups=40)
    report, check, achieved = run_recipe(hierarchical_logistic, args, kwargs, run_seed=1, ess=2000)
    assert check.passed
    ratio = (achieved / report.predicted_sd)[:40]
    assert abs(ratio[36] - 1) < 0.045 and np.all(np.abs(ratio - 1) < 0.05), ratio


def separable(seed=0, n=4000):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 2)).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.float32)


@pytest.mark.slow
def test_separable_classes_under_a_normal_prior_are_right():
    """Perfectly separable classes: no finite maximum-likelihood estimate, so the prior holds
    the mode (far out, at β₀ ≈ 23 here) and sets the sd with the few rows near the boundary.
    The tuner reaches that mode and predicts the sd NUTS finds."""
    X, y = separable()
    kernel, report = autotune(logistic, jax.random.key(0), X, y)
    reference = nuts_reference(logistic, (X, y), {}, num_samples=2000)["beta"]
    assert np.all(np.abs(report.predicted_sd / reference - 1) < 0.15), report.predicted_sd


def logistic_cauchy(X, y=None):
    beta = numpyro.sample("beta", dist.Cauchy(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=200):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ beta), obs=yb)


@pytest.mark.slow  # 10-23 s: the quick suite's 10 minutes
def test_separable_classes_under_a_heavy_tailed_prior_are_said():
    """Under a Cauchy prior the mode of separable classes is at β₀ ≈ 1600, in a log posterior
    that is nearly flat for hundreds of units: the tuner says it found no mode, instead of
    predicting an sd from a curvature that does not describe the posterior: its Newton steps
    do not settle either, so it returns no kernel, and the error names a stronger prior."""
    X, y = separable()
    with (
        pytest.warns(LinearizationWarning, match="does not rise on one side"),
        pytest.raises(
            ValueError,
            match=r"found no mode.*does not rise on one side along beta"
            r".*separable classes or a flat likelihood: give these sites a more "
            r"informative prior",
        ),  # fmt: skip
    ):
        autotune(logistic_cauchy, jax.random.key(0), X, y)


def test_a_profile_with_a_wall_on_one_side_is_measured_not_called_modeless():
    """Rises at -2, -1, +1, +2 sds of a half-Gaussian with a wall (curvature 16 on the left):
    the probes' quartic swings below zero between them; each side on its own gives the
    profile's mean and sd (0.598 and 0.674 of the quadratic's, by quadrature)."""
    steps = np.array([-2.0, -1.0, 1.0, 2.0])
    rises = np.where(steps > 0, steps**2 / 2, 8 * steps**2)
    mean, sd = profile_moments(steps, rises)
    assert abs(mean - 0.598) < 0.01 and abs(sd - 0.674) < 0.01, (mean, sd)
    assert profile_moments(steps, steps**2 / 2) == pytest.approx((0.0, 1.0), abs=1e-6)


def _bernoulli_rate(y):
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    with numpyro.plate("rows", y.shape[0], subsample_size=min(y.shape[0], 32)):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=numpyro.subsample(y, event_dim=0))


def test_a_rate_from_one_event_is_not_sampled_by_sgd():
    """One success in 30 rows: the rate's logit is far from Gaussian (the profile says so).
    SGD (P5) was the cheapest row, and its runs were 0.76 of the exact sd with ``check_run``
    passing them (its noise is the posterior's only through the Gaussian picture); a row
    with injected noise samples the posterior itself."""
    from scipy.special import polygamma

    y = np.zeros(30, np.float32)
    y[0] = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LinearizationWarning)
        kernel, report = autotune(_bernoulli_rate, jax.random.key(0), y)
    why = dict(report.alternatives)["P5"]
    assert report.row != "P5" and "its only noise is the gradient's" in why, why
    run = run_kernel(
        kernel, jax.random.key(1), y, num_samples=report.draws_for(2000), progress_bar=False
    )
    logit = np.asarray(unconstrained_draws(run.get_samples(group_by_chain=True), report))
    ess = float(effective_sample_size(logit[..., 0]))
    exact = np.sqrt(polygamma(1, 2) + polygamma(1, 30))  # the logit of a Beta(2, 30)
    # the sd's Monte Carlo error, and 5% for the step
    assert abs(logit.std() / exact - 1) < 4 / np.sqrt(2 * ess) + 0.05, (logit.std(), exact, ess)


@pytest.mark.parametrize("events", [1, 3, 10])
def test_a_thin_profile_gives_the_log_gamma_marginal(events):
    """The log rate of ``k`` Poisson events (flat prior) is log-gamma distributed: the
    profile through :data:`THIN_STEPS` gives its mean and sd (``ψ(k) - log k`` and
    ``sqrt(ψ'(k))``, in Laplace sds ``1/√k``), its curvature growth is ``e^{σt}`` at a
    visited probe, and a Gaussian's is (0, 1, 1): the interpolation is of the departure from
    a Gaussian, exact for one."""
    from scipy.special import digamma, polygamma

    from numpyro_sgmc.tuner.laplace import THIN_STEPS, _profile_growth, profile_on_grid

    s = THIN_STEPS / np.sqrt(events)  # the steps in log rate
    rises = events * (np.expm1(s) - s)  # U(u* + s) - U(u*), κ = 1
    mean, sd, shape = profile_on_grid(THIN_STEPS, rises)
    exact_mean = (digamma(events) - np.log(events)) * np.sqrt(events)
    exact_sd = np.sqrt(polygamma(1, events) * events)
    assert abs(mean - exact_mean) < 0.02 and abs(sd / exact_sd - 1) < 0.01, (mean, sd)
    assert abs(sd / exact_sd - 1) <= shape + 0.005 and shape < 0.05 and exact_sd > 1.02
    assert _profile_growth(THIN_STEPS, rises, 1.0) > np.exp(1 / np.sqrt(events))
    gaussian = 0.5 * THIN_STEPS**2
    assert profile_on_grid(THIN_STEPS, gaussian) == pytest.approx((0.0, 1.0, 0.0), abs=2e-3)
    assert _profile_growth(THIN_STEPS, gaussian, 1.0) == pytest.approx(1.0)


@pytest.mark.slow  # 35 s: the quick suite's budget
def test_a_thin_class_held_by_its_prior_gets_an_error_that_covers_it():
    """The thin class's night coefficient: NUTS's sd is about 1.4 times the Laplace's. The
    report says so (a LinearizationWarning with the profile's width, not "no finite mode")
    and its stated error covers the difference; the other sds are right to their errors.
    The curvature grows 45-fold one sd into the data's side, so the tuned step is shorter
    than at the mode: the run matches NUTS (at the mode's step it was thrown across the
    prior's side, 30 times too wide)."""
    X, y = thin_class()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kernel, report = autotune(softmax_with_reference, jax.random.key(0), X, y)
    said = [str(w.message) for w in seen if w.category is LinearizationWarning]
    assert said and all("does not rise on one side" not in m for m in said), said
    assert "W[1, 1]" in said[0] and "sd along it is about" in said[0], said
    reference = nuts_reference(softmax_with_reference, (X, y), {}, num_samples=4000)["W"].ravel()
    ratio = report.predicted_sd / reference
    # NUTS's own sds are known to about 3% (4000 draws)
    assert np.all(np.abs(ratio - 1) < 3 * report.prediction_error + 0.06), (
        ratio, report.prediction_error)  # fmt: skip
    assert report.prediction_error[3] > 0.2 and np.all(report.prediction_error[:3] < 0.05)
    (widest,) = [f for f in report.nonlinearity if f.label == "W[1, 1]"]
    assert abs(widest.sd_ratio * ratio[3] - 1) < 0.15, (widest.sd_ratio, ratio[3])
    assert widest.curvature_growth > 10
    run = run_kernel(kernel, jax.random.key(1), X, y, num_samples=1000, progress_bar=False)
    thin = np.asarray(run.get_samples()["W"])[:, 1, 1]
    ess = float(effective_sample_size(thin[None]))
    # the sds' relative errors, the run's and NUTS's (ESS about 1000), and 5% for the step
    tolerance = 4 * np.sqrt(1 / (2 * ess) + 1 / 2000) + 0.05
    assert abs(thin.std() / reference[3] - 1) < tolerance, (thin.std(), reference[3], ess)


def _level_marginal(t, rows, offset, y, prior_sd=5.0):
    """The log posterior of a level's coefficient on the grid ``t``, the other coefficients
    fixed: its rows' Poisson terms and the prior."""
    eta = t[:, None] + offset[rows]
    return (y[rows] * eta - np.exp(eta)).sum(axis=1) - 0.5 * (t / prior_sd) ** 2


def test_levels_of_a_few_rows_have_their_skew_in_the_stated_error():
    """A Poisson with a one-hot category whose first 8 levels have 1-3 rows: their
    posteriors are skewed (the Laplace sd was 0.81x NUTS's on a level of one row, with
    ±0.0% stated). Each is profiled along its marginal path and the profile's sd matches the
    exact one (quadrature; the covariates' coefficients, known to 1%, at the mode), and the
    stated error covers the Laplace prediction's distance from it."""
    args, kwargs, level = make_thin_levels()
    X, log_exposure, y = (np.asarray(a, np.float64) for a in args)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, report = autotune(one_hot_poisson, jax.random.key(0), *args, **kwargs)
    beta = np.asarray(report.mode["beta"], np.float64)
    offset = X[:, -2:] @ beta[-2:] + log_exposure
    thin = {f.parameter: f for f in report.nonlinearity if f.informing_rows > 0}
    assert set(range(8)) <= set(thin), sorted(thin)
    t = np.linspace(-40.0, 20.0, 120_001)
    for j in range(8):
        rows = np.flatnonzero(level == j)
        log_p = _level_marginal(t, rows, offset, y)
        w = np.exp(log_p - log_p.max())
        w /= w.sum()
        sd = np.sqrt(w @ t**2 - (w @ t) ** 2)
        peak = t[np.argmax(log_p)]
        laplace = 1.0 / np.sqrt(np.exp(peak + offset[rows]).sum() + 1 / 25)
        exact = sd / laplace
        assert abs(thin[j].sd_ratio / exact - 1) < 0.02, (j, thin[j].sd_ratio, exact)
        off = abs(np.log(report.predicted_sd[j] / sd))
        assert off <= report.prediction_error[j] + 0.02, (j, off, report.prediction_error[j])
    assert max(abs(f.sd_ratio - 1) for f in thin.values()) > 0.1  # a test that can fail
    said = [str(w.message) for w in seen if w.category is LinearizationWarning]
    assert any("parameters that few rows inform" in m for m in said), said


def test_a_kernel_tuned_on_other_data_is_an_error():
    (X, y), _ = make_wide_logistic(n=20_000, d=3)
    kernel, _ = autotune(logistic, jax.random.key(0), X[:5000], y[:5000])
    mcmc = MCMC(kernel, num_warmup=0, num_samples=10, progress_bar=False)
    with pytest.raises(ValueError, match=r"tuned by autotune for data with plate sizes"):
        mcmc.run(jax.random.key(1), X, y)


@pytest.mark.slow
def test_check_run_sees_a_run_that_matches_a_wrong_prediction():
    """The kernel and report of well-specified counts, run on over-dispersed counts of the same
    size: the run matches the report (the kernel samples what it was tuned for), but the
    information recomputed from the run's own data disagrees, and check_run says so."""
    (X, y), _ = make_overdispersed(n=8000)
    rng = np.random.default_rng(1)
    mean = np.exp(0.2 + 0.01 * X[:, 0] + 1e-5 * X[:, 1] + 0.05 * X[:, 2])
    y_poisson = rng.poisson(mean).astype(np.float32)
    kernel, report = autotune(poisson_raw, jax.random.key(0), X, y_poisson, target="local_fiducial")
    mcmc = MCMC(kernel, num_warmup=10, num_samples=report.draws_for(300), progress_bar=False)
    mcmc.run(jax.random.key(2), X, y)  # the other data, the same n
    with pytest.warns(RunCheckWarning, match="information from fresh rows"):
        check = check_run(mcmc, report, print_table=False)
    assert not check.passed
    exact = sandwich64(poisson_raw, (X, y), {})
    exact = np.concatenate([np.ravel(exact[s]) for s, *_ in report.layout.sites])
    # the independent estimate is the over-dispersed data's sandwich
    assert np.all(np.abs(check.sd_independent / exact - 1) < 0.1), check.sd_independent / exact


@pytest.mark.slow
def test_check_run_on_a_diagonal_report():
    """A diagonal prediction (what d > 1000 gets): variances only, a table, no crash."""
    (X, y), _ = make_wide_logistic(n=20_000, d=4)
    kernel, report = autotune(logistic, jax.random.key(0), X, y, dense=False)
    assert report.information.kind == "diagonal"
    mcmc = MCMC(kernel, num_warmup=10, num_samples=report.draws_for(500), progress_bar=False)
    mcmc.run(jax.random.key(1), X, y)
    check = check_run(mcmc, report, print_table=False)
    assert check.covariance.shape == (4,) and "beta[3]" in str(check)
    assert check.passed, check


@pytest.mark.slow
def test_the_diagonal_path_on_correlated_covariates():
    """``dense=False`` (what d > 1000 gets) on equicorrelated covariates (ρ = 0.6): the
    diagonal ``J`` leaves the correlations out, and the probes of ``H⁻¹``'s diagonal put them
    back. Before them the predicted sds were 20-45% narrow; the check's independent evidence
    estimates them again from fresh rows and probes."""
    case = MODELS["wide_correlated"]
    (X, y), _ = make_wide_logistic(n=20_000, d=30, rho=0.6)
    case = case._replace(make=lambda seed=0: ((X, y), {}))
    report, check, achieved, reference = recipe(case, dense=False)
    assert report.information.kind == "diagonal"
    assert np.all(np.abs(achieved / reference - 1) < 0.10), achieved / reference
    predicted = report.predicted_sd / reference
    assert np.all(np.abs(predicted - 1) < 0.10 + 3 * report.prediction_error), predicted
    assert np.max(report.correlations.inflation) > 1.5  # the correlations are there to miss
    assert check.passed, check


def test_a_hand_set_step_far_past_the_bound_is_warned():
    """SGLD with an identity preconditioner is stable for h·λmax(J) < 4; here λmax(J) is
    about 0.2, so h = 1000 is far past it: the warning gives the numbers and a step within."""
    (X, y), _ = make_wide_logistic(n=5000, d=3)
    mcmc = MCMC(SGLD(logistic, 1000.0), num_warmup=0, num_samples=5, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(jax.random.key(1), X, y)
    messages = [str(w.message) for w in caught if issubclass(w.category, StepSizeWarning)]
    assert messages and "past the stability bound" in messages[0], messages
    assert "step_size=1000" in messages[0] and "A step of" in messages[0]


def hierarchical_two_groups(y, group):
    """Two groups around a mean with a scale: a small model for the data-free treatment."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    alpha = numpyro.sample("alpha", dist.Normal(mu, tau).expand([2]).to_event(1))
    with numpyro.plate("data", y.shape[0], subsample_size=50):
        yb = numpyro.subsample(y, event_dim=0)
        gb = numpyro.subsample(group, event_dim=0)
        numpyro.sample("y", dist.Normal(alpha[gb], 1.0), obs=yb)


@pytest.mark.slow
def test_the_report_names_sites_without_a_per_datum_gradient():
    rng = np.random.default_rng(0)
    group = rng.integers(0, 2, 4000)
    y = (np.array([0.3, -0.2])[group] + rng.standard_normal(4000)).astype(np.float32)
    # mu's profile is a Gaussian's; its curvature changes with tau: the warning says which
    funnel = r"nearly a Gaussian's \(its sd [01]\.\d\dx .* moves along .* direction of tau"
    with pytest.warns(LinearizationWarning, match=funnel):
        _, report = autotune(hierarchical_two_groups, jax.random.key(0), y, group)
    assert "no per-datum gradient: mu, tau" in str(report)
    dropped = dict(report.alternatives)["P5"]
    assert isinstance(dropped, str) and "no per-datum gradient" in dropped
