"""numpyro-sgmc: tuned stochastic-gradient MCMC kernels for NumPyro.

The mathematics (one convention for every kernel) is ``shared/design/theory.md``; the
kernels implement its meta-algorithm (§2)

    θ' = θ + (h/2) Γ ĝ(θ) + sqrt(h/β) Λ^{1/2} ξ,   ξ ~ N(0, I_d),

with ``ĝ`` the minibatch or control-variate estimate of the average gradient ``-∇U/n``.
"""

from numpyro_sgmc import distributed, theory
from numpyro_sgmc.autotune import TuningReport, autotune, target_weights
from numpyro_sgmc.batches import shuffle_rows
from numpyro_sgmc.check import RunCheck, check_run
from numpyro_sgmc.diagnostics import DivergenceWarning
from numpyro_sgmc.fisher import Information, information, per_datum_hessians
from numpyro_sgmc.kernels import (
    SGD,
    SGHMC,
    SGLD,
    SGLDFP,
    AdaSGHMC,
    CentreWarning,
    ChainInit,
    DataOrderWarning,
    MassAdaptation,
    PerformanceWarning,
    SGMCKernel,
    SGMCState,
)
from numpyro_sgmc.mass_matrices import (
    layerwise_mass,
    mass_from_warm_start,
    pairwise_cosine_similarity,
    parameterwise_mass,
)
from numpyro_sgmc.preconditioners import Dense, Diagonal, Identity, flat_layout, layerwise
from numpyro_sgmc.progress import EpochProgress
from numpyro_sgmc.runner import KernelRun, run_kernel
from numpyro_sgmc.sharding import data_mesh, shard_data
from numpyro_sgmc.warmstart import ConvergenceWarning, WarmStart, warm_start

__version__ = "0.1.0"

__all__ = [
    "AdaSGHMC",
    "CentreWarning",
    "ChainInit",
    "ConvergenceWarning",
    "DataOrderWarning",
    "Dense",
    "Diagonal",
    "DivergenceWarning",
    "EpochProgress",
    "Identity",
    "Information",
    "KernelRun",
    "MassAdaptation",
    "PerformanceWarning",
    "RunCheck",
    "SGD",
    "SGHMC",
    "SGLD",
    "SGLDFP",
    "SGMCKernel",
    "SGMCState",
    "TuningReport",
    "WarmStart",
    "autotune",
    "check_run",
    "data_mesh",
    "distributed",
    "flat_layout",
    "information",
    "layerwise",
    "layerwise_mass",
    "mass_from_warm_start",
    "pairwise_cosine_similarity",
    "parameterwise_mass",
    "per_datum_hessians",
    "run_kernel",
    "shard_data",
    "shuffle_rows",
    "target_weights",
    "theory",
    "warm_start",
]
