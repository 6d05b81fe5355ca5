"""Bayesian deep ensembles against an external anchor: ``sklearn-contrib-bde`` on UCI regression.

The anchor is ``sklearn-contrib-bde`` 1.0.2 (``BdeRegressor``: ``K`` AdamW members, then
full-batch MILE/MCLMC sampling from each; JAX) and the regression benchmark of its JOSS paper
(``paper/scripts/benchmark.py`` of its repository). Its protocol, kept here:

* data: airfoil self-noise, concrete compressive strength, hourly bike sharing (the copies its
  wheel ships, bundled with this package: :mod:`numpyro_sgmc.bde.datasets`); one split,
  scikit-learn's ``train_test_split(test_size=0.2, random_state=0)``; inputs and target
  standardised with the training rows' mean and standard deviation;
* network: a fully connected ReLU network, 4 hidden layers of 16 units, a heteroscedastic
  Gaussian output (mean and ``softplus(·) + 1e-6`` scale), ``W, b ~ N(0, 1)`` on every
  weight (the standard parametrisation: :func:`numpyro_sgmc.bde.mlp` with
  ``noise="heteroscedastic", parametrization="standard"``), ``K = 10`` members;
* metrics on the test rows (standardised scale): RMSE of the predictive mean and the NLL of
  the moment-matched Gaussian (:func:`numpyro_sgmc.bde.gaussian_nll`, its
  ``predict(mean_and_std=True)``), mean ± standard error over the seeds ``0, 1, …`` of the
  methods (the split stays at seed 0).

Four methods, on each data set and seed, in one run:

1. **bde** (its own ``BdeRegressor``) in a subprocess of the separate environment where it is
   installed (``--bde-python``; its pins, ``jax`` 0.10 and ``blackjax``, are not ours), on the
   same arrays (passed as an ``.npz``);
2. **bde (published)**: the numbers of its paper (5 seeds, its full budget), not run here;
3. **deep ensemble**: our ``K`` Adam members (:func:`numpyro_sgmc.warm_start`, minibatches,
   vectorised), the equal-weight mixture of the ``K`` modes;
4. **ours**: ``K`` minibatch SGHMC chains started at the ``K`` Adam modes, chain ``k`` with the
   first-moment mass of its own Adam run (:func:`numpyro_sgmc.bde.chain_init`,
   ``docs/theory.md`` §6), ``step_size="auto"`` (:mod:`numpyro_sgmc.kernels.auto_step`), zero
   warm-up; its wall time includes the Adam members.

Wall time is the fit and prediction of each method in its process, compilation included
(bde's: ``fit`` + ``predict``, its paper's "total time"), on this machine.

Then the **step-size sweep** (seed 0; first-moment masses, zero warm-up): test LPPD per datum
of SGHMC at the fractions ``f`` of every chain's stability bound in ``--sweep`` (each chain's
``h = f·2(2 - α)/λmax(M⁻¹J)``), on the three anchor sets and, with the networks and budgets of
``benchmarks/deep_ensembles.py``, on digits and diabetes; ``f = 0.2`` is ``step_size="auto"``.
The check: auto's LPPD within 10% of the sweep's best (``|best - auto| ≤ 0.1·|best|``), no
divergent step.

Budgets are fixed before the run and nothing is tuned until it agrees. The paper's own
budget for bde (1200 epochs, 50 000 MCLMC warm-up steps and 1000 × 10 sampling steps per
member, 5 seeds) takes hours on 2 shared CPU cores, so bde runs here at a reduced budget
(``--size full``: 1000 warm-up steps, 100 × 10 sampling steps per member; the printed header
says which), next to its published numbers. Run: ``python benchmarks/bde_anchor.py --seeds
2,2,1 --no-sweep`` (the table of ``benchmarks/README.md``: seeds 0–1 on airfoil and concrete,
seed 0 on bike sharing; about an hour on 2 shared cores; the default is the protocol's 5
seeds), ``--sweep-only`` (the sweep, about 40 minutes), or ``--size small`` (one seed of
airfoil, small networks, no bde; the test suite runs that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ANCHOR = ("airfoil", "concrete", "bike_sharing")
METHODS = ("bde", "bde (published)", "deep ensemble", "ours")

# sklearn-contrib-bde's JOSS paper, fully connected network, 5 seeds: (RMSE, se, NLL, se);
# its deep ensemble without standard errors. Concrete is in its wheel but not in its table.
PUBLISHED = {
    "airfoil": {"bde": (0.1215, 0.0042, -0.9126, 0.0131), "deep ensemble": (0.3650, 0.1760)},
    "bike_sharing": {
        "bde": (0.2261, 0.0016, -0.7315, 0.0098),
        "deep ensemble": (0.2880, -0.4550),
    },
}

SIZES = {
    "full": dict(
        datasets=ANCHOR,
        seeds=5,  # bde's protocol; --seeds for fewer
        members=10,
        hidden=(16, 16, 16, 16),
        adam_steps=20000,  # minibatch Adam iterations per member
        batch_size=128,
        learning_rate=3e-3,
        samples=200,  # draws per chain
        thin=50,  # SGHMC steps per draw
        bde=dict(epochs=1200, patience=20, warmup_steps=1000, n_samples=100, n_thinning=10),
        sweep=(0.05, 0.1, 0.2, 0.4, 0.8),
        sweep_extra=("diabetes", "digits"),
    ),
    "small": dict(
        datasets=("airfoil",),
        seeds=1,
        members=3,
        hidden=(16, 16),
        adam_steps=600,
        batch_size=64,
        learning_rate=3e-3,
        samples=20,
        thin=10,
        bde=None,
        sweep=(0.05, 0.2, 0.8),
        sweep_extra=(),
    ),
}
DEFAULT_BDE_PYTHON = "/work/bde-venv/bin/python"  # where this machine keeps bde's environment
AUTO_FRACTION = 0.2  # numpyro_sgmc.kernels.auto_step.FRACTION, checked in main()


# ---- bde, in its own environment ----------------------------------------------------------


def bde_worker(path_in: str, path_out: str) -> None:
    """Fit and predict with ``sklearn-contrib-bde`` (run by its own interpreter)."""
    from bde import BdeRegressor  # noqa: PLC0415 (only in bde's environment)
    from bde.loss.loss import GaussianNLL  # noqa: PLC0415

    data = np.load(path_in)
    cfg = json.loads(str(data["config"]))
    t0 = time.perf_counter()
    model = BdeRegressor(
        n_members=cfg["members"],
        hidden_layers=list(cfg["hidden"]),
        loss=GaussianNLL(),
        epochs=cfg["epochs"],
        validation_split=0.15,
        lr=1e-3,
        weight_decay=1e-4,
        warmup_steps=cfg["warmup_steps"],
        n_samples=cfg["n_samples"],
        n_thinning=cfg["n_thinning"],
        patience=cfg["patience"],
        seed=cfg["seed"],
    )
    model.fit(data["X_train"], data["y_train"])
    mean, std = model.predict(data["X_test"], mean_and_std=True)
    seconds = time.perf_counter() - t0
    mean, std, y = np.asarray(mean, np.float64), np.asarray(std, np.float64), data["y_test"]
    std = np.maximum(std, 1e-8)
    nll = np.mean(0.5 * np.log(2 * np.pi * std**2) + 0.5 * (y - mean) ** 2 / std**2)
    out = {"rmse": float(np.sqrt(np.mean((y - mean) ** 2))), "nll": float(nll), "time": seconds}
    Path(path_out).write_text(json.dumps(out))


def run_bde(python: str, split, seed: int, size: dict) -> dict:
    """bde's metrics and wall time on ``split``, from a subprocess of ``python``."""
    cfg = dict(size["bde"], members=size["members"], hidden=size["hidden"], seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        path_in, path_out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.json")
        np.savez(
            path_in,
            X_train=split.X_train,
            y_train=split.y_train,
            X_test=split.X_test,
            y_test=split.y_test,
            config=json.dumps(cfg),
        )
        env = dict(os.environ, TQDM_DISABLE="1", PYTHONPATH="")
        done = subprocess.run(
            [python, __file__, "--bde-worker", path_in, path_out],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
        )
        if done.returncode != 0:
            raise RuntimeError(f"bde failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(Path(path_out).read_text())


# ---- ours --------------------------------------------------------------------------------


def load(name: str):
    from numpyro_sgmc import bde  # noqa: PLC0415

    return getattr(bde, name)(seed=0)


def network(size: dict, batch_size: int):
    from numpyro_sgmc.bde import mlp  # noqa: PLC0415

    return mlp(
        1,
        hidden=size["hidden"],
        noise="heteroscedastic",
        parametrization="standard",
        batch_size=batch_size,
    )


def fit_members(model, data, seed: int, size: dict, num_epochs: float, learning_rate: float):
    """``K`` Adam runs from LeCun-initialised weights (:func:`init_to_fan_in`)."""
    import jax  # noqa: PLC0415

    from numpyro_sgmc import warm_start  # noqa: PLC0415
    from numpyro_sgmc.bde import init_to_fan_in  # noqa: PLC0415
    from numpyro_sgmc.diagnostics import ConvergenceWarning  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # a network's modes are not points
        return warm_start(
            model,
            jax.random.key(seed),
            *data,
            num_restarts=size["members"],
            num_epochs=num_epochs,
            learning_rate=learning_rate,
            init_strategy=init_to_fan_in,
            check=False,
        )


def sghmc(model, data, warm, step_size, size: dict, seed: int):
    """``K`` SGHMC chains from the ``K`` modes, first-moment masses, zero warm-up: (kernel,
    draws, divergent steps)."""
    import jax  # noqa: PLC0415
    from numpyro.infer import MCMC  # noqa: PLC0415

    from numpyro_sgmc import SGHMC  # noqa: PLC0415
    from numpyro_sgmc.bde import chain_init  # noqa: PLC0415

    kernel = SGHMC(model, step_size, num_steps=size["thin"])
    mcmc = MCMC(
        kernel,
        num_warmup=0,
        num_samples=size["samples"],
        num_chains=size["members"],
        chain_method="vectorized",
        progress_bar=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # divergences are counted from the state instead
        mcmc.run(jax.random.key(1000 + seed), *data, init_params=chain_init(warm, "first_moment"))
    divergent = int(np.sum(np.asarray(mcmc.last_state.num_diverging)))
    return kernel, mcmc.get_samples(), divergent


_MODELS = {}  # one model per data set and size: its compiled functions are reused across seeds


def anchor_problem(name: str, size: dict):
    import jax.numpy as jnp  # noqa: PLC0415

    split = load(name)
    key = (name, size["hidden"], size["batch_size"])
    model = _MODELS.setdefault(key, network(size, size["batch_size"]))
    data = (jnp.asarray(split.X_train), jnp.asarray(split.y_train))
    epochs = size["adam_steps"] * size["batch_size"] / split.X_train.shape[0]
    return split, model, data, epochs


def run_ours(name: str, seed: int, size: dict):
    """Deep ensemble and SGHMC on one data set and seed: metrics, times, the chosen steps."""
    from numpyro_sgmc.bde import evaluate  # noqa: PLC0415

    split, model, data, epochs = anchor_problem(name, size)
    t0 = time.perf_counter()
    warm = fit_members(model, data, seed, size, epochs, size["learning_rate"])
    t_adam = time.perf_counter() - t0
    de = evaluate(model, warm.constrained, split.X_test, y=split.y_test)
    t_de = time.perf_counter() - t0
    kernel, draws, divergent = sghmc(model, data, warm, "auto", size, seed)
    ours = evaluate(model, draws, split.X_test, y=split.y_test)
    t_ours = time.perf_counter() - t0 - (t_de - t_adam)  # Adam + SGHMC + its evaluation
    return {
        "deep ensemble": dict(rmse=de["rmse"], nll=de["gaussian_nll"], time=t_de, div=0),
        "ours": dict(
            rmse=ours["rmse"],
            nll=ours["gaussian_nll"],
            time=t_ours,
            div=divergent,
            lppd=ours["lppd"],
        ),  # fmt: skip
        "_auto": kernel.auto_step,
        "_warm": (split, model, data, warm),
    }


# ---- the sweep ---------------------------------------------------------------------------


def sweep_problem(name: str, size: dict):
    """(model, data, test X, test y, warm) at seed 0: an anchor set, or digits / diabetes with
    the networks and Adam budgets of ``benchmarks/deep_ensembles.py``."""
    sys.path.insert(0, str(HERE))
    import deep_ensembles  # noqa: PLC0415

    de_size = deep_ensembles.SIZES["full"]
    model, data, test = deep_ensembles.problem(name, 0, de_size["train_rows"])
    warm = deep_ensembles.fit_ensemble(model, data, name, 0, de_size)
    return model, data, test[0], test[1], warm


def sweep(names, size: dict, cached: dict) -> dict:
    """``{name: {fraction: (lppd, divergent steps)}}``, seed 0."""
    from numpyro_sgmc.bde import evaluate  # noqa: PLC0415
    from numpyro_sgmc.kernels.auto_step import Auto  # noqa: PLC0415

    out = {}
    for name in names:
        if name in ANCHOR:
            if name not in cached:
                split, model, data, epochs = anchor_problem(name, size)
                warm = fit_members(model, data, 0, size, epochs, size["learning_rate"])
                cached[name] = (split, model, data, warm)
            split, model, data, warm = cached[name]
            X_test, y_test = split.X_test, split.y_test
            run_size = size
        else:
            model, data, X_test, y_test, warm = sweep_problem(name, size)
            run_size = dict(size, members=warm.num_restarts)
        out[name] = {}
        for f in size["sweep"]:
            t0 = time.perf_counter()
            _, draws, divergent = sghmc(model, data, warm, Auto(fraction=f), run_size, 0)
            lppd = evaluate(model, draws, X_test, y=y_test)["lppd"]
            out[name][f] = (lppd, divergent)
            print(
                f"  [sweep {name}] f = {f:g}: LPPD {lppd:.4f}, {divergent} divergent steps, "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    return out


# ---- tables ------------------------------------------------------------------------------


def mean_se(values, digits=4):
    values = [v for v in values if np.isfinite(v)]
    if not values:
        return "nan"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    se = statistics.stdev(values) / len(values) ** 0.5
    return f"{statistics.mean(values):.{digits}f} ± {se:.{digits}f}"


def print_table(results: dict, size: dict) -> None:
    print("\n| data set | method | RMSE | NLL | wall time (s) | divergent steps |")
    print("|---|---|---|---|---|---|")
    for name, per_method in results.items():
        for method in METHODS:
            if method == "bde (published)":
                pub = PUBLISHED.get(name, {})
                if "bde" in pub:
                    r, rs, n, ns = pub["bde"]
                    print(f"| {name} | bde (published, 5 seeds, its budget) | {r:.4f} ± {rs:.4f} "
                          f"| {n:.4f} ± {ns:.4f} | – | – |")  # fmt: skip
                if "deep ensemble" in pub:
                    r, n = pub["deep ensemble"]
                    print(f"| {name} | bde's deep ensemble (published) | {r:.4f} | {n:.4f} "
                          "| – | – |")  # fmt: skip
                continue
            rows = per_method.get(method)
            if not rows:
                continue
            rmse = mean_se([r["rmse"] for r in rows])
            nll = mean_se([r["nll"] for r in rows])
            seconds = mean_se([r["time"] for r in rows], 1)
            div = sum(r.get("div", 0) for r in rows) if method != "bde" else "–"
            print(f"| {name} | {method} | {rmse} | {nll} | {seconds} | {div} |")


def verdicts(results: dict) -> None:
    """Ours against bde (run here): within one standard error or better, at ≤ 1/3 its time."""
    print("\n| data set | RMSE: ours ≤ bde + se | NLL: ours ≤ bde + se | time ours / bde |")
    print("|---|---|---|---|")
    for name, per_method in results.items():
        if not per_method.get("bde"):
            continue
        cells = []
        for key in ("rmse", "nll"):
            ours = [r[key] for r in per_method["ours"]]
            theirs = [r[key] for r in per_method["bde"]]
            se = statistics.stdev(theirs) / len(theirs) ** 0.5 if len(theirs) > 1 else 0.0
            ok = statistics.mean(ours) <= statistics.mean(theirs) + se
            cells.append(f"{'yes' if ok else 'no'} ({statistics.mean(ours):.4f} vs "
                         f"{statistics.mean(theirs):.4f} ± {se:.4f})")  # fmt: skip
        ratio = statistics.mean(r["time"] for r in per_method["ours"]) / statistics.mean(
            r["time"] for r in per_method["bde"]
        )
        print(f"| {name} | {cells[0]} | {cells[1]} | {ratio:.2f} |")


def print_sweep(results: dict, fractions) -> None:
    print("\n| data set | " + " | ".join(f"f = {f:g}" for f in fractions)
          + f" | auto (f = {AUTO_FRACTION:g}) within 10% of best |")  # fmt: skip
    print("|---|" + "---|" * (len(fractions) + 1))
    for name, row in results.items():
        cells = [f"{lppd:.4f}" + (f" ({div} div)" if div else "") for lppd, div in row.values()]
        best = max(lppd for lppd, _ in row.values() if np.isfinite(lppd))
        auto, div = row.get(AUTO_FRACTION, (np.nan, 0))
        ok = abs(best - auto) <= 0.1 * abs(best) and div == 0
        cells.append(f"{'yes' if ok else 'no'} (best {best:.4f}, auto {auto:.4f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--datasets", default=None, help="comma-separated; default: the size's")
    parser.add_argument(
        "--seeds", default=None, help="seeds per data set: one int, or one per data set ('2,2,1')"
    )
    parser.add_argument(
        "--bde-python",
        default=os.environ.get("BDE_PYTHON"),
        help=f"the interpreter of bde's environment (default {DEFAULT_BDE_PYTHON} if it "
        "exists; '' to skip bde)",
    )
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--sweep-only", action="store_true")
    parser.add_argument("--bde-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bde_worker:
        bde_worker(*args.bde_worker)
        return

    import jax  # noqa: PLC0415

    from numpyro_sgmc.kernels.auto_step import FRACTION  # noqa: PLC0415

    assert FRACTION == AUTO_FRACTION, (FRACTION, AUTO_FRACTION)
    size = dict(SIZES[args.size])
    names = tuple(args.datasets.split(",")) if args.datasets else size["datasets"]
    seeds = [size["seeds"]] * len(names)
    if args.seeds is not None:
        seeds = [int(s) for s in args.seeds.split(",")]
        seeds = seeds * len(names) if len(seeds) == 1 else seeds
        if len(seeds) != len(names):
            parser.error(f"--seeds gives {len(seeds)} counts for {len(names)} data sets")
    python = args.bde_python
    if python is None and Path(DEFAULT_BDE_PYTHON).exists():
        python = DEFAULT_BDE_PYTHON
    run_bde_here = bool(size["bde"]) and bool(python) and not args.sweep_only
    print(
        f"jax {jax.__version__}, devices {jax.devices()}, {os.cpu_count()} CPU cores; "
        f"size={args.size}: K={size['members']}, hidden={size['hidden']}, "
        f"seeds {dict(zip(names, seeds, strict=True))}; ours: {size['adam_steps']} Adam steps "
        f"(batch {size['batch_size']}, lr {size['learning_rate']:g}), "
        f"{size['samples']}×{size['thin']} SGHMC steps per chain, step_size='auto'; "
        + (f"bde ({python}): {size['bde']}" if run_bde_here else "bde not run"),
        flush=True,
    )
    results, cached = {}, {}
    for name, num_seeds in zip(() if args.sweep_only else names, seeds, strict=False):
        results[name] = {m: [] for m in ("bde", "deep ensemble", "ours")}
        for seed in range(num_seeds):
            t0 = time.perf_counter()
            got = run_ours(name, seed, size)
            for method in ("deep ensemble", "ours"):
                results[name][method].append(got[method])
            if seed == 0:
                cached[name] = got["_warm"]
                print(f"  [{name}] {got['_auto']}", flush=True)
            if run_bde_here:
                results[name]["bde"].append(run_bde(python, got["_warm"][0], seed, size))
            line = ", ".join(
                f"{m}: RMSE {r[-1]['rmse']:.4f} NLL {r[-1]['nll']:.4f} {r[-1]['time']:.0f} s"
                for m, r in results[name].items()
                if r
            )
            print(f"  [{name}] seed {seed}: {line} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if results:
        print_table(results, size)
    if results and run_bde_here:
        verdicts(results)
    if not args.no_sweep:
        swept = sweep(names + tuple(size["sweep_extra"]), size, cached)
        print_sweep(swept, size["sweep"])


if __name__ == "__main__":
    main()
