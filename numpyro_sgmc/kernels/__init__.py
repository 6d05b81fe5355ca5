"""``numpyro.infer.MCMC`` kernels: the shared shell and the named samplers."""

from numpyro_sgmc.kernels.base import (
    CentreWarning,
    ChainInit,
    DataOrderWarning,
    PerformanceWarning,
    SGMCKernel,
    SGMCState,
)
from numpyro_sgmc.kernels.sghmc import SGHMC, AdaSGHMC, MassAdaptation
from numpyro_sgmc.kernels.sgld import SGD, SGLD, SGLDFP

__all__ = [
    "AdaSGHMC",
    "CentreWarning",
    "ChainInit",
    "DataOrderWarning",
    "MassAdaptation",
    "PerformanceWarning",
    "SGD",
    "SGHMC",
    "SGLD",
    "SGLDFP",
    "SGMCKernel",
    "SGMCState",
]
