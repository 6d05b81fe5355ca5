"""SGLD, SGLD-FP and SGD-as-a-sampler: the meta-algorithm of ``docs/theory.md`` §2.

.. math::

    \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
              + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d)

All three are the Langevin integrator (:func:`~numpyro_sgmc.kernels.diffusions.langevin`) with a
choice of gradient estimator and inverse temperature: SGLD-FP is SGLD with control variates,
SGD is SGLD at ``β = ∞`` with the iterate average kept. They share one family record,
:data:`LANGEVIN_FAMILY` (:class:`~numpyro_sgmc.kernels.family.Family`), over
:class:`LangevinDynamics`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
from numpyro.infer.initialization import init_to_uniform

from numpyro_sgmc.host import device_array
from numpyro_sgmc.kernels import family
from numpyro_sgmc.kernels.adaptation import iterate_average
from numpyro_sgmc.kernels.auto_step import auto_spec
from numpyro_sgmc.kernels.checks import StepCheck
from numpyro_sgmc.kernels.core import build_kernel
from numpyro_sgmc.kernels.curvature import MARGIN, curvature
from numpyro_sgmc.kernels.diffusions import LangevinParams, langevin
from numpyro_sgmc.kernels.shell import SGMCKernel
from numpyro_sgmc.scales import check_type, prepare
from numpyro_sgmc.theory.linear import langevin_sd_ratio

__all__ = [
    "LANGEVIN_FAMILY",
    "SGD",
    "SGLD",
    "SGLDFP",
    "LangevinConfig",
    "LangevinDynamics",
    "build_langevin",
    "langevin_step_check",
]


class LangevinConfig(NamedTuple):
    """The static (hashable) description of a first-order kernel; its compiled code is keyed
    by it. Per-chain values (``h``, ``Γ``, ``Λ``) are in the state."""

    spec: object
    layout: object
    shards: object
    batch_sampling: str
    control_variates: bool
    chunk_size: int
    inverse_temperature: float
    average_after: Optional[int]  # SGD: warm-up iterations before the iterate average starts
    check_support: bool
    exclude: frozenset
    fed_rows: bool = False  # batches' rows given with each step (data.streaming)


class LangevinDynamics(NamedTuple):
    """A first-order kernel's own arguments, checked: ``h`` (or
    :class:`~numpyro_sgmc.kernels.auto_step.Auto`), ``β`` (``None`` for ``n``, ``inf`` for
    SGD), ``Γ`` and ``Λ`` as given (``None``: identity, and ``Λ = Γ``), whether the gradient
    has control variates (SGLD-FP) and whether the iterate average is kept (SGD)."""

    step_size: Any
    inverse_temperature: Optional[float]
    preconditioner: Any
    noise_preconditioner: Any
    control_variates: bool
    keeps_average: bool


def langevin_dynamics(step_size, beta, preconditioner, noise_preconditioner, control, average):
    """:class:`LangevinDynamics` from a constructor's arguments, each checked."""
    return LangevinDynamics(
        auto_spec(step_size) or family.check_step_size(step_size),
        family.check_positive("inverse_temperature", beta),
        check_type(preconditioner, "preconditioner"),
        check_type(noise_preconditioner, "noise_preconditioner"),
        bool(control),
        bool(average),
    )


def build_langevin(config: LangevinConfig):
    """The functional kernel (:func:`~numpyro_sgmc.kernels.core.build_kernel`) of ``config``."""
    estimator, valid = family.estimator_and_check(config)
    adaptation = None if config.average_after is None else iterate_average(config.average_after)
    return build_kernel(
        estimator, langevin(config.inverse_temperature), config.layout, adaptation, valid
    )


def langevin_step_check(step_size, curvature, batch_size, beta, control_variates) -> StepCheck:
    """The :class:`~numpyro_sgmc.kernels.checks.StepCheck` of a first-order kernel.

    Whitened by ``Γ`` and along its stiffest direction (``λ = λmax(ΓJ)``, per-datum gradient
    variance ``rλ`` there, ``r = tr(ΓI)/tr(ΓJ)``), the linearised chain's stationary sd over
    its target's ``1/sqrt(βλ)`` is ``sqrt((1 + hβrλ/(4b)) / (1 - hλ/4))``
    (:func:`~numpyro_sgmc.theory.linear.langevin_sd_ratio`, ``docs/theory.md`` §3): the
    discretisation and, without control variates, the gradient noise. ``inflation`` is that
    ratio less 1, from the point estimate ``λmax/1.1`` (``curvature.lam_max`` is raised by 10%
    as a margin for the stability bound, which ``stability`` keeps); ``suggested`` is the step
    whose sd is 10% wide. SGD (``β = ∞``) has no target: stability only.
    """
    h, lam = float(step_size), float(curvature.lam_max)
    if math.isinf(beta):
        return StepCheck(h, lam, curvature.noise_ratio, h * lam, 4.0, math.nan, 1.0 / lam)
    r = (
        0.0
        if control_variates or not math.isfinite(curvature.noise_ratio)
        else max(curvature.noise_ratio, 0.0)
    )
    estimate = lam / MARGIN  # the point estimate, without the stability bound's margin
    inflation = (
        langevin_sd_ratio(h, estimate, r * estimate, batch_size, beta) - 1
        if h * lam < 4
        else math.inf
    )
    # sd ratio 1.1: 1 + h·c = 1.21 (1 - hλ/4), c = βrλ/(4b)
    c = beta * r * estimate / (4.0 * batch_size)
    suggested = min(0.21 / (c + 0.3025 * estimate), 1.0 / lam)
    return StepCheck(h, lam, curvature.noise_ratio, h * lam, 4.0, inflation, suggested)


def _beta(dynamics: LangevinDynamics, num_data: int) -> float:
    """``β``: the given one, else ``n`` (the posterior)."""
    beta = dynamics.inverse_temperature
    return float(num_data if beta is None else beta)


def _make_config(dynamics: LangevinDynamics, options, prepared, shards, num_warmup_steps):
    return LangevinConfig(
        **family.common_config(dynamics, options, prepared, shards),
        inverse_temperature=_beta(dynamics, prepared.num_data),
        average_after=num_warmup_steps if dynamics.keeps_average else None,
    )


def _check_step(dynamics, prepared, position, params, rng_key, model_args, model_kwargs):
    found = curvature(
        prepared.spec, prepared.layout, position, params.preconditioner, rng_key, model_args,
        model_kwargs,
    )  # fmt: skip
    beta, b = _beta(dynamics, prepared.num_data), prepared.spec.batch_size
    return langevin_step_check(dynamics.step_size, found, b, beta, dynamics.control_variates)


def _stability_bound(dynamics) -> float:
    """4: the bound of ``h·λmax(ΓJ)`` (``docs/theory.md`` §3)."""
    return 4.0


def _adapts_mass(dynamics) -> bool:
    """False: the first-order kernels keep their preconditioners."""
    return False


def _chain_gamma(dynamics: LangevinDynamics, position, chain_init, where):
    own = chain_init.preconditioner is not None
    role = ("ChainInit." if own else "") + "preconditioner" + where
    return prepare(chain_init.preconditioner if own else dynamics.preconditioner, position, role)


def _step_scale(dynamics, position, chain_init, where):
    """This chain's ``Γ`` (``inverse=False``: the bound is on ``λmax(ΓJ)``)."""
    return _chain_gamma(dynamics, position, chain_init, where), False


def _chain_params(dynamics: LangevinDynamics, prepared, position, chain_init, where, step_size):
    gamma = _chain_gamma(dynamics, position, chain_init, where)
    own = chain_init.noise_preconditioner is not None
    spec = chain_init.noise_preconditioner if own else dynamics.noise_preconditioner
    role = ("ChainInit." if own else "") + "noise_preconditioner" + where
    lam = gamma if spec is None else prepare(spec, position, role)
    dtype = jnp.result_type(*[jnp.asarray(v) for v in position.values()])
    return LangevinParams(device_array(step_size, dtype), gamma, lam)


LANGEVIN_FAMILY = family.Family(
    "langevin", _make_config, build_langevin, _chain_params, _stability_bound, _step_scale,
    _check_step, _adapts_mass,
)  # fmt: skip
"""The first-order family (SGLD, SGLD-FP, SGD) over :class:`LangevinDynamics`."""


class _Langevin(SGMCKernel):
    """The first-order kernels' shared shell (SGLD, SGLDFP, SGD): a recipe of
    :data:`LANGEVIN_FAMILY`."""

    def __init__(self, model, dynamics: LangevinDynamics, options: tuple):
        super().__init__(
            model, family.Recipe.of(type(self).__name__, LANGEVIN_FAMILY, dynamics, options)
        )

    @property
    def inverse_temperature(self) -> Optional[float]:
        """``β`` (``n`` unless given; ``inf`` for SGD). Known after ``init``."""
        beta = self.recipe.dynamics.inverse_temperature
        if beta is not None or self.num_data is None:
            return beta
        return float(self.num_data)


class SGLD(_Langevin):
    """Stochastic gradient Langevin dynamics, optionally preconditioned.

    .. math::

        \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
                  + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d),

    with ``ĝ(θ) = (1/n)∇log p0(θ) + (1/b)Σ_{i∈B}∇l(θ; X_i)`` the minibatch average gradient
    (``docs/theory.md`` §1–§2), ``β = n`` by default (the posterior) and ``Λ = Γ`` by default.
    With ``ε = h/n`` this is ``θ' = θ - (ε/2)Γ∇Ũ(θ) + sqrt(ε)Γ^{1/2}ξ`` (Welling & Teh 2011;
    preconditioned: Li, Chen, Carlson & Carin 2016).

    What it samples: for small ``h·n/b`` the posterior (Table 1 rows P1, P2); at larger ``h``
    the stationary covariance is the discrete-Lyapunov solution of ``docs/theory.md`` §3, which
    :func:`numpyro_sgmc.theory.stationary_covariance` predicts. Mixing takes about
    ``4/(h·λmin(ΓJ))`` iterations; the chain is stable while ``h·λmax(ΓJ) < 4``.

    **Example** (the mean of 10,000 observations)::

        import jax
        import numpyro
        import numpyro.distributions as dist
        from numpyro.infer import MCMC
        from numpyro_sgmc import SGLD

        def model(y):
            mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
            with numpyro.plate("data", y.shape[0], subsample_size=100):
                numpyro.sample("y", dist.Normal(mu, 1.0), obs=numpyro.subsample(y, 0))

        y = 1.0 + jax.random.normal(jax.random.key(0), (10_000,))
        mcmc = MCMC(SGLD(model, step_size=0.01), num_warmup=50, num_samples=500)
        mcmc.run(jax.random.key(1), y)
        mcmc.print_summary()  # mu: mean ≈ 1.0, sd ≈ 0.01 (= 1/sqrt(n))

    **Automatic step.** ``step_size="auto"`` sets every chain's ``h`` at init, from its own
    start and preconditioner, to a fixed fraction of the stability bound,
    ``h = f·4/λmax(ΓJ)`` (``λmax`` by a power iteration with Hessian-vector products on a
    batch of rows, :mod:`numpyro_sgmc.kernels.auto_step`), and reports it in
    ``kernel.auto_step``: for models where :func:`~numpyro_sgmc.autotune` does not apply
    (neural networks, modes that are not isolated). It corrects neither the discretisation
    bias nor the gradient noise.

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param step_size: ``h``, on the average-gradient scale (``ε = h/n`` on the scale
        of the full potential), ``"auto"`` or
        :class:`~numpyro_sgmc.kernels.auto_step.Auto` settings.
    :param batch_size: ``None`` for each plate's ``subsample_size``; an int for every
        subsample plate; or ``{plate name: int}``. ``batch_size = n`` means full-data
        gradients.
    :param inverse_temperature: ``β``; ``None`` for ``n``, the total number of data over the
        subsample plates (the posterior); ``n/w`` tempers it by ``w`` (rows B and G of Table 1).
    :param preconditioner: ``Γ``: ``None`` (identity), :class:`~numpyro_sgmc.Diagonal`,
        :func:`~numpyro_sgmc.layerwise` or :class:`~numpyro_sgmc.Dense`, over the
        unconstrained parameters; the same for every chain unless
        :class:`~numpyro_sgmc.ChainInit` gives per-chain values.
    :param noise_preconditioner: ``Λ``; ``None`` for ``Λ = Γ``.
    :param str batch_sampling: ``"with_replacement"`` (default), ``"without_replacement"``,
        ``"epochs"`` or ``"blocks"`` (:mod:`~numpyro_sgmc.data.batches`); all O(b) per step.
    :param int num_steps: iterations per MCMC draw (default 100, as HMC's leapfrog steps):
        ``num_samples`` draws cost ``num_samples · num_steps`` iterations. ``1`` keeps every
        iterate.
    :param init_strategy: NumPyro init strategy for chains not given ``init_params``.
    :param int chunk_size: rows per plate evaluated at once for full-data gradients.
    :param int progress_draws: show a progress bar in epochs for a run of this many draws
        (warm-up included; :class:`~numpyro_sgmc.data.progress.EpochProgress`), updated from inside
        the compiled loop about 100 times; for ``MCMC(..., progress_bar=False)``.
    """

    _control_variates = False

    def __init__(
        self,
        model,
        step_size,
        *,
        inverse_temperature=None,
        preconditioner=None,
        noise_preconditioner=None,
        batch_size=None,
        batch_sampling="with_replacement",
        num_steps=100,
        init_strategy=init_to_uniform,
        chunk_size=65536,
        progress_draws=None,
    ):
        if inverse_temperature is not None and math.isinf(float(inverse_temperature)):
            raise ValueError(
                "inverse_temperature=inf removes the noise: that is SGD, use numpyro_sgmc.SGD."
            )
        dynamics = langevin_dynamics(
            step_size, inverse_temperature, preconditioner, noise_preconditioner,
            self._control_variates, False,
        )  # fmt: skip
        options = (batch_size, batch_sampling, num_steps, init_strategy, chunk_size, progress_draws)
        super().__init__(model, dynamics, options)


class SGLDFP(SGLD):
    """SGLD with control variates around a centre ``θ̂`` ("SGLD-FP", fixed point).

    The update is :class:`SGLD`'s with the gradient estimate

    .. math::

        \\hat g_{cv}(\\theta) = \\tfrac{1}{n}\\nabla\\log p_0(\\theta) + \\bar g(\\hat\\theta)
            + \\tfrac{1}{b}\\textstyle\\sum_{i\\in B}
              [\\nabla l(\\theta; X_i) - \\nabla l(\\hat\\theta; X_i)],

    where ``ḡ(θ̂) = (1/n)Σ_i ∇l(θ̂; X_i)`` is computed once, over all the data, at ``init``
    (``docs/theory.md`` §1; Baker, Fearnhead, Fox & Nemeth 2019). Near ``θ̂`` the gradient
    noise vanishes, so with ``h = c_h/n`` it samples the posterior at a cost per unit mixing
    time linear in ``n`` (Table 1 rows P3, P4).

    The centre is each chain's starting position: start at the mode
    (``init_strategy=init_to_value(values=map_estimate)`` or ``init_params``), or give
    ``ChainInit(centre=...)``. A centre far from a mode raises a
    :class:`~numpyro_sgmc.diagnostics.CentreWarning`. The arguments are :class:`SGLD`'s.
    """

    _control_variates = True


class SGD(_Langevin):
    """Stochastic gradient descent used as a sampler (``β = ∞``).

    .. math::

        \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)

    Its iterates fluctuate around the mode with a stationary covariance set by the gradient
    noise (``docs/theory.md`` §3–§4). With ``Γ = J⁻¹`` and ``h = 4b/n`` that covariance is
    ``S/n``, the sandwich ``J⁻¹IJ⁻¹`` (Table 1 row F, the local fiducial distribution,
    mixing in about one epoch); with ``Γ = I⁻¹`` and ``h = 4b/n`` it is ``J⁻¹/n`` (row P5).
    The iterates are the draws (``z``); the running mean of the iterates after warm-up is
    ``state.adaptation.average`` (collect it with ``extra_fields=("adaptation.average",)``),
    whose covariance after ``m`` epochs approaches ``S/(n m)`` (row A).

    The arguments are :class:`SGLD`'s without ``inverse_temperature`` and
    ``noise_preconditioner`` (there is no noise).
    """

    def __init__(
        self,
        model,
        step_size,
        *,
        preconditioner=None,
        batch_size=None,
        batch_sampling="with_replacement",
        num_steps=100,
        init_strategy=init_to_uniform,
        chunk_size=65536,
        progress_draws=None,
    ):
        dynamics = langevin_dynamics(step_size, math.inf, preconditioner, None, False, True)
        options = (batch_size, batch_sampling, num_steps, init_strategy, chunk_size, progress_draws)
        super().__init__(model, dynamics, options)
