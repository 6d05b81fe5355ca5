"""Posterior-predictive metrics: log pointwise predictive density, accuracy, calibration, RMSE
and the Gaussian negative log-likelihood.

Draws are a dict of constrained values with a leading draw axis, site name -> ``(S, ...)``:
what :meth:`numpyro.infer.MCMC.get_samples` returns, and equally the ``K`` modes of an
ensemble (``warm_start(...).constrained``). The model is run on new inputs once per draw,
with every subsample plate over all of its rows (:class:`~numpyro_sgmc.data.subsample.full_data`),
so the model the kernels ran, ``batch_size`` and all, evaluates every test row::

    metrics = evaluate(kernel.model, mcmc.get_samples(), X_test, y=y_test)

For a draw ``θ_s`` the observed site gives ``p(y_i | θ_s)``; the posterior predictive
distribution is their average over the draws,
``p(y_i | data) ≈ (1/S) Σ_s p(y_i | θ_s)``, the Bayesian model average (for ``K`` modes, the
deep ensemble of Lakshminarayanan et al. 2017).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import logsumexp
from numpyro.handlers import seed, substitute, trace

from numpyro_sgmc.data.subsample import full_data

__all__ = [
    "evaluate",
    "expected_calibration_error",
    "gaussian_nll",
    "lppd",
    "predictive_distribution",
]


def _num_draws(samples: dict) -> int:
    """The common length ``S`` of the leading axis of every draw."""
    lengths = {
        name: jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        for name, value in samples.items()
        for leaf in jax.tree.leaves(value)
    }
    if not lengths or 0 in lengths.values():
        raise ValueError("samples has no draws: pass a dict of draws, site name -> (S, ...).")
    if None in lengths.values() or len(set(lengths.values())) > 1:
        raise ValueError(
            "Every draw needs the same leading draw axis; got leading lengths "
            f"{lengths} (None: a scalar without a draw axis)."
        )
    return next(iter(lengths.values()))


def _check_trace(model_trace, draw: dict, site: str) -> None:
    """Check that ``site`` is a sample site and that every latent site it needs has draws.

    A latent site that shares a plate with ``site`` (another per-datum variable, e.g. a second
    observation the model was run without) is drawn by the model itself; any other latent
    site must have draws.
    """
    sample_sites = [name for name, s in model_trace.items() if s["type"] == "sample"]
    if site not in sample_sites:
        raise ValueError(
            f"Site '{site}' is not a sample site of the model; its sample sites are "
            f"{sample_sites}. Pass the observed site's name as site=..."
        )
    site_plates = {frame.name for frame in model_trace[site]["cond_indep_stack"]}
    missing = [
        name
        for name in sample_sites
        if name != site
        and name not in draw
        and not model_trace[name]["is_observed"]
        and not site_plates & {frame.name for frame in model_trace[name]["cond_indep_stack"]}
    ]
    if missing:
        raise ValueError(
            f"samples has no draws of the latent site(s) {missing}; it has {sorted(draw)}. "
            "Pass the constrained draws of every latent site (e.g. mcmc.get_samples())."
        )


def predictive_distribution(
    model: Callable, samples: dict, *args, site: str = "obs", draw_chunk: int = 256, **kwargs
):
    """The distribution of site ``site`` under every draw, batched over the draws.

    For each draw ``θ_s`` this runs ``model(*args, **kwargs)`` with the latent sites
    substituted by ``θ_s`` and every subsample plate over all of its rows
    (:class:`~numpyro_sgmc.data.subsample.full_data`), and records the distribution object of
    ``site``. NumPyro distributions are pytrees, so the ``S`` of them are returned as one
    distribution whose parameters have a leading draw axis; its ``batch_shape`` attribute is
    that of a single draw. Map over the draws with :func:`jax.vmap`, which works for every
    distribution::

        fn = predictive_distribution(model, samples, X_test)
        log_lik = jax.vmap(lambda d: d.log_prob(y_test))(fn)  # (S, N)

    Draws are processed ``draw_chunk`` at a time (:func:`jax.lax.map`), which bounds the
    memory of the intermediate values of the model to that of ``draw_chunk`` runs.

    :param model: a NumPyro model; plates with ``subsample_size`` run over all rows.
    :param dict samples: site name -> constrained draws ``(S, ...)``; sites that are not latent
        sites of the model (deterministic sites, the observed site) are ignored.
    :param args: the model's positional arguments (the new inputs).
    :param site: name of the sample site whose distribution is returned.
    :param draw_chunk: number of draws evaluated together.
    :param kwargs: the model's keyword arguments.
    :return: the distribution of ``site``, its parameters with a leading axis of length ``S``.
    :raises ValueError: ``site`` is not a sample site of the model; draws of a latent site are
        missing; the draws have different leading lengths.
    """
    num_draws = _num_draws(samples)
    model = seed(full_data(model), 0)

    def site_distribution(draw):
        def latent_value(msg):  # the observed site, deterministic sites and plates keep theirs
            if msg["type"] == "sample" and not msg["is_observed"] and msg["name"] != site:
                return draw.get(msg["name"])
            return None

        model_trace = trace(substitute(model, substitute_fn=latent_value)).get_trace(
            *args, **kwargs
        )
        _check_trace(model_trace, draw, site)
        return model_trace[site]["fn"]

    return jax.lax.map(site_distribution, samples, batch_size=min(draw_chunk, num_draws))


@jax.jit
def lppd(log_likelihood) -> jax.Array:
    """Log pointwise predictive density per datum (larger is better).

    .. math::

        \\mathrm{lppd} = \\frac{1}{N}\\sum_{i=1}^N \\log\\Big(\\frac{1}{S}\\sum_{s=1}^S
        p(y_i\\mid\\theta_s)\\Big)

    the mean over the data of the log of the Monte Carlo posterior predictive density
    (Gelman, Hwang, Vehtari, *Understanding predictive information criteria for Bayesian
    models*, Statistics and Computing 2014, whose lppd is the sum, ``N`` times this),
    computed with a log-sum-exp over the draws.

    :param log_likelihood: ``(S, N)`` array of ``log p(y_i | θ_s)``, draws along axis 0.
    :return: the lppd per datum, a scalar array.
    """
    log_likelihood = jnp.asarray(log_likelihood)
    num_draws = log_likelihood.shape[0]
    return jnp.mean(logsumexp(log_likelihood, axis=0) - math.log(num_draws))


@partial(jax.jit, static_argnames="num_bins")
def expected_calibration_error(probs, y, num_bins: int = 15) -> jax.Array:
    """Expected calibration error of class probabilities (Guo et al. 2017).

    Each datum is put in the bin ``((m-1)/M, m/M]`` of its confidence
    ``c_i = max_k probs[i, k]`` (``M = num_bins`` equal-width bins), and

    .. math::

        \\mathrm{ECE} = \\sum_{m=1}^M \\frac{|B_m|}{N}\\,
        \\big|\\mathrm{acc}(B_m) - \\mathrm{conf}(B_m)\\big|

    with ``acc(B_m)`` the fraction of the bin's data whose most probable class is the label
    and ``conf(B_m)`` their mean confidence. 0 is perfect calibration. Reference: C. Guo,
    G. Pleiss, Y. Sun, K. Q. Weinberger, *On Calibration of Modern Neural Networks*, ICML 2017.

    :param probs: ``(N, C)`` predictive class probabilities.
    :param y: ``(N,)`` integer labels.
    :param num_bins: number of equal-width confidence bins ``M``.
    :return: the ECE, a scalar array in ``[0, 1]``.
    """
    probs, y = jnp.asarray(probs), jnp.asarray(y)
    confidence = jnp.max(probs, axis=-1)
    correct = (jnp.argmax(probs, axis=-1) == y).astype(confidence.dtype)
    bins = jnp.clip(jnp.ceil(confidence * num_bins).astype(jnp.int32) - 1, 0, num_bins - 1)
    # |B_m| (acc - conf) is the bin's sum of (correct - confidence)
    gaps = jnp.bincount(bins, weights=correct - confidence, length=num_bins)
    return jnp.sum(jnp.abs(gaps)) / y.shape[0]


def _categorical_base(fn):
    """The categorical distribution ``fn`` is (possibly expanded to a plate), else ``None``."""
    while isinstance(fn, dist.ExpandedDistribution):
        fn = fn.base_dist
    return fn if isinstance(fn, (dist.CategoricalLogits, dist.CategoricalProbs)) else None


@partial(jax.jit, static_argnames="num_bins")
def _classification_metrics(fn, y, num_bins: int) -> dict:
    """lppd, accuracy and ECE of the averaged class probabilities of the draws ``fn``."""
    num_draws = jax.tree.leaves(fn)[0].shape[0]
    num_classes = jnp.shape(_categorical_base(fn).logits)[-1]
    classes = jnp.arange(num_classes).reshape((num_classes,) + (1,) * y.ndim)
    class_log_lik = jax.vmap(lambda d: d.log_prob(classes))(fn)  # (S, C, *y.shape)
    probs = jnp.moveaxis(jnp.exp(logsumexp(class_log_lik, axis=0) - math.log(num_draws)), 0, -1)
    return {
        "lppd": lppd(jax.vmap(lambda d: d.log_prob(y))(fn)),
        "accuracy": jnp.mean(jnp.argmax(probs, axis=-1) == y),
        "ece": expected_calibration_error(probs, y, num_bins),
    }


@jax.jit
def gaussian_nll(means, variances, y) -> jax.Array:
    """Negative log-likelihood per datum of the moment-matched Gaussian predictive (smaller is
    better).

    .. math::

        \\bar\\mu_i = \\frac{1}{S}\\sum_s \\mu_{si}, \\qquad
        \\bar\\sigma_i^2 = \\frac{1}{S}\\sum_s \\sigma_{si}^2
            + \\frac{1}{S}\\sum_s (\\mu_{si} - \\bar\\mu_i)^2, \\qquad
        \\mathrm{NLL} = \\frac{1}{N}\\sum_i \\Big[\\tfrac12 \\log(2\\pi\\bar\\sigma_i^2)
            + \\frac{(y_i - \\bar\\mu_i)^2}{2\\bar\\sigma_i^2}\\Big],

    the aleatoric (mean of the variances) plus the epistemic (variance of the means) variance
    of the draws: the "NLL (distributional regression)" of ``sklearn-contrib-bde``
    (``BdeRegressor.predict(mean_and_std=True)``, its paper's regression benchmark). Unlike
    ``-lppd`` it scores a Gaussian with the mixture's first two moments, not the mixture.

    :param means: ``(S, N)`` (or ``(S, ...)``) predictive means of the draws.
    :param variances: their predictive variances, the same shape.
    :param y: ``(N,)`` (or ``(...)``) observations.
    :return: the mean over every element of ``y``, a scalar array.
    """
    mean = jnp.mean(means, axis=0)
    variance = jnp.mean(variances, axis=0) + jnp.var(means, axis=0)
    return jnp.mean(0.5 * jnp.log(2 * jnp.pi * variance) + 0.5 * jnp.square(y - mean) / variance)


@jax.jit
def _regression_metrics(fn, y) -> dict:
    """lppd of the draws ``fn``, RMSE of their averaged mean and the Gaussian NLL."""
    means = jax.vmap(lambda d: d.mean)(fn)
    return {
        "lppd": lppd(jax.vmap(lambda d: d.log_prob(y))(fn)),
        "rmse": jnp.sqrt(jnp.mean(jnp.square(jnp.mean(means, axis=0) - y))),
        "gaussian_nll": gaussian_nll(means, jax.vmap(lambda d: d.variance)(fn), y),
    }


def evaluate(
    model: Callable,
    samples: dict,
    *args,
    y,
    site: str = "obs",
    num_bins: int = 15,
    draw_chunk: int = 256,
    **kwargs,
) -> dict:
    """Posterior-predictive metrics of draws on held-out data.

    Runs ``model(*args, **kwargs)`` once per draw (:func:`predictive_distribution`; the model
    is not given ``y``, so its observations default to ``None``) and compares the
    distribution of ``site`` with ``y``:

    * a categorical site (``dist.Categorical``): the predictive class probabilities
      ``p̄_ik = (1/S) Σ_s p(k | x_i, θ_s)`` give ``"lppd"`` (``mean_i log p̄_{i y_i}``, see
      :func:`lppd`), ``"accuracy"`` (of ``argmax_k p̄_ik``) and ``"ece"``
      (:func:`expected_calibration_error` with ``num_bins`` bins);
    * any other site: ``"lppd"`` from ``log p(y_i | θ_s)``, ``"rmse"``, the root mean
      squared error of the predictive mean ``(1/S) Σ_s E[y_i | θ_s]`` (over every element of
      ``y``), and ``"gaussian_nll"`` (:func:`gaussian_nll`, from the draws' means and
      variances).

    Example, on the full-data version of the model the kernel ran::

        evaluate(kernel.model, mcmc.get_samples(), X_test, y=y_test)

    :param model: a NumPyro model; plates with ``subsample_size`` run over all rows.
    :param dict samples: site name -> constrained draws ``(S, ...)``.
    :param args: the model's positional arguments (the test inputs).
    :param y: the held-out observations of ``site``, of the site's shape for these inputs.
    :param site: name of the observed sample site.
    :param num_bins: number of confidence bins of the ECE.
    :param draw_chunk: number of draws evaluated together.
    :param kwargs: the model's keyword arguments.
    :return: a dict of Python floats: ``lppd``, ``accuracy``, ``ece`` (categorical) or
        ``lppd``, ``rmse``, ``gaussian_nll`` (otherwise).
    :raises ValueError: as :func:`predictive_distribution`; ``y`` of another shape than the
        site.
    """
    fn = predictive_distribution(model, samples, *args, site=site, draw_chunk=draw_chunk, **kwargs)
    y = jnp.asarray(y)
    site_shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
    if y.shape != site_shape:
        raise ValueError(
            f"y has shape {y.shape}, but site '{site}' has shape {site_shape} for these inputs."
        )
    if _categorical_base(fn) is not None:
        metrics = _classification_metrics(fn, y, num_bins)
    else:
        metrics = _regression_metrics(fn, y)
    return {name: float(value) for name, value in metrics.items()}
