"""1.2 × 10^8 rows on one machine: autotuned SGLD-FP for logistic regression in bounded memory.

The data (``--rows``, default 120,000,000: the size of Negrea et al.'s airline data) are generated
in float32 chunks written in place into their final JAX arrays, ``X`` (n × 3 covariates) and
``y`` (``jnp.asarray`` of a whole NumPy array would hold two copies for a while). The model
has four parameters, an intercept and three slopes. Then:

1. :func:`~numpyro_sgmc.autotune` with a short Adam warm start (``--warm-epochs``) and the
   information ``J``, ``I`` from 10,000 rows; its Newton polish and the control-variate centre
   make chunked full-data passes (65,536 rows at a time);
2. ``--epochs`` passes of autotuned sampling with :func:`~numpyro_sgmc.run_kernel` (the
   kernel's own chain in one compiled loop that takes the data as arguments and never returns
   them: ``MCMC(jit_model_args=True)`` returns them with its last state, a transient copy of
   the whole data), with the epoch progress bar
   (:class:`~numpyro_sgmc.data.progress.EpochProgress`): about 100 host updates in all, none per
   step;
3. :func:`~numpyro_sgmc.check_run`: the achieved covariance against the predicted one.

It prints the wall time of each phase, the peak resident memory of the process against the
size of the data (the issue asks for at most 1.5×), and the covariance check. Run:
``python benchmarks/large_data.py`` (``--rows 1e7`` for a quick look).
"""

from __future__ import annotations

import argparse
import math
import resource
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import lax

from numpyro_sgmc import autotune, check_run, run_kernel

COEFFICIENTS = np.array([0.3, -0.8, 0.5, 0.1], np.float32)  # intercept, three slopes


def model(X, y=None):
    intercept = numpyro.sample("intercept", dist.Normal(0.0, 10.0))
    slopes = numpyro.sample("slopes", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("rows", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=intercept + Xb @ slopes), obs=yb)


def generate(n, chunk, seed):
    """``X`` (n × 3) and ``y`` (n), float32, filled chunk by chunk in place.

    Each chunk is drawn with NumPy and written into the JAX arrays by a compiled update that
    donates them, so no n-sized temporary or copy is ever made.
    """
    X = jnp.zeros((n, 3), jnp.float32)
    y = jnp.zeros(n, jnp.float32)
    rng = np.random.default_rng(seed)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        x = rng.standard_normal((stop - start, 3), dtype=np.float32)
        x[:, 1] = 0.6 * x[:, 0] + 0.8 * x[:, 1]  # correlated covariates
        logits = COEFFICIENTS[0] + x @ COEFFICIENTS[1:]
        labels = rng.random(stop - start, dtype=np.float32) < 1 / (1 + np.exp(-logits))
        X, y = _write(X, y, x, labels.astype(np.float32), start)
    return X, y


@partial(jax.jit, donate_argnums=(0, 1))
def _write(X, y, x, labels, start):
    return lax.dynamic_update_slice(X, x, (start, 0)), lax.dynamic_update_slice(y, labels, (start,))


def peak_rss() -> float:
    """Peak resident memory of this process so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=float, default=1.2e8)
    parser.add_argument("--epochs", type=float, default=10.0, help="passes of sampling")
    parser.add_argument("--warm-epochs", type=float, default=0.02)
    parser.add_argument("--draws", type=int, default=2000, help="draws kept")
    parser.add_argument("--chunk", type=int, default=2**22, help="rows generated at a time")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n = int(args.rows)
    start = time.perf_counter()
    baseline = peak_rss()
    print(
        f"jax {jax.__version__}, numpyro {numpyro.__version__}, {jax.devices()[0]}, "
        f"{jax.device_count()} device(s); n = {n:,} rows, 4 parameters"
    )

    t = time.perf_counter()
    X, y = jax.block_until_ready(generate(n, args.chunk, args.seed))
    data_bytes = X.nbytes + y.nbytes
    print(
        f"data: {data_bytes / 2**30:.2f} GiB float32 generated in {time.perf_counter() - t:.1f} s "
        f"(process before the data: {baseline / 2**30:.2f} GiB)"
    )

    t = time.perf_counter()
    kernel, report = autotune(
        model,
        jax.random.key(args.seed),
        X,
        y,
        warm_start_epochs=args.warm_epochs,
        num_rows=10000,
        batch_sampling="blocks",  # the rows are in random order: contiguous reads
    )
    t_tune = time.perf_counter() - t
    print(f"autotune: {t_tune:.1f} s, {report.setup_epochs:.2f} passes over the data\n{report}")

    batch = sum(report.batch_size.values())
    iterations = math.ceil(args.epochs * n / batch)
    thinning = max(1, iterations // (report.num_steps * args.draws))
    num_draws = iterations // report.num_steps // thinning
    t = time.perf_counter()
    run = run_kernel(
        kernel,
        jax.random.key(args.seed + 1),
        X,
        y,
        num_samples=num_draws,
        thinning=thinning,
        progress_bar=True,
    )
    t_run = time.perf_counter() - t
    done = num_draws * thinning * report.num_steps
    epochs = done * batch / n
    print(
        f"sampling: {done:,} iterations of b = {batch} ({epochs:.2f} epochs, {num_draws} draws "
        f"kept) in {t_run:.1f} s: {t_run / done * 1e6:.2f} µs per iteration, "
        f"{epochs / t_run * 60:.2f} epochs per minute (compilation included)"
    )
    check = check_run(run, report)
    peak = peak_rss()
    print(
        f"\nwall time {time.perf_counter() - start:.0f} s in all (autotune {t_tune:.0f} s, "
        f"sampling {t_run:.0f} s); achieved vs predicted covariance: "
        f"{check.covariance_error:.1%} relative Frobenius"
    )
    print(
        f"peak memory {peak / 2**30:.2f} GiB = {peak / data_bytes:.2f}x the data "
        f"({data_bytes / 2**30:.2f} GiB); above the process before the data: "
        f"{(peak - baseline) / data_bytes:.2f}x"
    )


if __name__ == "__main__":
    main()
