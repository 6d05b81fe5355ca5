"""The thin ``numpyro.infer.MCMC`` shell around the functional core of
:mod:`numpyro_sgmc.kernels.core`.

:class:`SGMCKernel` prepares the model (:func:`~numpyro_sgmc.data.model.prepare_model`), runs the
checks of ``numpyro_sgmc.kernels.checks``, gives every chain its own parameters and
control-variate centre (in the state, so that ``chain_method="vectorized" | "sequential" |
"parallel"`` all keep them per chain), and vectorises the draw once, at ``init``. The named kernels
(:mod:`numpyro_sgmc.kernels.sgld`, :mod:`numpyro_sgmc.kernels.sghmc`) say which estimator,
integrator and adaptation to compose and how to build each chain's parameters.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import identity, is_prng_key, not_jax_tracer

from numpyro_sgmc.data import sharding, validation
from numpyro_sgmc.data.batches import BATCH_SAMPLING
from numpyro_sgmc.data.gradients import control_variates, full_data_gradient, minibatch
from numpyro_sgmc.data.model import constrain, prepare_model, split_args, total_batch
from numpyro_sgmc.data.progress import EpochProgress, RunWatch, interrupts
from numpyro_sgmc.data.subsample import full_data
from numpyro_sgmc.diagnostics import report_new_divergences
from numpyro_sgmc.kernels import auto_step, checks
from numpyro_sgmc.kernels.core import draw, tree_all_finite

__all__ = [
    "ChainInit",
    "KernelOptions",
    "Tuned",
    "SGMCKernel",
    "check_step_size",
    "estimator_for",
    "valid_constrained",
]

_DIAGNOSTICS_INTERVAL = 0.25  # seconds between progress-bar reads of the divergence count


class ChainInit(NamedTuple):
    """Per-chain starting values, passed to ``MCMC.run(..., init_params=ChainInit(...))``.

    With ``num_chains > 1`` every given field carries a leading chain axis; ``MCMC`` hands
    chain ``k`` its slice whatever the ``chain_method``.

    :param dict params: starting position, unconstrained (as NumPyro's ``init_params``);
        ``None`` to use the kernel's ``init_strategy``.
    :param preconditioner: this chain's drift preconditioner ``Γ`` (SGLD, SGLD-FP, SGD) or mass
        ``M`` (SGHMC); ``None`` for the kernel's.
    :param noise_preconditioner: this chain's ``Λ`` (first-order kernels); ``None`` for the
        kernel's.
    :param dict centre: this chain's control-variate centre ``θ̂``, unconstrained; ``None`` for
        the starting position. Only for kernels with control variates.
    """

    params: Optional[dict] = None
    preconditioner: Any = None
    noise_preconditioner: Any = None
    centre: Optional[dict] = None


def estimator_for(spec, shards, batch_sampling: str, control: bool, chunk_size: int):
    """The gradient estimator of a kernel: minibatch, data-parallel over ``shards`` when the
    data are sharded, wrapped in control variates when ``control``."""
    if shards is None:
        base = minibatch(spec, batch_sampling)
        full = partial(full_data_gradient, spec, chunk_size=chunk_size)
    else:
        base = sharding.minibatch(shards, spec, batch_sampling)
        full = sharding.full_data_gradient(shards, spec, chunk_size)
    return control_variates(base, full) if control else base


def valid_constrained(spec, exclude) -> Callable:
    """``valid(z, args, kwargs)``: every constrained value and deterministic site is finite."""

    def valid(z, model_args, model_kwargs):
        return tree_all_finite(constrain(spec, z, model_args, model_kwargs, exclude))

    return valid


@partial(jax.jit, static_argnames=("build", "config", "structure", "batched"))
def _init_chains(build, config, structure, batched, rng_key, z, params, centre, arrays):
    args, kwargs = structure.rebuild(arrays)
    init = build(config).init
    if batched:
        return jax.vmap(init, (0, 0, 0, None, None, 0))(rng_key, z, params, args, kwargs, centre)
    return init(rng_key, z, params, args, kwargs, centre)


def draws_of(build: Callable, config, num_steps: int, batched: bool) -> Callable:
    """``sample(state, model_args, model_kwargs)``: one draw of ``num_steps`` iterations,
    vectorised over a leading chain axis when ``batched``."""
    one = draw(build(config), num_steps)
    return jax.vmap(one, (0, None, None)) if batched else one


class Tuned(NamedTuple):
    """What :func:`~numpyro_sgmc.autotune` tuned a kernel for: the data's plates, the mode and
    the predicted law of the unconstrained parameters (flat ``mean``, a scale ``covariance``)."""

    plates: tuple
    mean: Any
    covariance: Any

    def check(self, plates, kernel_name: str):
        """The data a tuned kernel runs on are the data it was tuned on (their plate sizes)."""
        tuned = {p.name: p.size for p in self.plates}
        given = {p.name: p.size for p in plates}
        if tuned != given:
            raise ValueError(
                f"This {kernel_name} kernel was tuned by autotune for data with plate sizes "
                f"{tuned}, but is run on {given}. Its step size, batch size, temperature and "
                "preconditioners are those of the tuning data (the posterior narrows as 1/n): "
                "run autotune on these data."
            )

    def draws(self, rng_key, layout, batched: bool):
        """Starting positions drawn from the predicted law, one per key."""
        mean = jnp.asarray(self.mean)
        root = self.covariance.sqrt()
        root = jax.tree.map(lambda a: jnp.asarray(a, mean.dtype), root)

        def one(key):
            return layout.unravel(mean + root.apply(random.normal(key, mean.shape, mean.dtype)))

        return jax.vmap(one)(rng_key) if batched else one(rng_key)

    def centre(self, layout, num_chains: Optional[int]):
        """The control-variate centre: the mode, for every chain."""
        mean = jnp.asarray(self.mean)
        mean = mean if num_chains is None else jnp.broadcast_to(mean, (num_chains,) + mean.shape)
        return layout.unravel(mean)


class KernelOptions(NamedTuple):
    """The keyword arguments every kernel takes (see :class:`~numpyro_sgmc.SGLD`)."""

    batch_size: Any
    batch_sampling: str
    num_steps: int
    init_strategy: Callable
    chunk_size: int
    progress_draws: Optional[int]

    def check(self) -> "KernelOptions":
        batch_size = self.batch_size
        if batch_size is not None and not isinstance(batch_size, (int, np.integer, dict)):
            raise TypeError(
                f"batch_size must be None, an int or a dict {{plate: int}}, got {batch_size!r}."
            )
        if self.batch_sampling not in BATCH_SAMPLING:
            raise ValueError(
                f"Unknown batch_sampling {self.batch_sampling!r}; choose one of "
                f"{', '.join(BATCH_SAMPLING)}."
            )
        _check_count("num_steps", self.num_steps)
        _check_count("chunk_size", self.chunk_size)
        if not callable(self.init_strategy):
            raise TypeError(
                f"init_strategy must be a NumPyro init strategy (e.g. "
                f"numpyro.infer.init_to_median), got {self.init_strategy!r}."
            )
        return self


class SGMCKernel(MCMCKernel):
    """What every stochastic-gradient kernel shares; use the named kernels.

    Subclasses define ``_build(config) -> Kernel`` (a static method of the hashable
    ``config``), ``_make_config(prepared, shards, num_warmup_steps)`` and
    ``_chain_params(prepared, position, chain_init, where, step_size)`` (one chain's
    parameters); for ``step_size="auto"`` (:mod:`~numpyro_sgmc.kernels.auto_step`) also
    ``_stability_bound()`` and ``_step_scale(prepared, position, chain_init, where)`` (a
    chain's ``P`` of ``h·λmax(PJ)``).
    """

    sample_field = "z"
    _control_variates = False

    def __init__(self, model, options: KernelOptions):
        if not callable(model):
            raise TypeError(f"model must be a NumPyro model (a callable), got {model!r}.")
        options.check()
        self._model = model
        self._batch_size = options.batch_size
        self._batch_sampling = options.batch_sampling
        self._num_steps = int(options.num_steps)
        self._init_strategy = options.init_strategy
        self._chunk_size = int(options.chunk_size)
        self.progress_draws = options.progress_draws
        self._prepared = None
        self._config = None
        self._sample_fn = None
        self._tuned = None
        self.step_check = None
        self.auto_step = None

    # ---- what MCMC asks -------------------------------------------------------------------

    @property
    def model(self):
        """The model as a full-data program: its subsample plates run over all their rows.

        This is the target the kernel samples, and what tools that replay the model see
        (``az.from_numpyro`` computes per-datum log-likelihoods with it: memory
        ``draws × n``; pass ``log_likelihood=False`` there for large ``n``).
        """
        return full_data(self._model)

    @property
    def prepared(self):
        """The :class:`~numpyro_sgmc.data.model.SubsampledModel` of the last ``init``."""
        return self._prepared

    @property
    def plates(self) -> Optional[dict]:
        """Plate name -> :class:`~numpyro_sgmc.data.subsample.SubsamplePlate` (after ``init``)."""
        return None if self._prepared is None else {p.name: p for p in self._prepared.plates}

    @property
    def shards(self):
        """The :class:`~numpyro_sgmc.data.sharding.DataLayout` of sharded data (after ``init``), or
        ``None`` on one device."""
        return None if self._config is None else self._config.shards

    @property
    def num_data(self) -> Optional[int]:
        """``n``, the number of data over all subsample plates (known after ``init``)."""
        return None if self._prepared is None else self._prepared.num_data

    @property
    def num_steps(self) -> int:
        """Iterations of the update per MCMC draw."""
        return self._num_steps

    @property
    def progress_draws(self):
        return self._progress_draws

    @progress_draws.setter
    def progress_draws(self, value):
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1
        if value is not None and not ok:
            raise ValueError(f"progress_draws must be None or a positive int, got {value!r}.")
        self._progress_draws = value

    @property
    def default_fields(self):
        """``z``, ``diverging`` and ``interrupted`` (draws skipped after a Ctrl-C)."""
        return ("z", "diverging", "interrupted")

    def get_diagnostics_str(self, state):
        """Divergences so far, for NumPyro's progress bar (read at most every 0.25 s, so
        that NumPyro can dispatch the next draws while this one computes)."""
        if not self._warned_copies:
            checks.warn_progress_copies(self._traced_bytes)
            self._warned_copies = True
        now = time.monotonic()
        if self._diagnostics is None or now - self._diagnostics[0] >= _DIAGNOSTICS_INTERVAL:
            self._diagnostics = (now, f"{int(np.sum(state.num_diverging))} divergences")
        return self._diagnostics[1]

    def postprocess_fn(self, model_args, model_kwargs):
        """Unconstrained draws -> constrained values and deterministic sites (those inside a
        subsample plate, per-datum values of one batch, are left out: use ``Predictive``)."""
        if self._prepared is None:
            return identity
        spec, exclude = self._prepared.spec, self._prepared.per_datum_sites
        args, kwargs = validation.as_arrays(self._model, model_args, model_kwargs)
        return lambda z: constrain(spec, z, args, kwargs, exclude)

    # ---- init -----------------------------------------------------------------------------

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        model_args, model_kwargs = validation.as_arrays(self._model, model_args, model_kwargs)
        chain_init = init_params if isinstance(init_params, ChainInit) else ChainInit(init_params)
        if chain_init.centre is not None and not self._control_variates:
            raise ValueError(
                f"ChainInit.centre is only used with control variates; {type(self).__name__} "
                "has none (use SGLDFP, or control_variates=True)."
            )
        batched = not is_prng_key(rng_key)
        if batched:
            keys = jax.vmap(partial(random.split, num=3))(rng_key)
            rng_key, key_init, key_check = keys[:, 0], keys[:, 1], keys[:, 2]
        else:
            rng_key, key_init, key_check = random.split(rng_key, 3)
        sharding.data_layout(model_args, model_kwargs)  # layout errors before the model is traced
        prepared = prepare_model(
            key_init, self._model, model_args, model_kwargs, self._batch_size, self._init_strategy
        )
        shards = sharding.data_layout(model_args, model_kwargs, prepared.plates)
        if self._tuned is not None:
            self._tuned.check(prepared.plates, type(self).__name__)
        z, centre = self._starts(prepared, chain_init, key_init, batched)
        checks.check_position(z, prepared.init_params, batched)
        first = jax.tree.map(lambda v: v[0], z) if batched else z
        key = key_check[0] if batched else key_check
        if shards is not None:
            sharding.check_shard_evaluation(
                shards, prepared.spec, first, key, model_args, model_kwargs
            )
        if chain_init.params is not None:
            checks.check_finite_start(prepared.spec, z, model_args, model_kwargs, batched)
        if self._batch_sampling == "blocks":
            checks.check_row_order(
                prepared.spec, first, key, model_args, model_kwargs, type(self).__name__
            )
        if centre is not None:
            checks.check_position(centre, prepared.init_params, batched, "ChainInit.centre")
        self.auto_step = None
        if isinstance(self._step_size, auto_step.Auto):  # a fraction of each chain's bound
            self.auto_step = auto_step.choose_step_sizes(
                self._step_size, self, prepared, z, chain_init, key, model_args, model_kwargs,
                batched,
            )  # fmt: skip
        steps = None if self.auto_step is None else self.auto_step.step_size
        params = self._all_chain_params(prepared, z, chain_init, batched, steps)
        self._prepared = prepared
        self._config = _finite_draws(
            self._make_config(prepared, shards, num_warmup * self._num_steps), prepared
        )
        self.step_check = None
        hand_set = self._tuned is None and shards is None and steps is None
        if hand_set and not_jax_tracer(jax.tree.leaves(first)[0]):
            one = jax.tree.map(lambda v: v[0], params) if batched else params
            self.step_check = self._check_step(prepared, first, one, key, model_args, model_kwargs)
            checks.warn_step_size(
                self.step_check, type(self).__name__, inflation=not self._adapts_mass()
            )
        arrays, structure = split_args(model_args, model_kwargs)
        state = _init_chains(
            type(self)._build, self._config, structure, batched, rng_key, z, params, centre, arrays
        )
        if shards is not None:
            state = sharding.replicate(state, shards)
        if self._control_variates and self._tuned is None:  # autotune's centre is its mode
            checks.warn_far_centre(
                prepared.spec,
                z if centre is None else centre,
                key,
                model_args,
                model_kwargs,
                batched,
                type(self).__name__,
            )
        self._progress = self._epoch_progress()
        on_stop = None if self._progress is None else self._progress.close
        watch = RunWatch(type(self).__name__, self._num_steps, num_warmup, on_stop)
        draws = draws_of(type(self)._build, self._config, self._num_steps, batched)
        self._sample_fn = watch.guard(draws)
        interrupts.arm()  # Ctrl-C stops the run and keeps its draws (numpyro_sgmc.data.progress)
        self._diagnostics, self._warned_copies, self._warned_constants = None, False, False
        self._traced_bytes = 0
        return state

    def _starts(self, prepared, chain_init: ChainInit, rng_key, batched: bool):
        """Each chain's start and control-variate centre: the given ones; else, for a tuned
        kernel, draws from the predicted law and the mode; else the init strategy's."""
        z, centre = chain_init.params, chain_init.centre
        if z is None:
            if self._tuned is None:
                z = prepared.init_params
            else:
                z = self._tuned.draws(rng_key, prepared.layout, batched)
        if centre is None and self._control_variates and self._tuned is not None:
            num_chains = jax.tree.leaves(z)[0].shape[0] if batched else None
            centre = self._tuned.centre(prepared.layout, num_chains)
        return z, centre

    def _all_chain_params(self, prepared, z, chain_init: ChainInit, batched: bool, steps=None):
        """Every chain's parameters, stacked along a leading chain axis when ``batched``;
        ``steps``: each chain's ``h`` (``None``: the kernel's ``step_size`` for all)."""
        if not batched:
            step = self._step_size if steps is None else float(steps[0])
            return self._chain_params(prepared, z, chain_init, "", step)
        num_chains = jax.tree.leaves(z)[0].shape[0]
        per_chain = []
        for c in range(num_chains):
            own = jax.tree.map(lambda v, c=c: v[c], chain_init._replace(params=z, centre=None))
            step = self._step_size if steps is None else float(steps[c])
            per_chain.append(self._chain_params(prepared, own.params, own, f" of chain {c}", step))
        return jax.tree.map(lambda *xs: jax.numpy.stack(xs), *per_chain)

    def _epoch_progress(self) -> Optional[EpochProgress]:
        if self._progress_draws is None:
            return None
        return EpochProgress(
            self._progress_draws * self._num_steps,
            iterations_per_epoch=self._prepared.num_data / total_batch(self._prepared.plates),
            desc=f"{type(self).__name__} ",
        )

    # ---- sample ---------------------------------------------------------------------------

    def sample(self, state, model_args, model_kwargs):
        """One MCMC draw: ``num_steps`` iterations of the update in one compiled loop, or
        none after a Ctrl-C (:class:`~numpyro_sgmc.data.progress.RunWatch`)."""
        model_args, model_kwargs = validation.as_arrays(self._model, model_args, model_kwargs)
        concrete, self._traced_bytes = checks.data_bytes(model_args, model_kwargs)
        if not self._warned_constants:
            checks.warn_compiled_in_data(concrete)
            self._warned_constants = True
        new = self._sample_fn(state, model_args, model_kwargs)
        if self._progress is not None:
            self._progress.report(state.i, new.i)
        num_diverging = report_new_divergences(
            state.num_diverging,
            new.num_diverging,
            new.divergence_iteration,
            type(self).__name__,
            self._step_size_label(),
            self._num_steps,
        )
        return new._replace(num_diverging=num_diverging)

    def _adapts_mass(self) -> bool:
        """Whether the kernel adapts its mass during warm-up (AdaSGHMC's ``adaptation_window``):
        the step check at the initial mass then predicts nothing of the kept draws' law."""
        return getattr(self, "_adaptation_window", None) is not None

    def _step_size_label(self) -> str:
        return f"{self._step_size:g}" if isinstance(self._step_size, float) else "per chain"


def _finite_draws(config, prepared):
    """``config`` with its check of the constrained values (``check_support``, which rejects a
    step whose constrained values or deterministic sites are not finite) on wherever the model
    has a deterministic site: ``exp`` of a finite position can overflow there too."""
    deterministic = any(
        site["type"] == "deterministic" and name not in prepared.per_datum_sites
        for name, site in prepared.prototype_trace.items()
    )
    return config._replace(check_support=True) if deterministic else config


def _check_count(name, value):
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}.")


def check_step_size(step_size) -> float:
    """A positive finite number (the kernels' ``step_size``, ``h``)."""
    if (
        isinstance(step_size, (str, bytes, bool))
        or not np.isscalar(step_size)
        and np.ndim(step_size)
    ):
        raise TypeError(f"step_size must be a positive number, got {step_size!r}.")
    try:
        h = float(step_size)
    except (TypeError, ValueError):
        raise TypeError(f"step_size must be a positive number, got {step_size!r}.") from None
    if not (h > 0 and math.isfinite(h)):
        raise ValueError(f"step_size must be positive and finite, got {step_size!r}.")
    return h
