"""Models users bring, and their references: the zoo of ``tests/test_user_models.py`` and
``benchmarks/user_models.py``.

Each :class:`UserModel` is a NumPyro model with a subsample plate, a data generator, the
target to tune for, and a reference for the unconstrained sds: a float64 Laplace
approximation of the posterior (:func:`laplace64`), the exact float64 sandwich
(:func:`sandwich64`), or NUTS on the full data (:func:`nuts_reference`). None of them is one of
the clean models the kernels were built on: hierarchical scales with no per-datum gradient,
heavy-tailed gradients on raw covariate scales, two plates, d up to 650, a covariate on a
scale 10⁴ times the others.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.flatten_util import ravel_pytree
from numpyro.infer import MCMC, NUTS, init_to_mean
from numpyro.infer.util import constrain_fn, get_transforms, initialize_model, log_likelihood

from numpyro_sgmc import full_data


class UserModel(NamedTuple):
    """A model, its data (``make(seed) -> (args, kwargs)``), the target, and its reference
    (``reference(args, kwargs) -> {site: unconstrained sd}``)."""

    name: str
    model: Callable
    make: Callable
    target: str
    reference: Callable
    reference_kind: str


# ---- the models ----------------------------------------------------------------------------


def hierarchical_logistic(X, group, y=None, num_groups=20):
    """Group intercepts around a mean, with a HalfNormal group scale: ``mu`` and ``tau`` have no
    per-datum gradient."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    alpha = numpyro.sample("alpha", dist.Normal(mu, tau).expand([num_groups]).to_event(1))
    beta = numpyro.sample("beta", dist.Normal(0.0, 5.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        gb = numpyro.subsample(group, event_dim=0)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=alpha[gb] + Xb @ beta), obs=yb)


def make_hierarchical(seed=0, n=20_000, num_groups=20):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 3)).astype(np.float32)
    group = rng.integers(0, num_groups, n)
    alpha = rng.normal(0.3, 0.7, num_groups)
    logits = alpha[group] + X @ np.array([0.5, -0.5, 0.2])
    y = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return (X, group, y), {"num_groups": num_groups}


def unequal_groups_poisson(X, group, y=None, num_groups=400):
    """Centred group intercepts under a half-Cauchy scale, Poisson counts, two covariates."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", num_groups):
        alpha = numpyro.sample("alpha", dist.Normal(mu, tau))
    with numpyro.plate("data", X.shape[0], subsample_size=500):
        Xb = numpyro.subsample(X, event_dim=1)
        gb = numpyro.subsample(group, event_dim=0)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Poisson(jnp.exp(alpha[gb] + Xb @ beta)), obs=yb)


def make_unequal_groups(seed=1, num_groups=400, num_thin=30, num_large=10, n=20_000):
    """Groups of log-uniform sizes from 2 rows up, ``num_thin`` of them of 2-3 rows and
    ``num_large`` of n/40-n/20 rows, the rest scaled to about ``n`` rows in all; a covariate
    on a raw scale (mean 200, sd 1000)."""
    rng = np.random.default_rng(seed)
    sizes = np.round(np.exp(rng.uniform(np.log(2), np.log(2000), num_groups))).astype(int)
    sizes[:num_thin] = rng.integers(2, 4, num_thin)
    sizes[num_thin : num_thin + num_large] = rng.integers(n // 40, n // 20, num_large)
    rest = n - sizes[: num_thin + num_large].sum()
    middle = sizes[num_thin + num_large :] * rest / sizes[num_thin + num_large :].sum()
    sizes[num_thin + num_large :] = np.maximum(2, np.round(middle))
    group = rng.permutation(np.repeat(np.arange(num_groups), sizes))
    alpha = rng.normal(0.5, 0.7, num_groups)
    X = np.column_stack([rng.normal(0, 1, group.size), rng.normal(200, 1000, group.size)])
    y = rng.poisson(np.exp(alpha[group] + X @ np.array([0.3, 3e-4])))
    args = (X.astype(np.float32), group.astype(np.int32), y.astype(np.float32))
    return args, {"num_groups": num_groups}


def weibull_raw(X, t, event):
    """Weibull survival times, right-censored (``event = 0``: the log-survival ``-(t/s)^k``
    as a factor), the scale log-linear in covariates on their raw scales."""
    b0 = numpyro.sample("b0", dist.Normal(0.0, 10.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    k = numpyro.sample("k", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("rows", X.shape[0], subsample_size=200):
        Xb = numpyro.subsample(X, event_dim=1)
        tb = numpyro.subsample(t, event_dim=0)
        observed = numpyro.subsample(event, event_dim=0) > 0.5
        scale = jnp.exp(b0 + Xb @ beta)
        numpyro.sample("t", dist.Weibull(scale, k).mask(observed), obs=tb)
        numpyro.factor("censored", jnp.where(observed, 0.0, -((tb / scale) ** k)))


def make_weibull_raw(seed=2, n=50_000):
    """An age in years (20-90), an income in dollars (10⁴-10⁵) and a treatment; about 40%
    of the times censored."""
    rng = np.random.default_rng(seed)
    age = rng.uniform(20, 90, n)
    income = np.clip(np.exp(rng.normal(np.log(3e4), 0.6, n)), 1e4, 1e5)
    X = np.column_stack([age, income, rng.integers(0, 2, n)])
    T = np.exp(3.0 + X @ np.array([-0.02, 5e-6, 0.3])) * rng.weibull(1.5, n)
    C = rng.exponential(np.median(T) * 2.0, n)
    args = (X.astype(np.float32), np.minimum(T, C).astype(np.float32), (T <= C).astype(np.float32))
    return args, {}


def poisson_raw(X, y=None):
    """Poisson regression on covariates on their raw scales (an age in years, an income in
    dollars), with an intercept."""
    b0 = numpyro.sample("b0", dist.Normal(0.0, 10.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=200):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Poisson(jnp.exp(b0 + Xb @ beta)), obs=yb)


def make_overdispersed(seed=0, n=20_000):
    """Negative-binomial counts (concentration 1.2): the Poisson fit's per-datum gradients are
    heavy-tailed, and ``I`` is far from ``J``."""
    rng = np.random.default_rng(seed)
    age = rng.uniform(18, 80, n)
    income = rng.lognormal(10.5, 0.6, n)
    visits = rng.poisson(3.0, n)
    X = np.column_stack([age, income, visits]).astype(np.float32)
    mean = np.exp(0.2 + 0.01 * age + 1e-5 * income + 0.05 * visits)
    y = rng.negative_binomial(1.2, 1.2 / (1.2 + mean)).astype(np.float32)
    return (X, y), {}


def nb2_raw(X, y=None):
    """Negative-binomial (NB2, log link) regression on raw covariates with an intercept column,
    laid out as the RAND health insurance experiment's doctor visits: a log coinsurance rate,
    binary plan and health indicators, a count of chronic diseases up to about 70. A draw
    from the N(0, 10²) prior puts ``X @ beta`` in the hundreds, where ``exp`` overflows."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    alpha = numpyro.sample("alpha", dist.HalfNormal(5.0))
    with numpyro.plate("data", X.shape[0], subsample_size=500):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.NegativeBinomial2(jnp.exp(Xb @ beta), alpha), obs=yb)


def make_nb2(seed=0, n=20_000):
    rng = np.random.default_rng(seed)
    X = np.column_stack([
        np.ones(n), rng.uniform(0, 4.6, n), rng.integers(0, 2, n), rng.uniform(0, 7, n),
        rng.integers(0, 2, n), rng.gamma(2.0, 6.0, n), rng.integers(0, 2, n),
    ]).astype(np.float32)  # fmt: skip
    mean = np.exp(X @ np.array([0.7, -0.05, -0.1, 0.05, 0.2, 0.02, 0.3]))
    y = rng.negative_binomial(1.0, 1.0 / (1.0 + mean)).astype(np.float32)
    return (X, y), {}


def two_plates(X, y, counts, z=None):
    """A regression on one dataset and a Poisson rate on another, sharing ``beta``: two
    subsample plates of different sizes and batch sizes."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 3.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(3.0))
    rate = numpyro.sample("rate", dist.Normal(0.0, 3.0))
    with numpyro.plate("rows", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Normal(Xb @ beta, sigma), obs=yb)
    with numpyro.plate("visits", counts.shape[0], subsample_size=40):
        cb = numpyro.subsample(counts, event_dim=1)
        zb = None if z is None else numpyro.subsample(z, event_dim=0)
        numpyro.sample("z", dist.Poisson(jnp.exp(rate + cb @ beta)), obs=zb)


def make_two_plates(seed=0, n1=30_000, n2=12_000):
    rng = np.random.default_rng(seed)
    beta = np.array([0.5, -0.3, 0.2])
    X = rng.standard_normal((n1, 3)).astype(np.float32)
    y = (X @ beta + 1.5 * rng.standard_normal(n1)).astype(np.float32)
    counts = (0.5 * rng.standard_normal((n2, 3))).astype(np.float32)
    z = rng.poisson(np.exp(0.3 + counts @ beta)).astype(np.float32)
    return (X, y, counts, z), {}


def logistic(X, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=200):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ beta), obs=yb)


def make_wide_logistic(seed=0, n=30_000, d=120, rho=0.0):
    """``d`` covariates, equicorrelated with ``rho``; coefficients of size ``1/√d``."""
    rng = np.random.default_rng(seed)
    Z = rng.standard_normal((n, d))
    if rho:
        Z = np.sqrt(1 - rho) * Z + np.sqrt(rho) * rng.standard_normal((n, 1))
    beta = rng.normal(0.0, 1.0 / np.sqrt(d), d)
    y = (rng.random(n) < 1 / (1 + np.exp(-Z @ beta))).astype(np.float32)
    return (Z.astype(np.float32), y), {}


def make_scaled_covariate(seed=0, n=20_000):
    """Logistic regression with one covariate 10⁴ times the others' scale (an intercept, two
    standard covariates, one in units 10⁴ too small)."""
    rng = np.random.default_rng(seed)
    Z = rng.standard_normal((n, 3))
    X = np.column_stack([np.ones(n), Z[:, 0], Z[:, 1], 1e4 * Z[:, 2]])
    logits = 0.3 + 0.8 * Z[:, 0] - 0.5 * Z[:, 1] + 0.6 * Z[:, 2]
    y = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return (X.astype(np.float32), y), {}


def softmax(X, y=None, num_classes=10):
    W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([X.shape[1], num_classes]).to_event(2))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Categorical(logits=Xb @ W), obs=yb)


def make_softmax(seed=0, n=2000, d=65, num_classes=10):
    """``d·K = 650`` parameters on 2000 rows."""
    rng = np.random.default_rng(seed)
    X = np.column_stack([np.ones(n), rng.standard_normal((n, d - 1))]).astype(np.float32)
    W = rng.normal(0.0, 0.3, (d, num_classes))
    logits = X @ W
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    y = np.array([rng.choice(num_classes, p=row) for row in p], np.int32)
    return (X, y), {"num_classes": num_classes}


def one_hot_poisson(X, log_exposure, y=None):
    """Counts with an exposure, a coefficient per one-hot level of a category and per
    covariate (no intercept), under N(0, 5²) priors."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 5.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("rows", X.shape[0], subsample_size=400):
        Xb = numpyro.subsample(X, event_dim=1)
        offset = numpyro.subsample(log_exposure, event_dim=0)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Poisson(jnp.exp(Xb @ beta + offset)), obs=yb)


def make_thin_levels(seed=5, n=20_000, num_levels=40, num_thin=8):
    """:func:`one_hot_poisson`'s data: the first ``num_thin`` levels have 1-3 rows each, the
    others share the rest; two standard-normal covariates. Returns ``(args, kwargs, level)``,
    ``level`` each row's level."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 4, num_thin)
    rest = rng.integers(num_thin, num_levels, n - sizes.sum())
    level = rng.permutation(np.concatenate([np.repeat(np.arange(num_thin), sizes), rest]))
    x = rng.normal(size=(n, 2))
    exposure = rng.uniform(0.5, 5.0, n)
    rate = exposure * np.exp(rng.normal(-1.0, 0.5, num_levels)[level] + x @ [0.3, -0.2])
    X = np.column_stack([np.eye(num_levels)[level], x]).astype(np.float32)
    args = (X, np.log(exposure).astype(np.float32), rng.poisson(rate).astype(np.float32))
    return args, {}, level


# ---- references ------------------------------------------------------------------------------


def thin_class(seed=0, n=5000):
    """Three classes, the third seen on 30 rows and never at night: its night coefficient is
    held by the N(0, 10²) prior on one side and by the data on the other."""
    rng = np.random.default_rng(seed)
    night = (rng.random(n) < 0.3).astype(np.float32)
    X = np.column_stack([np.ones(n), night]).astype(np.float32)
    y = rng.choice(2, n, p=[0.6, 0.4])
    y[rng.choice(np.flatnonzero(night == 0), 30, replace=False)] = 2
    return X, y.astype(np.int32)


def softmax_with_reference(X, y=None):
    """A softmax regression with class 0 as the reference (its logits fixed at zero)."""
    W = numpyro.sample("W", dist.Normal(0.0, 10.0).expand([X.shape[1], 2]).to_event(2))
    with numpyro.plate("rows", X.shape[0], subsample_size=200):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        logits = jnp.concatenate([jnp.zeros((Xb.shape[0], 1)), Xb @ W], axis=1)
        numpyro.sample("y", dist.Categorical(logits=logits), obs=yb)


def _float64(tree):
    return jax.tree.map(
        lambda a: (
            np.asarray(a, np.float64)
            if np.issubdtype(np.asarray(a).dtype, np.floating)
            else np.asarray(a)
        ),  # fmt: skip
        tree,
    )


def _mode64(model, args, kwargs, iterations=50, start=None):
    """The float64 posterior mode (unconstrained, flat), the Hessian of the potential there,
    and the unravel function: damped Newton from the prior mean, or from ``start`` (site ->
    unconstrained value), where the prior mean is too far for them (raw covariate scales)."""
    full = full_data(model)
    info = initialize_model(
        jax.random.key(0), full, model_args=args, model_kwargs=kwargs, init_strategy=init_to_mean
    )
    z0, unravel = ravel_pytree(info.param_info.z if start is None else _float64(start))
    potential = jax.jit(lambda x: info.potential_fn(unravel(x)))
    grad, hess = jax.jit(jax.grad(potential)), jax.jit(jax.hessian(potential))
    x = np.asarray(z0, np.float64)
    for _ in range(iterations):
        g, H = np.asarray(grad(x)), np.asarray(hess(x))
        step = np.linalg.solve(H + 1e-10 * np.eye(x.size), g)
        u, t = float(potential(x)), 1.0
        while t > 1e-6 and not float(potential(x - t * step)) <= u + 1e-12 * abs(u):
            t /= 2
        x = x - t * step
        if float(g @ step) < 1e-12:
            break
    return x, np.asarray(hess(x)), unravel, info


def _by_site(flat, unravel):
    return {k: np.asarray(v) for k, v in unravel(jnp.asarray(flat)).items()}


def laplace64(model, args, kwargs, start=None):
    """Unconstrained posterior sds of the float64 Laplace approximation at the mode
    (``start``: as for :func:`_mode64`)."""
    with jax.enable_x64(True):
        args, kwargs = _float64(args), _float64(kwargs)
        _, H, unravel, _ = _mode64(model, args, kwargs, start=start)
        return _by_site(np.sqrt(np.diag(np.linalg.inv(H))), unravel)


def sandwich64(model, args, kwargs):
    """Unconstrained sds of the exact float64 sandwich ``H⁻¹(Σᵢ gᵢgᵢᵀ - n ḡḡᵀ)H⁻¹`` at the
    mode, ``gᵢ`` the per-datum log-likelihood gradients over every row (one plate)."""
    with jax.enable_x64(True):
        args, kwargs = _float64(args), _float64(kwargs)
        x, H, unravel, info = _mode64(model, args, kwargs)
        full = full_data(model)

        def per_datum(flat):
            z = unravel(flat)
            values = constrain_fn(full, args, kwargs, z)
            ll = log_likelihood(full, values, *args, batch_ndims=0, **kwargs)
            return jnp.concatenate([v.reshape(-1) for v in ll.values()])

        G = np.asarray(jax.jacfwd(per_datum)(jnp.asarray(x)))
        G = G - G.mean(axis=0)
        H_inv = np.linalg.inv(H)
        S = H_inv @ (G.T @ G) @ H_inv
        return _by_site(np.sqrt(np.diag(S)), unravel)


def nuts_draws(model, args, kwargs, num_samples=4000, seed=0):
    """Unconstrained posterior draws from NUTS on the full data, by site."""
    full = full_data(model)
    mcmc = MCMC(NUTS(full), num_warmup=1000, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.key(seed), *args, **kwargs)
    samples = mcmc.get_samples()
    transforms = get_transforms(numpyro.handlers.seed(full, rng_seed=0), args, kwargs, {})
    return {
        site: np.asarray(jax.vmap(transforms[site].inv)(value))
        for site, value in samples.items()
        if site in transforms
    }


def nuts_reference(model, args, kwargs, num_samples=4000, seed=0):
    """Unconstrained posterior sds from NUTS on the full data."""
    draws = nuts_draws(model, args, kwargs, num_samples, seed)
    return {site: value.std(axis=0) for site, value in draws.items()}


MODELS = {
    "hierarchical": UserModel(
        "hierarchical logistic, group scale", hierarchical_logistic, make_hierarchical,
        "posterior", lambda a, k: nuts_reference(hierarchical_logistic, a, k), "NUTS",
    ),
    "poisson_posterior": UserModel(
        "over-dispersed counts, Poisson, raw covariates", poisson_raw, make_overdispersed,
        "posterior", lambda a, k: laplace64(poisson_raw, a, k), "float64 Laplace",
    ),
    "poisson_sandwich": UserModel(
        "over-dispersed counts, Poisson, raw covariates", poisson_raw, make_overdispersed,
        "local_fiducial", lambda a, k: sandwich64(poisson_raw, a, k), "exact sandwich",
    ),
    "nb2_raw": UserModel(
        "negative binomial, raw covariates", nb2_raw, make_nb2, "posterior",
        lambda a, k: laplace64(nb2_raw, a, k), "float64 Laplace",
    ),
    "two_plates": UserModel(
        "two plates sharing coefficients", two_plates, make_two_plates, "posterior",
        lambda a, k: laplace64(two_plates, a, k), "float64 Laplace",
    ),
    "wide_independent": UserModel(
        "logistic, d = 120, independent", logistic, make_wide_logistic, "posterior",
        lambda a, k: laplace64(logistic, a, k), "float64 Laplace",
    ),
    "wide_correlated": UserModel(
        "logistic, d = 120, correlated (ρ = 0.6)", logistic,
        lambda seed=0: make_wide_logistic(seed, rho=0.6), "posterior",
        lambda a, k: laplace64(logistic, a, k), "float64 Laplace",
    ),
    "scaled_covariate": UserModel(
        "logistic, one covariate x10⁴", logistic, make_scaled_covariate, "posterior",
        lambda a, k: laplace64(logistic, a, k), "float64 Laplace",
    ),
    "softmax": UserModel(
        "softmax, 650 parameters, 2000 rows", softmax, make_softmax, "posterior",
        lambda a, k: laplace64(softmax, a, k), "float64 Laplace",
    ),
}  # fmt: skip
