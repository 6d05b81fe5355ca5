"""The model prepared for stochastic-gradient inference: traced once, then passed down.

:func:`prepare_model` traces a NumPyro model once, on the first rows of its data, finds its
subsample plates (``numpyro.plate(name, n, subsample_size=b)``), checks that stochastic
gradients can serve it, and returns a :class:`SubsampledModel`:

* :class:`ModelSpec`, the hashable part (the model function and its plates), which every
  compiled function of the library takes as a static argument, so that a second call with
  data of the same shapes reuses the compiled code;
* :class:`Layout`, the order of the flattened unconstrained parameters (sites sorted by name,
  each raveled row-major) in which every scale (:mod:`numpyro_sgmc.scales`) and every
  prediction is written;
* the starting values of the init strategy and the constraining transforms.

The checks of the model on its first trace (plates against their data, sites that stochastic
gradients can serve) are :mod:`~numpyro_sgmc.data.first_trace`'s; the start, the model's own
indexing and the potential are here.

:func:`potential` is the model's potential ``Ũ(z)`` on a :class:`~numpyro_sgmc.data.subsample.Batch`
of indices (NumPyro scales the batch log-likelihood by ``n_p/b_p``, ``docs/theory.md`` §1),
and :func:`constrain` maps unconstrained values back, with the deterministic sites. Both are
pure functions of the spec, the position, the indices and the data, so the data reach every
compiled function as arguments (:func:`split_args`), never as compiled-in constants.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from jax.experimental import checkify
from numpyro import handlers
from numpyro.distributions import biject_to
from numpyro.handlers import seed, trace
from numpyro.infer.initialization import (
    init_to_mean,
    init_to_median,
    init_to_uniform,
    init_to_value,
)
from numpyro.infer.util import constrain_fn, potential_energy
from numpyro.util import is_prng_key, not_jax_tracer

from numpyro_sgmc import host
from numpyro_sgmc.compilation import one_shot_jit
from numpyro_sgmc.data import validation
from numpyro_sgmc.data.files import check_zarr_arguments, fed_rows, first_rows
from numpyro_sgmc.data.first_trace import check_sites, declared_plates, first_trace
from numpyro_sgmc.data.subsample import (
    Batch,
    SubsamplePlate,
    data_indexed_model,
    first_batch,
    plate_sites,
)

__all__ = [
    "ArgStructure",
    "Layout",
    "ModelSpec",
    "SubsampledModel",
    "constrain",
    "constrained",
    "data_version",
    "num_data",
    "potential",
    "prepare_model",
    "split_args",
]


def num_data(plates) -> int:
    """``n``: the total number of data over all subsample plates (``docs/theory.md`` §1)."""
    return sum(p.size for p in plates)


def total_batch(plates) -> int:
    """``b``: the rows one minibatch draws over all subsample plates."""
    return sum(p.batch_size for p in plates)


class ModelSpec(NamedTuple):
    """The hashable description of a subsampled model: a static argument of compiled code.

    :param model: the user's NumPyro model.
    :param tuple plates: its subsample plates, :class:`~numpyro_sgmc.data.subsample.SubsamplePlate`
        sorted by name, with the batch size the kernel draws.
    """

    model: Callable
    plates: tuple

    @property
    def num_data(self) -> int:
        return num_data(self.plates)

    @property
    def batch_size(self) -> int:
        return total_batch(self.plates)

    def plate(self, name: str) -> SubsamplePlate:
        return {p.name: p for p in self.plates}[name]

    def with_batch_size(self, batch_size) -> "ModelSpec":
        """The same model with batch size ``batch_size`` (an int for every plate, or
        ``{plate: int}``; plates left out keep theirs)."""
        return self._replace(plates=_batch_sizes(self.plates, batch_size))


_HOST_ELEMENTS = 2**20  # larger arrays (draws, say) are reshaped on the device: no round trip


def _on_host(values) -> bool:
    """Whether to reshape ``values`` with NumPy: concrete, and small."""
    if any(isinstance(v, jax.core.Tracer) for v in values):
        return False
    return sum(int(np.size(v)) for v in values) <= _HOST_ELEMENTS


class Layout(NamedTuple):
    """Order of the flattened unconstrained parameters: ``((site, start, stop, shape), ...)``,
    sites sorted by name, each raveled row-major (as :func:`jax.flatten_util.ravel_pytree`)."""

    sites: tuple

    @classmethod
    def of(cls, params: dict) -> "Layout":
        sites, start = [], 0
        for name in sorted(params):
            shape = tuple(jnp.shape(params[name]))
            size = int(np.prod(shape))
            sites.append((name, start, start + size, shape))
            start += size
        return cls(tuple(sites))

    @property
    def size(self) -> int:
        """``d``."""
        return self.sites[-1][2] if self.sites else 0

    def ravel(self, tree: dict):
        """The flat ``(..., d)`` vector of a dict of site values (leading axes kept); small
        concrete values are raveled on the host (each eager reshape or concatenation compiles)."""
        values = [tree[name] for name, *_ in self.sites]
        xp = np if _on_host(values) else jnp
        parts = []
        for value, (_, start, stop, shape) in zip(values, self.sites, strict=True):
            value = xp.asarray(value)
            lead = value.shape[: value.ndim - len(shape)]
            parts.append(xp.reshape(value, lead + (stop - start,)))
        flat = xp.concatenate(parts, axis=-1)
        return flat if xp is jnp else host.device_array(flat)

    def unravel(self, flat) -> dict:
        """Site name -> array for a flat ``(..., d)`` vector (a small concrete one split on
        the host)."""
        xp, put = (np, host.device_array) if _on_host([flat]) else (jnp, lambda v: v)
        flat = xp.asarray(flat)
        lead = flat.shape[:-1]
        return {
            name: put(xp.reshape(flat[..., start:stop], lead + shape))
            for name, start, stop, shape in self.sites
        }

    def names(self) -> list:
        """``site`` or ``site[i, j]`` for every flat entry."""
        out = []
        for name, start, stop, shape in self.sites:
            if not shape:
                out.append(name)
                continue
            for k in range(stop - start):
                idx = np.unravel_index(k, shape)
                out.append(f"{name}[{', '.join(str(int(i)) for i in idx)}]")
        return out


class ArgStructure(NamedTuple):
    """The non-array part of the model arguments (hashable), to rebuild them from arrays."""

    treedef: object
    static: tuple  # the non-array leaves, None where an array goes

    def rebuild(self, arrays) -> tuple:
        it = iter(arrays)
        leaves = [next(it) if s is _ARRAY else s for s in self.static]
        return jax.tree.unflatten(self.treedef, leaves)


class _ArrayMarker:
    def __repr__(self):
        return "<array>"


_ARRAY = _ArrayMarker()


def split_args(model_args, model_kwargs) -> tuple:
    """``(arrays, structure)``: the array leaves of the model arguments (the data, passed to
    compiled functions as arguments) and a hashable :class:`ArgStructure` to rebuild
    ``(model_args, model_kwargs)`` from them (``structure.rebuild(arrays)``)."""
    kwargs = {} if model_kwargs is None else dict(model_kwargs)
    leaves, treedef = jax.tree.flatten((tuple(model_args), kwargs))
    is_array = [
        isinstance(x, (np.ndarray, jax.Array, np.generic)) or validation.zarr_array(x)
        for x in leaves
    ]
    arrays = tuple(x for x, a in zip(leaves, is_array, strict=True) if a)
    static = tuple(_ARRAY if a else x for x, a in zip(leaves, is_array, strict=True))
    return arrays, ArgStructure(treedef, static)


def data_version(model_args, model_kwargs) -> Optional[tuple]:
    """A key for the model arguments, or ``None`` where one would cost a pass over the data:
    their :class:`ArgStructure` and the ``arrays_version`` of their arrays
    (``numpyro_sgmc.data.validation``: file versions, JAX arrays by identity, digests of small
    NumPy arrays). Equal keys mean
    the same data, so what a pass computed on one holds for the other (``Tuned.centre``)."""
    arrays, structure = split_args(model_args, model_kwargs)
    version = validation.arrays_version(arrays)
    return None if version is None else (structure, version)


def potential(spec: ModelSpec, z: dict, batch: Batch, model_args, model_kwargs):
    """``Ũ(z)``: the potential in unconstrained space on ``batch`` (``docs/theory.md`` §1).

    NumPyro's own :func:`~numpyro.infer.util.potential_energy` of the model whose subsample
    plates take ``batch.indices`` (scaled ``n_p / b_p``), or the weights of ``batch``.
    """
    indexed = data_indexed_model(spec.model, spec.plates)
    return potential_energy(indexed, (batch,) + tuple(model_args), model_kwargs, z)


def constrain(spec: ModelSpec, z: dict, model_args, model_kwargs, exclude=frozenset()) -> dict:
    """Constrained latent values and deterministic sites at ``z`` (those in ``exclude``, the
    per-datum deterministic sites of one batch, are left out)."""
    indexed = data_indexed_model(spec.model, spec.plates)
    values = constrain_fn(
        indexed,
        (first_batch(spec.plates),) + tuple(model_args),
        model_kwargs,
        z,
        return_deterministic=True,
    )
    return {k: v for k, v in values.items() if k not in exclude}


@one_shot_jit(("spec", "structure", "exclude", "batched", "layout"))
def _constrained(spec, structure, exclude, batched, layout, z, arrays):
    args, kwargs = structure.rebuild(arrays)
    one = partial(constrain, spec, model_args=args, model_kwargs=kwargs, exclude=exclude)

    def with_jacobian(z):
        if layout is None:
            return one(z), None

        def latent(x):  # the constrained latent values, flat, in the layout's site order
            values = one(layout.unravel(x))
            return jnp.concatenate([jnp.ravel(values[name]) for name, *_ in layout.sites])

        return one(z), jax.jacfwd(latent)(layout.ravel(z))

    return jax.vmap(with_jacobian)(z) if batched else with_jacobian(z)


def constrained(
    spec, z, model_args, model_kwargs, exclude=frozenset(), batched=False, layout=None
) -> tuple:
    """``(values, jacobian)``: :func:`constrain`, compiled once per model and data shapes (the
    data as arguments), and with a ``layout`` the Jacobian ``∂(constrained latent values)/∂z``
    at ``z`` (flat, ``(d_constrained, d)``, sites in the layout's order), else ``None``;
    ``batched``: ``z`` has a leading axis (one point per restart or chain), and so have both.
    The warm start and the tuner's report share one program: where the report maps a dense
    covariance to the constrained sites, the warm start asks for the Jacobian too."""
    arrays, structure = split_args(model_args, model_kwargs)
    arrays = first_rows(arrays, spec.plates)  # the first batch's rows, not a file whole
    return _constrained(spec, structure, frozenset(exclude), bool(batched), layout, z, arrays)


class SubsampledModel(NamedTuple):
    """A model prepared for stochastic-gradient inference (:func:`prepare_model`).

    :param spec: the hashable :class:`ModelSpec`.
    :param layout: the flat order of the unconstrained parameters.
    :param dict init_params: unconstrained starting values of the init strategy (a leading
        axis per key when ``rng_key`` was a batch of keys).
    :param dict transforms: latent site -> transform from unconstrained to constrained values.
    :param frozenset per_datum_sites: deterministic sites inside a subsample plate (values for
        one batch only; left out of the draws).
    :param frozenset deterministic_sites: every deterministic site.
    """

    spec: ModelSpec
    layout: Layout
    init_params: dict
    transforms: dict
    per_datum_sites: frozenset
    deterministic_sites: frozenset

    @property
    def plates(self) -> tuple:
        return self.spec.plates

    @property
    def num_data(self) -> int:
        return self.spec.num_data

    @property
    def latent_sites(self) -> list:
        return [name for name, *_ in self.layout.sites]

    def with_batch_size(self, batch_size) -> "SubsampledModel":
        return self._replace(spec=self.spec.with_batch_size(batch_size))


def prepare_model(
    rng_key,
    model: Callable,
    model_args: tuple = (),
    model_kwargs: Optional[dict] = None,
    batch_size=None,
    init_strategy=init_to_uniform,
    init_params: Optional[dict] = None,
) -> SubsampledModel:
    """Trace ``model`` once (in O(b)), find its subsample plates and starting values.

    :param rng_key: key (or a batch of keys, one per chain) for the init strategy.
    :param batch_size: ``None`` to keep each plate's ``subsample_size``; an int for every
        subsample plate; or ``{plate name: batch size}``.
    :param init_strategy: a NumPyro init strategy; where it finds no point with a finite
        potential, the prior means and then the unconstrained zeros are tried (a random start
        on raw covariate scales overflows ``exp``; the prior mean of a zero-mean coefficient
        does not).
    :param init_params: unconstrained starting values whose potential is known to be finite
        (a tuned kernel's mode, with a leading axis per key when ``rng_key`` is a batch):
        used as they are, instead of the init strategy's search.

    The model and its data are checked on this first trace, before anything compiles
    (``docs/bad-input.md``): every plate against the data it subsamples and every site
    (:mod:`~numpyro_sgmc.data.first_trace`), and the data for NaN and infinite values in one
    chunked pass (``numpyro_sgmc.data.validation.nonfinite_data``: refused unless the model
    masks them, tried on a batch of them); with file-backed data,
    that the model reads only its batch's rows
    (:func:`~numpyro_sgmc.data.streaming.check_file_rows`); a plate whose indices
    the model uses itself (``X[idx]``) is evaluated once on its last rows, where an index past
    the data is an error rather than JAX's silent clamp.

    :raises ValueError: no subsample plate; a batch larger than its plate; a plate whose size
        is not the length of the data it subsamples or indexes; an array used whole inside a
        subsample plate; an observation that broadcasts against its distribution; a discrete,
        or a per-datum, latent site; a second subsample plate nested inside a subsample plate;
        an unknown plate name; non-finite data; a model that uses file-backed per-row
        arguments as a whole.
    :raises TypeError: a pandas object or a non-numeric array among the model arguments
        (``numpyro_sgmc.data.validation.as_arrays`` converts them first where a kernel runs).
    :raises RuntimeError: no starting point with a finite potential.
    """
    model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
    model_args = tuple(model_args)
    validation.check_types(model, model_args, model_kwargs)
    batched = not is_prng_key(rng_key)  # one key per chain
    trace_key = host.unstack_keys(rng_key)[0] if batched else rng_key
    model_trace, subsampled = first_trace(model, trace_key, model_args, model_kwargs)
    plates = _batch_sizes(declared_plates(model_trace), batch_size)
    check_sites(model_trace, plates)
    check_zarr_arguments(split_args(model_args, model_kwargs)[0], plates)
    nonfinite = validation.nonfinite_data(model, model_args, model_kwargs)
    spec = ModelSpec(model, plates)
    if init_params is None:
        try:
            init_params = _initialize(
                rng_key, model, plates, model_args, model_kwargs, init_strategy
            )
        except RuntimeError:
            if nonfinite:  # the data, not the start, are at fault
                validation.refuse_nonfinite(nonfinite[0])
            raise
    one = host.take(init_params) if batched else init_params
    _check_masked(spec, one, model_args, model_kwargs, nonfinite)
    arrays, structure = split_args(model_args, model_kwargs)
    from numpyro_sgmc.data.streaming import check_file_rows  # it builds on this module

    check_file_rows(spec, structure, arrays, one)
    indexed = [p.name for p in plates if p.name not in subsampled]
    if indexed:
        _check_indexing(spec, one, model_args, model_kwargs, indexed)
        validation.check_indexed_rows(model, plates, indexed, model_args, model_kwargs)
    latent = [
        name
        for name, site in model_trace.items()
        if site["type"] == "sample" and not site["is_observed"]
    ]
    transforms = {name: biject_to(model_trace[name]["fn"].support) for name in latent}
    deterministic = frozenset(n for n, s in model_trace.items() if s["type"] == "deterministic")
    per_datum = deterministic & set(plate_sites(model_trace, plates))
    return SubsampledModel(spec, Layout.of(one), init_params, transforms, per_datum, deterministic)


def check_data(spec: ModelSpec, z: dict, model_args, model_kwargs, files_only=False):
    """The data check where a pass has read the files (``files_only``: theirs alone, the
    others were checked on the first trace): NaN or infinite rows are refused unless the
    model masks them, tried at the point ``z`` (no chain axis) on a batch of them.

    :raises ValueError: ``numpyro_sgmc.data.validation.refuse_nonfinite``."""
    nonfinite = validation.nonfinite_data(spec.model, model_args, model_kwargs, files_only)
    _check_masked(spec, z, model_args, model_kwargs, nonfinite)


def _check_masked(spec, z, model_args, model_kwargs, nonfinite):
    """That the model masks the rows of ``nonfinite``
    (:class:`~numpyro_sgmc.data.validation.NonFiniteRows`): its potential and gradient at ``z``
    are finite on one batch of them (each plate's batch shared among its arguments with such
    rows, their other arguments cut to the same rows). A model that writes
    ``d.mask(jnp.isfinite(y))`` passes (NumPyro's mask replaces the masked values before the
    log density); an unmasked NaN or a ``jnp.where`` over a log density computed on it (a NaN
    gradient) does not, and is refused with what its potential did. An argument that is not
    a plate's per-row one (a table of the groups' covariates) is in every batch whole, so one
    batch tries all of it.

    :raises ValueError: ``numpyro_sgmc.data.validation.refuse_nonfinite`` (of the first)."""
    if not nonfinite:
        return
    arrays, structure = split_args(model_args, model_kwargs)
    try:
        fed = fed_rows(arrays, spec.plates)
    except ValueError:  # two plates of one size: which rows go together is unknown
        validation.refuse_nonfinite(nonfinite[0])
    plate_of = dict(zip(fed.leaves, fed.plates, strict=True))
    found_in = {}  # plate -> the arguments of it with non-finite rows
    for found in nonfinite:
        k = next((k for k, x in enumerate(arrays) if x is found.value), None)
        if k is None or k in plate_of and any(validation.zarr_array(a) for a in arrays):
            validation.refuse_nonfinite(found)  # not among the arrays, or not read by rows here
        if k in plate_of:  # else used whole: every batch holds all of it
            found_in.setdefault(plate_of[k], []).append(found)
    cut = list(arrays)  # every per-row argument is cut below
    for name in set(fed.plates):
        b = next(p.batch_size for p in spec.plates if p.name == name)
        share = -(-b // len(found_in.get(name, [None])))  # each argument's part of the batch
        rows = np.concatenate(
            [validation.nonfinite_row_indices(f.value, f.first, share) for f in found_in[name]]
            if name in found_in
            else [np.arange(b)]
        )
        rows = np.resize(rows, b)  # a batch of them, repeated if fewer
        for j in (j for j, p in plate_of.items() if p == name):
            cut[j] = np.asarray(arrays[j][rows])
    value_finite, grad_finite = _finite_on(spec, structure, z, tuple(cut))
    if not value_finite:
        why = "The model's potential is not finite on a batch of those rows"
        validation.refuse_nonfinite(nonfinite[0], why)
    if not grad_finite:
        why = "The model's potential is finite on a batch of those rows, its gradient is not"
        validation.refuse_nonfinite(nonfinite[0], why)


@one_shot_jit(("spec", "structure"))
def _finite_on(spec, structure, z, arrays):
    """Whether the potential and its gradient at ``z`` are finite on the first batch of
    ``arrays`` (:func:`_check_masked`: one program, not an op-by-op evaluation)."""
    args, kwargs = structure.rebuild(arrays)
    with numpyro.validation_enabled(False):
        return _finite_potential(spec, z, first_batch(spec.plates), args, kwargs)


def _finite_potential(spec, z, batch, args, kwargs):
    """``(value finite, gradient finite)`` of the potential at ``z`` on ``batch``."""
    value, grad = jax.value_and_grad(lambda z: potential(spec, z, batch, args, kwargs))(z)
    return jnp.isfinite(value), jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grad)])
    )


def _initialize(rng_key, model, plates, model_args, model_kwargs, init_strategy) -> dict:
    """Unconstrained starting values from ``init_strategy`` (a leading axis per key when
    ``rng_key`` is a batch of keys), then from the fallbacks (:func:`prepare_model`).

    Each strategy's point and the potential's finiteness there (value and gradient, on the
    first rows of each plate) are one compiled function of the keys and the data, cached per
    model, strategy and data shapes (NumPyro's ``initialize_model`` compiles afresh on every
    call). A random strategy gets ten draws per key."""
    spec = ModelSpec(model, plates)
    batched = not is_prng_key(rng_key)
    keys = rng_key if batched else host.key_batch(rng_key)
    arrays, structure = split_args(model_args, model_kwargs)
    arrays = first_rows(arrays, plates)  # the first batch's rows, not a file whole
    # init_to_mean is undefined for a Cauchy prior (NaN); the median and zeros are not
    strategies = (init_strategy, init_to_mean, init_to_median, init_to_uniform(radius=0.0))
    for strategy in strategies:
        for attempt in range(10):
            shell, values = _split_values(strategy)
            z, finite = _start(spec, structure, shell, keys, np.int32(attempt), arrays, values)
            traced = not not_jax_tracer(finite)  # keys traced by MCMC's pmap: no retry
            if traced or bool(np.all(np.asarray(finite))):
                return z if batched else host.take(z)
            if not _is_random(strategy):
                break
    raise RuntimeError(
        "No starting point with a finite potential and gradient was found: the init "
        "strategy (ten points per chain), the prior means and medians and the unconstrained "
        "zeros all failed, evaluating the model on the first rows of each subsample plate. "
        "Check that the model's log-density is finite for these data (e.g. no log of a "
        "non-positive value, no impossible observation, no NaN), or pass init_params "
        "(unconstrained values)."
    )


def _is_random(strategy) -> bool:
    base = strategy.func if isinstance(strategy, partial) else strategy
    return base in (init_to_uniform,) and (
        not isinstance(strategy, partial) or strategy.keywords.get("radius", 2.0) != 0.0
    )


def _split_values(strategy) -> tuple:
    """``(strategy, values)``: an ``init_to_value`` strategy's values apart, as JAX arrays, so
    that :func:`_start` takes them as arguments (a new mode each call, the same compilation);
    ``values`` is ``None`` for every other strategy."""
    if not (isinstance(strategy, partial) and strategy.func is init_to_value):
        return strategy, None
    values = strategy.keywords.get("values", {})
    return init_to_value, {name: jnp.asarray(v) for name, v in values.items()}


@one_shot_jit(("spec", "structure", "strategy"))
def _start(spec, structure, strategy, keys, attempt, arrays, values=None):
    """``(z, finite)`` per key (folded with the ``attempt`` number): the strategy's
    unconstrained point, and whether the potential and its gradient are finite there (a NaN
    from an undefined prior mean counts as not). ``values``: those of
    ``strategy = init_to_value`` (:func:`_split_values`)."""
    if values is not None:
        strategy = partial(init_to_value, values=values)
    args, kwargs = structure.rebuild(arrays)
    indexed = data_indexed_model(spec.model, spec.plates)
    batch = first_batch(spec.plates)

    def one(key):
        key = jax.random.fold_in(key, attempt)
        with numpyro.validation_enabled(False):
            model_trace = trace(
                handlers.substitute(seed(indexed, key), substitute_fn=_as_jax(strategy))
            ).get_trace(batch, *args, **kwargs)
        z = {
            name: biject_to(site["fn"].support).inv(site["value"])
            for name, site in model_trace.items()
            if site["type"] == "sample" and not site["is_observed"]
        }
        value_finite, grad_finite = _finite_potential(spec, z, batch, args, kwargs)
        return z, value_finite & grad_finite

    return jax.vmap(one)(keys)


def _as_jax(strategy):
    """``strategy`` with its values as JAX arrays: a NumPy value (``init_to_value`` of NumPy
    arrays) cannot be indexed by traced data, as ``alpha[group]`` in a hierarchical model."""

    def substitute_fn(site):
        value = strategy(site)
        return None if value is None else jnp.asarray(value)

    return substitute_fn


def _batch_sizes(plates: tuple, batch_size) -> tuple:
    names = [p.name for p in plates]
    if batch_size is not None and not isinstance(batch_size, (int, np.integer, dict)):
        raise TypeError(
            f"batch_size must be None, an int or a dict {{plate: int}}, got {batch_size!r}."
        )
    if isinstance(batch_size, dict):
        unknown = set(batch_size) - set(names)
        if unknown:
            raise ValueError(
                f"batch_size names plate(s) {sorted(unknown)} that are not subsample plates "
                f"of the model; its subsample plates are {sorted(names)}."
            )
    out = []
    for p in plates:
        if isinstance(batch_size, dict):
            b = batch_size.get(p.name, p.batch_size)
        else:
            b = p.batch_size if batch_size is None else batch_size
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
            given = (
                f"the model's numpyro.plate('{p.name}', ..., subsample_size={b!r})"
                if batch_size is None or (isinstance(batch_size, dict) and p.name not in batch_size)
                else f"batch_size={b!r} for plate '{p.name}'"
            )
            raise ValueError(
                f"{given}: a batch must be a positive int number of rows (subsample_size=100, "
                "say; subsample_size equal to the plate's size means full-data gradients)."
            )
        if b > p.size:
            raise ValueError(
                f"batch_size={b} is larger than the data: plate '{p.name}' has size {p.size}. "
                f"Use a batch_size of at most {p.size} (batch_size={p.size} means full-data "
                "gradients every step)."
            )
        out.append(p._replace(batch_size=int(b)))
    return tuple(out)


@one_shot_jit(("spec", "structure"))
def _index_errors(spec, structure, z, arrays):
    args, kwargs = structure.rebuild(arrays)
    last = Batch({p.name: jnp.arange(p.size - p.batch_size, p.size) for p in spec.plates})
    checked = checkify.checkify(
        lambda z: potential(spec, z, last, args, kwargs), errors=checkify.index_checks
    )
    error, _ = checked(z)
    return error


def _check_indexing(spec, z, model_args, model_kwargs, plates: list):
    """The model's own indexing with the indices of ``plates`` stays within the data, on
    the plates' last rows (JAX clamps an index past the end without an error)."""
    arrays, structure = split_args(model_args, model_kwargs)
    if not all(not_jax_tracer(a) for a in arrays) or any(
        isinstance(a, jax.Array) and not a.is_fully_addressable or validation.zarr_array(a)
        for a in arrays
    ):  # the last rows are not all on this host, or not readable in place (zarr)
        return
    message = _index_errors(spec, structure, z, arrays).get()
    if message:
        sizes = ", ".join(f"'{p.name}' of size {p.size}" for p in spec.plates if p.name in plates)
        raise ValueError(
            f"The model indexes an array past its end with the indices of subsample plate "
            f"{sizes}, on the plate's last rows: {message.strip()} JAX clamps such indices "
            "without an error, so the kernels would silently reuse the data's last row. A "
            "subsample plate's size is the number of rows of the data it indexes: declare "
            "numpyro.plate(name, X.shape[0], subsample_size=...) with the data's own length."
        )


def chunked_batches(plates: tuple, chunk_size: int, num_shards: int = 1):
    """``(num_chunks, batch_of)``: every plate split into the same number of contiguous chunks
    of at most ``chunk_size`` rows; ``batch_of(c)`` is chunk ``c`` as a weighted
    :class:`~numpyro_sgmc.data.subsample.Batch` (each row weight 1, padding weight 0, the prior
    weighted ``1/(chunks · shards)``), so the chunks' potentials sum to the exact full-data
    potential (over ``num_shards`` shards)."""
    num_chunks = max(math.ceil(p.size / chunk_size) for p in plates)
    lengths = {p.name: math.ceil(p.size / num_chunks) for p in plates}

    def batch_of(c):
        indices, weights = {}, {}
        for p in plates:
            idx = c * lengths[p.name] + jnp.arange(lengths[p.name])
            valid = idx < p.size
            indices[p.name] = jnp.where(valid, idx, 0)
            weights[p.name] = valid.astype(jnp.result_type(float))
        return Batch(indices, weights, 1.0 / (num_chunks * num_shards))

    return num_chunks, batch_of
