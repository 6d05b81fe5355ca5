"""Running a kernel at scale (``docs/architecture.md``).

Owns :func:`~numpyro_sgmc.running.runner.run_kernel` (compiled chunks of steps, resume and
checkpoints) and :mod:`~numpyro_sgmc.running.distributed` (``jax.distributed`` across hosts). It
may import :mod:`numpyro_sgmc.data`, the kernels' public contract (:mod:`numpyro_sgmc.kernels`)
and the foundations (:mod:`numpyro_sgmc.scales`, :mod:`numpyro_sgmc.diagnostics`,
:mod:`numpyro_sgmc.host`, :mod:`numpyro_sgmc.compilation`); the tuner
and the theory are not its business.
"""
