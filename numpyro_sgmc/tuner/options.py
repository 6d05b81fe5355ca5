"""The autotuner's options, typed and checked once (:func:`~numpyro_sgmc.tuner.tuning.autotune`'s
keyword arguments; every step of the pipeline reads them from
:attr:`~numpyro_sgmc.tuner.laplace.Problem.options`)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import numpy as np

from numpyro_sgmc import theory
from numpyro_sgmc.data import validation
from numpyro_sgmc.data.batches import BATCH_SAMPLING

__all__ = ["AutotuneOptions"]


class AutotuneOptions(NamedTuple):
    """The autotuner's options (the keyword arguments of
    :func:`~numpyro_sgmc.tuner.tuning.autotune`), checked once by :meth:`check`.

    :param batch_size: ``b``: ``None`` (the plates' ``subsample_size``), an int for every
        plate, or ``{plate: int}``.
    :param row: a Table 1 row to force (:data:`~numpyro_sgmc.theory.TABLE_1`) that reaches the
        target; ``None`` for the cheapest.
    :param warm_start_epochs: epochs of the warm start's Adam; ``None`` (the default): Newton
        steps from the start itself where they are cheap (at most
        :data:`~numpyro_sgmc.tuner.rows.WARM_START_SAMPLE_ROWS` rows, one restart, at most
        :data:`~numpyro_sgmc.tuner.tuning.NEWTON_START_MAX_DIM` parameters), and
        :data:`~numpyro_sgmc.tuner.tuning.WARM_START_EPOCHS` epochs of Adam first where they
        do not settle or do not apply.
    :param float learning_rate: the warm start's Adam learning rate.
    :param int num_restarts: warm-start restarts (the best is kept).
    :param num_rows: rows for ``J`` and ``I`` to start with (``None``: all ``n``;
        :data:`~numpyro_sgmc.tuner.rows.INFORMATION_ROWS` by default); more are added until
        the prediction's own error is under ``tolerance``. Also the rows of the power
        iteration for ``λmax(ΓJ)``.
    :param dense: ``J``/``Γ`` dense (``True``), diagonal (``False``) or dense up to
        :data:`~numpyro_sgmc.tuner.laplace.DENSE_MAX_DIM` parameters (``None``).
    :param regularize: ``None``, a ridge ``>= 0`` or ``"auto"`` for a ``J`` that is not
        positive definite (:func:`~numpyro_sgmc.tuner.fisher.information`).
    :param float max_step: the bound on ``h·λmax(ΓJ)``, in ``(0, 4)``
        (:mod:`~numpyro_sgmc.tuner.tuning`, "Step-size bound").
    :param int min_batch_size: the smallest batch per plate the control-variate rows try.
    :param num_steps: iterations per draw (``None``: about a quarter of the predicted mixing
        time).
    :param str batch_sampling: the kernel's ``batch_sampling``
        (:data:`~numpyro_sgmc.data.batches.BATCH_SAMPLING`). The predictions assume batches
        drawn with replacement; the others have a gradient noise smaller by
        ``(n - b)/(n - 1)``.
    :param float tolerance: the largest relative standard error of the predicted sds allowed
        from the rows used for ``J`` and ``I``, in ``(0, 1)`` (default 2%).
    :param init_strategy: where the warm start begins: a NumPyro init strategy (default the
        prior mean, which keeps ``exp`` finite on raw covariate scales; a strategy that finds
        no finite point falls back to the prior mean, then to the unconstrained zeros).
    :param init_params: or unconstrained starting values (a dict, with a leading restart axis
        for several restarts; ``None``: the strategy's).
    """

    batch_size: Union[None, int, dict]
    row: Optional[str]
    warm_start_epochs: Optional[float]
    learning_rate: float
    num_restarts: int
    num_rows: Optional[int]
    dense: Optional[bool]
    regularize: Union[None, float, str]
    max_step: float
    min_batch_size: int
    num_steps: Optional[int]
    batch_sampling: str
    tolerance: float
    init_strategy: Callable
    init_params: Optional[dict]

    def check(self) -> AutotuneOptions:
        """Every option's type and range: a ``TypeError`` or ``ValueError`` that names it."""
        checked = self._replace(
            max_step=validation.number_in(
                "max_step (the bound on h·λmax(ΓJ))", self.max_step, 0, 4
            ),
            num_restarts=validation.positive_int("num_restarts", self.num_restarts),
            min_batch_size=validation.positive_int("min_batch_size", self.min_batch_size),
            learning_rate=validation.positive_number("learning_rate", self.learning_rate),
            warm_start_epochs=validation.positive_number(
                "warm_start_epochs", self.warm_start_epochs, allow_none=True
            ),
            tolerance=validation.number_in("tolerance", self.tolerance, 0, 1),
            num_rows=validation.positive_int("num_rows", self.num_rows, allow_none=True),
            num_steps=validation.positive_int("num_steps", self.num_steps, allow_none=True),
        )
        if self.dense is not None and not isinstance(self.dense, (bool, np.bool_)):
            raise TypeError(f"dense must be None, True or False, got {self.dense!r}.")
        if self.batch_sampling not in BATCH_SAMPLING:
            raise ValueError(
                f"Unknown batch_sampling {self.batch_sampling!r}; choose one of "
                f"{', '.join(BATCH_SAMPLING)}."
            )
        if not callable(self.init_strategy):
            raise TypeError(
                f"init_strategy must be a NumPyro init strategy, got {self.init_strategy!r}."
            )
        if self.row is not None and self.row not in theory.ROWS:
            raise ValueError(
                f"Unknown Table 1 row {self.row!r}; the rows are {', '.join(theory.ROWS)}."
            )
        return checked
