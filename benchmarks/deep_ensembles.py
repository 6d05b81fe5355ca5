"""Bayesian deep ensembles: optimizer-informed SGHMC mass matrices (``docs/theory.md`` §6).

On two bundled data sets, a LeNet-style CNN on scikit-learn's digits (classification) and an
MLP on scikit-learn's diabetes (regression), for each of ``--seeds`` seeds:

1. ``K`` Adam runs from different initial values, in one vectorised call
   (:func:`numpyro_sgmc.warm_start`): the **deep ensemble** (Adam only) is their ``K`` modes;
2. ``K`` SGHMC chains started at the ``K`` modes, chain ``k`` with a mass from its own Adam
   run: **identity** (vanilla SGHMC), **gradient** ``|g|``, **first moment** ``|μ|`` and
   **second moment** ``sqrt(ν)``, layer-wise and min-normalised
   (:func:`numpyro_sgmc.bde.mass_from_warm_start`); the four variants run as ``4K`` chains of one
   vectorised ``MCMC`` call (they differ only in the per-chain mass);
3. ``K`` **AdaSGHMC** chains (identity initial mass, adapted during warm-up, then frozen);

each at zero warm-up and at ``--long-warmup`` warm-up steps, followed by ``--samples``
sampling steps (every ``--thin``-th iterate kept). Test-set metrics of the posterior
predictive over all ``K`` chains (:func:`numpyro_sgmc.bde.evaluate`): LPPD per datum,
accuracy and expected calibration error (digits), RMSE (diabetes, standardised ``y``).
Then a step-size sweep (one seed) shows where each method breaks, and the pairwise cosine
similarity of AdaSGHMC's adapted masses across chains is compared with that of the static
first-moment masses (per parameter).

Step sizes: every kernel's ``step_size`` is ``h`` on the average-gradient scale; Chen et al.'s
SGHMC step is ``η = sqrt(h/n)`` (``n`` training rows), so the script fixes ``η`` and passes
``h = n·η²``, and the tables print ``h``. Everything is fixed before the run (step sizes,
budgets); nothing is tuned to agree with the paper. Run: ``python benchmarks/deep_ensembles.py``
(about 40 minutes on 2 cores), or ``--size small`` for a two-minute look (the test suite runs
that).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import MCMC

from numpyro_sgmc import SGHMC, AdaSGHMC, ChainInit, Diagonal, bde, warm_start
from numpyro_sgmc.bde import (
    diabetes,
    digits,
    evaluate,
    lenet,
    mass_from_warm_start,
    mlp,
    pairwise_cosine_similarity,
)
from numpyro_sgmc.diagnostics import ConvergenceWarning

STATIC = ("identity", "gradient", "first_moment", "second_moment")
METHODS = ("deep ensemble",) + STATIC + ("AdaSGHMC",)
LABELS = {
    "deep ensemble": "deep ensemble (Adam)",
    "identity": "SGHMC, identity M",
    "gradient": "SGHMC, gradient M",
    "first_moment": "SGHMC, first-moment M",
    "second_moment": "SGHMC, second-moment M",
    "AdaSGHMC": "AdaSGHMC",
}

# Budgets. The step sizes η (Chen et al.'s SGHMC step, on the potential scale) were fixed once
# from a two-point pilot on seed 0 (η = 3e-3 left the chains at their modes, 1e-2 moved them);
# the sweep shows the range around them (factors of η). The kernels take h = n·η² (n training
# rows: η = sqrt(h/n)), see step_size().
SIZES = {
    "full": dict(
        members=4,
        seeds=3,
        train_rows=None,
        epochs={"digits": 40, "diabetes": 200},
        samples=2000,
        long_warmup=2000,
        thin=40,
        sweep=(0.25, 1.0, 4.0, 16.0),
    ),
    "small": dict(
        members=4,
        seeds=1,
        train_rows=400,
        epochs={"digits": 10, "diabetes": 40},
        samples=200,
        long_warmup=100,
        thin=20,
        sweep=(1.0, 16.0),
    ),
}
ETA = {"digits": 1e-2, "diabetes": 1e-2}  # Chen et al.'s η; the kernels' h = n·η²
BATCH_SIZE = {"digits": 64, "diabetes": 32}
LEARNING_RATE = {"digits": 0.01, "diabetes": 0.01}


def problem(name, seed, train_rows):
    """Data split and model (with its training batch size) for one data set."""
    split = digits(seed) if name == "digits" else diabetes(seed)
    X, y = split.X_train, split.y_train
    if train_rows is not None:
        X, y = X[:train_rows], y[:train_rows]
    if name == "digits":
        model = lenet(num_classes=10, batch_size=BATCH_SIZE[name])
    else:
        model = mlp(1, hidden=(50,), likelihood="gaussian", batch_size=BATCH_SIZE[name])
    return model, (jnp.asarray(X), jnp.asarray(y)), (jnp.asarray(split.X_test), split.y_test)


def step_size(eta, data):
    """The kernels' ``h = n·η²`` for Chen et al.'s step ``η`` (``n`` training rows)."""
    return data[0].shape[0] * eta**2


def fit_ensemble(model, data, name, seed, size):
    with warnings.catch_warnings():
        # a network's modes are not isolated zeros of the gradient; the check's verdict is
        # reported in the table header instead
        warnings.simplefilter("ignore", ConvergenceWarning)
        return warm_start(
            model,
            jax.random.key(seed),
            *data,
            num_restarts=size["members"],
            num_epochs=size["epochs"][name],
            learning_rate=LEARNING_RATE[name],
        )


def ones_mass(warm):
    """Identity mass in the layer-wise format (one scalar per site and member)."""
    return Diagonal({k: jnp.ones(warm.num_restarts) for k in warm.params})


def stack(trees):
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees)


def per_method(samples, num_methods):
    """Split ``(num_methods·K, draws, ...)`` chain-grouped draws into flat per-method dicts."""
    out = []
    for m in range(num_methods):
        part = jax.tree.map(lambda v, m=m: v.reshape((num_methods, -1) + v.shape[1:])[m], samples)
        out.append(jax.tree.map(lambda v: v.reshape((-1,) + v.shape[2:]), part))
    return out


def run_chains(kernel, data, init, num_chains, warmup, size, seed):
    thin = size["thin"]
    mcmc = MCMC(
        kernel,
        num_warmup=warmup // thin,
        num_samples=size["samples"] // thin,
        num_chains=num_chains,
        chain_method="vectorized",
        progress_bar=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # divergences are counted from the state instead
        mcmc.run(jax.random.key(1000 + seed), *data, init_params=init)
    return mcmc


def sample_all(model, data, test, warm, h, warmup, size, seed, ada=True, static=True):
    """Metrics of the SGHMC variants at one step size ``h`` and warm-up: {method: (metrics, div)}.

    The four static masses run as ``4K`` chains of one vectorised call; AdaSGHMC as ``K``.
    """
    K, thin = warm.num_restarts, size["thin"]
    results = {}
    if static:
        inits = [ChainInit(params=warm.params, preconditioner=ones_mass(warm))]
        inits += [bde.chain_init(warm, s) for s in STATIC[1:]]
        init = ChainInit(
            params=stack([i.params for i in inits]),
            preconditioner=stack([i.preconditioner for i in inits]),
        )
        kernel = SGHMC(model, h, num_steps=thin)
        mcmc = run_chains(kernel, data, init, len(STATIC) * K, warmup, size, seed)
        diverged = np.asarray(mcmc.last_state.num_diverging).reshape(len(STATIC), K).sum(axis=1)
        draws = per_method(mcmc.get_samples(group_by_chain=True), len(STATIC))
        for method, samples, div in zip(STATIC, draws, diverged, strict=True):
            results[method] = (evaluate(model, samples, test[0], y=test[1]), int(div))
    if ada:
        kernel = AdaSGHMC(model, h, num_steps=thin)
        mcmc = run_chains(kernel, data, bde.chain_init(warm), K, warmup, size, seed)
        (samples,) = per_method(mcmc.get_samples(group_by_chain=True), 1)
        div = int(np.sum(np.asarray(mcmc.last_state.num_diverging)))
        results["AdaSGHMC"] = (evaluate(model, samples, test[0], y=test[1]), div)
        results["_ada_mass"] = mcmc.last_state.params.mass  # Diagonal, flat (K, d)
    return results


def off_diagonal(sim):
    K = sim.shape[0]
    values = sim[~np.eye(K, dtype=bool)]
    return float(np.mean(values)), float(np.std(values))


def fmt(values, digits=3):
    """``mean ± standard error`` over seeds."""
    values = [v for v in values if np.isfinite(v)]
    if not values:
        return "diverged"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    se = statistics.stdev(values) / len(values) ** 0.5
    return f"{statistics.mean(values):.{digits}f} ± {se:.{digits}f}"


def main_table(name, size, args):
    metrics = ("lppd", "accuracy", "ece") if name == "digits" else ("lppd", "rmse")
    table = {(w, m): {k: [] for k in metrics + ("div",)} for w in ("zero", "long") for m in METHODS}
    similarity = {"AdaSGHMC": [], "first_moment": []}
    sweep_model = None
    t0 = time.perf_counter()
    for seed in range(size["seeds"]):
        model, data, test = problem(name, seed, size["train_rows"])
        warm = fit_ensemble(model, data, name, seed, size)
        de = evaluate(model, warm.constrained, test[0], y=test[1])
        for w in ("zero", "long"):
            for k in metrics:
                table[(w, "deep ensemble")][k].append(de[k])
            table[(w, "deep ensemble")]["div"].append(0)
            warmup = 0 if w == "zero" else size["long_warmup"]
            h = step_size(ETA[name], data)
            results = sample_all(model, data, test, warm, h, warmup, size, seed)
            for method in METHODS[1:]:
                values, div = results[method]
                for k in metrics:
                    table[(w, method)][k].append(values[k])
                table[(w, method)]["div"].append(div)
            if w == "long":
                ada = pairwise_cosine_similarity(results["_ada_mass"])
                static = pairwise_cosine_similarity(
                    mass_from_warm_start(warm, "first_moment", "parameter")
                )
                similarity["AdaSGHMC"].append(off_diagonal(ada)[0])
                similarity["first_moment"].append(off_diagonal(static)[0])
        if seed == 0:
            sweep_model = (model, data, test, warm)
        print(f"  [{name}] seed {seed} done, {time.perf_counter() - t0:.0f} s", flush=True)

    h = step_size(ETA[name], data)
    print(
        f"\n### {name}: test metrics, h = n·η² = {h:.4g} (n = {data[0].shape[0]}, "
        f"η = sqrt(h/n) = {ETA[name]:g}, Chen et al.'s step), K = {size['members']}, "
        f"{size['seeds']} seed(s), {size['samples']} sampling steps\n"
    )
    header = "| warm-up | method | " + " | ".join(metrics) + " | divergent steps |"
    print(header)
    print("|" + "---|" * (len(metrics) + 3))
    for w in ("zero", "long"):
        steps = 0 if w == "zero" else size["long_warmup"]
        for m in METHODS:
            row = table[(w, m)]
            cells = [fmt(row[k]) for k in metrics]
            print(f"| {steps} | {LABELS[m]} | " + " | ".join(cells) + f" | {sum(row['div'])} |")
    print(
        f"\nPairwise cosine similarity of the chains' masses (per parameter, mean of the "
        f"off-diagonal pairs, averaged over seeds): AdaSGHMC adapted "
        f"{statistics.mean(similarity['AdaSGHMC']):.4f}, static first-moment "
        f"{statistics.mean(similarity['first_moment']):.4f}"
    )
    return table, sweep_model


def sweep(name, size, sweep_model):
    model, data, test, warm = sweep_model
    print(
        f"\n### {name}: step-size sweep (seed 0), LPPD at zero warm-up (AdaSGHMC: "
        f"{size['long_warmup']} warm-up steps); 'div' = divergent steps; h = n·η² "
        f"(n = {data[0].shape[0]}; η = sqrt(h/n) is Chen et al.'s step)\n"
    )
    print("| h | " + " | ".join(LABELS[m] for m in STATIC + ("AdaSGHMC",)) + " |")
    print("|" + "---|" * (len(STATIC) + 2))
    for factor in size["sweep"]:  # factors of η: h grows as factor²
        h = step_size(ETA[name] * factor, data)
        zero = sample_all(model, data, test, warm, h, 0, size, 0, ada=False)
        long = sample_all(model, data, test, warm, h, size["long_warmup"], size, 0, static=False)
        cells = []
        for m in STATIC + ("AdaSGHMC",):
            values, div = (long if m == "AdaSGHMC" else zero)[m]
            cell = f"{values['lppd']:.3f}" if np.isfinite(values["lppd"]) else "nan"
            cells.append(cell + (f" ({div} div)" if div else ""))
        print(f"| {h:.3g} | " + " | ".join(cells) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--datasets", default="digits,diabetes")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    size = SIZES[args.size]
    print(
        f"jax {jax.__version__}, devices {jax.devices()}, size={args.size}: "
        f"K={size['members']}, seeds={size['seeds']}"
    )
    for name in args.datasets.split(","):
        _, sweep_model = main_table(name, size, args)
        if not args.no_sweep:
            sweep(name, size, sweep_model)


if __name__ == "__main__":
    main()
