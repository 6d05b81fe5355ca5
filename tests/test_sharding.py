"""Data-parallel gradients over sharded data, and chains across devices (issue 6).

JAX fixes the number of devices when its backend starts, and this process keeps one, so the
checks on 4 CPU devices run in ``sharded_checks.py`` as subprocesses, started when this module's
first test asks for them and running while the one-device tests below run here:

* ``gradient_moments``: the data-parallel estimate at a fixed ``θ`` over 4000 keys, every batch
  sampling mode: its mean is the exact full-data gradient (z-test) and, for batches with and
  without replacement, its covariance is ``c·Ī/b`` (stratified over the shards); a prior
  counted once per device or a likelihood scaled by ``D`` would be hundreds of standard errors
  off. The exact full-data gradient (chunks summed over shards) matches to float precision.
* ``same_draws``: full-data gradients (``b = n``) on 4 shards give the single-device draws.
* ``stationary_law``: sharded SGLD (64 chains, ``b = 40``, large step) has the stationary law
  of ``docs/theory.md`` §3 that the single-device tests use, within the same ``Z_MAX``
  tolerance, with the
  harness's power check, and is far from the laws of the factor-of-``D`` errors.
* ``parallel_chains``: ``chain_method="parallel"`` for every kernel and a deep ensemble
  (ChainInit with per-chain starts and masses), one chain per device.
* ``errors``: each bad layout is a clear ``ValueError`` at ``init``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.handlers import seed, trace

from harness import Z_MAX
from numpyro_sgmc import AdaSGHMC, shard_data
from numpyro_sgmc.data import sharding
from numpyro_sgmc.data.batches import BATCH_SAMPLING
from numpyro_sgmc.data.gradients import minibatch
from numpyro_sgmc.data.model import prepare_model
from numpyro_sgmc.data.sharding import data_layout
from numpyro_sgmc.data.subsample import plate_sizes, subsample_indices
from numpyro_sgmc.running import distributed
from problems import gaussian_location, make_gaussian_location

SCRIPT = Path(__file__).with_name("sharded_checks.py")
GROUPS = (("gradient_moments", "same_draws", "stationary_law", "errors", "parallel_chains"),)
TIMEOUT = 600  # seconds: a hang fails the test instead of blocking CI


@pytest.fixture(scope="module")
def launched():
    """Start the 4-device checks (a subprocess) and return it, without waiting for it."""
    env = dict(os.environ, SGMC_TEST_DEVICES="4")
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *group],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for group in GROUPS
    ]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def results(launched):
    out = {}
    deadline = time.monotonic() + TIMEOUT
    for proc in launched:
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"sharded_checks.py did not finish within {TIMEOUT} s")
        assert proc.returncode == 0, stderr[-4000:]
        line = [row for row in stdout.splitlines() if row.startswith("RESULTS ")][-1]
        out.update(json.loads(line[len("RESULTS ") :]))
    return out


# ---- one device, in this process -------------------------------------------------------------


@pytest.fixture(scope="module")
def problem():
    return make_gaussian_location(n=1000, sd=(1.0, 0.3), corr=0.6, seed=0)


def test_plate_sizes_scales_a_shard_to_the_global_size(problem):
    # a model that takes its plate size from the data sees 250 rows on a shard; given 10
    # indices the plate scales by 250/10, and plate_sizes makes it 1000/10
    def scale_of(model_size, sizes):
        with subsample_indices(indices={"data": jnp.arange(10)}):
            with plate_sizes(sizes=sizes):
                tr = trace(seed(gaussian_location, 0)).get_trace(problem.W[:model_size], problem.L)
        return tr["w"]["scale"]

    assert scale_of(250, {"data": 1000}) == pytest.approx(100.0)
    assert scale_of(1000, {"data": 1000}) == pytest.approx(100.0)  # global size: untouched

    # a shard whose size equals the model's subsample_size still takes the kernel's indices
    def tiny(W):
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", W.shape[0], subsample_size=50):
            numpyro.sample("w", dist.Normal(theta, 1.0), obs=numpyro.subsample(W, event_dim=0))

    with subsample_indices(indices={"data": jnp.arange(5)}):
        with plate_sizes(sizes={"data": 200}):
            tr = trace(seed(tiny, 0)).get_trace(jnp.zeros(50))
    assert tr["w"]["value"].shape == (5,)
    assert tr["w"]["scale"] == pytest.approx(40.0)


def test_one_device_mesh_estimates_the_single_device_gradient(launched, problem):
    # D = 1: the data-parallel estimator (inside shard_map) draws the same batches and returns
    # the same estimate as the single-device one, step after step, for every batch sampling
    args = (problem.W, problem.L)
    sharded = (shard_data(problem.W), problem.L)
    prep = prepare_model(jax.random.key(0), gaussian_location, args, batch_size=40)
    layout = data_layout(sharded, {}, prep.plates)
    assert layout is not None and layout.num_shards == 1
    z = {"theta": jnp.array([0.3, -0.2])}
    estimators = {
        method: (sharding.minibatch(layout, prep.spec, method), minibatch(prep.spec, method))
        for method in BATCH_SAMPLING
    }

    @jax.jit
    def both(key):
        out = {}
        for method, (parallel, single) in estimators.items():
            state_a, state_b = parallel.init(key, z, sharded, {}), single.init(key, z, args, {})
            out[method] = []
            for k in jax.random.split(key, 2):
                g_a, state_a = parallel.estimate(state_a, z, k, sharded, {})
                g_b, state_b = single.estimate(state_b, z, k, args, {})
                out[method].append((g_a["theta"], g_b["theta"]))
        return out

    for method, pairs in both(jax.random.key(1)).items():
        for a, b in pairs:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=method)


@pytest.mark.slow
def test_one_device_mesh_gives_the_single_device_draws(launched, problem):
    # the whole kernel (second-order update, stateful epochs sampler) on a 1-device data mesh
    z = {"theta": jnp.tile(jnp.asarray(problem.mode, jnp.float32), (3, 1))}
    keys = jax.random.split(jax.random.key(0), 3)
    draws = []
    for W in (problem.W, shard_data(problem.W)):
        kernel = AdaSGHMC(
            gaussian_location, problem.n * 2e-3**2, batch_size=40, batch_sampling="epochs",
            num_steps=5,
        )  # fmt: skip
        state = kernel.init(keys, 2, z, (W, problem.L), {})
        assert (kernel.shards is not None) == (W is not problem.W)
        step = jax.jit(lambda s, W=W, kernel=kernel: kernel.sample(s, (W, problem.L), {}))
        for _ in range(4):
            state = step(state)
        draws.append(np.asarray(state.z["theta"]))
    np.testing.assert_allclose(draws[0], draws[1], rtol=1e-6, atol=1e-7)


def test_unsharded_and_replicated_arguments_keep_the_single_device_path(problem):
    assert data_layout((problem.W, problem.L), {}) is None
    replicated = jax.device_put(problem.W, jax.devices()[0])
    assert data_layout((replicated, 1.0), {"noise": None}) is None


def test_distributed_initialize_rejects_bad_arguments_without_joining():
    for kwargs, match in (
        (dict(coordinator_address="localhost:1234", num_processes=2), "all of"),
        (dict(coordinator_address="localhost", num_processes=2, process_id=0), "host:port"),
        (dict(coordinator_address="localhost:1", num_processes=2, process_id=2), "process_id"),
        (dict(coordinator_address="localhost:1", num_processes=0, process_id=0), "num_proc"),
        (dict(coordinator_address="localhost:1", num_processes=2, process_id=0, timeout=0), "time"),
    ):
        with pytest.raises(distributed.DistributedInitError, match=match):
            distributed.initialize(**kwargs)
    assert not jax.distributed.is_initialized()


def test_distributed_initialize_reports_an_unreachable_coordinator():
    # process 1 of 2 with nothing listening on the coordinator's port: a clear error after
    # the timeout (a TCP check before JAX's runtime, which would otherwise abort the process)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and closed when the block ends
    t0 = time.monotonic()
    with pytest.raises(distributed.DistributedInitError, match="could not reach the coordinator"):
        distributed.initialize(f"127.0.0.1:{port}", 2, 1, timeout=1.0)
    assert time.monotonic() - t0 < 10
    assert not jax.distributed.is_initialized()


# ---- four devices, from the subprocesses -----------------------------------------------------


@pytest.mark.slow  # one subprocess with 4 devices runs these checks
def test_data_parallel_estimate_is_unbiased_with_the_stratified_noise(results):
    r = results["gradient_moments"]
    assert r["num_devices"] == 4
    for method in BATCH_SAMPLING:
        entry = r[method]
        assert np.all(np.abs(entry["mean_z"]) < Z_MAX), (method, entry)
        # a prior counted D times, or a likelihood scaled by D, would fail by far
        assert entry["power_prior_z"] > 10 * Z_MAX and entry["power_likelihood_z"] > 10 * Z_MAX
        if "cov_z" in entry:
            assert np.all(np.abs(entry["cov_z"]) < Z_MAX), (method, entry)
            assert entry["power_cov_z"] > 3 * Z_MAX  # a noise covariance off by D
    assert r["within_vs_total"] < 0.02  # Ī = I up to O(D/n): the single-device prediction
    assert r["full_gradient_error"] < 1e-5
    assert r["full_gradient_single_error"] < 1e-5


@pytest.mark.slow  # one subprocess with 4 devices runs these checks
def test_full_data_gradients_give_the_single_device_draws(results):
    for name, r in results["same_draws"].items():
        assert r["spread_in_sd"] > 0.05, name  # the chains move
        assert r["max_diff_in_sd"] < 1e-4, (name, r)


@pytest.mark.slow  # one subprocess with 4 devices runs these checks
def test_sharded_sgld_has_the_single_device_stationary_law(results):
    r = results["stationary_law"]
    assert r["diverging"] == 0
    assert np.all(np.array(r["power"]) > Z_MAX), r  # a factor-2 covariance error would fail
    assert np.all(np.abs(r["mean_z"]) < Z_MAX), r
    assert np.all(np.abs(r["cov_z"]) < Z_MAX), r
    assert min(r["cov_over_posterior"]) > 1.5  # the step's noise shows: not just the posterior
    assert r["stratified_vs_single"] < 0.01
    for wrong in ("prior_counted_D_times", "likelihood_times_D", "likelihood_over_D"):
        assert r[wrong] > 10 * Z_MAX, (wrong, r[wrong])


@pytest.mark.slow  # one subprocess with 4 devices runs these checks
def test_parallel_chains_for_every_kernel_and_a_deep_ensemble(results):
    r = results["parallel_chains"]
    for name in ("SGLD", "SGLDFP", "SGD", "SGHMC", "AdaSGHMC", "deep_ensemble"):
        entry = r[name]
        assert entry.get("max_diff", 0.0) < 1e-5, (name, entry)  # chain k = chain k run alone
        for flag, value in entry.items():
            if flag != "max_diff":
                assert value is True, (name, flag)


ERRORS = {
    "rows_not_divisible_shard_data": "cannot be split evenly over the 4 devices",
    "batch_not_divisible": "batch_size=42 cannot be split evenly",
    "different_meshes": "different device meshes",
    "non_plate_axis": "along the plate axis only",
    "two_mesh_axes": "over the mesh axes",
    "leading_size_not_a_plate": "has 8 rows",
    "plate_not_sharded": "Subsample plate 'b' (200 rows) has no sharded",
    "axis_not_in_mesh": "not 'batch'",
    "literal_plate_size": "take its size from the data",
    "parallel_chains_with_sharded_data": "chain_method='parallel'",
}


@pytest.mark.slow  # one subprocess with 4 devices runs these checks
def test_bad_layouts_are_clear_errors(results):
    r = results["errors"]
    for case, phrase in ERRORS.items():
        assert r[case]["type"] == "ValueError", (case, r[case])
        assert phrase in r[case]["message"], (case, r[case]["message"])
    assert r["grid_mesh_runs"]["type"] is None, r["grid_mesh_runs"]
