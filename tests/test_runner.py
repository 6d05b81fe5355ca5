"""run_kernel: the same chain as MCMC, no copy of the data, clear errors."""

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from numpyro.infer import MCMC

from numpyro_sgmc import SGD, SGHMC, SGLD, SGLDFP, autotune, check_run, run_kernel
from problems import linear_regression, make_linear_regression


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=1000)


@pytest.mark.parametrize(
    "kernel, num_chains",
    [
        (SGLD(linear_regression, 1e-3, num_steps=3), 1),
        pytest.param(SGLDFP(linear_regression, 1e-3, num_steps=3), 3, marks=pytest.mark.slow),
        (SGD(linear_regression, 1e-3, num_steps=3), 3),
        (SGHMC(linear_regression, 1e-2, num_steps=3), 1),
    ],
    ids=["SGLD-1", "SGLDFP-3", "SGD-3", "SGHMC-1"],
)
@pytest.mark.filterwarnings(
    "ignore::numpyro_sgmc.diagnostics.CentreWarning"
)  # started away from the mode
def test_same_draws_as_mcmc(problem, kernel, num_chains):
    mcmc = MCMC(
        kernel,
        num_warmup=20,
        num_samples=60,
        thinning=3,
        num_chains=num_chains,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(7), problem.X, problem.y)
    run = run_kernel(
        kernel,
        jax.random.key(7),
        problem.X,
        problem.y,
        num_warmup=20,
        num_samples=20,
        thinning=3,
        num_chains=num_chains,
    )
    for group in (False, True):
        ours, theirs = run.get_samples(group), mcmc.get_samples(group)
        assert set(ours) == set(theirs)
        for name in ours:
            assert ours[name].shape == theirs[name].shape
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(run.last_state.i, mcmc.last_state.i)
    assert run.num_diverging.shape == (num_chains,) and not run.num_diverging.any()


@pytest.mark.slow
def test_check_run_takes_a_kernel_run():
    problem = make_linear_regression(n=5000)
    kernel, report = autotune(linear_regression, jax.random.key(0), problem.X, problem.y)
    run = run_kernel(kernel, jax.random.key(1), problem.X, problem.y, num_samples=2000, thinning=2)
    check = check_run(run, report, print_table=False)
    # 2000 draws half the mixing time apart: ESS in the hundreds, so the covariance is
    # within 20% (Frobenius) and a factor-2 error would be far outside it
    assert check.covariance_error < 0.2
    assert np.all(np.abs(check.sd_ratio - 1) < 5 * check.sd_ratio_se + 0.05)
    # the prediction counts the thinning: a kept draw is 2·num_steps iterations
    np.testing.assert_allclose(check.predicted_autocorrelation, report.autocorrelation_per_draw(2))


_PEAK = textwrap.dedent(
    """
    import json, sys, threading, time
    import jax, jax.numpy as jnp, numpy as np, numpyro, numpyro.distributions as dist, psutil
    from numpyro.infer import MCMC
    from numpyro_sgmc import SGLD, run_kernel

    def model(X, y):
        theta = numpyro.sample("theta", dist.Normal(0, 1).expand([2]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=16):
            Xb, yb = numpyro.subsample(X, event_dim=1), numpyro.subsample(y, event_dim=0)
            numpyro.sample("y", dist.Normal(Xb @ theta, 1.0), obs=yb)

    n = 25_000_000  # 300 MB
    X = jax.random.normal(jax.random.key(0), (n, 2))
    y = jax.random.normal(jax.random.key(1), (n,))
    data = X.nbytes + y.nbytes
    process, peak, lock = psutil.Process(), [0], threading.Lock()

    # the lock keeps a reset from being overwritten by a poll that read the old peak (the
    # data's creation) before it: under load that race counted a copy that was not there
    def poll():
        while True:
            rss = process.memory_info().rss
            with lock:
                peak[0] = max(peak[0], rss)
            time.sleep(0.001)

    threading.Thread(target=poll, daemon=True).start()

    def extra(run):
        run()  # compile first
        time.sleep(0.05)
        with lock:
            peak[0] = base = process.memory_info().rss
        run()
        time.sleep(0.05)
        return (peak[0] - base) / data

    kernel = SGLD(model, 1e-3, num_steps=10)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=50, jit_model_args=True, progress_bar=False)
    ours = extra(lambda: run_kernel(kernel, jax.random.key(2), X, y, num_samples=50))
    theirs = extra(lambda: jax.block_until_ready(mcmc.run(jax.random.key(2), X, y)))
    print(json.dumps({"run_kernel": ours, "mcmc": theirs}))
    """
)


@pytest.mark.slow
def test_run_kernel_makes_no_copy_of_the_data():
    out = subprocess.run(
        [sys.executable, "-c", _PEAK], capture_output=True, text=True, timeout=300, check=True
    )
    extra = json.loads(out.stdout.strip().splitlines()[-1])
    # MCMC(jit_model_args=True) returns the data with its last state: a whole transient copy,
    # which also shows that this measurement sees a copy when there is one
    assert extra["mcmc"] > 0.8, extra
    assert extra["run_kernel"] < 0.2, extra


def test_bad_arguments(problem):
    kernel = SGLD(linear_regression, 1e-3)
    args = (jax.random.key(0), problem.X, problem.y)
    with pytest.raises(ValueError, match="num_samples must be at least 1"):
        run_kernel(kernel, *args, num_samples=0)
    with pytest.raises(TypeError, match="thinning must be a positive int, got True"):
        run_kernel(kernel, *args, num_samples=5, thinning=True)
    with pytest.raises(ValueError, match="num_warmup must be a non-negative int, got -1"):
        run_kernel(kernel, *args, num_samples=5, num_warmup=-1)
    with pytest.raises(TypeError, match="runs the kernels of numpyro_sgmc"):
        from numpyro.infer import NUTS

        run_kernel(NUTS(linear_regression), *args, num_samples=5)


def test_large_data_in_memory_reach_the_device_once(capfd):
    """A NumPy argument of more than a megabyte is put on the device once per run, not on each
    compiled chunk's call (each call would copy it anew; the first chunk makes one draw, so
    3000 draws take several)."""
    n = 100_000
    data = make_linear_regression(n=n, seed=2)
    X, y = np.asarray(data.X), np.asarray(data.y)
    assert X.nbytes > 2**20 > y.nbytes
    kernel = SGLD(linear_regression, 1e-6, num_steps=3)
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log_explicit"):
        run_kernel(kernel, jax.random.key(0), X, y, num_samples=3000)
    transfers = capfd.readouterr().err
    assert "host-to-device transfer" in transfers  # the guard's log is seen
    whole = [line for line in transfers.splitlines() if f"[{n},3]" in line]
    assert len(whole) == 1, whole[:5]
