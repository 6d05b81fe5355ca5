"""Optimizer-informed mass matrices (``docs/theory.md`` §6) on a hand-checked two-layer network."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.infer import MCMC

from numpyro_sgmc import SGHMC, Diagonal, warm_start
from numpyro_sgmc.bde import (
    chain_init,
    layerwise_mass,
    mass_from_warm_start,
    pairwise_cosine_similarity,
    parameterwise_mass,
)
from numpyro_sgmc.tuner.warmstart import WarmStart
from problems import flat_masses, make_two_groups, two_groups

# member 0's statistics on a 2-3-1 network, chosen so that the layer means are round numbers
GRADIENT = {
    "dense0.kernel": [[1.0, -2.0, 3.0], [-4.0, 5.0, -3.0]],  # mean |g| = 18/6 = 3
    "dense0.bias": [0.5, -0.5, 2.0],  # mean 1
    "dense1.kernel": [[6.0], [-6.0], [6.0]],  # mean 6
    "dense1.bias": [-1.5],  # mean 1.5
}
NU = {  # sqrt(ν) has layer means 2, 10/3, 1, 8
    "dense0.kernel": [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]],
    "dense0.bias": [1.0, 9.0, 36.0],
    "dense1.kernel": [[1.0], [1.0], [1.0]],
    "dense1.bias": [64.0],
}


def fake_warm_start():
    """Two members: member 1 is member 0 with every statistic doubled on dense1."""

    def two(values, factor_on_dense1):
        out = {}
        for k, v in values.items():
            v = jnp.asarray(v, jnp.float32)
            out[k] = jnp.stack([v, v * (factor_on_dense1 if k.startswith("dense1") else 1.0)])
        return out

    grad = two(GRADIENT, 2.0)
    params = jax.tree.map(jnp.zeros_like, grad)
    return WarmStart(
        params=params,
        constrained=params,
        gradient=params,
        first_moment=jax.tree.map(lambda g: -0.5 * g, grad),  # |μ| = |g| / 2
        second_moment=two(NU, 4.0),  # sqrt(ν) doubled on dense1
        loss=np.zeros((2, 3)),
        gradient_distance=np.zeros(2),
        converged=np.ones(2, bool),
        num_data=100,
        num_epochs=1.0,
        plates={},
        final_gradient=grad,
    )


def test_layerwise_gradient_mass_is_min_normalised_layer_means():
    masses = mass_from_warm_start(fake_warm_start(), "gradient", "layer")
    # member 0: means 3, 1, 6, 1.5 -> / 1; member 1: 3, 1, 12, 3 -> / 1
    expected = {
        "dense0.kernel": [3.0, 3.0],
        "dense0.bias": [1.0, 1.0],
        "dense1.kernel": [6.0, 12.0],
        "dense1.bias": [1.5, 3.0],
    }
    for k, v in expected.items():
        np.testing.assert_allclose(masses.values[k], v, rtol=1e-6)


def test_first_moment_mass_is_scale_free():
    # |μ| = |g|/2: the normalisation removes the factor
    g = mass_from_warm_start(fake_warm_start(), "gradient")
    mu = mass_from_warm_start(fake_warm_start(), "first_moment")
    for k in g.values:
        np.testing.assert_allclose(mu.values[k], g.values[k], rtol=1e-6)


def test_second_moment_mass_uses_sqrt_nu():
    masses = mass_from_warm_start(fake_warm_start(), "second_moment")
    # member 0: mean sqrt(ν) = 2, (1+3+6)/3 = 10/3, 1, 8 -> min 1
    np.testing.assert_allclose(masses.values["dense0.kernel"][0], 2.0, rtol=1e-6)
    np.testing.assert_allclose(masses.values["dense0.bias"][0], 10.0 / 3.0, rtol=1e-6)
    np.testing.assert_allclose(masses.values["dense1.kernel"][0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(masses.values["dense1.bias"][0], 8.0, rtol=1e-6)
    # member 1: dense1 doubled -> means 2, 10/3, 2, 16 -> min 2
    np.testing.assert_allclose(
        [masses.values[k][1] for k in sorted(masses.values)], [5.0 / 3.0, 1.0, 8.0, 1.0], rtol=1e-6
    )


@pytest.mark.parametrize("statistic", ["gradient", "first_moment", "second_moment"])
@pytest.mark.parametrize("granularity", ["layer", "parameter"])
def test_every_effective_step_is_at_most_eta(statistic, granularity):
    masses = mass_from_warm_start(fake_warm_start(), statistic, granularity)
    for member in range(2):
        values = np.concatenate([np.ravel(v[member]) for v in masses.values.values()])
        assert values.min() == pytest.approx(1.0)  # η / m ≤ η, with equality somewhere


def test_parameterwise_mass_divides_by_the_smallest_entry():
    values = {k: jnp.abs(jnp.asarray(v)) for k, v in GRADIENT.items()}
    masses = parameterwise_mass(values)
    np.testing.assert_allclose(
        masses.values["dense0.kernel"], np.abs(GRADIENT["dense0.kernel"]) / 0.5
    )
    np.testing.assert_allclose(masses.values["dense1.bias"], [3.0])
    # an exactly-zero statistic is raised to max/1e6: masses capped at 1e6, never inf/nan
    values["dense1.bias"] = jnp.zeros(1)
    masses = parameterwise_mass(values)
    np.testing.assert_allclose(masses.values["dense1.bias"], [1.0])
    np.testing.assert_allclose(masses.values["dense1.kernel"], [[1e6], [1e6], [1e6]], rtol=1e-5)


def test_layerwise_mass_errors():
    with pytest.raises(ValueError, match="zero on every parameter"):
        layerwise_mass({"a": jnp.zeros(3), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match="not finite"):
        layerwise_mass({"a": jnp.array([jnp.nan]), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match="Unknown statistic"):
        mass_from_warm_start(fake_warm_start(), "hessian")
    with pytest.raises(ValueError, match="Unknown granularity"):
        mass_from_warm_start(fake_warm_start(), "gradient", "block")
    no_adam = fake_warm_start()._replace(first_moment=None)
    with pytest.raises(ValueError, match="kept no Adam state"):
        mass_from_warm_start(no_adam, "first_moment")


def test_pairwise_cosine_similarity():
    masses = Diagonal({"a": jnp.array([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])})
    sim = pairwise_cosine_similarity(masses)
    np.testing.assert_allclose(np.diag(sim), 1.0)
    np.testing.assert_allclose(sim[0, 1], 0.0, atol=1e-12)
    np.testing.assert_allclose(sim[0, 2], 1 / np.sqrt(2))
    np.testing.assert_allclose(sim, sim.T)


@pytest.mark.slow
def test_real_warm_start_to_per_chain_sghmc():
    """K Adam runs -> K masses -> K SGHMC chains, each keeping its own mass."""
    y1, y2, mean, cov = make_two_groups(n1=2000, n2=500)
    warm = warm_start(two_groups, jax.random.key(0), y1, y2, num_restarts=3, num_epochs=5)
    for stat in (warm.final_gradient, warm.first_moment, warm.second_moment):
        assert set(stat) == {"delta", "mu"}
        assert all(v.shape == (3,) and np.all(np.isfinite(v)) for v in stat.values())
    masses = mass_from_warm_start(warm, "second_moment")
    assert masses.values["mu"].shape == (3,)
    kernel = SGHMC(two_groups, 2.5e-3, num_steps=10)
    mcmc = MCMC(
        kernel,
        num_warmup=0,
        num_samples=5,
        num_chains=3,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(1), y1, y2, init_params=chain_init(warm, "second_moment"))
    np.testing.assert_allclose(mcmc.last_state.params.mass.values, flat_masses(masses, warm.params))
