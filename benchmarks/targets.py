"""Every target at the posterior's speed: the control-variate rows against the natural-noise
rows, on misspecified models (``docs/theory.md`` §4, "Control-variate rows for every target").

Two misspecified models at n ≥ 10⁵, whose exact ``J``, ``I`` and ``S = J⁻¹IJ⁻¹`` are computed
in float64 from every row at the float64 mode:

* heteroscedastic linear regression (d = 3, noise sd growing with ``|x₁|``; the model says 1);
* over-dispersed counts (negative binomial, concentration 1.5) under a Poisson likelihood.

For each target (posterior, bagged, sandwich, the mix ``0.5·S + J⁻¹``), ``autotune`` picks its
row (the control-variate rows F-cv, B-cv, G-cv where they are cheaper); the natural-noise row
of the same target (F, B, G: ``h = 4w₁b/(n + w₁b)``) is tuned too, for its predicted cost.
The chosen kernel runs two chains for ``report.draws_for(1000)`` draws; the script prints the
epochs of sampling per chain for ESS 1000 (predicted, and from the achieved ESS), and the
achieved covariance against the exact target ``Q/n``: the relative Frobenius error and the
range of sd ratios.

    python benchmarks/targets.py               # n = 10⁵ and 2·10⁵
    python benchmarks/targets.py --n 1e6
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import jax
import numpy as np
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from numpyro_sgmc import autotune, theory  # noqa: E402
from numpyro_sgmc.tuner.check import unconstrained_draws  # noqa: E402
from problems import (  # noqa: E402
    PRIOR_SCALE,
    linear_regression,
    make_linear_regression,
    make_overdispersed_counts,
    poisson_regression,
)

TARGETS = {
    "posterior": dict(target="posterior"),
    "bagged": dict(target="bagged"),
    "sandwich": dict(target="local_fiducial"),
    "mix 0.5·S + J⁻¹": dict(target="mix", weights=(0.5, 1.0)),
}
NATURAL = {"posterior": None, "bagged": "B", "sandwich": "F", "mix 0.5·S + J⁻¹": "G"}


def linear(n, seed):
    p = make_linear_regression(n=n, d=3, rho=0.5, heteroscedastic=True, seed=seed)
    return linear_regression, (p.X, p.y), p.J, p.I


def counts(n, seed):
    X, y = make_overdispersed_counts(n=n, seed=seed)
    X64, y64 = np.asarray(X, np.float64), np.asarray(y, np.float64)
    theta = np.zeros(X64.shape[1])
    for _ in range(50):  # float64 Newton to the posterior mode
        mu = np.exp(X64 @ theta)
        grad = X64.T @ (y64 - mu) - theta / PRIOR_SCALE**2
        hess = X64.T @ (mu[:, None] * X64) + np.eye(len(theta)) / PRIOR_SCALE**2
        theta = theta + np.linalg.solve(hess, grad)
    mu = np.exp(X64 @ theta)
    J = (X64.T @ (mu[:, None] * X64) + np.eye(len(theta)) / PRIOR_SCALE**2) / n
    scores = X64 * (y64 - mu)[:, None]
    return poisson_regression, (X, y), J, np.cov(scores.T, bias=True)


def run(model, args, J, I, options, seed):
    n = args[0].shape[0]
    start = time.perf_counter()
    kernel, report = autotune(model, jax.random.key(seed), *args, **options)
    tuned = time.perf_counter() - start
    mcmc = MCMC(
        kernel,
        num_warmup=10,
        num_samples=report.draws_for(1000),
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(seed + 1), *args)
    draws = unconstrained_draws(mcmc.get_samples(group_by_chain=True), report)
    exact = np.asarray(theory.target_covariance(J, I, report.weights)) / n
    achieved = np.cov(draws.reshape(-1, draws.shape[-1]), rowvar=False)
    error = np.linalg.norm(achieved - exact) / np.linalg.norm(exact)
    ratio = np.sqrt(np.diag(achieved) / np.diag(exact))
    ess = float(np.min(effective_sample_size(draws)))
    per_draw = report.num_steps * report.gradient_evaluations_per_iteration / n
    achieved_epochs = draws.shape[1] * per_draw * 1000 * draws.shape[0] / ess  # per chain
    return report, tuned, error, ratio, report.epochs_for(1000), achieved_epochs


def natural_cost(model, args, options, row, seed):
    """Predicted epochs per chain for ESS 1000 of the natural-noise row (tuning only)."""
    if row is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, report = autotune(model, jax.random.key(seed), *args, row=row, **options)
    return report.epochs_for(1000)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", nargs="*", type=float, default=[1e5, 2e5])
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores")
    print(
        "| model | n | target | row | autotune s | sampling epochs (pred / achieved) | "
        "natural row epochs (pred) | covariance error | sd ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, make in (("heteroscedastic regression", linear), ("over-dispersed counts", counts)):
        for n in options.n:
            model, args, J, I = make(int(n), options.seed)
            for label, target in TARGETS.items():
                report, tuned, error, ratio, predicted, achieved = run(
                    model, args, J, I, target, options.seed
                )
                natural = natural_cost(model, args, target, NATURAL[label], options.seed)
                natural_text = "-" if natural is None else f"{natural:.3g} ({NATURAL[label]})"
                print(
                    f"| {name} | {int(n)} | {label} | {report.row} | {tuned:.1f} | "
                    f"{predicted:.3g} / {achieved:.3g} | {natural_text} | {error:.3f} | "
                    f"{ratio.min():.3f}–{ratio.max():.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
