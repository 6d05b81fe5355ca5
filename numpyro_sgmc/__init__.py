"""numpyro-sgmc: tuned stochastic-gradient MCMC kernels for NumPyro.

The mathematics (one convention for every kernel) is ``shared/design/theory.md``; the
kernels implement its meta-algorithm (§2)

    θ' = θ + (h/2) Γ ĝ(θ) + sqrt(h/β) Λ^{1/2} ξ,   ξ ~ N(0, I_d),

with ``ĝ`` the minibatch or control-variate estimate of the average gradient ``-∇U/n``.
"""

from numpyro_sgmc.batches import shuffle_rows
from numpyro_sgmc.diagnostics import DivergenceWarning
from numpyro_sgmc.kernels import (
    SGD,
    SGLD,
    SGLDFP,
    CentreWarning,
    ChainInit,
    DataOrderWarning,
    PerformanceWarning,
    SGMCKernel,
    SGMCState,
)
from numpyro_sgmc.preconditioners import Dense, Diagonal, Identity, flat_layout, layerwise

__version__ = "0.1.0"

__all__ = [
    "CentreWarning",
    "ChainInit",
    "DataOrderWarning",
    "Dense",
    "Diagonal",
    "DivergenceWarning",
    "Identity",
    "PerformanceWarning",
    "SGD",
    "SGLD",
    "SGLDFP",
    "SGMCKernel",
    "SGMCState",
    "flat_layout",
    "layerwise",
    "shuffle_rows",
]
