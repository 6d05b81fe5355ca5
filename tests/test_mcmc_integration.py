"""The kernels inside numpyro.infer.MCMC: chains, fields, continuation, arviz, reproducibility."""

import io
import warnings
from contextlib import redirect_stdout

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.infer import MCMC, Predictive
from numpyro.infer.initialization import init_to_value

from numpyro_sgmc import SGD, SGLD, SGLDFP, ChainInit, Dense
from numpyro_sgmc.diagnostics import DivergenceWarning
from problems import linear_regression, make_linear_regression


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=1000)


def mode_params(problem, num_chains=None):
    theta = jnp.asarray(problem.mode, jnp.float32)
    if num_chains is not None:
        theta = jnp.tile(theta, (num_chains, 1))
    return {"theta": theta}


def test_init_params_thinning_extra_fields_and_summary(problem):
    mcmc = MCMC(
        SGLD(linear_regression, step_size=1e-3, num_steps=10),
        num_warmup=20,
        num_samples=100,
        thinning=5,
        progress_bar=False,
    )
    mcmc.run(
        jax.random.key(0),
        problem.X,
        problem.y,
        init_params=mode_params(problem),
        extra_fields=("grad_norm", "i"),
    )
    theta = mcmc.get_samples()["theta"]
    assert theta.shape == (20, 3)
    # started at the mode, the chain stays within a few posterior sds of it
    sd = np.sqrt(np.diag(problem.post_cov))
    assert np.all(np.abs(np.asarray(theta) - problem.mode) < 6 * sd)
    extra = mcmc.get_extra_fields()
    assert extra["grad_norm"].shape == (20,) and np.all(np.isfinite(extra["grad_norm"]))
    assert extra["diverging"].dtype == jnp.bool_ and not extra["diverging"].any()
    # i counts iterations: warm-up 20 draws x 10, then every 5th of 100 draws x 10
    np.testing.assert_array_equal(extra["i"], 200 + 50 * np.arange(1, 21))
    out = io.StringIO()
    with redirect_stdout(out):
        mcmc.print_summary()
    assert "theta[2]" in out.getvalue() and "Number of divergences: 0" in out.getvalue()


def test_same_key_same_draws_and_init_strategy(problem):
    def run(seed):
        mcmc = MCMC(
            SGLD(
                linear_regression,
                step_size=1e-3,
                num_steps=5,
                init_strategy=init_to_value(values={"theta": jnp.asarray(problem.mode)}),
            ),
            num_warmup=0,
            num_samples=30,
            progress_bar=False,
        )
        mcmc.run(jax.random.key(seed), problem.X, problem.y)
        return np.asarray(mcmc.get_samples()["theta"])

    a, b, c = run(0), run(0), run(1)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


@pytest.mark.slow
def test_post_warmup_state_continues_the_chain(problem):
    kernel = SGLD(linear_regression, step_size=1e-3, num_steps=4)
    mcmc = MCMC(kernel, num_warmup=10, num_samples=25, progress_bar=False)
    mcmc.run(jax.random.key(0), problem.X, problem.y, init_params=mode_params(problem))
    first = mcmc.last_state
    assert int(first.i) == 4 * 35
    mcmc.post_warmup_state = mcmc.last_state
    mcmc.run(first.rng_key, problem.X, problem.y, extra_fields=("i",))
    assert int(mcmc.last_state.i) == 4 * 60
    np.testing.assert_array_equal(mcmc.get_extra_fields()["i"], 140 + 4 * np.arange(1, 26))
    # one more step from the last state, by hand, is the continuation's first draw
    manual = kernel.sample(first, (problem.X, problem.y), {})
    np.testing.assert_allclose(mcmc.get_samples()["theta"][0], manual.z["theta"], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("chain_method", ["vectorized", "sequential"])
def test_each_chain_keeps_its_own_preconditioner_and_centre(problem, chain_method):
    """Chain k of a multi-chain run equals a single-chain run given chain k's own values."""
    Jinv = np.linalg.inv(problem.J)
    precond = np.stack([np.eye(3), Jinv, 0.5 * Jinv])
    offsets = np.array([[0.0, 0.0, 0.0], [0.02, 0.0, -0.01], [-0.01, 0.03, 0.0]])
    centres = {"theta": jnp.asarray(problem.mode + offsets, jnp.float32)}
    starts = {"theta": jnp.asarray(problem.mode - offsets, jnp.float32)}
    kwargs = dict(step_size=0.05, batch_size=20, num_steps=10)
    mcmc = MCMC(
        SGLDFP(linear_regression, **kwargs),
        num_warmup=5,
        num_samples=20,
        num_chains=3,
        chain_method=chain_method,
        progress_bar=False,
    )
    key = jax.random.key(7)
    mcmc.run(
        key,
        problem.X,
        problem.y,
        init_params=ChainInit(starts, preconditioner=Dense(jnp.asarray(precond)), centre=centres),
    )
    together = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    state = mcmc.last_state
    np.testing.assert_allclose(state.params.preconditioner.matrix, precond, rtol=1e-6)
    np.testing.assert_allclose(
        state.estimator.centre.position["theta"], centres["theta"], rtol=1e-6
    )
    for k, chain_key in enumerate(jax.random.split(key, 3)):
        single = MCMC(
            SGLDFP(linear_regression, preconditioner=Dense(precond[k]), **kwargs),
            num_warmup=5,
            num_samples=20,
            progress_bar=False,
        )
        single.run(
            chain_key,
            problem.X,
            problem.y,
            init_params=ChainInit(
                {"theta": starts["theta"][k]}, centre={"theta": centres["theta"][k]}
            ),
        )
        np.testing.assert_allclose(together[k], single.get_samples()["theta"], rtol=1e-4, atol=1e-5)
    assert not np.allclose(together[0], together[1], atol=1e-3)


@pytest.mark.slow
def test_arviz_from_numpyro(problem):
    az = pytest.importorskip("arviz")
    mcmc = MCMC(
        SGLD(linear_regression, step_size=1e-3, num_steps=5),
        num_warmup=5,
        num_samples=40,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(0), problem.X, problem.y, init_params=mode_params(problem, 2))
    idata = az.from_numpyro(mcmc)
    assert idata.posterior["theta"].shape == (2, 40, 3)
    assert idata.sample_stats["diverging"].shape == (2, 40)
    summary = az.summary(idata, var_names=["theta"])
    assert np.all(np.isfinite(summary["mean"].to_numpy()))


def test_sgd_running_average_is_the_mean_of_post_warmup_iterates(problem):
    mcmc = MCMC(
        SGD(linear_regression, step_size=0.04, num_steps=1),
        num_warmup=30,
        num_samples=200,
        progress_bar=False,
    )
    mcmc.run(
        jax.random.key(0),
        problem.X,
        problem.y,
        init_params=mode_params(problem),
        extra_fields=("adaptation.average",),
    )
    draws = np.asarray(mcmc.get_samples()["theta"], np.float64)
    average = np.asarray(mcmc.last_state.adaptation.average["theta"])
    np.testing.assert_allclose(average, draws.mean(0), rtol=1e-5)
    running = np.asarray(mcmc.get_extra_fields()["adaptation.average"]["theta"])
    np.testing.assert_allclose(running[9], draws[:10].mean(0), rtol=1e-5)


def test_jit_model_args_and_predictive(problem):
    mcmc = MCMC(
        SGLD(linear_regression, step_size=1e-3, num_steps=5),
        num_warmup=5,
        num_samples=20,
        progress_bar=False,
        jit_model_args=True,
    )
    mcmc.run(jax.random.key(0), problem.X, problem.y, init_params=mode_params(problem))
    mcmc.run(jax.random.key(1), problem.X[:500], problem.y[:500], init_params=mode_params(problem))
    assert mcmc.sampler.plates["data"].size == 500
    pred = Predictive(linear_regression, mcmc.get_samples())(
        jax.random.key(2), problem.X[:10], subsample_size=10
    )
    assert pred["y"].shape == (20, 10)


def test_progress_bar_shows_divergences(problem):
    kernel = SGLD(linear_regression, step_size=1e-3, num_steps=5)
    state = kernel.init(jax.random.key(0), 0, mode_params(problem), (problem.X, problem.y), {})
    assert kernel.get_diagnostics_str(state) == "0 divergences"


@pytest.mark.filterwarnings("ignore::RuntimeWarning:numpy")  # print_summary of huge draws
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_divergence_is_flagged_warned_and_never_nan(problem):
    # h·λmax(J)/2 ≈ 20: the linearised chain is unstable and blows up to inf within the draw
    kernel = SGLD(linear_regression, step_size=20.0, num_steps=50)
    mcmc = MCMC(
        kernel,
        num_warmup=0,
        num_samples=40,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    with pytest.warns(DivergenceWarning, match=r"step_size=20") as record:
        mcmc.run(jax.random.key(0), problem.X, problem.y, init_params=mode_params(problem, 2))
    assert len(record) >= 1
    theta = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    assert np.all(np.isfinite(theta))
    diverging = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["diverging"])
    assert diverging.any(axis=1).all()
    assert int(np.sum(mcmc.last_state.num_diverging)) >= 2
    out = io.StringIO()
    with redirect_stdout(out):
        mcmc.print_summary()
    assert "Number of divergences: 0" not in out.getvalue()
    assert kernel.get_diagnostics_str(mcmc.last_state) != "0 divergences"


def test_no_divergence_no_warning(problem):
    mcmc = MCMC(
        SGLD(linear_regression, step_size=1e-3, num_steps=5),
        num_warmup=0,
        num_samples=10,
        progress_bar=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        mcmc.run(jax.random.key(0), problem.X, problem.y, init_params=mode_params(problem))
