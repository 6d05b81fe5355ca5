"""Bad input gets a clear error that names the problem and the fix."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC
from numpyro.infer.initialization import init_to_value

from numpyro_sgmc import SGD, SGLD, SGLDFP, ChainInit, Dense, Diagonal, layerwise, shuffle_rows
from numpyro_sgmc.diagnostics import CentreWarning, DataOrderWarning
from problems import linear_regression, make_linear_regression


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=500)


def run(kernel, problem, init_params=None, num_chains=1):
    mcmc = MCMC(
        kernel,
        num_warmup=0,
        num_samples=2,
        num_chains=num_chains,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(0), problem.X, problem.y, init_params=init_params)
    return mcmc


def no_plate_model(X, y):
    theta = numpyro.sample("theta", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ theta, 1).to_event(1), obs=y)


def full_plate_model(X, y):
    theta = numpyro.sample("theta", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ theta, 1), obs=y)


@pytest.mark.parametrize(
    "model, match",
    [(no_plate_model, "no `numpyro.plate` at all"), (full_plate_model, r"\['data'\] have no")],
)
def test_model_without_subsample_plate(problem, model, match):
    with pytest.raises(ValueError, match="no subsample plate") as err:
        run(SGLD(model, step_size=1e-3), problem)
    assert "subsample_size=100" in str(err.value)
    assert err.match(match)


def test_batch_larger_than_the_data(problem):
    with pytest.raises(ValueError, match="batch_size=501 is larger than the data.*size 500"):
        run(SGLD(linear_regression, step_size=1e-3, batch_size=501), problem)


def test_batch_size_for_an_unknown_plate(problem):
    with pytest.raises(ValueError, match=r"\['rows'\].*subsample plates are \['data'\]"):
        run(SGLD(linear_regression, step_size=1e-3, batch_size={"rows": 10}), problem)


def test_latent_variable_inside_the_subsample_plate(problem):
    def model(X, y):
        theta = numpyro.sample("theta", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=10):
            u = numpyro.sample("u", dist.Normal(0, 1))
            numpyro.sample(
                "y",
                dist.Normal(numpyro.subsample(X, 1) @ theta + u, 1),
                obs=numpyro.subsample(y, 0),
            )

    with pytest.raises(ValueError, match=r"Latent site 'u'.*marginalise.*u\[numpyro.subsample"):
        run(SGLD(model, step_size=1e-3), problem)


def test_nested_subsample_plates(problem):
    def model(X, y):
        theta = numpyro.sample("theta", dist.Normal(0, 1))
        with numpyro.plate("rows", 50, subsample_size=5, dim=-2):
            with numpyro.plate("cols", 10, subsample_size=2, dim=-1):
                numpyro.sample("y", dist.Normal(theta, 1), obs=jnp.zeros((5, 2)))

    with pytest.raises(ValueError, match="nested subsample plates"):
        run(SGLD(model, step_size=1e-3), problem)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(step_size=-1.0), ValueError, "step_size must be positive"),
        (dict(step_size=float("nan")), ValueError, "step_size must be positive"),
        (dict(step_size="big"), TypeError, "step_size must be a positive number"),
        (dict(step_size=1e-3, num_steps=0), ValueError, "num_steps must be a positive int"),
        (dict(step_size=1e-3, inverse_temperature=-2.0), ValueError, "inverse_temperature"),
        (dict(step_size=1e-3, inverse_temperature=math.inf), ValueError, "use numpyro_sgmc.SGD"),
        (dict(step_size=1e-3, batch_size=2.5), TypeError, "batch_size must be"),
        (dict(step_size=1e-3, preconditioner=np.eye(3)), TypeError, r"Dense\(matrix\)"),
        (dict(step_size="0.01"), TypeError, "step_size must be a positive number"),
        (dict(step_size=1e-3, chunk_size=0), ValueError, "chunk_size"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SGLD(linear_regression, **kwargs)


def test_sgldfp_has_no_control_variates_switch():
    with pytest.raises(TypeError, match="unexpected keyword argument 'control_variates'"):
        SGLDFP(linear_regression, step_size=1e-3, control_variates=False)


@pytest.mark.parametrize(
    "precond, match",
    [
        (Dense(np.diag([1.0, 1.0, 0.0])), "not positive definite"),
        (Dense(np.array([[1.0, 0.5, 0], [0.0, 1, 0], [0, 0, 1]])), "not symmetric"),
        (
            Dense(np.diag([1.0, np.nan, 1.0])),
            r"non-finite entries \(NaN or inf\) in row\(s\) \[1\]",
        ),
        (Dense(np.eye(4)), r"shape \(4, 4\).*d = 3"),
        (Diagonal({"theta": np.array([1.0, -1.0, 1.0])}), "entry 1 .* is -1"),
        (Diagonal({"beta": 1.0}), r"unknown: \['beta'\], missing: \['theta'\]"),
        (Diagonal({"theta": np.ones(4)}), r"shape \(4,\).*\(3,\)"),
    ],
)
def test_bad_preconditioners(problem, precond, match):
    with pytest.raises(ValueError, match=match):
        run(SGLD(linear_regression, step_size=1e-3, preconditioner=precond), problem)


def test_layerwise_takes_scalars():
    assert layerwise({"theta": 2.0}) == Diagonal({"theta": 2.0})
    with pytest.raises(ValueError, match="one scalar per site"):
        layerwise({"theta": np.ones(3)})


def test_bad_per_chain_preconditioner_names_the_chain(problem):
    bad = Dense(np.stack([np.eye(3), np.diag([1.0, 0.0, 1.0])]))
    start = {"theta": jnp.zeros((2, 3))}
    with pytest.raises(ValueError, match="ChainInit.preconditioner.*positive definite"):
        run(SGLD(linear_regression, step_size=1e-3), problem, ChainInit(start, bad), num_chains=2)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"beta": jnp.zeros(3)}, r"latent sites \['theta'\]"),
        ({"theta": jnp.zeros(4)}, r"shape \(4,\); the unconstrained site has shape \(3,\)"),
        ({"theta": jnp.array([0.0, jnp.inf, 0.0])}, "not finite at the initial position"),
    ],
)
def test_bad_init_params(problem, params, match):
    with pytest.raises(ValueError, match=match):
        run(SGLD(linear_regression, step_size=1e-3), problem, params)


def test_centre_without_control_variates(problem):
    with pytest.raises(ValueError, match="only used with control variates"):
        run(
            SGD(linear_regression, step_size=1e-3),
            problem,
            ChainInit({"theta": jnp.zeros(3)}, centre={"theta": jnp.zeros(3)}),
        )


@pytest.mark.filterwarnings("ignore:.*Out-of-support values:UserWarning")
def test_no_finite_starting_point(problem):
    def model(X, y):
        theta = numpyro.sample("theta", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=10):
            # an impossible observation: y is real but the likelihood is a Poisson count
            numpyro.sample(
                "y",
                dist.Poisson(jnp.exp(numpyro.subsample(X, 1) @ theta)),
                obs=numpyro.subsample(y, 0) + 0.5,
            )

    with pytest.raises(RuntimeError, match="No starting point with a finite potential"):
        run(SGLD(model, step_size=1e-3), problem)


@pytest.mark.slow
def test_blocks_of_sorted_rows_warn_and_shuffled_rows_do_not(problem):
    rows = np.argsort(np.asarray(problem.y))
    ordered = problem._replace(X=problem.X[rows], y=problem.y[rows])
    start = {"theta": jnp.asarray(problem.mode, jnp.float32)}
    kernel = SGLD(linear_regression, step_size=1e-3, batch_sampling="blocks")
    with pytest.warns(DataOrderWarning, match="rows look ordered.*shuffle_rows"):
        run(kernel, ordered, start)
    X, y = shuffle_rows(jax.random.key(0), ordered.X, ordered.y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataOrderWarning)
        run(kernel, ordered._replace(X=X, y=y), start)


@pytest.mark.slow
def test_centre_far_from_the_mode_warns_and_a_mode_centre_does_not(problem):
    far = {"theta": jnp.asarray(problem.mode + 1.0, jnp.float32)}
    with pytest.warns(CentreWarning, match="far from a mode"):
        run(SGLDFP(linear_regression, step_size=1e-3), problem, far)
    at_mode = init_to_value(values={"theta": jnp.asarray(problem.mode, jnp.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", CentreWarning)
        run(SGLDFP(linear_regression, step_size=1e-3, init_strategy=at_mode), problem)
