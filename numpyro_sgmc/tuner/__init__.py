"""The autotuner and its check (``docs/architecture.md``, ``docs/theory.md`` §4).

Owns the pipeline of :func:`~numpyro_sgmc.tuner.tuning.autotune`: the warm start
(:mod:`~numpyro_sgmc.tuner.warmstart`), the information matrices ``J`` and ``I`` from per-row
sums (:mod:`~numpyro_sgmc.tuner.fisher`, :mod:`~numpyro_sgmc.tuner.rowsums`), the Newton polish
and the prediction's own error (:mod:`~numpyro_sgmc.tuner.laplace`), the report
(:mod:`~numpyro_sgmc.tuner.report`) and :func:`~numpyro_sgmc.tuner.check.check_run`. It may
import :mod:`numpyro_sgmc.data`, :mod:`numpyro_sgmc.kernels` (their public names),
:mod:`numpyro_sgmc.theory` and the foundations; the row choice of Table 1 is the theory's, the
tuner only evaluates it.
"""
