"""The same code on two processes: JAX's distributed runtime on localhost, CPU collectives.

Two processes (``multihost_worker.py``), one CPU device each, join through
:func:`numpyro_sgmc.running.distributed.initialize`; each shards its own half of the rows and runs
sharded SGLD, the gradient all-reduced over both (Gloo, JAX's CPU collectives). A third
process runs the same on two CPU devices of one process: the same layout, so the draws must be
the same. The draws also have the stationary law of
``docs/theory.md`` §3 (the prediction and tolerance of
the single-device tests). A process whose peer never starts must exit with a clear message
within its deadline rather than hang. Every subprocess runs under a timeout.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sharded_problem import law_prediction, problem

from harness import Z_MAX, chain_estimates, z_scores
from numpyro_sgmc.running.distributed import JOIN_TIMEOUT_EXIT_CODE

pytestmark = pytest.mark.slow  # subprocesses: CI runs them, -m "not slow" skips them

WORKER = str(Path(__file__).with_name("multihost_worker.py"))
TIMEOUT = 300  # seconds for everything: a hang fails the test instead of blocking CI
JOIN_TIMEOUT = 3  # seconds the lone process waits for its peer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost")
    port, lone_port = str(free_port()), str(free_port())
    commands = {
        "p0": [WORKER, "process", "0", "2", port, str(out / "p0.npz")],
        "p1": [WORKER, "process", "1", "2", port, str(out / "p1.npz")],
        "single": [WORKER, "single", "2", str(out / "single.npz")],
        # process 0 of a 2-process run whose process 1 never starts
        "lone": [WORKER, "process", "0", "2", lone_port, str(out / "x.npz"), str(JOIN_TIMEOUT)],
    }
    started = time.monotonic()
    procs = {
        name: subprocess.Popen(
            [sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, cmd in commands.items()
    }
    results = {}
    try:
        for name, proc in procs.items():
            remaining = max(1.0, TIMEOUT - (time.monotonic() - started))
            stdout, stderr = proc.communicate(timeout=remaining)
            results[name] = {
                "returncode": proc.returncode,
                "stdout": stdout,
                "stderr": stderr,
                "elapsed": time.monotonic() - started,
            }
            line = [row for row in stdout.splitlines() if row.startswith("RESULTS ")]
            if line:
                results[name].update(json.loads(line[-1][len("RESULTS ") :]))
                results[name]["draws"] = np.load(out / f"{name}.npz")["draws"]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the multi-process run did not finish within {TIMEOUT} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results


def _ok(run):
    assert run["returncode"] == 0, run["stderr"][-4000:]
    return run


def test_two_processes_join_and_compute_the_same_chain(runs):
    p0, p1 = _ok(runs["p0"]), _ok(runs["p1"])
    for run in (p0, p1):
        assert run["processes"] == 2 and run["devices"] == 2 and run["diverging"] == 0
    np.testing.assert_array_equal(p0["draws"], p1["draws"])


def test_two_processes_give_the_one_process_draws_for_the_same_layout(runs):
    p0, single = _ok(runs["p0"]), _ok(runs["single"])
    assert single["processes"] == 1 and single["devices"] == 2
    sd = np.sqrt(np.diag(problem()["post_cov"]))
    assert np.max(np.abs(p0["draws"] - single["draws"]) / sd) < 1e-4
    assert np.max(np.std(p0["draws"], axis=1) / sd) > 0.5  # the chains move


def test_two_process_run_has_the_single_device_stationary_law(runs):
    p = problem()
    cov = law_prediction(p)
    means, covs = chain_estimates(_ok(runs["p0"])["draws"])
    mean_z, _ = z_scores(means, p["mode"])
    cov_z, se = z_scores(covs, cov)
    iu = np.triu_indices(2)
    assert np.all(0.5 * np.diag(cov) / np.diag(se) > Z_MAX)  # power: a factor 2 would fail
    assert np.all(np.abs(mean_z) < Z_MAX), mean_z
    assert np.all(np.abs(cov_z[iu]) < Z_MAX), cov_z
    for wrong in (problem(prior_factor=2), problem(likelihood_factor=2)):
        z_wrong, _ = z_scores(covs, law_prediction(wrong))
        m_wrong, _ = z_scores(means, wrong["mode"])
        assert max(np.max(np.abs(z_wrong[iu])), np.max(np.abs(m_wrong))) > 10 * Z_MAX


def test_multihost_input_errors_are_clear_on_every_process(runs):
    for name in ("p0", "p1"):
        run = _ok(runs[name])
        assert "the processes hold [500, 498] rows" in run["unequal_rows"]
        assert "jit_model_args=True" in run["constant_data"]


def test_a_process_whose_peer_never_joins_exits_with_a_clear_error(runs):
    lone = runs["lone"]
    assert lone["returncode"] == JOIN_TIMEOUT_EXIT_CODE, lone["stderr"][-2000:]
    assert f"waited {JOIN_TIMEOUT} s for all 2 processes to join" in lone["stderr"]
    assert "RESULTS" not in lone["stdout"]
