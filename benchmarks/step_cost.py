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
``init``) is printed apart. Each number is the median of ``--reps`` repetitions, and each
ratio the median of ratios to a hand-written measurement taken just before it.
Every row runs in a fresh process. Run: ``python benchmarks/step_cost.py`` (about 40 minutes
on 2 cores; ``--sizes 1e4 --seconds 4`` for a quick look).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

os.environ.pop("CI", None)  # NumPyro turns its progress bar off when CI is set

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402

from numpyro_sgmc import SGLD  # noqa: E402
from numpyro_sgmc.diagnostics import PerformanceWarning  # noqa: E402

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


def loop_timer(build_step, n, data, draws, steps=100):
    """Compile a jitted loop; return ``measure(seed) -> seconds per iteration``."""
    run = scan_loop(build_step(n), steps, draws)
    theta = jnp.zeros(D)
    jax.block_until_ready(run(jax.random.key(0), theta, *data))

    def measure(seed):
        t = time.perf_counter()
        jax.block_until_ready(run(jax.random.key(seed + 1), theta, *data))
        return (time.perf_counter() - t) / (draws * steps), None

    return measure


def mcmc_timer(data, steps, progress_bar, jit_model_args, batching, seconds, short_draws=20):
    """Return ``measure(seed) -> (seconds per iteration, fixed seconds per run)`` for MCMC.run.

    ``MCMC.run`` re-traces part of its loop on every call, so the cost per iteration is the
    difference between a long and a short run; the long run is sized here, once, to take
    about ``seconds`` of sampling.
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

    def measure(seed):
        t_short, t_long = once(short_draws, seed + 1), once(long_draws, seed + 1)
        per_iter = (t_long - t_short) / ((long_draws - short_draws) * steps)
        return per_iter, t_short - short_draws * steps * per_iter

    return measure


CONFIGS = [  # (num_steps, progress_bar, jit_model_args, batch_sampling)
    (100, False, True, "with_replacement"),
    (100, False, True, "blocks"),
    (100, True, False, "with_replacement"),
    (100, True, True, "with_replacement"),
    (1, False, True, "with_replacement"),
    (1, True, False, "with_replacement"),
]


def label(config):
    steps, pb, jit_args, batching = config
    bar = "on " if pb else "off"
    name = f"ours, num_steps={steps:<3}, bar {bar}, jit_model_args={jit_args!s:<5}"
    return name + (", blocks" if batching == "blocks" else "")


def measure_one(n, which, reps, iterations, seconds):
    """In this process: ``reps`` pairs (hand-written, ``which``) at size ``n``, as JSON."""
    data = make_data(n)
    hand = loop_timer(hand_written_step, n, data, iterations // 100)
    if which == "hand":
        target = hand
    elif which == "blackjax":
        target = loop_timer(blackjax_step, n, data, iterations // 100)
    else:
        target = mcmc_timer(data, *CONFIGS[int(which)], seconds)
    runs = []
    for rep in range(reps):
        baseline, _ = hand(rep)
        value, fixed = target(rep)
        runs.append({"seconds": value, "ratio": value / baseline, "fixed": fixed})
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e7])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--iterations",
        type=int,
        default=300_000,
        help="iterations per timed run of the hand-written and blackjax loops",
    )
    parser.add_argument(
        "--seconds", type=float, default=15.0, help="sampling time of each long MCMC.run"
    )
    parser.add_argument("--one", nargs=2, metavar=("N", "WHICH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        n, which = int(float(args.one[0])), args.one[1]
        print(json.dumps(measure_one(n, which, args.reps, args.iterations, args.seconds)))
        return
    try:
        import blackjax  # noqa: F401

        targets = ["hand", "blackjax"]
    except ImportError:
        targets = ["hand"]
        print("blackjax is not installed (pip install -e '.[bench]'): its row is skipped")
    targets += [str(k) for k in range(len(CONFIGS))]
    names = {"hand": "hand-written lax.scan", "blackjax": "blackjax.sgld"}
    names.update({str(k): label(c) for k, c in enumerate(CONFIGS)})

    print(
        f"jax {jax.__version__}, numpyro {numpyro.__version__}, {jax.devices()[0]}, "
        f"{os.cpu_count()} cores; d={D}, b={B}; µs per iteration, median of {args.reps}, "
        "each row in a fresh process\n"
    )
    per_iteration = {}
    for n in map(int, args.sizes):
        print(f"n = {n:.0e}")
        per_iteration[n] = {}
        for which in targets:
            # a fresh process per row: compiled programs and allocations of one configuration
            # (hundreds of MB at n = 10^7) must not slow the next one down
            command = [
                sys.executable,
                __file__,
                "--one",
                str(n),
                which,
                "--reps",
                str(args.reps),
                "--iterations",
                str(args.iterations),
                "--seconds",
                str(args.seconds),
            ]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            runs = json.loads(out.stdout.strip().splitlines()[-1])
            value = statistics.median(r["seconds"] for r in runs)
            ratio = statistics.median(r["ratio"] for r in runs)
            per_iteration[n][names[which]] = value
            line = f"  {names[which]:<66} {value * 1e6:9.2f} µs {ratio:7.2f}x hand"
            if runs[0]["fixed"] is not None:
                line += f"   compile+init {statistics.median(r['fixed'] for r in runs):5.2f} s"
            print(line, flush=True)
        print()
    sizes = sorted(per_iteration)
    if len(sizes) > 1:
        lo, hi = sizes[0], sizes[-1]
        print(f"per-iteration cost at n = {hi:.0e} relative to n = {lo:.0e} (medians):")
        for name in per_iteration[lo]:
            print(f"  {name:<66} {per_iteration[hi][name] / per_iteration[lo][name]:5.2f}x")


if __name__ == "__main__":
    main()
