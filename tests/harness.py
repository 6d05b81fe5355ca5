"""The one statistical harness of the test suite.

Draws come from ``C`` independent chains run far longer than their mixing time, so the
per-chain estimates (mean vector, covariance matrix) are independent replicates: their
spread across chains gives the Monte Carlo standard error without modelling the
autocorrelation. A test passes when every element is within ``Z_MAX`` standard errors of
the known answer (:func:`assert_law`, :func:`assert_within_mc`), and it is only accepted as a
test if it has the power to see a factor-2 error in the covariance
(``|0.5 Σ_ii| > Z_MAX · SE_ii`` on the diagonal).
"""

from __future__ import annotations

import jax
import numpy as np
from numpyro.infer import MCMC

Z_MAX = 4.5  # ~1e-5 two-sided per element under the null; fixed seeds make it deterministic


def run_chains(kernel, args, init_params, num_warmup, num_samples, seed=0, num_chains=None):
    """Vectorised chains, one per row of ``init_params`` (or ``num_chains`` chains started by
    the kernel's init strategy when ``init_params`` is None); asserts that none diverged."""
    if init_params is not None:
        params = init_params.params if hasattr(init_params, "params") else init_params
        num_chains = jax.tree.leaves(params)[0].shape[0]
    mcmc = MCMC(
        kernel,
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=num_chains,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(seed), *args, init_params=init_params)
    assert not np.any(np.asarray(mcmc.get_extra_fields()["diverging"]))
    return mcmc


def chain_estimates(draws):
    """Per-chain mean ``(C, d)`` and covariance ``(C, d, d)`` of ``draws`` ``(C, T, d)``.

    Covariances are taken about the pooled mean, which removes the O(τ/T) bias of a per-chain
    centring.
    """
    x = np.asarray(draws, np.float64)
    pooled = x.reshape(-1, x.shape[-1]).mean(axis=0)
    centred = x - pooled
    means = x.mean(axis=1)
    covs = np.einsum("cti,ctj->cij", centred, centred) / x.shape[1]
    return means, covs


def z_scores(estimates, target):
    """``(mean over chains - target) / SE`` elementwise, and the SE."""
    est = np.asarray(estimates, np.float64)
    se = est.std(axis=0, ddof=1) / np.sqrt(est.shape[0])
    return (est.mean(axis=0) - np.asarray(target)) / se, se


def assert_law(draws, mean=None, cov=None, z_max=Z_MAX, label=""):
    """Assert that the draws' mean and covariance match ``mean`` and ``cov`` within MC error.

    Also asserts the test's power: a covariance off by a factor of 2 would fail it.
    """
    means, covs = chain_estimates(draws)
    report = []
    if mean is not None:
        z, _ = z_scores(means, mean)
        report.append(f"mean z={np.round(z, 2)}")
        assert np.all(np.abs(z) < z_max), f"{label}: mean off: " + "; ".join(report)
    if cov is not None:
        cov = np.asarray(cov)
        z, se = z_scores(covs, cov)
        iu = np.triu_indices(cov.shape[0])
        report.append(f"cov z={np.round(z[iu], 2)}")
        power = 0.5 * np.diag(cov) / np.diag(se)
        assert np.all(power > z_max), (
            f"{label}: test too weak to see a factor-2 error (0.5·Σ_ii/SE_ii = {power}); "
            "run longer or more chains"
        )
        assert np.all(np.abs(z[iu]) < z_max), f"{label}: covariance off: " + "; ".join(report)


def assert_within_mc(estimate, se, expected, label=""):
    """Every entry of ``estimate`` within ``Z_MAX`` standard errors ``se`` of ``expected``."""
    err = np.abs(np.asarray(estimate) - np.asarray(expected))
    assert np.all(err <= Z_MAX * np.asarray(se)), (
        f"{label}: |estimate - prediction| / se = {np.max(err / np.asarray(se)):.2f} > {Z_MAX}"
    )


def assert_law_differs(draws, cov, z_min=10.0, label=""):
    """Assert that the draws' covariance is clearly *not* ``cov`` (some diagonal |z| > z_min)."""
    _, covs = chain_estimates(draws)
    z, _ = z_scores(covs, cov)
    assert np.max(np.abs(np.diag(z))) > z_min, f"{label}: expected a clear difference, z={z}"
