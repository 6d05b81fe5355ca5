"""The problem the multi-device and multi-host checks share (no JAX computation at import).

A Gaussian location model: ``w_i = Lᵀy_i ~ N(Lᵀθ, I)``, every per-datum Hessian ``-P``, so
minibatch gradient noise is exactly additive and the discrete-Lyapunov law of
``docs/theory.md`` §3 is the
exact stationary law at any step size. The prior is *strong*, as informative as several hundred
data: a prior counted once per device, or a likelihood scaled by the number of devices, then
moves the law by many standard errors.
"""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist

N = 1000
PRIOR_SD = 0.03  # prior precision 1111: as informative as ~800 data in coordinate 1
# the stationary-law run: SGLD with a step large enough that its law is ~2-4x the posterior
LAW = dict(step_size=0.1, batch_size=40, num_steps=10, chains=64, warmup=20, samples=150)
# the two-process run: shorter (each step waits for an all-reduce over localhost TCP)
LAW_MULTIHOST = dict(LAW, warmup=10, samples=60)


def location(W, L, prior_sd=PRIOR_SD, subsample_size=40):
    """``w_i ~ N(Lᵀθ, I)``, ``θ ~ N(0, prior_sd²)``: the plate takes its size from ``W``."""
    theta = numpyro.sample("theta", dist.Normal(0.0, prior_sd).expand([L.shape[0]]).to_event(1))
    with numpyro.plate("data", W.shape[0], subsample_size=subsample_size):
        Wb = numpyro.subsample(W, event_dim=1)
        numpyro.sample("w", dist.Normal(theta @ L, 1.0).to_event(1), obs=Wb)


def problem(prior_factor=1.0, likelihood_factor=1.0, num_shards=1):
    """Data (NumPy, float32) and the exact posterior and §3 quantities, optionally with a
    wrong factor; ``I_within`` is the mean within-shard gradient covariance over
    ``num_shards`` contiguous shards (the stratified batch's noise)."""
    rng = np.random.default_rng(0)
    sd = np.array([1.0, 0.5])
    cov = 0.5 * np.outer(sd, sd) + 0.5 * np.diag(sd**2)
    P = np.linalg.inv(cov)
    L = np.linalg.cholesky(P)
    Y = rng.multivariate_normal([0.5, -0.5], cov, size=N)
    W = Y @ L
    precision = likelihood_factor * N * P + prior_factor * np.eye(2) / PRIOR_SD**2
    post_cov = np.linalg.inv(precision)
    mode = post_cov @ (likelihood_factor * P @ Y.sum(axis=0))
    grads = likelihood_factor * (Y - mode) @ P  # per-datum likelihood gradients at the mode
    shards = grads.reshape(num_shards, N // num_shards, 2)
    return dict(
        W=W.astype(np.float32),
        L=L.astype(np.float32),
        Y=Y,
        P=P,
        mode=mode,
        post_cov=post_cov,
        J=precision / N,
        I=np.cov(grads.T, bias=True),
        I_within=np.mean([np.cov(g.T, bias=True) for g in shards], axis=0),
    )


def start(p, chains, seed=1):
    """Starting points ``N(mode, posterior covariance)``, one per chain (NumPy)."""
    rng = np.random.default_rng(seed)
    return {"theta": rng.multivariate_normal(p["mode"], p["post_cov"], size=chains).astype("f4")}


def law_prediction(p):
    """The §3 stationary covariance of the ``LAW`` run."""
    from numpyro_sgmc.theory import stationary_covariance

    return stationary_covariance(
        p["J"], p["I"], step_size=LAW["step_size"], batch_size=LAW["batch_size"], num_data=N
    )
