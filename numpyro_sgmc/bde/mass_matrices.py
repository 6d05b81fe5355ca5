"""Optimizer-informed static mass matrices for SGHMC (``docs/theory.md`` §6).

After an Adam run (:func:`~numpyro_sgmc.warm_start`) each parameter ``i`` has three
statistics for free: the last minibatch gradient ``|g_i|``, Adam's first moment ``|μ_i|``
and its second moment ``sqrt(ν_i)`` (Adam's denominator). One of them, ``m_i``, becomes a
diagonal mass matrix:

* **layer-wise** (the default): average inside each parameter group ``ℓ`` (a NumPyro sample
  site, which is a leaf of the parameter dict), ``m^(ℓ) = mean_{i∈ℓ} m_i``, normalise by the
  smallest group, ``m̄^(ℓ) = m^(ℓ) / min_ℓ' m^(ℓ')``, and give every parameter of ``ℓ`` the
  mass ``m̄^(ℓ)``;
* **parameter-wise**: ``m̄_i = m_i / min_j m_j`` (known to be less stable: a parameter whose
  statistic is nearly zero sets the scale of all the others; the ratio is capped at ``10⁶``).

Either way every mass is at least 1, so every effective step ``η/m̄`` is at most ``η``.
Each ensemble member gets its own mass, from its own Adam run, which keeps the members'
geometric information distinct (optimizer-informed preconditioning of SGHMC in Bayesian deep
ensembles). :func:`chain_init` starts one chain per member at its mode with its own mass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_sgmc.kernels.shell import ChainInit
from numpyro_sgmc.scales import Diagonal

__all__ = [
    "GRANULARITIES",
    "STATISTICS",
    "adam_statistic",
    "chain_init",
    "layerwise_mass",
    "mass_from_warm_start",
    "pairwise_cosine_similarity",
    "parameterwise_mass",
]

STATISTICS = ("gradient", "first_moment", "second_moment")
GRANULARITIES = ("layer", "parameter")


def adam_statistic(warm, statistic: str) -> dict:
    """Per-parameter statistic ``m_i`` of every member: site -> ``(K, ...)`` array.

    :param warm: a :class:`~numpyro_sgmc.tuner.warmstart.WarmStart` (its optimizer must be Adam-like
        for the moments).
    :param str statistic: ``"gradient"`` (``|g|``, the last minibatch gradient),
        ``"first_moment"`` (``|μ|``) or ``"second_moment"`` (``sqrt(ν)``).
    """
    if statistic not in STATISTICS:
        raise ValueError(f"Unknown statistic {statistic!r}; choose one of {', '.join(STATISTICS)}.")
    source = {
        "gradient": warm.final_gradient,
        "first_moment": warm.first_moment,
        "second_moment": warm.second_moment,
    }[statistic]
    if source is None:
        raise ValueError(
            f"The warm start has no {statistic!r}: its optimizer kept no Adam state (use the "
            "default optimizer, or one built with optax.scale_by_adam)."
        )
    transform = jnp.sqrt if statistic == "second_moment" else jnp.abs
    return {k: transform(jnp.asarray(v)) for k, v in source.items()}


def _check_statistic(values: dict):
    for name, v in values.items():
        if not bool(jnp.all(jnp.isfinite(v))):
            raise ValueError(
                f"The statistic of site '{name}' is not finite: did the optimizer diverge?"
            )
        if bool(jnp.any(v < 0)):
            raise ValueError(f"The statistic of site '{name}' is negative; it must be >= 0.")


def layerwise_mass(values: dict) -> Diagonal:
    """``m̄^(ℓ) = mean_{i∈ℓ} m_i / min_ℓ' mean_{i∈ℓ'} m_i``, one scalar per site.

    :param dict values: site -> non-negative array (one member, no leading axis).
    :return: a :func:`~numpyro_sgmc.layerwise` :class:`~numpyro_sgmc.Diagonal`.
    :raises ValueError: a non-finite or negative value, or a site whose mean is zero.
    """
    _check_statistic(values)
    means = {k: jnp.mean(v) for k, v in values.items()}
    zero = [k for k, m in means.items() if not bool(m > 0)]
    if zero:
        raise ValueError(
            f"The statistic is zero on every parameter of site(s) {zero}: no layer-wise scale "
            "can be formed. Use another statistic (e.g. 'second_moment')."
        )
    smallest = min(means.values())
    return Diagonal({k: m / smallest for k, m in means.items()})


def parameterwise_mass(values: dict, max_ratio: float = 1e6) -> Diagonal:
    """``m̄_i = m_i / min_j m_j`` per entry.

    Entries below ``max(m)/max_ratio`` are raised to it, which caps the masses at
    ``max_ratio``: a statistic that is (nearly) zero somewhere would otherwise give infinite
    masses everywhere else.

    :param dict values: site -> non-negative array (one member, no leading axis).
    :param float max_ratio: the largest mass (default ``10⁶``).
    """
    _check_statistic(values)
    largest = max(jnp.max(v) for v in values.values())
    if not bool(largest > 0):
        raise ValueError("The statistic is zero everywhere: no parameter-wise scale can be formed.")
    floor = largest / max_ratio
    floored = {k: jnp.maximum(v, floor) for k, v in values.items()}
    smallest = min(jnp.min(v) for v in floored.values())
    return Diagonal({k: v / smallest for k, v in floored.items()})


def mass_from_warm_start(warm, statistic: str = "first_moment", granularity: str = "layer"):
    """One §6 mass matrix per warm-start member, stacked for ``ChainInit(preconditioner=...)``.

    :param warm: a :class:`~numpyro_sgmc.tuner.warmstart.WarmStart` with ``K`` members.
    :param str statistic: ``"gradient"``, ``"first_moment"`` (default) or ``"second_moment"``.
    :param str granularity: ``"layer"`` (default; mean per site, min-normalised) or
        ``"parameter"``.
    :return: a :class:`~numpyro_sgmc.Diagonal` whose values carry a leading member axis
        (``(K,)`` per site for ``"layer"``, ``(K, *site_shape)`` for ``"parameter"``); member
        ``k``'s chain uses slice ``k``.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"Unknown granularity {granularity!r}; choose one of {', '.join(GRANULARITIES)}."
        )
    values = adam_statistic(warm, statistic)
    build = layerwise_mass if granularity == "layer" else parameterwise_mass
    members = [build(jax.tree.map(lambda v, k=k: v[k], values)) for k in range(warm.num_restarts)]
    return Diagonal(jax.tree.map(lambda *xs: jnp.stack(xs), *[m.values for m in members]))


def chain_init(warm, statistic=None, granularity: str = "layer") -> ChainInit:
    """Start one chain per warm-start member at its mode, with its own §6 mass matrix.

    ``MCMC(SGHMC(...), num_chains=K).run(key, *args, init_params=chain_init(warm, ...))`` is the
    Bayesian deep ensemble: chain ``k`` starts at mode ``k`` with the mass of its own Adam run,
    so no warm-up is needed.

    :param warm: a :class:`~numpyro_sgmc.tuner.warmstart.WarmStart` with ``K`` members.
    :param statistic: ``None`` (the kernel's own mass, e.g. the identity), ``"gradient"``,
        ``"first_moment"`` or ``"second_moment"`` (:func:`mass_from_warm_start`).
    :param str granularity: ``"layer"`` or ``"parameter"``.
    """
    if statistic is None:
        return ChainInit(params=warm.params)
    return ChainInit(
        params=warm.params, preconditioner=mass_from_warm_start(warm, statistic, granularity)
    )


def pairwise_cosine_similarity(masses) -> np.ndarray:
    """``(K, K)`` cosine similarities between the chains' diagonal masses.

    :param masses: a :class:`~numpyro_sgmc.Diagonal` whose values have a leading chain axis
        (``mcmc.last_state.params.mass`` of a vectorised run, flat ``(K, d)``, or
        :func:`mass_from_warm_start`'s per-site result), or a ``(K, d)`` array. Layer-wise
        masses compare one value per site.
    """
    # A Diagonal is a pytree whose one child is its values: unwrap it without asking its type
    found = jax.tree.leaves(masses, is_leaf=lambda x: isinstance(x, dict))
    if len(found) != 1:
        raise ValueError(
            "masses must be a Diagonal or a (K, d) array, got a value with "
            f"{len(found)} arrays ({type(masses).__name__})."
        )
    (values,) = found
    if isinstance(values, dict):
        leaves = [np.asarray(values[k], np.float64) for k in sorted(values)]
        K = leaves[0].shape[0]
        flat = np.concatenate([v.reshape(K, -1) for v in leaves], axis=1)
    else:
        flat = np.asarray(values, np.float64)
        if flat.ndim != 2:
            raise ValueError(
                f"masses must be a Diagonal or a (K, d) array, got shape {flat.shape}."
            )
    unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    return unit @ unit.T
