"""SGHMC and AdaSGHMC: the second-order kernels of ``docs/theory.md`` §5–§6.

.. math::

    r' = r - \\eta\\,\\nabla\\tilde U(\\theta) - \\eta\\, C M^{-1} r
         + \\sqrt{2\\eta T}\\,(C - \\hat B)^{1/2}\\xi, \\qquad
    \\theta' = \\theta + \\eta\\, M^{-1} r', \\qquad \\eta = \\sqrt{h/n}

(Chen, Fox & Guestrin 2014), the :func:`~numpyro_sgmc.kernels.diffusions.sghmc` integrator with the
same estimators as the first-order kernels. ``step_size`` is ``h`` on the average-gradient
scale, as for every kernel (:mod:`numpyro_sgmc.kernels.diffusions`): Chen et al.'s ``ε`` is
``η = sqrt(h/n)`` and the learning rate of their momentum form is ``h/n``. Both share one
family record, :data:`SGHMC_FAMILY` (:class:`~numpyro_sgmc.kernels.family.Family`), over
:class:`SGHMCDynamics`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from numpyro.infer.initialization import init_to_uniform
from numpyro.util import not_jax_tracer

from numpyro_sgmc.kernels import family
from numpyro_sgmc.kernels.adaptation import mass_adaptation
from numpyro_sgmc.kernels.auto_step import Auto, auto_spec
from numpyro_sgmc.kernels.checks import StepCheck
from numpyro_sgmc.kernels.core import build_kernel
from numpyro_sgmc.kernels.curvature import MARGIN, curvature
from numpyro_sgmc.kernels.diffusions import sghmc, sghmc_params
from numpyro_sgmc.kernels.shell import SGMCKernel
from numpyro_sgmc.scales import Diagonal, check_type, is_dense, is_sized, prepare
from numpyro_sgmc.theory.sghmc import default_friction, sghmc_prediction

__all__ = [
    "SGHMC",
    "SGHMC_FAMILY",
    "AdaSGHMC",
    "SGHMCConfig",
    "SGHMCDynamics",
    "build_sghmc",
    "sghmc_step_check",
]


class SGHMCConfig(NamedTuple):
    """The static (hashable) description of an SGHMC kernel; per-chain values are in the
    state (:class:`~numpyro_sgmc.kernels.diffusions.SGHMCParams`)."""

    spec: object
    layout: object
    shards: object
    batch_sampling: str
    control_variates: bool
    chunk_size: int
    num_data: int
    temperature: float
    momentum_decay: Optional[float]  # None when the friction is given
    adaptation_window: Optional[float]  # AdaSGHMC
    num_warmup_steps: int
    check_support: bool
    exclude: frozenset
    fed_rows: bool = False  # batches' rows given with each step (data.streaming)


class SGHMCDynamics(NamedTuple):
    """An SGHMC kernel's own arguments, checked: ``h`` (or
    :class:`~numpyro_sgmc.kernels.auto_step.Auto`), ``M`` as given, ``C`` and ``B̂`` as
    scale specs (a number, a :class:`~numpyro_sgmc.Diagonal` or ``None``), ``α``, ``β``
    (``None`` for ``n``), control variates, and AdaSGHMC's ``adaptation_window`` (``None``:
    a static mass)."""

    step_size: Any
    mass: Any
    friction: Any
    momentum_decay: float
    gradient_noise: Any
    inverse_temperature: Optional[float]
    control_variates: bool
    adaptation_window: Optional[float]


def _with_mass(config: SGHMCConfig, params, mass):
    """The parameters for a new mass (the default friction ``C = (α/η) M`` follows it)."""
    d = config.layout.size
    friction = params.friction
    if config.momentum_decay is not None:
        friction = default_friction(
            config.momentum_decay, params.step_size, config.num_data, mass, d
        )
    return sghmc_params(
        params.step_size,
        config.num_data,
        config.temperature,
        mass,
        friction,
        params.gradient_noise,
        d,
    )


def build_sghmc(config: SGHMCConfig):
    """The functional kernel (:func:`~numpyro_sgmc.kernels.core.build_kernel`) of ``config``."""
    estimator, valid = family.estimator_and_check(config)
    adaptation = None
    if config.adaptation_window is not None:
        adaptation = mass_adaptation(
            config.adaptation_window,
            config.num_warmup_steps,
            config.num_data,
            partial(_with_mass, config),
        )
    integrator = sghmc(config.num_data, config.temperature)
    return build_kernel(estimator, integrator, config.layout, adaptation, valid)


def sghmc_step_check(step_size, curvature, num_data, batch_size, temperature, alpha, control):
    """The :class:`~numpyro_sgmc.kernels.checks.StepCheck` of SGHMC with its default friction:
    the 1-d linearised chain (``docs/theory.md`` §5) along the stiffest direction of ``M⁻¹J``
    (``λ = λmax``, ``I ≈ rλ``) against its target ``T/(nλ)``; stable while
    ``hλ < 2(2 - α)``. ``inflation`` is the predicted ratio of the position's sd to the
    target's, less 1, from the point estimate ``λmax/1.1`` (``curvature.lam_max`` is raised
    by 10% as a margin for the stability bound, which ``stability`` keeps)."""
    h, lam, n = float(step_size), float(curvature.lam_max), int(num_data)
    bound = 2.0 * (2.0 - alpha)
    r = curvature.noise_ratio if math.isfinite(curvature.noise_ratio) else 0.0
    minibatch = batch_size < n and not control and r > 0
    beta = math.inf if temperature == 0 else n / temperature
    estimate = lam / MARGIN  # the point estimate, without the stability bound's margin

    def inflation(h):
        if h * lam >= bound:
            return math.inf
        law = sghmc_prediction(
            np.array([estimate]), num_data=n, step_size=h, momentum_decay=alpha,
            inverse_temperature=beta, I=np.array([r * estimate]) if minibatch else None,
            batch_size=batch_size if minibatch else None,
        )  # fmt: skip
        variance = float(law.position_covariance[0, 0]) * n * estimate / max(temperature, 1e-300)
        return math.sqrt(variance) - 1

    if temperature == 0:
        return StepCheck(h, lam, r, h * lam, bound, math.nan, 1.0 / lam)
    low, high = 0.0, min(h, bound / lam)  # the largest step with inflation <= 10%
    if inflation(high) <= 0.1:
        low = high
    for _ in range(40):
        if high - low <= 1e-3 * high:
            break
        mid = 0.5 * (low + high)
        low, high = (mid, high) if inflation(mid) <= 0.1 else (low, mid)
    return StepCheck(h, lam, r, h * lam, bound, inflation(h), max(low, 1e-12))


def _diagonal_spec(spec, role: str, allow_zero: bool):
    """``None``, a number, a dict ``{site: value}`` or a scale -> a scale spec or ``None``."""
    if spec is None or is_sized(spec):
        return spec
    if isinstance(spec, dict):
        return Diagonal(dict(spec))
    if isinstance(spec, (str, bytes, bool)) or np.ndim(spec) != 0:
        raise TypeError(
            f"{role} must be None, a number, a dict {{site: value}} or a Diagonal; got "
            f"{type(spec).__name__}."
        )
    value = float(spec)
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        raise ValueError(
            f"{role} must be {'non-negative' if allow_zero else 'positive'}, got {value}."
        )
    return value


def _resolve(spec, position, role, allow_zero=False):
    """A prepared scale for a ``_diagonal_spec`` (a number covers every site)."""
    if spec is None:
        return None
    if isinstance(spec, float):
        spec = Diagonal({k: spec for k in position})
    return prepare(spec, position, role, allow_zero)


def sghmc_dynamics(step_size, mass, friction, alpha, noise, beta, control, window):
    """:class:`SGHMCDynamics` from a constructor's arguments, each checked."""
    step_size = auto_spec(step_size) or family.check_step_size(step_size)
    friction = _diagonal_spec(friction, "friction", allow_zero=False)
    if isinstance(step_size, Auto) and friction is not None:
        raise ValueError(
            "step_size='auto' sets h from the stability bound h·λmax(M⁻¹J) < 2(2 - α) of "
            "the default friction C = (α/η) M; a given friction has no single bound. Drop "
            "friction= or give a number."
        )
    try:
        alpha = float(alpha)
    except (TypeError, ValueError):
        raise TypeError(f"momentum_decay must be a number, got {alpha!r}.") from None
    if not 0 < alpha <= 1:
        raise ValueError(
            "momentum_decay must be in (0, 1] (the fraction of momentum lost per step), "
            f"got {alpha}."
        )
    return SGHMCDynamics(
        step_size,
        check_type(mass, "mass"),
        friction,
        alpha,
        _diagonal_spec(noise, "gradient_noise", allow_zero=True),
        family.check_positive("inverse_temperature", beta),
        bool(control),
        window,
    )


def _temperature(dynamics: SGHMCDynamics, num_data: int) -> float:
    """``T = n/β`` (1 for the posterior, 0 for ``β = ∞``)."""
    beta = dynamics.inverse_temperature
    return 1.0 if beta is None else (0.0 if math.isinf(beta) else num_data / beta)


def _make_config(dynamics: SGHMCDynamics, options, prepared, shards, num_warmup_steps):
    return SGHMCConfig(
        **family.common_config(dynamics, options, prepared, shards),
        num_data=prepared.num_data,
        temperature=_temperature(dynamics, prepared.num_data),
        momentum_decay=dynamics.momentum_decay if dynamics.friction is None else None,
        adaptation_window=dynamics.adaptation_window,
        num_warmup_steps=num_warmup_steps,
    )


def _check_step(dynamics, prepared, position, params, rng_key, model_args, model_kwargs):
    if dynamics.friction is not None:  # a given friction has no single stability bound
        return None
    found = curvature(
        prepared.spec, prepared.layout, position, params.mass, rng_key, model_args,
        model_kwargs, inverse=True,
    )  # fmt: skip
    n = prepared.num_data
    return sghmc_step_check(
        dynamics.step_size, found, n, prepared.spec.batch_size, _temperature(dynamics, n),
        dynamics.momentum_decay, dynamics.control_variates,
    )  # fmt: skip


def _stability_bound(dynamics: SGHMCDynamics) -> float:
    """``2(2 - α)``: the default friction's bound of ``h·λmax(M⁻¹J)`` (``docs/theory.md``
    §5)."""
    return 2.0 * (2.0 - dynamics.momentum_decay)


def _adapts_mass(dynamics: SGHMCDynamics) -> bool:
    """Whether warm-up adapts the mass (AdaSGHMC)."""
    return dynamics.adaptation_window is not None


def _chain_mass(dynamics: SGHMCDynamics, position, chain_init, where):
    own = chain_init.preconditioner is not None
    role = ("ChainInit.preconditioner" if own else "mass") + where
    mass = prepare(chain_init.preconditioner if own else dynamics.mass, position, role)
    if dynamics.adaptation_window is not None and is_dense(mass):
        raise ValueError(
            "AdaSGHMC adapts a diagonal mass matrix; give an Identity or Diagonal initial mass."
        )
    return mass


def _step_scale(dynamics, position, chain_init, where):
    """This chain's mass, and ``inverse=True``: the bound is on ``λmax(M⁻¹J)``."""
    return _chain_mass(dynamics, position, chain_init, where), True


def _chain_params(dynamics: SGHMCDynamics, prepared, position, chain_init, where, step_size):
    mass = _chain_mass(dynamics, position, chain_init, where)
    n, d = prepared.num_data, prepared.layout.size
    dtype = jnp.result_type(*[jnp.asarray(v) for v in position.values()])
    h = jnp.asarray(step_size, dtype)
    noise = _resolve(dynamics.gradient_noise, position, "gradient_noise" + where, True)
    default = dynamics.friction is None
    if default:
        if noise is not None and is_dense(mass):
            raise ValueError(
                "gradient_noise with the default friction C = (α/η) M needs a diagonal mass "
                "matrix; pass a diagonal friction= as well, or drop gradient_noise."
            )
        friction = default_friction(dynamics.momentum_decay, h, n, mass, d)
    else:
        friction = _resolve(dynamics.friction, position, "friction" + where)
    if noise is not None:
        excess = np.asarray((friction - noise).diagonal(d))
        if not_jax_tracer(excess) and np.any(excess < 0):
            raise ValueError(
                "The injected noise variance 2ηT(C - B̂) is negative somewhere: gradient_noise "
                "B̂ exceeds the friction C"
                + (" = (α/η) M" if default else "")
                + ". Lower gradient_noise or raise "
                + ("momentum_decay." if default else "friction.")
            )
    return sghmc_params(h, n, _temperature(dynamics, n), mass, friction, noise, d)


SGHMC_FAMILY = family.Family(
    "sghmc", _make_config, build_sghmc, _chain_params, _stability_bound, _step_scale,
    _check_step, _adapts_mass,
)  # fmt: skip
"""The second-order family (SGHMC, AdaSGHMC) over :class:`SGHMCDynamics`."""


class SGHMC(SGMCKernel):
    """Stochastic gradient Hamiltonian Monte Carlo with a static mass matrix.

    .. math::

        r' = r - \\eta\\,\\nabla\\tilde U(\\theta) - \\eta\\, C M^{-1} r
             + \\sqrt{2\\eta T}\\,(C - \\hat B)^{1/2}\\xi, \\qquad
        \\theta' = \\theta + \\eta\\, M^{-1} r', \\qquad \\eta = \\sqrt{h/n}, \\quad
        \\xi \\sim N(0, I_d)

    (``docs/theory.md`` §5; Chen, Fox & Guestrin 2014), with ``∇Ũ = -n ĝ`` the minibatch (or
    control-variate) estimate of the potential's gradient, as for
    :class:`~numpyro_sgmc.SGLD`. The momentum is drawn once from ``N(0, T M)`` at ``init`` and
    then carried in the state (``state.momentum``, flat), never redrawn.

    What it samples: for small ``h`` the posterior (tempered by ``T``); at a finite ``h``, on a
    quadratic potential, the ``2d × 2d`` discrete-Lyapunov solution that
    :func:`numpyro_sgmc.theory.sghmc_prediction` computes, which also gives the
    autocorrelation times. With the default friction it is stable iff
    ``h·λmax(M⁻¹J) < 2(2 - α)``.

    **Mass matrix.** ``M`` plays the role of an inverse preconditioner: a diagonal ``M``
    matched to the posterior's curvature lets one ``h`` fit every coordinate. The
    optimizer-informed masses of ``docs/theory.md`` §6 come from
    :func:`numpyro_sgmc.bde.mass_from_warm_start`, one per chain, and need no warm-up.

    **Example** (a Bayesian deep ensemble on scikit-learn's diabetes data: ``K = 4`` Adam
    modes, one chain from each with its own mass)::

        import jax
        from numpyro.infer import MCMC
        from numpyro_sgmc import SGHMC, bde, warm_start

        data = bde.diabetes()
        model = bde.mlp(1, hidden=(50,), likelihood="gaussian", batch_size=32)
        warm = warm_start(model, jax.random.key(0), data.X_train, data.y_train,
                          num_restarts=4, num_epochs=50, learning_rate=0.01, check=False)
        mcmc = MCMC(SGHMC(model, step_size=0.03, num_steps=20), num_warmup=0,
                    num_samples=50, num_chains=4, chain_method="vectorized")
        mcmc.run(jax.random.key(1), data.X_train, data.y_train,
                 init_params=bde.chain_init(warm, "first_moment"))
        bde.evaluate(mcmc.sampler.model, mcmc.get_samples(), data.X_test, y=data.y_test)

    **Automatic step.** ``step_size="auto"`` sets every chain's ``h`` at init, from its own
    start and mass, to a fixed fraction of the stability bound,
    ``h = f·2(2 - α)/λmax(M⁻¹J)`` (``λmax`` by a power iteration with Hessian-vector products
    on a batch of rows, :mod:`numpyro_sgmc.kernels.auto_step`), and reports it in
    ``kernel.auto_step`` (one ``h`` and ``λmax`` per chain). It needs the default friction.

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param step_size: ``h`` on the average-gradient scale (``η = sqrt(h/n)`` is Chen et
        al.'s step; from rest the position moves by ``h M⁻¹ ĝ``), ``"auto"`` or
        :class:`~numpyro_sgmc.kernels.auto_step.Auto` settings.
    :param mass: ``M``: ``None`` (identity), :class:`~numpyro_sgmc.Diagonal`,
        :func:`~numpyro_sgmc.layerwise` or :class:`~numpyro_sgmc.Dense`; the same for every
        chain unless ``ChainInit.preconditioner`` gives per-chain masses.
    :param friction: ``C``: ``None`` (default) for ``C = (α/η) M``, so that every momentum
        decays by ``1 - α`` per step (Springenberg et al. 2016); a positive number
        (``C = c I``), a dict ``{site: value}`` or a :class:`~numpyro_sgmc.Diagonal`.
    :param float momentum_decay: ``α`` in ``(0, 1]`` when ``friction`` is ``None`` (default
        0.1).
    :param gradient_noise: ``B̂``, an estimate of ``η/2`` times the covariance of the gradient
        noise of ``∇Ũ`` (Chen et al.'s correction), diagonal: ``None`` (0), a number, a dict
        or a :class:`~numpyro_sgmc.Diagonal`. ``C - B̂`` must be non-negative.
    :param inverse_temperature: ``β``: ``None`` for ``n`` (the posterior, ``T = n/β = 1``);
        ``n/w`` tempers the posterior by ``w``; ``math.inf`` removes the noise (SGD with
        heavy-ball momentum).
    :param bool control_variates: estimate gradients with control variates around each chain's
        start (or ``ChainInit.centre``).
    :param batch_size: as for :class:`~numpyro_sgmc.SGLD`.
    :param str batch_sampling: as for :class:`~numpyro_sgmc.SGLD`.
    :param int num_steps: iterations per MCMC draw (default 100).
    :param init_strategy: NumPyro init strategy for chains not given ``init_params``.
    :param int chunk_size: rows per plate evaluated at once for full-data gradients.
    :param int progress_draws: as for :class:`~numpyro_sgmc.SGLD`.
    """

    _adaptation_window = None  # AdaSGHMC's, set before SGHMC.__init__

    def __init__(
        self,
        model,
        step_size,
        *,
        mass=None,
        friction=None,
        momentum_decay=0.1,
        gradient_noise=None,
        inverse_temperature=None,
        control_variates=False,
        batch_size=None,
        batch_sampling="with_replacement",
        num_steps=100,
        init_strategy=init_to_uniform,
        chunk_size=65536,
        progress_draws=None,
    ):
        dynamics = sghmc_dynamics(
            step_size, mass, friction, momentum_decay, gradient_noise, inverse_temperature,
            control_variates, self._adaptation_window,
        )  # fmt: skip
        options = (batch_size, batch_sampling, num_steps, init_strategy, chunk_size, progress_draws)
        recipe = family.Recipe.of(type(self).__name__, SGHMC_FAMILY, dynamics, options)
        super().__init__(model, recipe)

    @property
    def temperature(self) -> Optional[float]:
        """``T = n/β`` (1 for the posterior). Known after ``init``."""
        n = self.num_data
        return None if n is None else _temperature(self.recipe.dynamics, n)


class AdaSGHMC(SGHMC):
    """Scale-adapted SGHMC (Springenberg, Klein, Falkner & Hutter 2016).

    The update is :class:`SGHMC`'s. During warm-up (the first ``num_warmup · num_steps``
    iterations) a diagonal mass is adapted from an exponential moving average of the squared
    gradient of the potential, ``M = diag(v̂^{1/2}) / min_i v̂_i^{1/2}``
    (:func:`~numpyro_sgmc.kernels.adaptation.mass_adaptation`), the momentum rescaled with it; after
    warm-up ``M`` is frozen, so the kept draws come from SGHMC with a fixed mass. The adapted
    mass is ``mcmc.last_state.params.mass``. With ``num_warmup=0`` nothing is adapted.

    :param model: as for :class:`SGHMC`.
    :param float step_size: ``h``, as for :class:`SGHMC`.
    :param float adaptation_window: ``1/κ`` of the moving average, in iterations (default
        1000, Adam's ``β₂ = 0.999``).
    :param mass: the initial mass, :class:`~numpyro_sgmc.Identity` (default) or diagonal.
    :param friction: as for :class:`SGHMC`.
    :param float momentum_decay: as for :class:`SGHMC`.
    :param gradient_noise: as for :class:`SGHMC`.
    :param inverse_temperature: as for :class:`SGHMC`.
    :param bool control_variates: as for :class:`SGHMC`.
    :param batch_size: as for :class:`SGHMC`.
    :param str batch_sampling: as for :class:`SGHMC`.
    :param int num_steps: as for :class:`SGHMC`.
    :param init_strategy: as for :class:`SGHMC`.
    :param int chunk_size: as for :class:`SGHMC`.
    :param int progress_draws: as for :class:`SGHMC`.
    """

    def __init__(
        self,
        model,
        step_size,
        *,
        adaptation_window=1000,
        mass=None,
        friction=None,
        momentum_decay=0.1,
        gradient_noise=None,
        inverse_temperature=None,
        control_variates=False,
        batch_size=None,
        batch_sampling="with_replacement",
        num_steps=100,
        init_strategy=init_to_uniform,
        chunk_size=65536,
        progress_draws=None,
    ):
        if isinstance(adaptation_window, bool) or not (
            isinstance(adaptation_window, (int, float)) and adaptation_window >= 1
        ):
            raise ValueError(f"adaptation_window must be a number >= 1, got {adaptation_window!r}.")
        self._adaptation_window = float(adaptation_window)
        super().__init__(
            model, step_size, mass=mass, friction=friction, momentum_decay=momentum_decay,
            gradient_noise=gradient_noise, inverse_temperature=inverse_temperature,
            control_variates=control_variates, batch_size=batch_size,
            batch_sampling=batch_sampling, num_steps=num_steps, init_strategy=init_strategy,
            chunk_size=chunk_size, progress_draws=progress_draws,
        )  # fmt: skip
