"""Predictions of the linearised chains and Table 1 (``docs/theory.md`` §3–§5).

Plain NumPy/SciPy (float64), usable without a model. Matrices are scales
(:mod:`numpyro_sgmc.scales`) or arrays (``(d,)`` diagonals, ``(d, d)`` dense); results that are
matrices are scales (``np.asarray(result)`` is the matrix).

* :mod:`~numpyro_sgmc.theory.linear`: Lyapunov equations, the stationary covariance of any
  first-order tuning, mixing and autocorrelation times, iterate averaging (§3);
* :mod:`~numpyro_sgmc.theory.table1`: Table 1 — targets, rows as data, their step rule and
  tunings with the exact-noise correction (§4);
* :mod:`~numpyro_sgmc.theory.sghmc`: SGHMC's ``2d × 2d`` linearisation (§5).

The public names are those of :mod:`~numpyro_sgmc.theory.linear` and
:mod:`~numpyro_sgmc.theory.table1` (their ``__all__``) and SGHMC's prediction
(``default_friction``, the kernels' helper, stays in :mod:`~numpyro_sgmc.theory.sghmc`).
"""

from numpyro_sgmc.theory import linear, table1
from numpyro_sgmc.theory.linear import *  # noqa: F403  (its __all__)
from numpyro_sgmc.theory.sghmc import SGHMCPrediction, sghmc_prediction, sghmc_recursion
from numpyro_sgmc.theory.table1 import *  # noqa: F403  (its __all__)

__all__ = [
    *linear.__all__,
    *table1.__all__,
    "SGHMCPrediction",
    "sghmc_prediction",
    "sghmc_recursion",
]
