"""Warm start: run the subsampled model to its mode with an optax optimizer (Adam).

The starting point of every tuned run (``shared/design/theory.md`` §3–§4, §6). One call runs
``K`` restarts from different initial values in one vectorised ``lax.scan``; each minimises
the minibatch estimate of the average potential

.. math::

    L(z) = \\tilde U(z) / n = -\\tfrac{1}{n}\\log p_0(z)
           - \\tfrac{1}{b}\\textstyle\\sum_{i\\in B}\\, l(z; X_i)

(a MAP fit in unconstrained space, equivalent to SVI with ``AutoDelta``), with random
reshuffling (every datum once per epoch) and by default Adam in two phases: a fifth of the
iterations at a constant learning rate, then a fresh Adam (whose second moment no longer
remembers the large gradients of the starting point) with a cosine-decayed rate, so that the
last iterates settle at the mode instead of rattling around it at the scale of the learning
rate; the mode returned is the mean of the last tenth of the iterates (tail averaging).
What the later steps need is kept: the mode (unconstrained and
constrained), Adam's moments ``μ`` and ``ν`` and its last minibatch gradient (the seed's
preconditioner statistics, §6, see :func:`~numpyro_sgmc.mass_from_warm_start`), the
full-data average gradient at the mode (one chunked pass) and the loss trace.

**Convergence check.** With ``g`` the full-data average gradient at the end and ``J`` the
curvature per datum of the potential there (:func:`numpyro_sgmc.fisher.information` on a
subsample of rows; dense for up to 100 parameters, diagonal above), the Newton step to the
mode is ``δ = J⁻¹g`` and the posterior covariance about ``(nJ)⁻¹``, so
``sqrt(n gᵀJ⁻¹g)`` is how many posterior standard deviations the mode found is from the
mode (the same measure :func:`~numpyro_sgmc.autotune.autotune` uses before its Newton
step). A restart farther than ``tol`` is reported as not converged, with its
numbers, by a :class:`ConvergenceWarning`. The default ``tol = max(3, 2√d)`` is close
enough for a control-variate centre and for the Newton step
:func:`~numpyro_sgmc.autotune.autotune` takes from there; Adam's last iterates typically
end about one posterior sd per coordinate from the mode.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax, random
from numpyro.infer.initialization import init_to_uniform

from numpyro_sgmc.batches import batch_sampler
from numpyro_sgmc.diagnostics import user_stacklevel
from numpyro_sgmc.fisher import information
from numpyro_sgmc.gradients import full_data_gradient
from numpyro_sgmc.kernels.base import ChainInit
from numpyro_sgmc.mass_matrices import mass_from_warm_start
from numpyro_sgmc.preconditioners import flat_layout
from numpyro_sgmc.subsample import initialize, num_data, split_args

__all__ = ["ConvergenceWarning", "WarmStart", "warm_start"]

_DENSE_MAX_DIM = 100  # the convergence check uses a dense J up to this many parameters


class ConvergenceWarning(UserWarning):
    """The optimizer stopped before the mode (the gradient there is too large)."""


class WarmStart(NamedTuple):
    """What :func:`warm_start` found. Every array has a leading axis of length ``K`` (restarts).

    :param dict params: the modes in unconstrained space, site -> ``(K, ...)``: the mean of
        each run's last tenth of iterates. Pass them as
        ``MCMC(..., num_chains=K).run(..., init_params=params)``.
    :param dict constrained: the modes in constrained space, with the deterministic sites.
    :param dict gradient: full-data average gradient ``-∇U/n`` at each mode (theory §1's
        ``ḡ`` with the prior), from one chunked pass over all the data.
    :param dict first_moment: Adam's ``μ`` of the gradient of ``L`` (``None`` if the optimizer
        keeps no Adam state).
    :param dict second_moment: Adam's ``ν`` (``sqrt(ν)`` is Adam's denominator).
    :param loss: ``(K, num_iterations)`` minibatch loss ``L`` at every iteration.
    :param gradient_distance: ``(K,)`` ``sqrt(n gᵀJ⁻¹g)``: the Newton step from each mode
        found to the exact one, in posterior standard deviations (NaN if not checked).
    :param converged: ``(K,)`` whether ``gradient_distance <= tol``; ``None`` if not checked.
    :param int num_data: ``n``.
    :param int num_epochs: passes over the data the optimizer made.
    :param dict plates: plate name -> :class:`~numpyro_sgmc.subsample.SubsamplePlate`.
    :param dict final_gradient: the optimizer's last minibatch gradient of ``L`` (at its last
        iterate): the "gradient" statistic of the §6 preconditioners.
    """

    params: dict
    constrained: dict
    gradient: dict
    first_moment: Optional[dict]
    second_moment: Optional[dict]
    loss: np.ndarray
    gradient_distance: np.ndarray
    converged: np.ndarray
    num_data: int
    num_epochs: float
    plates: dict
    final_gradient: Optional[dict] = None

    @property
    def num_restarts(self) -> int:
        return int(self.loss.shape[0])

    @property
    def best(self) -> int:
        """Index of the restart with the lowest loss over its last epoch."""
        steps = max(1, self.loss.shape[1] // max(1, math.ceil(self.num_epochs)))
        return int(np.argmin(self.loss[:, -steps:].mean(axis=1)))

    def member(self, k: int) -> dict:
        """The unconstrained mode of restart ``k`` (no leading axis)."""
        return _restart(self.params, k)

    def chain_init(self, statistic: Optional[str] = None, granularity: str = "layer"):
        """Start one chain per member at its mode, with its own §6 mass matrix.

        ``MCMC(SGHMC(...), num_chains=K).run(key, *args, init_params=warm.chain_init(...))``
        is the Bayesian deep ensemble: chain ``k`` starts at mode ``k`` with the mass of its own
        Adam run, so no warm-up is needed.

        :param statistic: ``None`` (the kernel's own preconditioner, e.g. identity mass), or
            ``"gradient"``, ``"first_moment"``, ``"second_moment"``
            (:func:`~numpyro_sgmc.mass_from_warm_start`).
        :param str granularity: ``"layer"`` or ``"parameter"``.
        :return: a :class:`~numpyro_sgmc.ChainInit`.
        """
        if statistic is None:
            return ChainInit(params=self.params)
        return ChainInit(
            params=self.params,
            preconditioner=mass_from_warm_start(self, statistic, granularity),
        )

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
            lines.append(
                f"  restart {k}: final loss {last[k]:.6g}, |full-data gradient| {norms[k]:.3g}, "
                + (
                    "convergence not checked"
                    if self.converged is None
                    else f"{self.gradient_distance[k]:.2g} posterior sd from the mode"
                    + ("" if self.converged[k] else "  NOT CONVERGED")
                )
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


def warm_start(
    model: Callable,
    *model_args,
    rng_key=None,
    num_epochs: float = 5,
    batch_size=None,
    num_restarts: int = 1,
    learning_rate: float = 0.05,
    optimizer: Optional[optax.GradientTransformation] = None,
    init_params: Optional[dict] = None,
    init_strategy=init_to_uniform,
    tol: Optional[float] = None,
    check: bool = True,
    num_check_rows: int = 2048,
    chunk_size: int = 65536,
    **model_kwargs,
) -> WarmStart:
    """Run ``num_restarts`` optimizers to the mode of ``model``, vectorised, and check them.

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param model_args: the model's positional arguments (the data).
    :param rng_key: PRNG key (default ``PRNGKey(0)``): initial values and batches.
    :param num_epochs: passes over the data (iterations: ``ceil(num_epochs · n / b)``, with
        ``b`` the total batch size over the plates).
    :param batch_size: overrides the plates' ``subsample_size`` (int or ``{plate: int}``).
    :param num_restarts: ``K`` independent runs from different initial values.
    :param learning_rate: Adam's learning rate: constant for the first fifth of the
        iterations, then Adam starts afresh (new moments) and the rate decays by a cosine
        schedule to 1/1000 of it at the last iteration (ignored when ``optimizer`` is given).
    :param optimizer: any optax transformation to use instead (its Adam moments are kept if
        it contains ``scale_by_adam``).
    :param init_params: unconstrained initial values, site -> array with a leading ``K`` axis
        (or without, to start every restart there); default: ``init_strategy`` per restart.
    :param tol: the largest ``gradient_distance`` (in posterior sds) counted as converged;
        default ``max(3, 2√d)`` for ``d`` parameters (a random offset of one posterior sd per
        coordinate is ``√d`` sds long).
    :param check: estimate ``J`` on ``num_check_rows`` rows per restart to measure how far
        each mode is from a zero of the gradient (``gradient_distance``), and warn if it is
        farther than ``tol``. For networks this is most of the cost; :func:`~numpyro_sgmc.
        autotune` skips it because it estimates ``J`` and takes a Newton step itself.
    :param num_check_rows: rows used to estimate the per-datum gradient scale of the check.
    :param chunk_size: rows per chunk of the full-data gradient pass.
    :param model_kwargs: the model's keyword arguments.
    :return: a :class:`WarmStart`.
    """
    if not isinstance(num_restarts, (int, np.integer)) or num_restarts < 1:
        raise ValueError(f"num_restarts must be a positive int, got {num_restarts!r}.")
    if not num_epochs > 0:
        raise ValueError(f"num_epochs must be positive, got {num_epochs!r}.")
    rng_key = random.PRNGKey(0) if rng_key is None else rng_key
    key_init, key_run, key_check = random.split(rng_key, 3)
    init_keys = random.split(key_init, num_restarts)
    prepared = initialize(
        init_keys,
        model,
        model_args,
        model_kwargs,
        batch_size=batch_size,
        init_strategy=init_strategy,
    )
    plates, n = prepared.plates, num_data(prepared.plates)
    b = sum(p.batch_size for p in plates.values())
    num_iterations = max(1, math.ceil(num_epochs * n / b))
    z0 = (
        prepared.init_params
        if init_params is None
        else _restart_axis(init_params, prepared.init_params, num_restarts)
    )
    if optimizer is None:
        # Adam restarted after a first fifth at constant rate: its second moment remembers
        # the huge gradients of a poor starting point for ~1/(1-b2) = 1000 steps, which
        # would stall a short run; the second phase decays the rate to lr/1000 (cosine)
        first = num_iterations // 5
        rest = num_iterations - first
        phases = [
            (optax.adam(learning_rate), first),
            (optax.adam(optax.cosine_decay_schedule(learning_rate, rest, alpha=1e-3)), rest),
        ][0 if first else 1 :]
    else:
        phases = [(optimizer, num_iterations)]
    sampler = batch_sampler(plates, "epochs")
    potential_fn = prepared.potential_fn

    def loss_fn(z, batch, args, kwargs):
        return potential_fn(z, batch, args, kwargs) / n

    tail = max(1, num_iterations // 10)

    def run_one(z, key, data):
        args, kwargs = rebuild(data)
        key_batches, key_steps = random.split(key)
        batch_state, all_losses, offset = sampler.init(key_batches), [], 0
        average = jax.tree.map(jnp.zeros_like, z)
        last_grad = jax.tree.map(jnp.zeros_like, z)
        for phase, (opt, steps) in enumerate(phases):

            def step(carry, xs, opt=opt):
                z, opt_state, batch_state, average, _ = carry
                k, t = xs
                batch, batch_state = sampler.draw(batch_state, k)
                loss, grad = jax.value_and_grad(loss_fn)(z, batch, args, kwargs)
                updates, opt_state = opt.update(grad, opt_state, z)
                z = optax.apply_updates(z, updates)
                # running mean of the last `tail` iterates (zero weight before them)
                weight = jnp.where(
                    t >= num_iterations - tail, 1.0 / (t - num_iterations + tail + 1), 0.0
                )
                average = jax.tree.map(lambda a, x: a + weight * (x - a), average, z)
                return (z, opt_state, batch_state, average, grad), loss

            keys = random.split(random.fold_in(key_steps, phase), steps)
            xs = (keys, offset + jnp.arange(steps))
            (z, opt_state, batch_state, average, last_grad), losses = lax.scan(
                step, (z, opt.init(z), batch_state, average, last_grad), xs
            )
            all_losses.append(losses)
            offset += steps
        gradient = full_data_gradient(potential_fn, plates, average, args, kwargs, chunk_size)
        mu, nu = _adam_moments(opt_state)
        return average, gradient, last_grad, mu, nu, jnp.concatenate(all_losses)

    # the data enter as arguments: closed over, they would be compiled in as constants
    # (compile time and memory growing with n)
    data, rebuild = split_args(model_args, model_kwargs)
    z, gradient, last_grad, mu, nu, losses = jax.jit(jax.vmap(run_one, (0, 0, None)))(
        z0, random.split(key_run, num_restarts), data
    )
    losses = np.asarray(losses)
    finite = np.isfinite(losses[:, -1])
    for leaf in jax.tree.leaves(z):
        finite &= np.all(np.isfinite(np.reshape(np.asarray(leaf), (num_restarts, -1))), axis=1)
    if not np.all(finite):
        raise FloatingPointError(
            f"The optimizer diverged (non-finite loss or parameters) in restart(s) "
            f"{np.flatnonzero(~finite).tolist()}: lower learning_rate (now {learning_rate})."
        )
    distance = np.full(num_restarts, np.nan)
    if check:
        distance = np.array(
            [
                _gradient_distance(
                    model,
                    model_args,
                    model_kwargs,
                    _restart(z, k),
                    _restart(gradient, k),
                    n,
                    num_check_rows,
                    random.fold_in(key_check, k),
                )
                for k in range(num_restarts)
            ]
        )
    if tol is None:
        tol = max(3.0, 2.0 * math.sqrt(sum(np.size(v[0]) for v in jax.tree.leaves(z))))
    converged = distance <= tol if check else None
    constrain = prepared.postprocess_fn(model_args, model_kwargs)
    result = WarmStart(
        params=z,
        constrained=jax.vmap(constrain)(z),
        gradient=gradient,
        first_moment=mu,
        second_moment=nu,
        loss=losses,
        gradient_distance=distance,
        converged=converged,
        num_data=n,
        num_epochs=num_iterations * b / n,
        plates=plates,
        final_gradient=last_grad,
    )
    if check and not np.all(converged):
        warnings.warn(
            f"The warm start has not converged in restart(s) {np.flatnonzero(~converged).tolist()}:"
            f" after {result.num_epochs:g} epochs the full-data gradient puts the mode "
            f"{', '.join(f'{x:.3g}' for x in distance[~converged])} posterior standard "
            f"deviations (tol={tol:.3g}) from a zero of the gradient. Run more epochs "
            f"(num_epochs={num_epochs}) or use a larger learning_rate (now {learning_rate}).\n"
            + str(result),
            ConvergenceWarning,
            stacklevel=user_stacklevel(),
        )
    return result


def _restart(tree, k):
    return jax.tree.map(lambda v: v[k], tree)


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


def _gradient_distance(model, args, kwargs, z, gradient, n, rows, key):
    """``sqrt(n gᵀJ⁻¹g)`` (see the module docstring); ``J`` made positive definite if needed."""
    flat = [np.ravel(np.asarray(gradient[name])) for name, *_ in flat_layout(z)]
    g = np.concatenate(flat).astype(np.float64)
    info = information(
        model,
        *args,
        params=z,
        rng_key=key,
        num_rows=min(rows, n),
        kind="dense" if g.size <= _DENSE_MAX_DIM else "diagonal",
        regularize="auto",
        **kwargs,
    )
    J = info.potential_curvature
    step = g / J if J.ndim == 1 else np.linalg.solve(J, g)
    return float(np.sqrt(max(n * float(g @ step), 0.0)))
