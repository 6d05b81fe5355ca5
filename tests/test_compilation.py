"""A second ``autotune`` and ``run_kernel`` call on new data of the same shapes compiles none
of the library's functions (issue: the fixed costs at the sizes users have).

Every compiled piece is a module-level ``jax.jit`` function of array arguments whose static
arguments (the model, the shapes, row counts) repeat on new data; a row count chosen from the
data's own estimates grows by doublings of the starting count, so that it repeats too. What is
counted is XLA's "Finished XLA compilation" log lines under ``jax.log_compiles``, by function
name; small eager array operations (a ``broadcast_in_dim`` on a new shape) may still compile.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import re
import traceback

import jax
import pytest
from user_models import hierarchical_logistic, logistic, make_hierarchical, make_wide_logistic

import numpyro_sgmc
from numpyro_sgmc import autotune, run_kernel


def library_jit_names() -> set:
    """The names of every ``jax.jit`` function defined at module level in the package."""
    names = set()
    for info in pkgutil.walk_packages(numpyro_sgmc.__path__, "numpyro_sgmc."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            wrapped = getattr(value, "__wrapped__", None)
            if callable(value) and wrapped is not None and hasattr(value, "lower"):
                names.add(getattr(wrapped, "__name__", name))
    return names


class Compilations(logging.Handler):
    """Each compilation's name and whether NumPyro's eager first trace of the model
    (``data.first_trace.first_trace``) was on the stack when it compiled."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.found = []

    def emit(self, record):
        found = re.search(r"Finished XLA compilation of jit\((\S+?)\)", record.getMessage())
        if found:
            stack = traceback.extract_stack()
            in_trace = any(f.name == "first_trace" and "first_trace" in f.filename for f in stack)
            self.found.append((found.group(1), in_trace))


def compiled_sites(call) -> list:
    """``(name, in the first trace)`` of every XLA compilation while ``call()`` runs."""
    handler = Compilations()
    loggers = [logging.getLogger(name) for name in ("jax._src.interpreters.pxla", "jax")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            call()
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
    return handler.found


def compiled_names(call) -> list:
    return [name for name, _ in compiled_sites(call)]


def recipe(model, data, **options):
    args, kwargs = data
    kernel, _ = autotune(model, jax.random.key(0), *args, model_kwargs=kwargs, **options)
    run = run_kernel(kernel, jax.random.key(1), *args, num_samples=50, model_kwargs=kwargs)
    jax.block_until_ready(run.samples)


@pytest.mark.parametrize(
    "model, make, options",
    [
        (logistic, lambda seed: make_wide_logistic(seed, 10_000, 10), {}),
        # Adam first (the warm start's loop): a start-point fit would not compile it
        (logistic, lambda seed: make_wide_logistic(seed, 10_000, 11), {"warm_start_epochs": 5}),
        pytest.param(
            hierarchical_logistic,
            lambda seed: make_hierarchical(seed, n=20_000, num_groups=20),
            {},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["logistic", "logistic-adam", "hierarchical"],
)
def test_a_second_call_on_new_data_compiles_nothing_of_ours(model, make, options):
    ours = library_jit_names()
    assert {"_optimise", "_sums", "_spread", "_chunk"} <= ours, sorted(ours)
    first = compiled_names(lambda: recipe(model, make(0), **options))
    assert {"_sums", "_chunk"} <= set(first), first  # the counter sees them
    assert ("_optimise" in first) == ("warm_start_epochs" in options), first
    again = compiled_names(lambda: recipe(model, make(1), **options))
    assert not set(again) & ours, again


def test_a_first_call_compiles_only_our_programs_and_the_models_first_trace():
    """No tiny eager programs of the library's own (key splits, slices, conversions, probes)
    in a first autotune + run_kernel: every compilation is one of the package's module-level
    ``jax.jit`` functions, or an operation of NumPyro's eager first trace of the model.
    Shapes no other test uses (d = 7, n = 40,001), so that nothing was compiled before; the
    covariates (1.1 MB) large enough to be put on the device, whose data check then reads
    their host copy instead of compiling a reduction."""
    (args, kwargs) = make_wide_logistic(3, 40_001, 7)
    key_tune, key_run = jax.random.key(0), jax.random.key(1)

    def first_call():
        kernel, _ = autotune(logistic, key_tune, *args, model_kwargs=kwargs)
        run = run_kernel(kernel, key_run, *args, num_samples=20, model_kwargs=kwargs)
        jax.block_until_ready(run.samples)

    found = compiled_sites(first_call)
    ours = library_jit_names()
    assert {"_sums", "_chunk"} <= {name for name, _ in found}
    stray = sorted({name for name, in_trace in found if name not in ours and not in_trace})
    assert not stray, stray
    # each program once (run_kernel starts from the tuner's mode: no second start search; the
    # constrained mode and its Jacobian are the start's program, the starting draws the
    # chains' init), at most ten in all (issue 24): Newton steps from the start compile no
    # optimizer loop and no Fisher diagonal for its scales
    names = [name for name, _ in found]
    assert "_optimise" not in names and "fisher_diagonal" not in names, names
    assert len(names) == len(set(names)) and len(names) <= 10, names
