"""Batched linear algebra in a compiled program finishes on CPU (``numpyro_sgmc.cpu_linalg``).

jaxlib 0.10.0-0.11.1 run a batch of matrices handed to a LAPACK kernel as chunks on XLA's
thread pool and wait for them from a thread of that pool; XLA runs independent operations of
a program concurrently on it, so two concurrent triangular solves deadlocked a 2-core
machine. The program below (the tuner's shape: a model's gradient and Hessian-vector
products vmapped over points and directions, a ``MultivariateNormal`` likelihood on 8,000
rows, an LKJ prior) never finished there without the library's lowering.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import version

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_sgmc  # noqa: F401  (its import installs the lowering)
from numpyro_sgmc.cpu_linalg import lapack_waits_on_its_pool

AFFECTED = lapack_waits_on_its_pool(version("jaxlib"))


def custom_calls(fun, *args) -> str:
    return " ".join(
        line for line in jax.jit(fun).lower(*args).as_text().splitlines() if "custom_call" in line
    )


def test_the_affected_releases_are_those_with_the_pool_waiting_kernels():
    assert lapack_waits_on_its_pool("0.10.2") and lapack_waits_on_its_pool("0.11.1")
    assert not lapack_waits_on_its_pool("0.9.2") and not lapack_waits_on_its_pool("0.11.2")
    assert lapack_waits_on_its_pool("0.10.0rc1") and not lapack_waits_on_its_pool("0.12.0")


@pytest.mark.skipif(not AFFECTED, reason="this jaxlib's LAPACK kernels do not use the pool")
def test_a_batch_of_matrices_avoids_lapack_and_one_matrix_keeps_it():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 4, 4)).astype(np.float32)
    spd = a @ np.swapaxes(a, -1, -2) + 4 * np.eye(4, dtype=np.float32)
    b = rng.normal(size=(6, 4, 3)).astype(np.float32)

    def solve(spd, b):
        return jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(spd), b, lower=True)

    assert "lapack" not in custom_calls(solve, spd, b)
    assert "lapack" not in custom_calls(jnp.linalg.solve, spd, b)  # LU
    assert "potrf" in custom_calls(solve, spd[0], b[0])
    # the same factors as LAPACK's, one matrix at a time; a NaN factor where not definite
    batched = np.asarray(jax.jit(solve)(spd, b))
    one_by_one = np.stack([np.asarray(jax.jit(solve)(s, r)) for s, r in zip(spd, b, strict=True)])
    np.testing.assert_allclose(batched, one_by_one, rtol=1e-4, atol=1e-5)
    indefinite = np.stack([spd[0], -spd[1]])
    factors = np.asarray(jax.jit(jnp.linalg.cholesky)(indefinite))
    assert np.all(np.isfinite(factors[0])) and np.any(np.isnan(factors[1]))


PROGRAM = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import numpyro, numpyro.distributions as dist
    from numpyro.infer.util import potential_energy
    import numpyro_sgmc

    rng = np.random.default_rng(0)
    C = np.array([[1.0, 0.6, 0.2], [0.6, 1.0, -0.3], [0.2, -0.3, 1.0]])
    Y = jnp.asarray(rng.multivariate_normal(np.zeros(3), C, 8000), jnp.float32)

    def model(Y):
        mu = numpyro.sample("mu", dist.Normal(0, 10).expand([3]).to_event(1))
        sigma = numpyro.sample("sigma", dist.HalfNormal(10).expand([3]).to_event(1))
        L = numpyro.sample("L", dist.LKJCholesky(3, 2.0))
        with numpyro.plate("N", Y.shape[0]):
            numpyro.sample("Y", dist.MultivariateNormal(mu, scale_tril=sigma[:, None] * L), obs=Y)

    def U(x):
        return potential_energy(model, (Y,), {}, {"L": x[0:3], "mu": x[3:6], "sigma": x[6:9]})

    def at(x, basis):
        def along(w):
            (value, grad), (_, hw) = jax.jvp(jax.value_and_grad(U), (x,), (w,))
            return value, grad, hw
        return jax.vmap(along, in_axes=1)(basis)

    points = jnp.asarray(rng.normal(size=(14, 9)) * 0.1, jnp.float32)
    basis = jnp.asarray(np.linalg.qr(rng.normal(size=(9, 9)))[0], jnp.float32)
    values, grads, hws = jax.jit(jax.vmap(at, in_axes=(0, None)))(points, basis)
    single = jax.jit(at)(points[3], basis)
    print(float(jnp.max(jnp.abs(hws[3] - single[2]) / (1 + jnp.abs(single[2])))))
    """
)


def test_a_vmapped_gradient_of_a_multivariate_normal_finishes():
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the vmapped program did not finish in 120 s: a deadlock")
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 1e-3  # the batch agrees with one point's products
