"""Calibration (``numpyro_sgmc.calibration``, ``docs/calibration.md``): coverage with binomial
errors, ranks and their uniformity test, failures kept with their messages, the prior
simulator of simulation-based calibration, the plots; and a reduced run of the autotuned
targets on a model where the posterior's intervals under-cover and the sandwich's do not.

Tolerances are binomial: a coverage ``p̂`` of ``R`` replicates is within ``Z`` standard
errors ``sqrt(p(1 - p)/R)`` of the ``p`` it should have. Fixed seeds make every test
deterministic; ``Z = 3`` keeps each far from a chance failure under the null, and the
alternatives tested against are many standard errors away.
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints
from scipy import stats

from numpyro_sgmc import calibration
from problems import linear_regression, make_overdispersed_counts, poisson_regression

Z = 3.0
N_OBS, SD = 50, 2.0  # a normal mean with known sd: exact intervals are ȳ ± z·SD/√N_OBS
EXACT_WIDTH_95 = 2 * stats.norm.ppf(0.975) * SD / np.sqrt(N_OBS)


def normal_mean(y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N_OBS, subsample_size=10):
        numpyro.sample("y", dist.Normal(mu, SD), obs=numpyro.subsample(y, event_dim=0))


def simulate_mean(seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(1.0 + SD * rng.standard_normal(N_OBS)),)


def exact(key, y):
    return {"mu": stats.norm(float(np.mean(y)), SD / np.sqrt(N_OBS))}


def narrow(key, y):  # half the right sd: nominal 95% covers 2Φ(1.96/2) - 1 = 67.3%
    return {"mu": stats.norm(float(np.mean(y)), 0.5 * SD / np.sqrt(N_OBS))}


def draws(key, y):
    return {"mu": np.mean(y) + SD / np.sqrt(N_OBS) * np.asarray(jax.random.normal(key, (2000,)))}


@pytest.fixture(scope="module")
def references():
    return calibration.calibrate(
        normal_mean,
        simulate_mean,
        {"mu": 1.0},
        jax.random.key(0),
        targets=(),
        num_replicates=400,
        references={"exact": exact, "narrow": narrow, "draws": draws},
        progress=False,
    )


def test_calibrated_intervals_cover_within_binomial_error(references):
    cal = references
    assert cal.methods == ("exact", "narrow", "draws") and cal.names == ("mu",)
    assert cal.coverage.shape == (3, 3, 1) and np.all(cal.num_valid == 400)
    for method in ("exact", "draws"):
        z = cal.z_scores[cal.methods.index(method)]
        assert np.all(np.abs(z) <= Z), f"{method}: coverage {cal.coverage} z {z}"
    i = cal.methods.index("exact")
    np.testing.assert_allclose(cal.width[i, 2, 0], EXACT_WIDTH_95, rtol=1e-9)
    np.testing.assert_allclose(
        cal.width[cal.methods.index("draws"), 2, 0], EXACT_WIDTH_95, rtol=0.01
    )
    assert np.all(np.isnan(cal.predicted_coverage)), "references have no Table 1 prediction"


def test_too_narrow_intervals_are_caught(references):
    cal, k = references, references.methods.index("narrow")
    expected = 2 * stats.norm.cdf(0.5 * stats.norm.ppf(0.5 + np.asarray(cal.levels) / 2)) - 1
    se = np.sqrt(expected * (1 - expected) / 400)
    assert np.all(np.abs(cal.coverage[k, :, 0] - expected) <= Z * se), cal.coverage[k]
    assert cal.z_scores[k, 2, 0] < -10  # far below nominal: the check has power
    np.testing.assert_allclose(cal.coverage_se[k, :, 0], np.sqrt(
        cal.coverage[k, :, 0] * (1 - cal.coverage[k, :, 0]) / 400))  # fmt: skip


def test_ranks_are_uniform_only_when_calibrated(references):
    for method in ("exact", "draws"):
        test = references.sbc(method, bins=10)
        assert test.counts.sum() == 400 and test.dof == 9
        assert test.p_value[0] > 1e-3, str(test)
    narrow_test = references.sbc("narrow", bins=10)
    assert narrow_test.p_value[0] < 1e-6, str(narrow_test)
    counts = narrow_test.counts[0]
    assert counts[0] + counts[-1] > 2 * counts[4:6].sum()  # the true value in the tails


def test_rank_test():
    rng = np.random.default_rng(0)
    uniform = calibration.rank_test(rng.integers(0, 100, size=(500, 2)), 100, bins=10)
    assert np.all(uniform.p_value > 1e-3) and uniform.names == ("0", "1")
    piled = calibration.rank_test(rng.integers(0, 50, size=500), 100, bins=10)
    assert piled.p_value[0] < 1e-10
    np.testing.assert_array_equal(piled.counts[0, 5:], 0)
    with pytest.raises(ValueError, match="must divide"):
        calibration.rank_test(np.zeros(10), 100, bins=7)


def test_failures_and_warnings_are_kept_with_their_messages():
    def flaky(seed):
        if seed == 3:
            raise ValueError("no data for seed 3")
        return simulate_mean(seed)

    def picky(key, y):
        if np.mean(y) > 1.4:
            raise FloatingPointError("mean too large")
        return exact(key, y)

    def chatty(key, y):
        warnings.warn("careful", UserWarning, stacklevel=1)
        return exact(key, y)

    R = 30
    cal = calibration.calibrate(
        normal_mean,
        flaky,
        {"mu": 1.0},
        jax.random.key(1),
        targets=(),
        num_replicates=R,
        references={"picky": picky, "chatty": chatty, "subset": (exact, [0, 2, 3, 4])},
        progress=False,
    )
    large = [s for s in range(R) if s != 3 and float(np.mean(simulate_mean(s)[0])) > 1.4]
    assert large, "the test needs replicates that fail"
    simulate_failures = [f for f in cal.failures if f.method == "simulate"]
    assert simulate_failures == [
        calibration.Failure("simulate", 3, "ValueError: no data for seed 3")
    ]
    picky_failures = [f for f in cal.failures if f.method == "picky"]
    assert [f.seed for f in picky_failures] == large
    assert all(f.message == "FloatingPointError: mean too large" for f in picky_failures)
    assert [w.seed for w in cal.warnings] == [s for s in range(R) if s != 3]
    assert all(w.method == "chatty" and w.message == "UserWarning: careful" for w in cal.warnings)
    assert cal.num_valid.tolist() == [R - 1 - len(large), R - 1, 3]
    assert not cal.ran[:, 3].any()
    assert str(cal).count("seed") >= len(large) + 1  # the failures are printed
    subset = cal.select(cal.ran[2])
    assert subset.seeds.tolist() == [0, 2, 4] and subset.num_valid[2] == 3
    assert not any(f.seed == 3 for f in subset.failures)


def test_a_set_up_error_stops_early():
    calls = []

    def broken(seed):
        calls.append(seed)
        raise KeyError("X")

    def broken_reference(key, y):
        raise TypeError("takes 2 positional arguments but 3 were given")

    kw = dict(targets=(), num_replicates=100, progress=False)
    with pytest.raises(RuntimeError, match="'simulate' failed on its first 5.*KeyError"):
        calibration.calibrate(
            normal_mean, broken, {"mu": 1.0}, jax.random.key(0), references={"exact": exact}, **kw
        )
    assert len(calls) == 5
    # a method that never runs stops the calibration even while the others run
    with pytest.raises(RuntimeError, match="'broken' failed on its first 5.*TypeError: takes"):
        calibration.calibrate(
            normal_mean, simulate_mean, {"mu": 1.0}, jax.random.key(0),
            references={"exact": exact, "broken": broken_reference}, **kw,
        )  # fmt: skip


def test_bad_input_is_named():
    kw = dict(targets=(), references={"exact": exact}, num_replicates=2, progress=False)
    with pytest.raises(ValueError, match="'sigma' of the true value"):
        calibration.calibrate(normal_mean, simulate_mean, {"sigma": 1.0}, jax.random.key(0), **kw)
    with pytest.raises(ValueError, match="distinct"):
        calibration.calibrate(
            normal_mean, simulate_mean, {"mu": 1.0}, jax.random.key(0),
            targets=("posterior", "posterior"), progress=False,
        )  # fmt: skip
    with pytest.raises(TypeError, match="'target' key"):
        calibration.calibrate(
            normal_mean, simulate_mean, {"mu": 1.0}, jax.random.key(0),
            targets=({"weights": (1, 1)},),
        )  # fmt: skip
    with pytest.raises(ValueError, match="num_ranks"):
        calibration.calibrate(
            normal_mean, simulate_mean, {"mu": 1.0}, jax.random.key(0), ess=50, **kw
        )


def test_prior_simulator_draws_the_prior_and_the_model_on_every_row():
    n = 200

    def covariates(seed):
        return (jnp.asarray(np.random.default_rng(seed).standard_normal((n, 3)), jnp.float32),)

    simulate = calibration.prior_simulator(
        linear_regression, covariates, jax.random.key(0), observed="y"
    )
    thetas, residual_sd = [], []
    for seed in range(300):
        truth, (X, y) = simulate(seed)
        assert set(truth) == {"theta"} and y.shape == (n,)  # all rows, not the subsample
        thetas.append(truth["theta"])
        residual_sd.append(np.std(np.asarray(y) - np.asarray(X) @ truth["theta"]))
    thetas = np.asarray(thetas)
    assert np.all(np.abs(thetas.mean(0)) < Z * 10 / np.sqrt(300))  # prior N(0, 10)
    assert np.all(np.abs(thetas.std(0) / 10 - 1) < Z / np.sqrt(2 * 300))
    assert abs(np.mean(residual_sd) - 1) < 0.02  # noise sd 1
    first, again = simulate(7), simulate(7)
    np.testing.assert_array_equal(first[1][1], again[1][1])
    with pytest.raises(ValueError, match="no site 'obs'"):
        calibration.prior_simulator(
            linear_regression, covariates, jax.random.key(0), observed="obs"
        )(0)

    def flat(X, y=None):
        theta = numpyro.sample("theta", dist.ImproperUniform(constraints.real, (), (3,)))
        numpyro.sample("y", dist.Normal(X @ theta, 1.0).to_event(1), obs=y)

    with pytest.raises(ValueError, match="Site 'theta' has a distribution with no sampler"):
        calibration.prior_simulator(flat, covariates, jax.random.key(0), observed="y")(0)


def test_plots(references, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = calibration.plot_coverage(references, title="normal mean")
    assert len([a for a in fig.axes if a.get_visible()]) == 1
    assert len(fig.legends[0].get_texts()) == 4  # three methods and the band
    fig = calibration.plot_ranks(references, "narrow", bins=10)
    heights = [p.get_height() for p in fig.axes[0].patches if p.get_width() < 1]
    assert heights == references.sbc("narrow").counts[0].tolist()
    fig = calibration.plot_widths(references, 0.95, relative_to="exact")
    assert [round(p.get_height(), 2) for p in fig.axes[0].patches] == [1.0, 0.5, 1.0]
    plt.close("all")
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install"):
        calibration.plot_coverage(references)


THETA_COUNTS = np.array([0.5, 0.4, -0.3])  # make_overdispersed_counts' mean: the pseudo-true value


def poisson_small_prior(X, y=None):
    """Poisson regression with a prior whose draws give moderate counts (for SBC)."""
    theta = numpyro.sample("theta", dist.Normal(0.0, 0.5).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Poisson(jnp.exp(Xb @ theta)), obs=yb)


@pytest.mark.slow
def test_posterior_under_covers_and_the_sandwich_does_not():
    """R = 40 replicates of a Poisson regression on strongly over-dispersed counts
    (concentration 0.3, ``S ≈ 6 J⁻¹``): the posterior's 95% intervals cover about 55%, the
    sandwich's 95% (``docs/theory.md``, "Which target when")."""
    R = 40

    def simulate(seed):
        return make_overdispersed_counts(n=2000, concentration=0.3, seed=seed)

    cal = calibration.calibrate(
        poisson_regression,
        simulate,
        {"theta": THETA_COUNTS},
        jax.random.key(0),
        targets=("posterior", "local_fiducial"),
        num_replicates=R,
        progress=False,
    )
    print(cal)
    assert not cal.failures and np.all(cal.num_valid == R)
    post, sand = cal.methods.index("posterior"), cal.methods.index("local_fiducial")
    assert np.all(np.abs(cal.z_scores[sand]) <= Z), cal.table()
    upper_95 = 0.95 - Z * np.sqrt(0.95 * 0.05 / R)
    assert np.all(cal.coverage[post, 2] < upper_95), cal.table(0.95)
    assert np.all(cal.coverage[sand, 2] >= upper_95)
    # the Table 1 prediction of each coverage holds within binomial error ...
    p = cal.predicted_coverage
    assert np.all(np.abs(cal.coverage - p) <= Z * np.sqrt(p * (1 - p) / R) + 1e-12), cal.table()
    # ... is nominal for the sandwich, and well below it for the posterior
    np.testing.assert_allclose(
        p[sand], np.broadcast_to(np.asarray(cal.levels)[:, None], p[sand].shape), atol=0.01
    )
    assert np.all(p[post, 2] < 0.75)
    assert np.all(cal.width[sand] > 1.8 * cal.width[post])


@pytest.mark.slow
def test_posterior_ranks_are_uniform_on_a_well_specified_model():
    """Simulation-based calibration of the autotuned posterior, R = 40: θ from the prior,
    counts from the model; the ranks pass the chi-square test and every level covers within
    binomial error."""
    R = 40

    def covariates(seed):
        Z = np.random.default_rng(10_000 + seed).multivariate_normal(
            [0, 0], [[1, 0.6], [0.6, 1]], 2000
        )
        return (jnp.asarray(np.column_stack([np.ones(2000), 0.5 * Z]), jnp.float32),)

    simulate = calibration.prior_simulator(
        poisson_small_prior, covariates, jax.random.key(1), observed="y"
    )
    cal = calibration.calibrate(
        poisson_small_prior, simulate, None, jax.random.key(2), targets=("posterior",),
        num_replicates=R, progress=False,
    )  # fmt: skip
    test = cal.sbc("posterior", bins=5)
    print(cal, test, sep="\n")
    assert not cal.failures and test.num_replicates == R
    assert np.all(test.p_value > 1e-3), str(test)
    assert np.all(np.abs(cal.z_scores) <= Z), cal.table()
    assert len({tuple(t) for t in cal.truth}) == R  # a fresh prior draw per replicate


@pytest.mark.slow
def test_the_whole_recipe_runs_on_a_normal_mean_with_its_check():
    """``autotune``, ``run_kernel`` and ``check_run`` on a few replicates of a normal mean
    with known sd (well specified): every target's interval is the exact one within Monte
    Carlo error, the Table 1 prediction of the coverage is nominal (posterior, sandwich) or
    the bagged posterior's ``2Φ(z·√2) - 1``, and the check's verdicts are recorded."""
    R = 4
    cal = calibration.calibrate(
        normal_mean, simulate_mean, {"mu": 1.0}, jax.random.key(3),
        targets=("posterior", "local_fiducial", "bagged"), num_replicates=R, ess=400,
        num_ranks=40, references={"exact": exact}, check=True, progress=False,
    )  # fmt: skip
    print(cal)
    assert not cal.failures and np.all(cal.num_valid == R)
    assert cal.checked.shape == (4, R) and np.all(np.isnan(cal.checked[3]))
    assert set(np.unique(cal.checked[:3])) <= {0.0, 1.0}
    assert np.all(np.isfinite(cal.check_passed[:3])) and "check_run passed" in cal.table()
    # widths: the exact one for posterior and sandwich (S = J⁻¹ here), √2 times it bagged;
    # the Monte Carlo error of a 95% interval's width from 400 effective draws is ~4%
    width = cal.width[:, 2, 0]
    np.testing.assert_allclose(width[:2], EXACT_WIDTH_95, rtol=0.12)
    np.testing.assert_allclose(width[2], np.sqrt(2) * EXACT_WIDTH_95, rtol=0.12)
    z = stats.norm.ppf(0.5 + np.asarray(cal.levels) / 2)
    np.testing.assert_allclose(
        cal.predicted_coverage[:2, :, 0], np.tile(cal.levels, (2, 1)), atol=0.02
    )
    np.testing.assert_allclose(
        cal.predicted_coverage[2, :, 0], 2 * stats.norm.cdf(np.sqrt(2) * z) - 1, atol=0.02
    )
    subset = cal.select([0, 2])
    assert subset.checked.shape == (4, 2)


def test_chunks_concatenate_to_the_whole(references):
    """Two chunks (``first_seed``) of a calibration joined by ``concatenate`` are the whole."""
    kw = dict(targets=(), references={"exact": exact, "narrow": narrow}, progress=False)
    args = (normal_mean, simulate_mean, {"mu": 1.0}, jax.random.key(0))
    whole = calibration.calibrate(*args, num_replicates=30, **kw)
    parts = [
        calibration.calibrate(*args, num_replicates=10, **kw),
        calibration.calibrate(*args, num_replicates=20, first_seed=10, **kw),
    ]
    joined = calibration.concatenate(parts)
    np.testing.assert_array_equal(joined.seeds, np.arange(30))
    for field in ("truth", "lower", "upper", "ranks"):
        np.testing.assert_array_equal(getattr(joined, field), getattr(whole, field))
    np.testing.assert_array_equal(joined.coverage, whole.coverage)
    with pytest.raises(ValueError, match="share seeds"):
        calibration.concatenate([parts[0], parts[0]])
    with pytest.raises(ValueError, match="different methods"):
        calibration.concatenate([parts[0], references])
