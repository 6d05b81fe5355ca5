"""One process of the two-process run of test_multihost.py (or its one-process reference).

``python tests/multihost_worker.py process <id> <num_processes> <port> <out.npz> [timeout]``
joins a run on localhost through :func:`numpyro_sgmc.running.distributed.initialize` (one CPU device
per process, JAX's Gloo CPU collectives), shards *its own* rows of the data
(:func:`numpyro_sgmc.shard_data`: process ``k`` holds rows ``k·n/P .. (k+1)·n/P``) and runs
sharded SGLD; ``python tests/multihost_worker.py single <devices> <out.npz>`` runs the same
thing in one process over ``devices`` CPU devices, the same layout. Both save the draws and
print one line ``RESULTS {json}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))

MODE = sys.argv[1]
if MODE == "single":
    jax.config.update("jax_num_cpu_devices", int(sys.argv[2]))
    OUT = sys.argv[3]
else:
    from numpyro_sgmc.running import distributed

    PROCESS_ID, NUM_PROCESSES, PORT = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    OUT = sys.argv[5]
    TIMEOUT = float(sys.argv[6]) if len(sys.argv) > 6 else 60.0
    t0 = time.perf_counter()
    # before any JAX computation; a peer that never arrives ends this process within TIMEOUT
    distributed.initialize(f"127.0.0.1:{PORT}", NUM_PROCESSES, PROCESS_ID, timeout=TIMEOUT)
    print(f"joined in {time.perf_counter() - t0:.2f} s", flush=True)

import numpy as np  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402
from sharded_problem import LAW_MULTIHOST as LAW  # noqa: E402
from sharded_problem import location, problem, start  # noqa: E402

from numpyro_sgmc import SGLD, shard_data  # noqa: E402


def run(W, L, jit_model_args=True):
    kernel = SGLD(
        location, LAW["step_size"], batch_size=LAW["batch_size"], num_steps=LAW["num_steps"]
    )
    mcmc = MCMC(
        kernel,
        num_warmup=LAW["warmup"],
        num_samples=LAW["samples"],
        num_chains=LAW["chains"],
        chain_method="vectorized",
        progress_bar=False,
        jit_model_args=jit_model_args,
    )
    mcmc.run(jax.random.key(3), W, L, init_params=start(p, LAW["chains"]))
    assert kernel.shards is not None and kernel.shards.num_shards == len(jax.devices())
    return mcmc


def error_of(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


p = problem()
out = {"devices": len(jax.devices()), "processes": jax.process_count()}
t0 = time.perf_counter()
if MODE == "single":
    W = shard_data(p["W"])
else:
    rows = len(p["W"]) // NUM_PROCESSES
    W = shard_data(p["W"][PROCESS_ID * rows : (PROCESS_ID + 1) * rows])  # this process's rows
    assert W.shape == p["W"].shape and not W.is_fully_addressable
mcmc = run(W, p["L"])
draws = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])  # replicated: readable here
out["seconds"] = time.perf_counter() - t0
out["diverging"] = int(np.sum(np.asarray(mcmc.get_extra_fields()["diverging"])))
np.savez(OUT, draws=draws)
if MODE != "single":
    # every process raises the same clear error, so nobody waits in a collective
    local = p["W"][PROCESS_ID * rows : (PROCESS_ID + 1) * rows]
    out["unequal_rows"] = error_of(lambda: shard_data(local[: rows - 2 * PROCESS_ID]))
    out["constant_data"] = error_of(lambda: run(W, p["L"], jit_model_args=False))
print("RESULTS " + json.dumps(out), flush=True)
