"""One MCMC draw of a kernel on the host side: the compiled loop of ``num_steps`` iterations of
the family's pure ``step`` and what ``MCMC`` shows around it (progress, divergences, Ctrl-C).

:class:`DrawLoop` holds no model or data: ``MCMC`` passes them to every draw. It holds compiled
functions, so a kernel drops it on pickling and builds it again from the config.
"""

from __future__ import annotations

import time
from typing import Optional

import jax
import numpy as np

from numpyro_sgmc.data.model import total_batch
from numpyro_sgmc.data.progress import EpochProgress, RunWatch
from numpyro_sgmc.diagnostics import report_new_divergences
from numpyro_sgmc.kernels import checks
from numpyro_sgmc.kernels.core import draw

__all__ = ["DrawLoop", "draws_of", "step_size_label"]

_DIAGNOSTICS_INTERVAL = 0.25  # seconds between progress-bar reads of the divergence count


def draws_of(build, config, num_steps: int, batched: bool):
    """``sample(state, model_args, model_kwargs)``: one draw of ``num_steps`` iterations,
    vectorised over a leading chain axis when ``batched``."""
    one = draw(build(config), num_steps)
    return jax.vmap(one, (0, None, None)) if batched else one


def step_size_label(step_size) -> str:
    """``h`` for the messages: the number, or ``per chain`` for ``step_size="auto"``."""
    return f"{step_size:g}" if isinstance(step_size, float) else "per chain"


class DrawLoop:
    """``loop(state, model_args, model_kwargs)``: one MCMC draw of the kernel of ``recipe`` and
    ``config``, or none after a Ctrl-C (:class:`~numpyro_sgmc.data.progress.RunWatch`).

    :param recipe: the kernel's :class:`~numpyro_sgmc.kernels.family.Recipe`.
    :param config: its static configuration (the family's ``make_config``).
    :param int num_warmup: warm-up draws of the run.
    :param bool batched: the state has a leading chain axis.
    :param progress_draws: draws of the run for an epoch progress bar, or ``None``.
    """

    def __init__(self, recipe, config, num_warmup: int, batched: bool, progress_draws=None):
        self.name, self.num_steps = recipe.name, recipe.options.num_steps
        self.step_size = step_size_label(recipe.dynamics.step_size)
        self.progress: Optional[EpochProgress] = None
        if progress_draws is not None:
            self.progress = EpochProgress(
                progress_draws * self.num_steps,
                iterations_per_epoch=config.spec.num_data / total_batch(config.spec.plates),
                desc=f"{self.name} ",
            )
        on_stop = None if self.progress is None else self.progress.close
        watch = RunWatch(self.name, self.num_steps, num_warmup, on_stop)
        self.sample = watch.guard(draws_of(recipe.family.build, config, self.num_steps, batched))
        self.diagnostics, self.warned_copies, self.warned_constants = None, False, False
        self.traced_bytes = 0

    def __call__(self, state, model_args, model_kwargs):
        concrete, self.traced_bytes = checks.data_bytes(model_args, model_kwargs)
        if not self.warned_constants:
            checks.warn_compiled_in_data(concrete)
            self.warned_constants = True
        new = self.sample(state, model_args, model_kwargs)
        if self.progress is not None:
            self.progress.report(state.i, new.i)
        num_diverging = report_new_divergences(
            state.num_diverging, new.num_diverging, new.divergence_iteration, self.name,
            self.step_size, self.num_steps,
        )  # fmt: skip
        return new._replace(num_diverging=num_diverging)

    def diagnostics_str(self, state) -> str:
        """Divergences so far, for NumPyro's progress bar (read at most every 0.25 s, so
        that NumPyro can dispatch the next draws while this one computes)."""
        RunWatch.between_draws()  # Ctrl-C raises here, between draws (data.progress)
        if not self.warned_copies:
            checks.warn_progress_copies(self.traced_bytes)
            self.warned_copies = True
        now = time.monotonic()
        if self.diagnostics is None or now - self.diagnostics[0] >= _DIAGNOSTICS_INTERVAL:
            self.diagnostics = (now, f"{int(np.sum(state.num_diverging))} divergences")
        return self.diagnostics[1]
