"""What a run ran on, and the checkpoint directory that records it.

**Fingerprint.** A :class:`~numpyro_sgmc.running.runner.KernelRun` carries a
:func:`fingerprint` of its run, a JSON-able dict computed on the host once per
``run_kernel`` call:

* ``model``: the sites of the unconstrained position and their shapes (the kernel's
  :class:`~numpyro_sgmc.data.model.Layout`) and the subsample plates (size ``n_p``, batch
  size ``b_p``);
* ``tuning``: the kernel's class, its ``step_size``, ``num_steps``, the scalar options of its
  static description (batch sampling, control variates, temperature, ...; not
  ``chunk_size``, a memory setting the chain's law does not depend on) and a summary
  (shape, ``Σx``, ``Σ|x|``, ``Σx²`` per leaf) of the chains' initial parameters
  (preconditioners, mass, friction) where the kernel alone sets them;
* ``data``: every array argument's label, shape, dtype and a hash of each of
  :data:`NUM_ROWS` rows spread over its first axis (first, last, evenly strided), read on the
  host from those rows only (a NumPy memory map reads 64 rows, not the file, and a sharded
  array each shard's rows on its device); a Python number or string argument by its
  ``repr``. A row changed outside those hashed is not seen.

A continuation (``run_kernel(previous=...)``, :func:`~numpyro_sgmc.load_run`) compares the
fingerprint of what it is given with the run's, and :func:`differences` says what differs.

**Directory.** ``checkpoint.json`` (the metadata: the run's settings, its fingerprint and the
files of its state and draws with their SHA-256) and ``checkpoint-previous.json`` (the
checkpoint before it); ``state-<generation>-<k>.npz`` (the state's leaves) and
``draws-<generation>-<k>.npz`` (kept draws), each written once. Every file is written to a
temporary file in the same directory, flushed to disk (``fsync``) and renamed over its name
(``os.replace``, atomic), the metadata last; files neither metadata lists are removed after
that. So a kill or a Ctrl-C at any moment leaves the last complete checkpoint, and a file
damaged later (truncated, emptied, overwritten, deleted) is found by its checksum when the
checkpoint is read (:func:`read`), which then says whether the previous one is intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_sgmc.data import validation

__all__ = [
    "FORMAT",
    "LATEST",
    "NUM_ROWS",
    "PREVIOUS",
    "CheckpointError",
    "CheckpointWriter",
    "Saved",
    "concatenate",
    "data_fingerprint",
    "differences",
    "fingerprint",
    "read",
    "sets_scales",
]

NUM_ROWS = 64
"""Rows of every data argument that the fingerprint hashes."""
FORMAT = 2  # of a checkpoint directory (1: one state.npz holding the metadata, no checksums)
LATEST, PREVIOUS = "checkpoint.json", "checkpoint-previous.json"
_OWN = re.compile(r"^(state|draws)-\d+-\d+\.npz(\.tmp)?$|^checkpoint(-previous)?\.json\.tmp$")
_FILE = re.compile(r"^(?:state|draws)-(\d+)-\d+\.npz$")  # a file of generation group(1)
_SCALE_RTOL = 1e-5  # the initial parameters are recomputed: float32 rounding may differ


class CheckpointError(ValueError):
    """A checkpoint directory whose files are missing, damaged or of another format."""


# ---- fingerprint ---------------------------------------------------------------------------


def fingerprint(kernel, config, initial_params, scales_given: bool, model_args, model_kwargs):
    """What a run of ``kernel`` (static description ``config``) on these data is (module
    docstring); ``initial_params`` are the chains' parameters at the start, summarised unless
    ``scales_given`` (per-chain scales of a ``ChainInit``) or the step size is automatic
    (each chain's ``h`` then depends on its start)."""
    step = kernel.step_size
    fixed = isinstance(step, (int, float)) and not scales_given
    options = {
        k: v
        for k, v in config._asdict().items()
        if k != "chunk_size" and (v is None or isinstance(v, (bool, int, float, str)))
    }
    return dict(
        model=dict(
            sites={name: list(shape) for name, _, _, shape in config.layout.sites},
            plates={p.name: [int(p.size), int(p.batch_size)] for p in config.spec.plates},
        ),
        tuning=dict(
            kernel=type(kernel).__name__,
            step_size=float(step) if isinstance(step, (int, float)) else repr(step),
            num_steps=int(kernel.num_steps),
            options={k: _jsonable(v) for k, v in options.items()},
            scales=_summary(initial_params) if fixed else None,
        ),
        data=data_fingerprint(kernel.subsampled_model, model_args, model_kwargs),
    )


def sets_scales(given: Any) -> bool:
    """Whether ``init_params`` (a dict or a ``ChainInit``) sets per-chain scales."""
    return any(
        getattr(given, field, None) is not None
        for field in ("preconditioner", "noise_preconditioner")
    )


def data_fingerprint(model, model_args, model_kwargs) -> list:
    """One entry per leaf of the model arguments: label, shape, dtype, rows, hashes (a
    Python number or string, compiled in as a constant, is hashed by its ``repr``)."""
    positional, keyword = validation.argument_labels(model, model_args, model_kwargs)
    labelled = list(zip(positional, model_args, strict=True))
    labelled += [(keyword[k], v) for k, v in (model_kwargs or {}).items()]
    entries = []
    for label, value in labelled:
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            name = label + jax.tree_util.keystr(path)
            if isinstance(leaf, (np.ndarray, jax.Array, np.generic)) or validation.zarr_array(leaf):
                entries.append(_array_entry(name, leaf))
            else:
                digest = hashlib.blake2b(repr(leaf).encode(), digest_size=8).hexdigest()
                entries.append(
                    dict(label=name, shape=[], dtype=type(leaf).__name__, rows=[], hashes=[digest])
                )
    return entries


def _array_entry(label: str, x) -> dict:
    shape = [int(s) for s in np.shape(x)]
    entry = dict(label=label, shape=shape, dtype=str(x.dtype), rows=[], hashes=None)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return entry  # rows on other hosts: shapes only
    if not shape:
        entry["hashes"] = [_digest(np.asarray(x))]
    elif shape[0]:
        rows = sorted({int(round(r)) for r in np.linspace(0, shape[0] - 1, NUM_ROWS)})
        values = _host_rows(x, np.asarray(rows))
        entry.update(rows=rows, hashes=[_digest(v) for v in values])
    return entry


def _host_rows(x, rows: np.ndarray) -> np.ndarray:
    """``x[rows]`` on the host, reading only those rows: NumPy indexes a NumPy array (a memory
    map reads just them); a JAX array is read shard by shard, each shard's rows taken on its
    device (a view of the buffer on a CPU, a small gather on an accelerator) and copied."""
    if not isinstance(x, jax.Array):
        return np.asarray(x[rows])
    out = np.empty((len(rows),) + tuple(x.shape[1:]), x.dtype)
    for shard in x.addressable_shards:
        begin, end, _ = shard.index[0].indices(x.shape[0])
        inside = np.flatnonzero((rows >= begin) & (rows < end))
        if inside.size:
            data, local = shard.data, rows[inside] - begin
            values = np.asarray(data)[local] if _on_one_cpu(data) else np.asarray(data[local])
            out[(inside,) + tuple(shard.index[1:])] = values
    return out


def _digest(x: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=8).hexdigest()


def _summary(params) -> Optional[list]:
    """``[shape, Σx, Σ|x|, Σx²]`` of every leaf, in float64 (``None`` if a leaf is on other
    hosts)."""
    out = []
    for x in jax.tree.leaves(params):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return None
        if isinstance(x, jax.Array) and not _on_one_cpu(x):  # three numbers leave the device
            x = x.astype(jnp.float32)
            sums = np.asarray(jnp.stack([x.sum(), jnp.abs(x).sum(), (x * x).sum()]), np.float64)
        else:
            v = np.asarray(x, np.float64)
            sums = np.array([v.sum(), np.abs(v).sum(), (v * v).sum()])
        out.append([[int(n) for n in np.shape(x)]] + [float(t) for t in sums])
    return out


def _on_one_cpu(x: jax.Array) -> bool:
    devices = x.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _jsonable(v):
    return v if not isinstance(v, float) or math.isfinite(v) else repr(v)


def differences(before: dict, now: dict) -> list:
    """What differs between the fingerprint of a run (``before``) and of what is given to
    continue it (``now``), one sentence each; empty when it is the same run."""
    return _model_differences(before["model"], now["model"]) + _tuning_differences(
        before["tuning"], now["tuning"]
    ) + _data_differences(before["data"], now["data"])  # fmt: skip


def _model_differences(before: dict, now: dict) -> list:
    out = []
    removed = sorted(set(before["sites"]) - set(now["sites"]))
    added = sorted(set(now["sites"]) - set(before["sites"]))
    if removed or added:
        out.append(
            "the model's sites differ: "
            + "; ".join(
                part
                for part in (
                    removed and f"{_names(removed)} in the checkpoint, not in this model",
                    added and f"{_names(added)} in this model, not in the checkpoint",
                )
                if part
            )
        )
    for name in sorted(set(before["sites"]) & set(now["sites"])):
        if before["sites"][name] != now["sites"][name]:
            out.append(
                f"site '{name}' has shape {_shape(now['sites'][name])}, the checkpoint's "
                f"{_shape(before['sites'][name])}"
            )
    for name in sorted(set(before["plates"]) | set(now["plates"])):
        old, new = before["plates"].get(name), now["plates"].get(name)
        if old != new:
            out.append(
                f"plate '{name}' differs: {_plate(old)} in the checkpoint, {_plate(new)} now"
            )
    return out


def _plate(size_and_batch) -> str:
    if size_and_batch is None:
        return "none"
    return f"n = {size_and_batch[0]}, batch {size_and_batch[1]}"


def _tuning_differences(before: dict, now: dict) -> list:
    out = []
    if before["step_size"] != now["step_size"]:
        out.append(
            f"the step size differs: {_number(before['step_size'])} in the checkpoint, "
            f"{_number(now['step_size'])} now"
        )
    if before["num_steps"] != now["num_steps"]:
        out.append(
            f"num_steps differs: {before['num_steps']} in the checkpoint, {now['num_steps']} now"
        )
    for name in sorted(set(before["options"]) | set(now["options"])):
        old, new = before["options"].get(name), now["options"].get(name)
        if old != new:
            out.append(f"the kernel's {name} differs: {old!r} in the checkpoint, {new!r} now")
    old, new = before["scales"], now["scales"]
    if not out and old is not None and new is not None and not _same_summary(old, new):
        out.append(
            "the kernel's preconditioner, mass or friction differs from the checkpoint's (a "
            "summary of the chains' initial parameters does)"
        )
    return out


def _same_summary(a: list, b: list) -> bool:
    if len(a) != len(b) or any(x[0] != y[0] for x, y in zip(a, b, strict=True)):
        return False
    x = np.array([v[1:] for v in a], np.float64).reshape(len(a), 3)
    y = np.array([v[1:] for v in b], np.float64).reshape(len(b), 3)
    scale = np.abs(x).max(axis=1, keepdims=True)  # per leaf: Σx may cancel, Σ|x| does not
    return bool(np.all(np.abs(x - y) <= _SCALE_RTOL * scale))


def _data_differences(before: list, now: list) -> list:
    if len(before) != len(now):
        return [
            f"the data differ from the run's: {len(now)} arguments, the run's "
            f"{len(before)} ({', '.join(e['label'] for e in before) or 'none'})"
        ]
    out = []
    for old, new in zip(before, now, strict=True):
        label = new["label"]
        if old["label"] != new["label"]:
            out.append(f"{label} is where the run had {old['label']}")
        elif old["shape"] != new["shape"]:
            old_shape, new_shape = _shape(old["shape"]), _shape(new["shape"])
            out.append(f"{label} has shape {new_shape}, the run's {old_shape}")
        elif old["dtype"] != new["dtype"]:
            out.append(f"{label} has dtype {new['dtype']}, the run's {old['dtype']}")
        elif None not in (old["hashes"], new["hashes"]) and old["hashes"] != new["hashes"]:
            if not old["rows"]:
                out.append(f"{label} has another value")
                continue
            rows = [r for r, a, b in zip(old["rows"], old["hashes"], new["hashes"], strict=True)
                    if a != b]  # fmt: skip
            shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
            out.append(
                f"{label} has other values in {len(rows)} of the {len(old['rows'])} rows "
                f"compared (rows {shown})"
            )
    return ["the data differ from the run's: " + "; ".join(out)] if out else []


def _names(names) -> str:
    return ", ".join(f"'{n}'" for n in names)


def _shape(shape) -> str:
    return str(tuple(shape))


def _number(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


# ---- files ---------------------------------------------------------------------------------


def _atomic_write(path: str, write) -> str:
    """``write(file)`` to ``path`` through ``path.tmp`` in the same directory, fsynced and
    renamed over ``path``: the old file stays whole until the new one is. The new file's
    SHA-256."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    _fsync_directory(os.path.dirname(path))
    return digest


def _fsync_directory(directory: str):
    """Make a rename durable (POSIX; where a directory cannot be opened the rename stands)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _encode(body: dict) -> bytes:
    text = json.dumps(body, sort_keys=True)
    return json.dumps(
        dict(body=body, sha256=hashlib.sha256(text.encode()).hexdigest()), sort_keys=True
    ).encode()


def _host_leaf(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(random.key_data(x))
    return np.asarray(x)


def concatenate(parts) -> dict:
    """Kept draws of consecutive chunks, ``(num_chains, draws, ...)`` each, as one dict."""
    if not parts:
        return {}
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *parts)


class CheckpointWriter:
    """Writes a run's checkpoints into ``directory`` (module docstring).

    :param dict settings: ``kernel`` (class name), ``num_warmup``, ``thinning``,
        ``num_chains`` and ``fingerprint``, recorded in every checkpoint.

    A continuation writing to a directory starts a new generation, whose first checkpoint
    rewrites the earlier draws once (the files of the loaded checkpoint stay until the
    previous-checkpoint metadata no longer lists them).
    """

    def __init__(self, directory: str, settings: dict):
        os.makedirs(directory, exist_ok=True)
        generations = [int(m.group(1)) for m in map(_FILE.match, os.listdir(directory)) if m]
        self.directory, self.settings = directory, settings
        self.generation = max(generations, default=-1) + 1
        self.segments, self.written, self.count = [], 0, 0

    def write(self, state, parts, num_draws: int, finished: bool):
        """A checkpoint of ``state`` and the kept draws ``parts`` (a list of dicts of
        ``(num_chains, draws, ...)`` arrays, of which those not yet written go to a new file)."""
        if len(parts) > self.written:
            name = f"draws-{self.generation}-{len(self.segments)}.npz"
            digest = self._file(name, concatenate(parts[self.written :]))
            self.segments.append(dict(name=name, sha256=digest))
            self.written = len(parts)
        leaves = jax.tree.leaves(state)
        name = f"state-{self.generation}-{self.count}.npz"
        digest = self._file(name, {f"leaf{k}": _host_leaf(x) for k, x in enumerate(leaves)})
        self.count += 1
        body = dict(
            self.settings,
            format=FORMAT,
            num_draws=int(num_draws),
            num_samples=sum(int(next(iter(p.values())).shape[1]) for p in parts),
            finished=bool(finished),
            generation=self.generation,
            state=dict(name=name, sha256=digest, num_leaves=len(leaves)),
            segments=list(self.segments),
        )
        latest = os.path.join(self.directory, LATEST)
        previous = os.path.join(self.directory, PREVIOUS)
        before = _verified_body(latest)
        if before is not None:  # the last complete checkpoint becomes the previous one
            _atomic_write(previous, lambda f: f.write(_encode(before)))
        else:  # none, or a damaged one: the previous one stays, with its files
            before = _verified_body(previous)
        _atomic_write(latest, lambda f: f.write(_encode(body)))
        keep = _listed(body) | (set() if before is None else _listed(before))
        for name in os.listdir(self.directory):
            if _OWN.match(name) and name not in keep:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.directory, name))

    def _file(self, name: str, arrays: dict) -> str:
        return _atomic_write(os.path.join(self.directory, name), lambda f: np.savez(f, **arrays))


def _listed(body: dict) -> set:
    return {body["state"]["name"]} | {s["name"] for s in body["segments"]}


def _verified_body(path: str) -> Optional[dict]:
    """The metadata at ``path`` if it is whole (its own checksum holds), else ``None``."""
    try:
        return _body(path)
    except (OSError, CheckpointError):
        return None


def _body(path: str) -> dict:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        outer = json.loads(raw)
        body = outer["body"]
        text = json.dumps(body, sort_keys=True).encode()
        ok = hashlib.sha256(text).hexdigest() == outer["sha256"]
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(
            f"{path} is not the metadata it was written as ({len(raw)} bytes that do not parse "
            "or do not match their checksum: truncated, emptied or overwritten)"
        )
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path} is of checkpoint format {body.get('format')}, not {FORMAT}")
    return body


class Saved(NamedTuple):
    """A verified checkpoint: its metadata, the state's leaves and the kept draws."""

    body: dict
    leaves: list
    samples: dict


def read(directory: str, previous: bool = False) -> Saved:
    """The last complete checkpoint in ``directory`` (``previous``: the one before it), every
    file checked against the SHA-256 its metadata records.

    :raises FileNotFoundError: no checkpoint in the directory.
    :raises CheckpointError: a file of it missing or damaged (the message names the file and
        says whether the previous checkpoint is intact), or of another format.
    """
    path = os.path.join(directory, PREVIOUS if previous else LATEST)
    if not any(os.path.exists(os.path.join(directory, n)) for n in (LATEST, PREVIOUS)):
        if os.path.exists(os.path.join(directory, "state.npz")):
            raise CheckpointError(
                f"The run_kernel checkpoint in {directory!r} is of format 1 (a state.npz without "
                f"checksums, written by an earlier numpyro_sgmc); this version reads format "
                f"{FORMAT}: start the run again."
            )
        raise FileNotFoundError(f"No run_kernel checkpoint in {directory!r} (no {LATEST}).")
    try:
        return _read(directory, path)
    except CheckpointError as e:
        raise CheckpointError(
            f"The run_kernel checkpoint in {directory!r} is damaged: {e}. "
            + _fallback(directory, previous)
        ) from None


def _read(directory: str, path: str) -> Saved:
    body = _verify(directory, path)
    with np.load(os.path.join(directory, body["state"]["name"])) as saved:
        leaves = [saved[f"leaf{k}"] for k in range(int(body["state"]["num_leaves"]))]
    parts = []
    for entry in body["segments"]:
        with np.load(os.path.join(directory, entry["name"])) as saved:
            parts.append({k: saved[k] for k in saved.files})
    return Saved(body, leaves, concatenate(parts))


def _verify(directory: str, path: str) -> dict:
    """The metadata at ``path``, once it and every file it lists are whole."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing")
    body = _body(path)
    files = [body["state"]] + body["segments"]
    for entry in files:
        file = os.path.join(directory, entry["name"])
        if not os.path.exists(file):
            raise CheckpointError(f"{file} is missing")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(
                f"{file} does not match the SHA-256 its metadata records ({os.path.getsize(file)} "
                "bytes: truncated, emptied or overwritten after it was written)"
            )
    return body


def _fallback(directory: str, previous: bool) -> str:
    """Where the run can restart from, having found the checkpoint read damaged."""
    if previous:
        try:
            _verify(directory, os.path.join(directory, LATEST))
        except CheckpointError:
            return "No other checkpoint is intact: start the run again."
        return "The last checkpoint is intact: load_run without previous_checkpoint reads it."
    try:
        body = _verify(directory, os.path.join(directory, PREVIOUS))
    except CheckpointError:
        return "There is no intact previous checkpoint: start the run again."
    return (
        f"The previous checkpoint ({body['num_samples']} kept draws per chain, "
        f"{body['num_draws']} draws) is intact: load_run(..., previous_checkpoint=True) reads "
        "it, and the run continues from there."
    )
