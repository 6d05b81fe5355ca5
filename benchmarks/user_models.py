"""The models users bring, through the plain recipe, against references.

For each model of ``tests/user_models.py`` (hierarchical logistic with a group scale,
over-dispersed counts under a Poisson likelihood on raw covariates for the posterior and the
sandwich, two plates, logistic regression with d = 120 independent and correlated covariates,
a covariate on a scale 10⁴ times the others, a 650-parameter softmax regression):
``autotune`` → ``MCMC(num_samples=report.draws_for(1000), 2 chains)`` → ``check_run``, and the
reference (NUTS, the exact float64 sandwich, or a float64 Laplace) in the same run. Prints wall
time (autotune, sampling, reference), epochs of setup and sampling, and the achieved and
predicted sds over the reference's (min–max over parameters).

    python benchmarks/user_models.py                  # every model
    python benchmarks/user_models.py --models softmax hierarchical --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import jax
import numpy as np
from numpyro.infer import MCMC

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from user_models import MODELS  # noqa: E402

from numpyro_sgmc import autotune, check_run  # noqa: E402
from numpyro_sgmc.diagnostics import SGMCWarning  # noqa: E402
from numpyro_sgmc.tuner.check import unconstrained_draws  # noqa: E402


def one(name, seed):
    case = MODELS[name]
    args, kwargs = case.make(seed)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SGMCWarning)
        kernel, report = autotune(
            case.model, jax.random.key(seed), *args, target=case.target, model_kwargs=kwargs
        )
        tuned = time.perf_counter()
        mcmc = MCMC(
            kernel,
            num_warmup=10,
            num_samples=report.draws_for(1000),
            num_chains=2,
            chain_method="vectorized",
            progress_bar=False,
        )
        mcmc.run(jax.random.key(seed + 100), *args, **kwargs)
        jax.block_until_ready(mcmc.get_samples())
        sampled = time.perf_counter()
        check = check_run(mcmc, report, print_table=False)
    ref = case.reference(args, kwargs)
    referenced = time.perf_counter()
    reference = np.concatenate([np.ravel(ref[site]) for site, *_ in report.layout.sites])
    draws = unconstrained_draws(mcmc.get_samples(group_by_chain=True), report)
    achieved = draws.reshape(-1, draws.shape[-1]).std(axis=0) / reference
    predicted = report.predicted_sd / reference
    warned = sorted({w.category.__name__ for w in caught if issubclass(w.category, SGMCWarning)})
    return dict(
        model=case.name,
        target=case.target,
        reference=case.reference_kind,
        d=report.layout.size,
        n=report.num_data,
        row=report.row,
        autotune_s=tuned - start,
        sampling_s=sampled - tuned,
        reference_s=referenced - sampled,
        setup_epochs=report.setup_epochs,
        sampling_epochs=report.epochs_for(1000),
        achieved=(achieved.min(), achieved.max()),
        predicted=(predicted.min(), predicted.max()),
        stated=float(np.max(report.prediction_error)),
        passed=check.passed,
        warnings=", ".join(warned) or "-",
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0])
    options = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores")
    print(
        "| model | target | d | n | row | autotune s | sampling s | reference s | setup ep "
        "| sampling ep | achieved/ref | predicted/ref | stated err | check | warnings |"
    )
    print("|---" * 15 + "|")
    for name in options.models:
        for seed in options.seeds:
            r = one(name, seed)
            print(
                f"| {r['model']} (seed {seed}) | {r['target']} vs {r['reference']} | {r['d']} | "
                f"{r['n']} | {r['row']} | {r['autotune_s']:.1f} | {r['sampling_s']:.1f} | "
                f"{r['reference_s']:.1f} | {r['setup_epochs']:.3g} | {r['sampling_epochs']:.3g} | "
                f"{r['achieved'][0]:.3f}–{r['achieved'][1]:.3f} | "
                f"{r['predicted'][0]:.3f}–{r['predicted'][1]:.3f} | ±{100 * r['stated']:.2g}% | "
                f"{'passed' if r['passed'] else 'FAILED'} | {r['warnings']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
