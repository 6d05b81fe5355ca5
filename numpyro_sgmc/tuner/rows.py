"""The rows the tuner reads: batch sizes, row samplers, row budgets and host random streams.

Every part of the tuner that visits data rows or draws probes takes them from here:

* **batch sizes** (:func:`batch_sizes`, :func:`halvings`): a plate -> ``b_p`` dict from the
  user's ``batch_size`` option, and the halvings the rows try;
* **row samplers** (:func:`choose_rows`, :func:`sample_rows`): a uniform subsample without
  replacement, split over the plates in proportion to their sizes (the information rows), or
  rows with replacement (:func:`~numpyro_sgmc.kernels.curvature.random_rows`);
* **row budgets**: how many rows and probes each part uses by default (the constants below);
* **random streams** (:class:`Stream`): each part draws its rows and probes on the host from its
  own named stream of a key, so that no two parts share draws.

The host generators are :func:`~numpyro_sgmc.host.host_rng`'s (the kernels' step
checks use the same helper on their own keys).
"""

from __future__ import annotations

from enum import Enum, unique

import numpy as np

from numpyro_sgmc.data.model import num_data
from numpyro_sgmc.data.subsample import Batch
from numpyro_sgmc.host import host_rng
from numpyro_sgmc.kernels.curvature import random_rows

__all__ = [
    "CONTROL_VARIATE_ROWS",
    "CORRELATION_ROWS",
    "CORRELATION_ROWS_PER_PARAMETER",
    "CURVATURE_CHECK_DIRECTIONS",
    "CURVATURE_CHECK_WORK",
    "EVERY_ROW_WORK",
    "EXACT_DIAGONAL_PROBES",
    "HEAVY_ROW_SHARE",
    "INFORMATION_ROWS",
    "LINEARITY_ROWS",
    "LINEARITY_WORK",
    "MAX_PROBES",
    "NEWTON_ROWS",
    "NEWTON_ROWS_PER_PARAMETER",
    "PROBES",
    "WARM_START_CHECK_ROWS",
    "WARM_START_ROWS",
    "WARM_START_BLOCKS",
    "WARM_START_RUNS_SHARE",
    "WARM_START_SAMPLE_ROWS",
    "Stream",
    "batch_sizes",
    "choose_rows",
    "chosen_indices",
    "halvings",
    "rows_per_plate",
    "sample_rows",
]

INFORMATION_ROWS = 10_000
"""Rows for ``J`` and ``I`` to start with (``autotune(num_rows=...)``); the fit doubles them
until the prediction's own error is under its tolerance."""

CONTROL_VARIATE_ROWS = 2_000
"""The fewest rows the control-variate noise is estimated from (more when ``J`` used more: a
few thousand rows miss the rare rows of large curvature that dominate that noise)."""

LINEARITY_ROWS = 4_000
"""Rows of the check that the log posterior is close to its quadratic
(:func:`~numpyro_sgmc.tuner.laplace.linearity`), sampled where the information did not use
every row or every row would cost more than :data:`LINEARITY_WORK`."""

LINEARITY_WORK = 2**21
"""The most row evaluations (a row's Hessian-vector product counting one) for which the
linearity check uses every row where the information did: a one-hot level of 4 rows, all of
one class, was missing from 4,000 sampled rows of 30,000, and its skewed coefficient's profile
was the prior's exact quadratic (a stated error of 0 on an sd 0.81 of the exact one)."""

HEAVY_ROW_SHARE = 0.01
"""Where the information used every row and the linearity check samples, every row carrying at
least this share of the data's curvature along a probed direction joins the sample at weight
1 (a category of up to 100 rows; 2 rows of 100,000 were otherwise absent and their
coefficient's prediction stated ±0.0%)."""

CURVATURE_CHECK_DIRECTIONS = 8
"""Directions along which the data's curvature over every row is compared with a sampled
``J``'s (:func:`~numpyro_sgmc.tuner.laplace.sample_misses`): the coordinates whose sampled
data curvature is least against the prior's (a hierarchy's data-free parameters among them).
A one-hot level of 2 rows in 200,000 was absent from the 10,000 rows of ``J``, and its
coefficient's predicted sd was the prior's 10 against an exact 5.9, stated ±0.0%."""

CURVATURE_CHECK_WORK = 2**26
"""The most row evaluations (a row's Hessian-vector product counting one) of that check:
``n`` times its directions, about 8·10⁶ rows of 8 directions."""

EVERY_ROW_WORK = 2**26
"""The most row evaluations (``n`` times ``d``, or the probes of a diagonal ``J``) for which
``J`` and ``I`` are estimated again on every row where the check finds their sample missed
rows; above it the error stated for the parameters along the missed directions is what the
check measured."""

CORRELATION_ROWS = 10_000
"""The budget of rows of :func:`~numpyro_sgmc.tuner.laplace.correlations`' solves (or
:data:`CORRELATION_ROWS_PER_PARAMETER` ``d``, the larger): the information's own rows up to
twice it, a sample of it above, extrapolated to every row."""

CORRELATION_ROWS_PER_PARAMETER = 8
"""Rows per parameter of :func:`~numpyro_sgmc.tuner.laplace.correlations`' budget: its
extrapolation to every row is from halves of ``4d`` rows or more, whose Hessians are well
away from singular (a Wishart's inverse grows as ``m/(m - d - 1)``; from halves of ``2d``
rows the extrapolation was 3% high at the median, from ``4d`` 1%)."""

NEWTON_ROWS = 20_000
"""Up to this many rows, the Hessian behind a diagonal ``J``'s Newton direction is every
row's; above, that of a sample of :data:`NEWTON_ROWS` or more."""

NEWTON_ROWS_PER_PARAMETER = 32
"""Rows per parameter of the sample behind a diagonal ``J``'s Newton direction at least: the
inverse of a Hessian from ``m`` rows stretches some directions by up to ``(1 - √(d/m))⁻²``,
1.5 at ``m = 32d``, which the line search's first halving absorbs."""

WARM_START_ROWS = 1_024
"""Rows of the empirical Fisher diagonal that sets the warm start's parameter scales."""

WARM_START_BLOCKS = 64
"""Runs of consecutive rows the warm start's sample is made of with
``batch_sampling="blocks"`` (:func:`choose_rows`)."""

WARM_START_RUNS_SHARE = 1 / 32
"""The share of the rows the warm start's sample takes when it is runs of rows (with
``batch_sampling="blocks"``, cheap to read), if more than :data:`WARM_START_SAMPLE_ROWS`."""

WARM_START_SAMPLE_ROWS = 2**20
"""Above this many rows, autotune's warm start optimises on a uniform sample of this many:
each of its epochs then costs ``2²⁰/n`` of a pass over the data (at ``n = 10⁹``, a pass over
disk), and the Newton steps that follow, on every row, move its mode the ``√(n/m)``
posterior sds to the full data's."""

WARM_START_CHECK_ROWS = 2_048
"""Rows of the ``J`` per restart with which ``warm_start(check=True)`` measures how far each
mode is from a zero of the gradient."""

PROBES = 64
"""Probes of every stochastic estimate: Hutchinson's diagonal of ``J`` (to start with), the
correlations a diagonal ``J`` leaves out, the control-variate noise above this many
parameters, the warm start's prior curvature."""

MAX_PROBES = 1_024
"""The most Hutchinson probes the fit takes for a diagonal ``J`` (fourfold steps from
:data:`PROBES` while their own error is over 10%) above :data:`EXACT_DIAGONAL_PROBES`."""

EXACT_DIAGONAL_PROBES = 8_192
"""The most Hadamard probes of an exact diagonal ``J`` (``2^⌈log₂ d⌉``,
:func:`~numpyro_sgmc.tuner.fisher.exact_probes`), which every estimate of ``J`` takes once
random probes' error is over 10%: on equicorrelated covariates (``ρ = 0.5``, ``d = 1500``)
random probes left some diagonal entries near zero, the Newton direction's conjugate
gradients, preconditioned by them, stalled, and the tuner stopped 24 sds from the mode."""


@unique
class Stream(Enum):
    """A named host random stream: ``(key, tags)``, the key it is drawn from and the integers
    appended to that key's seed (:meth:`rng`). ``@unique``: no two parts share a stream.

    On the information key (``autotune``'s third split; the check's fresh key):

    * ``INFORMATION_ROWS``: the uniform subsample of ``J`` and ``I``
      (:func:`choose_rows`); the control-variate noise and the correlations of a diagonal
      ``J`` re-draw it on purpose, to use the same rows;
    * ``HUTCHINSON_PROBES``: the Rademacher probes of a diagonal ``J``;
    * ``CONTROL_VARIATE_PROBES``: the ``N(0, Σ)`` probes of the control-variate noise;
    * ``CONTROL_VARIATE_WINDOWS``: which of its rows each of those probes uses;
    * ``CORRELATION_PROBES``: the probes (then the rows, above :data:`CORRELATION_ROWS`) of
      the correlations a diagonal ``J`` leaves out;
    * ``NEWTON_ROWS``: the rows of a diagonal ``J``'s Newton direction;
    * ``LINEARITY_ROWS``: the rows of the linearity check;
    * ``POWER_ITERATION``: the rows and start vector of the tuner's ``λmax(ΓJ)``.

    On the warm-start key: ``WARM_START_ROWS`` (the Fisher diagonal's rows),
    ``WARM_START_PROBES`` (the prior curvature's probes above
    :data:`~numpyro_sgmc.tuner.laplace.DENSE_MAX_DIM` parameters) and ``WARM_START_SAMPLE``
    (the rows the optimizer runs on, above :data:`WARM_START_SAMPLE_ROWS`).
    """

    INFORMATION_ROWS = ("information", ())
    HUTCHINSON_PROBES = ("information", (1,))
    CONTROL_VARIATE_PROBES = ("information", (13,))
    CORRELATION_PROBES = ("information", (11,))
    NEWTON_ROWS = ("information", (12,))
    LINEARITY_ROWS = ("information", (7,))
    POWER_ITERATION = ("information", (14,))
    CONTROL_VARIATE_WINDOWS = ("information", (15,))
    WARM_START_ROWS = ("warm start", ())
    WARM_START_PROBES = ("warm start", (1,))
    WARM_START_SAMPLE = ("warm start", (2,))

    def rng(self, rng_key) -> np.random.Generator:
        """This stream's NumPy generator for ``rng_key`` (reproducible for a key)."""
        return host_rng(rng_key, *self.value[1])


def sample_rows(stream: Stream, rng_key, plates, num_rows: int) -> Batch:
    """About ``num_rows`` uniform rows with replacement from ``stream`` of ``rng_key``
    (:func:`~numpyro_sgmc.kernels.curvature.random_rows`)."""
    return random_rows(stream.rng(rng_key), plates, num_rows)


def rows_per_plate(plates, num_rows: int) -> dict:
    """``m_p`` proportional to ``n_p`` (largest remainders), at least 2 and at most ``n_p``."""
    n = num_data(plates)
    quota = np.array([num_rows * p.size / n for p in plates])
    m = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - m))[: num_rows - int(m.sum())]:
        m[i] += 1
    return {p.name: int(min(max(mk, 2), p.size)) for p, mk in zip(plates, m, strict=True)}


def chosen_indices(plates, chosen: dict) -> dict:
    """Plate name -> the row indices of a :func:`choose_rows` choice, ``np.arange(n_p)`` where
    it chose every row (``None``)."""
    return {p.name: np.arange(p.size) if chosen[p.name] is None else chosen[p.name] for p in plates}


def choose_rows(plates, num_rows, rng_key, stream: "Stream" = None, blocks=None) -> dict:
    """Plate name -> sorted row indices of a uniform subsample of about ``num_rows`` rows
    without replacement (``None``: every row), from ``stream`` (default
    :attr:`Stream.INFORMATION_ROWS`).

    :param int blocks: if set, the sample is that many runs of consecutive rows at random,
        non-overlapping places, for rows in random order (``batch_sampling="blocks"``): from a
        file beyond RAM, ``blocks`` reads instead of a page (or a read-ahead) per row, which
        for a sample of 1% of the rows is a read of most of the file.
    """
    n = num_data(plates)
    if num_rows is None or num_rows >= n:
        return {p.name: None for p in plates}
    if not isinstance(num_rows, (int, np.integer)) or num_rows < 1:
        raise ValueError(f"num_rows must be None or a positive int, got {num_rows!r}")
    gen = (Stream.INFORMATION_ROWS if stream is None else stream).rng(rng_key)
    counts = rows_per_plate(plates, int(num_rows))
    rows = {}
    for p in plates:
        m_p = counts[p.name]
        if m_p == p.size:
            rows[p.name] = None
        elif blocks is not None:
            length = -(-m_p // blocks)  # runs of this length in aligned, distinct slots
            slots = gen.choice(p.size // length, min(blocks, p.size // length), replace=False)
            rows[p.name] = (np.sort(slots)[:, None] * length + np.arange(length)).ravel()
        else:  # Generator.choice without replacement uses a hash set (O(m)) for m << n
            rows[p.name] = np.sort(gen.choice(p.size, m_p, replace=False))
    return rows


def batch_sizes(plates, batch_size) -> dict:
    """Plate name -> ``b_p``: ``None`` for the plates' own batch sizes, an int for every
    plate, or ``{plate: b_p}`` (plates it leaves out keep their own)."""
    out = {}
    for p in plates:
        if batch_size is None:
            b = p.batch_size
        elif isinstance(batch_size, dict):
            unknown = set(batch_size) - {q.name for q in plates}
            if unknown:
                raise ValueError(
                    f"batch_size names plate(s) {sorted(unknown)}; the subsample plates "
                    f"are {sorted(q.name for q in plates)}."
                )
            b = batch_size.get(p.name, p.batch_size)
        else:
            b = batch_size
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
            raise ValueError(f"batch size for plate '{p.name}' must be a positive int, got {b!r}")
        out[p.name] = int(b)
    return out


def halvings(batch: dict, smallest: int):
    """``batch`` (plate -> b), then halved together while every plate stays ``>= smallest``."""
    yield batch
    while all(b // 2 >= smallest for b in batch.values()):
        batch = {k: b // 2 for k, b in batch.items()}
        yield batch
