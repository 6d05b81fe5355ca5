"""Multi-host runs: joining JAX's distributed runtime with a deadline.

One process per host (or per group of devices) runs the same script. Each calls
:func:`initialize` before any other JAX work; afterwards :func:`jax.devices` lists every
process's devices, :func:`numpyro_sgmc.shard_data` builds global arrays from each process's
own rows, and the kernels' data-parallel estimator (:mod:`numpyro_sgmc.data.sharding`) all-reduces
the gradient over all hosts through JAX's collectives (on CPU: Gloo, JAX's default CPU
collectives). Every process computes the same chain and gets the same draws.

:func:`initialize` is :func:`jax.distributed.initialize` with a deadline that is an error, not
a hang: the JAX call blocks until all ``num_processes`` processes have registered with the
coordinator (process 0), and when one never arrives the runtime terminates the process from
C++ after its own timeout, with a message about a "DEADLINE_EXCEEDED" RPC. Here a process that
cannot reach the coordinator raises :class:`DistributedInitError`, and a process still waiting
for the others when ``timeout`` expires prints which run it was waiting for and exits with
status :data:`~numpyro_sgmc.running.distributed.JOIN_TIMEOUT_EXIT_CODE` (it cannot raise: it is
blocked inside the runtime).

Launch recipe (SLURM, one process per host): see ``docs/distributed.md``.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from typing import Optional, Sequence, Union

import jax

__all__ = ["JOIN_TIMEOUT_EXIT_CODE", "DistributedInitError", "initialize"]

JOIN_TIMEOUT_EXIT_CODE = 75
"""Exit status of a process whose peers did not all join within the deadline (``EX_TEMPFAIL``)."""

_RETRY_SECONDS = 0.25
_RUNTIME_GRACE_SECONDS = 30  # JAX's own deadline, after ours: ours fires first


class DistributedInitError(RuntimeError):
    """A process could not join the distributed run (bad arguments, unreachable coordinator)."""


def _split_address(address: str):
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DistributedInitError(
            f"coordinator_address must be 'host:port' (process 0's host and a free port), "
            f"got {address!r}."
        )
    return host.strip("[]"), int(port)


def _wait_for_coordinator(address: str, deadline: float):
    """Retry a TCP connection to the coordinator until it accepts or the deadline passes."""
    host, port = _split_address(address)
    last = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, _RETRY_SECONDS)):
                return
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise DistributedInitError(
                f"Process could not reach the coordinator at {address} ({last}). Check that "
                "process 0 is running and was started with the same coordinator address, that "
                "the port is free on its host and reachable from this one (firewall), and that "
                "the host name resolves here."
            )
        time.sleep(_RETRY_SECONDS)


def _join_timed_out(address, num_processes, process_id, timeout):
    who = "this process" if process_id is None else f"process {process_id}"
    count = "all processes" if num_processes is None else f"all {num_processes} processes"
    ids = "" if num_processes is None else f" and process ids 0..{num_processes - 1}"
    sys.stderr.write(
        f"numpyro_sgmc.distributed.initialize: {who} waited {timeout:g} s for {count} to join "
        f"at {address}; at least one did not. Check that every process was started (one per "
        "host under SLURM: srun --ntasks-per-node=1), with the same coordinator address and "
        f"number of processes{ids}; raise timeout= for slow starts. Exiting with status "
        f"{JOIN_TIMEOUT_EXIT_CODE}.\n"
    )
    sys.stderr.flush()
    os._exit(JOIN_TIMEOUT_EXIT_CODE)


def initialize(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    *,
    timeout: float = 300.0,
    local_device_ids: Optional[Union[int, Sequence[int]]] = None,
    **kwargs,
) -> None:
    """Join the distributed run: :func:`jax.distributed.initialize` with a deadline.

    Call it once per process, first thing, before any other JAX computation. Under SLURM (or
    another cluster JAX detects) the three arguments may be left out; on other clusters, and on
    one machine, give them.

    :param str coordinator_address: ``"host:port"`` of process 0 (which runs the coordinator
        service on that port).
    :param int num_processes: the number of processes in the run.
    :param int process_id: this process's id, ``0 .. num_processes - 1``.
    :param float timeout: seconds to wait for the coordinator and for every process to join.
    :param local_device_ids: this process's devices (GPU ids), as for JAX.
    :param kwargs: further keyword arguments of :func:`jax.distributed.initialize`
        (``heartbeat_timeout_seconds``, ``cluster_detection_method``, ...).
    :raises DistributedInitError: invalid arguments, JAX already initialised, or (for a
        process other than 0) the coordinator unreachable within ``timeout``. A process whose
        peers do not all join within ``timeout`` exits with status
        :data:`~numpyro_sgmc.running.distributed.JOIN_TIMEOUT_EXIT_CODE` after printing why.
    """
    if jax.distributed.is_initialized():
        raise DistributedInitError("numpyro_sgmc.distributed.initialize was already called.")
    if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
        raise DistributedInitError(f"timeout must be a positive number of seconds: {timeout!r}.")
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise DistributedInitError(
            "Give all of coordinator_address, num_processes and process_id, or none of them "
            "(to let JAX read them from the cluster environment, e.g. SLURM)."
        )
    if num_processes is not None:
        if not (isinstance(num_processes, int) and num_processes >= 1):
            raise DistributedInitError(
                f"num_processes must be a positive int, got {num_processes!r}."
            )
        if not (isinstance(process_id, int) and 0 <= process_id < num_processes):
            raise DistributedInitError(
                f"process_id must be an int in 0..{num_processes - 1}, got {process_id!r}."
            )
        _split_address(coordinator_address)
    deadline = time.monotonic() + timeout
    if process_id not in (None, 0):
        _wait_for_coordinator(coordinator_address, deadline)
    remaining = max(1.0, deadline - time.monotonic())
    watchdog = threading.Timer(
        remaining,
        _join_timed_out,
        args=(
            coordinator_address or "<from the cluster environment>",
            num_processes,
            process_id,
            timeout,
        ),
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=int(math.ceil(remaining)) + _RUNTIME_GRACE_SECONDS,
            **kwargs,
        )
    except (RuntimeError, ValueError, TypeError) as err:
        raise DistributedInitError(
            f"jax.distributed.initialize failed: {err}. It must be called once per process, "
            "before any JAX computation (even jax.devices() or creating an array)."
        ) from err
    finally:
        watchdog.cancel()
    if num_processes is not None and jax.process_count() != num_processes:
        raise DistributedInitError(
            f"Expected {num_processes} processes, JAX reports {jax.process_count()}."
        )
