"""Subsample plates: finding them, giving them the kernel's indices, and the batch potential.

A NumPyro model marks its data with ``numpyro.plate(name, n, subsample_size=b)``, exactly as
for SVI or :class:`~numpyro.infer.hmc_gibbs.HMCECS`. NumPyro's own plate draws its indices
with a Fisher-Yates scan over ``arange(n)`` on CPU, which is O(n) per step, so the kernels
never let it run: the :class:`subsample_indices` handler hands every subsample plate the
indices the kernel drew (:mod:`numpyro_sgmc.batches`; or, for a trace that only needs
shapes, the first ``b`` rows), and the plate keeps its ``n / b`` log-likelihood scaling for
whatever batch length it is given.

With those indices the model's potential is NumPyro's own (:func:`numpyro.infer.util.
potential_energy` in unconstrained space), so constraints, Jacobians, masks and ``scale``
handlers behave exactly as under NUTS. The :class:`weight_data` handler additionally
reweights each datum, which is how exact full-data sums are computed in chunks
(:func:`numpyro_sgmc.gradients.full_data_gradient`).

Theory: ``shared/design/theory.md`` §1 (``Ũ`` scales the batch log-likelihood by ``n/b``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.handlers import seed, trace
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.util import initialize_model
from numpyro.primitives import Messenger

__all__ = [
    "Batch",
    "SubsamplePlate",
    "SubsampledModel",
    "data_indexed_model",
    "find_subsample_plates",
    "first_batch",
    "first_rows",
    "full_data",
    "initialize",
    "num_data",
    "plate_sites",
    "plate_sizes",
    "split_args",
    "subsample_indices",
    "weight_data",
]


class SubsamplePlate(NamedTuple):
    """A data plate the kernel subsamples.

    :param int size: number of data ``n_p`` in the plate.
    :param int batch_size: number of indices ``b_p`` the kernel draws per step; ``b_p == n_p``
        means the full data every step (no gradient noise).
    """

    size: int
    batch_size: int


class Batch(NamedTuple):
    """What the data-indexed model needs to evaluate the potential on part of the data.

    :param dict indices: plate name -> integer indices into that plate (length ``b_p``).
    :param dict weights: ``None`` for the ordinary minibatch estimate (each datum weighted
        ``n_p / b_p`` by the plate itself), or plate name -> per-index weights replacing that
        factor (a weight 0 removes a padding index).
    :param global_weight: weight of every term outside the subsample plates (prior,
        Jacobians, global observations); only used together with ``weights``.
    """

    indices: dict
    weights: Optional[dict] = None
    global_weight: float = 1.0


class subsample_indices(Messenger):
    """Give each subsample plate fixed indices instead of letting it draw its own.

    A plate named in ``indices`` gets those indices (any length: the plate then scales its
    log-likelihood by ``size / len(indices)``); any other plate that would draw a random
    subsample gets its first ``subsample_size`` rows, which is O(b) and deterministic.
    Plates without subsampling are left alone.
    """

    def __init__(self, fn: Optional[Callable] = None, indices: Optional[dict] = None):
        self.indices = {} if indices is None else indices
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "plate":
            return
        idx = self.indices.get(msg["name"])
        # a plate named in `indices` takes them even if it would run over all of its rows (on a
        # shard of n/D rows, a model's subsample_size can equal the shard's size)
        if msg["value"] is not None and idx is None:
            return
        size, subsample_size = msg["args"]
        if idx is None:
            idx = jnp.arange(subsample_size)
        msg["value"] = idx
        msg["args"] = (size, jnp.shape(idx)[0])


class plate_sizes(Messenger):
    """Scale each subsample plate to its global size, whatever size the model declares.

    A plate declared with ``size`` rows and given ``m`` indices scales its log-likelihood by
    ``size / m``. Inside the data-parallel estimator (:mod:`numpyro_sgmc.sharding`) a model
    that takes its plate size from the data (``numpyro.plate("data", X.shape[0], ...)``)
    sees its shard's ``n_p / D`` rows; this handler multiplies the plate's factor by
    ``sizes[p] / size``, so that the batch is scaled by ``n_p / m`` as the estimator of
    ``shared/design/theory.md`` §1 needs. Where the declared size is the global one (every
    single-device run) it does nothing.
    """

    def __init__(self, fn: Optional[Callable] = None, sizes: Optional[dict] = None):
        self.sizes = {} if sizes is None else sizes
        self.declared = {}
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "plate":
            if msg["name"] in self.sizes:
                self.declared[msg["name"]] = msg["args"][0]
            return
        if msg["type"] != "sample":
            return
        for frame in msg["cond_indep_stack"]:
            declared = self.declared.get(frame.name)
            if declared is None or declared == self.sizes[frame.name]:
                continue
            # the plate applied declared / m (1 when m == declared, the same thing)
            scale = 1.0 if msg["scale"] is None else msg["scale"]
            msg["scale"] = scale * (self.sizes[frame.name] / declared)


def first_rows(model: Callable) -> Callable:
    """``model`` with every subsample plate fixed to its first ``subsample_size`` rows."""
    return subsample_indices(model)


class full_data(Messenger):
    """Run a model with every subsample plate over all of its data (no subsampling).

    This is the full-data program the kernels target, e.g. for NUTS on the same model or for
    per-datum log-likelihoods over all rows (``az.from_numpyro``).
    """

    def process_message(self, msg):
        if msg["type"] == "plate" and msg["value"] is None:
            size = msg["args"][0]
            msg["value"] = jnp.arange(size)
            msg["args"] = (size, size)


class weight_data(Messenger):
    """Reweight the log-density terms of a model evaluated on a :class:`Batch` of indices.

    A sample site inside subsample plate ``p`` (whose batch of length ``m`` the plate scales by
    ``n_p / m``) gets the per-index weights ``weights[p]`` instead, broadcast along the plate's
    dimension; every other sample site is multiplied by ``global_weight``. With weights 1 on
    every index of a partition of the data into chunks and ``global_weight = 1 / chunks``,
    the potentials of the chunks sum to the exact full-data potential.
    """

    def __init__(self, fn=None, plates=None, weights=None, global_weight=1.0):
        self.plates = plates
        self.weights = weights
        self.global_weight = global_weight
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "sample":
            return
        scale = 1.0 if msg["scale"] is None else msg["scale"]
        frames = [f for f in msg["cond_indep_stack"] if f.name in self.weights]
        if not frames:
            msg["scale"] = scale * self.global_weight
            return
        frame = frames[0]
        plate_scale = self.plates[frame.name].size / frame.size
        w = self.weights[frame.name]
        w = jnp.reshape(w, jnp.shape(w) + (1,) * (-frame.dim - 1))
        msg["scale"] = scale / plate_scale * w


def data_indexed_model(model: Callable, plates: dict) -> Callable:
    """Wrap ``model`` so that its first argument is a :class:`Batch` of data indices.

    The wrapped model ``indexed(batch, *args, **kwargs)`` runs ``model(*args, **kwargs)`` with
    every subsample plate given ``batch.indices``, scaled to the size it has in ``plates``
    (:class:`plate_sizes`), and, if ``batch.weights`` is set, each term reweighted by
    :class:`weight_data`. It is what the kernels hand to
    :func:`numpyro.infer.util.initialize_model` with ``dynamic_args=True``: the data and the
    indices then reach the jitted step as arguments, never as compiled-in constants.
    """

    sizes = {name: p.size for name, p in plates.items()}

    def indexed(batch: Batch, *args, **kwargs):
        with subsample_indices(indices=batch.indices):
            if batch.weights is None:
                with plate_sizes(sizes=sizes):
                    return model(*args, **kwargs)
            with weight_data(
                plates=plates, weights=batch.weights, global_weight=batch.global_weight
            ):
                with plate_sizes(sizes=sizes):
                    return model(*args, **kwargs)

    return indexed


def _plate_names(site) -> list:
    return [f.name for f in site["cond_indep_stack"]]


def plate_sites(model_trace, plates: dict) -> dict:
    """Site name -> name of the subsample plate it lies in, for every site inside one."""
    out = {}
    for name, site in model_trace.items():
        if site["type"] in ("sample", "deterministic"):
            inside = [p for p in _plate_names(site) if p in plates]
            if inside:
                out[name] = inside[0]
    return out


def find_subsample_plates(
    model: Callable,
    model_args: tuple = (),
    model_kwargs: Optional[dict] = None,
    batch_size=None,
    rng_key=None,
) -> tuple[dict, dict]:
    """Trace ``model`` once (in O(b)) and return its subsample plates.

    :param model: a NumPyro model whose data plate(s) use ``subsample_size``.
    :param batch_size: ``None`` to keep each plate's ``subsample_size``; an int to use that
        batch size in every subsample plate; or a dict ``{plate name: batch size}``.
    :param rng_key: key for the prior draws of the trace (default ``PRNGKey(0)``).
    :return: ``(plates, trace)``: plate name -> :class:`SubsamplePlate`, and the prototype
        trace (plates fixed to their first rows).
    :raises ValueError: no subsample plate; a batch larger than its plate; a latent variable
        or a second subsample plate nested inside a subsample plate; an unknown plate name.
    """
    model_kwargs = {} if model_kwargs is None else model_kwargs
    rng_key = random.PRNGKey(0) if rng_key is None else rng_key
    model_trace = trace(seed(first_rows(model), rng_key)).get_trace(*model_args, **model_kwargs)
    declared = {
        name: site["args"]
        for name, site in model_trace.items()
        if site["type"] == "plate"
        and site["args"][1] is not None
        and site["args"][1] != site["args"][0]
    }
    if not declared:
        full_plates = [n for n, s in model_trace.items() if s["type"] == "plate"]
        hint = (
            f" Its plate(s) {full_plates} have no `subsample_size`."
            if full_plates
            else " It has no `numpyro.plate` at all."
        )
        raise ValueError(
            "The model has no subsample plate, so there is nothing to draw minibatches from."
            + hint
            + " Mark the data plate the way SVI and HMCECS expect:\n"
            "    with numpyro.plate('data', X.shape[0], subsample_size=100):\n"
            "        Xb = numpyro.subsample(X, event_dim=1)\n"
            "        yb = numpyro.subsample(y, event_dim=0)\n"
            "        numpyro.sample('y', dist.Bernoulli(logits=Xb @ theta), obs=yb)"
        )
    if isinstance(batch_size, dict):
        unknown = set(batch_size) - set(declared)
        if unknown:
            raise ValueError(
                f"batch_size names plate(s) {sorted(unknown)} that are not subsample plates "
                f"of the model; its subsample plates are {sorted(declared)}."
            )
    plates = {}
    for name, (size, model_b) in declared.items():
        if isinstance(batch_size, dict):
            b = batch_size.get(name, model_b)
        else:
            b = model_b if batch_size is None else batch_size
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
            raise ValueError(f"batch_size for plate '{name}' must be a positive int, got {b!r}.")
        if b > size:
            raise ValueError(
                f"batch_size={b} is larger than the data: plate '{name}' has size {size}. "
                f"Use a batch_size of at most {size} (batch_size={size} means full-data "
                "gradients every step)."
            )
        plates[name] = SubsamplePlate(int(size), int(b))

    for name, site in model_trace.items():
        inside = [p for p in _plate_names(site) if p in plates]
        if len(inside) > 1:
            raise ValueError(
                f"Site '{name}' lies in nested subsample plates {inside}. Stochastic-gradient "
                "kernels subsample one data dimension: give `subsample_size` to one of them only."
            )
        if inside and site["type"] == "sample" and not site["is_observed"]:
            raise ValueError(
                f"Latent site '{name}' lies inside subsample plate '{inside[0]}'. A per-datum "
                "latent variable is only updated for the rows in the batch, which SG-MCMC does "
                "not support: marginalise it out, or move it out of the subsample plate."
            )
    return plates, model_trace


def first_batch(plates: dict) -> Batch:
    """The batch of the first ``b_p`` rows of every plate (for shapes and postprocessing)."""
    return Batch({name: jnp.arange(p.batch_size) for name, p in plates.items()})


def num_data(plates: dict) -> int:
    """``n``: the total number of data over all subsample plates (theory §1)."""
    return sum(p.size for p in plates.values())


class SubsampledModel(NamedTuple):
    """A model prepared for stochastic-gradient inference (see :func:`initialize`).

    :param dict plates: plate name -> :class:`SubsamplePlate`.
    :param potential_fn: ``potential_fn(z, batch, model_args, model_kwargs) -> Ũ(z)``, the
        potential in unconstrained space on a :class:`Batch` (plates scale by ``n_p / b_p``).
    :param postprocess_fn: ``postprocess_fn(model_args, model_kwargs)`` returns a function
        mapping unconstrained values to constrained ones plus the deterministic sites (those
        inside a subsample plate, per-datum values of one batch, are left out).
    :param dict init_params: unconstrained starting values from the init strategy (with a
        leading axis per key when ``rng_key`` is a batch of keys).
    :param prototype_trace: a trace of the model on the first rows of each plate.
    """

    plates: dict
    potential_fn: Callable
    postprocess_fn: Callable
    init_params: dict
    prototype_trace: dict


def initialize(
    rng_key,
    model: Callable,
    model_args: tuple = (),
    model_kwargs: Optional[dict] = None,
    batch_size=None,
    init_strategy=init_to_uniform,
) -> SubsampledModel:
    """Find the subsample plates of ``model`` and build its batch-indexed potential.

    Wraps NumPyro's :func:`~numpyro.infer.util.initialize_model` around the model
    :func:`data_indexed_model` makes, so constraints, Jacobians and init strategies behave as
    for NUTS while the plates take the kernel's indices. ``batch_size`` is as in
    :func:`find_subsample_plates`.
    """
    model_kwargs = {} if model_kwargs is None else model_kwargs
    model_args = tuple(model_args)
    plates, proto_trace = find_subsample_plates(model, model_args, model_kwargs, batch_size)
    try:
        info = initialize_model(
            rng_key,
            data_indexed_model(model, plates),
            init_strategy=init_strategy,
            dynamic_args=True,
            model_args=(first_batch(plates),) + model_args,
            model_kwargs=model_kwargs,
        )
    except RuntimeError as err:
        if "Cannot find valid initial parameters" not in str(err):
            raise
        raise RuntimeError(
            "No starting point with a finite potential and gradient was found: the init "
            "strategy tried 100 points, evaluating the model on the first rows of each "
            "subsample plate. Check that the model's log-density is finite for these data "
            "(e.g. no log of a non-positive value, no impossible observation), or pass "
            "init_params (unconstrained values) or init_strategy=init_to_value(values=...)."
        ) from err
    potential_gen, postprocess_gen = info.potential_fn, info.postprocess_fn
    per_datum = {
        name
        for name in plate_sites(proto_trace, plates)
        if proto_trace[name]["type"] == "deterministic"
    }

    def potential_fn(z, batch, args, kwargs):
        return potential_gen(batch, *args, **kwargs)(z)

    def postprocess_fn(args, kwargs):
        constrain = postprocess_gen(first_batch(plates), *args, **kwargs)
        if not per_datum:
            return constrain
        return lambda z: {k: v for k, v in constrain(z).items() if k not in per_datum}

    return SubsampledModel(plates, potential_fn, postprocess_fn, info.param_info.z, proto_trace)


def split_args(model_args, model_kwargs):
    """Split the model's arguments into array leaves and a function that rebuilds them.

    Functions compiled with ``jax.jit`` take the arrays (the data) as arguments: closed over,
    they would be compiled in as constants, with compile time and memory growing with ``n``.

    :return: ``(arrays, rebuild)`` with ``rebuild(arrays) == (model_args, model_kwargs)``.
    """
    leaves, treedef = jax.tree.flatten((tuple(model_args), dict(model_kwargs)))
    is_array = [isinstance(x, (np.ndarray, jax.Array)) for x in leaves]
    dynamic = [x for x, a in zip(leaves, is_array, strict=True) if a]
    static = [None if a else x for x, a in zip(leaves, is_array, strict=True)]

    def rebuild(dyn):
        it = iter(dyn)
        out = [next(it) if a else s for s, a in zip(static, is_array, strict=True)]
        return jax.tree.unflatten(treedef, out)

    return dynamic, rebuild
