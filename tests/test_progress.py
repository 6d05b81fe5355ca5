"""The epoch progress bar: a bounded number of host updates, the right epochs, same draws;
the host checks for a Ctrl-C in MCMC.run: a few a second, and a stop keeps the draws made."""

import time

import jax
import numpy as np
import pytest
from numpyro.infer import MCMC

from numpyro_sgmc import SGLD, completed_samples
from numpyro_sgmc.data.progress import CHECK_SECONDS, EpochProgress, RunWatch, interrupts
from numpyro_sgmc.diagnostics import InterruptWarning
from problems import linear_regression, make_linear_regression


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=1000)


@pytest.fixture
def updates(monkeypatch):
    """Every host update as (iteration, bar position in epochs), in arrival order."""
    seen = []
    update = EpochProgress._update

    def record(self, i):
        update(self, i)
        seen.append((int(i), None if self._bar is None else self._bar.n))

    monkeypatch.setattr(EpochProgress, "_update", record)
    return seen


def run(kernel, problem, num_chains=1, chain_method="vectorized", seed=0):
    mcmc = MCMC(
        kernel,
        num_warmup=50,
        num_samples=150,
        num_chains=num_chains,
        chain_method=chain_method,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(seed), problem.X, problem.y)
    return np.asarray(mcmc.get_samples()["theta"])


def test_bar_is_updated_about_100_times_in_epochs_and_leaves_the_draws_alone(problem, updates):
    # 200 draws x 7 iterations = 1400 iterations at b = 10 of n = 1000: 14 epochs
    kernel = SGLD(linear_regression, 1e-3, batch_size=10, num_steps=7, progress_draws=200)
    with_bar = run(kernel, problem)
    iterations = [i for i, _ in updates]
    # one update per mark crossed (every 14 iterations), not one per draw (200) or step (1400)
    assert 90 <= len(iterations) <= 101
    assert iterations == sorted(iterations) and iterations[-1] == 1400
    assert np.all(np.diff(iterations) <= 14 + 7)
    # the bar shows passes over the data, i·b/n, and is closed at the end
    i, epochs = updates[-2]
    assert epochs == pytest.approx(i * 10 / 1000)
    assert updates[-1][1] is None

    kernel.progress_draws = None
    np.testing.assert_array_equal(run(kernel, problem), with_bar)


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential"])
def test_one_bar_per_chain_run(problem, updates, chain_method):
    kernel = SGLD(linear_regression, 1e-3, batch_size=10, num_steps=5, progress_draws=200)
    run(kernel, problem, num_chains=2, chain_method=chain_method)
    finished = [i for i, bar in updates if bar is None]
    # vectorised chains share one bar; sequential chains get one each
    assert finished == [1000] * (1 if chain_method == "vectorized" else 2)


def test_bad_progress_draws():
    for bad in (0, -3, 2.5, True, "100"):
        with pytest.raises(ValueError, match="progress_draws must be None or a positive int"):
            SGLD(linear_regression, 1e-3, progress_draws=bad)


def test_mcmc_checks_for_ctrl_c_a_few_times_a_second_not_per_draw(problem, monkeypatch):
    checks = []
    check = RunWatch.check

    def counted(self, i):
        checks.append(int(i))
        return check(self, i)

    monkeypatch.setattr(RunWatch, "check", counted)
    kernel = SGLD(linear_regression, 1e-3, num_steps=5)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=4000, progress_bar=False)
    start = time.perf_counter()
    mcmc.run(jax.random.key(3), problem.X, problem.y)
    seconds = time.perf_counter() - start
    # the first check is at iteration 0; each later one about CHECK_SECONDS of sampling on,
    # the interval growing at most eightfold from one check to the next
    assert checks[0] == 0 and checks == sorted(checks)
    assert len(checks) <= 12 + 3 * seconds / CHECK_SECONDS, (len(checks), seconds)
    assert len(checks) < 4000 // 20
    reference = np.asarray(mcmc.get_samples()["theta"])

    # a Ctrl-C seen at the fourth check skips every later draw; those before it are the
    # draws of the uninterrupted run
    polls = {"n": 0}

    def poll():
        polls["n"] += 1
        return polls["n"] >= 4

    monkeypatch.setattr(interrupts, "poll", poll)
    checks.clear()
    with pytest.warns(InterruptWarning) as record:
        mcmc.run(jax.random.key(3), problem.X, problem.y)
    made = completed_samples(mcmc)["theta"]
    stopped = checks[3]
    assert made.shape[0] == stopped // 5
    np.testing.assert_array_equal(made, reference[: made.shape[0]])
    flags = np.asarray(mcmc.get_extra_fields()["interrupted"])
    assert not flags[: made.shape[0]].any() and flags[made.shape[0] :].all()
    (message,) = [str(w.message) for w in record if w.category is InterruptWarning]
    assert (
        f"SGLD: interrupted (Ctrl-C) at iteration {stopped}, after {stopped // 5} draws" in message
    )
    assert "numpyro_sgmc.completed_samples(mcmc) gives the draws made" in message


def test_a_keyboard_interrupt_waits_until_the_main_thread_is_out_of_jax(monkeypatch):
    """Outside a run Ctrl-C raises KeyboardInterrupt, but not inside XLA's compiler (which
    checks for signals; an exception there abandons the compilation and crashed the process
    at exit): here the signal comes while a function compiles, and the raise after it."""
    import os
    import signal
    import sys
    import threading

    from numpyro_sgmc.data import progress

    monkeypatch.setattr(interrupts, "_alive_until", 0.0)  # no run is going
    monkeypatch.setattr(interrupts, "_requested", False)
    monkeypatch.setattr(interrupts, "_per_draw", False)
    # whatever earlier tests left: no run active, no Ctrl-C consumed, no handler chained
    monkeypatch.setattr(interrupts, "_active", 0)
    monkeypatch.setattr(interrupts, "_consumed", 0)
    monkeypatch.setattr(interrupts, "_previous", signal.default_int_handler)
    monkeypatch.setattr(interrupts, "_owed", False)
    monkeypatch.setattr(interrupts, "_raising", None)
    previous = signal.signal(signal.SIGINT, interrupts._handler)

    def f(x):
        for j in range(40):  # long enough to compile that the signal comes during it
            x = jax.lax.cond(x.sum() > j, lambda x: jax.numpy.sin(x @ x.T), jax.numpy.cos, x)
        return x

    compiled = jax.jit(f)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            timer.start()
            compiled(jax.numpy.ones((4, 4))).block_until_ready()
            time.sleep(5)  # a signal after the compilation raises here
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    innermost = raised.tb
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    assert not innermost.tb_frame.f_code.co_filename.startswith(progress._JAX_DIRS)
    assert compiled._cache_size() == 1  # the compilation finished
    assert sys.exc_info() == (None, None, None)
