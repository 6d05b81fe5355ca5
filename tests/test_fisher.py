"""J, J_prior, I (``docs/theory.md`` §1, §3) from the model's plates, against exact ones."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from numpyro_sgmc.data.subsample import SubsamplePlate
from numpyro_sgmc.tuner.fisher import information
from numpyro_sgmc.tuner.rows import Stream, choose_rows
from problems import (
    PRIOR_SCALE,
    flat_regression,
    linear_regression,
    logistic_laplace64,
    logistic_regression,
    make_linear_regression,
    make_logistic,
    make_two_groups,
    make_wide_logistic64,
    two_groups,
    wide_logistic,
)

KEY = jax.random.key(0)


def rel_err(a, b):
    return np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))


def noise(info, batch_size=None):
    """The per-step covariance of the minibatch gradient, as a matrix."""
    return np.asarray(info.gradient_noise(batch_size).constant)


@pytest.mark.parametrize("heteroscedastic", [False, True])
def test_linear_regression_matches_exact_j_and_i(heteroscedastic):
    p = make_linear_regression(n=1000, heteroscedastic=heteroscedastic)
    # chunk_size 96: 11 chunks of 91 rows, the last one padded with a weight-0 row
    with jax.enable_x64(True):
        X, y = jnp.asarray(p.X, jnp.float64), jnp.asarray(p.y, jnp.float64)
        info = information(linear_regression, KEY, X, y, params={"theta": p.mode}, chunk_size=96)
    # problems.py computes J, I from the float64 data before its float32 rounding (~1e-8)
    assert rel_err(info.potential_curvature, p.J) < 1e-6
    assert rel_err(info.I, p.I) < 1e-6
    assert rel_err(info.sandwich, p.S) < 1e-6
    np.testing.assert_allclose(info.J_prior, np.eye(3) / PRIOR_SCALE**2 / p.n, rtol=1e-12)
    assert np.max(np.abs(info.mean_gradient)) < 1e-6 * np.sqrt(np.max(np.diag(p.I)))
    assert info.num_data == info.num_rows == 1000 and info.regularization == 0.0
    assert info.layout.sites == (("theta", 0, 3, (3,)),)
    np.testing.assert_allclose(noise(info), p.I / 100, rtol=1e-6)  # b = 100
    np.testing.assert_allclose(noise(info, 7), p.I / 7, rtol=1e-6)
    np.testing.assert_allclose(info.unflatten(np.arange(3.0))["theta"], np.arange(3.0))
    assert info.condition_numbers["J"] == pytest.approx(np.linalg.cond(p.J), rel=1e-6)
    assert "d=3" in str(info) and "n=1000" in str(info)

    if heteroscedastic:  # the default float32, chunked with compensated sums
        info32 = information(linear_regression, KEY, p.X, p.y, params={"theta": p.mode})
        assert rel_err(info32.potential_curvature, p.J) < 1e-5
        assert rel_err(info32.I, p.I) < 1e-5


def test_the_curvature_of_a_hierarchical_prior_is_symmetric_exactly():
    """A float32 Hessian of a hierarchy's prior is symmetric only to rounding (1e-9 here);
    the eigenvalues of ``J + J_prior`` then took the general solver, 7.5 times slower (281 of
    474 s at d = 843). ``J_prior`` is symmetrised as ``J`` and ``I`` are."""
    from user_models import hierarchical_logistic, make_hierarchical

    args, kwargs = make_hierarchical(n=2000)
    rng = np.random.default_rng(0)
    params = {
        "mu": jnp.float32(0.3),
        "tau": jnp.float32(-0.5),
        "alpha": jnp.asarray(rng.normal(size=20), jnp.float32),
        "beta": jnp.zeros(args[0].shape[1], jnp.float32),
    }
    info = information(hierarchical_logistic, KEY, *args, params=params, model_kwargs=kwargs)
    for M in (info.J, info.J_prior, info.I, info.potential_curvature):
        assert np.array_equal(M.matrix, M.matrix.T)


@pytest.mark.slow
def test_row_subsample_is_close_within_its_sampling_error():
    p = make_linear_regression(n=1000, heteroscedastic=True)
    args = (p.X, p.y)
    z = {"theta": p.mode}
    full = information(linear_regression, KEY, *args, params=z, num_rows=1000)
    assert rel_err(full.I, p.I) < 1e-5 and full.num_rows == 1000
    # keyword arguments: arrays travel as data, python ints stay static (the plate's b)
    kw = information(
        linear_regression, KEY, p.X, params=z, model_kwargs={"y": p.y, "subsample_size": 50}
    )
    np.testing.assert_allclose(kw.I, full.I, rtol=1e-6)
    np.testing.assert_allclose(noise(kw), full.I / 50, rtol=1e-6)

    m, n = 200, p.n
    key = jax.random.PRNGKey(7)
    sub = information(linear_regression, key, *args, params=z, num_rows=m)
    again = information(linear_regression, key, *args, params=z, num_rows=m)
    assert sub.num_rows == m and sub.num_data == n
    np.testing.assert_array_equal(sub.I, again.I)  # deterministic given the key
    # standard errors of a mean of m of n rows drawn without replacement
    fpc = np.sqrt((n - m) / (n - 1) / m)
    se_J = np.std(p.hessians, axis=0) * fpc
    grads = (
        np.asarray(p.X, np.float64)
        * (np.asarray(p.y, np.float64) - np.asarray(p.X, np.float64) @ p.mode)[:, None]
    )
    se_I = np.std(np.einsum("ni,nj->nij", grads, grads), axis=0) * fpc
    assert np.all(np.abs(np.asarray(sub.potential_curvature) - p.J) < 5 * se_J + 1e-6)
    assert np.all(np.abs(np.asarray(sub.I) - p.I) < 5 * se_I + 2 * np.max(np.abs(p.I)) / m)
    assert rel_err(sub.I, p.I) > 1e-4  # it really is a subsample


def regression_with_noise_scale(X, y=None):
    theta = numpyro.sample("theta", dist.Normal(0.0, PRIOR_SCALE).expand([X.shape[1]]).to_event(1))
    # an interval support: the log-det-Jacobian of its sigmoid transform has curvature
    sigma = numpyro.sample("sigma", dist.Uniform(LOW, HIGH))
    with numpyro.plate("data", X.shape[0], subsample_size=50):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Normal(Xb @ theta, sigma), obs=yb)


LOW, HIGH = 0.05, 5.0


@pytest.mark.slow
def test_constrained_site_per_datum_terms_exclude_prior_and_jacobian():
    rng = np.random.default_rng(1)
    n, d = 400, 2
    X = rng.standard_normal((n, d))
    y = X @ np.array([1.0, -0.5]) + 0.7 * rng.standard_normal(n)
    theta = np.linalg.lstsq(X, y, rcond=None)[0]
    sigma = np.std(y - X @ theta)
    s = np.log((sigma - LOW) / (HIGH - sigma))  # unconstrained value of sigma
    info = information(
        regression_with_noise_scale,
        KEY,
        jnp.asarray(X, jnp.float32),
        jnp.asarray(y, jnp.float32),
        params={"sigma": s, "theta": theta},
        chunk_size=64,
    )
    with jax.enable_x64(True):
        # ground truth written by hand in flat order (sigma, theta), sigma = LOW + (HIGH-LOW)σ(s)
        z = jnp.concatenate([jnp.array([s]), jnp.asarray(theta)])

        def scale(s):
            return LOW + (HIGH - LOW) * jax.nn.sigmoid(s)

        def loglik(z, x, yi):  # l(z; x, y): no prior, no Jacobian
            sd = scale(z[0])
            return -0.5 * ((yi - x @ z[1:]) / sd) ** 2 - jnp.log(sd) - 0.5 * jnp.log(2 * jnp.pi)

        def global_part(z):  # -log p0(z): flat prior on sigma times |dsigma/ds|, Normal on θ
            log_jac = jnp.log(HIGH - LOW) + jax.nn.log_sigmoid(z[0]) + jax.nn.log_sigmoid(-z[0])
            log_p = -jnp.log(HIGH - LOW) + log_jac
            return -(log_p + dist.Normal(0.0, PRIOR_SCALE).log_prob(z[1:]).sum())

        Xj, yj = (
            jnp.asarray(X, jnp.float32).astype(float),
            jnp.asarray(y, jnp.float32).astype(float),
        )
        grads = np.asarray(jax.vmap(jax.grad(loglik), (None, 0, 0))(z, Xj, yj))
        hess = np.asarray(jax.vmap(jax.hessian(loglik), (None, 0, 0))(z, Xj, yj))
        J_prior = np.asarray(jax.hessian(global_part)(z)) / n
        mean_grad = (grads.sum(0) - np.asarray(jax.grad(global_part)(z))) / n
    assert [site for site, *_ in info.layout.sites] == ["sigma", "theta"]
    assert J_prior[0, 0] > 0.1 / n  # the Jacobian's curvature, which J must not contain
    assert rel_err(info.J, -hess.mean(0)) < 1e-5
    assert rel_err(info.J_prior, J_prior) < 1e-5
    assert rel_err(info.I, np.cov(grads.T, bias=True)) < 1e-5
    assert rel_err(info.mean_gradient, mean_grad) < 1e-4
    assert info.unflatten(np.arange(3.0))["sigma"].shape == ()


@pytest.mark.slow
def test_two_plates_pool_their_covariances_with_weights_n_p_over_n():
    n1, n2 = 300, 700
    y1, y2, mean, _ = make_two_groups(n1=n1, n2=n2)
    delta, mu = mean
    info = information(two_groups, KEY, y1, y2, params={"delta": delta, "mu": mu}, chunk_size=128)
    n = n1 + n2
    y1n, y2n = np.asarray(y1, np.float64), np.asarray(y2, np.float64)
    # per-datum gradients in (delta, mu): plate a (0, y1 - mu); plate b (r, r), r = resid / 4
    ga = np.column_stack([np.zeros(n1), y1n - mu])
    r = (y2n - mu - delta) / 4.0
    gb = np.column_stack([r, r])
    cov_a, cov_b = np.cov(ga.T, bias=True), np.cov(gb.T, bias=True)
    J = (n1 * np.diag([0.0, 1.0]) + n2 * np.full((2, 2), 0.25)) / n
    assert info.num_data == n and {p.name for p in info.plates} == {"a", "b"}
    np.testing.assert_allclose(info.J, J, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(info.J_prior, np.eye(2) / PRIOR_SCALE**2 / n, rtol=1e-5)
    np.testing.assert_allclose(info.plate_covariances["a"], cov_a, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(info.plate_covariances["b"], cov_b, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(info.I, (n1 * cov_a + n2 * cov_b) / n, rtol=1e-4, atol=1e-7)
    # ĝ noise per step: Σ_p (n_p/n)² Cov_p / b_p with the model's b_a = 50, b_b = 20
    step = (n1 / n) ** 2 * cov_a / 50 + (n2 / n) ** 2 * cov_b / 20
    np.testing.assert_allclose(noise(info), step, rtol=1e-4, atol=1e-9)
    step_10 = (n1 / n) ** 2 * cov_a / 10 + (n2 / n) ** 2 * cov_b / 10
    np.testing.assert_allclose(noise(info, 10), step_10, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(
        noise(info, {"b": 10}), step - (n2 / n) ** 2 * cov_b * (1 / 20 - 1 / 10)
    )

    sub = information(two_groups, KEY, y1, y2, params={"delta": delta, "mu": mu}, num_rows=100)
    assert sub.num_rows == 100  # 30 rows of plate a, 70 of plate b
    np.testing.assert_allclose(sub.J, J, rtol=1e-5, atol=1e-7)  # the Hessians are constant


def test_diagonal_kind_is_within_hutchinson_error_of_the_dense_diagonal():
    p = make_linear_regression(n=500, d=6, rho=0.5, heteroscedastic=True)
    args, z = (p.X, p.y), {"theta": p.mode}
    dense = information(linear_regression, KEY, *args, params=z)
    K = 5
    diag = information(linear_regression, KEY, *args, params=z, kind="diagonal", num_probes=K)
    assert diag.kind == "diagonal" and diag.J.values.shape == diag.I.values.shape == (6,)
    assert diag.num_probes == K and "5 probes" in str(diag)
    # Rademacher probes: v_j (Hv)_j = H_jj + Σ_{k≠j} H_jk v_j v_k, variance Σ_{k≠j} H_jk²
    dJ = np.asarray(dense.J)
    off = dJ - np.diag(np.diag(dJ))
    se = np.sqrt(np.sum(off**2, axis=1) / K)
    assert np.all(np.abs(diag.J.values - np.diag(dJ)) < 4.5 * se)
    assert np.any(np.abs(diag.J.values - np.diag(dJ)) > 1e-3 * se)  # it is an estimate
    np.testing.assert_allclose(diag.J_prior.values, np.diag(np.asarray(dense.J_prior)), rtol=1e-5)
    np.testing.assert_allclose(diag.I.values, np.diag(np.asarray(dense.I)), rtol=1e-5)  # exact
    np.testing.assert_allclose(
        diag.sandwich.values, diag.I.values / diag.potential_curvature.values**2
    )
    np.testing.assert_allclose(noise(diag), np.diag(np.diag(noise(dense))), rtol=1e-5, atol=1e-12)
    # d probes or more: the 8 columns of a Hadamard matrix, orthogonal, give it exactly
    exact = information(linear_regression, KEY, *args, params=z, kind="diagonal", num_probes=6)
    assert exact.num_probes == 8 and np.all(exact.probe_error == 0)
    np.testing.assert_allclose(exact.J.values, np.diag(dJ), rtol=1e-5)


def test_sylvester_columns_are_the_hadamard_matrix():
    import scipy.linalg

    from numpyro_sgmc.tuner.fisher import exact_probes, sylvester_columns

    np.testing.assert_array_equal(sylvester_columns(64, np.arange(64)), scipy.linalg.hadamard(64))
    assert [exact_probes(d) for d in (1, 2, 3, 1024, 1025)] == [1, 2, 4, 1024, 2048]


def independent_means(y, scales):
    loc = numpyro.sample("loc", dist.Normal(0.0, PRIOR_SCALE).expand([y.shape[1]]).to_event(1))
    shift = numpyro.sample("shift", dist.Normal(0.0, PRIOR_SCALE))
    with numpyro.plate("data", y.shape[0], subsample_size=min(10, y.shape[0])):
        yb = numpyro.subsample(y, event_dim=1)
        numpyro.sample("y", dist.Normal(loc + shift * 0.0, scales).to_event(1), obs=yb)


def test_diagonal_kind_is_exact_for_a_diagonal_hessian():
    rng = np.random.default_rng(2)
    scales = np.array([0.5, 1.0, 2.0, 4.0])
    y = rng.standard_normal((300, 4)) * scales + 1.0
    params = {"loc": jnp.asarray(y.mean(0), jnp.float32), "shift": jnp.array(0.3)}
    info = information(
        independent_means, KEY, jnp.asarray(y, jnp.float32), scales, params=params, kind="diagonal"
    )
    # flat order (loc[0..3], shift); shift does not enter the likelihood
    np.testing.assert_allclose(info.J.values, np.append(1 / scales**2, 0.0), rtol=1e-5)
    np.testing.assert_allclose(info.J_prior.values, np.full(5, 1 / PRIOR_SCALE**2 / 300), rtol=1e-5)
    per_datum = (y - y.mean(0)) / scales**2
    np.testing.assert_allclose(info.I.values[:4], per_datum.var(0), rtol=1e-4)
    assert info.I.values[4] == 0.0
    assert set(info.unflatten(info.I.values)) == {"loc", "shift"}


@pytest.mark.parametrize("max_rows", [None, 100])
def test_a_diagonal_js_correlations_are_those_of_every_row(max_rows):
    """The variance inflation ``J_jj (J⁻¹)_jj`` a diagonal ``J`` leaves out: the variance it
    predicts against the full data's in float64 (d = 200, n = 4000). On every row (the
    default here) the probes' error alone; from a sample (``max_rows=100``: 1600 rows and
    their halves) the inverse of the sample's Hessian is too large on average (1.36 times on
    10,000 rows at d = 2000), and the extrapolation to every row removes that (to 1.2% here),
    within the error it states."""
    from numpyro_sgmc.data.model import prepare_model
    from numpyro_sgmc.tuner.fisher import information_of
    from numpyro_sgmc.tuner.laplace import Problem, correlations

    n, d = 4000, 200
    X, y = make_wide_logistic64(n, d, 0.14, seed=9)
    theta, H = logistic_laplace64(X, y)
    variance = np.diag(np.linalg.inv(H))
    assert np.median(np.diag(H) * variance) > 1.03  # correlations to miss
    args = (jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32))
    prepared = prepare_model(KEY, wide_logistic, args)
    params = {"theta": jnp.asarray(theta, jnp.float32)}
    info = information_of(prepared, KEY, args, {}, params, num_rows=None, kind="diagonal")
    options = {} if max_rows is None else {"max_rows": max_rows}
    linked = correlations(Problem(prepared, args, {}, None, KEY), params, info, **options)
    assert linked.num_rows == (n if max_rows is None else 3200)
    # the variance it predicts: the inflation over the diagonal's nJ_jj (whose probes cancel)
    ratio = linked.inflation / (n * np.asarray(info.potential_curvature.diagonal())) / variance
    z = (ratio - 1) / linked.inflation_error
    assert abs(np.median(ratio) - 1) < 0.04, np.median(ratio)
    assert np.mean(np.abs(z) > 2) < 0.1 and np.mean(np.abs(z) > 3) < 0.02, np.abs(z).max()


def test_the_rows_bias_of_the_inverse_curvature_is_corrected():
    """The inverse of a Hessian from m of n rows is too large on average (here 1.8% on an sd,
    d = 200, m = 5000, correlated covariates): ``debiased`` removes it with the jackknife's
    own leave-one-group-out estimates, to the float64 Laplace's sds within 0.5% at the median,
    and leaves an estimate on every row alone."""
    from numpyro_sgmc.tuner.fisher import debiased

    n, d = 40_000, 200
    X, y = make_wide_logistic64(n, d, 0.02, rho=0.5)
    theta, H = logistic_laplace64(X, y)
    sd = np.sqrt(np.diag(np.linalg.inv(H)))
    args = (X.astype(np.float32), y.astype(np.float32))
    params = {"theta": jnp.asarray(theta, jnp.float32)}
    info = information(wide_logistic, KEY, *args, params=params, num_rows=5000)
    fixed = debiased(info)

    def ratio(i):
        return np.sqrt(np.diag(i.potential_curvature.inverse().matrix) / n) / sd

    assert np.median(ratio(info)) > 1.01, np.median(ratio(info))
    assert abs(np.median(ratio(fixed)) - 1) < 0.005, np.median(ratio(fixed))
    assert 0.02 < fixed.inverse_bias < 0.06 and "corrected for its bias" in str(fixed)
    everything = information(wide_logistic, KEY, *args, params=params)
    assert debiased(everything) is everything


def test_the_rows_bias_of_the_sandwich_is_corrected():
    """The sandwich from m rows is biased as well, by the inverse twice and by J and I moving
    together: over 8 row samples (d = 200, m = 5000, a regression) its variances are about 3.5%
    too large on average, and within 2% after ``debiased``, which moves I with J so that
    ``J⁻¹IJ⁻¹`` is corrected too (a J corrected alone would put S 4% short)."""
    from numpyro_sgmc.tuner.fisher import debiased

    n, d = 40_000, 200
    rng = np.random.default_rng(0)
    X = np.sqrt(0.5) * rng.standard_normal((n, d)) + np.sqrt(0.5) * rng.standard_normal((n, 1))
    y = X @ np.linspace(1, -1, d) + rng.standard_normal(n)
    K = X.T @ X / n + np.eye(d) / (n * PRIOR_SCALE**2)
    mode = np.linalg.solve(K, X.T @ y / n)
    grads = X * (y - X @ mode)[:, None]
    K_inv = np.linalg.inv(K)
    exact = np.diag(K_inv @ np.cov(grads.T, bias=True) @ K_inv)
    args = (jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32))
    params = {"theta": jnp.asarray(mode, jnp.float32)}
    raw, fixed = [], []
    for seed in range(8):
        info = information(linear_regression, jax.random.key(seed), *args, params=params,
                           num_rows=5000)  # fmt: skip
        for out, i in ((raw, info), (fixed, debiased(info))):
            out.append(np.mean(np.diag(np.asarray(i.sandwich.matrix)) / exact) - 1)
    assert np.mean(raw) > 0.02, raw
    assert abs(np.mean(fixed)) < 0.02, fixed


def duplicated_columns(n=500, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 2))
    X = np.column_stack([x[:, 0], x[:, 0], x[:, 1]])
    y = X[:, 0] + rng.standard_normal(n)
    return jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32)


def test_singular_j_raises_and_regularize_fixes_it():
    X, y = duplicated_columns()
    z = {"beta": jnp.array([0.5, 0.5, 0.0])}
    with pytest.raises(ValueError, match="regularize") as err:
        information(flat_regression, KEY, X, y, params=z)
    assert "beta[0]" in str(err.value) and "beta[1]" in str(err.value)
    assert "smallest eigenvalue" in str(err.value)

    auto = information(flat_regression, KEY, X, y, params=z, regularize="auto")
    vals = np.linalg.eigvalsh(auto.potential_curvature)
    assert auto.regularization > 0 and vals[0] >= 0.99e-6 * vals[-1]
    assert vals[0] < 1e-4 * vals[-1]  # the smallest ridge that does it, not a big one
    assert np.all(np.isfinite(np.asarray(auto.sandwich))) and "regularization" in str(auto)

    ridge = information(flat_regression, KEY, X, y, params=z, regularize=0.01)
    assert ridge.regularization == 0.01
    np.testing.assert_allclose(ridge.J - auto.J, (0.01 - auto.regularization) * np.eye(3))


def test_errors_for_no_subsample_plate_bad_params_and_non_finite_values():
    X, y = duplicated_columns()

    def no_subsample(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ theta, 1.0), obs=y)

    with pytest.raises(ValueError, match="no subsample plate"):
        information(no_subsample, KEY, X, y, params={"theta": jnp.zeros(3)})
    with pytest.raises(ValueError, match="latent sites"):
        information(flat_regression, KEY, X, y, params={"theta": jnp.zeros(3)})
    with pytest.raises(ValueError, match="no chain axis"):
        information(flat_regression, KEY, X, y, params={"beta": jnp.zeros((2, 3))})
    with pytest.raises(ValueError, match="not at a mode"):
        information(flat_regression, KEY, X, y, params={"beta": jnp.array([0.0, np.nan, 0.0])})
    with pytest.raises(ValueError, match="kind"):
        information(flat_regression, KEY, X, y, params={"beta": jnp.zeros(3)}, kind="full")


def test_one_row_and_a_full_batch():
    """One row: ``J`` is its curvature and ``I`` (a covariance of one gradient) is zero, with
    no replicates to divide by; a batch of every row draws ``arange(n)``, so its gradient has
    no noise."""
    y = jnp.ones((1, 4))
    params = {"loc": jnp.zeros(4), "shift": jnp.array(0.0)}
    info = information(independent_means, KEY, y, np.ones(4), params=params)
    np.testing.assert_allclose(np.diag(info.J.matrix), [1, 1, 1, 1, 0], rtol=1e-6)
    assert np.all(info.I.matrix == 0) and info.replicates == ()
    np.testing.assert_array_equal(info.jackknife(lambda J, I: J.diagonal()), np.zeros(5))
    y = jnp.asarray(np.random.default_rng(3).standard_normal((40, 4)), jnp.float32)
    info = information(independent_means, KEY, y, np.ones(4), params=params)
    assert np.all(noise(info, 40) == 0)
    np.testing.assert_allclose(np.diag(noise(info, 20))[:4], np.diag(info.I.matrix)[:4] / 20)


def test_every_part_draws_from_its_own_stream():
    streams = list(Stream)
    assert len({s.value for s in streams}) == len(streams)  # @unique: no two share
    draws = {s: s.rng(KEY).integers(0, 2**62, 4).tolist() for s in streams}
    same_key = [s for s in streams if s.value[0] == "information"]
    assert len({tuple(draws[s]) for s in same_key}) == len(same_key)
    # choose_rows is the information stream's: the same key, the same rows
    plates = (SubsamplePlate("data", 1000, 10),)
    np.testing.assert_array_equal(
        choose_rows(plates, 100, KEY)["data"], choose_rows(plates, 100, KEY)["data"]
    )


@pytest.mark.slow  # 10-23 s: the quick suite's 10 minutes
def noise_over_keys(prepared, args, params, covariance, num_rows, keys=24):
    """The control-variate noise's diagonal over ``keys`` row and probe draws: ``(draws,
    spread, ratio)``, the relative spread of each entry, and its median over the stated
    error."""
    from numpyro_sgmc.tuner.fisher import control_variate_noise

    draws, stated = [], []
    for k in range(keys):
        noise, error = control_variate_noise(
            prepared, jax.random.key(k), args, {}, params, covariance, num_rows=num_rows
        )
        draws.append(np.diag(np.asarray(noise["data"].as_matrix())))
        stated.append(error["data"])
    draws = np.asarray(draws)
    spread = draws.std(axis=0, ddof=1) / draws.mean(axis=0)
    return draws, spread, np.median(spread / np.mean(stated, axis=0))


def test_the_control_variate_noise_states_its_probes_error():
    """Above 64 parameters the control-variate noise comes from random probes of ``N(0, Σ)``;
    the relative error it states for each diagonal entry (from the probes' spread) is the
    spread of the entry over independent probe draws, and its ``d`` exact probes state none."""
    from numpyro_sgmc.data.model import prepare_model
    from numpyro_sgmc.scales import Dense
    from numpyro_sgmc.tuner.fisher import control_variate_noise

    X, y = make_logistic(n=2000, d=100, seed=3)[:2]
    prepared = prepare_model(jax.random.key(0), logistic_regression, (X, y), {})
    params = {"theta": jnp.full(100, 0.05)}
    covariance = Dense(np.eye(100) * 1e-3)
    _, spread, ratio = noise_over_keys(prepared, (X, y), params, covariance, 2000)
    assert 0.8 < ratio < 1.25, ratio  # 24 draws: the median's own error is a few percent
    # a real error, far below the bound √(2/K) = 18% (each entry sums over many directions)
    assert 0.005 < np.median(spread) < 0.1
    _, exact = control_variate_noise(
        prepared, jax.random.key(0), (X, y), {}, params, covariance, num_rows=2000,
        num_probes=100,
    )  # fmt: skip
    assert np.all(exact["data"] == 0.0)


@pytest.mark.slow  # about 10 s
def test_the_control_variate_noise_probes_on_rows_of_their_own():
    """Above :data:`CONTROL_VARIATE_ROWS` rows, each of the 64 random probes evaluates its
    own window of them (every row used by some probe, at a tenth of the work here): the
    estimate still averages to the exact ``diag M(Σ) = diag[(1/n)Σ_i H_iΣH_i - H̄ΣH̄]`` of
    the logistic rows (``H_i = p_i(1-p_i)x_ix_iᵀ``, float64, a small ``Σ`` where the gradient is
    linear), and the error it states, which now counts the windows' sampling, is the spread
    of the estimate over keys."""
    from numpyro_sgmc.data.model import prepare_model
    from numpyro_sgmc.scales import Dense

    n, d, s2 = 20_000, 100, 1e-4
    X, y = make_logistic(n=n, d=d, seed=3)[:2]
    prepared = prepare_model(jax.random.key(0), logistic_regression, (X, y), {})
    theta = np.full(d, 0.05)
    Xn = np.asarray(X, np.float64)
    p = 1 / (1 + np.exp(-Xn @ theta))
    w = p * (1 - p)
    # diag M = s2 [(1/n) Σ_i w_i² |x_i|² x_i² - (H̄²)_jj], H̄ = (1/n) Σ_i w_i x_i x_iᵀ
    mean_h = (Xn * w[:, None]).T @ Xn / n
    exact = s2 * (np.mean((w**2 * np.sum(Xn**2, 1))[:, None] * Xn**2, 0) - np.sum(mean_h**2, 0))
    params = {"theta": jnp.asarray(theta, jnp.float32)}
    draws, _, ratio = noise_over_keys(prepared, (X, y), params, Dense(np.eye(d) * s2), n)
    assert 0.8 < ratio < 1.25, ratio
    # the mean of 24 estimates, each of the 100 entries within 4.5 standard errors of the exact
    z = (draws.mean(0) - exact) / (draws.std(axis=0, ddof=1) / np.sqrt(len(draws)))
    assert np.max(np.abs(z)) < 4.5, np.sort(np.abs(z))[-5:]


def group_intercepts(group, y=None, num_groups=30):
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 2.0).expand([num_groups]).to_event(1))
    with numpyro.plate("data", group.shape[0], subsample_size=100):
        gb = numpyro.subsample(group, event_dim=0)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=alpha[gb]), obs=yb)


def test_the_control_variate_noise_is_its_average_over_the_chains_law_not_far_out():
    """Up to 64 parameters the control-variate noise's probes are a Hadamard design, one sd
    along every direction: the estimate is the noise averaged over ``N(0, Σ)``, the law the
    chain samples, even where the per-datum gradient is far from linear a few sds out.
    Group intercepts (each moves only its own rows' logits, ``p ≈ 0.18``): the per-datum
    covariance of ``∇l_i(α̂ + δ) - ∇l_i(α̂)`` averaged over ``δ ~ N(0, s²I)``, by quadrature in
    float64, is matched within 2%; probes ``√30`` sds along one intercept each put it 57% high
    (the run's sds of a 40-group hierarchy then 10% narrow)."""
    from numpyro_sgmc.data.model import prepare_model
    from numpyro_sgmc.scales import Dense
    from numpyro_sgmc.tuner.fisher import control_variate_noise

    n, k, a, s = 3000, 30, -1.5, 0.15
    group = np.arange(n) % k
    y = (np.random.default_rng(0).random(n) < 0.18).astype(np.float32)
    args = (jnp.asarray(group), jnp.asarray(y))
    prepared = prepare_model(KEY, group_intercepts, args, {})
    params = {"alpha": jnp.full(k, a)}
    noise, error = control_variate_noise(
        prepared, KEY, args, {}, params, Dense(np.eye(k) * s**2), num_rows=n
    )
    # every group has n/k rows with the same gradient change Δ(δ) = σ(a + δ) - σ(a), and the
    # other rows none: Cov_i = (1/k - 1/k²) E[Δ²]
    t, w = np.polynomial.hermite_e.hermegauss(60)
    change = 1 / (1 + np.exp(-(a + s * t))) - 1 / (1 + np.exp(-a))
    exact = (1 / k - 1 / k**2) * np.sum(w * change**2) / np.sum(w)
    ratio = np.diag(np.asarray(noise["data"].as_matrix())) / exact
    np.testing.assert_allclose(ratio, 1.0, atol=0.02)
    assert np.all(error["data"] == 0.0)  # a design on every row: no error of its own


def test_the_control_variate_noise_states_its_rows_error():
    """The Hadamard design on 2000 of 20,000 rows: the error it states for each diagonal
    entry is the rows' sampling (the spread over rows of each row's share, times the
    finite-population factor), which is the entry's spread over row samples."""
    from numpyro_sgmc.data.model import prepare_model
    from numpyro_sgmc.scales import Dense

    d = 10
    X, y = make_logistic(n=20_000, d=d, seed=3)[:2]
    prepared = prepare_model(jax.random.key(0), logistic_regression, (X, y), {})
    params = {"theta": jnp.full(d, 0.05)}
    _, spread, ratio = noise_over_keys(prepared, (X, y), params, Dense(np.eye(d) * 1e-3), 2000)
    assert 0.75 < ratio < 1.33, ratio
    assert 0.01 < np.median(spread) < 0.2, spread
