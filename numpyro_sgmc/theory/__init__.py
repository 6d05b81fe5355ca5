"""Predictions of the linearised chains and Table 1 (``docs/theory.md`` §3–§5).

Plain NumPy/SciPy (float64), usable without a model. Matrices are scales
(:mod:`numpyro_sgmc.scales`) or arrays (``(d,)`` diagonals, ``(d, d)`` dense); results that are
matrices are scales (``np.asarray(result)`` is the matrix).

* :mod:`~numpyro_sgmc.theory.linear`: Lyapunov equations, the stationary covariance of any
  first-order tuning, mixing and autocorrelation times, iterate averaging (§3);
* :mod:`~numpyro_sgmc.theory.table1`: Table 1 — targets, rows, tunings with the exact-noise
  correction (§4);
* :mod:`~numpyro_sgmc.theory.sghmc`: SGHMC's ``2d × 2d`` linearisation (§5).
"""

from numpyro_sgmc.theory.linear import (
    GradientNoise,
    LinearChain,
    MixingTime,
    WorstAutocorrelation,
    autocorrelation_times,
    continuous_lyapunov,
    discrete_lyapunov,
    gradient_noise,
    hessian_spread,
    iterate_average_covariance,
    iterate_average_covariance_limit,
    linear_chain,
    mixing_time,
    stationary,
    stationary_covariance,
    worst_autocorrelation_time,
)
from numpyro_sgmc.theory.sghmc import SGHMCPrediction, sghmc_prediction, sghmc_recursion
from numpyro_sgmc.theory.table1 import (
    ROWS,
    TABLE_1,
    TARGETS,
    InfeasibleTuning,
    Row,
    Tuning,
    preconditioner,
    rows_reaching,
    target_covariance,
    target_weights,
    tune,
)

__all__ = [
    "GradientNoise",
    "InfeasibleTuning",
    "LinearChain",
    "MixingTime",
    "ROWS",
    "Row",
    "SGHMCPrediction",
    "TABLE_1",
    "TARGETS",
    "Tuning",
    "WorstAutocorrelation",
    "autocorrelation_times",
    "continuous_lyapunov",
    "discrete_lyapunov",
    "gradient_noise",
    "hessian_spread",
    "iterate_average_covariance",
    "iterate_average_covariance_limit",
    "linear_chain",
    "mixing_time",
    "preconditioner",
    "rows_reaching",
    "sghmc_prediction",
    "sghmc_recursion",
    "stationary",
    "stationary_covariance",
    "target_covariance",
    "target_weights",
    "tune",
    "worst_autocorrelation_time",
]
