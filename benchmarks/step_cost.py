"""Cost of one SGLD iteration: ours through ``MCMC.run`` vs a hand-written loop vs blackjax.

Logistic regression, d = 10, b = 100, at n = 10^4 and 10^7 (float32 data, 400 MB at 10^7).
Every configuration runs the same update; all are timed in this one process:

* **hand-written**: a jitted ``lax.scan`` over draws of ``lax.fori_loop`` over iterations,
  gathering ``X[idx]`` for uniform ``idx`` and stepping ``θ + (h/2)ĝ + sqrt(h/n)ξ``;
* **blackjax**: ``blackjax.sgld`` with its ``grad_estimator``, in the same loop structure;
* **ours**: ``MCMC(SGLD(model, step_size=h, num_steps=k), ...).run`` for the default
  ``k = 100`` iterations per draw and for ``k = 1``, with the progress bar off and on, and
  ``jit_model_args`` True (data passed as arguments) or False (NumPyro's default: data
  compiled in as constants), with uniform random rows (the default) and, once, with
  ``batch_sampling="blocks"`` (consecutive rows from a random start; the rows here are i.i.d.,
  so in random order).

``MCMC.run`` compiles on every call, so our per-iteration cost is the difference of a long
and a short run divided by the difference in iterations; the fixed cost (compilation and
``init``) is printed apart. Each number is the median of ``--reps`` repetitions.
Run: ``python benchmarks/step_cost.py`` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time
import warnings

os.environ.pop("CI", None)  # NumPyro turns its progress bar off when CI is set

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402

from numpyro_sgmc import SGLD, PerformanceWarning  # noqa: E402

D, B, H = 10, 100, 1e-2


def make_data(n, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    X = jax.random.normal(k1, (n, D), jnp.float32)
    theta = jnp.linspace(-1.0, 1.0, D)
    y = jax.random.bernoulli(k2, jax.nn.sigmoid(X @ theta)).astype(jnp.float32)
    return jax.block_until_ready((X, y))


def model(X, y=None):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=B):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ theta), obs=yb)


def log_prior(theta):
    return jnp.sum(dist.Normal(0.0, 10.0).log_prob(theta))


def log_lik(theta, x, y):
    return dist.Bernoulli(logits=x @ theta).log_prob(y)


def scan_loop(step, steps, draws):
    """``run(key, θ, X, y)``: ``draws`` kept draws of ``steps`` iterations of ``step``, jitted.

    ``step(θ, key_for_indices, key_for_noise, X, y)`` is one iteration.
    """

    @jax.jit
    def run(key, theta, X, y):
        def iterate(_, carry):
            theta, key = carry
            key, k_idx, k_noise = jax.random.split(key, 3)
            return step(theta, k_idx, k_noise, X, y), key

        def draw(theta, key):
            theta, _ = jax.lax.fori_loop(0, steps, iterate, (theta, key))
            return theta, theta

        return jax.lax.scan(draw, theta, jax.random.split(key, draws))

    return run


def hand_written_step(n):
    """One SGLD iteration as a user would write it by hand."""

    def step(theta, k_idx, k_noise, X, y):
        idx = jax.random.randint(k_idx, (B,), 0, n)

        def batch_ll(t):
            return jnp.sum(log_lik(t, X[idx], y[idx]))

        g = (jax.grad(log_prior)(theta) + n / B * jax.grad(batch_ll)(theta)) / n
        noise = jax.random.normal(k_noise, theta.shape)
        return theta + 0.5 * H * g + jnp.sqrt(H / n) * noise

    return step


def blackjax_step(n):
    """One ``blackjax.sgld`` iteration on a uniform batch."""
    import blackjax
    from blackjax.sgmcmc.gradients import grad_estimator

    def datum_ll(theta, datum):
        x, y = datum
        return log_lik(theta, x, y)

    sgld = blackjax.sgld(grad_estimator(log_prior, datum_ll, n))
    eps = H / (2 * n)  # blackjax: θ + ε∇log π + sqrt(2ε)ξ, the same update

    def step(theta, k_idx, k_noise, X, y):
        idx = jax.random.randint(k_idx, (B,), 0, n)
        return sgld.step(k_noise, theta, (X[idx], y[idx]), eps)

    return step


def time_loop(build_step, n, data, draws, reps, steps=100):
    """Median seconds per iteration of a jitted loop (compiled once beforehand)."""
    run = scan_loop(build_step(n), steps, draws)
    theta = jnp.zeros(D)
    jax.block_until_ready(run(jax.random.key(0), theta, *data))  # compile
    times = []
    for r in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(run(jax.random.key(r + 1), theta, *data))
        times.append((time.perf_counter() - t) / (draws * steps))
    return statistics.median(times)


def time_ours(data, steps, progress_bar, jit_model_args, batching, reps, seconds, short_draws=20):
    """Median seconds per iteration through ``MCMC.run``, and the median fixed cost per run.

    ``MCMC.run`` re-traces part of its loop on every call, so the cost per iteration is the
    difference between a long and a short run (one warm-up call per MCMC object discarded);
    the long run is sized to take about ``seconds`` of sampling.
    """

    def once(num_samples, seed):
        mcmc = MCMC(
            SGLD(model, step_size=H, num_steps=steps, batch_sampling=batching),
            num_warmup=0,
            num_samples=num_samples,
            progress_bar=progress_bar,
            jit_model_args=jit_model_args,
        )
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore", PerformanceWarning)
            t = time.perf_counter()
            mcmc.run(jax.random.key(seed), *data)
            jax.block_until_ready(mcmc.get_samples())
        return time.perf_counter() - t

    once(short_draws, 0)
    base = statistics.median(once(short_draws, 0) for _ in range(3))
    draws = 200  # grow until the sampling clearly outlasts the noise of the fixed cost
    while (elapsed := once(short_draws + draws, 0) - base) < 1.0:
        draws *= 4
    long_draws = short_draws + max(draws, int(seconds * draws / elapsed))
    per_iter, fixed = [], []
    for r in range(reps):
        t_short, t_long = once(short_draws, r + 1), once(long_draws, r + 1)
        per_iter.append((t_long - t_short) / ((long_draws - short_draws) * steps))
        fixed.append(t_short - short_draws * steps * per_iter[-1])
    return statistics.median(per_iter), statistics.median(fixed)


CONFIGS = [  # (num_steps, progress_bar, jit_model_args, batch_sampling)
    (100, False, True, "with_replacement"),
    (100, False, True, "blocks"),
    (100, True, False, "with_replacement"),
    (100, True, True, "with_replacement"),
    (1, False, True, "with_replacement"),
    (1, True, False, "with_replacement"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e7])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=300_000,
                        help="iterations per timed run of the hand-written and blackjax loops")
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="sampling time of each long MCMC.run")
    args = parser.parse_args()
    try:
        import blackjax  # noqa: F401
        have_blackjax = True
    except ImportError:
        have_blackjax = False
        print("blackjax is not installed (pip install -e '.[bench]'): its column is skipped")

    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, {jax.devices()[0]}, "
          f"{os.cpu_count()} cores; d={D}, b={B}; µs per iteration, median of {args.reps}\n")
    results = {}
    for n in map(int, args.sizes):
        data = make_data(n)
        draws = args.iterations // 100
        row = {}
        row["hand-written lax.scan"] = time_loop(hand_written_step, n, data, draws, args.reps)
        if have_blackjax:
            row["blackjax.sgld"] = time_loop(blackjax_step, n, data, draws, args.reps)
        for steps, pb, jit_args, batching in CONFIGS:
            name = (f"ours, num_steps={steps:<3}, bar {'on ' if pb else 'off'}, "
                    f"jit_model_args={jit_args!s:<5}")
            if batching == "blocks":
                name += ", blocks"
            row[name], row[name + " (fixed s)"] = time_ours(
                data, steps, pb, jit_args, batching, args.reps, args.seconds
            )
        results[n] = row
        hand = row["hand-written lax.scan"]
        print(f"n = {n:.0e}")
        for name, value in row.items():
            if name.endswith("(fixed s)"):
                continue
            fixed = row.get(name + " (fixed s)")
            extra = f"   compile+init {fixed:5.2f} s" if fixed is not None else ""
            print(f"  {name:<66} {value * 1e6:9.2f} µs {value / hand:7.2f}x hand{extra}",
                  flush=True)
        print()
    sizes = sorted(results)
    if len(sizes) > 1:
        lo, hi = sizes[0], sizes[-1]
        print(f"per-iteration cost at n = {hi:.0e} relative to n = {lo:.0e}:")
        for name in results[lo]:
            if not name.endswith("(fixed s)"):
                print(f"  {name:<66} {results[hi][name] / results[lo][name]:5.2f}x")


if __name__ == "__main__":
    main()
