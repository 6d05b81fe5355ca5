"""Every common mistake gets a message that names it and the fix (``docs/bad-input.md``).

One test per row of the bad-input table; each asserts what the message says. The data
errors are raised on the model's first trace, before anything compiles.
"""

import math
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import pytest
from numpyro.infer import MCMC
from user_models import hierarchical_logistic, make_hierarchical, make_two_plates, two_plates

from numpyro_sgmc import (
    SGD,
    SGHMC,
    SGLD,
    SGLDFP,
    AdaSGHMC,
    Dense,
    autotune,
    information,
    run_kernel,
    warm_start,
)
from numpyro_sgmc.data import validation
from numpyro_sgmc.data.model import prepare_model
from numpyro_sgmc.diagnostics import DivergenceWarning, PerformanceWarning, StepSizeWarning
from numpyro_sgmc.kernels.curvature import Curvature
from numpyro_sgmc.kernels.sghmc import sghmc_step_check
from numpyro_sgmc.kernels.sgld import langevin_step_check
from problems import gaussian_location, make_gaussian_location, make_linear_regression


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=5000)


def run(kernel, *data, num_samples=2, **kwargs):
    mcmc = MCMC(kernel, num_warmup=0, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.key(0), *data, **kwargs)
    return mcmc


def regression(X, y):
    """A linear regression whose plate takes its size from the data."""
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        numpyro.sample("y", dist.Normal(Xb @ theta, 1.0), obs=numpyro.subsample(y, event_dim=0))


# ---- the data -------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [[17], list(range(3, 5000, 50))], ids=["one", "two-percent"])
def test_nan_labels_are_named_with_their_rows_before_sampling(problem, rows):
    y = np.array(problem.y)
    y[rows] = np.nan
    with pytest.raises(ValueError) as err:
        run(SGLD(regression, 1e-3), problem.X, y)
    message = str(err.value)
    assert (
        f"argument 'y' (position 1) has NaN or infinite values in {len(rows)} of its 5000 rows"
        in message
    )
    assert f"the first at row {rows[0]}" in message
    assert "keep = np.isfinite(y)" in message and "impute" in message
    assert "no step size fixes it" in message


def masked_regression(X, y, factor=False):
    """:func:`regression` with its missing labels (NaN) masked by NumPyro's ``mask``, or
    (``factor``) by a ``jnp.where`` over a log density computed on them: its gradient is NaN."""
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb, yb = numpyro.subsample(X, event_dim=1), numpyro.subsample(y, event_dim=0)
        seen, d = jnp.isfinite(yb), dist.Normal(Xb @ theta, 1.0)
        if factor:
            numpyro.factor("y", jnp.where(seen, d.log_prob(yb), 0.0))
        else:
            numpyro.sample("y", d.mask(seen), obs=yb)


def test_labels_the_model_masks_are_the_data_without_them(problem):
    X, y = np.asarray(problem.X), np.array(problem.y)
    missing = np.arange(1000, 5000, 7)  # none in the first batch: the start is not at fault
    y[missing] = np.nan
    kept = np.isfinite(y)
    _, report = autotune(masked_regression, jax.random.key(0), X, y)
    _, dropped = autotune(regression, jax.random.key(0), X[kept], y[kept])
    np.testing.assert_allclose(report.covariance, dropped.covariance, rtol=1e-3, atol=1e-9)
    draws = run(SGLD(masked_regression, 1e-4), X, y).get_samples()["theta"]
    assert np.all(np.isfinite(draws))
    for model, what in [
        (regression, "The model's potential is not finite on a batch of those rows"),
        (
            partial(masked_regression, factor=True),
            "potential is finite on a batch of those rows, its gradient is not",
        ),
    ]:
        with pytest.raises(ValueError) as err:
            run(SGLD(model, 1e-4), X, y)
        message = str(err.value)
        assert f"has NaN or infinite values in {len(missing)} of its 5000 rows" in message
        assert what in message
        assert "`d.mask(seen)` replaces them before the log density" in message


def test_masked_labels_past_a_files_first_rows_are_let_through(problem, tmp_path, monkeypatch):
    # a file's rows past its first are checked by the warm start's pass, after the first trace
    monkeypatch.setattr(validation, "_FIRST_ROWS", 1000)
    X, y = np.asarray(problem.X), np.array(problem.y)
    y[3000::11] = np.nan
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    files = [np.load(tmp_path / name, mmap_mode="r") for name in ("X.npy", "y.npy")]
    _, report = autotune(masked_regression, jax.random.key(0), *files)
    _, in_memory = autotune(masked_regression, jax.random.key(0), X, y)
    np.testing.assert_allclose(report.covariance, in_memory.covariance, rtol=1e-3, atol=1e-9)
    with pytest.raises(ValueError, match="The model's potential is not finite on a batch of"):
        autotune(regression, jax.random.key(0), *files)


def test_masked_labels_in_two_plates_leave_the_exact_posterior_of_the_rest():
    rng = np.random.default_rng(0)
    y1, y2 = rng.normal(1.0, 1.0, 3000), rng.normal(-1.0, 1.0, 2000)
    y1[500::9], y2[700::5] = np.nan, np.nan

    def two_means(y1, y2, masked=True):
        m = numpyro.sample("m", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        with numpyro.plate("a", y1.shape[0], subsample_size=100):
            b = numpyro.subsample(y1, event_dim=0)
            d = dist.Normal(m[0], 1.0)
            numpyro.sample("y1", d.mask(jnp.isfinite(b)) if masked else d, obs=b)
        with numpyro.plate("b", y2.shape[0], subsample_size=50):
            b = numpyro.subsample(y2, event_dim=0)
            numpyro.sample("y2", dist.Normal(m[1], 1.0).mask(jnp.isfinite(b)), obs=b)

    _, report = autotune(two_means, jax.random.key(0), y1, y2)
    seen = np.array([np.isfinite(y1).sum(), np.isfinite(y2).sum()])
    np.testing.assert_allclose(report.predicted_sd, 1 / np.sqrt(seen + 1 / 25), rtol=1e-3)
    with pytest.raises(ValueError, match="'y1' .* The model's potential is not finite on a"):
        autotune(two_means, jax.random.key(0), y1, y2, model_kwargs={"masked": False})


def test_a_table_of_group_covariates_with_nan_the_model_masks_is_let_through():
    rng = np.random.default_rng(0)
    n, num_groups = 5000, 20
    group = rng.integers(0, num_groups, n).astype(np.int32)
    covariate = rng.normal(size=num_groups).astype(np.float32)
    covariate[[3, 7]] = np.nan  # two groups' covariate unknown: the model sets it to 0
    y = (rng.normal(size=n) + np.nan_to_num(covariate)[group]).astype(np.float32)

    def groups(group, covariate, y):
        b = numpyro.sample("b", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        w = jnp.where(jnp.isfinite(covariate), covariate, 0.0)
        with numpyro.plate("rows", group.shape[0], subsample_size=100):
            gb, yb = numpyro.subsample(group, event_dim=0), numpyro.subsample(y, event_dim=0)
            numpyro.sample("y", dist.Normal(b[0] + b[1] * w[gb], 1.0), obs=yb)

    _, report = autotune(groups, jax.random.key(0), group, covariate, y)
    design = np.column_stack([np.ones(n), np.nan_to_num(covariate)[group]])
    exact = np.sqrt(np.diag(np.linalg.inv(design.T @ design + np.eye(2) / 25)))
    np.testing.assert_allclose(report.predicted_sd, exact, rtol=1e-3)


def test_nan_covariates_and_autotune(problem):
    X = np.array(problem.X)
    X[4321, 2] = np.inf
    with pytest.raises(ValueError) as err:
        autotune(regression, jax.random.key(0), X, problem.y)
    message = str(err.value)
    assert "argument 'X' (position 0) has NaN or infinite values in 1 of its 5000 rows" in message
    assert "the first at row 4321" in message
    assert "keep = np.isfinite(X).all(axis=1)" in message
    assert "optimizer of autotune would diverge" in message


@pytest.mark.parametrize("entry", [np.nan, -np.inf])
def test_a_non_finite_row_of_data_put_on_the_device_is_named_by_autotune_and_run_kernel(entry):
    """Covariates over 1 MB are copied to the device once; their data check reads the host
    copy (no program of its own) and still names the row, in autotune and in run_kernel."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((30_000, 10)).astype(np.float32)  # 1.2 MB
    y = (X.sum(axis=1) + rng.standard_normal(30_000)).astype(np.float32)
    kernel, _ = autotune(regression, jax.random.key(0), X, y)
    X[27_183, 4] = entry
    for call in (
        lambda: autotune(regression, jax.random.key(0), X, y),
        lambda: run_kernel(kernel, jax.random.key(1), X, y, num_samples=10),
    ):
        with pytest.raises(ValueError) as err:
            call()
        message = str(err.value)
        assert "argument 'X' (position 0) has NaN or infinite values in 1 of its 30000" in message
        assert "the first at row 27183" in message


def test_more_rows_in_a_batch_than_in_the_data(problem):
    with pytest.raises(ValueError) as err:
        run(SGLD(regression, 1e-3), problem.X[:50], problem.y[:50])
    message = str(err.value)
    assert "Plate 'data' has 50 rows but subsample_size=100" in message
    assert "subsample_size=min(100, X.shape[0])" in message
    assert "full-data gradients" in message


def test_a_batch_of_no_rows_names_the_option_it_came_from(problem):
    def empty_batches(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=0):
            Xb, yb = numpyro.subsample(X, event_dim=1), numpyro.subsample(y, event_dim=0)
            numpyro.sample("y", dist.Normal(Xb @ theta, 1.0), obs=yb)

    with pytest.raises(ValueError, match=r"numpyro.plate\('data', ..., subsample_size=0\): a "):
        autotune(empty_batches, jax.random.key(0), problem.X, problem.y)
    with pytest.raises(ValueError, match="batch_size=0 for plate 'data': a batch must be"):
        autotune(regression, jax.random.key(0), problem.X, problem.y, batch_size={"data": 0})


def test_a_model_keyword_passed_as_mcmc_run_takes_it_names_model_kwargs(problem):
    """``MCMC.run(key, X, y, offset=...)`` passes keywords to the model; autotune and
    run_kernel have options of their own, and an unknown keyword names ``model_kwargs``."""
    for call in (
        lambda: autotune(regression, jax.random.key(0), problem.X, problem.y, offset=1.0),
        lambda: run_kernel(
            SGLD(regression, 1e-3), jax.random.key(0), problem.X, problem.y, num_samples=5,
            offset=1.0,
        ),
    ):  # fmt: skip
        with pytest.raises(TypeError, match=r"keyword argument\(s\) 'offset' that are not its "):
            call()
    with pytest.raises(TypeError, match=r"autotune\(..., model_kwargs=\{'offset': ...\}\)"):
        autotune(regression, jax.random.key(0), problem.X, problem.y, offset=1.0)


def test_batch_of_all_rows_is_full_data_gradients(problem):
    X, y = problem.X[:100], problem.y[:100]
    kernel = SGD(regression, 1e-2, num_steps=5)
    start = {"theta": jnp.zeros(3)}
    first = run(kernel, X, y, init_params=start).get_samples()["theta"]
    assert kernel.plates["data"].batch_size == kernel.plates["data"].size == 100
    # SGD injects no noise: with the full data in every batch, another key gives the same chain
    again = MCMC(kernel, num_warmup=0, num_samples=2, progress_bar=False)
    again.run(jax.random.key(5), X, y, init_params=start)
    np.testing.assert_array_equal(again.get_samples()["theta"], first)


def test_no_rows(problem):
    with pytest.raises(ValueError) as err:
        run(SGLD(regression, 1e-3), problem.X[:0], problem.y[:0])
    message = str(err.value)
    assert "A numpyro.plate of the model has size 0: there are no data to sample from" in message
    assert "argument 'X' (position 0) has shape (0, 3)" in message


def test_plate_longer_than_the_data_it_indexes(problem):
    def indexing(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with numpyro.plate("data", 8000, subsample_size=100) as idx:
            numpyro.sample("y", dist.Normal(X[idx] @ theta, 1.0), obs=y[idx])

    with pytest.raises(ValueError) as err:
        run(SGLD(indexing, 1e-3), problem.X, problem.y)
    message = str(err.value)
    assert "indexes an array past its end with the indices of subsample plate 'data'" in message
    assert "out-of-bounds indexing for array of shape (5000, 3)" in message
    assert "JAX clamps such indices" in message


def test_plate_whose_size_is_not_the_subsampled_data_length(problem):
    def fixed_size(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with numpyro.plate("data", 8000, subsample_size=100):
            Xb = numpyro.subsample(X, event_dim=1)
            numpyro.sample("y", dist.Normal(Xb @ theta, 1.0), obs=numpyro.subsample(y, 0))

    with pytest.raises(ValueError) as err:
        run(SGLD(fixed_size, 1e-3), problem.X, problem.y)
    message = str(err.value)
    assert "Plate 'data' has size 8000" in message
    assert "argument 'X' (position 0) of shape (5000, 3) subsamples its axis 0" in message
    assert "numpyro.plate('data', X.shape[0], ...)" in message


def test_labels_one_row_shorter_than_the_covariates(problem):
    with pytest.raises(ValueError) as err:
        run(SGLD(regression, 1e-3), problem.X, problem.y[:-1])
    message = str(err.value)
    assert (
        "Plate 'data' has size 5000, the number of rows of argument 'X' (position 0), but "
        "argument 'y' (position 1), which numpyro.subsample takes in that plate, has 4999 rows"
    ) in message
    assert "the per-row arrays of a plate must have the same number of rows" in message
    assert "X[keep], y[keep]" in message
    assert "X.shape[0]" not in message  # the plate is sized by the data already


def indexed_regression(size, flat=False):
    """A regression that indexes its data with the indices of a plate of ``size`` rows, its
    prior normal or flat (an ImproperUniform, which has no sampler)."""

    def model(X, y, prior_scale):
        normal = dist.Normal(0.0, prior_scale).to_event(1)
        prior = dist.ImproperUniform(normal.support, (), normal.event_shape) if flat else normal
        theta = numpyro.sample("theta", prior)
        with numpyro.plate("data", size(X), subsample_size=100) as idx:
            numpyro.sample("y", dist.Normal(X[idx] @ theta, 1.0), obs=y[idx])

    return model


@pytest.mark.parametrize("flat", [False, True])
def test_hand_indexed_plate_smaller_than_the_data(problem, flat):
    half = indexed_regression(lambda X: X.shape[0] // 2, flat)
    with pytest.raises(ValueError) as err:
        run(SGLD(half, 1e-3), problem.X, problem.y, jnp.full(3, 10.0))
    message = str(err.value)
    assert (
        "Subsample plate 'data' has size 2500, but the model indexes argument 'X' (position 0) "
        "of 5000 rows, argument 'y' (position 1) of 5000 rows with its indices"
    ) in message
    assert "which reach row 2499 at most: rows 2500 to 4999 are never used" in message
    assert "scaled by 2500/100 instead of 5000/100" in message
    assert "numpyro.plate('data', X.shape[0], subsample_size=100)" in message
    # sized by the data, the same model samples; its (3,) prior scale is no per-row argument
    whole = indexed_regression(lambda X: X.shape[0], flat)
    assert run(SGLD(whole, 1e-4), problem.X, problem.y, jnp.full(3, 10.0)).get_samples()


def indexed_hierarchical(X, group, y=None, num_groups=20):
    """tests/user_models.py's hierarchical_logistic, indexing its rows itself: the group
    intercepts are looked up with the batch's groups, ``alpha[group[idx]]``."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    alpha = numpyro.sample("alpha", dist.Normal(mu, tau).expand([num_groups]).to_event(1))
    beta = numpyro.sample("beta", dist.Normal(0.0, 5.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100) as idx:
        logits = alpha[group[idx]] + X[idx] @ beta
        numpyro.sample("y", dist.Bernoulli(logits=logits), obs=y[idx])


def indexed_two_plates(X, y, counts, z):
    """tests/user_models.py's two_plates, indexing both of its plates (30,000 and 12,000
    rows) itself."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 3.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(3.0))
    rate = numpyro.sample("rate", dist.Normal(0.0, 3.0))
    with numpyro.plate("rows", X.shape[0], subsample_size=100) as i:
        numpyro.sample("y", dist.Normal(X[i] @ beta, sigma), obs=y[i])
    with numpyro.plate("visits", counts.shape[0], subsample_size=40) as j:
        numpyro.sample("z", dist.Poisson(jnp.exp(rate + counts[j] @ beta)), obs=z[j])


def grouped_summaries(X, y, group_means, num_groups=20):
    """A subsample plate over 20 groups (their observed means) beside one over the rows."""
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 1.0).expand([num_groups]).to_event(1))
    beta = numpyro.sample("beta", dist.Normal(0.0, 5.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", num_groups, subsample_size=5) as g:
        numpyro.sample("m", dist.Normal(alpha[g], 0.1), obs=group_means[g])
    with numpyro.plate("data", X.shape[0], subsample_size=100) as idx:
        numpyro.sample("y", dist.Normal(X[idx] @ beta, 1.0), obs=y[idx])


def lagged(y):
    """An AR(1) model over its n - 1 transitions: a plate one row shorter than ``y`` whose
    indices reach every row of it (``y[idx]`` and ``y[idx + 1]``)."""
    rho = numpyro.sample("rho", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", y.shape[0] - 1, subsample_size=100) as idx:
        numpyro.sample("y", dist.Normal(rho * y[idx], 1.0), obs=y[idx + 1])


def test_plates_of_other_sizes_than_the_rows_are_not_refused():
    # JAX arrays: a model indexes them with traced indices (X[idx] of a NumPy X cannot)
    data, kwargs = make_hierarchical(n=2000)
    X, group, y = jax.tree.map(jnp.asarray, data)
    two = jax.tree.map(jnp.asarray, make_two_plates(n1=3000, n2=1200)[0])
    sizes = {"rows": 3000, "visits": 1200}
    models = [  # (model, args, kwargs, its plates' sizes)
        (hierarchical_logistic, (X, group, y), kwargs, {"data": 2000}),
        (indexed_hierarchical, (X, group, y), kwargs, {"data": 2000}),
        (two_plates, two, {}, sizes),
        (indexed_two_plates, two, {}, sizes),
        (grouped_summaries, (X, y, jnp.zeros(20)), {}, {"groups": 20, "data": 2000}),
        (lagged, (y,), {}, {"data": 1999}),
    ]
    for model, args, kw, plates in models:
        # every check on the data is made here, where a kernel's init makes it
        prepared = prepare_model(jax.random.key(0), model, args, kw)
        assert {p.name: p.size for p in prepared.plates} == plates, model.__name__


def test_forgotten_subsample(problem):
    def whole(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=100):
            numpyro.sample("y", dist.Normal(X @ theta, 1.0), obs=y)

    with pytest.raises(ValueError) as err:
        run(SGLD(whole, 1e-3), problem.X, problem.y)
    message = str(err.value)
    assert "Site 'y' inside subsample plate 'data' (size 5000, subsample_size 100)" in message
    assert "an array with all 5000 rows is used inside the plate" in message
    assert "Xb = numpyro.subsample(X, event_dim=1)" in message


def test_likelihood_outside_the_subsample_plate(problem):
    def outside(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=100):
            pass
        numpyro.sample("y", dist.Normal(X @ theta, 1.0).to_event(1), obs=y)

    with pytest.warns(PerformanceWarning) as record:
        SGLD(outside, 1e-3).init(jax.random.key(0), 0, None, (problem.X, problem.y), {})
    message = str(record[0].message)
    assert "Observed site 'y' lies outside the subsample plate 'data'" in message
    assert "O(n) per step, not O(b)" in message
    assert "the plate holds no observed site" in message
    assert "information matrix I is then singular" in message


def test_column_of_labels(problem):
    with pytest.raises(ValueError) as err:
        run(SGLD(regression, 1e-3), problem.X, problem.y[:, None])
    message = str(err.value)
    assert "argument 'y' (position 1) of shape (5000, 1) subsamples nothing" in message
    assert "y.reshape(-1)" in message

    def event_column(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=100):
            Xb, yb = numpyro.subsample(X, event_dim=1), numpyro.subsample(y, event_dim=1)
            numpyro.sample("y", dist.Normal(Xb @ theta, 1.0), obs=yb)

    with pytest.raises(ValueError) as err:
        run(SGLD(event_column, 1e-3), problem.X, problem.y[:, None])
    message = str(err.value)
    assert (
        "has an observation of shape (100, 1) for a distribution of batch shape (100,)" in message
    )
    assert "broadcast to (100, 100)" in message


def test_an_event_dim_past_the_plates_dimension_names_the_one_that_fits(problem):
    def two_outputs(X, Y, event_dim=1):  # rows at dim -2, outputs at -1: X's rows are at -2
        W = numpyro.sample("W", dist.Normal(0.0, 3.0).expand([3, 2]).to_event(2))
        with numpyro.plate("data", X.shape[0], subsample_size=100, dim=-2):
            Xb = numpyro.subsample(X, event_dim=event_dim)
            Yb = numpyro.subsample(Y, event_dim=0)
            with numpyro.plate("outputs", 2, dim=-1):
                numpyro.sample("Y", dist.Normal(Xb @ W, 1.0), obs=Yb)

    Y = np.stack([problem.y, problem.y], axis=1)
    with pytest.raises(ValueError) as err:
        run(SGLD(two_outputs, 1e-3), problem.X, Y)
    message = str(err.value)
    assert "argument 'X' (position 0) of shape (5000, 3) subsamples nothing" in message
    assert "it has no axis -3 for the plate" in message
    assert "its rows are along axis 0: pass event_dim=0" in message
    fixed = run(SGLD(partial(two_outputs, event_dim=0), 1e-3), problem.X, Y)
    assert np.all(np.isfinite(fixed.get_samples()["W"]))


def test_discrete_latent_site(problem):
    def discrete(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        with numpyro.plate("data", X.shape[0], subsample_size=100):
            Xb = numpyro.subsample(X, event_dim=1)
            numpyro.sample("y", dist.Normal(Xb @ theta + k, 1.0), obs=numpyro.subsample(y, 0))

    with pytest.raises(ValueError) as err:
        run(SGLD(discrete, 1e-3), problem.X, problem.y)
    message = str(err.value)
    assert "Latent site 'k' is discrete" in message
    assert "the SG kernels sample continuous sites only" in message
    assert "Marginalise it out" in message and "numpyro.handlers.condition" in message


def test_pandas_lists_and_numpy_dtypes_give_the_same_draws(problem):
    X, y = np.asarray(problem.X), np.asarray(problem.y)
    kernel = SGLD(regression, 1e-4, num_steps=3)
    reference = run_kernel(kernel, jax.random.key(1), X, y, num_samples=3).samples["theta"]
    frame = pd.DataFrame(X, columns=["a", "b", "c"])
    for data in [
        (frame, pd.Series(y)),
        (X.tolist(), y.tolist()),
        (X.astype(np.float64), y.astype(np.float64)),
    ]:
        got = run_kernel(kernel, jax.random.key(1), *data, num_samples=3).samples["theta"]
        np.testing.assert_allclose(got, reference, rtol=1e-6)
    mcmc = run(kernel, frame, pd.Series(y), num_samples=3)  # MCMC(jit_model_args=False)
    assert mcmc.get_samples()["theta"].shape == (3, 3)
    frame["name"] = "a"
    with pytest.raises(TypeError) as err:
        run(kernel, frame, y)
    assert "argument 'X' (position 0) is a pandas DataFrame that is not numeric" in str(err.value)
    assert "non-numeric columns ['name']" in str(err.value)
    frame = frame.drop(columns="name")  # the public functions that take data convert it too
    start = warm_start(regression, jax.random.key(0), frame, pd.Series(y), num_epochs=1)
    same = warm_start(regression, jax.random.key(0), X, y, num_epochs=1)
    np.testing.assert_allclose(start.params["theta"], same.params["theta"], rtol=1e-6)
    params = {"theta": same.params["theta"][0]}
    got = information(regression, jax.random.key(0), frame, pd.Series(y), params=params)
    np.testing.assert_allclose(
        got.J, information(regression, jax.random.key(0), X, y, params=params).J, rtol=1e-6
    )


def grouped_logistic(group, y):
    effect = numpyro.sample("effect", dist.Normal(0, 2).expand([4]).to_event(1))
    with numpyro.plate("rows", group.shape[0], subsample_size=50):
        g = numpyro.subsample(group, event_dim=0)
        yb = numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=effect[g]), obs=yb)


def test_pandas_integer_group_indices_stay_integers():
    """A pandas integer column indexing group effects (int64, nullable Int64, a category's
    int8 codes) and a boolean or nullable outcome give the draws of the NumPy arrays; they
    were made float and the model's indexing raised JAX's bare "Indexer must have integer or
    boolean type". A categorical is refused, naming its codes."""
    rng = np.random.default_rng(0)
    group = rng.integers(0, 4, 400)
    y = (rng.random(400) < 0.3 + 0.1 * group).astype(np.float32)
    kernel = SGLD(grouped_logistic, 1e-3)
    reference = run_kernel(kernel, jax.random.key(1), group, y, num_samples=3).samples["effect"]
    categories = pd.Series(pd.Categorical(np.array(list("abcd"))[group]))
    for data in [
        (pd.Series(group), pd.Series(y)),
        (pd.Series(group).astype("Int64"), pd.Series(y.astype(bool))),
        (categories.cat.codes, pd.Series(y.astype(int)).astype("Int64")),
    ]:
        got = run_kernel(kernel, jax.random.key(1), *data, num_samples=3).samples["effect"]
        np.testing.assert_allclose(got, reference, rtol=1e-6)
    # one-hot columns, sparse ones too (pd.get_dummies(..., sparse=True)), are their numbers
    (dummies,), _ = validation.as_arrays(
        lambda X: X, (pd.get_dummies(categories, sparse=True),), {}
    )
    np.testing.assert_array_equal(dummies, np.eye(4, dtype=bool)[group])
    with pytest.raises(TypeError) as err:
        run_kernel(kernel, jax.random.key(1), categories, y, num_samples=3)
    assert "argument 'group' (position 0) is a pandas Series that is not numeric" in str(err.value)
    assert "x.cat.codes.to_numpy()" in str(err.value)


def test_dense_preconditioner_with_nan(problem):
    bad = Dense(np.diag([1.0, np.nan, 1.0]))
    with pytest.raises(ValueError) as err:
        run(SGLD(regression, 1e-3, preconditioner=bad), problem.X, problem.y)
    assert "non-finite entries (NaN or inf) in row(s) [1]" in str(err.value)


# ---- options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: SGLD(regression, "0.01"), "step_size must be a positive number"),
        (lambda p: SGLD(regression, 1e-3, init_strategy="median"), "init_strategy must be"),
        (
            lambda p: autotune(regression, jax.random.key(0), p.X, p.y, learning_rate=-0.1),
            "learning_rate must be positive and finite, got -0.1",
        ),
        (
            lambda p: autotune(regression, jax.random.key(0), p.X, p.y, min_batch_size=0),
            "min_batch_size must be a positive int, got 0",
        ),
        (
            lambda p: autotune(regression, jax.random.key(0), p.X, p.y, max_step="1"),
            r"max_step \(the bound on h·λmax\(ΓJ\)\) must be a number in \(0, 4\), got '1'",
        ),
        (
            lambda p: autotune(regression, jax.random.key(0), p.X, p.y, num_steps=2.5),
            "num_steps must be a positive int or None, got 2.5",
        ),
        (
            lambda p: warm_start(regression, jax.random.key(0), p.X, p.y, learning_rate="0.1"),
            "learning_rate must be a positive number, got '0.1'",
        ),
        (
            lambda p: run_kernel(
                SGLD(regression, 1e-3),
                jax.random.key(0),
                p.X,
                p.y,
                num_samples=5,
                checkpoint="somewhere",
            ),  # fmt: skip
            "checkpoint .* and checkpoint_every .* go together",
        ),
    ],
    ids=[
        "step_size",
        "init_strategy",
        "learning_rate",
        "min_batch_size",
        "max_step",
        "num_steps",
        "warm_start",
        "checkpoint",
    ],  # fmt: skip
)
def test_wrong_option_values_are_refused_by_name(problem, call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call(problem)


def test_an_adapted_mass_is_not_judged_at_its_initial_value(problem):
    data = ((problem.X, problem.y), {})
    with pytest.warns(StepSizeWarning, match="stationary sd is predicted .* larger"):
        SGHMC(regression, 1e-2).init(jax.random.key(0), 10, None, *data)
    # AdaSGHMC keeps its draws with the mass it adapts during warm-up, not the identity the
    # check sees at the start: the predicted widening is computed but not reported
    kernel = AdaSGHMC(regression, 1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepSizeWarning)
        kernel.init(jax.random.key(0), 10, None, *data)
    assert kernel.step_check.inflation > 0.1
    # the stability bound holds from the first iteration, whatever the mass becomes
    with pytest.warns(StepSizeWarning, match="past the stability bound"):
        AdaSGHMC(regression, 10.0).init(jax.random.key(0), 10, None, *data)


def stationary_sd_ratio(Kernel, problem, h):
    """``(σ/σ*, its standard error, the step-size warning, the kernel)`` of ``Kernel(h)`` on
    ``gaussian_location``, along the stiffest direction of ``J``, from 8 chains started at the
    mode (each chain's variance an independent estimate)."""
    lams, vectors = np.linalg.eigh(problem.J)
    v, tau = vectors[:, -1], 2.0 / (h * lams[0])  # the slowest direction's relaxation time
    kernel = Kernel(gaussian_location, h, num_steps=max(1, int(tau / 20)))
    mcmc = MCMC(kernel, num_warmup=100, num_samples=4000, num_chains=8,
                chain_method="vectorized", progress_bar=False)  # fmt: skip
    start = jnp.tile(jnp.asarray(problem.mode, jnp.float32), (8, 1))
    with pytest.warns(StepSizeWarning) as record:
        mcmc.run(jax.random.key(0), problem.W, problem.L, init_params={"theta": start})
    (message,) = [str(w.message) for w in record if w.category is StepSizeWarning]
    draws = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"], np.float64) @ v
    ratio = draws.var(axis=1) / (v @ problem.post_cov @ v)
    return np.sqrt(ratio.mean()), np.sqrt(ratio).std(ddof=1) / np.sqrt(8), message, kernel


@pytest.mark.parametrize("stability", [1.0, 3.0], ids=["moderate", "large"])
def test_the_step_size_warning_states_the_measured_widening(stability):
    # control variates on a Gaussian model leave no gradient noise: the warning's number rests
    # on λmax alone, which the check finds exactly in 2-d; the run's sd along the stiffest
    # direction must be that much larger than the posterior's
    problem = make_gaussian_location(n=1000)
    h = stability / np.linalg.eigvalsh(problem.J)[-1]
    measured, se, message, kernel = stationary_sd_ratio(SGLDFP, problem, h)
    stated = kernel.step_check.inflation
    assert f"stationary sd is predicted {100 * stated:.0f}% larger than the target's" in message
    assert abs(1 + stated - measured) < 4 * se + 0.005, (stated, measured, se)


@pytest.mark.parametrize(
    "Kernel, stability",
    [(SGLD, 0.36), (SGLD, 3.6), pytest.param(SGHMC, 0.5, marks=pytest.mark.slow)],
    ids=["SGLD-moderate", "SGLD-large", "SGHMC"],
)
def test_the_predicted_widening_with_gradient_noise_is_the_measured_one(Kernel, stability):
    # with minibatch noise the prediction's inputs are the check's estimates of λmax and of
    # r = tr(I)/tr(J) (32 batches: about 20% error); given their exact values it is the run's
    problem = make_gaussian_location(n=1000)
    lam = np.linalg.eigvalsh(problem.J)[-1]
    h = stability / lam
    found = Curvature(1.1 * lam, np.trace(problem.I) / np.trace(problem.J))
    if Kernel is SGLD:
        predicted = langevin_step_check(h, found, 50, 1000.0, False).inflation
    else:  # the default momentum_decay 0.1, temperature 1
        predicted = sghmc_step_check(h, found, 1000, 50, 1.0, 0.1, False).inflation
    measured, se, message, _ = stationary_sd_ratio(Kernel, problem, h)
    assert abs(1 + predicted - measured) < 4 * se, (predicted, measured, se)
    assert "stationary sd is predicted" in message


# ---- divergences ----------------------------------------------------------------------------


def positive_scale(X, y):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.deterministic("precision", 1.0 / sigma**2)
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        numpyro.sample("y", dist.Normal(Xb @ theta, sigma), obs=numpyro.subsample(y, 0))


def exp_of_a_coefficient(X, y):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
    numpyro.deterministic("odds", jnp.exp(20.0 * theta))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        numpyro.sample("y", dist.Normal(Xb @ theta, 1.0), obs=numpyro.subsample(y, 0))


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.StepSizeWarning")
@pytest.mark.parametrize(
    "model", [positive_scale, pytest.param(exp_of_a_coefficient, marks=pytest.mark.slow)]
)
def test_no_infinite_or_nan_draw_of_any_site(problem, model):
    with pytest.warns(DivergenceWarning):
        mcmc = run(SGLD(model, 1000.0, num_steps=10), problem.X, problem.y, num_samples=20)
    samples = mcmc.get_samples()
    assert set(samples) >= {"theta"}
    for name, value in samples.items():
        assert np.all(np.isfinite(np.asarray(value))), name


def location(y):
    """A normal location model: the potential is ``(n + 1) μ² / 2`` at ``y = 0``."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", y.shape[0], subsample_size=y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=numpyro.subsample(y, event_dim=0))


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.StepSizeWarning")
def test_divergence_names_the_iteration_it_happened_at():
    # A divergence by construction, not by chaos: every row's gradient is the same, so SGLD's
    # update is μ' = -G μ + sqrt(h/n) ξ with G = hλ/2 - 1 = 1.1e6 (λ = (n + 1)/n on the
    # average-gradient scale) and |μ_k| ≈ G^k |μ_0|: the state first overflows float32 at
    # the first k with G^k |μ_0| > its largest value (k = 7). Every value computed at
    # iteration k - 1 is below it by a factor of over 500, and the proposal of iteration k
    # above it by over 500: no noise, rounding or fusion of another CPU moves that iteration.
    y, h, mu = jnp.zeros(10), 2e6, 0.1
    growth = h * (y.shape[0] + 1) / y.shape[0] / 2 - 1
    expected = math.ceil(math.log(float(np.finfo(np.float32).max) / mu) / math.log(growth))
    start = {"mu": jnp.array(mu)}
    # every iterate kept: the first flagged draw is the first rejected iteration
    each = MCMC(SGLD(location, h, num_steps=1), num_warmup=0, num_samples=2 * expected,
                progress_bar=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DivergenceWarning)
        each.run(jax.random.key(2), y, init_params=start)
    flagged = np.flatnonzero(np.asarray(each.get_extra_fields()["diverging"]))
    first = int(flagged[0]) + 1
    assert first == expected
    # the same chain in draws of k // 2 + 1 iterations: iteration k lies inside draw 2, neither
    # its first nor its last iteration (k >= 5), and the message names that iteration
    num_steps = first // 2 + 1
    draws = MCMC(SGLD(location, h, num_steps=num_steps), num_warmup=0, num_samples=3,
                 progress_bar=False)  # fmt: skip
    with pytest.warns(DivergenceWarning) as record:
        draws.run(jax.random.key(2), y, init_params=start)
    (message,) = [str(w.message) for w in record if w.category is DivergenceWarning]
    assert (
        f"at iteration {first} (warm-up included; in draw 2, of {num_steps} iterations each)"
        in message
    )
