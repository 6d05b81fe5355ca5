"""Table 1: every target, the rows that reach it and their tunings (``docs/theory.md`` §4).

The one Table 1 of the library: the autotuner, the predictions and the tests use it.

* A **target** is a covariance ``Q = lim n·Cov``; every named target is a mix
  ``Q = w₁ S + w₂ J⁻¹`` (:func:`target_weights`, :func:`target_covariance`), ``S = J⁻¹IJ⁻¹``.
* A **row** (:data:`TABLE_1`) is an algorithm that reaches some targets: the rows of Negrea,
  Yang, Feng, Roy & Huggins ("Tuning stochastic gradient algorithms for statistical inference
  via large-sample asymptotics") P1–P5, B, F, G, A, and the control-variate rows F-cv, B-cv,
  G-cv of this library, which reach the sandwich and the bagged targets the way P4 reaches
  the posterior.
* A row carries what it is as data (:class:`Row`: the targets it reaches, its estimator,
  ``Γ``, how it sets ``β`` and ``h``, whether its noise is exact): :func:`tune`, the step
  rule :func:`step_rule` and the autotuner read those fields, never a row's name.
* A **tuning** (:func:`tune`) is a row's ``(h, β, Γ, Λ)`` at given ``b`` and ``n``, with its
  predicted stationary covariance. The paper's constants are statements about the scaling
  limit (``h n/b → c_h/c_b``); :func:`tune` uses their exact discrete versions:

  * **exact noise** (rows P4, B, G and the control-variate rows): the injected noise is what
    makes the target the solution of the discrete Lyapunov equation,

    .. math::

        \\tfrac{h}{\\beta}\\Lambda = \\Sigma_t - F\\Sigma_t F^\\top - D_g(\\Sigma_t),
        \\qquad F = I - \\tfrac{h}{2}\\Gamma J,\\quad \\Sigma_t = Q/n,

    ``D_g`` the gradient-noise part of the step's noise; for ``Γ = J⁻¹``,
    ``Λ = (β/n)(1 - h/4) Q - (β/h) D_g``. It exists while ``Λ`` is positive semi-definite, i.e.
    while the gradient noise is below the noise the target needs (:class:`InfeasibleTuning`
    otherwise);
  * **exact step** (rows F, B, G): the gradient noise supplies the ``w₁ S`` part at
    ``h = 4w₁b/(n + w₁b)``, the table's ``c_h = 4w₁c_b`` without its ``O(b/n)`` bias (for
    ``Γ = J⁻¹`` the discrete chain is wider than its limit by ``(1 - h/4)⁻¹``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from numpyro_sgmc import scales
from numpyro_sgmc.scales import Diagonal, as_scale, positive_definite, scaled_spectrum
from numpyro_sgmc.theory.linear import (
    GradientNoise,
    gradient_noise,
    linear_chain,
    mixing_time,
    stationary,
)

__all__ = [
    "REACH",
    "InfeasibleTuning",
    "ROWS",
    "Row",
    "TABLE_1",
    "TARGETS",
    "Tuning",
    "inverse_temperature",
    "preconditioner",
    "rows_reaching",
    "step_rule",
    "target_covariance",
    "target_weights",
    "tune",
]

TARGETS = ("posterior", "bagged", "local_fiducial", "sandwich", "mix")


def target_weights(target: str, weight=None, weights=None) -> tuple:
    """``(w₁, w₂)`` of ``Q = w₁ S + w₂ J⁻¹`` for a named target.

    * ``"posterior"``: ``(0, 1)``; ``weight=w`` tempers it to ``(0, w)``;
    * ``"bagged"``: ``(w, w)``, the bagged posterior (BayesBag) with weight ``w`` (default 1);
    * ``"local_fiducial"`` or ``"sandwich"``: ``(w, 0)``, default ``w = 1``: ``S``;
    * ``"mix"``: ``weights=(w₁, w₂)``, the general interpolation (row G).
    """
    if target not in TARGETS:
        raise ValueError(
            f"Unknown target {target!r}. Choose one of {', '.join(map(repr, TARGETS))}: "
            "'posterior' (J⁻¹), 'bagged' (w(S + J⁻¹)), 'local_fiducial'/'sandwich' (S = "
            "J⁻¹IJ⁻¹), or 'mix' with weights=(w1, w2) for w1·S + w2·J⁻¹."
        )
    if target == "mix":
        if weight is not None:
            raise ValueError("target='mix' takes weights=(w1, w2), not weight.")
        if weights is None or len(weights) != 2:
            raise ValueError(
                f"target='mix' needs weights=(w1, w2) for w1·S + w2·J⁻¹, got {weights!r}."
            )
        w1, w2 = (float(w) for w in weights)
    else:
        if weights is not None:
            raise ValueError(f"target={target!r} takes weight=w, not weights; or use 'mix'.")
        w = 1.0 if weight is None else float(weight)
        w1, w2 = {"posterior": (0.0, w), "bagged": (w, w)}.get(target, (w, 0.0))
    return check_weights(w1, w2)


def check_weights(w1: float, w2: float) -> tuple:
    """``(w₁, w₂)`` as floats, finite, non-negative, not both zero."""
    w1, w2 = float(w1), float(w2)
    if not (math.isfinite(w1) and math.isfinite(w2)) or w1 < 0 or w2 < 0:
        raise ValueError(
            f"Target weights must be finite and non-negative (w1·S + w2·J⁻¹ is then positive "
            f"semi-definite); got w1={w1}, w2={w2}."
        )
    if w1 == 0 and w2 == 0:
        raise ValueError("Target weights w1 = w2 = 0 give a zero covariance: nothing to sample.")
    return w1, w2


def target_covariance(J, I, weights, data_free=None) -> object:
    """``Q = w₁ J⁻¹IJ⁻¹ + w₂ J⁻¹`` as a scale (``J``, ``I`` scales or arrays).

    :param data_free: ``(d,)`` bool, the parameters with no per-datum gradient (``I`` is zero
        there: hierarchical means and scales). With ``w₂ = 0`` the sandwich alone is singular
        in their directions (a penalised estimator's hyperparameters are functions of the
        other parameters), so they get their conditional posterior given the others:
        ``Q = w₁(S + 0 ⊕ J_cc⁻¹)`` (``docs/theory.md`` §4, "Parameters with no per-datum
        gradient"). With ``w₂ > 0`` the posterior part already covers them.
    """
    w1, w2 = check_weights(*weights)
    J = as_scale(J)
    d = len(J)
    J_inv = J.inverse()
    Q = J_inv * w2
    if w1 > 0:
        S = J_inv @ as_scale(I, d) @ J_inv
        Q = S * w1 + Q
        free = np.zeros(d, bool) if data_free is None else np.asarray(data_free, bool)
        if w2 == 0 and free.any():
            # 0 ⊕ J_cc⁻¹: the covariance of the free parameters given the others
            Q = Q + scales.masked_inverse(J, free) * w1
    return scales.symmetrized(Q)


REACH = {
    "posterior": lambda w1, w2: w1 == 0,
    "untempered posterior": lambda w1, w2: w1 == 0 and w2 == 1,
    "sandwich": lambda w1, w2: w1 > 0 and w2 == 0,
    "bagged": lambda w1, w2: w1 > 0 and w1 == w2,
    "mix": lambda w1, w2: w1 > 0,
}
"""What a row's tuning reaches (:attr:`Row.reach`): the weights ``(w₁, w₂)`` of the targets
``Q = w₁S + w₂J⁻¹`` it can be tuned to. ``"posterior"`` includes the tempered ``w₂J⁻¹``;
``"mix"`` is every target with a sandwich part."""

TEMPERATURES = ("n/w2", "n", "inf")
"""How a row sets ``β`` (:attr:`Row.inverse_temperature`, :func:`inverse_temperature`)."""

STEPS = ("c_h", "free", "4w1b", "4b/n")
"""How a row sets ``h`` (:attr:`Row.step`, :func:`step_rule`)."""


@dataclass(frozen=True)
class Row:
    """One row of Table 1: its display strings (the first nine fields, ``docs/theory.md`` §4)
    and what it is, as data (the others), which is all :func:`tune` and the autotuner read;
    adding a row is one entry of :data:`TABLE_1`.

    :param str reach: the targets it reaches, a key of :data:`REACH`.
    :param default_weights: ``(w₁, w₂)`` of its target when none is given (``None``: the
        weights must be given).
    :param bool control_variates: its gradient estimator: control variates at the mode, or
        plain minibatches.
    :param str drift_matrix: what ``Γ`` is: ``"I"`` (identity), ``"J^-1"`` or ``"I^-1"``.
    :param str inverse_temperature: how ``β`` is set (:data:`TEMPERATURES`): ``"n/w2"``
        (``β = n/w₂``, ``∞`` at ``w₂ = 0``), ``"n"`` (the weights are in ``Λ``) or ``"inf"``
        (no injected noise: SGD).
    :param str step: how ``h`` is set (:data:`STEPS`, :func:`step_rule`): ``"c_h"``
        (``h = (c_h/c_b) b/n``, given), ``"free"`` (given; bounded only by stability),
        ``"4w1b"`` (the exact natural-noise step ``4w₁b/(n + w₁b)``) or ``"4b/n"`` (P5's
        ``c_h = 4c_b``).
    :param bool exact_noise: ``Λ`` is set so that the discrete prediction is the target.
    :param bool autotuned: the autotuner considers it (:func:`rows_reaching`).
    """

    name: str
    algorithm: str
    drift: str  # Γ
    noise: str  # Λ
    scaling: str
    constants: str
    target: str  # n·Cov → Q
    mixing: str  # epochs
    description: str
    reach: str
    default_weights: Optional[tuple] = None
    control_variates: bool = False
    drift_matrix: str = "J^-1"
    inverse_temperature: str = "n/w2"
    step: str = "4w1b"
    exact_noise: bool = False
    autotuned: bool = True

    def __post_init__(self):
        for field, value, allowed in (
            ("reach", self.reach, tuple(REACH)),
            ("inverse_temperature", self.inverse_temperature, TEMPERATURES),
            ("step", self.step, STEPS),
            ("drift_matrix", self.drift_matrix, ("I", "J^-1", "I^-1")),
        ):
            if value not in allowed:
                raise ValueError(f"Row {self.name}: {field}={value!r} is not one of {allowed}.")

    @property
    def stochastic(self) -> bool:
        """Whether noise is injected (``β < ∞``)."""
        return self.inverse_temperature != "inf"

    def reaches(self, weights) -> bool:
        """Whether this row's tuning reaches ``Q = w₁S + w₂J⁻¹``."""
        return REACH[self.reach](*weights)


_CV_EXACT = dict(
    control_variates=True, inverse_temperature="n", step="free", exact_noise=True
)  # the control-variate rows of this library: every weight in Λ, h bounded by stability

TABLE_1 = (
    Row("P1", "SGLD", "I", "I", "h·n/b → 0, β = n", "", "J⁻¹",
        "4b/(n h λmin(J)) (grows with n)",
        "Plain SGLD: samples the posterior only as h·n/b → 0, so ever more epochs per "
        "mixing time, and pays the condition number of J.",
        "posterior", (0.0, 1.0), drift_matrix="I", step="c_h", autotuned=False),
    Row("P2", "preconditioned SGLD", "J⁻¹", "J⁻¹", "h·n/b → 0, β = n", "", "J⁻¹",
        "4b/(n h) (grows with n)",
        "SGLD preconditioned by J⁻¹: no condition-number penalty, but still h·n/b → 0.",
        "posterior", (0.0, 1.0), step="c_h", autotuned=False),
    Row("P3", "SGLD-FP", "I", "I", "h = c_h/n, β = n", "", "J⁻¹", "4c_b/(c_h λmin(J))",
        "SGLD with control variates at the mode: the posterior at a fixed number of epochs "
        "per mixing time; pays the condition number of J.",
        "posterior", (0.0, 1.0), True, "I", step="c_h", autotuned=False),
    Row("P4", "preconditioned SGLD-FP", "J⁻¹", "J⁻¹", "h = c_h/n, β = n", "", "J⁻¹",
        "4c_b/c_h",
        "Control variates and J⁻¹ preconditioning: the posterior, 4c_b/c_h epochs per "
        "mixing time; with the exact noise its step is bounded only by stability.",
        "posterior", (0.0, 1.0), True, step="free", exact_noise=True),
    Row("P5", "preconditioned SGD", "I⁻¹", "–", "h = c_h/n, β = ∞", "c_h = 4c_b", "J⁻¹",
        "1/λmin(I⁻¹J)",
        "SGD preconditioned by the inverse gradient covariance: its minibatch noise alone "
        "gives the posterior-like J⁻¹ (natural-gradient SGD as a sampler).",
        "untempered posterior", (0.0, 1.0), False, "I^-1", "inf", "4b/n"),
    Row("B", "bagged posterior", "J⁻¹", "J⁻¹", "h = c_h/n, β = n/w", "c_h = 4w c_b",
        "w (S + J⁻¹)", "1/w",
        "Minibatch noise plus injected noise: the BayesBag (bagged posterior) covariance.",
        "bagged", exact_noise=True),
    Row("F", "local fiducial (sandwich)", "J⁻¹", "–", "h = c_h/n, β = ∞", "c_h = 4c_b", "S",
        "1",
        "SGD preconditioned by J⁻¹: its minibatch noise gives the sandwich S = J⁻¹IJ⁻¹, the "
        "frequentist covariance, robust to misspecification; one epoch per mixing time.",
        "sandwich", (1.0, 0.0), inverse_temperature="inf"),
    Row("G", "interpolation", "J⁻¹", "J⁻¹", "h = c_h/n, β = n/w₂", "c_h = 4w₁c_b",
        "w₁S + w₂J⁻¹", "1/w₁",
        "Interpolates between the sandwich (w₂ = 0) and J⁻¹: covariance w₁S + w₂J⁻¹.",
        "mix", exact_noise=True),
    Row("A", "iterate average", "any", "–", "h = c_h/n, β = ∞", "m epochs",
        "Cov(θ̄) ≈ S/(nm)", "–",
        "The average of SGD iterates over m epochs: n m Cov(θ̄) → S for any Γ (an estimator, "
        "not a sampler; its chain is row F's).",
        "sandwich", (1.0, 0.0), inverse_temperature="inf", autotuned=False),
    Row("F-cv", "SGLD-FP, sandwich noise", "J⁻¹", "(1 - h/4)S", "h bounded by stability",
        "exact noise", "S", "4c_b/c_h",
        "Control variates remove the gradient noise; injected noise shaped like S supplies "
        "the sandwich: mixing in a few iterations, at any n.",
        "sandwich", **_CV_EXACT),
    Row("B-cv", "SGLD-FP, bagged noise", "J⁻¹", "(1 - h/4)w(S + J⁻¹)",
        "h bounded by stability", "exact noise", "w (S + J⁻¹)", "4c_b/c_h",
        "The bagged posterior's covariance from injected noise alone, with control variates.",
        "bagged", **_CV_EXACT),
    Row("G-cv", "SGLD-FP, mixed noise", "J⁻¹", "(1 - h/4)(w₁S + w₂J⁻¹)",
        "h bounded by stability", "exact noise", "w₁S + w₂J⁻¹", "4c_b/c_h",
        "Any mix w₁S + w₂J⁻¹ from injected noise alone, with control variates.",
        "mix", **_CV_EXACT),
)  # fmt: skip
"""Table 1: every row, in the order of ``docs/theory.md`` §4 (:class:`Row`)."""

ROWS = {row.name: row for row in TABLE_1}
"""Row name -> :class:`Row`, for every row of :data:`TABLE_1`."""


def rows_reaching(weights) -> list:
    """The names of the autotuned rows (:attr:`Row.autotuned`) whose tuning reaches
    ``Q = w₁S + w₂J⁻¹``, in table order; a ``"mix"`` row is left out where a row of the same
    estimator names the target more narrowly (G and G-cv reach F's and B's targets too: the
    table names those F, B and their control-variate rows)."""
    w1, w2 = check_weights(*weights)
    out = [row for row in TABLE_1 if row.autotuned and row.reaches((w1, w2))]
    narrow = {row.control_variates for row in out if row.reach != "mix"}
    return [row.name for row in out if row.reach != "mix" or row.control_variates not in narrow]


class InfeasibleTuning(ValueError):
    """No injected noise reaches the target: the gradient noise alone is larger than what the
    target needs (``Λ`` would not be positive semi-definite)."""


class Tuning(NamedTuple):
    """A row's tuning at given ``b`` and ``n`` (:func:`tune`); matrices are scales.

    :param str row: the row's name.
    :param float step_size: ``h``.
    :param int batch_size: ``b`` (over all plates).
    :param float inverse_temperature: ``β`` (``inf`` for SGD).
    :param preconditioner: ``Γ``.
    :param noise_preconditioner: ``Λ`` (``None`` for SGD).
    :param bool control_variates: the row's estimator.
    :param target: ``Σ_t = Q/n``.
    :param covariance: the predicted stationary covariance (discrete Lyapunov); the target
        itself for the exact rows.
    :param drift: ``F = I - (h/2)ΓJ``.
    :param float noise_fraction: the gradient noise as a fraction of the noise the target
        needs (in the target's metric); 0 for SGD rows.
    """

    row: str
    step_size: float
    batch_size: int
    inverse_temperature: float
    preconditioner: object
    noise_preconditioner: Optional[object]
    control_variates: bool
    target: object
    covariance: object
    drift: object
    noise_fraction: float

    def mixing(self, J, num_data: int):
        """The :class:`~numpyro_sgmc.theory.linear.MixingTime` of the linearised chain (epochs
        counted as ``b/n`` per iteration)."""
        return mixing_time(
            J,
            step_size=self.step_size,
            preconditioner=self.preconditioner,
            batch_size=self.batch_size,
            num_data=num_data,
        )


def _row(row) -> Row:
    """``row`` itself, or the row of Table 1 it names."""
    if isinstance(row, Row):
        return row
    try:
        return ROWS[row]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown Table 1 row {row!r}; the rows are {', '.join(ROWS)}.") from None


def _weights_for(row: Row, weights) -> tuple:
    if weights is None:
        if row.default_weights is None:
            raise ValueError(f"Row {row.name} needs weights=(w1, w2) for its target.")
        weights = row.default_weights
    weights = check_weights(*weights)
    if not row.reaches(weights):
        raise ValueError(
            f"Row {row.name} does not reach the target w1={weights[0]:g}, w2={weights[1]:g}; "
            f"the rows that do: {rows_reaching(weights)}."
        )
    return weights


def tune(
    name: str,
    J,
    I,
    *,
    batch_size: int,
    num_data: int,
    weights=None,
    noise: Optional[GradientNoise] = None,
    step_size: Optional[float] = None,
    c_h: Optional[float] = None,
    c_b: Optional[float] = None,
    data_free=None,
) -> Tuning:
    """The tuning of Table 1 row ``name`` (module docstring) and its prediction.

    :param name: a row of :data:`TABLE_1` (or the :class:`Row` itself).
    :param J: curvature per datum of the potential at the mode (scale or array).
    :param I: per-datum gradient covariance at the mode (scale or array).
    :param batch_size: ``b`` (over all plates); ``num_data``: ``n``.
    :param weights: ``(w₁, w₂)`` of the target (default: the row's own,
        :attr:`Row.default_weights`: ``S`` for F and A, ``J⁻¹`` for P1–P5; required for B, G
        and the control-variate rows).
    :param noise: the gradient noise of the row's estimator
        (:func:`~numpyro_sgmc.theory.linear.gradient_noise`); default ``I/b`` for minibatch
        rows and none for control-variate rows (the per-datum-Hessian term neglected).
    :param step_size: ``h`` for the rows whose step is free (P4 and the control-variate rows;
        alternatively ``c_h``).
    :param c_h: step-size constant, ``h = (c_h/c_b) b/n``: required for P1–P3, or instead of
        ``step_size`` for P4; not accepted for the rows whose constants fix it.
    :param c_b: batch-size constant (default ``b``).
    :param data_free: the parameters with no per-datum gradient (:func:`target_covariance`).
    :raises ValueError: unknown row, a row that does not reach the target, missing or
        superfluous constants; :class:`InfeasibleTuning` when no injected noise reaches the
        target.
    """
    row = _row(name)
    w1, w2 = _weights_for(row, weights)
    b, n = int(batch_size), int(num_data)
    if b < 1 or n < 1:
        raise ValueError(f"batch_size and num_data must be positive, got {b}, {n}.")
    d = len(J) if scales.is_sized(J) else int(np.shape(J)[-1])
    J, I = as_scale(J, d), (None if I is None else as_scale(I, d))
    h = step_rule(row, b, n, (w1, w2), step_size=step_size, c_h=c_h, c_b=c_b)
    gamma = preconditioner(row, J, I, data_free)
    if noise is None:
        noise = gradient_noise(None if row.control_variates else I, batch_size=b)
    beta = inverse_temperature(row, n, (w1, w2))
    target = target_covariance(J, I, (w1, w2), data_free) * (1.0 / n)
    drift = Diagonal(np.ones(d)) - (gamma @ J) * (0.5 * h)
    lam, fraction = gamma if math.isfinite(beta) else None, 0.0
    if row.exact_noise:
        lam, fraction = _exact_noise(drift, gamma, h, beta, target, noise, row, b)
    chain = linear_chain(
        J,
        step_size=h,
        noise=noise,
        inverse_temperature=beta,
        preconditioner=gamma,
        noise_preconditioner=lam,
    )
    covariance = target if row.exact_noise else stationary(chain)
    return Tuning(
        row=row.name,
        step_size=h,
        batch_size=b,
        inverse_temperature=beta,
        preconditioner=gamma,
        noise_preconditioner=lam,
        control_variates=row.control_variates,
        target=target,
        covariance=covariance,
        drift=drift,
        noise_fraction=fraction,
    )


def preconditioner(row, J, I, data_free=None):
    """Row ``row``'s ``Γ`` (a name or a :class:`Row`; ``1``, ``J⁻¹`` or ``I⁻¹``, scales);
    :class:`InfeasibleTuning` when it needs ``I⁻¹`` and ``I`` is singular (parameters with no
    per-datum gradient)."""
    row = _row(row)
    kind = row.drift_matrix
    if kind == "I":
        return Diagonal(np.ones(len(J)))
    if kind == "J^-1":
        return J.inverse()
    free = 0 if data_free is None else int(np.sum(data_free))
    if free or not positive_definite(I, 1e-10):
        why = (
            f"{free} parameter(s) have no per-datum gradient (their I rows are zero)"
            if free
            else "the smallest eigenvalue of its correlation-scaled form is "
            f"{scaled_spectrum(I)[0]:.3g}"
        )
        raise InfeasibleTuning(
            f"Row {row.name} preconditions with I⁻¹, and the per-datum gradient covariance I is "
            f"singular: {why}. Use a row preconditioned by J⁻¹ (P4)."
        )
    return I.inverse()


def inverse_temperature(row, num_data: int, weights) -> float:
    """Row ``row``'s ``β`` for ``n = num_data`` and the target ``weights``
    (:attr:`Row.inverse_temperature`): ``n/w₂`` (``∞`` at ``w₂ = 0``: no injected noise),
    ``n`` or ``∞``."""
    row, (_, w2) = _row(row), weights
    if row.inverse_temperature == "n":
        return float(num_data)
    if row.inverse_temperature == "n/w2" and w2 > 0:
        return num_data / w2
    return math.inf


def step_rule(row, batch_size: int, num_data: int, weights=None, *, step_size=None, c_h=None,
              c_b=None) -> float:  # fmt: skip
    """Row ``row``'s step size ``h`` at ``b = batch_size``, ``n = num_data`` (:attr:`Row.step`).

    * ``"4w1b"`` (F, B, G): ``h = 4w₁b/(n + w₁b)``, the exact natural-noise step (module
      docstring); ``"4b/n"`` (P5): ``h = 4b/n``. Both fix ``h``: ``step_size`` and ``c_h``
      are refused;
    * ``"free"`` (P4, the control-variate rows): ``step_size``, or ``h = (c_h/c_b) b/n``;
    * ``"c_h"`` (P1–P3): ``h = (c_h/c_b) b/n``, ``c_b`` defaulting to ``b``.

    :param weights: ``(w₁, w₂)`` of the target (default the row's own); only ``"4w1b"``
        reads them.
    """
    row = _row(row)
    b, n = int(batch_size), int(num_data)
    if row.step in ("4w1b", "4b/n"):
        if c_h is not None or step_size is not None:
            raise ValueError(
                f"Row {row.name} fixes its step-size constant ({row.constants}); do not pass "
                "c_h or step_size."
            )
        if row.step == "4b/n":
            return 4.0 * b / n
        w1 = _weights_for(row, weights)[0]
        return 4.0 * w1 * b / (n + w1 * b)
    if step_size is not None and c_h is not None:
        raise ValueError("Give step_size or c_h, not both.")
    if step_size is not None:
        if row.step != "free":
            raise ValueError(f"Row {row.name} sets h = c_h/n: pass c_h, not step_size.")
        h = float(step_size)
    elif c_h is not None:
        c_b = float(b) if c_b is None else float(c_b)
        if not (float(c_h) > 0 and c_b > 0):
            raise ValueError(f"c_h and c_b must be positive, got {c_h!r}, {c_b!r}.")
        h = float(c_h) / c_b * b / n
    else:
        raise ValueError(f"Row {row.name} needs c_h (its step size is h = c_h/n) or step_size.")
    if not (h > 0 and math.isfinite(h)):
        raise ValueError(f"step_size must be positive and finite, got {h!r}.")
    return h


def _exact_noise(drift, gamma, h, beta, target, noise, row, b):
    """``Λ = (β/h)[Σ_t - FΣ_tFᵀ - D_g(Σ_t)]`` and the gradient-noise fraction."""
    needed = scales.symmetrized(target - drift @ target @ drift.T)
    G = gamma * (0.5 * h)
    supplied = G @ noise(target) @ G.T
    fraction = scales.relative_size(supplied, needed)
    if fraction >= 1.0:
        raise InfeasibleTuning(
            f"Row {row.name}: at batch size b = {b} and step size h = {h:.4g} the gradient "
            f"noise alone is {fraction:.4f} times the noise the target covariance needs, so no "
            "injected noise can reach it: "
            + (
                "increase the batch size or lower the step size."
                if row.step == "free"
                else "this row fixes its step from b, so the ratio does not fall with b; its "
                "control-variate row (which leaves far less gradient noise) or more data can."
            )
        )
    return scales.symmetrized((needed - supplied) * (beta / h)), fraction
