"""Warm start: run the subsampled model to its mode with an optax optimizer (Adam).

The starting point of every tuned run (``docs/theory.md`` §3–§4, §6). One call runs ``K``
restarts from different initial values in one vectorised ``lax.scan``; each minimises the
minibatch estimate of the average potential

.. math::

    L(z) = \\tilde U(z) / n = -\\tfrac{1}{n}\\log p_0(z)
           - \\tfrac{1}{b}\\textstyle\\sum_{i\\in B}\\, l(z; X_i)

(a MAP fit in unconstrained space, SVI with ``AutoDelta``), with random reshuffling (every
datum once per epoch) and by default Adam in two phases (:func:`default_optimizer`): a fifth
of the iterations at a constant learning rate, then a fresh Adam (whose second moment no
longer remembers the large gradients of the starting point) with a cosine-decayed rate, so
that the last iterates settle at the mode; the mode returned is the mean of the last tenth of
the iterates. What the later
steps need is kept: the mode, Adam's moments ``μ`` and ``ν`` and its last minibatch gradient
(the statistics of the §6 masses, :func:`numpyro_sgmc.bde.mass_from_warm_start`), the
full-data average gradient at the mode (one chunked pass) and the loss trace.

**Convergence check.** With ``g`` the full-data average gradient at the end and ``J`` the
curvature per datum there (:func:`numpyro_sgmc.tuner.fisher.information` on a subsample of rows),
``sqrt(n gᵀJ⁻¹g)`` is how many posterior standard deviations the mode found is from a zero of
the gradient. A restart farther than ``tol`` gets a
:class:`~numpyro_sgmc.diagnostics.ConvergenceWarning` with its numbers.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax, random
from numpyro.infer.initialization import init_to_uniform

from numpyro_sgmc import host
from numpyro_sgmc.data import validation
from numpyro_sgmc.data.batches import batch_sampler
from numpyro_sgmc.data.files import first_rows, rows_in_memory
from numpyro_sgmc.data.model import constrained, potential, prepare_model, split_args
from numpyro_sgmc.data.passes import exact_gradient
from numpyro_sgmc.diagnostics import ConvergenceWarning, warn
from numpyro_sgmc.tuner.fisher import information_of
from numpyro_sgmc.tuner.laplace import DENSE_MAX_DIM
from numpyro_sgmc.tuner.rows import (
    PROBES,
    WARM_START_CHECK_ROWS,
    WARM_START_ROWS,
    Stream,
    choose_rows,
    sample_rows,
)
from numpyro_sgmc.tuner.rowsums import fisher_diagonal, global_terms

__all__ = ["WarmStart", "start_point_of", "warm_start", "warm_start_of"]


class WarmStart(NamedTuple):
    """What :func:`warm_start` found. Every array has a leading axis of length ``K`` (restarts).

    :param dict params: the modes in unconstrained space, site -> ``(K, ...)``: the mean of
        each run's last tenth of iterates (``init_params`` of
        ``MCMC(..., num_chains=K).run``).
    :param dict constrained: the modes in constrained space, with the deterministic sites.
    :param dict gradient: full-data average gradient ``-∇U/n`` at each mode, from one chunked
        pass over all the data.
    :param dict first_moment: Adam's ``μ`` of the gradient of ``L`` (``None`` if the optimizer
        keeps no Adam state).
    :param dict second_moment: Adam's ``ν`` (``sqrt(ν)`` is Adam's denominator).
    :param loss: ``(K, num_iterations)`` minibatch loss ``L`` at every iteration.
    :param gradient_distance: ``(K,)`` ``sqrt(n gᵀJ⁻¹g)``, in posterior standard deviations
        (NaN if not checked).
    :param converged: ``(K,)`` whether ``gradient_distance <= tol``; ``None`` if not checked.
    :param int num_data: ``n``.
    :param float num_epochs: passes over the data the optimizer made.
    :param tuple plates: the model's subsample plates.
    :param dict final_gradient: the optimizer's last minibatch gradient of ``L``.
    :param potential: ``(K,)`` the full-data potential ``U`` at each mode, from the pass that
        gave ``gradient`` (``None`` where not computed).
    :param sample_size: the rows of the sample the optimizer ran on (``None``: all of them).
    """

    params: dict
    constrained: dict
    gradient: dict
    first_moment: Optional[dict]
    second_moment: Optional[dict]
    loss: np.ndarray
    gradient_distance: np.ndarray
    converged: Optional[np.ndarray]
    num_data: int
    num_epochs: float
    plates: tuple
    final_gradient: Optional[dict] = None
    potential: Optional[np.ndarray] = None
    sample_size: Optional[int] = None

    @property
    def num_restarts(self) -> int:
        return int(self.loss.shape[0])

    @property
    def best(self) -> int:
        """Index of the restart with the lowest full-data potential (without it, the lowest
        minibatch loss over its last epoch)."""
        if self.potential is not None:
            return int(np.argmin(np.where(np.isfinite(self.potential), self.potential, np.inf)))
        steps = max(1, self.loss.shape[1] // max(1, math.ceil(self.num_epochs)))
        return int(np.argmin(self.loss[:, -steps:].mean(axis=1)))

    def member(self, k: int) -> dict:
        """The unconstrained mode of restart ``k`` (no leading axis)."""
        return host.take(self.params, k)

    def __str__(self) -> str:
        lines = [
            f"WarmStart: {self.num_restarts} restart(s), {self.num_epochs:g} epochs over "
            f"n = {self.num_data}"
        ]
        last = self.loss[:, -max(1, self.loss.shape[1] // 20) :].mean(axis=1)
        norms = np.sqrt(
            sum(
                np.sum(np.reshape(g, (self.num_restarts, -1)) ** 2, axis=1)
                for g in self.gradient.values()
            )
        )
        for k in range(self.num_restarts):
            status = (
                "convergence not checked"
                if self.converged is None
                else f"{self.gradient_distance[k]:.2g} posterior sd from the mode"
                + ("" if self.converged[k] else "  NOT CONVERGED")
            )
            lines.append(
                f"  restart {k}: final loss {last[k]:.6g}, |full-data gradient| {norms[k]:.3g}, "
                + status
            )
        return "\n".join(lines)


def _adam_moments(opt_state):
    """Adam's ``(μ, ν)`` from an optax state, wherever it sits in a chain; else ``None``."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    if not found:
        return None, None
    return found[0].mu, found[0].nu


def default_optimizer(learning_rate: float, num_iterations: int):
    """``(optimizer, restart)``: Adam at a constant rate for the first fifth of the
    iterations, then a cosine decay to 1/1000 of it, with Adam's moments and bias correction
    started afresh at the switch (iteration ``restart``: its second moment no longer
    remembers the large gradients of the starting point). One optimizer, so that the whole
    run is one compiled loop."""
    first = num_iterations // 5
    schedule = optax.join_schedules(
        [
            optax.constant_schedule(learning_rate),
            optax.cosine_decay_schedule(learning_rate, num_iterations - first, alpha=1e-3),
        ],
        [first],
    )
    return optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(schedule)), first


@partial(
    jax.jit,
    static_argnames=(
        "spec", "structure", "layout", "optimizer", "learning_rate", "num_iterations",
        "sampled",
    ),
)  # fmt: skip
def _optimise(
    spec, structure, layout, optimizer, learning_rate, num_iterations, sampled, z0, scale, keys,
    rows, arrays,
):  # fmt: skip
    """``K`` optimizer runs, vectorised, in the coordinates ``u`` of ``z = z0 + scale ⊙ u``
    (flat); the data are arguments, not compiled-in constants. Returns the tail average, the
    last minibatch gradient and Adam's moments, all in ``z`` (the full-data gradient at the
    mode is :func:`~numpyro_sgmc.data.passes.exact_gradient`'s, a program the Newton polish
    compiles anyway).

    ``sampled``: the plates the epochs run over, of the sizes of ``rows`` (plate name -> the
    sample's row indices, for the plates sampled): a batch is drawn from the sample, and
    weighted as one from all ``n_p`` rows, so the optimizer finds the mode of the posterior
    whose likelihood is the sample's scaled to ``n``."""
    n = spec.num_data
    sampler = batch_sampler(sampled, "epochs")
    if optimizer is None:
        opt, restart = default_optimizer(learning_rate, num_iterations)
    else:
        opt, restart = optimizer, -1
    tail = max(1, num_iterations // 10)

    def run_one(z0, scale, key):
        args, kwargs = structure.rebuild(arrays)

        def loss_fn(u, batch):
            return potential(spec, layout.unravel(z0 + scale * u), batch, args, kwargs) / n

        def step(carry, xs):
            u, opt_state, batch_state, average, _ = carry
            k, t = xs
            if restart > 0:  # a fresh Adam (moments, bias correction) at the switch
                fresh = opt.init(u)
                opt_state = (
                    jax.tree.map(
                        lambda a, b: jnp.where(t == restart, a, b), fresh[0], opt_state[0]
                    ),
                ) + tuple(opt_state[1:])
            batch, batch_state = sampler.draw(batch_state, k)
            indices = {p: rows[p][i] if p in rows else i for p, i in batch.indices.items()}
            batch = batch._replace(indices=indices)
            loss, grad = jax.value_and_grad(loss_fn)(u, batch)
            updates, opt_state = opt.update(grad, opt_state, u)
            u = optax.apply_updates(u, updates)
            # running mean of the last `tail` iterates (zero weight before them)
            weight = jnp.where(
                t >= num_iterations - tail, 1.0 / (t - num_iterations + tail + 1), 0.0
            )
            return (u, opt_state, batch_state, average + weight * (u - average), grad), loss

        key_batches, key_steps = random.split(key)
        u = jnp.zeros_like(z0)
        xs = (random.split(key_steps, num_iterations), jnp.arange(num_iterations))
        (u, opt_state, _, average, last_grad), losses = lax.scan(
            step, (u, opt.init(u), sampler.init(key_batches), u, u), xs
        )
        mode = layout.unravel(z0 + scale * average)
        mu, nu = _adam_moments(opt_state)
        # back to z: d/dz = (d/du) / scale; Adam's moments of the gradient likewise
        moments = (
            (None, None)
            if mu is None
            else (layout.unravel(mu / scale), layout.unravel(nu / scale**2))
        )
        return (
            mode,
            layout.unravel(last_grad / scale),
            *moments,
            losses,
        )

    return jax.vmap(run_one)(z0, scale, keys)


def _scales(prepared, rng_key, model_args, model_kwargs, z0, num_rows=WARM_START_ROWS):
    """``(K, d)`` natural scales of the parameters at the starts: ``1/sqrt(F_jj)``, ``F`` the
    empirical Fisher information's diagonal per datum there plus the prior's curvature, so
    that Adam's steps are in units of each parameter's own scale (a covariate multiplied by
    ``10⁴`` just works).

    A parameter with no per-datum gradient (``F_jj = 0``: a hierarchy's mean and scale) has
    only the prior's curvature, at the start; in a hierarchy that depends on where the group
    parameters are. At a start with the groups equal, a group scale's curvature is nearly
    zero, and its ``1/sqrt`` made Adam's steps along ``log τ`` tens of posterior sds long
    (200 groups at ``n = 10⁵``: 280 per datum, against 16 at the posterior; the warm start
    ended at ``τ ≈ 2000``). Such a scale is capped at the widest of the parameters the data
    inform: a smaller scale only takes Adam more of its thousands of steps."""
    spec, layout = prepared.spec, prepared.layout
    arrays, structure = split_args(model_args, model_kwargs)
    rows = sample_rows(Stream.WARM_START_ROWS, rng_key, spec.plates, num_rows).indices
    sample_arrays, rows = rows_in_memory(arrays, spec.plates, rows)
    # the prior's curvature as the information step will compute it (one compilation for
    # both): exact and dense up to DENSE_MAX_DIM parameters, Hutchinson probes above
    dense = layout.size <= DENSE_MAX_DIM
    probes = None
    if not dense:
        signs = Stream.WARM_START_PROBES.rng(rng_key).integers(0, 2, (PROBES, layout.size))
        probes = host.device_array(2 * signs - 1, z0.dtype)
    first = first_rows(arrays, spec.plates)  # the prior's terms read no row
    out = []
    for zf in np.asarray(z0):
        zf = host.device_array(zf)
        fisher = np.asarray(fisher_diagonal(spec, structure, layout, zf, rows, sample_arrays))
        kind = "dense" if dense else "diagonal"
        _, prior = global_terms(spec, structure, layout, kind, zf, probes, first)
        prior = np.diag(np.asarray(prior)) if dense else np.asarray(prior).mean(axis=0)
        curvature = fisher + np.maximum(prior, 0.0) / spec.num_data
        positive = curvature[curvature > 0]
        floor = 1e-12 * (positive.max() if positive.size else 1.0)
        scale = np.where(curvature > floor, 1.0 / np.sqrt(np.maximum(curvature, floor)), 1.0)
        informed = fisher > 0
        if np.any(informed):  # the prior's curvature alone can be far too flat (docstring)
            scale = np.where(informed, scale, np.minimum(scale, scale[informed].max()))
        out.append(scale)
    return host.device_array(np.stack(out), z0.dtype)


def warm_start(
    model: Callable,
    rng_key,
    *model_args,
    num_epochs: float = 5,
    batch_size=None,
    num_restarts: int = 1,
    learning_rate: float = 0.05,
    optimizer: Optional[optax.GradientTransformation] = None,
    init_params: Optional[dict] = None,
    init_strategy=init_to_uniform,
    tol: Optional[float] = None,
    check: bool = True,
    num_check_rows: int = WARM_START_CHECK_ROWS,
    chunk_size: int = 65536,
    rescale: bool = False,
    model_kwargs: Optional[dict] = None,
) -> WarmStart:
    """Run ``num_restarts`` optimizers to the mode of ``model``, vectorised, and check them.

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param rng_key: PRNG key: initial values and batches.
    :param model_args: the model's positional arguments (the data; pandas objects, lists and
        NumPy arrays are converted once, ``numpyro_sgmc.data.validation.as_arrays``).
    :param num_epochs: passes over the data (iterations: ``ceil(num_epochs · n / b)``, with
        ``b`` the total batch size over the plates).
    :param batch_size: overrides the plates' ``subsample_size`` (int or ``{plate: int}``).
    :param num_restarts: ``K`` independent runs from different initial values.
    :param learning_rate: Adam's learning rate: constant for the first fifth of the
        iterations, then Adam starts afresh and the rate decays by a cosine schedule to 1/1000
        of it (ignored when ``optimizer`` is given).
    :param optimizer: any optax transformation to use instead (its Adam moments are kept if it
        contains ``scale_by_adam``).
    :param init_params: unconstrained initial values, site -> array with a leading ``K`` axis
        (or without, to start every restart there); default: ``init_strategy`` per restart.
    :param tol: the largest ``gradient_distance`` (in posterior sds) counted as converged;
        default ``max(3, 2√d)``.
    :param check: estimate ``J`` on ``num_check_rows`` rows per restart to measure how far
        each mode is from a zero of the gradient, and warn if farther than ``tol``.
    :param num_check_rows: rows of that estimate.
    :param chunk_size: rows per chunk of the full-data gradient pass.
    :param rescale: optimise in each parameter's natural scale at the start (``1/sqrt`` of the
        empirical Fisher information's diagonal there), so that ``learning_rate`` means the
        same whatever the covariates' scales, and retry a diverging run at a tenth of the
        learning rate (what :func:`~numpyro_sgmc.autotune` does). Adam's moments are returned
        in the model's own coordinates either way.
    :param dict model_kwargs: the model's keyword arguments.
    :return: a :class:`WarmStart`.
    """
    model_args, model_kwargs = validation.as_arrays(model, model_args, model_kwargs)
    num_restarts = validation.positive_int("num_restarts", num_restarts)
    num_epochs = validation.positive_number("num_epochs", num_epochs)
    if optimizer is None:
        learning_rate = validation.positive_number("learning_rate", learning_rate)
    tol = validation.positive_number("tol", tol, allow_none=True)
    num_check_rows = validation.positive_int("num_check_rows", num_check_rows)
    chunk_size = validation.positive_int("chunk_size", chunk_size)
    key_init, key_run = host.split_key(rng_key, 2)
    prepared = prepare_model(
        host.key_batch(key_init, num_restarts),
        model,
        model_args,
        model_kwargs,
        batch_size=batch_size,
        init_strategy=init_strategy,
    )
    return warm_start_of(
        prepared, key_run, model_args, model_kwargs, num_epochs, num_restarts, learning_rate,
        optimizer, init_params, tol, check, num_check_rows, chunk_size, rescale,
    )  # fmt: skip


def warm_start_of(
    prepared,
    rng_key,
    model_args,
    model_kwargs,
    num_epochs=5,
    num_restarts=1,
    learning_rate=0.05,
    optimizer=None,
    init_params=None,
    tol=None,
    check=True,
    num_check_rows=WARM_START_CHECK_ROWS,
    chunk_size=65536,
    rescale=False,
    max_rows=None,
    sample_blocks=None,
) -> WarmStart:
    """:func:`warm_start` on a prepared model whose ``init_params`` carry the restart axis.

    With ``rescale`` the optimizer works in each parameter's natural scale at the start
    (``_scales``), so that its learning rate means the same for a covariate on any scale;
    a run whose loss turns non-finite is retried from its start at a tenth of the learning rate,
    twice. With ``max_rows`` and more rows than that, the ``num_epochs`` run over a uniform
    sample of about ``max_rows`` rows (without replacement; ``_optimise``), for at least
    ``_MIN_ITERATIONS`` steps, and ``WarmStart.num_epochs`` counts them as passes over all the
    data; with ``sample_blocks``, the sample is that many runs of consecutive rows (for rows in
    random order, :func:`~numpyro_sgmc.tuner.rows.choose_rows`).
    """
    if not num_epochs > 0:
        raise ValueError(f"num_epochs must be positive, got {num_epochs!r}.")
    spec, layout = prepared.spec, prepared.layout
    n, b = spec.num_data, spec.batch_size
    key_run, key_check, key_scale = host.split_key(rng_key, 3)
    rows, sampled = _row_sample(spec.plates, max_rows, key_scale, sample_blocks)
    num_iterations = math.ceil(num_epochs * sum(p.size for p in sampled) / b)
    # on a sample, still the iterations Adam needs (or those of all the rows, if fewer)
    num_iterations = max(1, num_iterations, min(math.ceil(num_epochs * n / b), _MIN_ITERATIONS))
    z0 = (
        prepared.init_params
        if init_params is None
        else _restart_axis(init_params, prepared.init_params, num_restarts)
    )
    arrays, structure = split_args(model_args, model_kwargs)
    every = {p.name: rows.get(p.name) for p in spec.plates}  # None: all of a plate's rows
    sample_arrays, every = rows_in_memory(arrays, spec.plates, every)
    rows = {name: every[name] for name in rows}
    z0f = layout.ravel(z0)
    scale = _scales(prepared, key_scale, model_args, model_kwargs, z0f) if rescale else None
    scale = host.device_array(np.ones(z0f.shape), z0f.dtype) if scale is None else scale
    keys = host.key_batch(key_run, num_restarts)
    rate = float(learning_rate)
    for _ in range(3 if rescale else 1):
        z, last_grad, mu, nu, losses = _optimise(
            spec, structure, layout, optimizer, rate, num_iterations, sampled, z0f, scale, keys,
            rows, sample_arrays,
        )  # fmt: skip
        losses = np.asarray(losses)
        finite = np.all(np.isfinite(losses), axis=1)
        finite &= np.all(np.isfinite(np.asarray(layout.ravel(z))), axis=1)
        if np.all(finite):
            break
        rate = rate / 10
    if not np.all(finite):
        raise FloatingPointError(
            f"The optimizer's loss became non-finite in restart(s) "
            f"{np.flatnonzero(~finite).tolist()}"
            + (f", also at learning rates down to {rate * 10:g}" if rescale else "")
            + ": the model's log-density is not finite somewhere on the way from the start. "
            "Check the data for NaN or infinite values and impossible observations, and start "
            "nearer the data's scale (init_params, or init_strategy=init_to_mean)"
            + ("." if rescale else f", or lower learning_rate (now {learning_rate}).")
        )
    args, kwargs = tuple(model_args), dict(model_kwargs or {})
    modes = [host.take(z, k) for k in range(num_restarts)]
    # one pass for every restart's mode (from files, one read of them)
    potentials, gradient = exact_gradient(spec, z, args, kwargs, int(chunk_size), batched=True)
    distance = np.full(num_restarts, np.nan)
    d = prepared.layout.size
    if check:
        one = prepared._replace(init_params=host.take(prepared.init_params))
        for k in range(num_restarts):
            info = information_of(
                one,
                host.split_key(key_check, 1, k)[0],
                model_args,
                model_kwargs,
                modes[k],
                num_rows=min(num_check_rows, n),
                kind="dense" if d <= DENSE_MAX_DIM else "diagonal",
                regularize="auto",
            )
            g = np.asarray(prepared.layout.ravel(gradient))[k]
            step = np.asarray(info.potential_curvature.solve(g.astype(np.float64)))
            distance[k] = float(np.sqrt(max(n * float(g @ step), 0.0)))
    tol = max(3.0, 2.0 * math.sqrt(d)) if tol is None else tol
    converged = distance <= tol if check else None
    result = WarmStart(
        params=z,
        constrained=_constrained_points(prepared, z, args, kwargs),
        gradient=gradient,
        first_moment=mu,
        second_moment=nu,
        loss=losses,
        gradient_distance=distance,
        converged=converged,
        num_data=n,
        num_epochs=num_iterations * b / n,
        plates=spec.plates,
        final_gradient=last_grad,
        potential=np.asarray(potentials, np.float64),
        sample_size=sum(p.size for p in sampled) if rows else None,
    )
    if check and not np.all(converged):
        warn(
            f"The warm start has not converged in restart(s) {np.flatnonzero(~converged).tolist()}:"
            f" after {result.num_epochs:g} epochs the full-data gradient puts the mode "
            f"{', '.join(f'{x:.3g}' for x in distance[~converged])} posterior standard "
            f"deviations (tol={tol:.3g}) from a zero of the gradient. Run more epochs "
            f"(num_epochs={num_epochs}) or use a larger learning_rate (now {learning_rate}).\n"
            + str(result),
            ConvergenceWarning,
        )
    return result


def start_point_of(
    prepared, model_args, model_kwargs, init_params=None, chunk_size=65536
) -> WarmStart:
    """A :class:`WarmStart` at the start itself (``init_params`` as for :func:`warm_start_of`;
    by default the prepared model's, with the restart axis), no optimizer run: the full-data
    gradient and potential there from one pass, ``loss`` the potential per datum,
    ``num_epochs`` zero. Newton steps from the start reach the mode of a near-Gaussian
    posterior with up to hundreds of parameters in a few passes, without compiling an
    optimizer's loop (:func:`~numpyro_sgmc.autotune` tries them first)."""
    spec, z = prepared.spec, prepared.init_params
    if init_params is not None:
        z = _restart_axis(init_params, z, jax.tree.leaves(z)[0].shape[0])
    # strongly typed, as the mode the tuner builds from (a weak type compiles a second program)
    z = jax.tree.map(lambda v: host.device_array(np.asarray(v)), z)
    args, kwargs = tuple(model_args), dict(model_kwargs or {})
    potentials, gradient = exact_gradient(spec, z, args, kwargs, int(chunk_size), batched=True)
    potentials = np.asarray(potentials, np.float64)
    return WarmStart(
        params=z,
        constrained=_constrained_points(prepared, z, args, kwargs),
        gradient=gradient,
        first_moment=None,
        second_moment=None,
        loss=(potentials / spec.num_data)[:, None],
        gradient_distance=np.full(len(potentials), np.nan),
        converged=None,
        num_data=spec.num_data,
        num_epochs=0.0,
        plates=spec.plates,
        potential=potentials,
    )


def _constrained_points(prepared, z, args, kwargs) -> dict:
    """The points ``z`` (with the restart axis) in constrained space, with the deterministic
    sites; computed with the Jacobian where the tuner maps a dense covariance (up to
    ``DENSE_MAX_DIM`` parameters), so that its own call finds the program compiled."""
    jacobian = prepared.layout if prepared.layout.size <= DENSE_MAX_DIM else None
    spec, exclude = prepared.spec, prepared.per_datum_sites
    return constrained(spec, z, args, kwargs, exclude, True, jacobian)[0]


_MIN_ITERATIONS = 1000  # Adam's steps on a row sample, at least


def _row_sample(plates, max_rows, rng_key, blocks=None) -> tuple:
    """``(rows, sampled)``: plate name -> the sample's row indices (a device array), for the
    plates sampled, and the plates with the sample's sizes. About ``max_rows`` rows in all
    (``None``: every row); a plate whose share would be below its batch keeps all its rows."""
    sample = choose_rows(plates, max_rows, rng_key, Stream.WARM_START_SAMPLE, blocks)
    rows, sampled = {}, []
    for p in plates:
        r = sample[p.name]
        if r is None or len(r) < p.batch_size:
            sampled.append(p)
        else:
            rows[p.name] = host.device_array(r.astype(np.int32))
            sampled.append(p._replace(size=len(r)))
    return rows, tuple(sampled)


def _restart_axis(init_params, prototype, num_restarts):
    """``init_params`` with a leading restart axis (broadcast if it has none)."""
    if not isinstance(init_params, dict) or set(init_params) != set(prototype):
        raise ValueError(
            f"init_params must be a dict with the sites {sorted(prototype)}, got "
            f"{sorted(init_params) if isinstance(init_params, dict) else type(init_params)}."
        )
    out = {}
    for name, proto in prototype.items():
        v = jnp.asarray(init_params[name], proto.dtype)
        if v.shape == proto.shape[1:]:
            v = jnp.broadcast_to(v, proto.shape)
        if v.shape != proto.shape:
            raise ValueError(
                f"init_params['{name}'] has shape {v.shape}; expected {proto.shape[1:]} or, "
                f"one per restart, {proto.shape}."
            )
        out[name] = v
    return out
