"""Static preconditioners over the unconstrained parameters: identity, diagonal, layer-wise, dense.

In the meta-algorithm (``shared/design/theory.md`` §2)

.. math::

    \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
              + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d),

``Γ`` (drift) and ``Λ`` (noise) are symmetric positive definite matrices fixed for the run.
A preconditioner here is a small pytree (a ``NamedTuple``), so per-chain values can live in
the kernel state and be ``vmap``-ed:

* :class:`Identity`: ``Γ = I``.
* :class:`Diagonal`: ``Γ = diag(scale)``; ``scale`` is a dict over the unconstrained sample
  sites, each value an array of the site's shape or a scalar. All-scalar values are the
  layer-wise (per-site) preconditioner, see :func:`layerwise`.
* :class:`Dense`: a full ``d × d`` matrix over the flattened parameters, applied as a
  matrix-vector product; its square root for the noise is the Cholesky factor ``L``
  (``L Lᵀ = Λ``; any square root gives the same noise law). The flattening order is that of
  :func:`jax.flatten_util.ravel_pytree` on the dict of unconstrained sites: sites sorted by
  name, each raveled row-major; :func:`flat_layout` lists it.

:func:`prepare` validates a preconditioner against the parameters and precomputes what the
step needs (the Cholesky factor), once, at ``init``; :func:`apply` and :func:`apply_sqrt` are
the per-step products; :func:`apply_inverse` is ``M⁻¹ v`` for a preconditioner used as SGHMC's
mass matrix ``M`` (``shared/design/theory.md`` §5).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import jax.scipy.linalg
import numpy as np
from jax.flatten_util import ravel_pytree
from numpyro.util import not_jax_tracer

__all__ = [
    "Dense",
    "Diagonal",
    "Identity",
    "apply",
    "apply_inverse",
    "apply_sqrt",
    "check_scales",
    "diagonal",
    "flat_layout",
    "layerwise",
    "prepare",
]


class Identity(NamedTuple):
    """``Γ = I``: no preconditioning."""


class Diagonal(NamedTuple):
    """``Γ = diag(scale)``.

    :param dict scale: unconstrained site name -> positive array of the site's (unconstrained)
        shape, or a positive scalar used for every entry of that site.
    """

    scale: dict


class Dense(NamedTuple):
    """A dense SPD matrix over the flattened unconstrained parameters.

    :param matrix: ``(d, d)`` symmetric positive definite array, in the order of
        :func:`flat_layout`.
    :param cholesky: lower Cholesky factor of ``matrix``; leave it ``None``, :func:`prepare`
        computes it once.
    """

    matrix: Any
    cholesky: Optional[Any] = None


def layerwise(scales: dict) -> Diagonal:
    """Layer-wise preconditioner: one positive scalar per sample site (``Γ = diag`` of it).

    :param dict scales: site name -> positive scalar.
    """
    for name, value in scales.items():
        if jnp.ndim(value) != 0:
            raise ValueError(
                f"layerwise scales are one scalar per site; site '{name}' got shape "
                f"{jnp.shape(value)}. Use Diagonal for per-entry scales."
            )
    return Diagonal(dict(scales))


def flat_layout(params: dict) -> list:
    """The order of :class:`Dense` rows: ``[(site, start, stop, shape), ...]``.

    ``params`` is a dict of unconstrained values (e.g. ``mcmc.last_state.z`` of one chain).
    """
    layout, start = [], 0
    for name in sorted(params):
        shape = jnp.shape(params[name])
        size = int(np.prod(shape))
        layout.append((name, start, start + size, shape))
        start += size
    return layout


def _as_preconditioner(spec, role: str):
    if spec is None:
        return Identity()
    if isinstance(spec, (Identity, Diagonal, Dense)):
        return spec
    raise TypeError(
        f"{role} must be None, numpyro_sgmc.Identity(), Diagonal(...), layerwise(...) or "
        f"Dense(...); got {type(spec).__name__}. For a dict of per-site scales use "
        "Diagonal(scales); for a (d, d) matrix use Dense(matrix)."
    )


def prepare(spec, position: dict, role: str = "preconditioner"):
    """Validate ``spec`` against ``position`` (one chain's unconstrained values) and precompute.

    Shapes are checked always; values (positivity, symmetry, positive definiteness) whenever
    they are concrete. Returns the preconditioner the step uses (:class:`Dense` with its
    Cholesky factor filled in).

    :raises ValueError: unknown or missing sites, wrong shapes, a non-positive scale, or a
        dense matrix that is not symmetric positive definite.
    """
    spec = _as_preconditioner(spec, role)
    if isinstance(spec, Identity):
        return spec
    if isinstance(spec, Diagonal):
        if not isinstance(spec.scale, dict):
            raise TypeError(f"{role}: Diagonal.scale must be a dict keyed by site name.")
        out = check_scales(spec.scale, position, role)
        return Diagonal(out)
    d = ravel_pytree(position)[0].shape[0]
    matrix = jnp.asarray(spec.matrix, dtype=ravel_pytree(position)[0].dtype)
    if matrix.shape != (d, d):
        raise ValueError(
            f"{role}: Dense matrix has shape {matrix.shape}, but the model has d = {d} "
            f"unconstrained parameters (layout: {flat_layout(position)})."
        )
    cholesky = jnp.linalg.cholesky(matrix)
    if not_jax_tracer(matrix):
        m = np.asarray(matrix, dtype=np.float64)
        if not np.allclose(m, m.T, rtol=1e-5, atol=1e-6 * np.abs(m).max()):
            raise ValueError(f"{role}: Dense matrix is not symmetric.")
        if not np.all(np.isfinite(np.asarray(cholesky))):
            raise ValueError(
                f"{role}: Dense matrix is not positive definite (its Cholesky factorisation "
                "failed). If it is an inverse information estimate, regularise it, e.g. add "
                "a small multiple of the identity."
            )
    return Dense(matrix, cholesky)


def check_scales(scale: dict, position: dict, role: str, allow_zero: bool = False) -> dict:
    """Validate per-site diagonal values against ``position``; return them as arrays.

    Every latent site must be covered, each value must broadcast to its site's unconstrained
    shape and (when concrete) be finite and positive, or non-negative with ``allow_zero``.
    """
    unknown, missing = set(scale) - set(position), set(position) - set(scale)
    if unknown or missing:
        raise ValueError(
            f"{role}: Diagonal scales must cover exactly the latent sites "
            f"{sorted(position)}; unknown: {sorted(unknown)}, missing: {sorted(missing)}."
        )
    out = {}
    for name, value in scale.items():
        value = jnp.asarray(value, dtype=jnp.result_type(position[name]))
        try:
            jnp.broadcast_shapes(jnp.shape(value), jnp.shape(position[name]))
        except ValueError:
            raise ValueError(
                f"{role}: scale for site '{name}' has shape {jnp.shape(value)}, which does "
                f"not broadcast to the site's unconstrained shape {jnp.shape(position[name])}."
            ) from None
        if not_jax_tracer(value):
            arr = np.asarray(value)
            if not (np.all(np.isfinite(arr)) and np.all(arr >= 0 if allow_zero else arr > 0)):
                sign = "non-negative" if allow_zero else "positive"
                raise ValueError(
                    f"{role}: scale for site '{name}' must be {sign} and finite everywhere."
                )
        out[name] = value
    return out


def diagonal(precond, position: dict) -> dict:
    """The diagonal of an :class:`Identity` or :class:`Diagonal`, one array per site."""
    if isinstance(precond, Identity):
        return {k: jnp.ones_like(v) for k, v in position.items()}
    return {
        k: jnp.broadcast_to(precond.scale[k], jnp.shape(v)).astype(jnp.result_type(v))
        for k, v in position.items()
    }


def apply(precond, tree: dict) -> dict:
    """``Γ v`` for a pytree ``v`` shaped like the parameters."""
    if isinstance(precond, Identity):
        return tree
    if isinstance(precond, Diagonal):
        return {k: precond.scale[k] * v for k, v in tree.items()}
    flat, unravel = ravel_pytree(tree)
    return unravel(precond.matrix @ flat)


def apply_sqrt(precond, tree: dict) -> dict:
    """``Λ^{1/2} ξ``: ``sqrt(scale) ξ`` (diagonal) or ``L ξ`` with ``L Lᵀ = Λ`` (dense)."""
    if isinstance(precond, Identity):
        return tree
    if isinstance(precond, Diagonal):
        return {k: jnp.sqrt(precond.scale[k]) * v for k, v in tree.items()}
    flat, unravel = ravel_pytree(tree)
    return unravel(precond.cholesky @ flat)


def apply_inverse(precond, tree: dict) -> dict:
    """``M⁻¹ v``: ``v / scale`` (diagonal) or two triangular solves with ``L`` (dense)."""
    if isinstance(precond, Identity):
        return tree
    if isinstance(precond, Diagonal):
        return {k: v / precond.scale[k] for k, v in tree.items()}
    flat, unravel = ravel_pytree(tree)
    return unravel(jax.scipy.linalg.cho_solve((precond.cholesky, True), flat))
