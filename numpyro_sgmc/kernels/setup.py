"""A kernel's ``init`` as a function of its :class:`~numpyro_sgmc.kernels.family.Recipe`.

:func:`start` prepares the model (:func:`~numpyro_sgmc.data.model.prepare_model`), runs the
checks of ``numpyro_sgmc.kernels.checks``, gives every chain its own parameters and
control-variate centre (in the state, so that ``chain_method="vectorized" | "sequential" |
"parallel"`` all keep them per chain), chooses ``step_size="auto"``
(:mod:`~numpyro_sgmc.kernels.auto_step`) and builds the initial state with the family's pure
``init``. Everything it needs of the kernel is in the recipe's :class:`Family` record.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
from numpyro.util import is_prng_key, not_jax_tracer

from numpyro_sgmc import host
from numpyro_sgmc.compilation import one_shot_jit
from numpyro_sgmc.data import passes, sharding, validation
from numpyro_sgmc.data.files import fed_rows
from numpyro_sgmc.data.gradients import Centre
from numpyro_sgmc.data.model import check_data, prepare_model, split_args
from numpyro_sgmc.kernels import auto_step, checks
from numpyro_sgmc.kernels.family import ChainInit, Recipe, chain_keys, predicted_draw

__all__ = ["Start", "start"]


class Start(NamedTuple):
    """What :func:`start` made: the initial ``state``, the ``prepared`` model, the static
    ``config``, whether the chains are ``batched`` (a leading chain axis), and the
    ``auto_step`` (:class:`~numpyro_sgmc.kernels.auto_step.AutoStep`) and ``step_check``
    (``numpyro_sgmc.kernels.checks.StepCheck``) found, or ``None``."""

    state: Any
    prepared: Any
    config: Any
    batched: bool
    auto_step: Optional[auto_step.AutoStep]
    step_check: Optional[checks.StepCheck]


@one_shot_jit(
    ("build", "config", "structure", "batched", "layout"),
    rows=lambda config, **_: config.spec.num_data,
)
def _init_chains(
    build, config, structure, batched, layout, rng_key, z, law, params, centre, arrays
):
    """Each chain's initial state from its run key (the first of :func:`chain_keys`), at
    ``z``, or (``z`` None) at a draw of the predicted ``law`` by its start key
    (:func:`~numpyro_sgmc.kernels.family.predicted_draw`: in this program, not one of its
    own)."""
    args, kwargs = structure.rebuild(arrays)
    init = build(config).init

    def one(key, z, params, centre):
        z = predicted_draw(layout, law, key) if z is None else z
        return init(chain_keys(key)[0], z, params, args, kwargs, centre)

    return jax.vmap(one)(rng_key, z, params, centre) if batched else one(rng_key, z, params, centre)


@one_shot_jit(("batched",))
def _split_three(batched, rng_key):
    """:func:`chain_keys` of ``rng_key`` (of each key of a batch), in one program."""
    return jax.vmap(chain_keys)(rng_key) if batched else chain_keys(rng_key)


def start(recipe: Recipe, model, rng_key, num_warmup, init_params, model_args, model_kwargs):
    """The :class:`Start` of ``MCMCKernel.init`` (module docstring); ``model_args`` and
    ``model_kwargs`` already as arrays."""
    family, dynamics, options, tuned, name = (
        recipe.family, recipe.dynamics, recipe.options, recipe.tuned, recipe.name
    )  # fmt: skip
    chain_init = init_params if isinstance(init_params, ChainInit) else ChainInit(init_params)
    if chain_init.centre is not None and not dynamics.control_variates:
        raise ValueError(
            f"ChainInit.centre is only used with control variates; {name} has none (use "
            "SGLDFP, or control_variates=True)."
        )
    batched = not is_prng_key(rng_key)
    num_chains = len(rng_key) if batched else None
    # the keys of the start and the checks, split only where a search or a check needs them
    split = functools.cache(partial(_split_three, batched, rng_key))
    sharding.data_layout(model_args, model_kwargs)  # layout errors before the model is traced
    # with control variates, files are checked for non-finite rows by the centre's pass (or
    # were by the tuner's, on its data), not by a pass of their own
    deferred = validation.file_checks_deferred() if dynamics.control_variates else nullcontext()
    with deferred:
        if tuned is None:
            prepared = prepare_model(
                split()[1], model, model_args, model_kwargs, options.batch_size,
                options.init_strategy,
            )  # fmt: skip
        else:  # the tuner's mode: no search for a start
            prepared = prepare_model(
                rng_key, model, model_args, model_kwargs, options.batch_size,
                init_params=tuned.start(num_chains),
            )  # fmt: skip
            tuned.check(prepared.plates, name)
    shards = sharding.data_layout(model_args, model_kwargs, prepared.plates)
    z, law, centre = _starts(recipe, prepared, chain_init, batched, model_args, model_kwargs)
    arrays, structure = split_args(model_args, model_kwargs)
    streamed = shards is None and passes.streams(arrays, prepared.plates)
    if streamed and dynamics.control_variates and not isinstance(centre, Centre):
        # the centre's full-data gradient in one pass over the files, for every chain, read
        # in host chunks: no compiled program takes the files
        at = z if centre is None else centre
        centre = Centre(at, passes.exact_gradient(prepared.spec, at, model_args, model_kwargs,
                                                  options.chunk_size, batched)[1])  # fmt: skip
    if dynamics.control_variates:  # free where a pass has read the files (docstring above)
        check_data(prepared.spec, host.take(z) if batched else z, model_args, model_kwargs,
                   files_only=True)  # fmt: skip
    checks.check_position(z, prepared.init_params, batched)
    first = host.take(z) if batched else z
    data = (model_args, model_kwargs)

    def check_key():
        key_check = split()[2]
        return host.unstack_keys(key_check)[0] if batched else key_check

    if shards is not None:
        sharding.check_shard_evaluation(shards, prepared.spec, first, check_key(), *data)
    if chain_init.params is not None:
        checks.check_finite_start(prepared.spec, z, *data, batched)
    if options.batch_sampling == "blocks":
        checks.check_row_order(prepared.spec, first, check_key(), *data, name)
    if chain_init.centre is not None:
        checks.check_position(centre, prepared.init_params, batched, "ChainInit.centre")
    chosen = None
    if isinstance(dynamics.step_size, auto_step.Auto):  # a fraction of each chain's bound
        chosen = auto_step.choose_step_sizes(
            dynamics.step_size, name, family.stability_bound(dynamics),
            partial(family.step_scale, dynamics), prepared, z, chain_init, check_key(), *data,
            batched,
        )  # fmt: skip
    steps = None if chosen is None else chosen.step_size
    params = _all_chain_params(recipe, prepared, z, chain_init, batched, steps)
    config = family.make_config(dynamics, options, prepared, shards, num_warmup * options.num_steps)
    step_check = None
    hand_set = tuned is None and shards is None and steps is None
    if hand_set and not_jax_tracer(jax.tree.leaves(first)[0]):
        one = jax.tree.map(lambda v: v[0], params) if batched else params
        step_check = family.check_step(dynamics, prepared, first, one, check_key(), *data)
        checks.warn_step_size(step_check, name, inflation=not family.adapts_mass(dynamics))
    if streamed:  # the state needs no rows: the centre's gradient is known
        fed = fed_rows(arrays, prepared.plates).leaves
        arrays = tuple(None if k in fed else a for k, a in enumerate(arrays))
    state = _init_chains(
        family.build, config, structure, batched, prepared.layout, rng_key,
        None if law is not None else z, law, params, centre, arrays,
    )  # fmt: skip
    if shards is not None:
        state = sharding.replicate(state, shards)
    if dynamics.control_variates and tuned is None:  # autotune's centre is its mode
        checks.warn_far_centre(
            prepared.spec, z if centre is None else centre, check_key(), *data, batched, name
        )
    return Start(state, prepared, config, batched, chosen, step_check)


def _starts(recipe: Recipe, prepared, chain_init: ChainInit, batched: bool, *data):
    """``(z, law, centre)``: each chain's start and control-variate centre, the given ones;
    else, for a tuned kernel, the predicted ``law`` (:meth:`Tuned.law`), whose draws by each
    chain's key ``_init_chains`` makes, ``z`` the mode (what the checks before it evaluate)
    and its centre (``Tuned.centre``: with its gradient on the data it was tuned on); else the
    init strategy's."""
    z, centre, tuned = chain_init.params, chain_init.centre, recipe.tuned
    law = None
    if z is None:
        z = prepared.init_params
        if tuned is not None:
            law = tuned.law()
    if centre is None and recipe.dynamics.control_variates and tuned is not None:
        num_chains = jax.tree.leaves(z)[0].shape[0] if batched else None
        centre = tuned.centre(num_chains, *data)
    return z, law, centre


def _all_chain_params(recipe: Recipe, prepared, z, chain_init, batched: bool, steps=None):
    """Every chain's parameters, stacked along a leading chain axis when ``batched``;
    ``steps``: each chain's ``h`` (``None``: the kernel's ``step_size`` for all)."""
    dynamics, chain_params = recipe.dynamics, recipe.family.chain_params
    if not batched:
        step = dynamics.step_size if steps is None else float(steps[0])
        return chain_params(dynamics, prepared, z, chain_init, "", step)
    num_chains = jax.tree.leaves(z)[0].shape[0]
    per_chain = []
    for c in range(num_chains):
        own = jax.tree.map(lambda v, c=c: v[c], chain_init._replace(params=z, centre=None))
        step = dynamics.step_size if steps is None else float(steps[c])
        per_chain.append(chain_params(dynamics, prepared, own.params, own, f" of chain {c}", step))
    return jax.tree.map(lambda *xs: jax.numpy.stack(xs), *per_chain)
