"""The calibration as text: the coverage table and the list of failures.

:func:`table` lays out, per nominal level, method and parameter, the coverage with its
binomial standard error, the Table 1 prediction in brackets and the mean width, then the
Table 1 row(s) the tuner chose, the median seconds per replicate and, with ``check=True``,
how often :func:`~numpyro_sgmc.check_run` passed; :func:`summary` (``str`` of a
:class:`~numpyro_sgmc.calibration.coverage.Calibration`) adds the replicates that failed or
warned.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

__all__ = ["summary", "table"]


def table(calibration, level: Optional[float] = None) -> str:
    """The coverage table of a :class:`~numpyro_sgmc.calibration.coverage.Calibration`: per
    method and parameter, coverage ± binomial se, the Table 1 prediction in brackets and the
    mean width, at ``level`` (default every level)."""
    c = calibration
    levels = c.levels if level is None else (level,)
    coverage, se, pred, width = c.coverage, c.coverage_se, c.predicted_coverage, c.width
    label = max(len(m) for m in c.methods)
    lines = []
    for lv in levels:
        k = c.levels.index(lv)
        lines.append(
            f"{100 * lv:g}% intervals: coverage ± binomial se [Table 1 prediction] mean width"
        )
        lines.append(
            " " * (label + 7) + "".join(f"{n:<30}" for n in c.names) + "   row, median s/replicate"
        )
        for m, method in enumerate(c.methods):
            cells = []
            for i in range(len(c.names)):
                p = pred[m, k, i]
                shown = f"[{p:.3f}]" if np.isfinite(p) else " " * 7
                cells.append(
                    f"{coverage[m, k, i]:.3f}±{se[m, k, i]:.3f} {shown} {width[m, k, i]:<9.4g}"
                )
            passed = c.check_passed[m]
            lines.append(
                f"{method:<{label}} R={c.num_valid[m]:<4d}"
                + "".join(f"{cell:<30}" for cell in cells)
                + f"   {_rows(c.rows[m])}, {_median(c.seconds[m]):.2f}"
                + (f", check_run passed {100 * passed:.0f}%" if np.isfinite(passed) else "")
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def summary(calibration) -> str:
    """:func:`table` at every level, then the first ten failures and warnings of each kind."""
    lines = [table(calibration)]
    for kind, found in (("failed", calibration.failures), ("warned", calibration.warnings)):
        if found:
            lines.append(f"{len(found)} replicate runs {kind}:")
            lines.extend(f"  {f.method}, seed {f.seed}: {f.message}" for f in found[:10])
            if len(found) > 10:
                lines.append(f"  ... and {len(found) - 10} more")
    return "\n".join(lines)


def _rows(rows) -> str:
    names, counts = np.unique([r for r in rows if r], return_counts=True)
    if not len(names):
        return "-"
    return ", ".join(
        f"{n}" if len(names) == 1 else f"{n}×{c}" for n, c in zip(names, counts, strict=True)
    )


def _median(x) -> float:
    x = np.asarray(x)[np.isfinite(x)]
    return float(np.median(x)) if len(x) else math.nan
