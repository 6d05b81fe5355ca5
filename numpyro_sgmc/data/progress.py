"""A progress bar in epochs, and Ctrl-C as a request to stop a run and keep its draws.

NumPyro's own single-chain progress bar returns to Python after every draw, and with
``MCMC(jit_model_args=True)`` each of those calls copies the model arguments (the data), so
for large data it must be switched off (``progress_bar=False``). This bar is updated instead
by an unordered :func:`jax.debug.callback` inside the compiled loop, and only when the
iteration counter crosses one of ``updates`` evenly spaced marks: a run pays about
``updates`` host round-trips in all, none per step or per draw.

It counts passes over the data, ``epochs = iterations · b / n`` (``b`` the rows drawn per
iteration over all subsample plates), and shows the rate and the time left (ETA) of a run of
``num_draws`` draws, warm-up included.

**Interruption.** A compiled loop does not return to Python until it ends, so Python's
``KeyboardInterrupt`` waits for the whole run and then loses it. While a run of this library
is going, Ctrl-C (SIGINT) is instead a request to stop (:data:`interrupts`): the handler, and
where Python's signal wake-up descriptor is free a socket that the C-level handler writes to
at once, set a flag that the run reads between its chunks (:func:`~numpyro_sgmc.run_kernel`)
or, inside ``MCMC.run``'s single compiled loop, at a host check about every
``CHECK_SECONDS`` (0.2 s) of sampling (:class:`RunWatch`: the interval in iterations adapts to
the measured speed, so a run pays a few host round-trips a second, none per step).

Outside a run, and for a second Ctrl-C during a stopping run, Ctrl-C raises
``KeyboardInterrupt``, but only between calls into JAX, never inside one: Python runs a signal
handler wherever C code checks for signals, XLA's compiler among them, and an exception raised
there abandons the compilation and can crash the process (SIGSEGV) as it exits. The handler is
installed when this module is imported (where Python's default one is in place); where the
main thread is in JAX's code (its innermost frame one of ``jax`` or ``jaxlib``), the raise
waits until it is out: at once between dispatches or in traced user code, or when the
compilation or computation under way returns.

NumPyro's own progress bar (``MCMC(progress_bar=True)``) dispatches every draw from Python;
after a stop it would still dispatch each remaining (skipped) draw, at tens of microseconds
or more each, minutes for a long run. With one chain or sequential chains (where NumPyro asks
the kernel for its diagnostics between draws) a Ctrl-C raises ``KeyboardInterrupt`` between
two draws instead (:meth:`RunWatch.between_draws`), with an ``InterruptWarning`` saying how to
keep the draws; vectorised chains give the kernel no such hook. In that loop the raise does
not wait for the main thread to leave JAX's code (between draws dispatched back to back it is
out for microseconds at a time, and a wait took seconds): the next draw raises it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm.auto import tqdm

from numpyro_sgmc.diagnostics import InterruptWarning

__all__ = ["CHECK_SECONDS", "EpochProgress", "RunWatch", "interrupts"]

CHECK_SECONDS = 0.2  # sampling time between the host checks of an MCMC run
_GRACE = 1.0  # seconds after a check (or arming) during which a run counts as going

_BAR_FORMAT = (
    "{desc}{percentage:3.0f}%|{bar}| {n:.2f}/{total:.2f} epochs [{elapsed}<{remaining}, {rate_fmt}]"
)


class EpochProgress:
    """The host side of the bar: one tqdm bar per chain run, moved to absolute positions.

    Updates that arrive behind the bar's position are dropped, so chains running in parallel
    (``chain_method="parallel"``) share one bar that follows the leading chain; after a
    finished bar, an update in the first half of the run starts the next chain's bar
    (``chain_method="sequential"``).

    :param int total_iterations: iterations of the whole run (warm-up included).
    :param float iterations_per_epoch: ``n / b``.
    :param int updates: how many times the bar is updated over the run.
    :param str desc: the bar's label.
    """

    def __init__(self, total_iterations, iterations_per_epoch, updates=100, desc="SG-MCMC"):
        if not (isinstance(total_iterations, (int, np.integer)) and total_iterations >= 1):
            raise ValueError(f"total_iterations must be a positive int, got {total_iterations!r}.")
        if not (isinstance(updates, (int, np.integer)) and updates >= 1):
            raise ValueError(f"updates must be a positive int, got {updates!r}.")
        self.total_iterations = int(total_iterations)
        self.iterations_per_epoch = float(iterations_per_epoch)
        self.every = max(1, self.total_iterations // int(updates))
        self.desc = desc
        self._bar = None
        self._position = 0
        self._lock = threading.Lock()  # callbacks of parallel chains arrive on several threads

    def report(self, old_i, new_i):
        """Traced: emit a host update if the iteration counter crossed a mark in ``(old_i, new_i]``.

        With several chains in one state (a leading chain axis) the first chain's counter is
        used; chains run in lockstep.
        """
        old_i, new_i = jnp.ravel(old_i)[0], jnp.ravel(new_i)[0]
        crossed = (new_i // self.every > old_i // self.every) | (new_i >= self.total_iterations)
        lax.cond(
            crossed & (old_i < self.total_iterations),
            lambda i: jax.debug.callback(self._update, i, ordered=False),
            lambda i: None,
            new_i,
        )

    def _update(self, i):
        i = min(int(i), self.total_iterations)
        with self._lock:
            if self._bar is None and i <= self.total_iterations // 2:
                self._position = 0  # the next chain of a sequential run starts over
            if i <= self._position:  # a parallel chain behind the leader, or a finished run
                return
            if self._bar is None:
                self._bar = tqdm(
                    total=self.total_iterations / self.iterations_per_epoch,
                    initial=i / self.iterations_per_epoch,  # the rate counts from here
                    desc=self.desc,
                    bar_format=_BAR_FORMAT,
                    unit="epoch",
                )
            self._position = i
            self._bar.n = i / self.iterations_per_epoch
            self._bar.refresh()
            if i == self.total_iterations:
                self._close()

    def advance(self, i):
        """Host side: move the bar to iteration ``i`` (a run driven from Python, chunk by
        chunk, calls this between chunks instead of :meth:`report`)."""
        self._update(i)

    def close(self):
        """Close the bar where it is (a run that stopped before its end)."""
        with self._lock:
            self._close()

    def _close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


_JAX_DIRS = tuple(
    os.path.dirname(module.__file__) + os.sep for module in (jax, sys.modules["jaxlib"])
)
# code that JAX calls into: the standard library's (logging, contextlib, threading), NumPy's
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_NUMPY_DIR = os.path.dirname(np.__file__) + os.sep
_RAISE_POLL = 0.01  # seconds between looks at the main thread's stack while a raise waits

_PER_DRAW_MESSAGE = (
    "MCMC.run with NumPyro's progress bar (progress_bar=True) dispatches every draw from "
    "Python, and after a Ctrl-C would still dispatch each remaining draw: Ctrl-C raises "
    "KeyboardInterrupt between two draws instead, and the draws of this run are lost. To "
    "stop a run and keep its draws, run MCMC with progress_bar=False (the kernel's "
    "progress_draws= shows a bar in epochs at no cost per draw) or use numpyro_sgmc.run_kernel."
)


def _passive(filename: str) -> bool:
    """Code that runs for whoever called it: NumPy's and the standard library's (installed
    packages may live below the standard library's directory, so those are not)."""
    if filename.startswith(_NUMPY_DIR):
        return True
    installed = f"{os.sep}site-packages{os.sep}" in filename or "dist-packages" in filename
    return filename.startswith(_STDLIB_DIR) and not installed


def _in_jax(frame) -> bool:
    """Whether the thread whose innermost frame is ``frame`` runs JAX's code (tracing,
    compiling, dispatching, waiting for a result), or this module's handler; not whether JAX
    called the code it runs (a model being traced, a function under ``jax.tree.map``). A frame
    of the standard library or NumPy belongs to the frame that called it."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_JAX_DIRS) or frame.f_code is _HANDLER_CODE:
            return True
        if not _passive(filename):
            return False
        frame = frame.f_back
    return False


class _Interrupts:
    """Ctrl-C (SIGINT) as a request to stop the runs of this library, and a
    ``KeyboardInterrupt`` between JAX calls otherwise (module docstring).

    Process-wide (:data:`interrupts`). :meth:`arm` installs the handler from the main thread
    (elsewhere it does nothing: Python only handles signals there) with the wake-up socket; a
    run's end (:meth:`disarm`) takes the socket away and puts back the handler it replaced.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._handler = self._handle  # one bound method, to recognise it as installed
        self._previous = signal.default_int_handler  # what a KeyboardInterrupt stands for
        self._base = False  # installed at import, in place of Python's default handler
        self._armed = False
        self._socket = None  # (reader, writer) behind signal.set_wakeup_fd, when it was free
        self._requested = False
        self._consumed = 0  # Ctrl-Cs a run acted on before Python's handler ran
        self._active = 0  # runs driven from Python (run_kernel) going now
        self._alive_until = 0.0
        self._per_draw = False  # the run going dispatches every draw from Python
        self._raising = None  # the thread that delivers a KeyboardInterrupt, while one waits
        self._owed = False  # a KeyboardInterrupt is owed to the main thread, not yet raised

    def install_default(self):
        """Take the place of Python's default SIGINT handler (main thread only): Ctrl-C then
        raises ``KeyboardInterrupt`` between JAX calls, never inside one."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handler)
            self._base = True

    def arm(self) -> bool:
        """Install the handler and socket (main thread only) and clear any earlier request.

        :return: whether this call armed it (and :meth:`disarm` should disarm it).
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        with self._lock:
            self._drain()
            self._requested, self._consumed, self._per_draw = False, 0, False
            self._alive_until = time.monotonic() + _GRACE
        if self.installed():
            return False
        if signal.getsignal(signal.SIGINT) is not self._handler:
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._base = False
        self._armed = True
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        if signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False) == -1:
            self._socket = (reader, writer)
        else:  # an event loop owns the wake-up descriptor: give it back, use the handler only
            signal.set_wakeup_fd(-1)
            reader.close()
            writer.close()
        return True

    def installed(self) -> bool:
        """Whether a run armed the handler, and it is the process's SIGINT handler now."""
        return self._armed and signal.getsignal(signal.SIGINT) is self._handler

    def disarm(self):
        """Take the wake-up socket away, and put back the handler :meth:`arm` replaced (the
        one installed at import stays)."""
        if threading.current_thread() is not threading.main_thread() or not self._armed:
            return
        self._armed = False
        if signal.getsignal(signal.SIGINT) is self._handler and not self._base:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = signal.default_int_handler
        if self._socket is not None:
            signal.set_wakeup_fd(-1)
            for end in self._socket:
                end.close()
            self._socket = None

    def poll(self) -> bool:
        """Whether a stop was requested (any thread; reads the wake-up socket)."""
        with self._lock:
            seen = self._drain()
            if seen:
                self._requested = True
                self._consumed += seen
            self._alive_until = time.monotonic() + _GRACE
            return self._requested

    def start(self):
        """A run driven from Python begins: every Ctrl-C until :meth:`stop` is a request."""
        with self._lock:
            self._active += 1
            self._per_draw = False

    def stop(self):
        with self._lock:
            self._active -= 1

    def per_draw(self):
        """The run going dispatches every draw from Python (main thread): from now on a
        Ctrl-C raises ``KeyboardInterrupt`` between draws, and one already requested does."""
        with self._lock:
            self._per_draw = True
            requested, self._requested = self._requested, False
            owed, self._owed = self._owed, False
        if requested:
            warnings.warn(_PER_DRAW_MESSAGE, InterruptWarning, stacklevel=3)
        if requested or owed:
            raise KeyboardInterrupt

    @property
    def draws_from_python(self) -> bool:
        """Whether the run going dispatches every draw from Python (:meth:`per_draw`)."""
        return self._per_draw

    def _drain(self) -> int:
        if self._socket is None:
            return 0
        seen = 0
        while True:
            try:
                data = self._socket[0].recv(256)
            except (BlockingIOError, InterruptedError):
                return seen
            if not data:
                return seen
            seen += data.count(bytes([signal.SIGINT]))

    def _handle(self, signum, frame):
        with self._lock:
            self._drain()
            if self._consumed:  # a run already stopped for this Ctrl-C
                self._consumed = 0
                return
            going = self._active > 0 or time.monotonic() < self._alive_until
            if going and self._per_draw:
                warnings.warn(_PER_DRAW_MESSAGE, InterruptWarning, stacklevel=2)
            elif going and not self._requested:
                self._requested = True
                return
        previous = self._previous
        if previous is signal.SIG_IGN:
            return
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)
            return
        if not _in_jax(frame):  # the main thread runs code of its own, not JAX's
            raise KeyboardInterrupt
        with self._lock:
            # owed: the next draw of a per-draw loop raises it (per_draw), or the thread does
            # once the main thread is out of JAX (which between dispatches can take seconds)
            self._owed = True
            if self._raising is None:
                self._raising = threading.Thread(
                    target=self._raise_when_out_of_jax, name="ctrl-c", daemon=True
                )
                self._raising.start()

    def _raise_when_out_of_jax(self):
        """Raise ``KeyboardInterrupt`` in the main thread once it has left JAX's code.

        An asynchronous exception (``PyThreadState_SetAsyncExc``) is raised by the
        interpreter's loop at the thread's next bytecode, never inside a C call; it is set
        only once the main thread's innermost frame is not JAX's.
        """
        main = threading.main_thread().ident
        while self._owed and _in_jax(sys._current_frames().get(main)):
            time.sleep(_RAISE_POLL)
        with self._lock:
            self._raising = None
            if self._owed:  # not raised meanwhile by the next draw (per_draw)
                self._owed = False
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(main), ctypes.py_object(KeyboardInterrupt)
                )


_HANDLER_CODE = _Interrupts._handle.__code__
interrupts = _Interrupts()
"""The process's Ctrl-C handling for runs of this library (``_Interrupts``)."""
interrupts.install_default()


class RunWatch:
    """The host check inside an ``MCMC.run`` of one kernel: stop on Ctrl-C, keep the draws.

    :meth:`guard` wraps a draw: every ``next_check`` iterations (in the state) a
    :func:`jax.pure_callback` asks :data:`interrupts` whether to stop, and sets the next check
    about ``CHECK_SECONDS`` of sampling later at the speed measured since the last one.
    Once stopped, every later draw of the run is skipped (the state is returned unchanged,
    with ``interrupted`` set, which ``MCMC`` collects per draw), so the loop runs to its end
    and ``MCMC.run`` returns the draws made so far. NumPyro's loop cannot be left early: a
    skipped draw still costs one iteration of it, about 1 µs on a CPU, so a run of 2·10⁶
    draws stopped near its start takes about 2 s to return (``run_kernel`` stops between
    chunks at once).

    :param str kernel_name: for the message.
    :param int num_steps: iterations per draw.
    :param int num_warmup: warm-up draws of the run.
    :param on_stop: called on the host when the run stops (closes a progress bar).
    """

    def __init__(self, kernel_name, num_steps, num_warmup, on_stop: Optional[Callable] = None):
        self.kernel_name = kernel_name
        self.num_steps = int(num_steps)
        self.num_warmup = int(num_warmup)
        self.on_stop = on_stop
        self._lock = threading.Lock()
        self._last = {}  # thread -> (time, iteration, interval): parallel chains check apart
        self._stopped = False

    def check(self, i):
        """Host callback: ``(stop, next_check)`` at iteration ``i`` of the first chain."""
        i, now = int(i), time.monotonic()
        with self._lock:
            last = self._last.get(threading.get_ident())
            if last is None or i <= last[1]:  # a new run, or the next chain of a sequential one
                interval = self.num_steps
            else:
                rate = (i - last[1]) / max(now - last[0], 1e-6)
                interval = min(int(rate * CHECK_SECONDS), 8 * last[2], 2**30)
                interval = max(self.num_steps, interval)
            self._last[threading.get_ident()] = (now, i, interval)
            stop = interrupts.poll()
            report, self._stopped = stop and not self._stopped, self._stopped or stop
        # where the draws are dispatched from Python, Ctrl-C raises instead (between_draws)
        if report and not interrupts.draws_from_python:
            draws = i // self.num_steps
            warnings.warn(
                f"{self.kernel_name}: interrupted (Ctrl-C) at iteration {i}, after {draws} "
                f"draws ({min(draws, self.num_warmup)} of them warm-up, "
                f"{max(0, draws - self.num_warmup)} after it). The rest of the run is skipped: "
                "each remaining draw repeats the last state and is flagged in the "
                "'interrupted' field, and MCMC.run returns. "
                "numpyro_sgmc.completed_samples(mcmc) gives the draws made; "
                "numpyro_sgmc.run_kernel runs in chunks and can continue a run.",
                InterruptWarning,
                stacklevel=2,
            )
        if report and self.on_stop is not None:
            self.on_stop()
        return np.bool_(stop), np.int32(min(i + interval, 2**31 - 1))

    @staticmethod
    def between_draws():
        """Host side, between two draws of NumPyro's progress-bar loop (which dispatches every
        draw from Python): a Ctrl-C raises ``KeyboardInterrupt`` there, and one requested
        already does now (module docstring)."""
        interrupts.per_draw()

    def guard(self, sample: Callable) -> Callable:
        """``sample(state, args, kwargs)`` with the host check and the skip after a stop.

        Traced; the state's ``i``, ``next_check`` and ``interrupted`` may carry a leading
        chain axis (the first chain's are read: vectorised chains run in lockstep). The
        check's conditional is on scalars; the draw runs in a second one, whose other branch
        (taken once stopped) returns the state as it is.
        """

        def run(state, model_args, model_kwargs):
            i = jnp.ravel(state.i)[0]
            due = jnp.ravel(state.next_check)[0]
            stopped = jnp.ravel(state.interrupted)[0]
            out = (jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32))

            def ask(i):
                return jax.pure_callback(self.check, out, i, vmap_method="sequential")

            stop, due = lax.cond((i >= due) & ~stopped, ask, lambda i: (stopped, due), i)

            def skip(state):
                return state._replace(diverging=jnp.zeros_like(state.diverging))

            new = lax.cond(stop, skip, lambda s: sample(s, model_args, model_kwargs), state)
            return new._replace(
                interrupted=jnp.broadcast_to(stop, jnp.shape(state.interrupted)),
                next_check=jnp.broadcast_to(due, jnp.shape(state.next_check)),
            )

        return run
