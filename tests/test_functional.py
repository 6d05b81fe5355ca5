"""The kernels as data: the functional ``(init, step)`` view, tuning attached through the
public API, and pickling before and after ``init``."""

import ast
import pickle
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.infer import MCMC

from numpyro_sgmc import SGD, SGHMC, SGLD, SGLDFP, AdaSGHMC, autotune
from numpyro_sgmc.kernels import Family, Recipe
from problems import linear_regression, make_linear_regression

KERNELS = [
    (SGLD, dict(step_size=1e-3)),
    (SGLDFP, dict(step_size=1e-3)),
    (SGD, dict(step_size=1e-3)),
    (SGHMC, dict(step_size=1e-3)),
    (AdaSGHMC, dict(step_size=1e-3, adaptation_window=50)),
]


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=1000)


@pytest.fixture(scope="module")
def tuned(problem):
    """autotune's kernel and report for the posterior."""
    return autotune(linear_regression, jax.random.key(0), problem.X, problem.y)


def mode(problem):
    return {"theta": jnp.asarray(problem.mode, jnp.float32)}


def run(kernel, problem, key=1, num_samples=200, num_warmup=20):
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.key(key), problem.X, problem.y, init_params=mode(problem))
    return np.asarray(mcmc.get_samples()["theta"])


def test_a_hand_loop_over_the_functional_kernel_makes_the_mcmc_draws(problem):
    kernel = SGLD(linear_regression, step_size=1e-3, num_steps=1)
    data = (problem.X, problem.y)
    state = kernel.init(jax.random.key(1), 0, mode(problem), data, {})
    init, step = kernel.functional()

    def one(state, _):
        state = step(state, data, {})
        return state, state.z["theta"]

    _, hand = jax.jit(lambda s: jax.lax.scan(one, s, length=300))(state)
    mcmc = MCMC(
        SGLD(linear_regression, step_size=1e-3, num_steps=1),
        num_warmup=0,
        num_samples=300,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(1), *data, init_params=mode(problem))
    np.testing.assert_allclose(hand, mcmc.get_samples()["theta"], rtol=1e-4, atol=1e-5)
    # the pure init starts a chain from any position with the state's parameters
    again = init(jax.random.key(2), state.z, state.params, data, {})
    assert int(again.i) == 0 and again.params is state.params
    assert jax.tree.structure(again) == jax.tree.structure(state)


def test_every_kernel_is_a_recipe_over_a_family(problem):
    for cls, kwargs in KERNELS:
        kernel = cls(linear_regression, **kwargs)
        assert isinstance(kernel.recipe, Recipe) and isinstance(kernel.family, Family)
        assert kernel.recipe.name == cls.__name__
        assert kernel.config is None and kernel.tuned is None
        assert kernel.subsampled_model is linear_regression
    first, second = SGLD(linear_regression, 1e-3), SGHMC(linear_regression, 1e-3)
    assert first.family is SGD(linear_regression, 1e-3).family is not second.family
    first.init(jax.random.key(0), 0, mode(problem), (problem.X, problem.y), {})
    assert first.config.spec.num_data == problem.n


def test_functional_and_sample_before_init_say_to_call_init(problem):
    kernel = SGLD(linear_regression, step_size=1e-3)
    with pytest.raises(ValueError, match=r"SGLD.functional\(\) needs the model prepared"):
        kernel.functional()
    with pytest.raises(ValueError, match=r"call kernel.init\(...\) before sample"):
        kernel.sample(None, (problem.X, problem.y), {})


@pytest.mark.parametrize("cls, kwargs", KERNELS, ids=[c.__name__ for c, _ in KERNELS])
def test_a_kernel_pickled_before_init_samples_as_the_original(problem, cls, kwargs):
    kernel = cls(linear_regression, num_steps=5, **kwargs)
    loaded = pickle.loads(pickle.dumps(kernel))
    assert type(loaded) is cls and loaded.recipe == kernel.recipe
    np.testing.assert_allclose(run(loaded, problem), run(kernel, problem), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [SGLD, SGHMC])
def test_a_kernel_pickled_after_init_draws_from_its_state(problem, cls):
    kernel = cls(linear_regression, step_size=1e-3, num_steps=10)
    data = (problem.X, problem.y)
    state = kernel.init(jax.random.key(0), 0, mode(problem), data, {})
    loaded = pickle.loads(pickle.dumps(kernel))
    assert loaded.config == kernel.config and loaded.num_data == problem.n
    # no init on the loaded kernel: its draw loop is rebuilt from the pickled config
    mine, theirs = kernel.sample(state, data, {}), loaded.sample(state, data, {})
    np.testing.assert_allclose(theirs.z["theta"], mine.z["theta"], rtol=1e-5, atol=1e-6)
    assert int(theirs.i) == 10


def test_a_pickled_tuned_kernel_samples_the_tuned_law(problem, tuned):
    kernel, report = tuned
    assert kernel.tuned is not None
    loaded = pickle.loads(pickle.dumps(kernel))
    assert type(loaded) is type(kernel) and loaded.tuned is not None
    np.testing.assert_allclose(loaded.tuned.mean, kernel.tuned.mean)
    draws = {}
    for name, k in (("original", kernel), ("loaded", loaded)):
        mcmc = MCMC(k, num_warmup=20, num_samples=1000, progress_bar=False)
        mcmc.run(jax.random.key(1), problem.X, problem.y)
        draws[name] = np.asarray(mcmc.get_samples()["theta"], np.float64)
    np.testing.assert_allclose(draws["loaded"], draws["original"], rtol=1e-4, atol=1e-6)
    # and that law is the predicted one: mean within 5 standard errors, sds within 25%
    sd = np.sqrt(np.diag(np.asarray(report.covariance.as_matrix(len(problem.mode)))))
    ours = draws["loaded"]
    assert np.all(np.abs(ours.mean(0) - report.mode["theta"]) < 5 * sd / np.sqrt(50)), ours.mean(0)
    assert np.all(np.abs(ours.std(0) / sd - 1) < 0.25), (ours.std(0), sd)


def test_with_tuning_gives_a_new_tuned_kernel_and_leaves_the_original(problem, tuned):
    law = tuned[0].tuned
    hand = SGLD(linear_regression, step_size=1e-3)
    tuned = hand.with_tuning(law)
    assert type(tuned) is SGLD and tuned.tuned is law
    assert hand.tuned is None and tuned.recipe.dynamics == hand.recipe.dynamics
    other = make_linear_regression(n=500)
    with pytest.raises(ValueError, match="was tuned by autotune for data with plate sizes"):
        tuned.init(jax.random.key(0), 0, None, (other.X, other.y), {})


def test_no_code_outside_the_kernels_reads_a_private_attribute_of_a_kernel():
    """The tuner, runner and the rest use the kernels' public accessors (``config``,
    ``family``, ``subsampled_model``, ``with_tuning``, ...): no ``kernel._x`` or
    ``type(kernel)._x`` outside ``numpyro_sgmc/kernels/``."""
    root = Path(__file__).resolve().parents[1] / "numpyro_sgmc"
    names = {"kernel", "sampler"}
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            owner = node.value
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "type":
                owner = owner.args[0] if owner.args else owner
            if isinstance(owner, ast.Name) and owner.id in names and not node.attr.startswith("__"):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {owner.id}.{node.attr}")
    assert not found, found
