"""``numpyro.infer.MCMC`` kernels: the functional core, the shell and the named samplers."""

from numpyro_sgmc.kernels.core import Kernel, SGMCState, build_kernel
from numpyro_sgmc.kernels.sghmc import SGHMC, AdaSGHMC
from numpyro_sgmc.kernels.sgld import SGD, SGLD, SGLDFP
from numpyro_sgmc.kernels.shell import ChainInit, SGMCKernel

__all__ = [
    "AdaSGHMC",
    "ChainInit",
    "Kernel",
    "SGD",
    "SGHMC",
    "SGLD",
    "SGLDFP",
    "SGMCKernel",
    "SGMCState",
    "build_kernel",
]
