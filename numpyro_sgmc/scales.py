"""One scale type for every matrix of the library: identity, diagonal or dense.

The same three classes carry the kernels' preconditioners and masses (``Γ``, ``Λ``, ``M``, the
friction ``C`` and gradient-noise ``B̂`` of SGHMC, as JAX arrays in the chain state) and the
information matrices of the predictions (``J``, ``I``, ``S``, as NumPy float64 arrays), so
that no code outside this module asks whether a matrix is dense or diagonal
(``docs/theory.md`` §2–§4):

* :class:`Identity`: the identity; no storage, no arithmetic in the sampling step.
* :class:`Diagonal`: ``diag(values)``, ``values`` a flat ``(d,)`` array; everything stays
  ``O(d)`` (products, inverses, square roots, Lyapunov solves are elementwise).
* :class:`Dense`: a ``(d, d)`` symmetric positive definite matrix (or, as the product of two
  scales, a general square matrix), with its lower Cholesky factor for square roots and
  solves.

A scale acts on the flattened unconstrained parameters: the sites sorted by name, each raveled
row-major (:class:`~numpyro_sgmc.data.model.Layout`). A user writes per-site values,
``Diagonal({"theta": array, "sigma": 2.0})`` or :func:`layerwise`; :func:`prepare` turns them
into the flat form against the model's parameters once, at ``init``, and checks them.

Arithmetic (``@``, ``+``, ``-``, scalar ``*``) combines two scales into the narrowest scale
that holds the result (diagonal with diagonal stays diagonal). Operations use NumPy when every
array is a NumPy array (the predictions, in float64) and ``jax.numpy`` otherwise.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from numpyro.util import not_jax_tracer

from numpyro_sgmc.host import device_array

__all__ = [
    "Dense",
    "Diagonal",
    "Identity",
    "as_scale",
    "check_type",
    "continuous_lyapunov",
    "discrete_lyapunov",
    "generalized_eigh",
    "layerwise",
    "prepare",
    "positive_definite",
    "relative_size",
    "scaled_spectrum",
]


def _xp(*arrays):
    """NumPy when every array is a NumPy array or a Python number, else ``jax.numpy``."""
    if all(isinstance(a, (np.ndarray, np.generic, float, int)) for a in arrays):
        return np
    return jnp


class _Scale:
    """Methods every scale has; see the module docstring."""

    __array_ufunc__ = None  # NumPy scalars and arrays defer to the scale's own operators

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.as_matrix(), dtype=dtype)

    def __rmul__(self, c):
        return self * c

    def __truediv__(self, c):
        return self * (1.0 / c)

    def __neg__(self):
        return self * -1.0

    def __sub__(self, other):
        return self + (-other)


@partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclass(frozen=True)
class Identity(_Scale):
    """The identity: ``Γ = I``."""

    def apply(self, v):
        return v

    def apply_sqrt(self, v):
        return v

    def solve(self, v):
        return v

    def diagonal(self, d: int):
        return np.ones(d)

    def as_matrix(self, d: int):
        return np.eye(d)

    def inverse(self):
        return self

    @property
    def T(self):
        return self

    def __matmul__(self, other):
        return other

    def __mul__(self, c):
        raise TypeError("Identity has no size: use as_scale(Identity(), d) before arithmetic.")

    def __add__(self, other):
        raise TypeError("Identity has no size: use as_scale(Identity(), d) before arithmetic.")


@partial(jax.tree_util.register_dataclass, data_fields=["values"], meta_fields=[])
@dataclass(frozen=True)
class Diagonal(_Scale):
    """``diag(values)``.

    :param values: a flat ``(d,)`` array in the parameters' flat order; or, before
        :func:`prepare`, a dict ``{site: array or scalar}`` over the unconstrained sites (an
        array of the site's shape, or one value for the whole site).
    """

    values: Any

    def apply(self, v):
        return self.values * v

    def apply_sqrt(self, v):
        return _xp(self.values).sqrt(self.values) * v

    def solve(self, v):
        return v / self.values

    def diagonal(self, d: Optional[int] = None):
        return self.values

    def as_matrix(self, d: Optional[int] = None):
        return _xp(self.values).diag(self.values)

    def inverse(self):
        return Diagonal(1.0 / self.values)

    def sqrt(self):
        return Diagonal(_xp(self.values).sqrt(self.values))

    @property
    def T(self):
        return self

    def eigenvalues(self):
        return self.values

    def __matmul__(self, other):
        if isinstance(other, Identity):
            return self
        if isinstance(other, Diagonal):
            return Diagonal(self.values * other.values)
        return Dense(self.values[:, None] * other.matrix)

    def __mul__(self, c):
        return Diagonal(c * self.values)

    def __add__(self, other):
        if isinstance(other, Diagonal):
            return Diagonal(self.values + other.values)
        return Dense(_xp(self.values).diag(self.values) + other.matrix)

    def __len__(self):
        return int(np.shape(self.values)[-1])


@partial(jax.tree_util.register_dataclass, data_fields=["matrix", "cholesky"], meta_fields=[])
@dataclass(frozen=True)
class Dense(_Scale):
    """A ``(d, d)`` matrix over the flattened unconstrained parameters.

    :param matrix: ``(d, d)``; symmetric positive definite when it is a preconditioner, a mass
        or an information matrix (products of scales need not be symmetric).
    :param cholesky: its lower Cholesky factor ``L`` (``L Lᵀ = matrix``); leave it ``None``:
        :func:`prepare` (and ``apply_sqrt``, ``solve``) compute it.
    """

    matrix: Any
    cholesky: Any = None

    def _factor(self):
        if self.cholesky is not None:
            return self.cholesky
        return _xp(self.matrix).linalg.cholesky(self.matrix)

    def apply(self, v):
        return self.matrix @ v

    def apply_sqrt(self, v):
        return self._factor() @ v

    def solve(self, v):
        if self.cholesky is None and _xp(self.matrix) is np:
            return np.linalg.solve(self.matrix, v)
        return jax.scipy.linalg.cho_solve((self._factor(), True), v)

    def diagonal(self, d: Optional[int] = None):
        return _xp(self.matrix).diagonal(self.matrix)

    def as_matrix(self, d: Optional[int] = None):
        return self.matrix

    def inverse(self):
        inv = _xp(self.matrix).linalg.inv(self.matrix)
        return Dense(0.5 * (inv + inv.T) if _is_symmetric(self.matrix) else inv)

    def sqrt(self):
        """The Cholesky factor ``L`` as a (lower-triangular) :class:`Dense`: ``L Lᵀ`` is this."""
        return Dense(self._factor())

    @property
    def T(self):
        return Dense(self.matrix.T)

    def eigenvalues(self):
        """Real parts of the eigenvalues (eigvalsh when the matrix is symmetric)."""
        if _is_symmetric(self.matrix):
            return np.linalg.eigvalsh(np.asarray(self.matrix, np.float64))
        return np.linalg.eigvals(np.asarray(self.matrix, np.float64)).real

    def __matmul__(self, other):
        if isinstance(other, Identity):
            return self
        if isinstance(other, Diagonal):
            return Dense(self.matrix * other.values[None, :])
        return Dense(self.matrix @ other.matrix)

    def __mul__(self, c):
        return Dense(c * self.matrix)

    def __add__(self, other):
        if isinstance(other, Diagonal):
            return Dense(self.matrix + _xp(other.values).diag(other.values))
        return Dense(self.matrix + other.matrix)

    def __len__(self):
        return int(np.shape(self.matrix)[-1])


def _is_symmetric(m) -> bool:
    if not isinstance(m, np.ndarray):
        return False
    return bool(np.allclose(m, m.T, rtol=1e-12, atol=1e-14 * (np.abs(m).max() + 1e-300)))


SCALES = (Identity, Diagonal, Dense)


def layerwise(values: dict) -> Diagonal:
    """One positive scalar per sample site: ``Diagonal({site: scalar})``.

    :param dict values: site name -> positive scalar.
    """
    for name, value in values.items():
        if np.ndim(value) != 0:
            raise ValueError(
                f"layerwise scales are one scalar per site; site '{name}' got shape "
                f"{np.shape(value)}. Use Diagonal for per-entry scales."
            )
    return Diagonal(dict(values))


def as_scale(x, d: Optional[int] = None):
    """A NumPy float64 scale: ``None`` or :class:`Identity` -> ``Diagonal(ones(d))``,
    a ``(d,)`` array -> :class:`Diagonal`, a ``(d, d)`` array -> :class:`Dense`; a
    :class:`Diagonal` or :class:`Dense` is converted to float64."""
    if x is None or isinstance(x, Identity):
        if d is None:
            raise ValueError("The identity needs a size d.")
        return Diagonal(np.ones(int(d)))
    if isinstance(x, Diagonal):
        return Diagonal(np.asarray(x.values, np.float64))
    if isinstance(x, Dense):
        return Dense(np.asarray(x.matrix, np.float64))
    arr = np.asarray(x, np.float64)
    if arr.ndim == 0 and d is not None:
        return Diagonal(np.full(int(d), float(arr)))
    if arr.ndim == 1:
        return Diagonal(arr)
    if arr.ndim == 2 and arr.shape[0] == arr.shape[1]:
        return Dense(arr)
    raise ValueError(f"A scale is a (d,) diagonal or a (d, d) matrix; got shape {arr.shape}.")


# ---- validation against the parameters -------------------------------------------------------


def check_type(spec, role: str):
    """``spec`` itself if it is ``None`` or a scale; else a ``TypeError`` naming ``role``."""
    if spec is None or isinstance(spec, SCALES):
        return spec
    raise TypeError(
        f"{role} must be None, numpyro_sgmc.Identity(), Diagonal(...), layerwise(...) or "
        f"Dense(...); got {type(spec).__name__}. For per-site scales use "
        "Diagonal({site: values}); for a (d, d) matrix use Dense(matrix)."
    )


def is_dense(scale) -> bool:
    """Whether ``scale`` is a :class:`Dense` matrix (for kernels that need a diagonal one)."""
    return isinstance(scale, Dense)


def is_sized(scale) -> bool:
    """Whether ``scale`` is a :class:`Diagonal` or :class:`Dense` (the identity has no size)."""
    return isinstance(scale, (Diagonal, Dense))


def factored(scale):
    """A prepared diagonal or dense scale ready for repeated ``apply_sqrt``: a diagonal clipped
    at 0 (the rounding of a difference such as SGHMC's ``C - B̂``), a dense one with its
    Cholesky factor formed once."""
    if isinstance(scale, Diagonal):
        return Diagonal(jnp.maximum(scale.values, 0.0))
    return Dense(scale.matrix, jnp.linalg.cholesky(scale.matrix))


def prepare(spec, position: dict, role: str = "preconditioner", allow_zero: bool = False):
    """``spec`` checked against ``position`` (one chain's unconstrained values), in flat form.

    Shapes are checked always; values (finite, positive, symmetric, positive definite) when
    they are concrete. A :class:`Diagonal` given per site becomes a flat ``(d,)`` array; a
    :class:`Dense` gets its Cholesky factor.

    :param spec: ``None`` (identity), :class:`Identity`, :class:`Diagonal` or :class:`Dense`.
    :param role: the argument's name, for the messages.
    :param allow_zero: accept zero diagonal entries (SGHMC's ``B̂``).
    :raises TypeError: an array or another object where a scale is expected.
    :raises ValueError: unknown or missing sites, wrong shapes, a non-finite or non-positive
        value, a dense matrix that is not symmetric positive definite.
    """
    if check_type(spec, role) is None:
        return Identity()
    if isinstance(spec, Identity):
        return spec
    leaves = jax.tree.leaves(position)  # d and the dtype, without raveling (an eager program)
    d = sum(int(np.prod(np.shape(v))) for v in leaves)
    dtype = jnp.result_type(*leaves) if leaves else jnp.result_type(float)
    if isinstance(spec, Diagonal):
        values = _flat_diagonal(spec.values, position, role)
        values = device_array(values, dtype)
        if not_jax_tracer(values):
            arr = np.asarray(values)
            ok = np.all(arr >= 0) if allow_zero else np.all(arr > 0)
            if not (np.all(np.isfinite(arr)) and ok):
                bad = _first_bad(arr, allow_zero)
                sign = "non-negative" if allow_zero else "positive"
                raise ValueError(
                    f"{role}: every diagonal value must be {sign} and finite; entry {bad} "
                    f"(of {d}, in flat order) is {arr[bad]}."
                )
        return Diagonal(values)
    matrix = device_array(spec.matrix, dtype)
    if matrix.shape != (d, d):
        raise ValueError(
            f"{role}: Dense matrix has shape {tuple(matrix.shape)}, but the model has d = {d} "
            f"unconstrained parameters (sites {sorted(position)}, sorted by name, raveled)."
        )
    if not_jax_tracer(matrix):
        m = np.asarray(matrix, np.float64)
        if not np.all(np.isfinite(m)):
            rows = np.unique(np.argwhere(~np.isfinite(m))[:, 0])
            raise ValueError(
                f"{role}: Dense matrix has non-finite entries (NaN or inf) in row(s) "
                f"{rows[:5].tolist()}: build it from finite values."
            )
        if not np.allclose(m, m.T, rtol=1e-5, atol=1e-6 * np.abs(m).max()):
            raise ValueError(f"{role}: Dense matrix is not symmetric.")
    if not_jax_tracer(matrix):  # on the host: no program compiled for it
        try:
            cholesky = device_array(np.linalg.cholesky(np.asarray(matrix)))
        except np.linalg.LinAlgError:
            cholesky = np.full((d, d), np.nan)
    else:
        cholesky = jnp.linalg.cholesky(matrix)
    if not_jax_tracer(cholesky) and not np.all(np.isfinite(np.asarray(cholesky))):
        low = float(np.linalg.eigvalsh(np.asarray(matrix, np.float64))[0])
        raise ValueError(
            f"{role}: Dense matrix is not positive definite (smallest eigenvalue {low:.3g}). "
            "If it is an inverse information estimate, regularise it, e.g. add a small "
            "multiple of the identity."
        )
    return Dense(matrix, cholesky)


def _first_bad(arr, allow_zero) -> int:
    ok = np.isfinite(arr) & ((arr >= 0) if allow_zero else (arr > 0))
    return int(np.flatnonzero(~ok)[0])


def _flat_diagonal(values, position: dict, role: str):
    """Per-site diagonal values (dict) or a flat array -> the flat ``(d,)`` array."""
    d = sum(int(np.prod(np.shape(v))) for v in position.values())
    # concrete values are put together on the host (each eager op would compile)
    xp = jnp if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(values)) else np
    if not isinstance(values, dict):
        arr = xp.asarray(values)
        if arr.shape != (d,):
            raise ValueError(
                f"{role}: a flat Diagonal has shape {tuple(arr.shape)}; the model has d = {d} "
                f"unconstrained parameters. Give per-site values as Diagonal({{site: ...}})."
            )
        return arr
    unknown, missing = set(values) - set(position), set(position) - set(values)
    if unknown or missing:
        raise ValueError(
            f"{role}: Diagonal scales must cover exactly the latent sites "
            f"{sorted(position)}; unknown: {sorted(unknown)}, missing: {sorted(missing)}."
        )
    parts = []
    for name in sorted(position):
        shape = jnp.shape(position[name])
        value = xp.asarray(values[name])
        try:
            value = xp.broadcast_to(value, shape)
        except ValueError:
            raise ValueError(
                f"{role}: scale for site '{name}' has shape {tuple(value.shape)}, which does "
                f"not broadcast to the site's unconstrained shape {tuple(shape)}."
            ) from None
        parts.append(xp.ravel(value))
    return xp.concatenate(parts) if parts else xp.zeros(0)


# ---- NumPy linear algebra on scales (float64) -----------------------------------------------


def discrete_lyapunov(F, D):
    """``Σ`` with ``Σ = F Σ Fᵀ + D`` (``docs/theory.md`` §3); elementwise for diagonals.

    SciPy's direct solve, kept when it is PSD with a small backward error; otherwise Smith's
    doubling. The direct solve fails where the slowest contraction rate of ``F`` is within
    about 10⁻¹⁵ of 1 (``J`` with a condition number near 10¹⁶, as raw covariate scales can
    make it): it then warns and can return an indefinite ``Σ``.

    :raises ValueError: the recursion is not stable (spectral radius of ``F`` ≥ 1).
    """
    radius = spectral_radius(F)
    if radius >= 1:
        raise ValueError(
            f"The linearised chain is unstable: the spectral radius of I - A is {radius:.4g} >= 1. "
            "Reduce the step size (stability needs h * lambda_max(Gamma J) < 4)."
        )
    if isinstance(F, Diagonal) and isinstance(D, Diagonal):
        return Diagonal(D.values / (1.0 - F.values**2))
    F, D = _matrix(F), _matrix(D)
    with warnings.catch_warnings():  # SciPy's ill-conditioning warnings: checked below
        warnings.simplefilter("ignore")
        sigma = scipy.linalg.solve_discrete_lyapunov(F, D)
    sigma = 0.5 * (sigma + sigma.T)
    eigenvalues = np.linalg.eigvalsh(sigma)
    psd = eigenvalues[0] >= -1e-8 * max(abs(eigenvalues[-1]), np.finfo(np.float64).tiny)
    if not psd or _lyapunov_residual(F, D, sigma) > 1e-10:
        sigma = _doubling_lyapunov(F, D)
        sigma = 0.5 * (sigma + sigma.T)
    return Dense(sigma)


def _lyapunov_residual(F, D, sigma) -> float:
    """The backward error of ``Σ = F Σ Fᵀ + D``: the residual relative to its terms' size."""
    norm = np.linalg.norm
    scale = float(norm(D) + norm(F, 2) ** 2 * norm(sigma)) or 1.0
    return float(norm(sigma - F @ sigma @ F.T - D)) / scale


def _doubling_lyapunov(F, D, max_doublings=64):
    """Smith's doubling, ``Σ ← Σ + F Σ Fᵀ``, ``F ← F²``: the series ``Σ_k F^k D F^kᵀ`` summed
    in PSD terms, ``2^j`` of them after ``j`` doublings, so it stays PSD however slowly ``F``
    contracts."""
    sigma, power = D, F
    for _ in range(max_doublings):
        sigma = sigma + power @ sigma @ power.T
        power = power @ power
        if float(np.max(np.abs(power))) < 1e-17:
            break
    return sigma


def continuous_lyapunov(A, D):
    """``Σ`` with ``A Σ + Σ Aᵀ = D`` (``docs/theory.md`` §3); elementwise for diagonals.

    :raises ValueError: ``A`` has an eigenvalue with non-positive real part.
    """
    smallest = float(np.min(np.asarray(A.eigenvalues(), np.float64)))
    if smallest <= 0:
        raise ValueError(
            f"The drift matrix A has an eigenvalue with non-positive real part ({smallest:.4g}): "
            "the continuous-time chain does not contract, so A Sigma + Sigma A^T = D has no "
            "stationary (positive semidefinite) solution. A = (h/2) Gamma J needs Gamma and J "
            "positive definite."
        )
    if isinstance(A, Diagonal) and isinstance(D, Diagonal):
        return Diagonal(D.values / (2.0 * A.values))
    sigma = scipy.linalg.solve_continuous_lyapunov(_matrix(A), _matrix(D))
    return Dense(0.5 * (sigma + sigma.T))


def relative_size(part, whole) -> float:
    """``λmax(W^{-1/2} P W^{-1/2})``: how large ``part`` is in the metric of ``whole``."""
    if isinstance(part, Diagonal) and isinstance(whole, Diagonal):
        return float(np.max(part.values / whole.values))
    L = np.linalg.cholesky(_matrix(whole))
    M = np.linalg.solve(L, np.linalg.solve(L, _matrix(part)).T)
    return float(np.linalg.eigvalsh(0.5 * (M + M.T))[-1])


def generalized_eigh(A, B):
    """``(values, vectors)`` of ``A v = λ B v`` (``A``, ``B`` symmetric, ``B`` positive
    definite), ascending; for diagonals the ratios with unit vectors."""
    if isinstance(A, Diagonal) and isinstance(B, Diagonal):
        ratio = A.values / B.values
        order = np.argsort(ratio)
        return ratio[order], np.eye(ratio.size)[:, order]
    return scipy.linalg.eigh(_matrix(A), _matrix(B))


def matrix_power(F, k: int):
    """``F^k``."""
    if isinstance(F, Diagonal):
        return Diagonal(F.values ** int(k))
    return Dense(np.linalg.matrix_power(_matrix(F), int(k)))


def expm(A):
    """``exp(A)``."""
    if isinstance(A, Diagonal):
        return Diagonal(np.exp(A.values))
    return Dense(scipy.linalg.expm(_matrix(A)))


def spectral_radius(F) -> float:
    """``max |eig(F)|``."""
    if isinstance(F, Diagonal):
        return float(np.max(np.abs(np.asarray(F.values, np.float64))))
    return float(np.max(np.abs(np.linalg.eigvals(np.asarray(F.matrix, np.float64)))))


def _matrix(S) -> np.ndarray:
    return np.asarray(S.as_matrix(), np.float64)


def positive_definite(S, rtol: float = 0.0) -> bool:
    """Whether the Jacobi-scaled ``C = D^{-1/2} S D^{-1/2}`` (``D = diag(S)``, so ``C`` has a
    unit diagonal) has ``λmin(C) > rtol``: positive definiteness with the parameters' units
    divided out, so a covariate on a scale ``10⁴`` times the others changes nothing. One
    Cholesky factorisation."""
    diag = np.asarray(S.diagonal(), np.float64)
    if not np.all(diag > 0) or not np.all(np.isfinite(diag)):
        return False
    if isinstance(S, Diagonal):
        return rtol < 1.0
    root = 1.0 / np.sqrt(diag)
    C = _matrix(S) * np.outer(root, root)
    try:
        np.linalg.cholesky(0.5 * (C + C.T) - rtol * np.eye(len(diag)))
    except np.linalg.LinAlgError:
        return False
    return True


def scaled_spectrum(S) -> tuple:
    """``(λmin, λmax)`` of the Jacobi-scaled ``D^{-1/2} S D^{-1/2}`` (:func:`positive_definite`);
    ``(-inf, max diag)`` when a diagonal entry is not positive."""
    diag = np.asarray(S.diagonal(), np.float64)
    if np.any(~(diag > 0)):
        return -math.inf, float(np.max(diag, initial=0.0))
    if isinstance(S, Diagonal):
        return 1.0, 1.0
    root = 1.0 / np.sqrt(diag)
    values = np.linalg.eigvalsh(_matrix(S) * np.outer(root, root))
    return float(values[0]), float(values[-1])


def condition_number(S) -> float:
    """Largest over smallest eigenvalue of a symmetric scale; ``inf`` if the smallest <= 0.
    Symmetrised first: a matrix symmetric only to rounding would take the general solver."""
    values = np.asarray(symmetrized(S).eigenvalues(), np.float64)
    lo, hi = float(np.min(values)), float(np.max(values))
    return math.inf if lo <= 0 else hi / lo


def symmetrized(S):
    """``S`` with a dense matrix replaced by ``(M + Mᵀ)/2`` (a diagonal or the identity is
    already symmetric): a covariance such as ``J⁻¹IJ⁻¹`` without the rounding of its products."""
    if not isinstance(S, Dense):
        return S
    return Dense(0.5 * (S.matrix + S.matrix.T))


def masked_inverse(S, mask):
    """``0 ⊕ S_mm⁻¹`` (NumPy): the inverse of ``S``'s block on the coordinates where the
    ``(d,)`` bool ``mask`` is set, zero elsewhere."""
    mask = np.asarray(mask, bool)
    if isinstance(S, Diagonal):
        return Diagonal(np.where(mask, 1.0 / np.asarray(S.values), 0.0))
    out = np.zeros_like(np.asarray(S.matrix))
    block = np.ix_(mask, mask)
    out[block] = np.linalg.inv(np.asarray(S.matrix)[block])
    return Dense(out)


def apply_rows(S, rows) -> np.ndarray:
    """``(K, d)``: ``S v_k`` for every row ``v_k`` of ``rows`` ``(K, d)``, on the host in
    float64 (probes and starting points, made without a compiled program)."""
    rows = np.asarray(rows, np.float64)
    if isinstance(S, Identity):
        return rows
    if isinstance(S, Diagonal):
        return rows * np.asarray(S.values, np.float64)
    return rows @ np.asarray(S.matrix, np.float64).T


def principal_axes(S, count: int) -> list:
    """The ``count`` unit eigenvectors of the symmetric ``S`` of largest eigenvalue, as
    ``(d,)`` NumPy arrays (coordinate axes for a diagonal: no ``d × d`` matrix)."""
    if isinstance(S, Diagonal):
        values = np.asarray(S.values)
        axes = np.zeros((count, values.size))  # no d × d identity
        order = np.argsort(-values)[:count]
        axes[np.arange(order.size), order] = 1.0
        return list(axes[: order.size])
    values, vectors = np.linalg.eigh(np.asarray(S.matrix))
    return [vectors[:, k] for k in np.argsort(-values)[:count]]


def size_of(x) -> Optional[int]:
    """``d`` of a sized scale or of a ``(…, d)`` array; ``None`` for ``None``, the identity
    and a scalar (they fit any size)."""
    if is_sized(x):
        return len(x)
    if x is None or isinstance(x, Identity) or np.ndim(x) == 0:
        return None
    return int(np.shape(x)[-1])


def max_abs(S) -> float:
    """The largest ``|S_ij|`` of a diagonal or dense scale, without forming a diagonal's
    ``d × d`` matrix."""
    return float(np.max(np.abs(np.asarray(S.values if isinstance(S, Diagonal) else S.matrix))))
