"""The model's first trace and the checks made on it, before anything compiles.

:func:`first_trace` runs the model once on the first rows of each subsample plate
(:func:`~numpyro_sgmc.data.subsample.first_rows`), checking each plate against the data it
subsamples as the trace runs; :func:`declared_plates` reads the subsample plates off the trace
and :func:`check_sites` checks that stochastic gradients can serve every site of it. Each
failure is a ``ValueError`` that names the site or plate and the fix
(``docs/bad-input.md``), raised where NumPyro would raise a broadcasting error, fail an
assertion or, worse, silently broadcast the whole data set against every batch.
:func:`~numpyro_sgmc.data.model.prepare_model` calls them in that order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.initialization import init_to_uniform
from numpyro.primitives import _PYRO_STACK, Messenger, plate

from numpyro_sgmc.data import validation
from numpyro_sgmc.data.subsample import SubsamplePlate, first_rows
from numpyro_sgmc.diagnostics import PerformanceWarning, warn

__all__ = ["check_sites", "declared_plates", "failing_site", "first_trace"]


def declared_plates(model_trace) -> tuple:
    """The subsample plates of the trace (``subsample_size`` given), sorted by name; a
    ``ValueError`` showing how to declare one when there is none."""
    declared = [
        SubsamplePlate(name, int(site["args"][0]), int(site["args"][1]))
        for name, site in model_trace.items()
        if site["type"] == "plate" and site["args"][1] is not None  # b = n: full data
    ]
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
    return tuple(sorted(declared))


def check_sites(model_trace, plates: tuple):
    """Every site of the first trace can be sampled by stochastic gradients: no latent site
    is discrete or per-datum, no observation broadcasts against its distribution's batch
    shape, and none with the rows of a subsample plate lies outside it (a
    :class:`~numpyro_sgmc.diagnostics.PerformanceWarning`: O(n) per step)."""
    names = {p.name for p in plates}
    for name, site in model_trace.items():
        inside = [f.name for f in site.get("cond_indep_stack", ()) if f.name in names]
        if len(inside) > 1:
            raise ValueError(
                f"Site '{name}' lies in nested subsample plates {inside}. Stochastic-gradient "
                "kernels subsample one data dimension: give `subsample_size` to one of them only."
            )
        if site["type"] != "sample":
            continue
        if not site["is_observed"]:
            if getattr(getattr(site["fn"], "support", None), "is_discrete", False):
                raise ValueError(
                    f"Latent site '{name}' is discrete ({type(site['fn']).__name__}): the SG "
                    "kernels sample continuous sites only, by gradient steps. Marginalise it "
                    "out (sum the likelihood over its values, e.g. with a mixture distribution "
                    "such as dist.MixtureSameFamily), or fix it to a value with "
                    f"numpyro.handlers.condition(model, data={{'{name}': value}})."
                )
            if inside:
                raise ValueError(
                    f"Latent site '{name}' lies inside subsample plate '{inside[0]}'. A "
                    "per-datum latent variable is only updated for the rows in the batch, "
                    "which SG-MCMC does not support (the kernels treat that plate as the "
                    "data's, even with subsample_size equal to its size): marginalise it out, "
                    "or move it out of the subsample plate, into a plate of its own without "
                    f"subsample_size (with numpyro.plate('groups', G): {name} = "
                    "numpyro.sample(...)), indexed by each row's group inside the subsample "
                    f"plate ({name}[numpyro.subsample(group, event_dim=0)])."
                )
            continue
        if inside:
            _check_observation(name, site, inside[0])
    _warn_outside_plates(model_trace, plates)


def _check_observation(name, site, plate_name):
    """An observation in a subsample plate has its distribution's batch shape (one
    observation per row of the batch), not a shape that broadcasts to a larger one."""
    fn, value = site["fn"], site["value"]
    event = tuple(fn.event_shape)
    shape = tuple(jnp.shape(value))
    batch = shape[: len(shape) - len(event)]
    try:
        full = jax.lax.broadcast_shapes(tuple(fn.batch_shape), batch)
    except ValueError:
        full = None
    if full == tuple(fn.batch_shape):
        return
    what = f"broadcast to {full}" if full is not None else "do not broadcast"
    raise ValueError(
        f"Observed site '{name}' in subsample plate '{plate_name}' has an observation of shape "
        f"{shape} for a distribution of batch shape {tuple(fn.batch_shape)} and event shape "
        f"{event}: their batch shapes {what}, so the observations are not matched row by row "
        "with the predictions (a column y of shape (n, 1) against predictions of shape (b,) "
        "compares every prediction with every observation). Give the observation the plate's "
        "shape: pass y.reshape(-1) (or y[:, 0]) to the model, or, for a vector-valued "
        "observation, make its distribution's event shape match with .to_event(1)."
    )


def _warn_outside_plates(model_trace, plates: tuple):
    """A :class:`~numpyro_sgmc.diagnostics.PerformanceWarning` for each observed site outside
    every subsample plate whose observation has the rows of one (b < n)."""
    names = {p.name for p in plates}
    sizes = {p.size: p.name for p in plates if p.batch_size < p.size}
    for name, site in model_trace.items():
        if site["type"] != "sample" or not site["is_observed"]:
            continue
        if any(f.name in names for f in site.get("cond_indep_stack", ())):
            continue
        rows = [sizes[k] for k in jnp.shape(site["value"]) if k in sizes]
        if not rows:
            continue
        p = rows[0]
        empty = not any(
            s["type"] == "sample"
            and s["is_observed"]
            and any(f.name == p for f in s.get("cond_indep_stack", ()))
            for s in model_trace.values()
        )
        warn(
            f"Observed site '{name}' lies outside the subsample plate '{p}', but its "
            f"observation of shape {tuple(jnp.shape(site['value']))} has the plate's "
            f"{dict((q.name, q.size) for q in plates)[p]} rows: its log-likelihood is computed "
            "on all the rows at every step (O(n) per step, not O(b))"
            + (", and the plate holds no observed site, so nothing is subsampled" if empty else "")
            + ". autotune, which measures the gradient noise row by row, cannot see it (its "
            "information matrix I is then singular). Put the likelihood inside the plate:\n"
            f"    with numpyro.plate('{p}', y.shape[0], subsample_size=100):\n"
            f"        numpyro.sample('{name}', ..., obs=numpyro.subsample(y, event_dim=0))",
            PerformanceWarning,
        )


class _DataCheck(Messenger):
    """Check each plate and each ``numpyro.subsample`` call as the first trace runs, before
    NumPyro's own broadcasting errors: a plate no larger than its data, data whose plate
    dimension has the plate's size. ``subsampled`` collects the plates that subsample data."""

    def __init__(self, fn, labels: dict, rows: tuple = ()):
        self.labels = labels  # id(array) -> "argument 'X' (position 0)"
        self.rows = rows  # validation.row_counts: the arguments' leading dimensions
        self.subsampled = set()
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "plate":
            size, b = msg["args"]
            if b is not None and b > size:
                raise ValueError(
                    f"Plate '{msg['name']}' has {size} rows but subsample_size={b}: a batch "
                    f"cannot be larger than the data. Give the plate a subsample_size of at "
                    f"most {size}, e.g. numpyro.plate('{msg['name']}', X.shape[0], "
                    f"subsample_size=min({b}, X.shape[0])); subsample_size equal to the number "
                    "of rows means full-data gradients."
                )
            return
        if msg["type"] != "subsample":
            return
        data, event_dim = msg["value"], msg["kwargs"]["event_dim"]
        shape = tuple(jnp.shape(data))
        what = self.labels.get(id(data), "the array")
        for p in [h for h in _PYRO_STACK if isinstance(h, plate) and h.dim is not None]:
            dim = p.dim - event_dim
            subsampling = p.subsample_size < p.size
            self.subsampled.add(p.name)
            if len(shape) >= -dim and shape[dim] == p.size:
                continue
            call = f"numpyro.subsample(..., event_dim={event_dim}) of {what} of shape {shape}"
            axis = len(shape) + dim
            if len(shape) >= -dim and shape[dim] != 1:
                fits = [a for a in range(len(shape)) if shape[a] == p.size]
                hint = (
                    f" If its rows are along axis {fits[0]}, pass event_dim="
                    f"{p.dim + len(shape) - fits[0]}."
                    if fits and p.dim + len(shape) - fits[0] >= 0
                    else ""
                )
                unequal = validation.unequal_rows(p.name, p.size, what, shape[dim], self.rows)
                if unequal and not fits:
                    raise ValueError(unequal)
                raise ValueError(
                    f"Plate '{p.name}' has size {p.size}, but the {call} subsamples its axis "
                    f"{axis}, of length {shape[dim]}. A subsample plate's size is the number of "
                    f"rows of the data it subsamples: declare numpyro.plate('{p.name}', "
                    f"X.shape[0], ...) with the data's own length.{hint}"
                )
            if subsampling:
                if len(shape) >= -dim:
                    where = f"its axis {axis}, the plate's, has length 1"
                    fix = "a column y of shape (n, 1) as y.reshape(-1) (or y[:, 0])"
                else:  # the plate's dim counts from the left of the event's event_dim axes
                    where = f"it has no axis {dim} for the plate"
                    fix = f"axis {dim}, with event_dim={event_dim} and the plate's dim={p.dim}"
                    if shape and shape[0] == p.size and p.dim + len(shape) >= 0:
                        fix = f"its rows are along axis 0: pass event_dim={p.dim + len(shape)}"
                    elif shape and shape[0] == p.size:
                        wanted = (shape[0],) + (1,) * (-dim - len(shape)) + shape[1:]
                        fix = f"{fix}, as x.reshape{wanted}"
                raise ValueError(
                    f"Inside plate '{p.name}' (size {p.size}, subsample_size {p.subsample_size}) "
                    f"the {call} subsamples nothing: {where}, so NumPyro broadcasts the whole "
                    "array against every batch instead of taking the batch's rows. Pass the "
                    f"data with their rows along the plate's dimension: {fix}."
                )


def first_trace(model, rng_key, model_args, model_kwargs) -> tuple:
    """``(trace, subsampled plates)``: ``model`` on the first rows of each subsample plate.

    Each plate and each ``numpyro.subsample`` call is checked as the trace runs (a plate no
    larger than its data, data whose plate dimension has the plate's size); what NumPyro would
    raise as a broadcasting error or a failed assertion is raised with a message that names
    the fix. The subsampled plates are those whose data the model subsamples with
    ``numpyro.subsample``; the others index the data themselves (``X[idx]``). The trace's
    values are abstract (traced under ``jax.eval_shape``): read their shapes, not their
    values, and keep none of them past the call."""
    positional, keyword = validation.argument_labels(model, model_args, model_kwargs)

    def labels(args, kwargs) -> dict:  # id(array) -> "argument 'X' (position 0)"
        named = {id(x): label for x, label in zip(args, positional, strict=True)}
        named.update({id(v): keyword[k] for k, v in kwargs.items()})
        return named

    check = _DataCheck(model, {}, validation.row_counts(model, model_args, model_kwargs))
    try:
        # latent values from init_to_uniform, not the prior: a site with no sampler (an
        # ImproperUniform's flat prior, as NUTS allows) has a value all the same
        seeded = substitute(seed(first_rows(check), rng_key), substitute_fn=init_to_uniform)
        model_trace = _structure(seeded, check, labels, model_args, model_kwargs)
    except AssertionError as err:
        if "size of plate should be positive" not in str(err):
            raise
        empty = validation.empty_arguments(model, model_args, model_kwargs)
        raise ValueError(
            "A numpyro.plate of the model has size 0: there are no data to sample from"
            + (f" ({empty})" if empty else "")
            + ". Check the step that loads or filters the data: every subsample plate needs "
            "at least one row."
        ) from err
    except ValueError as err:
        if "Incompatible shapes for broadcasting" not in str(err):
            raise
        site, frame = failing_site(err)
        if frame is None or frame.subsample_size >= frame.size:
            raise
        raise ValueError(
            f"Site '{site}' inside subsample plate '{frame.name}' (size {frame.size}, "
            f"subsample_size {frame.subsample_size}) does not fit the plate's batch of "
            f"{frame.subsample_size} rows ({err}): an array with all {frame.size} rows is used "
            "inside the plate. Subsample every per-row array there, e.g. "
            "Xb = numpyro.subsample(X, event_dim=1) and yb = numpyro.subsample(y, event_dim=0), "
            "and write the likelihood with Xb and yb (or index with the plate's indices: "
            "with numpyro.plate(...) as idx: X[idx])."
        ) from err
    return model_trace, check.subsampled


def _structure(model, check, labels, model_args, model_kwargs):
    """The trace of ``model`` (seeded) for its sites, plates and supports, traced abstractly.

    Only its structure is used (names, shapes, supports, plates), so it is traced as the
    compiled programs trace the model, with the arrays as abstract values
    (``jax.eval_shape``): no eager operation compiles a program of its own, and a prior draw
    that overflows a parameter the model computes from it (``exp(X @ beta)`` on raw covariate
    scales) raises no NumPyro argument check; the starts are searched apart, for a finite
    potential (``numpyro_sgmc.data.model.prepare_model``). A support that depends on the
    values (``Uniform(0, y.max())``) needs concrete bounds for its transform: such a model is
    traced again eagerly, with NumPyro's argument checks off."""
    from numpyro_sgmc.data.model import split_args  # it builds on this module

    arrays, structure = split_args(model_args, model_kwargs)
    traced = {}

    def structure_of(arrays):
        args, kwargs = structure.rebuild(arrays)
        check.labels = labels(args, kwargs)
        traced["trace"] = trace(model).get_trace(*args, **kwargs)

    jax.eval_shape(structure_of, arrays)
    check.labels = labels(model_args, model_kwargs)
    latent = [s for s in traced["trace"].values() if s["type"] == "sample" and not s["is_observed"]]
    if not any(_holds_tracer(site["fn"].support) for site in latent):
        return traced["trace"]
    with numpyro.validation_enabled(False):
        return trace(model).get_trace(*model_args, **model_kwargs)


def _holds_tracer(obj, depth: int = 4) -> bool:
    """Whether a constraint (or a constraint it wraps) holds a traced value."""
    if isinstance(obj, jax.core.Tracer):
        return True
    if depth == 0 or not hasattr(obj, "__dict__"):
        return False
    return any(_holds_tracer(v, depth - 1) for v in vars(obj).values())


def failing_site(err) -> tuple:
    """``(site name, plate)`` of the innermost ``numpyro.sample`` call and plate that ``err``'s
    traceback passed through (a failed broadcast, a draw with no sampler); ``None`` where it
    passed through none."""
    site, frame, tb = None, None, err.__traceback__
    while tb is not None:
        here = tb.tb_frame
        if here.f_code.co_name == "sample" and isinstance(here.f_locals.get("name"), str):
            site = here.f_locals["name"]
        if isinstance(here.f_locals.get("self"), plate):
            frame = here.f_locals["self"]
        tb = tb.tb_next
    return site, frame
