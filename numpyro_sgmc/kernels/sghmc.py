"""SGHMC and AdaSGHMC: the second-order kernels of ``shared/design/theory.md`` §5–§6.

.. math::

    r' = r - \\eta\\,\\nabla\\tilde U(\\theta) - \\eta\\, C M^{-1} r
         + \\sqrt{2\\eta T}\\,(C - \\hat B)^{1/2}\\xi, \\qquad
    \\theta' = \\theta + \\eta\\, M^{-1} r'

(Chen, Fox & Guestrin 2014). The batch sampler, gradient estimators, divergence handling and
per-chain values are those of :class:`~numpyro_sgmc.kernels.base.SGMCKernel`; the momentum
``r`` lives in the state and is carried from step to step (drawn once, at ``init``, from its
stationary law ``N(0, T M)``). The state's ``preconditioner`` field holds the mass matrix
``M``, so each chain can have its own (``ChainInit(preconditioner=M_k)``, e.g. from its own
Adam run, :func:`~numpyro_sgmc.mass_from_warm_start`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro.util import is_prng_key, not_jax_tracer

from numpyro_sgmc import preconditioners
from numpyro_sgmc.diagnostics import tree_all_finite
from numpyro_sgmc.diffusions import sghmc_step
from numpyro_sgmc.kernels.base import SGMCKernel, SGMCState, _tree_norm

__all__ = ["SGHMC", "AdaSGHMC", "MassAdaptation"]


def _as_diagonal(spec, role: str, allow_zero: bool):
    """``None``, a scalar, a dict of per-site values or a ``Diagonal`` -> ``Diagonal`` or None."""
    if spec is None:
        return None
    if isinstance(spec, preconditioners.Diagonal):
        spec = spec.scale
    if isinstance(spec, dict):
        return preconditioners.Diagonal(dict(spec))
    try:
        value = float(spec)
    except (TypeError, ValueError):
        raise TypeError(
            f"{role} must be None, a number, a dict {{site: value}} or a Diagonal; got "
            f"{type(spec).__name__}."
        ) from None
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        sign = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{role} must be {sign}, got {value}.")
    return value


def _per_site(spec, position: dict, role: str, allow_zero: bool):
    """Broadcast a scalar or ``Diagonal`` spec to {site: array} over ``position``, checking it."""
    if spec is None:
        return None
    if not isinstance(spec, preconditioners.Diagonal):
        return {k: jnp.full(jnp.shape(v), spec, jnp.result_type(v)) for k, v in position.items()}
    scales = preconditioners.check_scales(spec.scale, position, role, allow_zero)
    return {k: jnp.broadcast_to(v, jnp.shape(position[k])) for k, v in scales.items()}


class MassAdaptation(NamedTuple):
    """AdaSGHMC's running statistics (Springenberg et al. 2016).

    :param dict square_gradient: exponential moving average of ``(∇Ũ)²``, per entry.
    :param count: number of averaged gradients (for the bias correction).
    """

    square_gradient: dict
    count: jnp.ndarray


class SGHMC(SGMCKernel):
    """Stochastic gradient Hamiltonian Monte Carlo with a static mass matrix.

    .. math::

        r' = r - \\eta\\,\\nabla\\tilde U(\\theta) - \\eta\\, C M^{-1} r
             + \\sqrt{2\\eta T}\\,(C - \\hat B)^{1/2}\\xi, \\qquad
        \\theta' = \\theta + \\eta\\, M^{-1} r', \\qquad \\xi \\sim N(0, I_d)

    (``shared/design/theory.md`` §5; Chen, Fox & Guestrin 2014), with ``∇Ũ = -n ĝ`` the
    minibatch (or control-variate) estimate of the full potential's gradient, exactly as for
    :class:`~numpyro_sgmc.SGLD`. The momentum is drawn once from ``N(0, T M)`` at ``init`` and
    then carried in the state (``state.momentum``), never redrawn.

    What it samples: for small ``η`` the posterior (tempered by ``T``), with the momentum
    ``~ N(0, T M)``. At a finite ``η``, on a quadratic potential, the stationary covariance of
    ``(θ, r)`` is the ``2d × 2d`` discrete-Lyapunov solution that
    :func:`numpyro_sgmc.theory.sghmc_prediction` computes, which also gives the
    autocorrelation times.

    **Mass matrix.** ``M`` plays the role of a preconditioner: the step of parameter ``i`` is
    about ``η/m_i`` on the ``M⁻¹r`` scale. A diagonal ``M`` matched to the posterior's scales
    (``m_i ∝`` the curvature) lets one ``η`` fit every coordinate. The optimizer-informed
    masses of theory §6 come from :func:`~numpyro_sgmc.mass_from_warm_start`, one per chain
    (``ChainInit(params=warm.params, preconditioner=masses)``), and need no warm-up.

    **Example** (a Bayesian deep ensemble: ``K`` Adam modes, ``K`` chains)::

        warm = warm_start(model, X, y, num_restarts=K, num_epochs=20)
        kernel = SGHMC(model, step_size=1e-3, num_steps=50)
        mcmc = MCMC(kernel, num_warmup=0, num_samples=200, num_chains=K,
                    chain_method="vectorized")
        # = ChainInit(params=warm.params, preconditioner=mass_from_warm_start(warm, ...))
        mcmc.run(key, X, y, init_params=warm.chain_init("first_moment"))

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param float step_size: ``η``, on the scale of the full potential ``U`` (the ``ε`` of
        Chen et al.; the position moves about ``η² M⁻¹ ∇Ũ`` per step from the gradient).
    :param mass: ``M``: ``None`` (identity), :class:`~numpyro_sgmc.Diagonal`,
        :func:`~numpyro_sgmc.layerwise` or :class:`~numpyro_sgmc.Dense`; the same for every
        chain unless ``ChainInit.preconditioner`` gives per-chain masses.
    :param friction: ``C``: ``None`` (default) for ``C = (α/η) M``, so that every
        coordinate's momentum decays by ``1 - α`` per step (Springenberg et al. 2016's
        choice); or a positive number (``C = c I``), a dict ``{site: value}`` or a
        :class:`~numpyro_sgmc.Diagonal` for a diagonal ``C``.
    :param float momentum_decay: ``α`` in ``(0, 1]`` when ``friction`` is ``None``
        (default 0.1).
    :param gradient_noise: ``B̂``, an estimate of ``η/2`` times the covariance of the
        gradient noise of ``∇Ũ`` (Chen et al.'s correction), diagonal: ``None`` (0), a number,
        a dict or a :class:`~numpyro_sgmc.Diagonal`. ``C - B̂`` must be non-negative; with the
        default friction this needs a diagonal ``M``.
    :param inverse_temperature: ``β`` on the average-gradient scale as for the other kernels:
        ``None`` for ``n`` (the posterior, temperature ``T = n/β = 1``); ``n/w`` tempers the
        posterior by ``w``; ``math.inf`` removes the noise (SGD with heavy-ball momentum).
    :param kwargs: ``batch_size``, ``control_variates``, ``batch_sampling``, ``num_steps``
        (iterations per MCMC draw, default 100), ``init_strategy``, ``chunk_size``, as for
        :class:`~numpyro_sgmc.kernels.base.SGMCKernel`.
    """

    _adapts_mass = False

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
        **kwargs,
    ):
        for name in ("preconditioner", "noise_preconditioner"):
            if name in kwargs:
                raise TypeError(
                    f"SGHMC takes no {name}: its preconditioner is the mass matrix, pass mass=."
                )
        super().__init__(
            model,
            step_size,
            preconditioner=mass,
            inverse_temperature=inverse_temperature,
            **kwargs,
        )
        self._friction = _as_diagonal(friction, "friction", allow_zero=False)
        try:
            alpha = float(momentum_decay)
        except (TypeError, ValueError):
            raise TypeError(f"momentum_decay must be a number, got {momentum_decay!r}.") from None
        if not 0 < alpha <= 1:
            raise ValueError(
                f"momentum_decay must be in (0, 1] (the fraction of momentum lost per step), "
                f"got {alpha}."
            )
        self._momentum_decay = alpha
        self._gradient_noise = _as_diagonal(gradient_noise, "gradient_noise", allow_zero=True)

    @property
    def temperature(self) -> float:
        """``T = n/β`` (1 for the posterior). Known after ``init``."""
        beta = self.inverse_temperature
        return None if beta is None else self.num_data / beta

    # ---- init ----------------------------------------------------------------------------

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        state = super().init(rng_key, num_warmup, init_params, model_args, model_kwargs)
        batched = not is_prng_key(rng_key)
        one_z = jax.tree.map(lambda x: x[0], state.z) if batched else state.z
        self._friction_sites = _per_site(self._friction, one_z, "friction", allow_zero=False)
        self._noise_sites = _per_site(
            self._gradient_noise, one_z, "gradient_noise", allow_zero=True
        )
        if (
            self._noise_sites is not None
            and self._friction is None
            and isinstance(state.preconditioner, preconditioners.Dense)
        ):
            raise ValueError(
                "gradient_noise with the default friction C = (α/η) M needs a diagonal mass "
                "matrix; pass a diagonal friction= as well, or drop gradient_noise."
            )
        if self._adapts_mass and isinstance(state.preconditioner, preconditioners.Dense):
            raise ValueError(
                "AdaSGHMC adapts a diagonal mass matrix; give an Identity or Diagonal initial mass."
            )
        extend = self._start_momentum
        state, noise_ok = jax.vmap(extend)(state) if batched else extend(state)
        if not_jax_tracer(noise_ok) and not np.all(noise_ok):
            raise ValueError(
                "The injected noise variance 2ηT(C - B̂) is negative somewhere: gradient_noise "
                "B̂ exceeds the friction C"
                + (" = (α/η) M" if self._friction is None else "")
                + ". Lower gradient_noise or raise "
                + ("momentum_decay." if self._friction is None else "friction.")
            )
        return state

    def _start_momentum(self, state: SGMCState):
        """Draw ``r ~ N(0, T M)``; check ``C - B̂ ≥ 0`` for this chain's ``M``."""
        key, key_momentum = random.split(state.rng_key)
        mass = state.preconditioner
        adaptation = None
        if self._adapts_mass:
            # a full per-entry diagonal, so that adaptation can write every entry
            mass = preconditioners.Diagonal(preconditioners.diagonal(mass, state.z))
            adaptation = MassAdaptation(
                jax.tree.map(jnp.zeros_like, state.z), jnp.zeros((), jnp.int32)
            )
        flat, unravel = ravel_pytree(state.z)
        xi = unravel(random.normal(key_momentum, flat.shape, flat.dtype))
        scale = math.sqrt(self.temperature)
        momentum = jax.tree.map(lambda e: scale * e, preconditioners.apply_sqrt(mass, xi))
        noise_ok = jnp.array(True)
        if self._noise_sites is not None:
            if self._friction_sites is None:
                m = preconditioners.diagonal(mass, state.z)
                friction = {k: self._momentum_decay * m[k] / self._step_size for k in m}
            else:
                friction = self._friction_sites
            noise_ok = jnp.all(
                jnp.stack([jnp.all(friction[k] >= self._noise_sites[k]) for k in friction])
            )
        state = state._replace(
            rng_key=key, momentum=momentum, preconditioner=mass, mass_adaptation=adaptation
        )
        return state, noise_ok

    # ---- sample --------------------------------------------------------------------------

    def _step(self, state: SGMCState, model_args, model_kwargs) -> SGMCState:
        key, key_batch, key_noise = random.split(state.rng_key, 3)
        grad, batch_state = self._gradient(
            state.z, state.batch_state, key_batch, model_args, model_kwargs, state.centre
        )
        z, r = sghmc_step(
            key_noise,
            state.z,
            state.momentum,
            grad,
            self._step_size,
            self.num_data,
            self.temperature,
            state.preconditioner,
            friction=self._friction_sites,
            momentum_decay=self._momentum_decay,
            gradient_noise=self._noise_sites,
        )
        finite = tree_all_finite(grad) & tree_all_finite(z) & tree_all_finite(r)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        state = state._replace(
            i=state.i + 1,
            z=jax.tree.map(keep, z, state.z),
            momentum=jax.tree.map(keep, r, state.momentum),
            grad_norm=_tree_norm(grad),
            num_diverging=state.num_diverging + (~finite).astype(state.num_diverging.dtype),
            batch_state=batch_state,
            rng_key=key,
        )
        if self._adapts_mass:
            state = self._adapt_mass(state, grad, finite)
        return state


class AdaSGHMC(SGHMC):
    """Scale-adapted SGHMC (Springenberg et al. 2016): a diagonal mass adapted during warm-up.

    The update is :class:`SGHMC`'s. During warm-up (the first ``num_warmup · num_steps``
    iterations) it keeps an exponential moving average, with bias correction as in Adam,

    .. math::

        \\hat v \\leftarrow (1 - \\kappa)\\,\\hat v + \\kappa\\,(\\nabla\\tilde U(\\theta))^2,
        \\qquad \\kappa = 1/\\text{adaptation\\_window},

    and after every warm-up step sets ``M = diag(v̂^{1/2}) / min_i v̂_i^{1/2}``: Springenberg
    et al.'s ``M = diag(v̂^{1/2})`` divided by its smallest entry, the normalisation of theory
    §6, so that every effective step ``η/m_i`` is at most ``η`` and ``step_size`` means the
    same as for :class:`SGHMC` with a §6 mass (a constant factor on ``M`` only rescales ``η``).
    When ``M`` changes, the momentum is rescaled with it, ``r ← (M_new/M_old)^{1/2} r``, so that
    it keeps its law ``N(0, T M)``: otherwise a mass that shrinks (the normalising minimum
    moves as ``v̂`` fills in) would turn the old momentum into a kick. After warm-up ``M`` is
    frozen: the kept draws come from SGHMC with a fixed mass. The adapted mass is
    ``mcmc.last_state.preconditioner``.

    With ``num_warmup=0`` nothing is adapted (this is :class:`SGHMC` with the initial mass).

    :param model: as for :class:`SGHMC`.
    :param float step_size: ``η``, as for :class:`SGHMC`.
    :param float adaptation_window: ``1/κ``, in iterations (default 1000, Adam's
        ``β₂ = 0.999``).
    :param kwargs: the keyword arguments of :class:`SGHMC`; ``mass`` is the initial mass,
        :class:`~numpyro_sgmc.Identity` (default) or diagonal, which adaptation overwrites.
    """

    _adapts_mass = True

    def __init__(self, model, step_size, *, adaptation_window=1000, **kwargs):
        if not (isinstance(adaptation_window, (int, float)) and adaptation_window >= 1):
            raise ValueError(f"adaptation_window must be a number >= 1, got {adaptation_window!r}.")
        super().__init__(model, step_size, **kwargs)
        self._kappa = 1.0 / float(adaptation_window)

    def _adapt_mass(self, state: SGMCState, grad, finite) -> SGMCState:
        adapting = finite & (state.i <= self._num_warmup_steps)  # i counts the step just taken
        n, kappa = self.num_data, self._kappa
        stats = state.mass_adaptation
        square = jax.tree.map(
            lambda v, g: jnp.where(adapting, (1 - kappa) * v + kappa * (n * g) ** 2, v),
            stats.square_gradient,
            grad,
        )
        count = stats.count + adapting.astype(stats.count.dtype)
        correction = 1.0 - (1.0 - kappa) ** jnp.maximum(count, 1)
        root = jax.tree.map(
            lambda v: jnp.sqrt(jnp.maximum(v / correction, jnp.finfo(v.dtype).tiny)), square
        )
        smallest = jnp.min(jnp.stack([jnp.min(v) for v in jax.tree.leaves(root)]))
        old = state.preconditioner.scale
        mass = {k: jnp.where(adapting, root[k] / smallest, old[k]) for k in root}
        # keep r ~ N(0, T M) under the new M: a mass that shrinks must not turn the momentum
        # built under the old one into a kick (equivalently, M^{-1/2} r is left unchanged)
        momentum = {k: state.momentum[k] * jnp.sqrt(mass[k] / old[k]) for k in mass}
        return state._replace(
            preconditioner=preconditioners.Diagonal(mass),
            momentum=momentum,
            mass_adaptation=MassAdaptation(square, count),
        )
