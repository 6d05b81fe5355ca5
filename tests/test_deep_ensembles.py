"""The Bayesian deep-ensemble workflow end to end, at a reduced size (``docs/theory.md`` §6).

``K`` vectorised Adam runs, ``K`` SGHMC chains started at the ``K`` modes with their own
optimizer-informed masses and no warm-up, posterior-predictive metrics on held-out data. The
numbers that matter statistically (SGHMC's law) are tested on exact targets in
``test_sghmc.py``; here the workflow must run, keep each chain's start and mass, and predict
the held-out data better than the best constant predictor.
"""

import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.infer import MCMC, Predictive

from numpyro_sgmc import SGHMC, warm_start
from numpyro_sgmc.bde import (
    chain_init,
    diabetes,
    digits,
    evaluate,
    lenet,
    mass_from_warm_start,
    mlp,
)
from numpyro_sgmc.diagnostics import ConvergenceWarning
from problems import flat_masses

K = 4
ROOT = Path(__file__).resolve().parent.parent


def fit(model, X, y, epochs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a network's modes are not points
        return warm_start(
            model,
            jax.random.key(0),
            X,
            y,
            num_restarts=K,
            num_epochs=epochs,
            learning_rate=0.01,
        )


def sample(model, X, y, init, eta, steps=300, thin=20):
    """SGHMC at Chen et al.'s step ``eta``: the library's ``h = n η²``."""
    kernel = SGHMC(model, X.shape[0] * eta**2, num_steps=thin)
    mcmc = MCMC(
        kernel,
        num_warmup=0,
        num_samples=steps // thin,
        num_chains=K,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(1), X, y, init_params=init)
    return kernel, mcmc


@pytest.fixture(scope="module")
def regression():
    data = diabetes(seed=0)
    model = mlp(1, hidden=(50,), likelihood="gaussian", batch_size=32)
    warm = fit(model, data.X_train, data.y_train, epochs=100)
    return data, model, warm


@pytest.mark.slow
@pytest.mark.parametrize("statistic", [None, "first_moment"])  # all four: the benchmark test
def test_regression_ensemble_predicts_held_out_data(regression, statistic):
    data, model, warm = regression
    kernel, mcmc = sample(model, data.X_train, data.y_train, chain_init(warm, statistic), 1e-2)
    assert int(np.sum(mcmc.last_state.num_diverging)) == 0
    if statistic is not None:  # each chain kept its own member's mass
        masses = mass_from_warm_start(warm, statistic)
        np.testing.assert_allclose(
            mcmc.last_state.params.mass.values, flat_masses(masses, warm.params), rtol=1e-6
        )
    draws = mcmc.get_samples(group_by_chain=True)
    # chain k started at mode k: its first draw is nearer mode k than any other mode
    first = np.asarray(draws["dense0.kernel"][:, 0]).reshape(K, -1)
    modes = np.asarray(warm.constrained["dense0.kernel"]).reshape(K, -1)
    distances = np.linalg.norm(first[:, None] - modes[None], axis=-1)
    np.testing.assert_array_equal(distances.argmin(axis=1), np.arange(K))

    flat = mcmc.get_samples()
    metrics = evaluate(kernel.model, flat, data.X_test, y=data.y_test)
    baseline = evaluate(model, warm.constrained, data.X_test, y=data.y_test)
    y = np.asarray(data.y_test)
    constant_rmse = float(np.sqrt(np.mean((y - y.mean()) ** 2)))
    constant_lppd = float(np.mean(-0.5 * np.log(2 * np.pi * y.var()) - 0.5))
    assert metrics["rmse"] < 0.9 * constant_rmse
    assert metrics["lppd"] > constant_lppd + 0.2
    # sampling around the modes does not lose what Adam found
    assert metrics["lppd"] > baseline["lppd"] - 0.1
    # posterior predictive draws through numpyro.infer.Predictive, one per kept draw
    predicted = Predictive(kernel.model, flat)(jax.random.key(2), data.X_test)["obs"]
    assert predicted.shape == (K * 15, data.X_test.shape[0])


@pytest.mark.slow
def test_cnn_ensemble_runs_with_zero_warmup_on_digits():
    data = digits(seed=0)
    # on fewer digits or steps the prior keeps some restarts near zero weights (module
    # docstring of numpyro_sgmc.bde.networks): 10 epochs on 400 gave 6-22% accuracy
    X, y = jnp.asarray(data.X_train[:600]), jnp.asarray(data.y_train[:600])
    model = lenet(num_classes=10, batch_size=64)
    warm = fit(model, X, y, epochs=30)
    masses = mass_from_warm_start(warm).values
    assert {k: v.shape[0] for k, v in masses.items()} == dict.fromkeys(warm.params, K)
    kernel, mcmc = sample(model, X, y, chain_init(warm, "first_moment"), 1e-2, steps=100)
    assert int(np.sum(mcmc.last_state.num_diverging)) == 0
    metrics = evaluate(kernel.model, mcmc.get_samples(), data.X_test, y=data.y_test)
    assert set(metrics) == {"lppd", "accuracy", "ece"}
    assert metrics["accuracy"] > 0.3  # chance is 0.1
    assert metrics["lppd"] > np.log(0.1)  # better than the uniform predictive
    assert 0.0 <= metrics["ece"] <= 1.0


@pytest.mark.slow
def test_benchmark_script_runs_at_small_size():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "deep_ensembles.py"),
            "--size",
            "small",
            "--datasets",
            "diabetes",
            "--no-sweep",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for label in ("deep ensemble (Adam)", "SGHMC, first-moment M", "AdaSGHMC", "cosine"):
        assert label in result.stdout


@pytest.mark.slow
def test_anchor_benchmark_runs_at_small_size():
    """``benchmarks/bde_anchor.py --size small`` (one seed of airfoil, ``K = 3``, no bde): the
    table, the automatic steps it chose, and the sweep with its verdict."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bde_anchor.py"),
            "--size",
            "small",
            "--bde-python",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "bde not run" in out and "step_size='auto'" in out
    for label in (
        "| airfoil | bde (published",
        "| airfoil | deep ensemble |",
        "| airfoil | ours |",
    ):
        assert label in out
    ours = next(line for line in out.splitlines() if line.startswith("| airfoil | ours |"))
    rmse, nll = (float(cell) for cell in ours.split("|")[3:5])
    assert rmse < 0.9 and np.isfinite(nll)  # standardised y: a constant predicts at RMSE ≈ 1
    assert ours.rstrip(" |").endswith("| 0")  # no divergent step
    assert "within 10% of best" in out
