"""Ctrl-C keeps the draws made so far, is prompt and never crashes the process; run_kernel
continues a run and restores a checkpoint.

The interrupt tests run a child process that starts long runs and reports when each has
begun sampling; the test sends it SIGINT a moment later, as a terminal's Ctrl-C would, and
checks that the run returned within 2 s with the draws it had made (the same draws as an
uninterrupted run of that length), or raised KeyboardInterrupt within 2 s where that is what
Ctrl-C does, and that the child exits normally (a KeyboardInterrupt raised inside XLA's
compiler made it die of SIGSEGV as it exited). The checkpoint test kills (SIGKILL) a child that
writes checkpoints and restores the run from its directory.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from numpyro_sgmc import SGHMC, SGLD, load_run, run_kernel
from numpyro_sgmc.diagnostics import InterruptWarning
from problems import linear_regression, make_linear_regression

HERE = os.path.dirname(__file__)

_PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    sys.path.insert(0, TESTS)
    import jax, numpy as np
    from numpyro.infer import MCMC
    from numpyro_sgmc import SGLD, completed_samples, run_kernel
    from numpyro_sgmc.data.progress import interrupts
    from problems import linear_regression, make_linear_regression

    problem = make_linear_regression(n=1000)
    X, y = np.asarray(problem.X), np.asarray(problem.y)
    poll = interrupts.poll
    began = {"phase": None}

    def watched():  # the first host check of a phase says that it samples now
        if began["phase"] is not None:
            print("sampling", began["phase"], flush=True)
            began["phase"] = None
        return poll()

    interrupts.poll = watched

    def phase(name):
        began["phase"] = name
    """
)

_INTERRUPTED = _PRELUDE + textwrap.dedent(
    """
    results = {}
    kernel = SGLD(linear_regression, 1e-4, num_steps=10)
    run_kernel(kernel, jax.random.key(0), X, y, num_samples=2**14)  # compiles the chunk
    phase("run_kernel")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run = run_kernel(kernel, jax.random.key(1), X, y, num_samples=10**8)
    ended = time.time()
    reference = run_kernel(kernel, jax.random.key(1), X, y, num_samples=run.num_samples)
    more = run_kernel(kernel, None, X, y, num_samples=7, previous=run)
    longer = run_kernel(kernel, jax.random.key(1), X, y, num_samples=run.num_samples + 7)
    results["run_kernel"] = dict(
        ended=ended,
        interrupted=run.interrupted,
        kept=run.num_samples,
        draws=run.num_draws,
        messages=[str(w.message) for w in seen if w.category.__name__ == "InterruptWarning"],
        same=bool(np.array_equal(run.samples["theta"], reference.samples["theta"])),
        continued=bool(np.array_equal(more.samples["theta"], longer.samples["theta"])),
        finite=bool(np.all(np.isfinite(run.samples["theta"]))),
    )
    for bar in (False,):  # with NumPyro's bar Ctrl-C raises: test_ctrl_c_in_every_phase
        slow = SGLD(linear_regression, 1e-4, num_steps=2000)
        mcmc = MCMC(slow, num_warmup=10, num_samples=600, progress_bar=bar)
        phase(f"mcmc-bar-{bar}")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mcmc.run(jax.random.key(2), X, y)
        ended = time.time()
        made = completed_samples(mcmc)["theta"]
        flags = np.asarray(mcmc.get_extra_fields()["interrupted"])
        results[f"mcmc-bar-{bar}"] = dict(
            ended=ended,
            kept=int(made.shape[0]),
            flagged=int(flags.sum()),
            messages=[str(w.message) for w in seen if w.category.__name__ == "InterruptWarning"],
            finite=bool(np.all(np.isfinite(np.asarray(made)))),
        )
    print("result", json.dumps(results), flush=True)
    """
)


def _child(source, log, *args):
    """The child process, its stderr (progress bars, warnings) in the file ``log``.

    NumPyro switches its progress bar off where ``CI`` or ``PYTEST_XDIST_WORKER`` is set
    (``MCMC.__init__``): the child runs without them, so that ``progress_bar=True`` is the
    per-draw loop these tests are about on a CI machine too."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER")}
    return subprocess.Popen(
        [sys.executable, "-c", source.replace("TESTS", repr(HERE)), *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_ctrl_c_stops_run_kernel_and_mcmc_within_2_s_and_keeps_the_draws(tmp_path):
    log = open(tmp_path / "stderr", "w+")
    child = _child(_INTERRUPTED, log)
    sent = {}
    try:
        for line in child.stdout:
            if line.startswith("sampling"):
                name = line.split()[1]
                time.sleep(2.0)  # a few seconds into the run
                sent[name] = time.time()
                child.send_signal(signal.SIGINT)
            elif line.startswith("result"):
                results = json.loads(line.split(" ", 1)[1])
                break
        else:
            log.seek(0)
            raise AssertionError(log.read())
        child.wait(timeout=60)
    finally:
        child.kill()
        log.close()
    assert set(sent) == {"run_kernel", "mcmc-bar-False"}
    latency = {name: results[name]["ended"] - sent[name] for name in sent}
    print("seconds from SIGINT to the run's return:", latency)
    assert all(0 < t < 2.0 for t in latency.values()), latency

    ours = results["run_kernel"]
    assert ours["interrupted"] and 0 < ours["kept"] < 10**8
    # the draws kept are those of an uninterrupted run of that length, and the run continues
    # as one long run would
    assert ours["same"] and ours["continued"] and ours["finite"]
    (message,) = ours["messages"]
    assert f"run_kernel: interrupted (Ctrl-C) after {ours['draws']} of 100000000 draws" in message
    assert f"the KernelRun holds the {ours['kept']} kept draws made so far" in message
    assert "previous=run" in message

    for bar in (False,):
        mcmc = results[f"mcmc-bar-{bar}"]
        # warm-up and sampling took 2 s or more: some draws were kept, and the others flagged
        assert 0 < mcmc["kept"] < 600 and mcmc["kept"] + mcmc["flagged"] == 600
        assert mcmc["finite"]
        (message,) = mcmc["messages"]
        assert "SGLD: interrupted (Ctrl-C) at iteration" in message
        assert f"{mcmc['kept']} after it" in message
        assert "numpyro_sgmc.completed_samples(mcmc) gives the draws made" in message


_PHASES = _PRELUDE + textwrap.dedent(
    """
    import signal
    from numpyro_sgmc import autotune, load_run
    from problems import logistic_regression, make_logistic

    def absorbed(name, call):
        # the outcome of one phase and when it came; the rest of the signal's burst lands in
        # the pauses after it, so that the child's own bookkeeping is not interrupted
        out = dict(outcome="completed", messages=[])
        try:
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    out.update(call() or {})
            except KeyboardInterrupt:
                out["outcome"] = "raised"
            out["ended"] = time.time()
            out["messages"] = [str(w.message) for w in seen if w.category is InterruptWarning]
            if out["outcome"] == "completed":  # done before the signal: it comes while we wait
                out["outcome"] = "finished early"
                time.sleep(30)
        except KeyboardInterrupt:
            if out["outcome"] == "finished early" or "ended" not in out:
                out["ended"] = time.time()
        for _ in range(5):
            try:
                time.sleep(1.0)  # longer than a burst
                break
            except KeyboardInterrupt:
                pass
        print("phase", name, json.dumps(out), flush=True)

    from numpyro_sgmc.diagnostics import InterruptWarning

    def tune():
        XL, yL = make_logistic(n=20_000)
        print("sampling autotune", flush=True)  # tuning compiles most of the time
        autotune(logistic_regression, jax.random.key(0), XL, yL)

    def mcmc(bar):
        kernel = SGLD(linear_regression, 1e-4, num_steps=10 if bar else 2000)
        # no warm-up phase: one compilation, before the first host check
        mcmc = MCMC(kernel, num_warmup=0, num_samples=2 * 10**6 if bar else 600,
                    progress_bar=bar)
        phase(f"mcmc-bar-{bar}")
        mcmc.run(jax.random.key(2), X, y)
        made = completed_samples(mcmc)["theta"]
        return dict(outcome="returned", kept=int(made.shape[0]))

    def checkpointed():
        kernel = SGLD(linear_regression, 1e-4, num_steps=50)
        run_kernel(kernel, jax.random.key(3), X, y, num_samples=64)  # compiles the chunk
        phase("run_kernel")
        run = run_kernel(kernel, jax.random.key(3), X, y, num_samples=10**7,
                         checkpoint=sys.argv[1], checkpoint_every=1)
        return dict(outcome="returned", kept=run.num_samples)

    absorbed("autotune", tune)
    absorbed("mcmc-bar-True", lambda: mcmc(True))
    absorbed("mcmc-bar-False", lambda: mcmc(False))
    absorbed("run_kernel", checkpointed)
    kernel = SGLD(linear_regression, 1e-4, num_steps=50)
    print("restored", load_run(sys.argv[1], kernel, X, y).num_samples, flush=True)
    """
)


@pytest.mark.slow  # 10-23 s: the quick suite's 10 minutes
def test_ctrl_c_in_every_phase_is_prompt_and_never_crashes(tmp_path):
    """SIGINT at random times, in bursts of two or three, in autotune, MCMC.run with NumPyro's
    progress bar and (a single one) without, and run_kernel writing a checkpoint after every
    chunk.

    Each run ends (returns its draws or raises KeyboardInterrupt, as documented) within 2 s
    of the first signal, measured in the child. autotune compiles most of its time, and the
    raise waits for the XLA compilation under way (interrupting one is what crashed the
    process): its largest takes about 2.5 s on 2 quiet cores, so autotune gets 6 s. The
    process's own exit is slower on a loaded machine (up to about 3 s for JAX's teardown)
    and is only required to be a normal one."""
    rng = np.random.default_rng(25)
    directory = str(tmp_path / "run")
    log = open(tmp_path / "stderr", "w+")
    child = _child(_PHASES, log, directory)
    sent, phases, restored = {}, {}, None
    try:
        for line in child.stdout:
            if line.startswith("sampling"):
                name = line.split()[1]
                # autotune: anywhere in its compilations; a run: some way into its sampling
                time.sleep(rng.uniform(0.3, 3.0) if name == "autotune" else rng.uniform(0.5, 2))
                sent[name] = time.time()
                # a burst (Ctrl-C pressed again while the first one takes effect), but a single
                # Ctrl-C where it should keep the draws
                more = 0 if name == "mcmc-bar-False" else rng.integers(1, 3)
                for pause in [0.0] + list(rng.uniform(0.05, 0.4, size=more)):
                    time.sleep(pause)
                    child.send_signal(signal.SIGINT)
            elif line.startswith("phase"):
                _, name, record = line.split(" ", 2)
                phases[name] = json.loads(record)
            elif line.startswith("restored"):
                restored = int(line.split()[1])
        child.wait(timeout=60)
    finally:
        child.kill()
        log.seek(0)
        errors = log.read()
        log.close()
    assert child.returncode == 0, (child.returncode, errors[-3000:])  # never -11 (SIGSEGV)
    assert set(phases) == set(sent) == {"autotune", "mcmc-bar-True", "mcmc-bar-False",
                                        "run_kernel"}, (phases, errors[-3000:])  # fmt: skip
    latency = {name: phases[name]["ended"] - sent[name] for name in sent}
    print("seconds from the first SIGINT to the phase's end:", latency)
    print({name: phases[name]["outcome"] for name in phases})
    limits = {name: 6.0 if name == "autotune" else 2.0 for name in latency}
    assert all(latency[name] < limits[name] for name in latency), latency

    assert phases["autotune"]["outcome"] in ("raised", "finished early")
    # NumPyro's bar dispatches each draw from Python: Ctrl-C raises between two draws
    bar = phases["mcmc-bar-True"]
    assert bar["outcome"] == "raised"
    assert any("Ctrl-C raises KeyboardInterrupt between two draws" in m and
               "progress_bar=False" in m for m in bar["messages"]), bar["messages"]  # fmt: skip
    # without it the run returns the draws made
    plain = phases["mcmc-bar-False"]
    assert plain["outcome"] == "returned" and 0 < plain["kept"] < 600
    assert any("SGLD: interrupted (Ctrl-C)" in m for m in plain["messages"])
    # run_kernel stopped (or the burst's second Ctrl-C raised) and its checkpoint loads
    assert phases["run_kernel"]["outcome"] in ("returned", "raised")
    assert restored is not None and restored >= 0


_CHECKPOINTING = _PRELUDE + textwrap.dedent(
    """
    kernel = SGLD(linear_regression, 1e-4, num_steps=50)
    phase("checkpointing")
    run_kernel(kernel, jax.random.key(3), X, y, num_warmup=30, num_samples=10**7, thinning=2,
               checkpoint=sys.argv[1], checkpoint_every=64)
    """
)


@pytest.mark.slow
def test_a_killed_run_is_restored_from_its_checkpoint_and_continued(tmp_path):
    directory = str(tmp_path / "run")
    log = open(tmp_path / "stderr", "w+")
    child = _child(_CHECKPOINTING, log, directory)
    try:
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(directory, "checkpoint.json")):
            assert child.poll() is None and time.time() < deadline, log.seek(0) or log.read()
            time.sleep(0.05)
        time.sleep(1.5)  # a few more checkpoints
        child.send_signal(signal.SIGKILL)  # no chance to write anything more
        child.wait(timeout=30)
    finally:
        child.kill()
        log.close()
    problem = make_linear_regression(n=1000)
    kernel = SGLD(linear_regression, 1e-4, num_steps=50)
    run = load_run(directory, kernel, problem.X, problem.y)
    # a checkpoint every 64 kept draws: a kill loses at most 64
    assert run.interrupted and run.num_samples % 64 == 0 and run.num_samples >= 64
    assert run.num_draws == 30 + 2 * run.num_samples
    reference = run_kernel(kernel, jax.random.key(3), problem.X, problem.y, num_warmup=30,
                           num_samples=run.num_samples + 10, thinning=2)  # fmt: skip
    samples = reference.samples["theta"]
    np.testing.assert_array_equal(run.samples["theta"], samples[:, : run.num_samples])
    # and it continues as the one long run
    more = run_kernel(kernel, None, problem.X, problem.y, num_samples=10, previous=run)
    np.testing.assert_array_equal(more.samples["theta"], samples)
    np.testing.assert_array_equal(more.last_state.z["theta"], reference.last_state.z["theta"])


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=1000)


@pytest.mark.parametrize(
    "kernel, num_chains",
    [
        (SGLD(linear_regression, 1e-3, num_steps=3), 1),
        pytest.param(SGHMC(linear_regression, 1e-3), 2, marks=pytest.mark.slow),
    ],
    ids=["SGLD-1", "SGHMC-2"],
)
@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.StepSizeWarning")
def test_two_halves_are_one_run(problem, kernel, num_chains):
    data = (problem.X, problem.y)
    settings = dict(num_warmup=7, thinning=3, num_chains=num_chains)
    whole = run_kernel(kernel, jax.random.key(4), *data, num_samples=25, **settings)
    # the first call stops inside the warm-up; the second finishes it and keeps 20 draws
    first = run_kernel(kernel, jax.random.key(4), *data, num_samples=5, **settings)
    second = run_kernel(kernel, None, *data, num_samples=20, previous=first)
    assert second.num_samples == 25 and second.num_draws == 7 + 3 * 25
    for name in whole.samples:
        np.testing.assert_array_equal(second.samples[name], whole.samples[name])
    for a, b in zip(
        jax.tree.leaves(second.last_state), jax.tree.leaves(whole.last_state), strict=True
    ):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.StepSizeWarning")
def test_a_continuation_is_checked(problem, tmp_path):
    kernel = SGLD(linear_regression, 1e-3, num_steps=3)
    data = (problem.X, problem.y)
    first = run_kernel(kernel, jax.random.key(4), *data, num_samples=4, thinning=2,
                       checkpoint=tmp_path, checkpoint_every=3)  # fmt: skip
    restored = load_run(tmp_path, kernel, *data)
    assert not restored.interrupted and restored.num_samples == 4
    np.testing.assert_array_equal(restored.samples["theta"], first.samples["theta"])
    with pytest.raises(ValueError, match="pass rng_key=None"):
        run_kernel(kernel, jax.random.key(4), *data, num_samples=4, previous=first)
    with pytest.raises(ValueError, match=r"keeps previous's thinning \(2\), got thinning=3"):
        run_kernel(kernel, None, *data, num_samples=4, thinning=3, previous=first)
    with pytest.raises(ValueError, match="previous was run by another kernel"):
        run_kernel(SGLD(linear_regression, 1e-3), None, *data, num_samples=4, previous=first)
    with pytest.raises(ValueError, match="needs data of the same shapes"):
        run_kernel(kernel, None, problem.X[:500], problem.y[:500], num_samples=4, previous=first)
    with pytest.raises(ValueError, match="The checkpoint in .* is of a SGLD run; got a SGHMC"):
        load_run(tmp_path, SGHMC(linear_regression, 1e-3), *data)
    with pytest.raises(FileNotFoundError, match="No run_kernel checkpoint in"):
        load_run(tmp_path / "nothing", kernel, *data)


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.StepSizeWarning")
def test_interrupt_between_chunks_keeps_the_draws(problem, monkeypatch):
    """In process: a stop requested after the third chunk ends the run there."""
    from numpyro_sgmc.data.progress import interrupts

    polls = {"n": 0}

    def poll():
        polls["n"] += 1
        return polls["n"] > 3

    monkeypatch.setattr(interrupts, "poll", poll)
    kernel = SGLD(linear_regression, 1e-3, num_steps=3)
    with pytest.warns(InterruptWarning) as record:
        run = run_kernel(kernel, jax.random.key(5), problem.X, problem.y, num_samples=10**6)
    assert run.interrupted and 0 < run.num_samples < 10**6
    (message,) = [str(w.message) for w in record if w.category is InterruptWarning]
    assert f"holds the {run.num_samples} kept draws made so far" in message
    assert f"num_samples={10**6 - run.num_samples}, previous=run" in message
