"""Figures of a calibration (matplotlib, imported when a plot is first drawn).

:func:`plot_coverage` shows each method's coverage minus the nominal level with two binomial
standard errors over the band in which a calibrated method's coverage falls 95% of the time;
:func:`plot_ranks` the histograms of a method's ranks with their 99% binomial band (SBC,
Talts et al. 2018); :func:`plot_widths` the mean interval widths, absolute or relative to a
method's.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from numpyro_sgmc.calibration.coverage import Calibration, _index

__all__ = ["plot_coverage", "plot_ranks", "plot_widths"]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "The calibration plots need matplotlib: pip install matplotlib (or the package's "
            "'examples' extra: pip install 'numpyro-sgmc[examples]')."
        ) from error
    return plt


def _methods(calibration: Calibration, methods) -> list:
    methods = calibration.methods if methods is None else tuple(methods)
    return [_index(calibration, m) for m in methods]


def plot_coverage(calibration: Calibration, methods=None, ncols: int = 4, title=None):
    """Coverage against nominal, one panel per parameter: for each nominal level, each
    method's coverage minus the nominal level in percentage points, with error bars of two
    binomial standard errors, over a grey band ``± 2 sqrt(l(1 - l)/R)`` in which a calibrated
    method's coverage falls 95% of the time. Targets are dots, references squares.

    :param calibration: a :class:`Calibration`.
    :param methods: the methods to show (default all).
    :param int ncols: panels per row.
    :param str title: the figure's title.
    :return: the matplotlib ``Figure``.
    """
    plt = _pyplot()
    index = _methods(calibration, methods)
    d = len(calibration.names)
    ncols = min(ncols, d)
    nrows = math.ceil(d / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.0 * ncols, 2.9 * nrows + 0.5), squeeze=False, sharey=True
    )
    levels = np.asarray(calibration.levels)
    R = np.max(calibration.num_valid[index])
    band = 200 * np.sqrt(levels * (1 - levels) / max(R, 1))
    x = np.arange(len(levels))
    offsets = np.linspace(-0.33, 0.33, len(index)) if len(index) > 1 else [0.0]
    for i, ax in enumerate(axes.flat):
        if i >= d:
            ax.set_visible(False)
            continue
        ax.bar(x, 2 * band, bottom=-band, width=0.84, color="0.88", label="±2 se at nominal")
        ax.axhline(0.0, color="0.4", lw=0.8)
        for k, m in enumerate(index):
            target = any(calibration.rows[m])
            ax.errorbar(
                x + offsets[k],
                100 * (calibration.coverage[m, :, i] - levels),
                yerr=200 * calibration.coverage_se[m, :, i],
                fmt="o" if target else "s",
                mfc=None if target else "white",
                ms=4,
                capsize=2,
                color=f"C{k % 10}",
                label=calibration.methods[m],
            )
        ax.set_title(calibration.names[i], fontsize=10)
        ax.set_xticks(x, [f"{100 * lv:g}%" for lv in levels])
        ax.set_xlabel("nominal level")
        if i % ncols == 0:
            ax.set_ylabel("coverage − nominal (points)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    rows = math.ceil(len(labels) / 5)
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 * rows / nrows + 0.02, 1, 1))
    return fig


def plot_ranks(calibration: Calibration, method: str = "posterior", bins: int = 10, ncols=4):
    """Histograms of ``method``'s ranks, one panel per parameter, with the expected count
    ``R/bins`` and its 99% binomial band (SBC, Talts et al. 2018); the chi-square p-value of
    :meth:`Calibration.sbc` in each title.

    :param calibration: a :class:`Calibration`.
    :param str method: the method whose ranks to show.
    :param int bins: bins of the ranks (must divide ``num_ranks``).
    :param int ncols: panels per row.
    :return: the matplotlib ``Figure``.
    """
    plt = _pyplot()
    test = calibration.sbc(method, bins)
    d = len(test.names)
    ncols = min(ncols, d)
    nrows = math.ceil(d / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.8 * nrows), squeeze=False)
    R = test.num_replicates
    lo, hi = stats.binom.ppf([0.005, 0.995], R, 1 / bins)
    for i, ax in enumerate(axes.flat):
        if i >= d:
            ax.set_visible(False)
            continue
        ax.axhspan(lo, hi, color="0.85")
        ax.axhline(R / bins, color="0.4", lw=0.8)
        ax.bar(np.arange(bins), test.counts[i], width=0.9, color="C0")
        ax.set_title(f"{test.names[i]}  (p = {test.p_value[i]:.2f})", fontsize=10)
        ax.set_xticks([])
        ax.set_xlabel(f"rank bin ({calibration.num_ranks} ranks)")
    fig.suptitle(f"{method}: ranks of the true value, R = {R}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_widths(calibration: Calibration, level: float = 0.95, methods=None, relative_to=None):
    """Mean interval width at ``level`` per parameter and method (bars with two standard
    errors), absolute or divided by method ``relative_to``'s.

    :param calibration: a :class:`Calibration`.
    :param float level: one of the calibration's levels.
    :param methods: the methods to show (default all).
    :param str relative_to: a method to divide by (default: absolute widths).
    :return: the matplotlib ``Figure``.
    """
    plt = _pyplot()
    index = _methods(calibration, methods)
    k = calibration.levels.index(level)
    width, se = calibration.width[:, k], calibration.width_se[:, k]
    ylabel = f"mean {100 * level:g}% interval width"
    if relative_to is not None:
        base = width[_index(calibration, relative_to)]
        width, se = width / base, se / base
        ylabel += f" / {relative_to}'s"
    d = len(calibration.names)
    fig, ax = plt.subplots(figsize=(min(12.0, 2.0 + 0.3 * d * len(index)), 3.2))
    step = 0.8 / len(index)
    for j, m in enumerate(index):
        ax.bar(
            np.arange(d) + (j - (len(index) - 1) / 2) * step,
            width[m],
            width=step,
            yerr=2 * se[m],
            capsize=2,
            label=calibration.methods[m],
        )
    if relative_to is not None:
        ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xticks(np.arange(d))
    ax.set_xticklabels(calibration.names)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
