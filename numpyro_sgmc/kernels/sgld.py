"""SGLD, SGLD-FP and SGD-as-a-sampler: the meta-algorithm of ``shared/design/theory.md`` §2.

All three are :class:`~numpyro_sgmc.kernels.base.SGMCKernel` with a choice of gradient
estimator and inverse temperature; they differ in nothing else.
"""

from __future__ import annotations

import math

from numpyro_sgmc.kernels.base import SGMCKernel

__all__ = ["SGD", "SGLD", "SGLDFP"]


class SGLD(SGMCKernel):
    """Stochastic gradient Langevin dynamics, optionally preconditioned.

    .. math::

        \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)
                  + \\sqrt{h/\\beta}\\;\\Lambda^{1/2}\\xi, \\qquad \\xi \\sim N(0, I_d),

    with ``ĝ(θ) = (1/n)∇log p0(θ) + (1/b)Σ_{i∈B}∇l(θ; X_i)`` the minibatch average gradient
    (``shared/design/theory.md`` §1–§2), ``β = n`` by default (the posterior) and ``Λ = Γ``
    by default. With ``ε = h/n`` this is ``θ' = θ - (ε/2)Γ∇Ũ(θ) + sqrt(ε)Γ^{1/2}ξ``
    (Welling & Teh 2011; preconditioned: Li et al. 2016).

    What it samples: for small ``h·n/b`` the posterior (Table 1 rows P1, P2); at larger ``h``
    the stationary covariance is the discrete-Lyapunov solution of theory §3, which
    :func:`numpyro_sgmc.theory.stationary_covariance` predicts. Mixing takes about
    ``4/(h·λmin(ΓJ))`` iterations.

    **Example**::

        from numpyro.infer import MCMC
        from numpyro_sgmc import SGLD

        # 1000 warm-up and 20000 kept draws, 100 iterations each (num_steps=100)
        mcmc = MCMC(SGLD(model, step_size=1e-3), num_warmup=1000, num_samples=20000)
        mcmc.run(jax.random.key(0), X, y)
        mcmc.print_summary()

    Arguments (all but ``model`` and ``step_size`` keyword-only) are those of
    :class:`~numpyro_sgmc.kernels.base.SGMCKernel`:

    :param model: a NumPyro model whose data plate(s) declare ``subsample_size``.
    :param float step_size: ``h`` on the average-gradient scale.
    :param inverse_temperature: ``β``; ``None`` for ``n`` (the posterior); ``n/w`` targets
        the posterior tempered by ``w`` (with ``Γ = J⁻¹``, rows B and G of Table 1).
    :param kwargs: ``batch_size``, ``preconditioner`` (``Γ``), ``noise_preconditioner``
        (``Λ``, default ``Γ``), ``control_variates`` (this is then SGLD-FP),
        ``batch_sampling``, ``num_steps`` (iterations per MCMC draw, default 100: ``N``
        draws cost ``100 N`` iterations; ``num_steps=1`` keeps every iterate),
        ``init_strategy``, ``chunk_size``.
    """

    def __init__(self, model, step_size, *, inverse_temperature=None, **kwargs):
        if inverse_temperature is not None and math.isinf(float(inverse_temperature)):
            raise ValueError(
                "inverse_temperature=inf removes the noise: that is SGD, use numpyro_sgmc.SGD."
            )
        super().__init__(model, step_size, inverse_temperature=inverse_temperature, **kwargs)


class SGLDFP(SGLD):
    """SGLD with control variates around a centre ``θ̂`` ("SGLD-FP", fixed point).

    The update is :class:`SGLD`'s with the gradient estimate

    .. math::

        \\hat g_{cv}(\\theta) = \\tfrac{1}{n}\\nabla\\log p_0(\\theta) + \\bar g(\\hat\\theta)
            + \\tfrac{1}{b}\\textstyle\\sum_{i\\in B}
              [\\nabla l(\\theta; X_i) - \\nabla l(\\hat\\theta; X_i)],

    where ``ḡ(θ̂) = (1/n)Σ_i ∇l(θ̂; X_i)`` is computed once, over all the data, at ``init``
    (``shared/design/theory.md`` §1; Baker et al. 2019). Near ``θ̂`` the gradient noise
    vanishes, so with ``h = c_h/n`` it samples the posterior at a cost per unit mixing time
    linear in ``n`` (Table 1 rows P3, P4; mixing ``4c_b/(c_h λmin(ΓJ))`` epochs).

    The centre is each chain's starting position: start at the mode
    (``init_strategy=init_to_value(values=map_estimate)`` or ``init_params``), or give
    ``ChainInit(centre=...)``. A centre far from a mode raises a
    :class:`~numpyro_sgmc.kernels.base.CentreWarning`.

    Takes the arguments of :class:`SGLD` except ``control_variates``.
    """

    def __init__(self, model, step_size, **kwargs):
        if "control_variates" in kwargs:
            raise TypeError("SGLDFP always uses control variates; use SGLD for a choice.")
        super().__init__(model, step_size, control_variates=True, **kwargs)


class SGD(SGMCKernel):
    """Stochastic gradient descent used as a sampler (``β = ∞``).

    .. math::

        \\theta' = \\theta + \\tfrac{h}{2}\\,\\Gamma\\,\\hat g(\\theta)

    Its iterates do not converge: with a fixed ``h`` they fluctuate around the mode with a
    stationary covariance set by the gradient noise (``shared/design/theory.md`` §3–§4). With
    ``Γ = J⁻¹`` and ``h = 4b/n`` that covariance is ``S/n``, the sandwich ``J⁻¹IJ⁻¹`` (Table 1
    row F, the local fiducial distribution, mixing in about one epoch); with ``Γ = I⁻¹`` and
    ``h = 4b/n`` it is ``J⁻¹/n`` (row P5). The iterates are the draws (``z``); the running
    mean of the iterates after warm-up is ``state.average`` (collect it with
    ``extra_fields=("average",)``, or read ``mcmc.last_state.average``), whose covariance
    after ``m`` epochs approaches ``S/(n m)`` (row A).

    Takes the arguments of :class:`~numpyro_sgmc.kernels.base.SGMCKernel` except
    ``inverse_temperature`` and ``noise_preconditioner`` (there is no noise).
    """

    _tracks_average = True

    def __init__(self, model, step_size, **kwargs):
        for name in ("inverse_temperature", "noise_preconditioner"):
            if name in kwargs:
                raise TypeError(f"SGD adds no noise, so it takes no {name}; use SGLD.")
        super().__init__(model, step_size, inverse_temperature=math.inf, **kwargs)
