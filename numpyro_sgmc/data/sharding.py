"""Data-parallel gradients over data sharded across devices and hosts.

Shard the per-datum arrays along their leading (plate) axis over a 1-D device mesh, with
:func:`shard_data`, and run any kernel as usual::

    X, y = numpyro_sgmc.shard_data(X, y)          # NamedSharding(mesh, P("data"))
    mcmc = MCMC(SGLD(model, 1e-3), num_warmup=100, num_samples=1000,
                jit_model_args=True, progress_bar=False)
    mcmc.run(jax.random.key(0), X, y)

At ``init`` the kernel finds the sharded arguments (:func:`data_layout`) and estimates every
gradient inside :func:`jax.shard_map` over the mesh's data axis of ``D`` devices. Device ``d``
draws ``b_p/D`` indices among its own ``n_p/D`` rows of each subsample plate ``p``
(:func:`~numpyro_sgmc.data.batches.batch_sampler` with ``shard_axis``, O(b/D) per step), evaluates
the model on them with the plate scaled to the *global* size
(:class:`~numpyro_sgmc.data.subsample.plate_sizes`), and the ``D`` estimates are averaged with
:func:`jax.lax.pmean`:

.. math::

    \\hat g_d(\\theta) = \\tfrac{1}{n}\\nabla\\log p_0(\\theta)
        + \\tfrac{D}{b}\\textstyle\\sum_{i\\in B_d}\\nabla l(\\theta; X_i),
    \\qquad
    \\hat g(\\theta) = \\tfrac{1}{D}\\textstyle\\sum_d \\hat g_d(\\theta)
        = \\tfrac{1}{n}\\nabla\\log p_0(\\theta)
        + \\tfrac{1}{b}\\textstyle\\sum_{i\\in B_1\\cup\\dots\\cup B_D}\\nabla l(\\theta; X_i).

Each ``ĝ_d`` is unbiased for the average gradient ``-∇U/n`` (``E Σ_{B_d} ∇l = (b/D)·(D/n)·
Σ_{shard d} ∇l``), so ``ĝ`` is the minibatch estimate of ``docs/theory.md`` §1 with
the prior counted once and the likelihood scaled by ``n/b``; its batch is stratified over the
shards. Its noise covariance is ``Ī/b``, ``Ī`` the mean over shards of the within-shard
covariance of the per-datum gradients: ``I`` of ``docs/theory.md`` §2–§3 up to a relative
``O(D/n)`` when the rows are in random order (``Ī ≤ I`` always: the between-shard part is left
out), so the single-device predictions of :mod:`numpyro_sgmc.theory` hold. The control-variate
centre's full-data gradient is summed over the shards with :func:`jax.lax.psum`, the prior weighted
``1/D`` on each (:func:`~numpyro_sgmc.data.gradients.full_data_gradient`).

Everything else (the position update and its Langevin noise, the momentum, the batch sampler's
state) is computed from the same key on every device, so the chain is the same on all of
them. With ``D = 1``, or with full-data gradients (``batch_size = n``), the draws are those of
the single-device kernel for the same key (up to the order of floating-point sums).

Multi-host: call :func:`numpyro_sgmc.running.distributed.initialize` first; :func:`shard_data` then
builds the global arrays from each process's own rows. See ``docs/distributed.md``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from numpyro.util import not_jax_tracer

from numpyro_sgmc.data import gradients
from numpyro_sgmc.data.batches import batch_sampler
from numpyro_sgmc.data.gradients import Estimator, batch_gradient
from numpyro_sgmc.data.model import split_args

__all__ = [
    "DataLayout",
    "check_shard_evaluation",
    "data_layout",
    "data_mesh",
    "full_data_gradient",
    "minibatch",
    "replicate",
    "shard_data",
    "shard_plates",
]


def data_mesh(devices=None, axis_name: str = "data") -> Mesh:
    """A 1-D :class:`jax.sharding.Mesh` named ``axis_name`` over ``devices``.

    :param devices: default :func:`jax.devices`, every process's devices in a multi-host run
        (in process order, so process ``k``'s rows follow process ``k-1``'s).
    """
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (axis_name,))


def shard_data(*arrays, mesh: Optional[Mesh] = None, axis_name: str = "data"):
    """Shard arrays along their leading (plate) axis over the data axis of a device mesh.

    Each array's rows are split into ``D`` equal blocks, block ``d`` on the ``d``-th device of
    the mesh axis (``NamedSharding(mesh, P(axis_name))``); the kernels then estimate
    gradients data-parallel (module docstring). In a single process the arrays are the whole
    data; in a multi-host run (after :func:`numpyro_sgmc.running.distributed.initialize`) each
    process passes *its own rows*, the same number on every process, and the global array is their
    concatenation in process order (:func:`jax.make_array_from_process_local_data`).

    :param arrays: arrays with the same number of rows (the plate's data: covariates,
        responses, ...).
    :param mesh: default :func:`data_mesh` over all devices. A mesh of several axes is fine:
        the data are replicated over the other axes.
    :param str axis_name: the mesh axis to shard over.
    :return: the sharded array, or a tuple of them.
    :raises ValueError: the rows are not divisible by the number of devices on the axis, the
        arrays have different numbers of rows, the mesh has no axis ``axis_name``, or (multi-
        host) the processes hold different numbers of rows.
    """
    if not arrays:
        raise TypeError("shard_data needs at least one array.")
    mesh = data_mesh(axis_name=axis_name) if mesh is None else mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"The mesh has axes {tuple(mesh.axis_names)}, not {axis_name!r}: pass "
            f"axis_name=<one of them>, or build the mesh with numpyro_sgmc.data_mesh()."
        )
    num_shards = mesh.shape[axis_name]
    rows = [np.shape(a)[0] if np.ndim(a) >= 1 else None for a in arrays]
    if None in rows:
        raise ValueError("shard_data shards along the leading axis; got a 0-d array.")
    if len(set(rows)) != 1:
        raise ValueError(
            f"shard_data needs arrays with the same number of rows (the plate's data), got {rows}."
        )
    local_rows = rows[0]
    sharding = NamedSharding(mesh, PartitionSpec(axis_name))
    if jax.process_count() == 1:
        if local_rows % num_shards:
            raise ValueError(_indivisible(local_rows, num_shards, axis_name))
        out = tuple(jax.device_put(a, sharding) for a in arrays)
    else:
        local_shards = _local_shards(mesh, axis_name)
        counts = _gather_row_counts(local_rows)
        if len(set(counts)) != 1:
            raise ValueError(
                f"In a multi-host run every process passes its own rows, the same number on "
                f"each: the processes hold {counts} rows. Split the data evenly."
            )
        if local_rows % local_shards:
            raise ValueError(
                f"This process holds {local_rows} rows for its {local_shards} device(s) on mesh "
                f"axis {axis_name!r}: "
                + _indivisible(local_rows * len(counts), num_shards, axis_name)
            )
        out = tuple(jax.make_array_from_process_local_data(sharding, np.asarray(a)) for a in arrays)
    return out[0] if len(out) == 1 else out


def _indivisible(n, num_shards, axis_name) -> str:
    lower = n - n % num_shards
    return (
        f"{n} rows cannot be split evenly over the {num_shards} devices of mesh axis "
        f"{axis_name!r}: use a number of rows divisible by {num_shards} (e.g. drop the last "
        f"{n - lower} rows, X[:{lower}]), or a mesh whose number of devices divides {n}."
    )


def _local_shards(mesh: Mesh, axis_name: str) -> int:
    """Distinct positions along ``axis_name`` that this process's devices occupy."""
    axis = mesh.axis_names.index(axis_name)
    local = {d.id for d in jax.local_devices()}
    positions = {
        index[axis] for index, device in np.ndenumerate(mesh.devices) if device.id in local
    }
    return len(positions)


def _gather_row_counts(local_rows: int) -> list:
    from jax.experimental import multihost_utils

    counts = multihost_utils.process_allgather(np.asarray(local_rows, np.int64))
    return [int(c) for c in np.ravel(counts)]


# ---- finding the layout at init --------------------------------------------------------------


class DataLayout(NamedTuple):
    """How the model arguments are laid out over the devices (found by :func:`data_layout`).

    :param mesh: the :class:`jax.sharding.Mesh` the data are sharded over.
    :param str axis_name: its data axis.
    :param int num_shards: ``D``, the number of devices along it.
    :param treedef: the pytree structure of ``(model_args, model_kwargs)``.
    :param frozenset sharded: positions of the sharded leaves in that structure.
    """

    mesh: Mesh
    axis_name: str
    num_shards: int
    treedef: object
    sharded: frozenset


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _sharding_of(x):
    """``(mesh, axis)`` if ``x`` is sharded along its leading axis only, ``None`` if it is
    replicated or on one device; raises for any other layout.

    A ``NamedSharding`` that names a mesh axis counts as sharded even over a mesh of one
    device (``D = 1``: the data-parallel code path, with the single-device draws).
    """
    if not isinstance(x, jax.Array) or not not_jax_tracer(x):
        return None
    sharding = x.sharding
    named = isinstance(sharding, NamedSharding) and any(s is not None for s in sharding.spec)
    if not named and sharding.is_fully_replicated:
        return None
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            f"A model argument of shape {x.shape} is split over devices with a "
            f"{type(sharding).__name__}; the kernels need it sharded along its leading "
            "(plate) axis with a NamedSharding: use numpyro_sgmc.shard_data(...)."
        )
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    first = spec[0] if spec else None
    if first is None or any(s is not None for s in spec[1:]):
        raise ValueError(
            f"A model argument of shape {x.shape} is sharded as PartitionSpec{spec}: the "
            "kernels shard data along the plate axis only, the leading one, "
            "PartitionSpec('data') (numpyro_sgmc.shard_data does this). Shard it along axis 0, "
            "or replicate it."
        )
    axes = first if isinstance(first, tuple) else (first,)
    if len(axes) != 1:
        raise ValueError(
            f"A model argument of shape {x.shape} is sharded over the mesh axes {axes} at "
            "once; shard the data over one mesh axis (numpyro_sgmc.data_mesh())."
        )
    return sharding.mesh, axes[0]


def data_layout(model_args, model_kwargs, plates: Optional[tuple] = None) -> Optional[DataLayout]:
    """Find the sharded model arguments and check them (against the subsample plates if given).

    The kernels call it twice at ``init``: without ``plates`` before tracing the model (so
    that arguments on different meshes get this error rather than JAX's), and with them after.

    :return: ``None`` when no argument is sharded (the single-device code path), else a
        :class:`DataLayout`.
    :raises ValueError: arguments sharded over different meshes or mesh axes, or along a
        non-plate axis; sharded data under ``chain_method="parallel"``; and with ``plates``: a
        sharded argument whose leading size is no subsample plate's size, a subsample plate
        none of whose data is sharded, or whose data is only partly sharded, a plate size or
        batch size not divisible by the number of devices.
    """
    leaves, treedef = jax.tree.flatten((tuple(model_args), model_kwargs))
    found = {}
    for i, x in enumerate(leaves):
        layout = _sharding_of(x)
        if layout is not None:
            found[i] = layout
    if not found:
        return None
    if len({mesh for mesh, _ in found.values()}) > 1:
        raise ValueError(
            "The sharded model arguments are laid out over different device meshes; shard all "
            "of them with the same mesh (numpyro_sgmc.shard_data(X, y, mesh=mesh))."
        )
    axis_names = sorted({a for _, a in found.values()})
    if len(axis_names) > 1:
        raise ValueError(
            f"The sharded model arguments use different mesh axes {axis_names}; shard all of "
            "them along the same axis."
        )
    mesh, axis_name = next(iter(found.values()))
    if jax.sharding.get_abstract_mesh().manual_axes:
        raise ValueError(
            "Sharded data cannot be combined with MCMC(chain_method='parallel') (nor run inside "
            "jax.pmap or jax.shard_map): the devices already hold the data's shards. Use "
            "chain_method='vectorized': every device then runs all the chains on its shard."
        )
    layout = DataLayout(mesh, axis_name, mesh.shape[axis_name], treedef, frozenset(found))
    if plates is not None:
        _check_plates(layout, leaves, plates)
    return layout


def _check_plates(layout: DataLayout, leaves: list, plates: tuple):
    sizes = {p.name: p.size for p in plates}
    sharded_sizes = set()
    for i in layout.sharded:
        rows = leaves[i].shape[0]
        if rows not in sizes.values():
            raise ValueError(
                f"A sharded model argument has {rows} rows (shape {leaves[i].shape}), but the "
                f"model's subsample plates have sizes {sizes}: only a plate's data can be "
                "sharded (along its leading axis). Replicate the other arguments."
            )
        sharded_sizes.add(rows)
    for name, size in sizes.items():
        if size not in sharded_sizes:
            raise ValueError(
                f"Subsample plate '{name}' ({size} rows) has no sharded model argument while "
                f"other plates' data are sharded over mesh axis {layout.axis_name!r}: shard its "
                "data too (numpyro_sgmc.shard_data). The data-parallel estimator draws each "
                "plate's indices among a device's own rows."
            )
    for i, x in enumerate(leaves):
        if i in layout.sharded or not _is_array(x) or np.ndim(x) == 0:
            continue
        if np.shape(x)[0] in sharded_sizes:
            raise ValueError(
                f"A model argument of shape {np.shape(x)} has as many rows as a sharded subsample "
                f"plate but is not sharded: shard every per-datum array of the plate together "
                f"(X, y = numpyro_sgmc.shard_data(X, y)); a device indexes only its own rows."
            )
    shard_plates(plates, layout.num_shards, layout.axis_name)  # divisibility


def shard_plates(plates: tuple, num_shards: int, axis_name: str = "data") -> tuple:
    """One shard's plates: ``n_p/D`` rows and batch ``b_p/D`` for every plate.

    :raises ValueError: ``n_p`` or ``b_p`` not divisible by ``D``.
    """
    local = []
    for p in plates:
        if p.size % num_shards:
            raise ValueError(
                f"Subsample plate '{p.name}': " + _indivisible(p.size, num_shards, axis_name)
            )
        if p.batch_size % num_shards:
            lower = max(num_shards, p.batch_size - p.batch_size % num_shards)
            raise ValueError(
                f"Subsample plate '{p.name}': batch_size={p.batch_size} cannot be split evenly "
                f"over the {num_shards} devices of mesh axis {axis_name!r} (each draws "
                f"b/D of its own rows): use a multiple of {num_shards}, e.g. "
                f"batch_size={lower}."
            )
        local.append(p._replace(size=p.size // num_shards, batch_size=p.batch_size // num_shards))
    return tuple(local)


# ---- the data-parallel estimators ------------------------------------------------------------


def replicate(tree, layout: DataLayout):
    """``tree`` replicated over the layout's mesh (a global array in a multi-host run).

    The chain's state lives there: the compiled step then returns it with the sharding it was
    given, so the sampling loop compiles once.
    """
    return jax.jit(lambda t: t, out_shardings=NamedSharding(layout.mesh, PartitionSpec()))(tree)


def _varying(tree, axis_name):
    """``tree`` marked as varying over ``axis_name`` (each shard's own copy)."""
    return jax.tree.map(lambda x: lax.pcast(x, axis_name, to="varying"), tree)


def _split_args(layout: DataLayout, model_args, model_kwargs):
    """The array leaves of the arguments, their ``PartitionSpec`` s, and a rebuild function."""
    leaves, treedef = jax.tree.flatten((tuple(model_args), model_kwargs))
    if treedef != layout.treedef:
        raise ValueError(
            "The model arguments do not have the structure they had at init "
            f"({treedef} vs {layout.treedef}); the sharded layout is fixed at init."
        )
    for i in layout.sharded:
        x = leaves[i]
        if isinstance(x, jax.Array) and not_jax_tracer(x) and not x.is_fully_addressable:
            raise ValueError(
                "The sharded data span several processes, and the compiled sampling loop "
                "cannot hold them as constants: pass MCMC(..., jit_model_args=True) so that "
                "they enter it as arguments."
            )
    positions = [i for i, x in enumerate(leaves) if _is_array(x)]
    arrays = tuple(leaves[i] for i in positions)
    specs = tuple(
        PartitionSpec(layout.axis_name) if i in layout.sharded else PartitionSpec()
        for i in positions
    )

    def rebuild(local_arrays):
        new = list(leaves)
        for i, a in zip(positions, local_arrays, strict=True):
            new[i] = a
        return jax.tree.unflatten(treedef, new)

    return arrays, specs, rebuild


def minibatch(layout: DataLayout, spec, method: str = "with_replacement") -> Estimator:
    """The data-parallel minibatch estimator (module docstring), an
    :class:`~numpyro_sgmc.data.gradients.Estimator` like
    :func:`numpyro_sgmc.data.gradients.minibatch`.

    :param spec: the model's :class:`~numpyro_sgmc.data.model.ModelSpec` with its global plates.
    :param str method: the batch sampling, applied on each shard.
    """
    local = shard_plates(spec.plates, layout.num_shards, layout.axis_name)
    sampler = batch_sampler(local, method, shard_axis=layout.axis_name)
    gradient = batch_gradient(spec)
    replicated = PartitionSpec()

    def init(rng_key, centre, model_args, model_kwargs):
        return sampler.init(rng_key)

    def estimate(state, position, rng_key, model_args, model_kwargs):
        arrays, specs, rebuild = _split_args(layout, model_args, model_kwargs)

        def on_shard(position, state, rng_key, arrays):
            args, kwargs = rebuild(arrays)
            batch, state = sampler.draw(state, rng_key)
            # differentiate this shard's estimate only (the gradient with respect to a
            # replicated input would be summed over the shards), then average the D estimates
            grad = gradient(_varying(position, layout.axis_name), batch, args, kwargs)
            return lax.pmean(grad, layout.axis_name), state

        return jax.shard_map(
            on_shard,
            mesh=layout.mesh,
            in_specs=(replicated, replicated, replicated, specs),
            out_specs=(replicated, replicated),
        )(position, state, rng_key, arrays)

    return Estimator(init, estimate)


def full_data_gradient(layout: DataLayout, spec, chunk_size: int = 65536) -> Callable:
    """``full(position, model_args, model_kwargs) -> -∇U(θ)/n``, exact, summed over shards.

    Each device evaluates its ``n/D`` rows in chunks (prior weighted ``1/D``) and the shards
    are added with :func:`jax.lax.psum` (:func:`numpyro_sgmc.data.gradients.full_data_gradient`).
    """
    local = shard_plates(spec.plates, layout.num_shards, layout.axis_name)
    replicated = PartitionSpec()

    def full(position, model_args, model_kwargs):
        arrays, specs, rebuild = _split_args(layout, model_args, model_kwargs)

        def on_shard(position, arrays):
            args, kwargs = rebuild(arrays)
            return gradients.full_data_gradient(
                spec,
                _varying(position, layout.axis_name),
                args,
                kwargs,
                chunk_size,
                axis_name=layout.axis_name,
                rows=local,
            )

        return jax.shard_map(
            on_shard, mesh=layout.mesh, in_specs=(replicated, specs), out_specs=replicated
        )(position, arrays)

    return full


def check_shard_evaluation(layout: DataLayout, spec, z, rng_key, model_args, model_kwargs):
    """Trace the data-parallel estimate once, to report a model that fails on a shard."""
    estimator = minibatch(layout, spec)

    def estimate(z, k, arrays):
        args, kwargs = structure.rebuild(arrays)
        return estimator.estimate(estimator.init(k, z, args, kwargs), z, k, args, kwargs)[0]

    arrays, structure = split_args(model_args, model_kwargs)  # arguments, not constants
    try:
        jax.eval_shape(estimate, z, rng_key, arrays)
    except Exception as err:
        raise ValueError(
            f"Evaluating the model on one shard of the sharded data failed "
            f"({type(err).__name__}: {err}). Each of the {layout.num_shards} devices runs the "
            "model on its own rows of every sharded argument: the data plate must take its size "
            "from the data (numpyro.plate('data', X.shape[0], subsample_size=b)) or index the "
            "data with the plate's indices, and every per-datum array must be sharded."
        ) from err
