"""Per-iteration time of data-parallel SGLD on 1, 2 and 4 devices, and the scaling efficiency.

Logistic regression with a batch large enough that the gradient dominates the step
(default n = 2^18 rows, d = 100, b = 32768, float32: 105 MB of data). For ``D`` devices the
rows are sharded over ``D`` CPU devices (:func:`numpyro_sgmc.shard_data`), and each device
draws ``b/D`` of its own rows per iteration and all-reduces its gradient estimate
(:mod:`numpyro_sgmc.data.sharding`). The baseline is the unsharded kernel in a one-device process.

The device count is fixed when JAX starts (``jax_num_cpu_devices``), so every measurement runs
in a fresh process with exactly ``D`` devices, as a user's run would. A process times the
kernel's compiled draw (``--steps`` iterations in one call, data passed as arguments as with
``MCMC(jit_model_args=True)``) ``--repeats`` times after one call to compile, and reports the
median per iteration. The layouts are measured in turn, round after round (``--rounds``), so
that a change in the machine's load hits them alike; the table gives the median over the
rounds and their range. Speed-up = baseline / time; efficiency = speed-up / D.

Run: ``python benchmarks/device_scaling.py`` (about two minutes on 2 cores);
``--devices 1 2 4 8 --n 1048576`` for more. CPU "devices" share the machine's cores, so the
speed-up is bounded by the number of physical cores; on GPUs or hosts each device brings its
own compute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def worker(args):
    """One measurement, in a process with ``args.worker`` CPU devices."""
    import jax

    jax.config.update("jax_num_cpu_devices", args.worker)
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    from numpyro_sgmc import SGLD, shard_data

    def model(X, y):
        theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=args.batch):
            Xb = numpyro.subsample(X, event_dim=1)
            yb = numpyro.subsample(y, event_dim=0)
            numpyro.sample("y", dist.Bernoulli(logits=Xb @ theta), obs=yb)

    k1, k2 = jax.random.split(jax.random.key(0))
    X = jax.random.normal(k1, (args.n, args.d), jnp.float32)
    theta = jnp.linspace(-1.0, 1.0, args.d) / jnp.sqrt(args.d)
    y = jax.random.bernoulli(k2, jax.nn.sigmoid(X @ theta)).astype(jnp.float32)
    data = shard_data(X, y) if args.sharded else (X, y)
    kernel = SGLD(model, 1e-3, batch_size=args.batch, num_steps=args.steps)
    state = kernel.init(jax.random.key(1), 0, None, data, {})
    assert (kernel.shards is not None) == args.sharded
    draw = jax.jit(lambda s, X, y: kernel.sample(s, (X, y), {}))
    state = jax.block_until_ready(draw(state, *data))  # compile
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(draw(state, *data))
        times.append((time.perf_counter() - t0) / args.steps)
    finite = bool(jnp.all(jnp.isfinite(state.z["theta"])))
    print("RESULT " + json.dumps({"seconds": statistics.median(times), "finite": finite}))


def measure(args, devices, sharded):
    command = [sys.executable, __file__, "--worker", str(devices)]
    for name in ("n", "d", "batch", "steps", "repeats"):
        command += [f"--{name}", str(getattr(args, name))]
    out = subprocess.run(
        command + (["--sharded"] if sharded else []), capture_output=True, text=True, timeout=1800
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    line = [row for row in out.stdout.splitlines() if row.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--n", type=int, default=2**18)
    parser.add_argument("--d", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=20, help="iterations per timed call")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sharded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import jax

    print(
        f"Data-parallel SGLD, logistic regression: n = {args.n}, d = {args.d}, b = {args.batch},"
        f" float32; per layout, {args.rounds} fresh processes x median of {args.repeats} calls"
        f" of {args.steps} iterations.\n"
        f"Machine: {os.cpu_count()} CPU cores ({platform.machine()}), CPU devices forced with "
        f"jax_num_cpu_devices; jax {jax.__version__}.\n"
    )
    layouts = [("1 (unsharded)", 1, False)] + [(str(D), D, True) for D in args.devices]
    times = {label: [] for label, _, _ in layouts}
    finite = True
    for _ in range(args.rounds):
        for label, devices, sharded in layouts:
            result = measure(args, devices, sharded)
            times[label].append(result["seconds"])
            finite &= result["finite"]
    base = statistics.median(times[layouts[0][0]])
    header = ("devices", "ms / iteration", "range (ms)", "speed-up", "efficiency")
    print("{:>14}  {:>15}  {:>13}  {:>9}  {}".format(*header))
    for label, devices, _ in layouts:
        t = times[label]
        med = statistics.median(t)
        speedup = base / med
        print(
            f"{label:>14}  {1e3 * med:15.2f}  {1e3 * min(t):6.2f}-{1e3 * max(t):6.2f}  "
            f"{speedup:8.2f}x  {speedup / devices:9.0%}"
        )
    if not finite:
        print("warning: a run ended at a non-finite position")


if __name__ == "__main__":
    main()
