"""Batched Cholesky, triangular solves and LU on CPU without jaxlib's deadlocking LAPACK path.

jaxlib 0.10.0 to 0.11.1 split a batch of matrices handed to a LAPACK kernel into chunks,
schedule them on XLA's intra-op thread pool and wait for them from a thread of that same
pool. XLA runs a program's independent operations concurrently on that pool, so when every
pool thread is inside such a kernel no thread is left for the chunks, and the program never
finishes, at 0% CPU (the native stacks: ``jax::ParallelBatchMap`` in
``BlockingCounter::Wait`` on every ``tf_XLAEigen`` thread). On 2 cores, two concurrent
triangular solves of a few thousand rows suffice: the tuner's profile of a model with a
``MultivariateNormal`` likelihood (14 points × 9 directions, 4,000 rows) hung every time, and
a vmapped ``jax.jvp`` of its gradient hangs from about 4,000 rows in float64 and 8,000 in
float32. A tuner vmaps the potential over points, directions and chains, exactly that shape.
JAX removed the parallel path from open-source builds in July 2026 ("Don't try to
parallelize LAPACK kernels in opensource builds").

On those releases :func:`avoid_parallel_lapack` lowers a batch of more than one matrix to
XLA's own ``cholesky`` and ``triangular_solve`` operations and JAX's blocked LU, which use no
thread pool, for every program of the process (a user's NUTS on the same model included);
a single matrix keeps LAPACK, whose kernel then runs inline. The results are the same to
float rounding (a non-positive-definite matrix still gives a NaN factor). Batched
eigendecompositions, SVDs and QR have no LAPACK-free lowering on CPU and keep theirs.
"""

from __future__ import annotations

import math
import re
from importlib.metadata import version

from jax.interpreters import mlir
from jax.lax import linalg

__all__ = ["AFFECTED_JAXLIB", "avoid_parallel_lapack", "lapack_waits_on_its_pool"]

AFFECTED_JAXLIB = ((0, 10, 0), (0, 11, 2))
"""The jaxlib releases ``[first, end)`` whose LAPACK kernels wait on the pool they run in: the
parallel path came with 0.10.0 and 0.11.0 still has it; releases from 0.11.2, built after its
removal, are taken as fixed."""

_PRIMITIVES = (linalg.cholesky_p, linalg.triangular_solve_p, linalg.lu_p)
_lowered = set()  # the primitives whose CPU rule is already ours


def lapack_waits_on_its_pool(jaxlib_version: str) -> bool:
    """Whether a jaxlib release is in :data:`AFFECTED_JAXLIB` (``"0.10.2"``: yes)."""
    release = tuple(int(number) for number in re.findall(r"\d+", jaxlib_version)[:3])
    first, end = AFFECTED_JAXLIB
    return first <= release < end


def _one_matrix_or_xla(lapack, xla):
    """A CPU lowering rule: LAPACK where every operand is one matrix, XLA's otherwise."""

    def rule(ctx, *operands, **params):
        one = all(math.prod(aval.shape[:-2]) <= 1 for aval in ctx.avals_in)
        return (lapack if one else xla)(ctx, *operands, **params)

    return rule


def avoid_parallel_lapack() -> bool:
    """Lower batched Cholesky, triangular solves and LU on CPU through XLA's own operations
    when the installed jaxlib is in :data:`AFFECTED_JAXLIB` (once; the library's import
    does it). Returns whether it did."""
    if not lapack_waits_on_its_pool(version("jaxlib")):
        return False
    cpu = mlir._platform_specific_lowerings["cpu"]
    for primitive in _PRIMITIVES:
        lapack, xla = cpu.get(primitive), mlir._lowerings.get(primitive)
        if lapack is None or xla is None or primitive in _lowered:
            continue
        mlir.register_lowering(primitive, _one_matrix_or_xla(lapack.rule, xla.rule), "cpu")
        _lowered.add(primitive)
    return True
