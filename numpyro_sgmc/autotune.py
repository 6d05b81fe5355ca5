"""The Table 1 autotuner: from a named target to a ready kernel, a prediction and its cost.

``autotune(model, *args, target=...)`` runs the pipeline of ``shared/design/theory.md``
§3–§4 on any NumPyro model with a subsample plate:

1. **warm start** (:func:`~numpyro_sgmc.warmstart.warm_start`): Adam to the mode ``θ̂``,
   then polished by a Newton step with the exact full-data gradient;
2. **information** at ``θ̂`` (:func:`~numpyro_sgmc.fisher.information`): ``J`` (the
   potential's curvature per datum, prior included), ``I`` and ``S = J⁻¹IJ⁻¹``, dense for
   ``d ≤ 100`` and diagonal above;
3. **tuning**: every target is a mix ``Q = w₁ S + w₂ J⁻¹`` (posterior: ``(0, 1)``; bagged
   with weight ``w``: ``(w, w)``; local fiducial / sandwich: ``(1, 0)``), and the row of
   Table 1 that reaches it is chosen:

   * ``w₁ = 0`` (a tempered posterior): **P4**, SGLD-FP with ``Γ = Λ = J⁻¹``,
     ``β = n/w₂``: control variates remove the gradient noise, so the step is bounded only
     by stability, or **P5**, SGD with ``Γ = I⁻¹``, ``h = 4b/n`` (used when it is predicted
     cheaper, or when asked for with ``row="P5"``);
   * ``w₁ > 0``: **G** (**B** when ``w₁ = w₂``, **F** when ``w₂ = 0``): SGLD (SGD for F)
     without control variates, ``Γ = J⁻¹``, ``β = n/w₂``, the gradient noise supplying the
     ``w₁ S`` part: ``h = 4w₁b/(n + w₁b)``, which is the table's ``c_h = 4w₁c_b`` with its
     ``O(b/n)`` discretisation bias removed (theory §3: for ``Γ = J⁻¹`` the discrete chain is
     wider than its scaling limit by ``(1 - h/4)⁻¹``).

   **Exact noise.** For a chain with drift ``F = I - (h/2)ΓJ`` and gradient noise ``D_g``
   the stationary covariance solves ``Σ = FΣFᵀ + D_g(Σ) + (h/β)Λ``; the tuner sets the
   injected noise to what makes the *target* the solution,

   .. math::

       \\Lambda = \\tfrac{\\beta}{h}\\,[\\,\\Sigma_t - F\\Sigma_t F^\\top - D_g(\\Sigma_t)\\,],
       \\qquad \\Sigma_t = Q/n,

   which for ``Γ = J⁻¹`` is ``Λ = (1 - h/4)Γ`` minus the control-variate noise term. So the
   discrete-time bias of a large step is corrected rather than avoided (exact for a
   quadratic log-likelihood; theory §3), and the discrete Lyapunov prediction of the tuned
   chain equals the target.

   **Step size bound.** ``h·λmax(ΓJ) ≤ max_step`` (default 1). Linear stability needs
   ``< 4``; at ``h λ = 1`` every direction contracts by at least 1/2 per iteration without
   the sign-alternating oscillation that sets in at ``h λ > 2``, which leaves a factor 4 for
   ``J`` varying over the posterior (a relative ``O(n^{-1/2})``) and for its estimate from a
   subsample (a relative ``O(m^{-1/2})``), and keeps the control-variate noise, which grows as
   ``h²/b``, a small part of the injected noise.

4. **prediction**: the stationary covariance (discrete Lyapunov; unconstrained, and mapped to
   the constrained sites by the delta method), the per-parameter integrated autocorrelation
   times and the mixing time in iterations and epochs, and the draws needed for an effective
   sample size; :func:`~numpyro_sgmc.check.check_run` compares a run with them.

Cost is counted in gradient evaluations per datum (epochs): ``b`` per iteration, ``2b`` with
control variates (the centre's minibatch gradient is evaluated too).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro.distributions import biject_to
from numpyro.infer.initialization import init_to_value

from numpyro_sgmc import theory
from numpyro_sgmc.diagnostics import user_stacklevel
from numpyro_sgmc.fisher import Information, information, per_datum_hessians
from numpyro_sgmc.gradients import full_data_gradient
from numpyro_sgmc.kernels import SGD, SGLD, SGLDFP
from numpyro_sgmc.preconditioners import Dense, Diagonal, flat_layout
from numpyro_sgmc.subsample import Batch, initialize, split_args
from numpyro_sgmc.warmstart import ConvergenceWarning, WarmStart, warm_start

__all__ = ["TARGETS", "TuningReport", "autotune", "target_weights"]

TARGETS = ("posterior", "bagged", "local_fiducial", "sandwich", "mix")
DENSE_MAX_DIM = 100


def target_weights(target: str, weight=None, weights=None) -> tuple[float, float]:
    """``(w₁, w₂)`` of ``Q = w₁ S + w₂ J⁻¹`` for a named target (theory §4).

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
        if target == "posterior":
            w1, w2 = 0.0, w
        elif target == "bagged":
            w1, w2 = w, w
        else:
            w1, w2 = w, 0.0
    if not (math.isfinite(w1) and math.isfinite(w2)) or w1 < 0 or w2 < 0:
        raise ValueError(
            f"Target weights must be finite and non-negative (w1·S + w2·J⁻¹ is then positive "
            f"semi-definite); got w1={w1}, w2={w2}."
        )
    if w1 == 0 and w2 == 0:
        raise ValueError("Target weights w1 = w2 = 0 give a zero covariance: nothing to sample.")
    return w1, w2


class TuningReport(NamedTuple):
    """What :func:`autotune` chose and predicts. Flat vectors follow ``layout``.

    :param str row: Table 1 row (``"P4"``, ``"P5"``, ``"B"``, ``"F"``, ``"G"``).
    :param str algorithm: the kernel's class name.
    :param str target: the target's name; ``weights`` its ``(w₁, w₂)``.
    :param float step_size: ``h``.
    :param batch_size: ``b`` per plate, ``{plate: b}``.
    :param float inverse_temperature: ``β`` (``inf`` for SGD).
    :param preconditioner: ``Γ``, ``(d, d)`` or ``(d,)``.
    :param noise_preconditioner: ``Λ`` likewise (``None`` for SGD).
    :param bool control_variates: whether the kernel uses control variates.
    :param int num_steps: iterations per MCMC draw given to the kernel.
    :param target_covariance: ``Σ_t = Q/n`` (unconstrained).
    :param covariance: the predicted stationary covariance (discrete Lyapunov, unconstrained).
    :param constrained_covariance: the prediction mapped to the constrained latent sites by
        the delta method (``constrained_layout`` gives their order).
    :param autocorrelation_iterations: ``(d,)`` predicted integrated autocorrelation time of
        each unconstrained parameter, in iterations.
    :param float mixing_iterations: the worst over all linear functionals, in iterations.
    :param float mixing_epochs: the same in epochs of gradient work (``2b/n`` per iteration
        with control variates, ``b/n`` without).
    :param float gradient_evaluations_per_iteration: ``b`` or ``2b``.
    :param float setup_epochs: passes over the data before sampling: the warm start's epochs,
        the rows used for ``J``, ``I`` (and the per-datum Hessians) over ``n``, and one full
        pass for the control-variate centre when the kernel has one.
    :param float newton_step: length, in posterior sds, of the Newton step that polished the
        warm start's mode (theory §3 linearises at the exact mode).
    :param int num_data: ``n``.
    :param mode: unconstrained mode, dict; ``init_params`` for ``MCMC.run``.
    :param constrained_mode: the mode in constrained space (latent and deterministic sites).
    :param information: the :class:`~numpyro_sgmc.fisher.Information` at the mode.
    :param warm_start: the :class:`~numpyro_sgmc.warmstart.WarmStart` run.
    :param list layout: ``[(site, start, stop, shape)]`` of the unconstrained vector.
    :param list constrained_layout: the same for the constrained latent sites.
    :param dict transforms: site -> the transform from unconstrained to constrained values.
    """

    row: str
    algorithm: str
    target: str
    weights: tuple
    step_size: float
    batch_size: dict
    inverse_temperature: float
    preconditioner: np.ndarray
    noise_preconditioner: Optional[np.ndarray]
    control_variates: bool
    num_steps: int
    target_covariance: np.ndarray
    covariance: np.ndarray
    constrained_covariance: np.ndarray
    autocorrelation_iterations: np.ndarray
    mixing_iterations: float
    mixing_epochs: float
    gradient_evaluations_per_iteration: int
    setup_epochs: float
    newton_step: float
    num_data: int
    mode: dict
    constrained_mode: dict
    information: Information
    warm_start: WarmStart
    layout: list
    constrained_layout: list
    transforms: dict

    @property
    def drift(self) -> np.ndarray:
        """``F = I - (h/2)ΓJ``: the linearised chain ``δ' = Fδ + noise`` (theory §3).

        ``(d,)`` in the diagonal approximation (every coordinate its own chain).
        """
        J = np.asarray(self.information.potential_curvature, np.float64)
        gamma = np.asarray(self.preconditioner, np.float64)
        if J.ndim == 1:
            return 1.0 - 0.5 * self.step_size * gamma * J
        return np.eye(J.shape[0]) - 0.5 * self.step_size * gamma @ J

    def autocorrelation_per_draw(self, thinning: int = 1) -> np.ndarray:
        """Predicted per-parameter integrated autocorrelation time of the collected draws.

        A kept draw is every ``k = num_steps · thinning``-th iterate, so the lag-``j``
        autocovariance is that of lag ``j·k`` iterations: ``theory.autocorrelation_times(F^k,
        Σ)`` (``(1 + F^k)/(1 - F^k)`` per coordinate in the diagonal approximation).
        """
        F, k = self.drift, self.num_steps * int(thinning)
        if F.ndim == 1:
            Fk = F**k
            return (1.0 + Fk) / (1.0 - Fk)
        return theory.autocorrelation_times(np.linalg.matrix_power(F, k), self.covariance)

    def draws_for(self, ess: float) -> int:
        """Draws (per chain, ``num_samples``) for an effective sample size ``ess`` of every
        parameter."""
        return int(math.ceil(ess * float(np.max(self.autocorrelation_per_draw()))))

    def epochs_for(self, ess: float) -> float:
        """Epochs of gradient work (per chain) for an effective sample size ``ess``."""
        iterations = self.draws_for(ess) * self.num_steps
        return iterations * self.gradient_evaluations_per_iteration / self.num_data

    def total_epochs(self, ess: float) -> float:
        """Setup plus sampling epochs (per chain) for an effective sample size ``ess``."""
        return self.setup_epochs + self.epochs_for(ess)

    def __str__(self) -> str:
        b = ", ".join(f"{k}: {v}" for k, v in self.batch_size.items())
        w1, w2 = self.weights
        sd = np.sqrt(np.diag(self.covariance) if self.covariance.ndim == 2 else self.covariance)
        lines = [
            f"Autotuned {self.algorithm} (Table 1 row {self.row}) for target '{self.target}' "
            f"(Q = {w1:g}·S + {w2:g}·J⁻¹), n = {self.num_data}",
            f"  step size h = {self.step_size:.4g}, batch size b = {b}, "
            f"inverse temperature β = {self.inverse_temperature:.6g}, "
            f"control variates: {self.control_variates}, {self.num_steps} iterations per draw",
            f"  predicted mixing: {self.mixing_iterations:.3g} iterations = "
            f"{self.mixing_epochs:.3g} epochs; per-draw autocorrelation time "
            f"{self.autocorrelation_per_draw().max():.3g}",
            f"  information from {self.information.num_rows} rows: "
            f"cond(J) = {self.information.condition_numbers['J']:.3g}, "
            f"cond(I) = {self.information.condition_numbers['I']:.3g}; warm-start mode moved "
            f"{self.newton_step:.2g} posterior sd by a Newton step",
            "  predicted posterior sd (unconstrained):",
        ]
        for name, start, stop, _ in self.layout:
            values = " ".join(f"{v:.4g}" for v in sd[start:stop][:8])
            more = " ..." if stop - start > 8 else ""
            lines.append(f"    {name:<20} {values}{more}")
        lines.append(
            f"  ESS 1000 needs {self.draws_for(1000)} draws = {self.epochs_for(1000):.3g} epochs "
            f"of sampling, after {self.setup_epochs:.3g} epochs of setup"
        )
        return "\n".join(lines)


def _inverse(p) -> np.ndarray:
    p = np.asarray(p, np.float64)
    if p.ndim == 1:
        return 1.0 / p
    inv = np.linalg.inv(p)
    return 0.5 * (inv + inv.T)


def autotune(
    model: Callable,
    *model_args,
    target: str = "posterior",
    weight: Optional[float] = None,
    weights=None,
    rng_key=None,
    batch_size=None,
    row: Optional[str] = None,
    warm: Optional[WarmStart] = None,
    warm_start_epochs: float = 5,
    learning_rate: float = 0.05,
    num_restarts: int = 1,
    num_rows: Optional[int] = 10000,
    dense: Optional[bool] = None,
    regularize=None,
    max_step: float = 1.0,
    min_batch_size: int = 32,
    num_steps: Optional[int] = None,
    batch_sampling: str = "with_replacement",
    **model_kwargs,
):
    """Choose ``(row, h, b, β, Γ, Λ)`` for ``target`` and return ``(kernel, report)``.

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param model_args: the data, as for ``MCMC.run``.
    :param target: ``"posterior"``, ``"bagged"``, ``"local_fiducial"`` (= ``"sandwich"``) or
        ``"mix"``; see :func:`target_weights`.
    :param weight: ``w`` of ``"bagged"`` / ``"local_fiducial"`` / tempered ``"posterior"``.
    :param weights: ``(w₁, w₂)`` of ``"mix"``.
    :param rng_key: PRNG key for the warm start and the information subsample.
    :param batch_size: ``b`` (int or ``{plate: int}``); default the plates' ``subsample_size``,
        lowered where the step-size bound needs it (rows F, B, G: ``4w₁b/n ≤ max_step``).
    :param row: force a row of Table 1 that reaches the target (``"P4"`` or ``"P5"`` for the
        posterior); default: the cheapest predicted.
    :param warm: a :class:`~numpyro_sgmc.warmstart.WarmStart` to reuse (its best restart);
        otherwise one is run with ``warm_start_epochs``, ``learning_rate``, ``num_restarts``.
    :param num_rows: rows for ``J`` and ``I`` (``None``: all ``n``).
    :param dense: dense ``J``/``Γ`` (default when ``d ≤ 100``) or diagonal.
    :param regularize: passed to :func:`~numpyro_sgmc.fisher.information` for a ``J`` that is
        not positive definite.
    :param max_step: the bound on ``h·λmax(ΓJ)`` (see the module docstring).
    :param min_batch_size: the smallest batch per plate the P4 search tries: below a few dozen
        rows the fixed cost of an iteration (index draws, dispatch) dominates its time, so
        fewer gradient evaluations no longer mean less wall time.
    :param num_steps: iterations per draw; default about a quarter of the predicted mixing
        time (so a draw is nearly independent of the fourth one after it).
    :param batch_sampling: the kernel's ``batch_sampling``. The predictions assume batches
        drawn with replacement; ``"without_replacement"`` and ``"blocks"`` (on rows in random
        order, the fastest for large ``n``) have a gradient noise smaller by the factor
        ``(n - b)/(n - 1)``, negligible for ``b ≪ n``.
    :return: ``(kernel, report)``: a kernel for ``numpyro.infer.MCMC`` that starts at the mode,
        and a :class:`TuningReport`.
    """
    w1, w2 = target_weights(target, weight, weights)
    if not 0 < max_step < 4:
        raise ValueError(f"max_step bounds h·λmax(ΓJ) and must be in (0, 4), got {max_step}.")
    rng_key = random.PRNGKey(0) if rng_key is None else rng_key
    key_warm, key_info = random.split(rng_key)
    if warm is None:
        # no convergence check: a mode a few posterior sds off is polished by the Newton
        # step below, which measures the same distance with the J estimated here anyway
        warm = warm_start(
            model,
            *model_args,
            rng_key=key_warm,
            num_epochs=warm_start_epochs,
            batch_size=batch_size,
            num_restarts=num_restarts,
            learning_rate=learning_rate,
            check=False,
            **model_kwargs,
        )
    mode = warm.member(warm.best)
    prepared = initialize(key_info, model, model_args, model_kwargs, batch_size=batch_size)
    plates, n = prepared.plates, warm.num_data
    d = ravel_pytree(mode)[0].shape[0]
    dense = d <= DENSE_MAX_DIM if dense is None else bool(dense)

    def information_at(params):
        return information(
            model,
            *model_args,
            params=params,
            rng_key=key_info,
            num_rows=num_rows,
            kind="dense" if dense else "diagonal",
            regularize=regularize,
            **model_kwargs,
        )

    info = information_at(mode)
    gradient = jax.tree.map(lambda v: v[warm.best], warm.gradient)
    mode, newton_distance, passes = _newton_polish(
        mode, gradient, _inverse(info.potential_curvature), prepared, model_args, model_kwargs
    )
    if passes:  # the mode moved by more than the quadratic model is trusted for: J again
        info = information_at(mode)
    J = np.asarray(info.potential_curvature, np.float64)
    I = np.asarray(info.I, np.float64)
    J_inv = _inverse(J)
    S = J_inv * I * J_inv if J.ndim == 1 else J_inv @ I @ J_inv
    target_cov = (w1 * S + w2 * J_inv) / n
    if target_cov.ndim == 2 and np.linalg.eigvalsh(target_cov)[0] <= 0:
        raise ValueError(
            f"The target covariance {w1:g}·S + {w2:g}·J⁻¹ is not positive definite (I is "
            f"singular: some parameter has no gradient noise). Use weights with w2 > 0."
        )
    hessians = None
    if dense and w1 == 0:
        hessians = per_datum_hessians(
            model,
            *model_args,
            params=mode,
            rng_key=key_info,
            num_rows=min(n, 2000),
            **model_kwargs,
        )
    if dense:
        lam_max = lambda gamma: _eig_extremes(gamma, J)[1]  # noqa: E731
    else:
        lam_max = _hessian_power_iteration(
            prepared, mode, key_info, model_args, model_kwargs, num_rows or n
        )
    candidates = _candidates(w1, w2, row)
    tunings = [
        _tune(
            name,
            J,
            I,
            J_inv,
            target_cov,
            plates,
            n,
            w1,
            w2,
            max_step,
            lam_max,
            hessians,
            min_batch_size,
        )
        for name in candidates
    ]
    tuning = min(tunings, key=lambda t: t["mixing_epochs"])
    tuning["newton_step"] = newton_distance
    visited = info.num_rows * (2 if passes else 1) + (0 if hessians is None else len(hessians))
    setup = warm.num_epochs + passes + visited / n + (1.0 if tuning["control_variates"] else 0.0)
    return _build(
        tuning,
        setup,
        model,
        prepared,
        mode,
        info,
        warm,
        target,
        (w1, w2),
        num_steps,
        batch_sampling,
        model_args,
        model_kwargs,
    )


def _newton_polish(mode, gradient, J_inv, prepared, args, kwargs, max_passes=4):
    """Newton steps ``θ̂ + J⁻¹ḡ`` from the warm start's mode, with exact full-data gradients.

    Adam's last iterates end about a posterior sd per coordinate from the mode; a Newton step
    from there lands within ``O(n^{-1/2})`` of it (the log posterior is nearly quadratic on
    that scale) for nothing: ``J`` and the warm start's full-data gradient ``ḡ`` are already
    computed. A step longer than the trust radius ``max(10, 3√d)`` posterior sds (the length
    ``sqrt(n ḡᵀJ⁻¹ḡ)``) is shortened to it, and then the gradient is recomputed (one pass over
    the data) and the step repeated, at most ``max_passes`` times; a mode still farther than
    the trust radius gets a :class:`~numpyro_sgmc.warmstart.ConvergenceWarning`.

    :return: ``(mode, distance, passes)``: the polished mode, the length of the first step
        in posterior sds, and the extra passes over the data.
    """
    flat, unravel = ravel_pytree(mode)
    x = np.asarray(flat, np.float64)
    n = sum(p.size for p in prepared.plates.values())
    trust = max(10.0, 3.0 * math.sqrt(x.size))
    g = np.asarray(ravel_pytree(gradient)[0], np.float64)
    first, passes = None, 0
    while True:
        step = J_inv * g if np.ndim(J_inv) == 1 else J_inv @ g
        distance = float(np.sqrt(max(n * float(g @ step), 0.0)))
        first = distance if first is None else first
        x = x + step * min(1.0, trust / max(distance, 1e-300))
        if distance <= trust or passes == max_passes:
            break
        passes += 1
        z = unravel(jnp.asarray(x, flat.dtype))
        g = full_data_gradient(prepared.potential_fn, prepared.plates, z, args, kwargs)
        g = np.asarray(ravel_pytree(g)[0], np.float64)
    if distance > trust:
        warnings.warn(
            f"The warm start stopped {first:.3g} posterior standard deviations from the mode, "
            f"and {max_passes} damped Newton steps did not reach it: the predictions, which "
            "linearise the model at the mode, may be off. Run the warm start longer (more "
            "epochs) or with a larger learning_rate.",
            ConvergenceWarning,
            stacklevel=user_stacklevel(),
        )
    return unravel(jnp.asarray(x, flat.dtype)), first, passes


def _candidates(w1, w2, row):
    """The Table 1 rows that reach ``w1·S + w2·J⁻¹`` (``row`` forces one of them).

    A tempered posterior (``w1 = 0``) is reached by P4, and the posterior itself also by P5;
    any ``w1 > 0`` by one tuning, which Table 1 names F (``w2 = 0``), B (``w1 = w2``) or G.
    """
    if w1 == 0:
        reachable = ["P4", "P5"] if w2 == 1 else ["P4"]
    else:
        reachable = ["F" if w2 == 0 else "B" if w1 == w2 else "G"]
    if row is None:
        return reachable
    if row not in reachable:
        raise ValueError(
            f"Row {row!r} of Table 1 does not reach this target (w1={w1:g}, w2={w2:g}); the "
            f"rows that do: {reachable}."
        )
    return [row]


def _tune(name, J, I, J_inv, target_cov, plates, n, w1, w2, max_step, lam_max, hessians, min_batch):
    """The tuning of one row: its constants, batch size, exact noise, prediction and cost.

    Dense ``J`` gives ``(d, d)`` matrices throughout; a diagonal ``J`` (``(d,)``) treats every
    coordinate as its own one-dimensional chain (the diagonal approximation of large ``d``).
    """
    batch = {k: p.batch_size for k, p in plates.items()}
    if name == "P4":
        # mixing in iterations does not depend on b, so the cost per mixing time grows with
        # b: take the smallest batch (down to min_batch) whose control-variate noise is at
        # most half the noise the chain needs, so that the injected noise stays well defined
        gamma, beta = J_inv, n / w2
        h = max_step / lam_max(gamma)
        tuning = None
        for candidate in _halvings(batch, min_batch):
            try:
                tuning = _predict(
                    "P4", h, candidate, beta, gamma, True, J, I, target_cov, n, hessians, 0.5
                )
            except _TooNoisy:
                break
        if tuning is None:
            raise ValueError(
                f"Row P4: at batch size b = {sum(batch.values())} the control-variate noise "
                "exceeds half the noise the target needs. Increase batch_size, or lower max_step."
            )
        return tuning
    if name == "P5":
        gamma, beta = _inverse(I), math.inf
        top = lam_max(gamma)
        batch = _first(_halvings(batch, 1), lambda b: 4 * b / n * top <= max_step)
        h = 4 * sum(batch.values()) / n
        return _predict("P5", h, batch, beta, gamma, False, J, I, target_cov, n, None, 1.0)
    gamma, beta = J_inv, (math.inf if w2 == 0 else n / w2)
    top = lam_max(gamma)
    batch = _first(_halvings(batch, 1), lambda b: 4 * w1 * b / n * top <= max_step)
    b = sum(batch.values())
    h = 4 * w1 * b / (n + w1 * b)
    return _predict(name, h, batch, beta, gamma, False, J, I, target_cov, n, None, 1.0)


class _TooNoisy(ValueError):
    pass


def _predict(name, h, batch, beta, gamma, control_variates, J, I, target, n, hessians, limit):
    """Exact injected noise ``Λ`` for ``target`` (module docstring), prediction and cost.

    Raises :class:`_TooNoisy` when the gradient noise exceeds ``limit`` times the noise the
    target needs (in the metric of the needed noise).
    """
    b = sum(batch.values())
    diagonal = np.ndim(J) == 1
    noise = h * h / (4 * b)
    if diagonal:
        F = 1.0 - 0.5 * h * gamma * J
        residual = (1.0 - F * F) * target
        grad_noise = np.zeros_like(J) if control_variates else noise * gamma * I * gamma
    else:
        F = np.eye(J.shape[0]) - 0.5 * h * gamma @ J
        residual = target - F @ target @ F.T
        spread = _hessian_spread(hessians, target) if control_variates else I
        grad_noise = noise * gamma @ spread @ gamma.T
    if math.isinf(beta):
        lam = None
    else:
        fraction = _relative_size(grad_noise, residual)
        if fraction > limit:
            raise _TooNoisy(
                f"Row {name}: at batch size b = {b} the gradient noise is {fraction:.3g} of the "
                "noise the target covariance needs, so no injected noise can reach it. Increase "
                "batch_size."
            )
        lam = (beta / h) * (residual - grad_noise)
        lam = lam if diagonal else 0.5 * (lam + lam.T)
    if diagonal:
        injected = 0.0 if lam is None else (h / beta) * lam
        covariance = (grad_noise + injected) / (1.0 - F * F)
        tau = (1.0 + F) / (1.0 - F)
        worst = float(np.max(tau))
    else:
        covariance = theory.stationary_covariance(
            J,
            I,
            step_size=h,
            batch_size=b,
            num_data=n,
            inverse_temperature=beta,
            preconditioner=gamma,
            noise_preconditioner=lam,
            hessians=hessians,
            control_variates=control_variates,
        )
        tau = theory.autocorrelation_times(F, covariance)
        worst = float(theory.worst_autocorrelation_time(F, covariance)[0])
    cost = 2 * b if control_variates else b
    return dict(
        row=name,
        step_size=h,
        batch_size=batch,
        inverse_temperature=beta,
        preconditioner=gamma,
        noise_preconditioner=lam,
        control_variates=control_variates,
        target_covariance=target,
        covariance=covariance,
        autocorrelation_iterations=tau,
        mixing_iterations=worst,
        mixing_epochs=worst * cost / n,
        cost=cost,
    )


def _relative_size(part, whole) -> float:
    """``λmax(W^{-1/2} P W^{-1/2})``: how large ``part`` is in the metric of ``whole``."""
    if np.ndim(whole) == 1:
        return float(np.max(part / whole))
    L = np.linalg.cholesky(whole)
    M = np.linalg.solve(L, np.linalg.solve(L, part).T)
    return float(np.linalg.eigvalsh(0.5 * (M + M.T))[-1])


def _hessian_power_iteration(prepared, mode, rng_key, args, kwargs, num_rows, iterations=50):
    """``gamma -> λmax(ΓJ)`` for a diagonal ``Γ``, without forming ``J``.

    Power iteration on ``Γ^{1/2}(∇²U/n)Γ^{1/2}`` with Hessian-vector products of the potential
    on a random batch of about ``num_rows`` rows (which the plates scale by ``n_p/m_p``, an
    unbiased estimate of ``∇²U``). The estimate is raised by 10% for the iteration's
    shortfall and the batch's noise.
    """
    plates = prepared.plates
    n = sum(p.size for p in plates.values())
    keys = random.split(rng_key, len(plates) + 1)
    indices = {
        name: random.randint(k, (max(1, min(p.size, num_rows * p.size // n)),), 0, p.size)
        for k, (name, p) in zip(keys[1:], sorted(plates.items()), strict=True)
    }
    flat, unravel = ravel_pytree(mode)
    data, rebuild = split_args(args, kwargs)  # data as arguments, not compiled-in constants

    @jax.jit
    def power(scale, v, data):
        def potential(x):
            return prepared.potential_fn(unravel(x), Batch(indices), *rebuild(data)) / n

        def body(_, v):
            hv = jax.jvp(jax.grad(potential), (flat,), (scale * v,))[1] * scale
            return hv / jnp.linalg.norm(hv)

        v = jax.lax.fori_loop(0, iterations, body, v)
        hv = jax.jvp(jax.grad(potential), (flat,), (scale * v,))[1] * scale
        return jnp.vdot(v, hv)

    start = random.normal(keys[0], flat.shape, flat.dtype)
    start = start / jnp.linalg.norm(start)

    def lam_max(gamma):
        scale = jnp.sqrt(jnp.asarray(gamma, flat.dtype))
        return 1.1 * float(power(scale, start, data))

    return lam_max


def _halvings(batch, smallest):
    """``batch`` (plate -> b), then halved together while every plate stays ``>= smallest``."""
    yield batch
    while all(b // 2 >= smallest for b in batch.values()):
        batch = {k: b // 2 for k, b in batch.items()}
        yield batch


def _first(batches, ok):
    for batch in batches:
        if ok(sum(batch.values())):
            return batch
    raise ValueError(
        "No batch size satisfies the step-size bound h·λmax(ΓJ) <= max_step for this target; "
        "raise max_step."
    )


def _eig_extremes(gamma, J):
    """``(λmin, λmax)`` of the real parts of the eigenvalues of ``ΓJ``."""
    if np.ndim(J) == 1:
        product = np.asarray(gamma) * np.asarray(J)
        return float(product.min()), float(product.max())
    eig = np.linalg.eigvals(np.asarray(gamma) @ np.asarray(J)).real
    return float(eig.min()), float(eig.max())


def _hessian_spread(hessians, sigma):
    """``M(Σ) = (1/m)Σ_i H_i Σ H_i - H̄ Σ H̄`` (theory §3's control-variate term)."""
    if hessians is None:
        return np.zeros_like(sigma)
    H = np.asarray(hessians, np.float64)
    H_bar = H.mean(axis=0)
    spread = (H @ sigma @ H.transpose(0, 2, 1)).mean(axis=0)  # batched: O(m d³)
    return spread - H_bar @ sigma @ H_bar.T


def _build(
    tuning,
    setup_epochs,
    model,
    prepared,
    mode,
    info,
    warm,
    target,
    weights,
    num_steps,
    batch_sampling,
    args,
    kwargs,
):
    if num_steps is None:
        num_steps = max(1, int(round(tuning["mixing_iterations"] / 4)))
    constrain = prepared.postprocess_fn(args, kwargs)
    latent = [
        name
        for name, site in prepared.prototype_trace.items()
        if site["type"] == "sample" and not site["is_observed"]
    ]
    transforms = {name: biject_to(prepared.prototype_trace[name]["fn"].support) for name in latent}
    flat_mode, unravel = ravel_pytree(mode)

    def constrained_flat(x):
        values = constrain(unravel(x))
        return ravel_pytree({name: values[name] for name in latent})[0]

    constrained_covariance = None
    if np.ndim(tuning["covariance"]) == 2:
        jac = np.asarray(jax.jacfwd(constrained_flat)(flat_mode), np.float64)
        constrained_covariance = jac @ tuning["covariance"] @ jac.T
    constrained_mode = jax.tree.map(np.asarray, constrain(mode))
    as_spec = (
        (lambda p: Dense(jnp.asarray(p)))
        if np.ndim(tuning["preconditioner"]) == 2
        else (lambda p: Diagonal(info.unflatten(p)))
    )
    common = dict(
        batch_size=tuning["batch_size"]
        if len(tuning["batch_size"]) > 1
        else next(iter(tuning["batch_size"].values())),
        preconditioner=as_spec(tuning["preconditioner"]),
        num_steps=num_steps,
        batch_sampling=batch_sampling,
        init_strategy=init_to_value(values={k: constrained_mode[k] for k in latent}),
    )
    if math.isinf(tuning["inverse_temperature"]):
        kernel = SGD(model, tuning["step_size"], **common)
    else:
        cls = SGLDFP if tuning["control_variates"] else SGLD
        kernel = cls(
            model,
            tuning["step_size"],
            inverse_temperature=tuning["inverse_temperature"],
            noise_preconditioner=as_spec(tuning["noise_preconditioner"]),
            **common,
        )
    report = TuningReport(
        row=tuning["row"],
        algorithm=type(kernel).__name__,
        target=target,
        weights=weights,
        step_size=tuning["step_size"],
        batch_size=tuning["batch_size"],
        inverse_temperature=tuning["inverse_temperature"],
        preconditioner=tuning["preconditioner"],
        noise_preconditioner=tuning["noise_preconditioner"],
        control_variates=tuning["control_variates"],
        num_steps=num_steps,
        target_covariance=tuning["target_covariance"],
        covariance=tuning["covariance"],
        constrained_covariance=constrained_covariance,
        autocorrelation_iterations=tuning["autocorrelation_iterations"],
        mixing_iterations=tuning["mixing_iterations"],
        mixing_epochs=tuning["mixing_epochs"],
        gradient_evaluations_per_iteration=tuning["cost"],
        setup_epochs=setup_epochs,
        newton_step=tuning["newton_step"],
        num_data=warm.num_data,
        mode=mode,
        constrained_mode=constrained_mode,
        information=info,
        warm_start=warm,
        layout=info.layout,
        constrained_layout=flat_layout({k: constrained_mode[k] for k in latent}),
        transforms=transforms,
    )
    return kernel, report
