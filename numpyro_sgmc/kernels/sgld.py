"""SGLD, SGLD-FP and SGD-as-a-sampler: the meta-algorithm of ``docs/theory.md`` §2.

.. math::

    \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
              + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d)

All three are the Langevin integrator (:func:`~numpyro_sgmc.kernels.diffusions.langevin`) with a
choice
of gradient estimator and inverse temperature: SGLD-FP is SGLD with control variates, SGD is
SGLD at ``β = ∞`` with the iterate average kept.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax.numpy as jnp
from numpyro.distributions.transforms import IdentityTransform, IndependentTransform
from numpyro.infer.initialization import init_to_uniform

from numpyro_sgmc.kernels.adaptation import iterate_average
from numpyro_sgmc.kernels.auto_step import auto_spec
from numpyro_sgmc.kernels.checks import StepCheck
from numpyro_sgmc.kernels.core import build_kernel
from numpyro_sgmc.kernels.curvature import curvature
from numpyro_sgmc.kernels.diffusions import LangevinParams, langevin
from numpyro_sgmc.kernels.shell import (
    KernelOptions,
    SGMCKernel,
    check_step_size,
    estimator_for,
    valid_constrained,
)
from numpyro_sgmc.scales import check_type, prepare

__all__ = ["SGD", "SGLD", "SGLDFP", "LangevinConfig", "build_langevin", "langevin_step_check"]


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


def build_langevin(config: LangevinConfig):
    """The functional kernel (:func:`~numpyro_sgmc.kernels.core.build_kernel`) of ``config``."""
    estimator = estimator_for(
        config.spec,
        config.shards,
        config.batch_sampling,
        config.control_variates,
        config.chunk_size,
    )
    adaptation = None if config.average_after is None else iterate_average(config.average_after)
    valid = valid_constrained(config.spec, config.exclude) if config.check_support else None
    return build_kernel(
        estimator, langevin(config.inverse_temperature), config.layout, adaptation, valid
    )


def langevin_step_check(step_size, curvature, batch_size, beta, control_variates) -> StepCheck:
    """The :class:`~numpyro_sgmc.kernels.checks.StepCheck` of a first-order kernel.

    Whitened by ``Γ`` and along its stiffest direction (``λ = λmax(ΓJ)``, ``I ≈ rλ``), the
    linearised chain's stationary variance against its target ``1/(βλ)`` is
    ``(1 + hβrλ/(4b)) / (1 - hλ/4)`` (``docs/theory.md`` §3): the discretisation and, without
    control variates, the gradient noise. SGD (``β = ∞``) has no target: stability only.
    """
    h, lam = float(step_size), float(curvature.lam_max)
    if math.isinf(beta):
        return StepCheck(h, lam, curvature.noise_ratio, h * lam, 4.0, math.nan, 1.0 / lam)
    r = (
        0.0
        if control_variates or not math.isfinite(curvature.noise_ratio)
        else curvature.noise_ratio
    )
    c = beta * max(r, 0.0) * lam / (4.0 * batch_size)
    inflation = (1 + h * c) / (1 - h * lam / 4) - 1 if h * lam < 4 else math.inf
    suggested = min(0.1 / (c + 0.275 * lam), 1.0 / lam)
    return StepCheck(h, lam, curvature.noise_ratio, h * lam, 4.0, inflation, suggested)


def needs_support_check(prepared) -> bool:
    """Whether a finite unconstrained position can map to a non-finite constrained value."""

    def identity(t):
        while isinstance(t, IndependentTransform):
            t = t.base_transform
        return isinstance(t, IdentityTransform)

    return not all(identity(t) for t in prepared.transforms.values())


class _Langevin(SGMCKernel):
    """The first-order kernels' shared construction (SGLD, SGLDFP, SGD)."""

    _build = staticmethod(build_langevin)
    _keeps_average = False

    def _configure(self, step_size, inverse_temperature, preconditioner, noise_preconditioner):
        self._step_size = auto_spec(step_size) or check_step_size(step_size)
        if inverse_temperature is not None:
            beta = float(inverse_temperature)
            if not beta > 0:
                raise ValueError(f"inverse_temperature must be positive, got {beta!r}.")
            inverse_temperature = beta
        self._inverse_temperature = inverse_temperature
        self._preconditioner = check_type(preconditioner, "preconditioner")
        self._noise_preconditioner = check_type(noise_preconditioner, "noise_preconditioner")

    @property
    def step_size(self):
        """``h``, on the average-gradient scale, or the
        :class:`~numpyro_sgmc.kernels.auto_step.Auto` settings of ``step_size="auto"`` (each
        chain's ``h`` is in ``auto_step`` after ``init``)."""
        return self._step_size

    @property
    def inverse_temperature(self) -> Optional[float]:
        """``β`` (``n`` unless given; ``inf`` for SGD). Known after ``init``."""
        if self._inverse_temperature is not None:
            return self._inverse_temperature
        return None if self._prepared is None else float(self.num_data)

    def _make_config(self, prepared, shards, num_warmup_steps):
        return LangevinConfig(
            spec=prepared.spec,
            layout=prepared.layout,
            shards=shards,
            batch_sampling=self._batch_sampling,
            control_variates=self._control_variates,
            chunk_size=self._chunk_size,
            inverse_temperature=float(
                prepared.num_data
                if self._inverse_temperature is None
                else self._inverse_temperature
            ),
            average_after=num_warmup_steps if self._keeps_average else None,
            check_support=needs_support_check(prepared),
            exclude=prepared.per_datum_sites,
        )

    def _check_step(self, prepared, position, params, rng_key, model_args, model_kwargs):
        found = curvature(
            prepared.spec, prepared.layout, position, params.preconditioner, rng_key, model_args,
            model_kwargs,
        )  # fmt: skip
        beta = float(self.inverse_temperature)
        b = prepared.spec.batch_size
        return langevin_step_check(self._step_size, found, b, beta, self._control_variates)

    def _stability_bound(self) -> float:
        """4: the bound of ``h·λmax(ΓJ)`` (``docs/theory.md`` §3)."""
        return 4.0

    def _step_scale(self, prepared, position, chain_init, where):
        """This chain's ``Γ`` (``inverse=False``: the bound is on ``λmax(ΓJ)``)."""
        return self._chain_gamma(position, chain_init, where), False

    def _chain_gamma(self, position, chain_init, where):
        own = chain_init.preconditioner is not None
        role = ("ChainInit." if own else "") + "preconditioner" + where
        return prepare(chain_init.preconditioner if own else self._preconditioner, position, role)

    def _chain_params(self, prepared, position, chain_init, where, step_size):
        gamma = self._chain_gamma(position, chain_init, where)
        own = chain_init.noise_preconditioner is not None
        spec = chain_init.noise_preconditioner if own else self._noise_preconditioner
        role = ("ChainInit." if own else "") + "noise_preconditioner" + where
        lam = gamma if spec is None else prepare(spec, position, role)
        dtype = jnp.result_type(*[jnp.asarray(v) for v in position.values()])
        return LangevinParams(jnp.asarray(step_size, dtype), gamma, lam)


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

    def __init__(
        self,
        model,
        step_size,
        *,
        batch_size=None,
        inverse_temperature=None,
        preconditioner=None,
        noise_preconditioner=None,
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
        options = (batch_size, batch_sampling, num_steps, init_strategy, chunk_size, progress_draws)
        super().__init__(model, KernelOptions(*options))
        self._configure(step_size, inverse_temperature, preconditioner, noise_preconditioner)


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

    _keeps_average = True

    def __init__(
        self,
        model,
        step_size,
        *,
        batch_size=None,
        preconditioner=None,
        batch_sampling="with_replacement",
        num_steps=100,
        init_strategy=init_to_uniform,
        chunk_size=65536,
        progress_draws=None,
    ):
        options = (batch_size, batch_sampling, num_steps, init_strategy, chunk_size, progress_draws)
        super().__init__(model, KernelOptions(*options))
        self._configure(step_size, math.inf, preconditioner, None)
