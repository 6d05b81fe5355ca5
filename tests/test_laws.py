"""Every kernel samples the law the theory predicts: kernels × scales × estimators, one table.

Each row runs a kernel in 32-64 independent vectorised chains on a model whose linearised
chain is exact (Bayesian linear regression: a quadratic log-likelihood; the Gaussian location
model: constant per-datum Hessians, additive gradient noise), and compares the draws with the
law of ``docs/theory.md`` — the exact posterior, the sandwich, or the discrete-Lyapunov
covariance of the tuning (§3; SGHMC's ``2d × 2d`` one, §5) — through the shared harness, which
also checks that a factor-2 error in the covariance would be seen. A wrong factor anywhere in
an update (the 1/2 in the drift, the noise scale, the n/b scaling, a square root, the
step-size convention) fails a row. Where the row's law is not the posterior, ``differs``
checks that the test could tell the two apart.
"""

from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
import pytest

from harness import assert_law, assert_law_differs, run_chains
from numpyro_sgmc import SGD, SGHMC, SGLD, SGLDFP, ChainInit, Dense, Diagonal, layerwise
from numpyro_sgmc.theory import sghmc_prediction, stationary_covariance
from problems import (
    draws,
    gaussian_location,
    linear_regression,
    make_gaussian_location,
    make_linear_regression,
    make_two_groups,
    two_groups,
)


@pytest.fixture(scope="module")
def problems():
    return {
        "linear": make_linear_regression(n=1000, d=3, rho=0.5, seed=0),
        "misspecified": make_linear_regression(
            n=10_000, d=3, rho=0.5, heteroscedastic=True, seed=1
        ),
        "location": make_gaussian_location(n=1000, sd=(1.0, 0.3), corr=0.6, seed=0),
        "two_plates": make_two_groups(n1=2000, n2=500),
    }


def lyapunov(p, **kwargs):
    """The discrete-Lyapunov law of a first-order tuning on problem ``p`` (Hessian term in)."""
    return np.asarray(stationary_covariance(p.J, p.I, num_data=p.n, hessians=p.hessians, **kwargs))


def sghmc_law(p, **kwargs):
    return sghmc_prediction(p.J, num_data=p.n, I=p.I, **kwargs).position_covariance


def unit_step(p, mass=None):
    """``h`` with ``h λmax(M⁻¹J) = 1`` (SGHMC is stable below ``2(2 - α)``)."""
    m = np.ones(len(p.J)) if mass is None else np.asarray(mass)
    if m.ndim == 1:
        s = 1 / np.sqrt(m)
        return 1.0 / np.linalg.eigvalsh(s[:, None] * p.J * s[None, :]).max()
    return 1.0 / np.linalg.eigvals(np.linalg.solve(m, p.J)).real.max()


class Law(NamedTuple):
    """One row: the kernel, the problem, the predicted law, and the run."""

    kernel: Callable  # problem -> kernel
    problem: str
    law: Callable  # problem -> (mean or None, covariance)
    warmup: int
    samples: int
    centred: bool = False  # control variates centred at the exact mode
    differs: Optional[Callable] = None  # problem -> a covariance the draws must not match
    chains: int = 64


def posterior(p):
    return p.mode, p.post_cov


LAWS = {
    # SGLD, identity, minibatch: h·n/b = 0.06, a ~1% bias, well inside the MC tolerance
    "SGLD-identity-posterior": Law(
        lambda p: SGLD(linear_regression, step_size=0.006), "linear", posterior, 30, 400
    ),
    "SGLDFP-identity-posterior": Law(
        lambda p: SGLDFP(linear_regression, step_size=0.02),
        "linear",
        posterior,
        10,
        150,
        centred=True,
    ),
    # b = 10 overrides the model's subsample_size; the noise h²I/(4b) makes it ~2.8x wide
    "SGLD-identity-large-step": Law(
        lambda p: SGLD(linear_regression, step_size=0.1, batch_size=10, num_steps=20),
        "linear",
        lambda p: (p.mode, lyapunov(p, step_size=0.1, batch_size=10)),
        20,
        400,
        differs=lambda p: p.post_cov,
    ),
    # Table 1 row F: Γ = J⁻¹, h = 4b/n, β = ∞: the sandwich S/n, far from J⁻¹/n here
    "SGD-dense-sandwich": Law(
        lambda p: SGD(
            linear_regression,
            step_size=4 * 100 / (p.n + 100),
            preconditioner=Dense(np.linalg.inv(p.J)),
            num_steps=10,
        ),
        "misspecified",
        lambda p: (p.mode, p.S / p.n),
        50,
        600,
        differs=lambda p: np.linalg.inv(p.J) / p.n,
    ),
    "SGLD-diagonal": Law(
        lambda p: SGLD(
            linear_regression,
            step_size=0.1,
            batch_size=10,
            num_steps=20,
            preconditioner=Diagonal({"theta": np.array([0.25, 1.0, 2.0])}),
        ),
        "linear",
        lambda p: (
            p.mode,
            lyapunov(p, step_size=0.1, batch_size=10, preconditioner=np.array([0.25, 1.0, 2.0])),
        ),
        20,
        400,
        differs=lambda p: lyapunov(p, step_size=0.1, batch_size=10),
    ),
    # row P4 at a large step: the control-variate Hessian term adds ~14% to the covariance
    "SGLDFP-dense-hessian-term": Law(
        lambda p: SGLDFP(
            linear_regression,
            step_size=1.0,
            batch_size=10,
            num_steps=5,
            preconditioner=Dense(np.linalg.inv(p.J)),
        ),
        "linear",
        lambda p: (
            p.mode,
            lyapunov(
                p,
                step_size=1.0,
                batch_size=10,
                preconditioner=np.linalg.inv(p.J),
                control_variates=True,
            ),
        ),
        20,
        600,
        centred=True,
        differs=lambda p: p.post_cov / (1 - 1.0 / 4),
    ),
    "SGLD-dense-drift-diagonal-noise": Law(
        lambda p: SGLD(
            linear_regression,
            step_size=0.2,
            batch_size=20,
            num_steps=10,
            preconditioner=Dense(np.linalg.inv(p.J)),
            noise_preconditioner=Diagonal({"theta": 1 / np.diag(p.J)}),
        ),
        "linear",
        lambda p: (
            p.mode,
            lyapunov(
                p,
                step_size=0.2,
                batch_size=20,
                preconditioner=np.linalg.inv(p.J),
                noise_preconditioner=1 / np.diag(p.J),
            ),
        ),
        20,
        400,
    ),
    # b = n/2 distinct indices: the noise is (n-b)/(n-1) ≈ 1/2 of the i.i.d. noise
    "SGLD-without-replacement": Law(
        lambda p: SGLD(
            linear_regression,
            step_size=1.0,
            batch_size=500,
            batch_sampling="without_replacement",
            num_steps=5,
        ),
        "linear",
        lambda p: (
            p.mode,
            lyapunov(p, step_size=1.0, batch_size=500, batch_sampling="without_replacement"),
        ),
        10,
        400,
        differs=lambda p: lyapunov(p, step_size=1.0, batch_size=500),
    ),
    # SGHMC at h λmax(M⁻¹J) = 1, where its law is far from the posterior (§5)
    "SGHMC-identity": Law(
        lambda p: SGHMC(gaussian_location, unit_step(p), num_steps=20),
        "location",
        lambda p: (p.mode, sghmc_law(p, step_size=unit_step(p), batch_size=50)),
        100,
        2000,
        differs=lambda p: p.post_cov,
        chains=32,
    ),
    # C = c I with a per-step decay η c/m_i of 0.2 and 0.05
    "SGHMC-diagonal-friction": Law(
        lambda p: SGHMC(
            gaussian_location,
            unit_step(p, [1.0, 4.0]),
            num_steps=20,
            mass=Diagonal({"theta": jnp.array([1.0, 4.0])}),
            friction=0.2 / np.sqrt(unit_step(p, [1.0, 4.0]) / p.n),
        ),
        "location",
        lambda p: (
            p.mode,
            sghmc_law(
                p,
                step_size=unit_step(p, [1.0, 4.0]),
                batch_size=50,
                mass=[1.0, 4.0],
                friction=0.2 / np.sqrt(unit_step(p, [1.0, 4.0]) / p.n),
            ),
        ),
        100,
        2000,
        chains=32,
    ),
    # dense M = J (isotropic dynamics), control variates (exact: constant Hessians), T = 2
    "SGHMC-dense-control-variates-tempered": Law(
        lambda p: SGHMC(
            gaussian_location,
            0.25 * unit_step(p, _mass(p)),
            num_steps=20,
            mass=Dense(jnp.asarray(_mass(p), jnp.float32)),
            control_variates=True,
            inverse_temperature=p.n / 2.0,
        ),
        "location",
        lambda p: (
            p.mode,
            sghmc_prediction(
                p.J,
                num_data=p.n,
                step_size=0.25 * unit_step(p, _mass(p)),
                mass=_mass(p),
                inverse_temperature=p.n / 2.0,
                control_variates=True,
            ).position_covariance,
        ),
        100,
        2000,
        centred=True,
        differs=lambda p: p.post_cov,
        chains=32,
    ),
}


def _mass(p):
    mass = np.linalg.inv(p.post_cov) / p.n
    return mass / np.linalg.eigvalsh(mass).min()


# one law per family stays in the quick run (-m "not slow"); CI runs them all
SLOW_LAWS = {
    "SGHMC-dense-control-variates-tempered", "SGLD-diagonal", "SGLD-dense-drift-diagonal-noise",
    "SGLD-identity-posterior", "SGHMC-identity", "SGD-dense-sandwich", "SGLDFP-dense-hessian-term",
    "SGLD-identity-large-step", "SGLDFP-identity-posterior", "SGHMC-diagonal-friction",
}  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAWS else n for n in sorted(LAWS)],
)
def test_kernel_samples_its_law(problems, name):
    law = LAWS[name]
    p = problems[law.problem]
    mean, cov = law.law(p)
    rng = np.random.default_rng(1)
    start = {
        "theta": jnp.asarray(rng.multivariate_normal(p.mode, cov, size=law.chains), jnp.float32)
    }
    init = start
    if law.centred:
        init = ChainInit(
            start, centre={"theta": jnp.tile(jnp.asarray(p.mode, jnp.float32), (law.chains, 1))}
        )
    args = (p.X, p.y) if law.problem != "location" else (p.W, p.L)
    x = draws(run_chains(law.kernel(p), args, init, law.warmup, law.samples))
    assert_law(x, mean, cov, label=name)
    if law.differs is not None:
        assert_law_differs(x, law.differs(p), z_min=4.5, label=f"{name} vs alternative")


@pytest.mark.slow
def test_layerwise_scales_with_two_plates_sample_their_law(problems):
    """Per-site scalars ``Γ = diag(2, 1/2)`` and two plates' minibatch noise: the estimate's
    noise per step is ``Σ_p (n_p/n)² I_p / b_p``; the likelihood is quadratic, so the discrete
    Lyapunov prediction is exact."""
    y1, y2, mean, post_cov = problems["two_plates"]
    n1, n2, b1, b2 = 2000, 500, 10, 5
    n = n1 + n2
    y1n, y2n = np.asarray(y1, np.float64), np.asarray(y2, np.float64)
    delta, mu = mean
    grads_a = np.stack([np.zeros(n1), y1n - mu], -1)  # (delta, mu)
    r = (y2n - mu - delta) / 4
    grads_b = np.stack([r, r], -1)
    noise = (n1 / n) ** 2 * np.cov(grads_a.T, bias=True) / b1
    noise += (n2 / n) ** 2 * np.cov(grads_b.T, bias=True) / b2
    J = np.linalg.inv(post_cov) / n
    h, gamma = 0.2, np.array([2.0, 0.5])
    cov = np.asarray(
        stationary_covariance(J, noise, step_size=h, batch_size=1, num_data=n, preconditioner=gamma)
    )
    kernel = SGLD(
        two_groups,
        step_size=h,
        batch_size={"a": b1, "b": b2},
        preconditioner=layerwise({"delta": 2.0, "mu": 0.5}),
        num_steps=20,
    )
    start = np.random.default_rng(3).multivariate_normal(mean, cov, size=32)
    z = {k: jnp.asarray(start[:, i], jnp.float32) for i, k in enumerate(("delta", "mu"))}
    mcmc = run_chains(kernel, (y1, y2), z, num_warmup=10, num_samples=400)
    s = mcmc.get_samples(group_by_chain=True)
    x = np.stack([np.asarray(s["delta"]), np.asarray(s["mu"])], -1)
    assert_law(x, mean, cov, label="layer-wise, two plates")
    assert np.all(np.diag(cov) / np.diag(post_cov) > 1.3)  # far from the posterior: noise shows
