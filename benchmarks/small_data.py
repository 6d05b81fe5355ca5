"""Fixed costs at the sizes most users have: autotune + sampling to ESS 1000 against NUTS,
compilation included, in one process.

Models (``tests/user_models.py``): logistic regression with d = 10 at n = 10⁴, 10⁵, 10⁶; a
hierarchical logistic regression with 40 group intercepts, their mean and scale (45
parameters, n = 5·10⁴); the two-plate model (n = 3·10⁴ + 1.3·10⁴). For each:

* **ours**: ``autotune`` (first call: traces and compiles; then a second call on new data of
  the same shape, which reuses every compiled function), then ``run_kernel`` for
  ``report.draws_for(1000)`` draws (one chain; the compiled loop is cached across calls);
  time to ESS 1000 = autotune + sampling, with the ESS of the draws printed;
* **NUTS** on the full data, 500 warm-up and 1000 draws, one chain; its time is scaled to a
  minimum ESS of 1000 (``time · 1000 / ESS_min``, warm-up included);
* **the floor**: what any tuned SG-MCMC run must at least compile and run, written by hand
  for each model (:class:`FloorModel`: its potential on the unconstrained vector, scales as
  logs with their log-Jacobians, as NumPyro's) as two jitted programs with the tuning given,
  no model tracing and no checks. The tuner: full-data Newton steps from zero (log-scales 0)
  with the exact Hessian ``J`` (each coordinate's step clipped to ±1), eight for the logistic
  regression and twelve for the others, then ``J⁻¹``, the full-data gradient and ``I`` from
  10,000 rows of each plate. The sampler: 3000 iterations of control-variate SGLD
  preconditioned by ``J⁻¹``, each plate's rows drawn with replacement at the model's batch
  size (200; 100; 100 and 40), the terms with no per-datum gradient (priors, Jacobians)
  exact, a half step ``ε = 1/2`` with the noise ``(2ε - ε²)J⁻¹`` that makes the Gaussian's
  law stationary (the minibatch noise adds about 2% to the variances, 15-20% to the
  hierarchical model's, whose batch holds 2.5 rows of each group). Its time to ESS 1000 is
  scaled likewise and its covariance error against ``J⁻¹`` is printed: at this ESS, exact
  draws would already be off by about 0.08 at d = 10 and 0.2 at d = 45. It runs after ours
  and NUTS, so JAX's one-time start-up is not charged to it;
* **the floor through NumPyro** (:class:`NumPyroFloor`): the same two programs, the same
  algorithm and the same draws (its potential equals the hand-written one), on the user's
  NumPyro model itself: ``potential_energy`` under ``full_data`` for every row and with each
  plate's indices substituted for a minibatch, ``I`` from one-row substitutions. What it adds
  to the floor is what evaluating a model through NumPyro costs (tracing its handlers and
  distributions, compiling what they emit); nothing that takes NumPyro models can go below it.

Medians over ``--reps`` repetitions (seeds), in one process: the first repetition of each
model pays the compilation, later ones find the functions compiled (the second-call column).
With ``--cache DIR`` JAX's persistent compilation cache is on
(:func:`numpyro_sgmc.enable_compilation_cache`): run twice to see a fresh process that finds
its compilations on disk.

    python benchmarks/small_data.py
    python benchmarks/small_data.py --models logistic --sizes 1e5 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from jax.flatten_util import ravel_pytree
from numpyro.diagnostics import effective_sample_size
from numpyro.handlers import seed, substitute, trace
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import potential_energy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from user_models import (  # noqa: E402
    hierarchical_logistic,
    logistic,
    make_hierarchical,
    make_two_plates,
    make_wide_logistic,
    two_plates,
)

import numpyro_sgmc  # noqa: E402
from numpyro_sgmc import autotune, full_data, run_kernel  # noqa: E402


def cases(sizes):
    for n in sizes:
        yield (
            f"logistic d=10, n={n:.0e}",
            logistic,
            LOGISTIC,
            lambda s, n=n: make_wide_logistic(s, n, 10),
        )
    yield (
        "hierarchical, 45 parameters, n=5e4",
        hierarchical_logistic,
        HIERARCHICAL,
        lambda s: make_hierarchical(s, n=50_000, num_groups=40),
    )
    yield (
        "two plates, n=3e4+1.3e4",
        two_plates,
        TWO_PLATES,
        lambda s: make_two_plates(s, 30_000, 13_000),
    )


def ours(model, make, seed):
    args, kwargs = make(seed)
    start = time.perf_counter()
    kernel, report = autotune(model, jax.random.key(seed), *args, model_kwargs=kwargs)
    tuned = time.perf_counter()
    run = run_kernel(
        kernel,
        jax.random.key(seed + 1),
        *args,
        num_samples=report.draws_for(1000),
        model_kwargs=kwargs,
    )
    sampled = time.perf_counter()
    ess = min(
        float(np.min(effective_sample_size(np.asarray(v).reshape(1, v.shape[1], -1))))
        for v in run.samples.values()
    )
    return tuned - start, sampled - tuned, ess, report


def nuts(model, make, seed):
    args, kwargs = make(seed)
    start = time.perf_counter()
    mcmc = MCMC(NUTS(full_data(model)), num_warmup=500, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.key(seed), *args, **kwargs)
    samples = mcmc.get_samples(group_by_chain=True)
    jax.block_until_ready(samples)
    elapsed = time.perf_counter() - start
    ess = min(
        float(np.min(effective_sample_size(np.asarray(v).reshape(1, v.shape[1], -1))))
        for v in samples.values()
    )
    return elapsed * 1000.0 / ess, ess


class FloorModel(NamedTuple):
    """A model written by hand for the floor, on its unconstrained vector ``θ`` (NumPyro's
    potential up to a constant: each scale ``exp(u)`` with its log-Jacobian ``u``)."""

    #: ``(*args, **kwargs) -> (start, plates)``: the Newton start (zeros: log-scales 0) and
    #: each plate's arrays, rows first
    prepare: Callable
    #: ``(θ, plates) -> -log p0(θ)``: every term with no per-datum gradient (priors,
    #: log-Jacobians); the plates give only the shapes
    prior: Callable
    #: per plate, ``(θ, *rows) -> Σ log-likelihood`` over the rows given
    likelihoods: tuple
    #: per plate, the minibatch size (the model's ``subsample_size``)
    batches: tuple
    newton_steps: int


def _logistic_prepare(X, y):
    return np.zeros(X.shape[1], X.dtype), ((X, y),)


def _logistic_likelihood(beta, X, y):
    logits = X @ beta
    return jnp.sum(y * logits - jnp.logaddexp(0.0, logits))


#: beta ~ N(0, 2²)
LOGISTIC = FloorModel(
    _logistic_prepare, lambda beta, _: 0.125 * jnp.sum(beta**2), (_logistic_likelihood,), (200,), 8
)


def _hierarchical_prepare(X, group, y, num_groups):
    return np.zeros(2 + num_groups + X.shape[1], X.dtype), ((X, group, y),)


def _hierarchical_split(theta, k):
    """``θ = (mu, log tau, alpha, beta)``, ``beta`` the last ``k``."""
    return theta[0], theta[1], theta[2:-k], theta[-k:]


def _hierarchical_prior(theta, plates):
    mu, u, alpha, beta = _hierarchical_split(theta, plates[0][0].shape[1])
    tau = jnp.exp(u)
    # mu ~ N(0, 5²), tau ~ HalfNormal(2) with its log-Jacobian u, alpha ~ N(mu, tau²), beta ~
    # N(0, 5²): tau has no per-datum gradient, so all of this enters every step exactly
    return (
        mu**2 / 50
        + tau**2 / 8
        - u
        + jnp.sum((alpha - mu) ** 2) / (2 * tau**2)
        + alpha.size * u
        + jnp.sum(beta**2) / 50
    )


def _hierarchical_likelihood(theta, X, group, y):
    _, _, alpha, beta = _hierarchical_split(theta, X.shape[1])
    logits = alpha[group] + X @ beta
    return jnp.sum(y * logits - jnp.logaddexp(0.0, logits))


HIERARCHICAL = FloorModel(
    _hierarchical_prepare, _hierarchical_prior, (_hierarchical_likelihood,), (100,), 12
)


def _two_plates_prepare(X, y, counts, z):
    return np.zeros(X.shape[1] + 2, X.dtype), ((X, y), (counts, z))


def _two_plates_prior(theta, _):
    """``θ = (beta, log sigma, rate)``: beta ~ N(0, 3²), sigma ~ HalfNormal(3) with its
    log-Jacobian, rate ~ N(0, 3²)."""
    beta, u, rate = theta[:-2], theta[-2], theta[-1]
    return (jnp.sum(beta**2) + jnp.exp(2 * u) + rate**2) / 18 - u


def _rows_likelihood(theta, X, y):
    """y ~ Normal(X @ beta, sigma), up to a constant."""
    beta, u = theta[:-2], theta[-2]
    return jnp.sum(-0.5 * (y - X @ beta) ** 2 * jnp.exp(-2 * u) - u)


def _visits_likelihood(theta, counts, z):
    """z ~ Poisson(exp(rate + counts @ beta)), up to a constant."""
    log_rate = theta[-1] + counts @ theta[:-2]
    return jnp.sum(z * log_rate - jnp.exp(log_rate))


TWO_PLATES = FloorModel(
    _two_plates_prepare, _two_plates_prior, (_rows_likelihood, _visits_likelihood), (100, 40), 12
)


def _floor_potential(model, theta, plates, scales):
    """``U(θ)``, each plate's log-likelihood weighted by its scale (1 on the full data,
    ``n_p/b_p`` on a minibatch)."""
    return model.prior(theta, plates) - sum(
        s * likelihood(theta, *rows)
        for likelihood, rows, s in zip(model.likelihoods, plates, scales, strict=True)
    )


def _per_datum_covariance(likelihood, theta, rows, m=10_000):
    """The covariance of the per-datum gradients over the first ``m`` rows."""
    rows = tuple(a[:m] for a in rows)
    per_datum = jax.vmap(lambda *row: jax.grad(likelihood)(theta, *(a[None] for a in row)))
    return jnp.cov(per_datum(*rows).T)


@partial(jax.jit, static_argnums=0)
def _floor_tune(model, start, plates):
    """The tuner's floor: the mode by ``model.newton_steps`` full-data Newton steps from
    ``start`` with the exact Hessian ``J``, each coordinate's step clipped to ±1, ``J⁻¹``
    there, the full-data gradient (the control variates' centre) and ``I = Σ_p (n_p/n) Cov_p``
    from up to 10,000 rows of each plate."""
    full = {"plates": plates, "scales": (1.0,) * len(plates)}  # every row, scale 1
    grad = partial(jax.grad(_floor_potential, argnums=1), model, **full)
    hessian = partial(jax.hessian(_floor_potential, argnums=1), model, **full)

    def newton(theta, _):
        # each coordinate moves at most 1 (a scale e-fold): from the hierarchical model's start
        # (alpha = mu) the plain step sends log tau down the funnel to -78
        return theta - jnp.clip(jnp.linalg.solve(hessian(theta), grad(theta)), -1.0, 1.0), None

    mode, _ = lax.scan(newton, start, None, length=model.newton_steps)
    sizes = [rows[0].shape[0] for rows in plates]
    information = sum(
        n_p / sum(sizes) * _per_datum_covariance(likelihood, mode, rows)
        for likelihood, rows, n_p in zip(model.likelihoods, plates, sizes, strict=True)
    )
    return mode, jnp.linalg.inv(hessian(mode)), grad(mode), information


def _minibatch(key, rows, b):
    """``b`` rows drawn with replacement."""
    idx = random.randint(key, (b,), 0, rows[0].shape[0])
    return tuple(a[idx] for a in rows)


@partial(jax.jit, static_argnums=0)
def _floor_sample(model, key, plates, mode, covariance, centre):
    """The sampler's floor: 3000 iterations of control-variate SGLD preconditioned by ``J⁻¹``,
    each plate's minibatch scaled by ``n_p/b_p``; the prior's terms enter every step exactly
    (unscaled in both minibatch gradients, so ``ĝ`` holds their gradient at ``x``)."""
    grad = jax.grad(_floor_potential, argnums=1)
    root = jnp.linalg.cholesky(covariance)
    scales = tuple(rows[0].shape[0] / b for rows, b in zip(plates, model.batches, strict=True))
    eps = 0.5

    def step(x, k):
        *k_rows, k_noise = random.split(k, len(plates) + 1)
        batch = tuple(map(_minibatch, k_rows, plates, model.batches))
        g = grad(model, x, batch, scales) - grad(model, mode, batch, scales) + centre
        # x' = x - εJ⁻¹ĝ + ξ, ξ ~ N(0, (2ε - ε²)J⁻¹): the Gaussian's law is stationary
        noise = jnp.sqrt(2 * eps - eps**2) * root @ random.normal(k_noise, x.shape, x.dtype)
        x = x - eps * covariance @ g + noise
        return x, x

    return lax.scan(step, mode, random.split(key, 3000))[1]


class NumPyroFloor(NamedTuple):
    """The floor's algorithm on the user's NumPyro model itself, traced by NumPyro: each
    potential is ``numpyro.infer.util.potential_energy`` (the sites' transforms and
    log-Jacobians NumPyro's own), on every row under ``full_data`` and on a minibatch by
    substituting each subsample plate's indices (the plate then scales by ``n_p/b_p``)."""

    model: Callable
    kwargs: tuple  # the model's keyword arguments (static), as ``(name, value)`` pairs
    plates: tuple  # ``(name, size, batch size)`` of each subsample plate
    unravel: Callable  # the flat unconstrained vector to the latent sites' dict
    newton_steps: int

    def potential(self, theta, args, indices=None):
        """``U(θ)`` on every row (``indices=None``) or on the plates' ``indices``."""
        model = full_data(self.model) if indices is None else substitute(self.model, indices)
        return potential_energy(model, args, dict(self.kwargs), self.unravel(theta))


def numpyro_floor_of(model, floor_model, args, kwargs):
    """``(NumPyroFloor, start)``: the plates and the latent sites from one abstract trace of
    ``model`` (no eager NumPyro operation), the start at the unconstrained zeros (log-scales
    0), as the hand-written floor's."""
    plates = []

    def latent(key):
        model_trace = trace(seed(model, key)).get_trace(*args, **kwargs)
        plates.extend(
            (name, *site["args"]) for name, site in model_trace.items() if site["type"] == "plate"
        )
        return {
            name: site["value"]
            for name, site in model_trace.items()
            if site["type"] == "sample" and not site["is_observed"]
        }

    shapes = jax.eval_shape(latent, jax.random.key(0))
    start, unravel = ravel_pytree(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    subsampled = tuple(p for p in plates if p[2] is not None and p[2] < p[1])
    floor = NumPyroFloor(
        model, tuple(kwargs.items()), subsampled, unravel, floor_model.newton_steps
    )
    return floor, start


@partial(jax.jit, static_argnums=0)
def _numpyro_floor_tune(floor, start, args):
    """:func:`_floor_tune` on :meth:`NumPyroFloor.potential`; ``I`` from the first 10,000 rows
    of each plate, each row's gradient through a one-row substitution of its plate (scaled
    ``n_p/b_p`` by the plate, undone here) minus the first row's."""
    grad = jax.grad(floor.potential)
    hessian = jax.hessian(floor.potential)

    def newton(theta, _):
        step = jnp.linalg.solve(hessian(theta, args), grad(theta, args))
        return theta - jnp.clip(step, -1.0, 1.0), None

    mode, _ = lax.scan(newton, start, None, length=floor.newton_steps)
    first = {name: jnp.zeros(1, jnp.int32) for name, _, _ in floor.plates}
    n = sum(size for _, size, _ in floor.plates)
    information = 0.0
    for name, size, batch in floor.plates:

        def datum(i, name=name):
            return grad(mode, args, {**first, name: i[None]})

        g = jax.vmap(datum)(jnp.arange(min(size, 10_000)))
        information = information + size / n * jnp.cov(g.T) * (batch / size) ** 2
    return mode, jnp.linalg.inv(hessian(mode, args)), grad(mode, args), information


@partial(jax.jit, static_argnums=0)
def _numpyro_floor_sample(floor, key, args, mode, covariance, centre):
    """:func:`_floor_sample` on :meth:`NumPyroFloor.potential`: each step's minibatch is each
    plate's indices drawn with replacement at its batch size."""
    grad = jax.grad(floor.potential)
    root = jnp.linalg.cholesky(covariance)
    eps = 0.5

    def step(x, k):
        *k_rows, k_noise = random.split(k, len(floor.plates) + 1)
        indices = {
            name: random.randint(k_p, (batch,), 0, size)
            for (name, size, batch), k_p in zip(floor.plates, k_rows, strict=True)
        }
        g = grad(x, args, indices) - grad(mode, args, indices) + centre
        noise = jnp.sqrt(2 * eps - eps**2) * root @ random.normal(k_noise, x.shape, x.dtype)
        x = x - eps * covariance @ g + noise
        return x, x

    return lax.scan(step, mode, random.split(key, 3000))[1]


def _floor_result(start, tuned, draws, covariance):
    """``(tuning s, time to ESS 1000 s, ESS, covariance error)`` of a floor's two programs."""
    elapsed = time.perf_counter() - start
    draws, covariance = np.asarray(draws, np.float64), np.asarray(covariance, np.float64)
    ess = float(np.min(effective_sample_size(draws[None])))
    error = np.linalg.norm(np.cov(draws.T) - covariance) / np.linalg.norm(covariance)
    return tuned - start, elapsed * 1000.0 / min(ess, 1000), ess, error


def numpyro_floor(model, floor_model, make, seed):
    """:func:`floor` through NumPyro: the same two programs on ``model`` itself."""
    args, kwargs = make(seed)
    start = time.perf_counter()
    numpyro_model, theta = numpyro_floor_of(model, floor_model, args, kwargs)
    args = jax.tree.map(jnp.asarray, args)
    mode, covariance, centre, _ = jax.block_until_ready(
        _numpyro_floor_tune(numpyro_model, theta, args)
    )
    tuned = time.perf_counter()
    draws = jax.block_until_ready(
        _numpyro_floor_sample(numpyro_model, jax.random.key(seed), args, mode, covariance, centre)
    )
    return _floor_result(start, tuned, draws, covariance)


def floor(model, make, seed):
    """``(tuning s, time to ESS 1000 s, ESS, covariance error)`` of the floor's two programs
    for the :class:`FloorModel` ``model``, each compiled on its first call."""
    args, kwargs = make(seed)
    start = time.perf_counter()
    theta, plates = jax.tree.map(jnp.asarray, model.prepare(*args, **kwargs))
    mode, covariance, centre, _ = jax.block_until_ready(_floor_tune(model, theta, plates))
    tuned = time.perf_counter()
    draws = jax.block_until_ready(
        _floor_sample(model, jax.random.key(seed), plates, mode, covariance, centre)
    )
    return _floor_result(start, tuned, draws, covariance)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["logistic", "hierarchical", "two"])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1e4, 1e5, 1e6])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache", default=None, help="persistent compilation cache directory")
    parser.add_argument("--no-nuts", action="store_true")
    options = parser.parse_args()
    if options.cache:
        numpyro_sgmc.enable_compilation_cache(options.cache)
    warnings.simplefilter("ignore")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores")
    print(
        "| model | autotune s: first call / second call | sampling s | ESS | ours to ESS 1000 s "
        "(compile included) | NUTS to ESS 1000 s | NUTS / ours | floor: tuning s / to ESS 1000 s "
        "(covariance error) | floor through NumPyro s | ours / floor "
        "| ours / floor through NumPyro | NUTS / floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, model, floor_model, make in cases([int(n) for n in options.sizes]):
        if not any(label.startswith(m) for m in options.models):
            continue
        runs = [ours(model, make, seed) for seed in range(options.reps)]
        later = statistics.median(r[0] for r in runs[1:]) if len(runs) > 1 else float("nan")
        first, sampling, ess, _ = runs[0]
        total = (first + sampling) * 1000 / min(ess, 1000)  # the first call: compile included
        if options.no_nuts:
            reference, ratio = "-", "-"
        else:
            times = [nuts(model, make, seed)[0] for seed in range(options.reps)]
            reference = f"{statistics.median(times):.1f}"
            ratio = f"{statistics.median(times) / total:.1f}x"
        # its first call compiles; a second seed's would not, so only the first is shown
        floor_tuning, floor_time, _, error = floor(floor_model, make, 0)
        _, traced_time, _, _ = numpyro_floor(model, floor_model, make, 0)
        best = f"{floor_tuning:.2f} / {floor_time:.2f} ({error:.3f})"
        above = f"{total / floor_time:.1f}x | {total / traced_time:.1f}x"
        versus = "-" if options.no_nuts else f"{statistics.median(times) / floor_time:.1f}x"
        print(
            f"| {label} | {first:.1f} / {later:.2f} | {sampling:.2f} | {ess:.0f} | {total:.1f} | "
            f"{reference} | {ratio} | {best} | {traced_time:.2f} | {above} | {versus} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
