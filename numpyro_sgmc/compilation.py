"""How hard XLA optimises a program: by how long the program will run.

On CPU, XLA spends most of a first call's compile time optimising, and the library's setup is
made of programs that run once for a fraction of a second (a start on the first rows, the
tuner's row sums, probes and profiles on a few thousand rows, full-data passes on small data).
For those, ``xla_backend_optimization_level=0`` is the better trade. Measured on 2 cores
(logistic regression, d = 10): compiling the first ``autotune`` + ``run_kernel`` programs took
8.7 s at the default level and 5.3 s at level 0, while running them took 1.6-2.7x longer
(a second ``autotune`` call at n = 10⁶, all compiled: 1.4 s against 3.7 s). XLA's older
elemental emitters (``xla_cpu_use_fusion_emitters=False``) halve the compile time of those
programs again (1.6 s to 0.8 s in all, n = 10⁵, d = 10) and run them as fast, except the
passes over every row, which run about 30% slower with them (d = 200) and keep the fusion
emitters (``fused=True``). On the sampling loop they save 0.1-0.15 s of compilation and run
7% slower (hierarchical and two-plate models): it keeps XLA's defaults.

:func:`one_shot_jit` compiles a function both ways and chooses per call: the quick compile
on the CPU backend where the program touches at most :data:`QUICK_ROWS` rows (its ``rows``
function of the call's arguments; always, without one), the default elsewhere and inside
another trace (a nested ``jax.jit`` takes no compiler options). Long-running
programs (the sampling loop, the warm start's Adam loop) are plain ``jax.jit`` functions; the
control-variate noise's probes, ``O(rows · probes · d)`` work, are quick only while that work
is small (a logistic regression's 16 probes, not a hierarchy's 64).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import jax

__all__ = ["QUICK_FUSED_OPTIONS", "QUICK_OPTIONS", "QUICK_ROWS", "one_shot_jit"]

QUICK_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
"""The XLA options of a quick compilation."""

QUICK_FUSED_OPTIONS = {"xla_backend_optimization_level": 0}
"""The XLA options of a quick compilation of a program heavy in reductions over rows."""

QUICK_ROWS = 2**18
"""Rows up to which a program's run stays shorter than the compile time level 0 saves."""


class _OneShot:
    """A ``jax.jit`` function compiled quickly or fully per call (:func:`one_shot_jit`)."""

    def __init__(
        self, fun: Callable, static_argnames: tuple, rows: Optional[Callable], fused: bool
    ):
        functools.update_wrapper(self, fun)
        self._signature = inspect.signature(fun)
        self._rows = rows
        options = QUICK_FUSED_OPTIONS if fused else QUICK_OPTIONS
        self._quick = jax.jit(fun, static_argnames=static_argnames, compiler_options=options)
        self._full = jax.jit(fun, static_argnames=static_argnames)

    def _chosen(self, args, kwargs):
        if jax.default_backend() != "cpu" or _traced(args, kwargs):
            return self._full  # compiler options are for top-level jits only
        if self._rows is None:
            return self._quick
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return self._quick if self._rows(**bound.arguments) <= QUICK_ROWS else self._full

    def __call__(self, *args, **kwargs):
        return self._chosen(args, kwargs)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._chosen(args, kwargs).lower(*args, **kwargs)


def _traced(args, kwargs) -> bool:
    """Whether the call is inside another trace (a ``pmap`` or ``jit`` over chains)."""
    return any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((args, kwargs)))


def one_shot_jit(
    static_argnames: tuple = (), rows: Optional[Callable] = None, fused: bool = False
) -> Callable:
    """Decorator: ``jax.jit`` with ``static_argnames``, compiled with :data:`QUICK_OPTIONS`
    (:data:`QUICK_FUSED_OPTIONS` where ``fused``) on CPU when ``rows(**arguments)`` (the rows
    the call's program runs over; ``None``: a bounded few) is at most :data:`QUICK_ROWS`, with
    XLA's default options otherwise."""

    def wrap(fun: Callable) -> _OneShot:
        return _OneShot(fun, tuple(static_argnames), rows, fused)

    return wrap
