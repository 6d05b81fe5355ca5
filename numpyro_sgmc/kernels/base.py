"""The shared ``MCMCKernel`` shell of every stochastic-gradient kernel.

One implementation of the meta-algorithm (``shared/design/theory.md`` §2),

.. math::

    \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
              + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi,

composed from a batch sampler (:mod:`~numpyro_sgmc.subsample`), a gradient estimator
(:mod:`~numpyro_sgmc.gradients`) and a one-step diffusion (:mod:`~numpyro_sgmc.diffusions`).
The named kernels in :mod:`numpyro_sgmc.kernels.sgld` only choose the estimator and ``β``.

Everything that changes per step, and everything that may differ between chains (the
preconditioners, the control-variate centre), lives in :class:`SGMCState`, so that
``MCMC(..., num_chains=K, chain_method="vectorized" | "sequential" | "parallel")`` runs each
chain with its own values. Per-chain values enter through ``init_params`` as a
:class:`ChainInit`.
"""

from __future__ import annotations

import math
import time
import warnings
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from jax.flatten_util import ravel_pytree
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import identity, is_prng_key, not_jax_tracer

from numpyro_sgmc import preconditioners, sharding
from numpyro_sgmc.batches import BATCH_SAMPLING, batch_sampler
from numpyro_sgmc.diagnostics import report_new_divergences, tree_all_finite, user_stacklevel
from numpyro_sgmc.diffusions import langevin_step, sgd_step
from numpyro_sgmc.gradients import (
    Centre,
    control_variate_gradient,
    full_data_gradient,
    minibatch_gradient,
)
from numpyro_sgmc.progress import EpochProgress
from numpyro_sgmc.subsample import first_batch, full_data, initialize, num_data, split_args

__all__ = [
    "CentreWarning",
    "ChainInit",
    "DataOrderWarning",
    "PerformanceWarning",
    "SGMCKernel",
    "SGMCState",
]

_DIAGNOSTICS_INTERVAL = 0.25  # seconds between progress-bar reads of the divergence count
_LARGE_DATA_BYTES = 2**24  # model arguments above this trigger a PerformanceWarning


class SGMCState(NamedTuple):
    """State of a stochastic-gradient chain.

    :param i: iteration counter (warm-up included).
    :param dict z: current position, unconstrained.
    :param grad_norm: Euclidean norm of the gradient estimate ``ĝ`` used by the last iteration.
    :param diverging: whether an iteration of the last draw was rejected for a non-finite
        gradient estimate or position (the chain then stays put).
    :param num_diverging: number of rejected iterations so far.
    :param preconditioner: the drift preconditioner ``Γ`` (fixed for the run).
    :param noise_preconditioner: the noise preconditioner ``Λ``, or ``None`` for ``Λ = Γ``.
    :param centre: :class:`~numpyro_sgmc.gradients.Centre` for control variates, else ``None``.
    :param average: running mean of the iterates after warm-up (SGD), else ``None``.
    :param batch_state: state of the batch sampler (:mod:`~numpyro_sgmc.batches`).
    :param rng_key: PRNG key for the next step.
    :param dict momentum: SGHMC's momentum ``r``, kept from step to step; ``None`` for the
        first-order kernels. For SGHMC, ``preconditioner`` holds the mass matrix ``M``.
    :param mass_adaptation: AdaSGHMC's running mean of squared gradients, else ``None``.
    """

    i: Any
    z: dict
    grad_norm: Any
    diverging: Any
    num_diverging: Any
    preconditioner: Any
    noise_preconditioner: Any
    centre: Optional[Centre]
    average: Optional[dict]
    batch_state: Any
    rng_key: Any
    momentum: Optional[dict] = None
    mass_adaptation: Any = None


class ChainInit(NamedTuple):
    """Per-chain starting values, passed to ``MCMC.run(..., init_params=ChainInit(...))``.

    With ``num_chains > 1`` every given field carries a leading chain axis; ``MCMC`` hands
    chain ``k`` its slice whatever the ``chain_method``.

    :param dict params: starting position, unconstrained (as NumPyro's ``init_params``);
        ``None`` to use the kernel's ``init_strategy``.
    :param preconditioner: this chain's drift preconditioner ``Γ``; ``None`` for the
        kernel's.
    :param noise_preconditioner: this chain's ``Λ``; ``None`` for the kernel's.
    :param dict centre: this chain's control-variate centre ``θ̂``, unconstrained; ``None`` for
        the starting position. Only for kernels with control variates.
    """

    params: Optional[dict] = None
    preconditioner: Any = None
    noise_preconditioner: Any = None
    centre: Optional[dict] = None


class CentreWarning(UserWarning):
    """The control-variate centre is far from a mode of the potential."""


class DataOrderWarning(UserWarning):
    """``batch_sampling="blocks"`` on rows that are not in random order."""


def _check_step_size(step_size) -> float:
    try:
        h = float(step_size)
    except (TypeError, ValueError):
        raise TypeError(f"step_size must be a positive number, got {step_size!r}.") from None
    if not (h > 0 and math.isfinite(h)):
        raise ValueError(f"step_size must be positive and finite, got {step_size!r}.")
    return h


def _tree_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _chain(tree, c):
    return jax.tree.map(lambda x: x[c], tree)


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


class PerformanceWarning(UserWarning):
    """A NumPyro setting makes the sampling loop handle the data in O(n) per draw or compile."""


def _data_bytes(model_args, model_kwargs) -> tuple[int, int]:
    """Bytes of the model arguments that are concrete arrays, and bytes that are traced."""
    concrete = traced = 0
    for x in jax.tree.leaves((model_args, model_kwargs)):
        if not hasattr(x, "dtype"):
            continue
        nbytes = int(np.prod(jnp.shape(x))) * x.dtype.itemsize
        if not_jax_tracer(x):
            concrete += nbytes
        else:
            traced += nbytes
    return concrete, traced


def _warn_large_data(message: str):
    warnings.warn(message, PerformanceWarning, stacklevel=user_stacklevel())


class SGMCKernel(MCMCKernel):
    """Stochastic-gradient MCMC kernel for ``numpyro.infer.MCMC`` (the meta-algorithm).

    .. math::

        \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
                  + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d)

    (``shared/design/theory.md`` §2). Use the named kernels :class:`~numpyro_sgmc.SGLD`,
    :class:`~numpyro_sgmc.SGLDFP` and :class:`~numpyro_sgmc.SGD`; this class holds what they
    share.

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param float step_size: ``h``, on the average-gradient scale (``ε = h/n`` in the usual
        ``-(ε/2)∇Ũ`` form).
    :param batch_size: ``None`` to use each plate's ``subsample_size``; an int for every
        subsample plate; or ``{plate name: int}``. The ``n/b`` scaling follows the batch size
        actually used. A batch size equal to the plate size means full-data gradients.
    :param inverse_temperature: ``β``; ``None`` for ``n``, the total number of data over the
        subsample plates (the posterior). ``math.inf`` gives SGD.
    :param preconditioner: ``Γ``: ``None`` (identity), :class:`~numpyro_sgmc.Diagonal`,
        :func:`~numpyro_sgmc.layerwise` or :class:`~numpyro_sgmc.Dense`, over the
        unconstrained parameters; the same for every chain (per-chain values: :class:`ChainInit`).
    :param noise_preconditioner: ``Λ``; ``None`` for ``Λ = Γ``.
    :param bool control_variates: use the control-variate estimator around a centre ``θ̂``
        (each chain's starting position unless :class:`ChainInit` gives one), with the
        full-data gradient at ``θ̂`` computed once at ``init``.
    :param str batch_sampling: ``"with_replacement"`` (default; ``b`` uniform indices),
        ``"without_replacement"`` (``b`` distinct indices per step), ``"epochs"`` (each datum
        at most once per epoch, reshuffled every epoch) or ``"blocks"`` (``b`` consecutive
        rows from a random start: fastest for large data, needs rows in random order, see
        :func:`~numpyro_sgmc.shuffle_rows`); all O(b) per step (:mod:`~numpyro_sgmc.batches`).
    :param int num_steps: iterations of the update per MCMC draw (as HMC's ``num_steps``
        leapfrog steps per draw): ``num_samples`` draws cost ``num_samples * num_steps``
        iterations, and the state's ``i`` counts iterations. Several iterations per draw run in
        one compiled loop, which keeps NumPyro's per-draw overhead (its progress bar dispatches
        every draw) small next to the iterations themselves; SG-MCMC iterates are strongly
        autocorrelated, so little is lost by not storing each one.
    :param init_strategy: NumPyro init strategy for chains not given ``init_params``.
    :param int chunk_size: rows per plate evaluated at once for full-data gradients.
    :param int progress_draws: show a progress bar in epochs with the time left (ETA) for a
        run of this many draws, warm-up included (``num_warmup + num_samples · thinning``);
        also settable as the attribute of the same name before ``MCMC.run``. It is updated
        from inside the compiled loop about 100 times per run
        (:class:`~numpyro_sgmc.progress.EpochProgress`), so it costs no per-step or per-draw
        host round-trips; use it with ``MCMC(..., progress_bar=False)`` for large data.
    """

    sample_field = "z"
    _tracks_average = False  # SGD keeps the running mean of its iterates

    def __init__(
        self,
        model,
        step_size,
        *,
        batch_size=None,
        inverse_temperature=None,
        preconditioner=None,
        noise_preconditioner=None,
        control_variates=False,
        batch_sampling="with_replacement",
        num_steps=100,
        init_strategy=init_to_uniform,
        chunk_size=65536,
        progress_draws=None,
    ):
        if not callable(model):
            raise TypeError(f"model must be a NumPyro model (a callable), got {model!r}.")
        self._model = model
        self._step_size = _check_step_size(step_size)
        if batch_size is not None and not isinstance(batch_size, (int, np.integer, dict)):
            raise TypeError(
                f"batch_size must be None, an int or a dict {{plate: int}}, got {batch_size!r}."
            )
        self._batch_size = batch_size
        if inverse_temperature is not None:
            beta = float(inverse_temperature)
            if not beta > 0:
                raise ValueError(f"inverse_temperature must be positive, got {beta!r}.")
            inverse_temperature = beta
        self._inverse_temperature = inverse_temperature
        self._preconditioner = preconditioners._as_preconditioner(preconditioner, "preconditioner")
        self._noise_preconditioner = (
            None
            if noise_preconditioner is None
            else preconditioners._as_preconditioner(noise_preconditioner, "noise_preconditioner")
        )
        self._control_variates = bool(control_variates)
        if batch_sampling not in BATCH_SAMPLING:
            raise ValueError(
                f"Unknown batch_sampling {batch_sampling!r}; choose one of "
                f"{', '.join(BATCH_SAMPLING)}."
            )
        self._batch_sampling = batch_sampling
        if not (isinstance(num_steps, int) and not isinstance(num_steps, bool) and num_steps >= 1):
            raise ValueError(f"num_steps must be a positive int, got {num_steps!r}.")
        self._num_steps = num_steps
        self._init_strategy = init_strategy
        if not (isinstance(chunk_size, int) and chunk_size > 0):
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
        self._chunk_size = chunk_size
        self.progress_draws = progress_draws
        self._progress = None
        self._plates = None
        self._potential_fn = None
        self._postprocess = None
        self._sample_fn = None
        self._diagnostics = None
        self._traced_data_bytes = 0
        self._warned_progress_copy = False
        self._layout = None

    # ---- configuration -------------------------------------------------------------------

    @property
    def model(self):
        """The model as a full-data program: its subsample plates run over all their rows.

        This is the target the kernel samples, and what tools that replay the model see
        (``az.from_numpyro`` computes per-datum log-likelihoods with it: memory
        ``draws × n``; pass ``log_likelihood=False`` there for large ``n``).
        """
        return full_data(self._model)

    @property
    def progress_draws(self) -> Optional[int]:
        """Draws of the run the epoch progress bar counts to (``None``: no bar)."""
        return self._progress_draws

    @progress_draws.setter
    def progress_draws(self, num_draws):
        if num_draws is not None and not (
            isinstance(num_draws, (int, np.integer))
            and not isinstance(num_draws, bool)
            and num_draws >= 1
        ):
            raise ValueError(
                f"progress_draws must be None or a positive int (num_warmup + num_samples), "
                f"got {num_draws!r}."
            )
        self._progress_draws = num_draws

    @property
    def step_size(self) -> float:
        """``h``."""
        return self._step_size

    @property
    def num_steps(self) -> int:
        """Iterations of the update per MCMC draw."""
        return self._num_steps

    @property
    def plates(self) -> dict:
        """Subsample plates found at ``init``: name -> ``SubsamplePlate(size, batch_size)``."""
        return self._plates

    @property
    def num_data(self) -> int:
        """``n``, the number of data over all subsample plates (known after ``init``)."""
        return None if self._plates is None else num_data(self._plates)

    @property
    def inverse_temperature(self) -> float:
        """``β`` (``n`` unless given; ``inf`` for SGD). Known after ``init``."""
        if self._inverse_temperature is not None:
            return self._inverse_temperature
        return None if self._plates is None else float(self.num_data)

    @property
    def default_fields(self):
        return ("z", "diverging")

    def get_diagnostics_str(self, state):
        """Divergences so far, for NumPyro's progress bar.

        The bar asks after every draw; reading the count waits for the draw to finish, so it
        is read at most every ``_DIAGNOSTICS_INTERVAL`` seconds and the last string reused in
        between, which lets NumPyro dispatch the next draws while this one computes.
        """
        if self._traced_data_bytes > _LARGE_DATA_BYTES and not self._warned_progress_copy:
            # MCMC(jit_model_args=True) with the progress bar: each draw is a separate call that
            # returns the model arguments, and XLA copies them every time
            _warn_large_data(
                f"With jit_model_args=True, NumPyro's progress bar copies the model arguments "
                f"({self._traced_data_bytes / 2**20:.0f} MB) on every draw (about 0.15 s for "
                "400 MB here). Pass MCMC(..., progress_bar=False) for data this large."
            )
            self._warned_progress_copy = True
        now = time.monotonic()
        if self._diagnostics is None or now - self._diagnostics[0] >= _DIAGNOSTICS_INTERVAL:
            self._diagnostics = (now, f"{int(np.sum(state.num_diverging))} divergences")
        return self._diagnostics[1]

    def postprocess_fn(self, model_args, model_kwargs):
        """Map unconstrained draws to constrained values and deterministic sites.

        Deterministic sites inside a subsample plate are per-datum quantities of a batch and
        are left out; compute them with :class:`numpyro.infer.Predictive`.
        """
        if self._postprocess is None:
            return identity
        return self._postprocess(model_args, {} if model_kwargs is None else model_kwargs)

    # ---- init ----------------------------------------------------------------------------

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        model_kwargs = {} if model_kwargs is None else model_kwargs
        model_args = tuple(model_args)
        chain_init = init_params if isinstance(init_params, ChainInit) else ChainInit(init_params)
        if chain_init.centre is not None and not self._control_variates:
            raise ValueError(
                f"ChainInit.centre is only used with control variates; {type(self).__name__} "
                "was built without them (use SGLDFP, or control_variates=True)."
            )
        self._num_warmup_steps = num_warmup * self._num_steps
        self._diagnostics = None
        self._warned_progress_copy = False
        batched = not is_prng_key(rng_key)
        if batched:
            keys = jax.vmap(partial(random.split, num=3))(rng_key)
            rng_key, key_init, key_batches = keys[:, 0], keys[:, 1], keys[:, 2]
        else:
            rng_key, key_init, key_batches = random.split(rng_key, 3)

        # sharded model arguments switch every gradient to the data-parallel estimator
        sharding.data_layout(model_args, model_kwargs)  # layout errors before tracing the model
        prepared = initialize(
            key_init,
            self._model,
            model_args,
            model_kwargs,
            batch_size=self._batch_size,
            init_strategy=self._init_strategy,
        )
        self._plates = prepared.plates
        self._potential_fn = prepared.potential_fn
        self._postprocess = prepared.postprocess_fn
        self._layout = sharding.data_layout(model_args, model_kwargs, self._plates)
        estimator = control_variate_gradient if self._control_variates else minibatch_gradient
        self._estimator = estimator(self._potential_fn, num_data(self._plates))
        self._batch_init, self._gradient = self._gradient_estimator(
            self._estimator, self._batch_sampling
        )
        # MCMC re-runs `init` on a `post_warmup_state` until this is set
        self._sample_fn = self._step
        self._progress = self._epoch_progress()

        z = prepared.init_params if chain_init.params is None else chain_init.params
        self._check_params(z, prepared.init_params, batched)
        if self._layout is not None:
            first = _chain(z, 0) if batched else z
            key = key_init[0] if batched else key_init
            self._check_shard_evaluation(first, key, model_args, model_kwargs)
        if chain_init.params is not None:
            self._check_finite_start(z, model_args, model_kwargs, batched)
        if self._batch_sampling == "blocks":
            first = _chain(z, 0) if batched else z
            key = key_init[0] if batched else key_init
            self._check_row_order(first, key, model_args, model_kwargs)
        num_chains = jax.tree.leaves(z)[0].shape[0] if batched else None

        gamma = self._per_chain(
            chain_init.preconditioner, self._preconditioner, z, num_chains, "preconditioner"
        )
        lam = (
            None
            if chain_init.noise_preconditioner is None and self._noise_preconditioner is None
            else self._per_chain(
                chain_init.noise_preconditioner,
                self._noise_preconditioner,
                z,
                num_chains,
                "noise_preconditioner",
            )
        )
        centre = None
        if self._control_variates:
            centre_z = z if chain_init.centre is None else chain_init.centre
            if chain_init.centre is not None:
                self._check_params(centre_z, prepared.init_params, batched, "ChainInit.centre")
            centre = self._centre(centre_z, key_init, model_args, model_kwargs, batched)

        def new_state(z, gamma, lam, centre, key, key_batches):
            zero = jnp.zeros((), jnp.result_type(float))
            return SGMCState(
                i=jnp.zeros((), jnp.int32),
                z=z,
                grad_norm=zero,
                diverging=jnp.array(False),
                num_diverging=jnp.zeros((), jnp.int32),
                preconditioner=gamma,
                noise_preconditioner=lam,
                centre=centre,
                average=z if self._tracks_average else None,
                batch_state=self._batch_init(key_batches),
                rng_key=key,
            )

        if batched:
            state = jax.vmap(new_state)(z, gamma, lam, centre, rng_key, key_batches)
        else:
            state = new_state(z, gamma, lam, centre, rng_key, key_batches)
        if self._layout is not None:
            state = sharding.replicate(state, self._layout)
        return state

    def _epoch_progress(self) -> Optional[EpochProgress]:
        """A fresh epoch progress bar for this run, if ``progress_draws`` asks for one."""
        if self._progress_draws is None:
            return None
        rows = sum(p.batch_size for p in self._plates.values())
        return EpochProgress(
            self._progress_draws * self._num_steps,
            iterations_per_epoch=num_data(self._plates) / rows,
            desc=f"{type(self).__name__} ",
        )

    @staticmethod
    def _check_params(params, prototype, batched, what="init_params"):
        if not isinstance(params, dict) or set(params) != set(prototype):
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(
                f"{what} must be a dict over the latent sites {sorted(prototype)} "
                f"(unconstrained values); got {got}."
            )
        for name, value in params.items():
            # with batched keys NumPyro's prototype carries the chain axis too
            want = jnp.shape(prototype[name])[1:] if batched else jnp.shape(prototype[name])
            have = jnp.shape(value)[1:] if batched else jnp.shape(value)
            if have != want:
                raise ValueError(
                    f"{what}['{name}'] has shape {jnp.shape(value)}; the unconstrained site has "
                    f"shape {want}" + (" after the leading chain axis." if batched else ".")
                )

    def _gradient_estimator(self, estimator, method):
        """``(init, gradient)`` for ``estimator`` with batches drawn by ``method``.

        ``gradient(z, batch_state, rng_key, model_args, model_kwargs, centre)`` returns
        ``(ĝ, batch_state)``: on one device the batch sampler's draw and the estimate; on
        sharded data (``self._layout``) the data-parallel estimate of
        :func:`~numpyro_sgmc.sharding.data_parallel_gradient` (theory §1, averaged over the
        shards).
        """
        if self._layout is not None:
            return sharding.data_parallel_gradient(self._layout, self._plates, estimator, method)
        sampler = batch_sampler(self._plates, method)

        def gradient(z, batch_state, rng_key, model_args, model_kwargs, centre=None):
            batch, batch_state = sampler.draw(batch_state, rng_key)
            return estimator(z, batch, model_args, model_kwargs, centre), batch_state

        return sampler.init, gradient

    def _full_gradient(self):
        """``full(z, model_args, model_kwargs) -> -∇U(z)/n``, exact (summed over shards)."""
        if self._layout is not None:
            return sharding.data_parallel_full_gradient(
                self._layout, self._potential_fn, self._plates, self._chunk_size
            )
        return partial(
            full_data_gradient, self._potential_fn, self._plates, chunk_size=self._chunk_size
        )

    def _check_shard_evaluation(self, z, rng_key, model_args, model_kwargs):
        """Trace the data-parallel estimate once, to report a model that fails on a shard."""
        init, gradient = self._gradient_estimator(
            minibatch_gradient(self._potential_fn, num_data(self._plates)), self._batch_sampling
        )
        data, rebuild = split_args(model_args, model_kwargs)  # arguments, not constants

        def estimate(z, k, data):
            return gradient(z, init(k), k, *rebuild(data))[0]

        try:
            jax.eval_shape(estimate, z, rng_key, data)
        except Exception as err:
            raise ValueError(
                f"{type(self).__name__}: evaluating the model on one shard of the sharded data "
                f"failed ({type(err).__name__}: {err}). Each of the "
                f"{self._layout.num_shards} devices runs the model on its own "
                "rows of every sharded argument: the data plate must take its size from the "
                "data (numpyro.plate('data', X.shape[0], subsample_size=b)) or index the "
                "data with the plate's indices, and every per-datum array must be sharded."
            ) from err

    def _check_finite_start(self, z, model_args, model_kwargs, batched):
        """A user-given start must have a finite potential and gradient on the first batch."""
        batch = first_batch(self._plates)
        value_and_grad = jax.value_and_grad(self._potential_fn)

        def finite_at(z, data):
            args, kwargs = rebuild(data)
            return tree_all_finite(value_and_grad(z, batch, args, kwargs))

        data, rebuild = split_args(model_args, model_kwargs)  # data as arguments, not constants
        finite = jax.jit(jax.vmap(finite_at, (0, None)) if batched else finite_at)(z, data)
        if not_jax_tracer(finite) and not np.all(finite):
            bad = np.flatnonzero(~np.atleast_1d(np.asarray(finite)))
            raise ValueError(
                "The potential or its gradient is not finite at the initial position"
                + (f" of chain(s) {bad.tolist()}" if batched else "")
                + ". init_params are unconstrained values: check they are in the support after "
                "the transform, and that the model's log-density is finite there."
            )

    def _check_row_order(self, z, rng_key, model_args, model_kwargs, draws=32):
        """Warn if blocks of rows give far noisier gradients than random batches at ``z``.

        On rows in random order the two have the same covariance, ``(n-b)/(n-1) I/b``; on
        ordered rows (sorted, grouped, in time order) a block is a biased sample of one region.
        """
        estimate = minibatch_gradient(self._potential_fn, num_data(self._plates))

        def spread(method, key, data):
            init, gradient = self._gradient_estimator(estimate, method)
            args, kwargs = rebuild(data)

            def flat_gradient(k):
                grad = gradient(z, init(k), k, args, kwargs)[0]
                return ravel_pytree(grad)[0]

            grads = jax.vmap(flat_gradient)(random.split(key, draws))
            return jnp.sum(jnp.var(grads, axis=0))

        key_blocks, key_random = random.split(rng_key)
        data, rebuild = split_args(model_args, model_kwargs)  # data as arguments, not constants
        ratio = jax.jit(
            lambda a, b, data: spread("blocks", a, data) / spread("without_replacement", b, data)
        )(key_blocks, key_random, data)
        if not_jax_tracer(ratio) and float(ratio) > 3.0:
            warnings.warn(
                f"{type(self).__name__}: with batch_sampling='blocks' the gradient noise is "
                f"{float(ratio):.3g} times that of random batches: the rows look ordered "
                "(sorted, grouped or in time order), so each block samples one region of the "
                "data. Shuffle them once, e.g. X, y = numpyro_sgmc.shuffle_rows(key, X, y), "
                "or use batch_sampling='with_replacement'.",
                DataOrderWarning,
                stacklevel=user_stacklevel(),
            )

    @staticmethod
    def _per_chain(chain_spec, kernel_spec, z, num_chains, role):
        """Prepare ``Γ`` or ``Λ`` for every chain: the chain's own if given, else the kernel's."""
        if num_chains is None:
            return preconditioners.prepare(
                kernel_spec if chain_spec is None else chain_spec, z, role
            )
        if chain_spec is None:
            shared = preconditioners.prepare(kernel_spec, _chain(z, 0), role)
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_chains,) + jnp.shape(x)), shared)
        return _stack(
            [
                preconditioners.prepare(_chain(chain_spec, c), _chain(z, c), f"ChainInit.{role}")
                for c in range(num_chains)
            ]
        )

    def _centre(self, centre_z, rng_key, model_args, model_kwargs, batched):
        """The control-variate centre: ``θ̂`` and ``ḡ(θ̂)`` for every chain, with a sanity check."""
        full = self._full_gradient()
        minibatch = minibatch_gradient(self._potential_fn, num_data(self._plates))
        # with replacement: noise covariance I/b
        init, gradient = self._gradient_estimator(minibatch, "with_replacement")

        def centre_and_offset(z, key, args, kwargs):
            g_full = full(z, args, kwargs)
            # gradient noise of a few batches at the centre: its size is the scale on which the
            # full-data gradient at a mode is zero (theory §3: ĝ noise has covariance I/b)
            noise = jax.vmap(
                lambda k: (
                    _tree_norm(
                        jax.tree.map(jnp.subtract, gradient(z, init(k), k, args, kwargs)[0], g_full)
                    )
                    ** 2
                )
            )(random.split(key, 4))
            return Centre(z, g_full), _tree_norm(g_full) ** 2, jnp.mean(noise)

        if batched:
            centre_and_offset = jax.vmap(centre_and_offset, (0, 0, None, None))
        centre, grad_sq, noise_sq = jax.jit(centre_and_offset)(
            centre_z, rng_key, model_args, model_kwargs
        )
        if not_jax_tracer(grad_sq):
            self._warn_far_centre(np.atleast_1d(grad_sq), np.atleast_1d(noise_sq))
        return centre

    def _warn_far_centre(self, grad_sq, noise_sq):
        # At a mode ḡ(θ̂) = 0; a posterior-typical centre has E|ḡ|² ≈ tr(I)/n while the batch
        # noise has E|ĝ_B - ḡ|² = tr(I)/b. Flag centres 10 posterior sds or more away.
        n = num_data(self._plates)
        b = sum(p.batch_size for p in self._plates.values())
        if b == n:
            return
        ratio = grad_sq * n / np.maximum(noise_sq * b, np.finfo(np.float32).tiny)
        if np.any(ratio > 100.0):
            warnings.warn(
                f"{type(self).__name__}: the control-variate centre is far from a mode: "
                f"n·|ḡ(θ̂)|² / (b·|ĝ_B(θ̂) - ḡ(θ̂)|²) = {float(np.max(ratio)):.3g} (about 1 or "
                "less at a mode). Control variates only reduce the gradient noise near θ̂. "
                "Start the chain at the MAP (init_strategy=init_to_value(values=map_estimate) "
                "or init_params), or pass the MAP as ChainInit(centre=...).",
                CentreWarning,
                stacklevel=user_stacklevel(),
            )

    # ---- sample --------------------------------------------------------------------------

    def _step(self, state: SGMCState, model_args, model_kwargs) -> SGMCState:
        key, key_batch, key_noise = random.split(state.rng_key, 3)
        grad, batch_state = self._gradient(
            state.z, state.batch_state, key_batch, model_args, model_kwargs, state.centre
        )
        beta = self.inverse_temperature
        if math.isinf(beta):
            proposal = sgd_step(state.z, grad, self._step_size, state.preconditioner)
        else:
            lam = (
                state.preconditioner
                if state.noise_preconditioner is None
                else state.noise_preconditioner
            )
            proposal = langevin_step(
                key_noise, state.z, grad, self._step_size, beta, state.preconditioner, lam
            )
        finite = tree_all_finite(grad) & tree_all_finite(proposal)
        z = jax.tree.map(lambda new, old: jnp.where(finite, new, old), proposal, state.z)
        average = state.average
        if average is not None:
            # running mean of the post-warm-up iterates; restarts when warm-up ends
            count = jnp.maximum(state.i + 1 - self._num_warmup_steps, 1)
            average = jax.tree.map(lambda a, x: a + (x - a) / count, average, z)
        return state._replace(
            i=state.i + 1,
            z=z,
            grad_norm=_tree_norm(grad),
            num_diverging=state.num_diverging + (~finite).astype(state.num_diverging.dtype),
            average=average,
            batch_state=batch_state,
            rng_key=key,
        )

    def sample(self, state, model_args, model_kwargs):
        """One MCMC draw: ``num_steps`` iterations of the update in one compiled loop."""
        concrete, self._traced_data_bytes = _data_bytes(model_args, model_kwargs)
        if concrete > _LARGE_DATA_BYTES:
            # MCMC(jit_model_args=False), NumPyro's default, closes the loop over the data
            _warn_large_data(
                f"The model arguments ({concrete / 2**20:.0f} MB) are compiled into the sampling "
                "loop as constants, which makes compilation slow (about 15 s for 400 MB here). "
                "Pass MCMC(..., jit_model_args=True, progress_bar=False) for data this large."
            )
        step = partial(
            self._step,
            model_args=tuple(model_args),
            model_kwargs={} if model_kwargs is None else model_kwargs,
        )

        def draw(s):
            if self._num_steps == 1:
                return step(s)
            return lax.fori_loop(0, self._num_steps, lambda _, s: step(s), s)

        new_state = draw(state) if is_prng_key(state.rng_key) else jax.vmap(draw)(state)
        if self._progress is not None:
            self._progress.report(state.i, new_state.i)
        num_diverging = report_new_divergences(
            state.num_diverging,
            new_state.num_diverging,
            new_state.i,
            type(self).__name__,
            self._step_size,
        )
        return new_state._replace(
            diverging=num_diverging > state.num_diverging, num_diverging=num_diverging
        )
