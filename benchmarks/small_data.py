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
* **the floor** (logistic rows only): what any tuned SG-MCMC run must at least compile and
  run, written by hand as two jitted programs with the tuning given, no model tracing and no
  checks. The tuner: eight full-data Newton steps from zero with the exact Hessian ``J``,
  then ``J⁻¹``, the full-data gradient and ``I`` from 10,000 rows. The sampler: 3000
  iterations of control-variate SGLD preconditioned by ``J⁻¹``, ``b = 200``, a half step
  ``ε = 1/2`` with the noise ``(2ε - ε²)J⁻¹`` that makes the Gaussian's law stationary (the
  minibatch noise adds about 2%). Its time to ESS 1000 is scaled likewise and its
  covariance error against ``J⁻¹`` is printed. It runs after ours and NUTS, so JAX's
  one-time start-up is not charged to it.

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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

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
        yield f"logistic d=10, n={n:.0e}", logistic, lambda s, n=n: make_wide_logistic(s, n, 10)
    yield (
        "hierarchical, 45 parameters, n=5e4",
        hierarchical_logistic,
        lambda s: make_hierarchical(s, n=50_000, num_groups=40),
    )
    yield "two plates, n=3e4+1.3e4", two_plates, lambda s: make_two_plates(s, 30_000, 13_000)


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


def _floor_potential(beta, X, y, scale):
    """The logistic model's potential: prior N(0, 2²), log-likelihood weighted by ``scale``."""
    logits = X @ beta
    return 0.125 * jnp.sum(beta**2) - scale * jnp.sum(y * logits - jnp.logaddexp(0.0, logits))


@jax.jit
def _floor_tune(X, y):
    """The tuner's floor: the mode by eight full-data Newton steps from zero, ``J⁻¹`` there,
    the full-data gradient (the control variates' centre) and ``I`` from 10,000 rows."""
    d = X.shape[1]
    grad, hessian = jax.grad(_floor_potential), jax.hessian(_floor_potential)

    def newton(beta, _):
        return beta - jnp.linalg.solve(hessian(beta, X, y, 1.0), grad(beta, X, y, 1.0)), None

    mode, _ = lax.scan(newton, jnp.zeros(d, X.dtype), None, length=8)
    rows = min(X.shape[0], 10_000)
    per_datum = jax.vmap(lambda x, t: grad(mode, x[None], t[None], 1.0))(X[:rows], y[:rows])
    information = jnp.cov(per_datum.T)
    return mode, jnp.linalg.inv(hessian(mode, X, y, 1.0)), grad(mode, X, y, 1.0), information


@jax.jit
def _floor_sample(key, X, y, mode, covariance, centre):
    """The sampler's floor: 3000 iterations of control-variate SGLD preconditioned by ``J⁻¹``."""
    n, d = X.shape
    grad = jax.grad(_floor_potential)
    root = jnp.linalg.cholesky(covariance)
    b, eps = 200, 0.5

    def step(x, k):
        k_rows, k_noise = random.split(k)
        idx = random.randint(k_rows, (b,), 0, n)
        g = grad(x, X[idx], y[idx], n / b) - grad(mode, X[idx], y[idx], n / b) + centre
        # x' = x - εJ⁻¹ĝ + ξ, ξ ~ N(0, (2ε - ε²)J⁻¹): the Gaussian's law is stationary
        noise = jnp.sqrt(2 * eps - eps**2) * root @ random.normal(k_noise, (d,), X.dtype)
        x = x - eps * covariance @ g + noise
        return x, x

    return lax.scan(step, mode, random.split(key, 3000))[1]


def floor(make, seed):
    """``(tuning s, time to ESS 1000 s, ESS, covariance error)`` of the floor's two programs,
    each compiled on its first call."""
    (X, y), _ = make(seed)
    start = time.perf_counter()
    X, y = jnp.asarray(X), jnp.asarray(y)
    mode, covariance, centre, _ = jax.block_until_ready(_floor_tune(X, y))
    tuned = time.perf_counter()
    draws = jax.block_until_ready(
        _floor_sample(jax.random.key(seed), X, y, mode, covariance, centre)
    )
    elapsed = time.perf_counter() - start
    draws, covariance = np.asarray(draws, np.float64), np.asarray(covariance, np.float64)
    ess = float(np.min(effective_sample_size(draws[None])))
    error = np.linalg.norm(np.cov(draws.T) - covariance) / np.linalg.norm(covariance)
    return tuned - start, elapsed * 1000.0 / min(ess, 1000), ess, error


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
        "(covariance error) | ours / floor | NUTS / floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, model, make in cases([int(n) for n in options.sizes]):
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
        best, above, versus = "-", "-", "-"
        if model is logistic:
            # its first call compiles; a second seed's would not, so only the first is shown
            floor_tuning, floor_time, _, error = floor(make, 0)
            best = f"{floor_tuning:.2f} / {floor_time:.2f} ({error:.3f})"
            above = f"{total / floor_time:.1f}x"
            if not options.no_nuts:
                versus = f"{statistics.median(times) / floor_time:.1f}x"
        print(
            f"| {label} | {first:.1f} / {later:.2f} | {sampling:.2f} | {ess:.0f} | {total:.1f} | "
            f"{reference} | {ratio} | {best} | {above} | {versus} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
