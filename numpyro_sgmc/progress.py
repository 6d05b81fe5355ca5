"""A progress bar in epochs, driven from inside the compiled sampling loop.

NumPyro's own single-chain progress bar returns to Python after every draw, and with
``MCMC(jit_model_args=True)`` each of those calls copies the model arguments (the data), so
for large data it must be switched off (``progress_bar=False``). This bar is updated instead
by an unordered :func:`jax.debug.callback` inside the compiled loop, and only when the
iteration counter crosses one of ``updates`` evenly spaced marks: a run pays about
``updates`` host round-trips in all, none per step or per draw.

It counts passes over the data, ``epochs = iterations · b / n`` (``b`` the rows drawn per
iteration over all subsample plates), and shows the rate and the time left (ETA) of a run of
``num_draws`` draws, warm-up included.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm.auto import tqdm

__all__ = ["EpochProgress"]

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

    def _close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None
