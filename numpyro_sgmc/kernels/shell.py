"""The thin ``numpyro.infer.MCMC`` shell around the functional kernels (NumPyro's ``HMC``
pattern: a small ``MCMCKernel`` over pure functions).

:class:`SGMCKernel` holds a kernel as data, a :class:`~numpyro_sgmc.kernels.family.Recipe`
(family record, dynamics, options, tuning), and uses only the recipe: ``init`` is
:func:`~numpyro_sgmc.kernels.setup.start`, ``sample`` one
:class:`~numpyro_sgmc.kernels.draws.DrawLoop` draw of the family's pure ``step``. The named
kernels (:mod:`numpyro_sgmc.kernels.sgld`, :mod:`numpyro_sgmc.kernels.sghmc`) only check their
arguments into a recipe.
"""

from __future__ import annotations

import copy
from typing import Optional

from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import identity

from numpyro_sgmc.data import streaming, validation
from numpyro_sgmc.data.model import constrain
from numpyro_sgmc.data.progress import interrupts
from numpyro_sgmc.data.subsample import full_data
from numpyro_sgmc.kernels import setup
from numpyro_sgmc.kernels.draws import DrawLoop, step_size_label
from numpyro_sgmc.kernels.family import ChainInit, Recipe, Tuned, needs_support_check

__all__ = ["ChainInit", "SGMCKernel", "Tuned"]


class SGMCKernel(MCMCKernel):
    """What every stochastic-gradient kernel shares; use the named kernels.

    **Your own loop.** After ``init`` (which prepares the model, runs the checks and builds
    each chain's parameters into the state), :meth:`functional` is the pure ``(init, step)``
    pair of :func:`~numpyro_sgmc.kernels.core.build_kernel`, as in blackjax; ``step`` is one
    iteration (``num_steps`` of them make one ``MCMC`` draw)::

        kernel = SGLD(model, step_size=0.01)
        state = kernel.init(jax.random.key(1), 0, None, (y,), {})
        init, step = kernel.functional()

        def one(state, _):
            state = step(state, (y,), {})
            return state, state.z

        state, zs = jax.lax.scan(one, state, length=10_000)  # zs["mu"]: (10_000,)
        again = init(jax.random.key(2), state.z, state.params, (y,), {})  # a fresh chain

    A kernel pickles before and after ``init`` (its compiled functions are rebuilt on the
    first draw); one on sharded data pickles as before its ``init`` (devices do not pickle).
    """

    sample_field = "z"

    def __init__(self, model, recipe: Recipe):
        if not callable(model):
            raise TypeError(f"model must be a NumPyro model (a callable), got {model!r}.")
        self._model, self._recipe = model, recipe
        self.progress_draws = recipe.options.progress_draws
        self._prepared = self._config = self._loop = None
        self._batched, self._num_warmup = False, 0
        self.step_check = self.auto_step = None

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k != "_loop"}  # compiled: rebuilt
        if self.shards is not None:  # devices do not pickle: the copy is as before init
            state.update(_prepared=None, _config=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _loop=None)

    # ---- the kernel as data -----------------------------------------------------------------

    @property
    def recipe(self) -> Recipe:
        """The :class:`~numpyro_sgmc.kernels.family.Recipe`: family, dynamics, options, tuning."""
        return self._recipe

    @property
    def family(self):
        """The kernel's :class:`~numpyro_sgmc.kernels.family.Family` record."""
        return self._recipe.family

    @property
    def config(self):
        """The static configuration of the last ``init`` (``family.make_config``), or ``None``."""
        return self._config

    @property
    def tuned(self) -> Optional[Tuned]:
        """The law :func:`~numpyro_sgmc.autotune` predicted, or ``None`` for a hand-set kernel."""
        return self._recipe.tuned

    def with_tuning(self, tuned: Tuned) -> "SGMCKernel":
        """This kernel (not yet run) tuned for ``tuned``: its chains start from draws of the
        predicted law, its control-variate centre is the mode, and it runs only on the data
        it was tuned on."""
        new = copy.copy(self)  # the same class (SGLD, SGLDFP, SGD, ...), nothing of a run
        SGMCKernel.__init__(new, self._model, self._recipe._replace(tuned=tuned))
        return new

    def functional(self):
        """The pure ``(init, step)`` :class:`~numpyro_sgmc.kernels.core.Kernel` of the last
        ``init`` (class docstring)."""
        if self._config is None:
            raise ValueError(
                f"{self._recipe.name}.functional() needs the model prepared: call "
                "kernel.init(rng_key, num_warmup, init_params, model_args, model_kwargs) first."
            )
        return self._recipe.family.build(self._config)

    # ---- what MCMC asks -------------------------------------------------------------------

    @property
    def model(self):
        """The model as a full-data program: its subsample plates run over all their rows.

        This is the target the kernel samples, and what tools that replay the model see
        (``az.from_numpyro`` computes per-datum log-likelihoods with it: memory
        ``draws × n``; pass ``log_likelihood=False`` there for large ``n``).
        """
        return full_data(self._model)

    @property
    def subsampled_model(self):
        """The model as given, with its subsample plates."""
        return self._model

    @property
    def prepared(self):
        """The :class:`~numpyro_sgmc.data.model.SubsampledModel` of the last ``init``."""
        return self._prepared

    @property
    def plates(self) -> Optional[dict]:
        """Plate name -> :class:`~numpyro_sgmc.data.subsample.SubsamplePlate` (after ``init``)."""
        return None if self._prepared is None else {p.name: p for p in self._prepared.plates}

    @property
    def shards(self):
        """The :class:`~numpyro_sgmc.data.sharding.DataLayout` of sharded data (after ``init``), or
        ``None`` on one device."""
        return None if self._config is None else self._config.shards

    @property
    def num_data(self) -> Optional[int]:
        """``n``, the number of data over all subsample plates (known after ``init``)."""
        return None if self._prepared is None else self._prepared.num_data

    @property
    def num_steps(self) -> int:
        """Iterations of the update per MCMC draw."""
        return self._recipe.options.num_steps

    @property
    def step_size(self):
        """``h``, on the average-gradient scale, or the
        :class:`~numpyro_sgmc.kernels.auto_step.Auto` settings of ``step_size="auto"`` (each
        chain's ``h`` is in ``auto_step`` after ``init``)."""
        return self._recipe.dynamics.step_size

    @property
    def step_size_label(self) -> str:
        """``h`` for messages: the number, or ``per chain`` for ``step_size="auto"``."""
        return step_size_label(self.step_size)

    @property
    def progress_draws(self):
        return self._progress_draws

    @progress_draws.setter
    def progress_draws(self, value):
        options = self._recipe.options._replace(progress_draws=value)
        self._progress_draws = options.check().progress_draws

    @property
    def default_fields(self):
        """``z``, ``diverging`` and ``interrupted`` (draws skipped after a Ctrl-C)."""
        return ("z", "diverging", "interrupted")

    def get_diagnostics_str(self, state):
        """Divergences so far, for NumPyro's progress bar."""
        return self._draws(state).diagnostics_str(state)

    def postprocess_fn(self, model_args, model_kwargs):
        """Unconstrained draws -> constrained values and deterministic sites (those inside a
        subsample plate, per-datum values of one batch, are left out: use ``Predictive``)."""
        if self._prepared is None or not needs_support_check(self._prepared):
            return identity  # identity transforms, no deterministic site: z itself
        spec, exclude = self._prepared.spec, self._prepared.per_datum_sites
        args, kwargs = validation.as_arrays(self._model, model_args, model_kwargs)
        return lambda z: constrain(spec, z, args, kwargs, exclude)

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        """The initial state (:func:`~numpyro_sgmc.kernels.setup.start`)."""
        data = validation.as_arrays(self._model, model_args, model_kwargs)
        streaming.refuse_in_mcmc(self._recipe.name, *data)
        self.step_check = self.auto_step = None
        begun = setup.start(self._recipe, self._model, rng_key, num_warmup, init_params, *data)
        self._prepared, self._config, self._batched = begun.prepared, begun.config, begun.batched
        self.auto_step, self.step_check = begun.auto_step, begun.step_check
        self._num_warmup, self._loop = int(num_warmup), None
        self._draws(begun.state)
        interrupts.arm()  # Ctrl-C stops the run and keeps its draws (numpyro_sgmc.data.progress)
        return begun.state

    def sample(self, state, model_args, model_kwargs):
        """One MCMC draw: ``num_steps`` iterations of the update in one compiled loop, or
        none after a Ctrl-C (:class:`~numpyro_sgmc.data.progress.RunWatch`)."""
        data = validation.as_arrays(self._model, model_args, model_kwargs)
        return self._draws(state)(state, *data)

    def _draws(self, state) -> DrawLoop:
        """The draw loop of the last ``init``, built again after unpickling."""
        if self._loop is None:
            if self._config is None:
                raise ValueError(f"{self._recipe.name}: call kernel.init(...) before sample.")
            self._loop = DrawLoop(
                self._recipe, self._config, self._num_warmup, self._batched, self._progress_draws
            )
        return self._loop
