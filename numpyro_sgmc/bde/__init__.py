"""Bayesian deep ensembles: networks, bundled data, predictive metrics and §6 masses.

``K`` Adam runs from different starts (:func:`numpyro_sgmc.warm_start` with
``num_restarts=K``), then ``K`` SGHMC chains, chain ``k`` starting at mode ``k`` with a mass
built from its own Adam state (:func:`chain_init`, ``docs/theory.md`` §6); the networks give
every layer's kernel and bias its own site (:mod:`~numpyro_sgmc.bde.networks`), and
:func:`evaluate` scores the predictive on held-out data
(:mod:`~numpyro_sgmc.bde.predictive`).
"""

from numpyro_sgmc.bde.datasets import Split, airfoil, bike_sharing, concrete, diabetes, digits
from numpyro_sgmc.bde.mass_matrices import (
    adam_statistic,
    chain_init,
    layerwise_mass,
    mass_from_warm_start,
    pairwise_cosine_similarity,
    parameterwise_mass,
)
from numpyro_sgmc.bde.networks import init_to_fan_in, lenet, mlp
from numpyro_sgmc.bde.predictive import evaluate, gaussian_nll, lppd, predictive_distribution

__all__ = [
    "Split",
    "adam_statistic",
    "airfoil",
    "bike_sharing",
    "chain_init",
    "concrete",
    "diabetes",
    "digits",
    "evaluate",
    "gaussian_nll",
    "init_to_fan_in",
    "layerwise_mass",
    "lenet",
    "lppd",
    "mass_from_warm_start",
    "mlp",
    "pairwise_cosine_similarity",
    "parameterwise_mass",
    "predictive_distribution",
]
