"""Kernel families as data: what :class:`~numpyro_sgmc.kernels.shell.SGMCKernel` needs of a
kind of kernel, as a record of pure functions (blackjax's pattern of small functional steps).

A :class:`Family` (``LANGEVIN_FAMILY`` of :mod:`~numpyro_sgmc.kernels.sgld`, ``SGHMC_FAMILY`` of
:mod:`~numpyro_sgmc.kernels.sghmc`) takes the family's *dynamics*, a NamedTuple of the
constructor's checked arguments with at least the fields ``step_size`` (a number or
:class:`~numpyro_sgmc.kernels.auto_step.Auto`) and ``control_variates`` (bool), and says

* ``make_config(dynamics, options, prepared, shards, num_warmup_steps)``: the hashable static
  configuration that keys the compiled code;
* ``build(config)``: the pure ``(init, step)`` pair,
  :class:`~numpyro_sgmc.kernels.core.Kernel`;
* ``chain_params(dynamics, prepared, position, chain_init, where, step_size)``: one chain's
  parameters (in the state, so that every chain has its own);
* ``stability_bound(dynamics)`` and ``step_scale(dynamics, position, chain_init, where)``:
  ``B`` and the ``P`` of ``h·λmax(PJ) < B`` (``step_size="auto"``, ``docs/theory.md`` §3, §5);
* ``check_step(dynamics, prepared, position, params, rng_key, model_args, model_kwargs)``: the
  ``StepCheck`` (``numpyro_sgmc.kernels.checks``) of a hand-set step, or ``None``;
* ``adapts_mass(dynamics)``: whether warm-up changes the mass (the step check then predicts
  nothing of the kept draws' law).

A :class:`Recipe` is a whole kernel as data: its family, dynamics, the :class:`KernelOptions`
every kernel takes and, from :func:`~numpyro_sgmc.autotune`, its :class:`Tuned` law.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np
from jax import random
from numpyro.distributions.transforms import IdentityTransform, IndependentTransform
from numpyro.infer.initialization import init_to_uniform

from numpyro_sgmc import host
from numpyro_sgmc.data import sharding
from numpyro_sgmc.data.batches import BATCH_SAMPLING
from numpyro_sgmc.data.gradients import (
    Centre,
    control_variates,
    full_data_gradient,
    minibatch,
)
from numpyro_sgmc.data.model import constrain, data_version
from numpyro_sgmc.kernels.core import tree_all_finite

__all__ = [
    "ChainInit",
    "Family",
    "KernelOptions",
    "Recipe",
    "Tuned",
    "chain_keys",
    "check_positive",
    "check_step_size",
    "common_config",
    "estimator_and_check",
    "estimator_for",
    "needs_support_check",
    "predicted_draw",
    "valid_constrained",
]


class Family(NamedTuple):
    """A kind of kernel as a record of pure functions (module docstring)."""

    name: str
    make_config: Callable
    build: Callable
    chain_params: Callable
    stability_bound: Callable
    step_scale: Callable
    check_step: Callable
    adapts_mass: Callable


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


class KernelOptions(NamedTuple):
    """The keyword arguments every kernel takes (see :class:`~numpyro_sgmc.SGLD`)."""

    batch_size: Any = None
    batch_sampling: str = "with_replacement"
    num_steps: int = 100
    init_strategy: Callable = init_to_uniform
    chunk_size: int = 65536
    progress_draws: Optional[int] = None

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
        if self.progress_draws is not None:
            _check_count("progress_draws", self.progress_draws, "None or a positive int")
        return self._replace(num_steps=int(self.num_steps), chunk_size=int(self.chunk_size))


class Tuned(NamedTuple):
    """What :func:`~numpyro_sgmc.autotune` tuned a kernel for: the data's plates, the mode and
    the predicted law of the unconstrained parameters (flat ``mean``, a scale ``covariance``;
    ``layout`` unravels them).

    :param exact: ``(x, ĝ)``: a point within the tuner's tolerance of the mode (0.05 posterior
        sds) and the full-data gradient ``ĝ = -∇U(x)/n`` its last pass computed (flat), or
        ``None``.
    :param data: the :func:`~numpyro_sgmc.data.model.data_version` of the data it was
        tuned on, or ``None``: on the same data ``(x, ĝ)`` is the control-variate centre, and
        the run needs no full-data pass of its own.
    """

    plates: tuple
    layout: Any
    mean: Any
    covariance: Any
    exact: Optional[tuple] = None
    data: Optional[tuple] = None

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

    def start(self, num_chains: Optional[int]) -> dict:
        """The mode, unconstrained, on the host: a starting point whose potential the tuner
        found finite (``num_chains``: stacked along a leading chain axis)."""
        return self._per_chain(self.mean, num_chains)

    def _per_chain(self, flat, num_chains: Optional[int]) -> dict:
        """A flat vector in the mean's dtype, unraveled, broadcast along a leading chain axis
        of ``num_chains`` (none when ``None``)."""
        flat = np.asarray(flat, np.asarray(self.mean).dtype)
        if num_chains is not None:
            flat = np.broadcast_to(flat, (num_chains,) + flat.shape)
        return self.layout.unravel(flat)

    def law(self) -> tuple:
        """``(mean, root)`` of the predicted law on the device, ``root`` the covariance's
        square root: the arguments of ``predicted_draw`` (drawn inside the program that
        starts the chains)."""
        mean = host.device_array(self.mean)
        root = jax.tree.map(lambda a: host.device_array(a, mean.dtype), self.covariance.sqrt())
        return mean, root

    def centre(self, num_chains: Optional[int], model_args, model_kwargs):
        """The control-variate centre of every chain: on the data it was tuned on (the same
        :func:`~numpyro_sgmc.data.model.data_version`), the
        :class:`~numpyro_sgmc.data.gradients.Centre` ``(x, ĝ)`` of :attr:`exact`; otherwise
        the mode, whose gradient the kernel's ``init`` computes."""
        same = self.data is not None and self.data == data_version(model_args, model_kwargs)
        if self.exact is None or not same:
            return self.start(num_chains)
        x, gradient = self.exact
        return Centre(self._per_chain(x, num_chains), self._per_chain(gradient, num_chains))


def chain_keys(rng_key) -> tuple:
    """A chain's key split in three by JAX: the keys of its run, its start and its checks
    (the same keys whether the chain runs alone, vectorised or in a ``pmap``)."""
    keys = random.split(rng_key, 3)
    return keys[0], keys[1], keys[2]


def predicted_draw(layout, law: tuple, rng_key) -> dict:
    """``mean + root ξ``, ``ξ ~ N(0, I)`` from a chain key's second key (:func:`chain_keys`),
    unraveled: a chain's start drawn from the predicted law ``law = (mean, root)``
    (:meth:`Tuned.law`), the same whether the chain runs alone, vectorised or in a ``pmap``."""
    mean, root = law
    xi = random.normal(chain_keys(rng_key)[1], mean.shape, mean.dtype)
    return layout.unravel(mean + root.apply(xi))


class Recipe(NamedTuple):
    """A kernel as data: ``name`` (its class's), ``family``, ``dynamics``, ``options`` and
    ``tuned`` (``None`` unless :func:`~numpyro_sgmc.autotune` made it)."""

    name: str
    family: Family
    dynamics: Any
    options: KernelOptions
    tuned: Optional[Tuned] = None

    @classmethod
    def of(cls, name: str, family: Family, dynamics, options: tuple) -> "Recipe":
        """A recipe with ``options`` the constructor's :class:`KernelOptions` values in order,
        checked."""
        return cls(name, family, dynamics, KernelOptions(*options).check())


def common_config(dynamics, options: KernelOptions, prepared, shards) -> dict:
    """The fields every family's config has: the model's ``spec`` and ``layout``, the
    ``shards``, the options' ``batch_sampling`` and ``chunk_size``, the dynamics'
    ``control_variates``, whether to ``check_support`` (:func:`needs_support_check`) and the
    per-datum sites to ``exclude`` from it."""
    return dict(
        spec=prepared.spec,
        layout=prepared.layout,
        shards=shards,
        batch_sampling=options.batch_sampling,
        control_variates=dynamics.control_variates,
        chunk_size=options.chunk_size,
        check_support=needs_support_check(prepared),
        exclude=prepared.per_datum_sites,
    )


def estimator_and_check(config) -> tuple:
    """A config's gradient estimator (:func:`estimator_for`) and its extra acceptance check
    (:func:`valid_constrained`, or ``None`` when ``config.check_support`` is off)."""
    estimator = estimator_for(
        config.spec,
        config.shards,
        config.batch_sampling,
        config.control_variates,
        config.chunk_size,
        config.fed_rows,
    )
    valid = valid_constrained(config.spec, config.exclude) if config.check_support else None
    return estimator, valid


def estimator_for(
    spec, shards, batch_sampling: str, control: bool, chunk_size: int, fed_rows: bool = False
):
    """The gradient estimator of a kernel: minibatch, data-parallel over ``shards`` when the
    data are sharded, on rows given with each step when ``fed_rows``
    (``minibatch(..., fed_rows=True)``), wrapped in control variates when
    ``control``."""
    if shards is None:
        base = minibatch(spec, batch_sampling, fed_rows)
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


def needs_support_check(prepared) -> bool:
    """Whether a finite unconstrained position can map to a non-finite constrained value:
    a constraining transform, or a deterministic site (``exp`` of a finite position can
    overflow there too)."""

    def identity(t):
        while isinstance(t, IndependentTransform):
            t = t.base_transform
        return isinstance(t, IdentityTransform)

    deterministic = prepared.deterministic_sites - prepared.per_datum_sites
    return bool(deterministic) or not all(identity(t) for t in prepared.transforms.values())


def _check_count(name, value, what="a positive int"):
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name} must be {what}, got {value!r}.")


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


def check_positive(name: str, value) -> Optional[float]:
    """``None``, or ``value`` as a positive float (``inverse_temperature``)."""
    if value is None:
        return None
    if not float(value) > 0:
        raise ValueError(f"{name} must be positive, got {value!r}.")
    return float(value)
