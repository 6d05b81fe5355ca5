"""Wall time and data passes to a 10%-accurate posterior covariance: autotune vs NUTS.

Logistic regression, d = 10 correlated covariates, n = 10^5 and 10^6 (float32). The
reference covariance is a long NUTS run on the full data (``--reference-draws`` draws, two
chains) up to ``--nuts-reference-max`` rows, and above it the Laplace covariance at the exact
mode (float64 Newton), which at these sizes is the posterior covariance to well under 1%
(the script prints the two side by side where both are computed). Then, for each method,
runs of growing length are tried until the covariance of the draws is within 10% (relative
Frobenius) of the reference:

* **autotune**: ``autotune(model, key, X, y, target="posterior")`` (Adam warm start, ``J``
  and ``I`` from 10,000 rows, tuning; it picks the cheapest Table 1 row and the script prints
  which), then ``MCMC`` for ``report.draws_for(ess)`` draws with
  ``ess`` = 500, 1000, 2000, ...; time = autotune + the first run that reaches 10%;
  passes = ``report.total_epochs(ess)``;
* **NUTS** on the full data with ``num_warmup = num_samples`` = 500, 1000, 2000, ...; passes =
  leapfrog steps (one full-data gradient each), warm-up included.

Wall times include compilation (``MCMC.run`` compiles on every call). Each figure is the
median over ``--reps`` repetitions with different seeds. Run:
``python benchmarks/autotune_vs_nuts.py`` (``--sizes 1e5 --reps 1`` for a quick look).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

from numpyro_sgmc import autotune, full_data

D, TOLERANCE = 10, 0.10


def make_data(n, seed=0):
    rng = np.random.default_rng(seed)
    cov = 0.5 * np.eye(D) + 0.5
    X = rng.multivariate_normal(np.zeros(D), cov, size=n).astype(np.float32)
    theta = np.linspace(-1.0, 1.0, D)
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ theta))).astype(np.float32)
    return jnp.asarray(X), jnp.asarray(y)


def model(X, y=None):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ theta), obs=yb)


def relative_error(draws, reference):
    cov = np.cov(np.asarray(draws, np.float64).T)
    return float(np.linalg.norm(cov - reference) / np.linalg.norm(reference))


def nuts(X, y, draws, seed):
    """(seconds, passes, draws) of one NUTS run with ``draws`` warm-up and kept draws."""
    t = time.perf_counter()
    mcmc = MCMC(
        NUTS(full_data(model)),
        num_warmup=draws,
        num_samples=draws,
        jit_model_args=True,
        progress_bar=False,
    )
    # warm-up apart, to count its leapfrog steps too (one more compilation, ~1 s)
    fields = ("num_steps",)
    mcmc.warmup(jax.random.key(seed), X, y, extra_fields=fields, collect_warmup=True)
    steps = int(np.sum(mcmc.get_extra_fields()["num_steps"]))
    mcmc.run(mcmc.post_warmup_state.rng_key, X, y, extra_fields=fields)
    steps += int(np.sum(mcmc.get_extra_fields()["num_steps"]))
    samples = np.asarray(mcmc.get_samples()["theta"])
    return time.perf_counter() - t, steps, samples


def reference_covariance(X, y, draws):
    mcmc = MCMC(
        NUTS(full_data(model)),
        num_warmup=1000,
        num_samples=draws,
        num_chains=2,
        chain_method="sequential",
        jit_model_args=True,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(12345), X, y)
    return np.cov(np.asarray(mcmc.get_samples()["theta"], np.float64).T)


def autotuned_run(X, y, reference, tuned, seed, ess):
    """(seconds, passes, error) of autotune plus a run for an effective sample size ``ess``."""
    kernel, report, t_tune = tuned
    t = time.perf_counter()
    mcmc = MCMC(
        kernel,
        num_warmup=10,
        num_samples=report.draws_for(ess),
        jit_model_args=True,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(seed), X, y)
    error = relative_error(mcmc.get_samples()["theta"], reference)
    return t_tune + time.perf_counter() - t, report.total_epochs(ess), error


def nuts_run(X, y, reference, seed, draws):
    """(seconds, passes, error) of a NUTS run with ``draws`` warm-up and kept draws."""
    seconds, passes, samples = nuts(X, y, draws, seed)
    return seconds, passes, relative_error(samples, reference)


def laplace_covariance(X, y, iterations=20, return_mode=False):
    """``(∇²U(θ̂))⁻¹`` at the exact mode, float64 Newton: the posterior covariance to
    ``O(n^{-1/2})`` relative (Bernstein–von Mises), far below the 10% asked at n >= 10^5.
    With ``return_mode``, ``(θ̂, covariance)``."""
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)
    theta = np.zeros(X.shape[1])
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-X @ theta))
        grad = X.T @ (y - p) - theta / 100.0
        hess = (X * (p * (1 - p))[:, None]).T @ X + np.eye(X.shape[1]) / 100.0
        theta = theta + np.linalg.solve(hess, grad)
    return (theta, np.linalg.inv(hess)) if return_mode else np.linalg.inv(hess)


def time_to_tolerance(attempt, sizes):
    """The first size whose run is within TOLERANCE: (seconds, passes, size, error)."""
    for size in sizes:
        seconds, passes, error = attempt(size)
        if error < TOLERANCE:
            return seconds, passes, size, error
    return seconds, passes, None, error


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e5,1e6")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--reference-draws", type=int, default=4000)
    parser.add_argument(
        "--nuts-reference-max",
        type=float,
        default=1e5,
        help="largest n whose reference is a long NUTS run (above: the Laplace covariance)",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(
        f"jax {jax.__version__}, numpyro {numpyro.__version__}, {jax.devices()[0]}; "
        f"logistic regression d={D}; time and passes to {TOLERANCE:.0%} covariance error"
    )
    for n in [int(float(s)) for s in args.sizes.split(",")]:
        X, y = make_data(n)
        t = time.perf_counter()
        laplace = laplace_covariance(X, y)
        if n <= args.nuts_reference_max:
            reference = reference_covariance(X, y, args.reference_draws)
            gap = np.linalg.norm(laplace - reference) / np.linalg.norm(reference)
            print(
                f"\nn = {n:.0e}: reference = NUTS, 2 x {args.reference_draws} draws "
                f"({time.perf_counter() - t:.0f} s); the Laplace covariance is {gap:.1%} from it"
            )
        else:
            reference = laplace
            print(f"\nn = {n:.0e}: reference = Laplace (exact mode and Hessian, float64)")
        rows = {"autotune": [], "NUTS": []}
        names = {"NUTS": "NUTS"}
        for rep in range(args.reps):
            t = time.perf_counter()
            kernel, report = autotune(model, jax.random.key(rep), X, y)
            t_tune = time.perf_counter() - t

            tuned = (kernel, report, t_tune)
            ours = partial(autotuned_run, X, y, reference, tuned, 100 + rep)
            theirs = partial(nuts_run, X, y, reference, 200 + rep)
            rows["autotune"].append(time_to_tolerance(ours, [500, 1000, 2000, 4000, 8000]))
            rows["NUTS"].append(time_to_tolerance(theirs, [500, 1000, 2000, 4000]))
            if rep == 0:
                names["autotune"] = f"autotune + {report.algorithm}"
                covariance = np.asarray(report.covariance)  # a scale: as a (d, d) matrix
                gap = np.linalg.norm(covariance - reference) / np.linalg.norm(reference)
                print(
                    f"  autotune chose row {report.row}: h = {report.step_size:.3g}, "
                    f"b = {sum(report.batch_size.values())}, setup {report.setup_epochs:.1f} "
                    f"passes, autotune {t_tune:.1f} s; its predicted covariance is {gap:.1%} "
                    "from the reference"
                )
        for name, results in rows.items():
            seconds = statistics.median(r[0] for r in results)
            passes = statistics.median(r[1] for r in results)
            sizes = [r[2] for r in results]
            errors = [f"{r[3]:.3f}" for r in results]
            print(
                f"  {names[name]:<20} {seconds:8.1f} s {passes:10.1f} passes   "
                f"(10% reached at ESS / NUTS draws {sizes}; errors {errors})"
            )
        ours_s, ours_p = (statistics.median(r[i] for r in rows["autotune"]) for i in (0, 1))
        nuts_s, nuts_p = (statistics.median(r[i] for r in rows["NUTS"]) for i in (0, 1))
        print(f"  NUTS / autotune: {nuts_s / ours_s:.1f}x wall time, {nuts_p / ours_p:.0f}x passes")


if __name__ == "__main__":
    main()
