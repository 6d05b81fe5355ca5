"""``step_size="auto"``: each chain's ``h`` at a fixed fraction of its stability bound.

Every kernel's step is ``h`` on the average-gradient scale and, linearised at a point, stable
while ``h·λmax(PJ) < B`` (``docs/theory.md`` §3, §5): ``P = Γ`` and ``B = 4`` for the
first-order kernels (SGLD, SGLD-FP, SGD); ``P = M⁻¹`` and ``B = 2(2 - α)`` for SGHMC with its
default friction ``C = (α/η) M`` (in Chen et al.'s step ``η = sqrt(h/n)`` the bound reads
``η²nλmax < 2(2 - α)``). With ``step_size="auto"`` a kernel sets, at ``init`` and for every
chain ``k`` separately (at its own start, with its own preconditioner or mass),

.. math::

    h_k = f\\,\\frac{B}{\\hat\\lambda_k}, \\qquad
    \\hat\\lambda_k = 1.1\\,\\lambda_{\\max}(P_k J(\\theta_k)),

with ``J = ∇²U/n`` from Hessian-vector products on a fixed batch of :data:`NUM_ROWS` random
rows (:func:`~numpyro_sgmc.kernels.curvature.random_rows`; the plates scale the batch to an unbiased
estimate of ``∇²U``), :data:`ITERATIONS` steps of the power iteration on ``PJ`` ending with the
Rayleigh quotient ``vᵀJv / vᵀP⁻¹v``, raised by 10% for the iteration's shortfall and the
batch's noise (as :func:`~numpyro_sgmc.kernels.curvature.largest_eigenvalue`), and the fraction
``f =`` :data:`FRACTION`. Away from a strict minimum the eigenvalue of largest magnitude can be
negative (a saddle direction the mass leaves unscaled); the power iteration is then run again
on ``PJ - λ₋I``, whose top eigenvalue is ``λmax - λ₋``: the step is set by the largest
positive curvature, the one that limits stability. The kernel reports the choice as its
``auto_step`` (:class:`AutoStep`): one ``h``, ``λ̂`` per chain.

**The fraction.** ``f`` is a fixed constant, not tuned per model. On the step-size sweep of
``benchmarks/bde_anchor.py`` (SGHMC from ``K`` Adam modes with first-moment masses, zero
warm-up, seed 0, ``f`` in 0.05, 0.1, 0.2, 0.4, 0.8; airfoil, concrete and bike sharing with
``sklearn-contrib-bde``'s network, diabetes and digits with the networks of
``benchmarks/deep_ensembles.py``) the best ``f`` differs between data sets: 0.05 (bike
sharing, diabetes), 0.1 (airfoil, digits), 0.4 (concrete). ``f = 0.8`` diverges on diabetes,
and ``f = 0.05`` loses 30% of concrete's test LPPD (its chains stay near their modes).
``f = 0.2`` is within 10% of the sweep's best test LPPD on all five (the largest gap 5.2%, on
concrete), with no divergent step. The table is in ``benchmarks/README.md``.

What the rule does not do: it bounds the stiffest direction only, so it neither corrects the
discretisation bias nor the gradient noise's inflation of the stationary law
(:func:`~numpyro_sgmc.autotune` does, for the targets of Table 1); and it looks at each chain's
start, so a chain that travels to a region of higher curvature can still turn unstable there
(its divergent steps are rejected and counted).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax import random
from numpyro.util import not_jax_tracer

from numpyro_sgmc.kernels.curvature import largest_eigenvalue

__all__ = [
    "FRACTION",
    "ITERATIONS",
    "NUM_ROWS",
    "Auto",
    "AutoStep",
    "auto_spec",
    "choose_step_sizes",
]

FRACTION = 0.2
"""``f``: the fraction of the stability bound (chosen from the step-size sweep, module
docstring)."""
NUM_ROWS = 4096
"""Random rows of the Hessian-vector products."""
ITERATIONS = 50
"""Steps of the power iteration."""


class Auto(NamedTuple):
    """The automatic step's settings: ``step_size=Auto(...)``; ``step_size="auto"`` is
    ``Auto()``.

    :param float fraction: ``f``, the fraction of the stability bound (default
        :data:`FRACTION`); ``0 < f < 1``.
    :param int num_rows: rows of the Hessian-vector products (default :data:`NUM_ROWS`).
    :param int iterations: steps of the power iteration (default :data:`ITERATIONS`).
    """

    fraction: float = FRACTION
    num_rows: int = NUM_ROWS
    iterations: int = ITERATIONS


class AutoStep(NamedTuple):
    """What ``step_size="auto"`` chose (``kernel.auto_step`` after ``init``).

    :param step_size: ``(K,)`` ``h`` of every chain (``K = 1`` for one chain).
    :param lam_max: ``(K,)`` ``λ̂ = 1.1·λmax(PJ)`` at every chain's start.
    :param float bound: the stability bound ``B`` of ``h·λmax`` (4, or ``2(2 - α)``).
    :param float fraction: ``f``: every chain has ``h·λ̂ = f·B``.
    :param int num_rows: rows of the Hessian-vector products.
    """

    step_size: np.ndarray
    lam_max: np.ndarray
    bound: float
    fraction: float
    num_rows: int

    def __str__(self) -> str:
        chains = ", ".join(
            f"{k}: h = {h:.4g} (λmax = {lam:.4g})"
            for k, (h, lam) in enumerate(zip(self.step_size, self.lam_max, strict=True))
        )
        return (
            f"step_size='auto': h = {self.fraction:g} × {self.bound:.3g} / λmax per chain "
            f"(λmax from {self.num_rows} rows, raised by 10%); {chains}"
        )


def choose_step_sizes(
    spec: Auto,
    kernel_name: str,
    bound: float,
    step_scale,
    prepared,
    z,
    chain_init,
    rng_key,
    model_args,
    model_kwargs,
    batched: bool,
) -> AutoStep:
    """Every chain's ``h = f·B/λ̂`` at its start (module docstring).

    :param spec: the :class:`Auto` settings.
    :param kernel_name: for the messages.
    :param bound: ``B``, the family's stability bound of ``h·λmax(PJ)``.
    :param step_scale: ``step_scale(position, chain_init, where) -> (P, inverse)``, a chain's
        scale (its inverse is ``P`` with ``inverse=True``), from the kernel's
        :class:`~numpyro_sgmc.kernels.family.Family`.
    :param prepared: the prepared model.
    :param z: the chains' starts, unconstrained, with a leading chain axis when ``batched``.
    :param chain_init: the :class:`~numpyro_sgmc.ChainInit` (per-chain preconditioners).
    :param rng_key: one key (the rows and the power iteration's start of every chain).
    :raises ValueError: ``init`` runs under a JAX transformation (``chain_method="parallel"``),
        or the curvature at a chain's start is not positive and finite.
    """
    if not not_jax_tracer(jax.tree.leaves(z)[0]):
        raise ValueError(
            f"{kernel_name}(step_size='auto') chooses the step from concrete values "
            "at init; with chain_method='parallel' init is traced. Use chain_method="
            "'vectorized' or 'sequential', or give a number."
        )
    num_chains = jax.tree.leaves(z)[0].shape[0] if batched else 1
    keys = random.split(rng_key, num_chains)
    lams = []
    for c in range(num_chains):
        own = chain_init._replace(params=z, centre=None)
        if batched:
            own = jax.tree.map(lambda v, c=c: v[c], own)
        where = f" of chain {c}" if batched else ""
        scale, inverse = step_scale(own.params, own, where)
        lam = largest_eigenvalue(
            prepared.spec, prepared.layout, own.params, scale, keys[c], model_args, model_kwargs,
            num_rows=spec.num_rows, iterations=spec.iterations, inverse=inverse, positive=True,
        )  # fmt: skip
        if not (np.isfinite(lam) and lam > 0):
            raise ValueError(
                f"step_size='auto' found λmax = {lam:.4g} at the start{where}: the potential "
                "has no positive curvature there (a flat or non-finite log-density). Start "
                "at a mode, or give a number."
            )
        lams.append(lam)
    lam_max = np.asarray(lams)
    return AutoStep(spec.fraction * bound / lam_max, lam_max, bound, spec.fraction, spec.num_rows)


def auto_spec(step_size):
    """The :class:`Auto` settings ``step_size`` asks for (``"auto"`` or an :class:`Auto`), or
    ``None`` for a number.

    :raises TypeError: another string (a number given as text is not converted).
    :raises ValueError: settings out of range.
    """
    if isinstance(step_size, str):
        if step_size != "auto":
            raise TypeError(f"step_size must be a positive number or 'auto', got {step_size!r}.")
        return Auto()
    if not isinstance(step_size, Auto):
        return None
    fraction = float(step_size.fraction)
    if not 0 < fraction < 1:
        raise ValueError(
            f"Auto(fraction=...) is a fraction of the stability bound in (0, 1), got {fraction}."
        )
    for name in ("num_rows", "iterations"):
        value = getattr(step_size, name)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Auto({name}=...) must be a positive int, got {value!r}.")
    return Auto(fraction, int(step_size.num_rows), int(step_size.iterations))
