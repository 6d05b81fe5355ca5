"""The samplers (``docs/architecture.md``, ``docs/theory.md`` §2, §5).

Owns the functional core (:mod:`~numpyro_sgmc.kernels.core`: ``build_kernel`` composes a
gradient estimator, an integrator from :mod:`~numpyro_sgmc.kernels.diffusions` and an optional
adaptation from :mod:`~numpyro_sgmc.kernels.adaptation` into pure ``(init, step)`` functions),
the kernel families as data (:mod:`~numpyro_sgmc.kernels.family`: a ``Family`` record of pure
functions per kind of kernel), the thin ``numpyro.infer.MCMC`` shell
(:mod:`~numpyro_sgmc.kernels.shell`, its ``init`` in :mod:`~numpyro_sgmc.kernels.setup`, its draw
in :mod:`~numpyro_sgmc.kernels.draws`), the named kernels
(:mod:`~numpyro_sgmc.kernels.sgld`, :mod:`~numpyro_sgmc.kernels.sghmc`), their step checks and
``step_size="auto"`` (:mod:`~numpyro_sgmc.kernels.checks`,
:mod:`~numpyro_sgmc.kernels.auto_step`, the power iteration of
:mod:`~numpyro_sgmc.kernels.curvature`). It may import :mod:`numpyro_sgmc.data`,
:mod:`numpyro_sgmc.theory` (for a kernel's own prediction) and the foundations; never the tuner.
"""

from numpyro_sgmc.kernels.core import Kernel, SGMCState, build_kernel
from numpyro_sgmc.kernels.family import Family, Recipe
from numpyro_sgmc.kernels.sghmc import SGHMC, AdaSGHMC
from numpyro_sgmc.kernels.sgld import SGD, SGLD, SGLDFP
from numpyro_sgmc.kernels.shell import ChainInit, SGMCKernel

__all__ = [
    "AdaSGHMC",
    "ChainInit",
    "Family",
    "Kernel",
    "Recipe",
    "SGD",
    "SGHMC",
    "SGLD",
    "SGLDFP",
    "SGMCKernel",
    "SGMCState",
    "build_kernel",
]
