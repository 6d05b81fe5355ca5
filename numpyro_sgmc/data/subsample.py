"""NumPyro effect handlers for subsample plates: the kernel's indices, weights and sizes.

A NumPyro model marks its data with ``numpyro.plate(name, n, subsample_size=b)``, exactly as
for SVI or :class:`~numpyro.infer.hmc_gibbs.HMCECS`. NumPyro's own plate draws its indices
with a Fisher-Yates scan over ``arange(n)`` on CPU, which is O(n) per step, so the kernels
never let it run: :class:`subsample_indices` hands every subsample plate the indices the
kernel drew (:mod:`numpyro_sgmc.data.batches`; or, for a trace that only needs shapes, the first
``b`` rows), and the plate keeps its ``n / b`` log-likelihood scaling for whatever batch
length it is given (``docs/theory.md`` §1: ``Ũ`` scales the batch log-likelihood by ``n/b``).

With those indices the model's potential is NumPyro's own
(:func:`numpyro.infer.util.potential_energy` in unconstrained space), so constraints,
Jacobians, masks and ``scale`` handlers behave exactly as under NUTS. :class:`weight_data`
reweights each datum, which is how exact full-data sums are computed in chunks;
:class:`plate_sizes` rescales a shard's plate to the global size; :class:`full_data` runs a
subsampled model on all of its rows (for NUTS on the same model).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp
from numpyro.primitives import Messenger

__all__ = [
    "Batch",
    "SubsamplePlate",
    "data_indexed_model",
    "first_batch",
    "first_rows",
    "full_data",
    "plate_sites",
    "plate_sizes",
    "subsample_indices",
    "weight_data",
]


class SubsamplePlate(NamedTuple):
    """A data plate the kernel subsamples. A model's plates are a tuple of these, sorted by name.

    :param str name: the plate's name.
    :param int size: number of data ``n_p`` in the plate.
    :param int batch_size: number of indices ``b_p`` the kernel draws per step; ``b_p == n_p``
        means the full data every step (no gradient noise).
    """

    name: str
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
    ``size / m``. Inside the data-parallel estimator (:mod:`numpyro_sgmc.data.sharding`) a model
    that takes its plate size from the data (``numpyro.plate("data", X.shape[0], ...)``)
    sees its shard's ``n_p / D`` rows; this handler multiplies the plate's factor by
    ``sizes[p] / size``, so that the batch is scaled by ``n_p / m`` as the estimator of
    ``docs/theory.md`` §1 needs. Where the declared size is the global one (every
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
        plate_scale = {p.name: p.size for p in self.plates}[frame.name] / frame.size
        w = self.weights[frame.name]
        w = jnp.reshape(w, jnp.shape(w) + (1,) * (-frame.dim - 1))
        msg["scale"] = scale / plate_scale * w


def data_indexed_model(model: Callable, plates: tuple) -> Callable:
    """Wrap ``model`` so that its first argument is a :class:`Batch` of data indices.

    The wrapped model ``indexed(batch, *args, **kwargs)`` runs ``model(*args, **kwargs)`` with
    every subsample plate given ``batch.indices``, scaled to the size it has in ``plates``
    (:class:`plate_sizes`), and, if ``batch.weights`` is set, each term reweighted by
    :class:`weight_data`. It is what the kernels hand to
    :func:`numpyro.infer.util.initialize_model` with ``dynamic_args=True``: the data and the
    indices then reach the jitted step as arguments, never as compiled-in constants.
    """

    sizes = {p.name: p.size for p in plates}

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


def plate_sites(model_trace, plates: tuple) -> dict:
    """Site name -> name of the subsample plate it lies in, for every site inside one."""
    names = {p.name for p in plates}
    out = {}
    for name, site in model_trace.items():
        if site["type"] in ("sample", "deterministic"):
            inside = [p for p in _plate_names(site) if p in names]
            if inside:
                out[name] = inside[0]
    return out


def first_batch(plates) -> Batch:
    """The batch of the first ``b_p`` rows of every plate (for shapes and postprocessing)."""
    return Batch({p.name: jnp.arange(p.batch_size) for p in plates})
