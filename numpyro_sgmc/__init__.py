"""numpyro-sgmc: tuned stochastic-gradient MCMC kernels for NumPyro.

The mathematics, one convention for every kernel, is ``docs/theory.md``. The kernels run its
meta-algorithm (§2)

    θ' = θ + (h/2) Γ ĝ(θ) + sqrt(h/β) Λ^{1/2} ξ,   ξ ~ N(0, I_d),

and SGHMC (§5), with ``ĝ`` the minibatch or control-variate estimate of ``-∇U/n`` and ``h``
the step size on that average-gradient scale for every kernel. :func:`autotune` chooses the
tuning for a named target (Table 1, §4) and predicts its covariance and mixing;
:func:`check_run` compares a run with the prediction.
"""

from numpyro_sgmc import bde, calibration, diagnostics, theory
from numpyro_sgmc.cache import enable_compilation_cache
from numpyro_sgmc.cpu_linalg import avoid_parallel_lapack
from numpyro_sgmc.data.batches import shuffle_rows
from numpyro_sgmc.data.on_disk import shuffle_to_disk
from numpyro_sgmc.data.sharding import shard_data
from numpyro_sgmc.data.subsample import full_data
from numpyro_sgmc.kernels import SGD, SGHMC, SGLD, SGLDFP, AdaSGHMC, ChainInit
from numpyro_sgmc.running import distributed
from numpyro_sgmc.running.checkpoint import CheckpointError
from numpyro_sgmc.running.runner import completed_samples, load_run, run_kernel
from numpyro_sgmc.scales import Dense, Diagonal, Identity, layerwise
from numpyro_sgmc.tuner.check import check_run
from numpyro_sgmc.tuner.fisher import information
from numpyro_sgmc.tuner.tuning import autotune
from numpyro_sgmc.tuner.warmstart import warm_start

__version__ = "0.2.0"

# jaxlib 0.10-0.11's batched LAPACK kernels can deadlock XLA's CPU thread pool: a tuner's
# vmapped potential of a MultivariateNormal model hung (numpyro_sgmc.cpu_linalg)
avoid_parallel_lapack()

__all__ = [
    "AdaSGHMC",
    "ChainInit",
    "CheckpointError",
    "Dense",
    "Diagonal",
    "Identity",
    "SGD",
    "SGHMC",
    "SGLD",
    "SGLDFP",
    "autotune",
    "bde",
    "calibration",
    "check_run",
    "completed_samples",
    "diagnostics",
    "distributed",
    "enable_compilation_cache",
    "full_data",
    "information",
    "layerwise",
    "load_run",
    "run_kernel",
    "shard_data",
    "shuffle_rows",
    "shuffle_to_disk",
    "theory",
    "warm_start",
]
