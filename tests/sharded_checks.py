"""Checks that need several devices: run as a script, with 4 CPU devices, by test_sharding.py.

JAX fixes its device count when its backend starts, so these run in a subprocess (the rest of
the suite keeps one device). ``python tests/sharded_checks.py [check ...]`` prints one line
``RESULTS {json}``; the assertions are in ``test_sharding.py``, which reads the numbers.

The model is a Gaussian location model (every per-datum Hessian is ``-P``, so minibatch noise
is exactly additive and the discrete-Lyapunov law of ``docs/theory.md`` §3 is exact) with a *strong*
prior, as informative as a few hundred data: a prior counted once per device, or a likelihood
scaled by the number of devices, then moves the law by many standard errors.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("SGMC_TEST_DEVICES", "4")))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from sharded_problem import LAW, PRIOR_SD, N, law_prediction, location  # noqa: E402
from sharded_problem import problem as _problem  # noqa: E402
from sharded_problem import start as _start_np  # noqa: E402

from harness import chain_estimates, z_scores  # noqa: E402
from numpyro_sgmc import (  # noqa: E402
    SGD,
    SGHMC,
    SGLD,
    SGLDFP,
    AdaSGHMC,
    ChainInit,
    Diagonal,
    shard_data,
    warm_start,
)
from numpyro_sgmc.bde import chain_init  # noqa: E402
from numpyro_sgmc.data import sharding  # noqa: E402
from numpyro_sgmc.data.batches import BATCH_SAMPLING  # noqa: E402
from numpyro_sgmc.data.gradients import full_data_gradient  # noqa: E402
from numpyro_sgmc.data.model import prepare_model  # noqa: E402
from numpyro_sgmc.data.sharding import data_layout  # noqa: E402
from numpyro_sgmc.diagnostics import ConvergenceWarning  # noqa: E402
from numpyro_sgmc.theory import stationary_covariance  # noqa: E402

SGHMC_STEP = N * 2e-3**2  # h = n η² for Chen et al.'s η = 2e-3

D = len(jax.devices())


def literal_size(W, L):
    """The location model with the plate size written as a number: fails on a shard."""
    theta = numpyro.sample("theta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", N, subsample_size=40):
        Wb = numpyro.subsample(W, event_dim=1)
        numpyro.sample("w", dist.Normal(theta @ L, 1.0).to_event(1), obs=Wb)


def problem(**kwargs):
    """:func:`sharded_problem.problem` over ``D`` shards, with JAX arrays."""
    p = _problem(num_shards=D, **kwargs)
    return dict(p, W=jnp.asarray(p["W"]), L=jnp.asarray(p["L"]))


def exact_gradient(p, theta):
    """``-∇U(θ)/n`` and the per-datum likelihood gradients, in float64."""
    per_datum = (p["Y"] - theta) @ p["P"]
    prior = -theta / PRIOR_SD**2
    return (prior + per_datum.sum(axis=0)) / N, per_datum


def _cov_z(samples, target):
    """z-scores of the sample covariance against ``target`` (Gaussian SE), upper triangle."""
    K = samples.shape[0]
    S = np.cov(samples.T)
    se = np.sqrt((np.outer(np.diag(target), np.diag(target)) + target**2) / K)
    iu = np.triu_indices(2)
    return ((S - target) / se)[iu]


def check_gradient_moments():
    """The data-parallel estimate at a fixed θ: mean = exact gradient, covariance = c·Ī/b."""
    p = problem()
    W = shard_data(p["W"])
    theta = np.array([0.3, -0.2])
    z = {"theta": jnp.asarray(theta, jnp.float32)}
    exact, per_datum = exact_gradient(p, theta)
    shard_var = np.mean([np.cov(g.T, bias=True) for g in per_datum.reshape(D, N // D, 2)], axis=0)
    b, K = 40, 4000
    out = {"num_devices": D}
    args = (W, p["L"])
    prep = prepare_model(jax.random.key(0), location, args, batch_size=b)
    layout = data_layout(args, {}, prep.plates)
    assert layout is not None and layout.num_shards == D
    for method in BATCH_SAMPLING:
        estimator = sharding.minibatch(layout, prep.spec, method)

        def one(k, estimator=estimator):
            state = estimator.init(k, z, args, {})
            return estimator.estimate(state, z, k, args, {})[0]["theta"]

        g = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(1), K)), np.float64)
        se = g.std(axis=0, ddof=1) / np.sqrt(K)
        entry = {"mean_z": ((g.mean(axis=0) - exact) / se).tolist()}
        # the same check against the two factor-of-D errors, to show the test's power
        prior_twice = exact + (D - 1) * (-theta / PRIOR_SD**2) / N
        lik_scaled = exact + (D - 1) * per_datum.sum(axis=0) / N
        entry["power_prior_z"] = float(np.max(np.abs((g.mean(axis=0) - prior_twice) / se)))
        entry["power_likelihood_z"] = float(np.max(np.abs((g.mean(axis=0) - lik_scaled) / se)))
        if method in ("with_replacement", "without_replacement"):
            n_l, b_l = N // D, b // D
            c = 1.0 if method == "with_replacement" else (n_l - b_l) / (n_l - 1)
            target = c * shard_var / b
            entry["cov_z"] = _cov_z(g, target).tolist()
            entry["power_cov_z"] = float(np.max(np.abs(_cov_z(g, D * target))))
        out[method] = entry
    # Ī (stratified) against I: the single-device prediction holds up to O(D/n)
    full_var = np.cov(per_datum.T, bias=True)
    out["within_vs_total"] = float(np.max(np.abs(np.diag(shard_var) / np.diag(full_var) - 1)))

    # the exact full-data gradient, in chunks, summed over shards with the prior once
    single = full_data_gradient(prep.spec, z, (p["W"], p["L"]), {})
    # 64-row chunks: 4 per shard
    sharded = sharding.full_data_gradient(layout, prep.spec, 64)(z, args, {})
    scale = np.max(np.abs(exact))
    out["full_gradient_error"] = float(np.max(np.abs(np.asarray(sharded["theta"]) - exact)) / scale)
    out["full_gradient_single_error"] = float(
        np.max(np.abs(np.asarray(single["theta"]) - exact)) / scale
    )
    return out


def _run(kernel, data, L, init, chains, warmup, samples, chain_method="vectorized", **kw):
    mcmc = MCMC(
        kernel,
        num_warmup=warmup,
        num_samples=samples,
        num_chains=chains,
        chain_method=chain_method,
        progress_bar=False,
        **kw,
    )
    mcmc.run(jax.random.key(3), data, L, init_params=init)
    return mcmc


def _draws(kernel, data, L, init, chains, warmup, samples, seed=3):
    """What ``MCMC(chain_method="vectorized")._run(key(seed), ...)`` collects, in one compiled
    scan (MCMC's progress loop and postprocessing cost as much compile time again)."""
    keys = jax.random.split(jax.random.key(seed), chains)
    args = (data, L)
    state = kernel.init(keys, warmup, init, args, {})

    def body(state, _):
        state = kernel.sample(state, args, {})
        return state, state.z["theta"]

    _, z = jax.jit(lambda s: jax.lax.scan(body, s, None, length=warmup + samples))(state)
    return np.swapaxes(np.asarray(z[warmup:]), 0, 1)


def _kernels(p, b):
    """Every kernel, with a step that mixes on this problem."""
    return {
        "SGLD": lambda: SGLD(location, 0.05, batch_size=b, num_steps=5),
        "SGLDFP": lambda: SGLDFP(location, 0.05, batch_size=b, num_steps=5),
        "SGD": lambda: SGD(location, 0.05, batch_size=b, num_steps=5),
        "SGHMC": lambda: SGHMC(location, SGHMC_STEP, batch_size=b, num_steps=5),
        "AdaSGHMC": lambda: AdaSGHMC(location, SGHMC_STEP, batch_size=b, num_steps=5),
    }


def _start(p, chains, seed=1):
    return {"theta": jnp.asarray(_start_np(p, chains, seed)["theta"])}


def check_same_draws():
    """Full-data gradients (b = n): the sharded run's draws are the single-device run's."""
    p = problem()
    W = shard_data(p["W"])
    sd = np.sqrt(np.diag(p["post_cov"]))
    out = {}
    # SGLDFP: the update, with the centre's psummed full-data gradient (the second-order
    # update's D = 1 run is in test_sharding.py)
    kernels = {k: v for k, v in _kernels(p, N).items() if k == "SGLDFP"}
    for name, make in kernels.items():
        draws = {}
        for label, data in (("single", p["W"]), ("sharded", W)):
            kernel = make()
            draws[label] = _draws(kernel, data, p["L"], _start(p, 4), 4, 5, 20)
            assert (kernel.shards is not None) == (label == "sharded")
        out[name] = {
            "max_diff_in_sd": float(np.max(np.abs(draws["single"] - draws["sharded"]) / sd)),
            "spread_in_sd": float(np.max(np.std(draws["single"], axis=1) / sd)),
        }
    return out


def check_stationary_law():
    """Sharded SGLD (b = 40 over 4 devices, jit_model_args) against the §3 prediction."""
    p = problem()
    W = shard_data(p["W"])
    h, b, chains = LAW["step_size"], LAW["batch_size"], LAW["chains"]
    kw = dict(step_size=h, batch_size=b, num_data=N)
    cov = law_prediction(p)
    kernel = SGLD(location, h, batch_size=b, num_steps=LAW["num_steps"])
    t0 = time.perf_counter()
    init = _start(p, chains)
    mcmc = _run(kernel, W, p["L"], init, chains, LAW["warmup"], LAW["samples"], jit_model_args=True)
    x = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    seconds = time.perf_counter() - t0
    assert kernel.shards is not None
    means, covs = chain_estimates(x)
    mean_z, _ = z_scores(means, p["mode"])
    cov_z, cov_se = z_scores(covs, cov)
    iu = np.triu_indices(2)
    out = {
        "seconds": seconds,
        "diverging": int(np.sum(np.asarray(mcmc.get_extra_fields()["diverging"]))),
        "mean_z": mean_z.tolist(),
        "cov_z": cov_z[iu].tolist(),
        "power": (0.5 * np.diag(cov) / np.diag(cov_se)).tolist(),
        "cov_over_posterior": (np.diag(cov) / np.diag(p["post_cov"])).tolist(),
        # the exact prediction for the stratified batch (Ī for I) differs by O(D/n)
        "stratified_vs_single": float(
            np.max(
                np.abs(
                    np.diag(stationary_covariance(p["J"], p["I_within"], **kw)) / np.diag(cov) - 1
                )
            )
        ),
    }
    # the laws with a factor-of-D error, and how far the draws are from them
    for label, q in (
        ("prior_counted_D_times", problem(prior_factor=D)),
        ("likelihood_times_D", problem(likelihood_factor=D)),
        ("likelihood_over_D", problem(likelihood_factor=1 / D)),
    ):
        zm, _ = z_scores(means, q["mode"])
        zc, _ = z_scores(covs, law_prediction(q))
        out[label] = float(max(np.max(np.abs(zm)), np.max(np.abs(zc[iu]))))
    return out


def _max_diff_last_chain(make, p, init, draws, warmup, samples):
    """Largest difference between the last chain of a parallel run and the same chain run
    alone (its key and its slice of ``init``), which is what every chain must be."""
    chains = draws.shape[0]
    key = jax.random.split(jax.random.key(3), chains)[-1]
    alone = MCMC(make(), num_warmup=warmup, num_samples=samples, progress_bar=False)
    alone.run(key, p["W"], p["L"], init_params=jax.tree.map(lambda x: x[-1], init))
    return float(np.max(np.abs(np.asarray(alone.get_samples()["theta"]) - draws[-1])))


def check_parallel_chains():
    """chain_method="parallel" (one chain per device) gives the vectorised run's draws."""
    p = problem()
    out = {}
    chains = D
    start = _start(p, chains)
    scales = np.linspace(0.5, 2.0, chains)[:, None] * np.array([1.0, 2.0])
    per_chain = Diagonal({"theta": jnp.asarray(scales, jnp.float32)})
    inits = {
        "SGLD": ChainInit(start, preconditioner=per_chain),
        "SGLDFP": ChainInit(start, centre={"theta": jnp.tile(jnp.asarray(p["mode"]), (chains, 1))}),
        "SGD": ChainInit(start),
        "SGHMC": ChainInit(start, preconditioner=per_chain),
        "AdaSGHMC": ChainInit(start),
    }
    for name, make in _kernels(p, 40).items():
        mcmc = _run(make(), p["W"], p["L"], inits[name], chains, 5, 10, chain_method="parallel")
        draws = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
        out[name] = {
            "chains_distinct": bool(np.all(np.std(draws[:, -1], axis=0) > 0)),
            "finite": bool(np.all(np.isfinite(draws))),
        }
        if name in ("SGLDFP", "AdaSGHMC"):  # the first- and the second-order update
            out[name]["max_diff"] = _max_diff_last_chain(make, p, inits[name], draws, 5, 10)
        if name in ("SGLD", "SGHMC"):
            params = mcmc.last_state.params
            kept = np.asarray(
                params.mass.values if name == "SGHMC" else params.preconditioner.values
            )
            given = np.asarray(per_chain.values["theta"])
            out[name]["preconditioners_kept"] = bool(np.allclose(kept, given))

    # a deep ensemble: K Adam runs, one SGHMC chain per member and device, own masses
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warm = warm_start(
            location, jax.random.key(0), p["W"], p["L"], num_restarts=chains,
            num_epochs=3, learning_rate=0.02,
        )  # fmt: skip
    init = chain_init(warm, "first_moment", granularity="parameter")

    def sghmc():
        return SGHMC(location, SGHMC_STEP, batch_size=40, num_steps=5)

    mcmc = _run(sghmc(), p["W"], p["L"], init, chains, 0, 10, chain_method="parallel")
    draws = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    kept = np.asarray(mcmc.last_state.params.mass.values)
    given = np.asarray(init.preconditioner.values["theta"])
    modes = np.asarray(warm.params["theta"])
    nearest = np.argmin(np.linalg.norm(draws[:, 0][:, None] - modes[None], axis=-1), axis=1)
    out["deep_ensemble"] = {
        "masses_kept": bool(np.allclose(kept, given)),
        "masses_distinct": bool(np.unique(np.round(given, 4), axis=0).shape[0] == chains),
        "first_draw_nearest_own_mode": bool(np.all(nearest == np.arange(chains))),
    }
    return out


def _error(fn):
    try:
        fn()
    except Exception as err:  # the test checks the type and the message
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": ""}


def check_errors():
    """Bad layouts: a clear error each, at init (nothing runs, nothing hangs)."""
    p = problem()
    W, L = p["W"], p["L"]
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    other = Mesh(np.asarray(jax.devices()[::-1]), ("data",))
    grid = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "model"))

    def run(kernel, *args, chain_method=None, chains=1):
        if chain_method is None:  # init finds the layout; no need to sample
            kernel.init(jax.random.key(0), 1, None, args, {})
            return
        mcmc = MCMC(
            kernel, num_warmup=1, num_samples=1, num_chains=chains, chain_method=chain_method,
            progress_bar=False,
        )  # fmt: skip
        mcmc.run(jax.random.key(0), *args)

    def sgld(model=location, **kw):
        return SGLD(model, 1e-3, num_steps=1, **kw)

    def two_plates(W, V, L):
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("a", W.shape[0], subsample_size=40):
            Wb = numpyro.subsample(W, event_dim=1)
            numpyro.sample("w", dist.Normal(theta @ L, 1.0).to_event(1), obs=Wb)
        with numpyro.plate("b", V.shape[0], subsample_size=20):
            numpyro.sample("v", dist.Normal(theta[0], 1.0), obs=numpyro.subsample(V, 0))

    def with_extra(W, L, Z):
        location(W, L)

    V = jnp.zeros(200)
    return {
        "rows_not_divisible_shard_data": _error(lambda: shard_data(W[:998])),
        "batch_not_divisible": _error(lambda: run(sgld(batch_size=42), shard_data(W), L)),
        "different_meshes": _error(
            lambda: run(
                sgld(model=two_plates), shard_data(W, mesh=mesh), shard_data(V, mesh=other), L
            )
        ),
        "non_plate_axis": _error(
            lambda: run(
                sgld(), jax.device_put(W, NamedSharding(grid, PartitionSpec(None, "data"))), L
            )
        ),
        "two_mesh_axes": _error(
            lambda: run(
                sgld(), jax.device_put(W, NamedSharding(grid, PartitionSpec(("data", "model")))), L
            )
        ),
        "leading_size_not_a_plate": _error(
            lambda: run(sgld(model=with_extra), shard_data(W), L, shard_data(jnp.zeros(8)))
        ),
        "plate_not_sharded": _error(lambda: run(sgld(model=two_plates), shard_data(W), V, L)),
        "axis_not_in_mesh": _error(lambda: shard_data(W, mesh=mesh, axis_name="batch")),
        "literal_plate_size": _error(lambda: run(sgld(model=literal_size), shard_data(W), L)),
        "parallel_chains_with_sharded_data": _error(
            lambda: run(sgld(), shard_data(W), L, chain_method="parallel", chains=D)
        ),
        # a 2-D mesh whose second axis replicates the data works
        "grid_mesh_runs": _error(lambda: run(sgld(), shard_data(W, mesh=grid), L)),
    }


CHECKS = {
    "gradient_moments": check_gradient_moments,
    "same_draws": check_same_draws,
    "stationary_law": check_stationary_law,
    "parallel_chains": check_parallel_chains,
    "errors": check_errors,
}


def main(names):
    results = {}
    for name in names or CHECKS:
        t0 = time.perf_counter()
        results[name] = CHECKS[name]()
        results[name + "_seconds"] = time.perf_counter() - t0
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
