"""``check_run`` calibrated both ways: how often it fails right runs, and passes wrong ones.

**Right runs.** Every model of ``tests/user_models.py`` (``MODELS``: a hierarchy with a group
scale, over-dispersed counts on raw covariates for the posterior and the sandwich, a
negative binomial on raw covariates, two plates, logistic regression with d = 120 independent
and correlated covariates, a covariate 10⁴ times the others', a 650-parameter softmax) through
the plain recipe: ``autotune`` → ``MCMC`` with two vectorised chains of
``report.draws_for(1000)`` draws after 10 warm-up draws → ``check_run``, one run per seed
(data, tuning and run keys all from the seed). A right run should be ``PASSED``; ``FAILED``
is a false alarm, ``CANNOT CHECK`` a check that says it has no reference to 20%.

**Wrong runs**, each a mistake a user can make, on the same models and seeds:

* ``step4``: the tuned kernel with its step multiplied by 4 after tuning (``h·λmax(ΓJ) = 4``,
  where the linearised chain stops contracting), run and checked against the report;
* ``other_data``: the kernel and report of one data set run on another of the same shapes
  (the model's data at seed ``s + 1000``);
* ``cold_start``: no warm-up, the two chains started 20 predicted sds either side of the mode
  (every unconstrained coordinate), a tenth of the draws;
* ``few_rows``: ``autotune(num_rows=100)``, a prediction starting from 100 rows (the tuner
  adds rows while its own error asks for them). Its runs are right when the stated error
  covers the prediction's miss; the table gives how often the miss against the default
  tuning's prediction (``|ratio - 1|`` over every parameter) is outside three of the two
  predictions' combined stated errors plus 2%, and how many of those passed;
* ``thin_class``: a softmax with a class seen on 30 of 5,000 rows and never at night
  (``tests/user_models.py::thin_class``), whose night coefficient the prior holds on one side
  and the data on the other, run at the step tuned at the mode: one sd into the data's side
  the curvature is 45 times the mode's, and the chain is thrown far across the prior's side
  (``autotune`` itself shortens its step by that growth; at the mode's step the sd was 30-76
  times NUTS's).

A wrong run is caught when ``check_run`` does not pass it (``FAILED`` or ``CANNOT CHECK``);
``few_rows`` is wrong only when its miss is outside its stated error. Rates with binomial
standard errors.

    python benchmarks/check_calibration.py                         # 9 models x 5 seeds, all kinds
    python benchmarks/check_calibration.py --models hierarchical --seeds 0 --kinds right step4
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import warnings

import jax
import numpy as np
from numpyro.infer import MCMC

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from user_models import MODELS, softmax_with_reference, thin_class  # noqa: E402

from numpyro_sgmc import autotune, check_run  # noqa: E402
from numpyro_sgmc.kernels.shell import SGMCKernel  # noqa: E402

KINDS = ("right", "step4", "other_data", "cold_start", "few_rows", "thin_class")
FEW_ROWS = 100
COLD_SDS = 20.0


def with_step(kernel, factor: float):
    """A copy of ``kernel`` (not yet run) whose step is ``factor`` times its own: a kernel
    changed after tuning."""
    recipe = kernel.recipe
    dynamics = recipe.dynamics._replace(step_size=factor * recipe.dynamics.step_size)
    new = copy.copy(kernel)
    SGMCKernel.__init__(new, kernel.subsampled_model, recipe._replace(dynamics=dynamics))
    return new


def sample(kernel, key, args, kwargs, num_samples, num_warmup=10, init_params=None):
    mcmc = MCMC(
        kernel,
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=2,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(key, *args, init_params=init_params, **kwargs)
    return mcmc


def status(mcmc, report) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_run(mcmc, report, print_table=False).status


def tuned(model, seed, args, kwargs, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotune(model, jax.random.key(seed), *args, model_kwargs=kwargs, **options)


def cold_start(report):
    """Two chains' unconstrained starts, ``COLD_SDS`` predicted sds either side of the mode."""
    mode = np.asarray(report.layout.ravel(report.mode), np.float64)
    offset = COLD_SDS * np.asarray(report.predicted_sd, np.float64)
    starts = np.stack([mode - offset, mode + offset]).astype(np.float32)
    return report.layout.unravel(starts)


def runs_of(name, seed, kinds):
    """``(kind, status, covered)`` for each kind on model ``name`` at ``seed``; every run gets
    its own copy of the tuned kernel (``with_step``), not yet run. ``covered``: for
    ``few_rows``, whether its stated error covers its miss (else ``None``)."""
    case = MODELS[name]
    args, kwargs = case.make(seed)
    key = jax.random.key(seed + 100)
    kernel, report = tuned(case.model, seed, args, kwargs, target=case.target)
    draws = report.draws_for(1000)
    out = []
    if "right" in kinds:
        out.append(("right", status(sample(with_step(kernel, 1.0), key, args, kwargs, draws),
                                    report), None))  # fmt: skip
    if "step4" in kinds:
        mcmc = sample(with_step(kernel, 4.0), key, args, kwargs, draws)
        out.append(("step4", status(mcmc, report), None))
    if "other_data" in kinds:
        other_args, other_kwargs = case.make(seed + 1000)
        mcmc = sample(with_step(kernel, 1.0), key, other_args, other_kwargs, draws)
        out.append(("other_data", status(mcmc, report), None))
    if "cold_start" in kinds:
        start = cold_start(report)
        mcmc = sample(with_step(kernel, 1.0), key, args, kwargs, max(40, draws // 10), 0, start)
        out.append(("cold_start", status(mcmc, report), None))
    if "few_rows" in kinds:
        few_kernel, few = tuned(
            case.model, seed, args, kwargs, target=case.target, num_rows=FEW_ROWS
        )
        mcmc = sample(few_kernel, key, args, kwargs, few.draws_for(1000))
        miss = np.abs(np.asarray(few.predicted_sd) / np.asarray(report.predicted_sd) - 1)
        # both predictions have an error (the few rows' may have grown to every row)
        error = np.hypot(np.asarray(few.prediction_error), np.asarray(report.prediction_error))
        covered = bool(np.all(miss <= 3 * error + 0.02))
        out.append(("few_rows", status(mcmc, few), covered))
    return out


def thin_class_run(seed):
    X, y = thin_class(seed)
    kernel, report = tuned(softmax_with_reference, seed, (X, y), {})
    growth = max(f.curvature_growth for f in report.nonlinearity)
    at_the_mode = with_step(kernel, max(1.0, growth / 2))  # autotune's shortening undone
    mcmc = sample(at_the_mode, jax.random.key(seed + 100), (X, y), {}, report.draws_for(1000))
    return [("thin_class", status(mcmc, report), None)]


def rate(k: int, n: int) -> str:
    """``k/n`` as a percentage with its binomial standard error (at least ``1/n``'s)."""
    if n == 0:
        return "-"
    p = k / n
    return f"{100 * p:.0f}% ± {100 * math.sqrt(max(p * (1 - p), 1 / n) / n):.0f}% ({k}/{n})"


def summary(rows) -> str:
    """The table of rates by kind: right runs' false alarms, wrong runs caught."""
    lines = [
        "| kind | runs | PASSED | FAILED | CANNOT CHECK | the check is wrong |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        statuses = ("PASSED", "FAILED", "CANNOT CHECK")
        count = {s: sum(r["status"] == s for r in sel) for s in statuses}
        if kind == "right":
            wrong = f"false alarms {rate(count['FAILED'], len(sel))}"
        elif kind == "few_rows":
            uncovered = [r for r in sel if not r["covered"]]
            passed = sum(r["status"] == "PASSED" for r in uncovered)
            wrong = (
                f"misses outside the stated error: {len(uncovered)}/{len(sel)}; of them "
                f"passed {rate(passed, len(uncovered))}"
            )
        else:
            wrong = f"passed {rate(count['PASSED'], len(sel))}"
        lines.append(
            f"| {kind} | {len(sel)} | {count['PASSED']} | {count['FAILED']} | "
            f"{count['CANNOT CHECK']} | {wrong} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--save", default=None, help="append each run as a JSON line here")
    parser.add_argument("--load", nargs="*", default=None, help="summarise saved JSON lines")
    options = parser.parse_args()
    if options.load:
        rows = [json.loads(line) for path in options.load for line in open(path)]
        latest = {(r["model"], r["seed"], r["kind"]): r for r in rows}  # a rerun replaces
        print(summary(list(latest.values())))
        return
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores")
    rows = []
    jobs = [(name, seed) for name in options.models for seed in options.seeds]
    model_kinds = [k for k in options.kinds if k != "thin_class"]
    if not model_kinds:
        jobs = []
    if "thin_class" in options.kinds:
        jobs += [("thin_class", seed) for seed in options.seeds]
    for k, (name, seed) in enumerate(jobs):
        if k and name != jobs[k - 1][0]:
            # each MCMC object compiles its own loop, kept while the process lives: without
            # this, ~130 runs exhaust the process's memory maps (LLVM: cannot allocate)
            jax.clear_caches()
        start = time.perf_counter()
        try:
            if name == "thin_class":
                found = thin_class_run(seed)
            else:
                found = runs_of(name, seed, model_kinds)
        except Exception as err:  # a crash is a result too: said, not hidden
            found = [("error", f"{type(err).__name__}: {err}"[:200], None)]
        seconds = time.perf_counter() - start
        for kind, result, covered in found:
            row = dict(model=name, seed=seed, kind=kind, status=result, covered=covered)
            rows.append(row)
            print(f"{name} seed {seed} {kind}: {result}"
                  + ("" if covered is None else f" (miss within stated error: {covered})")
                  + f"  [{seconds:.0f} s for the seed]", flush=True)  # fmt: skip
            if options.save:
                with open(options.save, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(summary(rows))


if __name__ == "__main__":
    main()
