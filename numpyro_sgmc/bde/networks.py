"""Bayesian neural networks as NumPyro models: a multilayer perceptron and a small LeNet.

The models of the Bayesian deep-ensemble workflow (SGHMC chains started at ``K`` Adam modes).
Each factory returns a model ``model(X, y=None)`` with an isotropic Gaussian prior
``N(0, prior_scale²)`` on every weight and bias, a data plate ``"data"`` (subsampled when
``batch_size`` is set, as the kernels expect) and the observed site ``"obs"``.

**Sites are layers.** Every layer's kernel and bias are their own sample site, named
``"<layer><index>.kernel"`` and ``"<layer><index>.bias"`` (``"conv0.kernel"``,
``"conv0.bias"``, ``"conv1.kernel"``, …, ``"dense0.kernel"``, …), the index counting the
layers of a kind in the order the input meets them and zero-padded when there are ten or more,
so that sorting the names (the order of the flattened parameters, see
:class:`~numpyro_sgmc.data.model.Layout`) keeps the layers in order. A sample site is
the parameter group of the layer-wise preconditioners (``docs/theory.md`` §6): their
statistics are averaged within a site, so one site per kernel and per bias gives every layer's
weights and biases their own step size. The Gaussian-likelihood MLP with a learned
homoscedastic noise has one more site, ``"noise_scale"``.

**Parametrisation.** By default (``parametrization="ntk"``) a layer with fan-in ``m`` (inputs
per output unit: ``m`` for a dense layer, ``3·3·C`` for a 3×3 convolution over ``C`` channels)
computes

.. math::

    h = \\sqrt{2/m}\\; x W + b, \\qquad W_{ij},\\ b_j \\sim N(0, s^2),

so the prior stays isotropic in the parameters while the prior over functions does not change
with the width (Neal 1996): this is the standard parametrisation ``h = xW + b`` with the
fan-in-scaled prior ``W ~ N(0, 2s²/m)``, written in variables that all have the same prior
scale (the NTK parametrisation of Jacot et al. 2018). With ``prior_scale=1`` the effective
kernels ``√(2/m) W`` of a prior draw follow He et al.'s (2015) initialisation: the gain ``√2``
makes up for the half of the second moment a ReLU removes, so the signal keeps its scale
through the layers (the gain recommended for ``tanh``, 5/3, is close). Both choices were
measured with Adam (learning rate ``1e-2``, full batch) from NumPyro's ``init_to_uniform``
(every parameter uniform on ``(-2, 2)``). Without the ``1/√m`` (standard parametrisation, same
isotropic prior) the initial loss per datum is in the hundreds to thousands instead of the
tens, and the 50-unit MLP overfits the 354 standardised diabetes training records (test RMSE
1.6 to 2.5 standard deviations, against 0.71 to 0.77 here). Without the gain ``√2`` the input
signal of :func:`lenet` is lost among the biases and Adam stalls at chance accuracy on 600
training digits (here: 84–87% after 300 steps; 90–93% on the 1438 training digits of
:func:`numpyro_sgmc.bde.datasets.digits`). The price of a prior that is scaled to the function is
that it matters on small data: on 300 training digits the fit of :func:`lenet` often stays
near zero weights (chance accuracy); a larger ``prior_scale`` weakens the prior.

:func:`mlp` also takes ``parametrization="standard"``, ``h = xW + b`` with ``W_ij, b_j ~
N(0, s²)``: the network of ``sklearn-contrib-bde`` (and of most Bayesian-neural-network
benchmarks), whose ``N(0, 1)`` prior on every weight is much wider on the function than the
default's. Start an optimizer for it at :func:`init_to_fan_in` (LeCun's ``W ~ N(0, 1/m)``,
zero biases), not at NumPyro's ``init_to_uniform`` (every weight uniform on ``(-2, 2)``, whose
outputs grow by a factor of about ``√(2m/3)`` per ReLU layer).

References: R. M. Neal, *Bayesian Learning for Neural Networks*, Springer 1996; A. Jacot,
F. Gabriel, C. Hongler, *Neural Tangent Kernel*, NeurIPS 2018; B. Lakshminarayanan,
A. Pritzel, C. Blundell, *Simple and Scalable Predictive Uncertainty Estimation using Deep
Ensembles*, NeurIPS 2017; K. He, X. Zhang, S. Ren, J. Sun, *Delving Deep into Rectifiers*,
ICCV 2015; Y. LeCun, L. Bottou, Y. Bengio, P. Haffner, *Gradient-Based Learning Applied to
Document Recognition*, Proc. IEEE 1998; Y. LeCun, L. Bottou, G. Orr, K.-R. Müller,
*Efficient BackProp*, Neural Networks: Tricks of the Trade, Springer 1998.
"""

from __future__ import annotations

import math
import numbers
from functools import partial
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from jax import lax, random
from numpyro.infer.initialization import init_to_median

__all__ = ["init_to_fan_in", "lenet", "mlp"]

_LIKELIHOODS = ("gaussian", "categorical")
_PARAMETRIZATIONS = ("ntk", "standard")
_NOISES = ("learned", "heteroscedastic")
_MIN_SCALE = 1e-6  # added to softplus(·) in the heteroscedastic scale, as sklearn-contrib-bde
_CONV_SIZE = 3  # 3x3 convolutions
_POOL_SIZE = 2  # 2x2 average pooling, stride 2


def _layer_names(kind: str, count: int) -> list:
    """``[kind0, kind1, …]``, the index zero-padded so the names sort in layer order."""
    width = len(str(count - 1))
    return [f"{kind}{i:0{width}d}" for i in range(count)]


def _layer(name: str, kernel_shape: tuple, prior_scale: float) -> tuple:
    """Sample a layer's kernel and bias, each its own site with prior ``N(0, prior_scale²)``."""
    prior = dist.Normal(0.0, prior_scale)
    kernel = numpyro.sample(
        f"{name}.kernel", prior.expand(kernel_shape).to_event(len(kernel_shape))
    )
    bias = numpyro.sample(f"{name}.bias", prior.expand(kernel_shape[-1:]).to_event(1))
    return kernel, bias


def _dense(x, kernel, bias):
    """``√(2/m) x W + b`` for the ``(m, k)`` kernel ``W``."""
    return math.sqrt(2 / kernel.shape[0]) * (x @ kernel) + bias


def _dense_standard(x, kernel, bias):
    """``x W + b`` (the standard parametrisation)."""
    return x @ kernel + bias


def init_to_fan_in(site=None):
    """NumPyro init strategy: LeCun's initialisation for the networks' layer sites.

    A site named ``"….kernel"`` starts at ``W ~ N(0, 1/m)``, ``m`` its fan-in (the product of
    every axis but the last: inputs per output unit), a ``"….bias"`` site at zero, and any
    other latent site at its prior median (:func:`numpyro.infer.initialization.init_to_median`).
    With :func:`mlp`'s ``parametrization="standard"`` every pre-activation then starts with
    about the variance of the layer's inputs (LeCun, Bottou, Orr & Müller 1998), which is how
    ``sklearn-contrib-bde`` initialises its members. Pass it as ``init_strategy=`` to
    :func:`numpyro_sgmc.warm_start` (each restart draws its own kernels) or to a kernel.

    :param dict site: a NumPyro site (``None`` returns the strategy itself).
    """
    if site is None:
        return partial(init_to_fan_in)  # NumPyro expects a strategy to be a partial
    if site["type"] != "sample" or site["is_observed"]:
        return None
    name = site["name"]
    if name.endswith((".kernel", ".bias")):
        shape = tuple(site["kwargs"].get("sample_shape", ())) + tuple(site["fn"].shape())
        if name.endswith(".bias"):
            return jnp.zeros(shape)
        fan_in = math.prod(shape[-len(site["fn"].shape()) : -1]) or 1
        return random.normal(site["kwargs"]["rng_key"], shape) / math.sqrt(fan_in)
    return init_to_median(site)


def _conv(x, kernel, bias):
    """Stride-1 ``SAME`` convolution of NHWC images with an HWIO kernel, scaled by ``√(2/m)``.

    Written as patch extraction and one matrix product (im2col): XLA:CPU runs a convolution
    whose kernel is batched over chains (``vmap``) about 30× slower inside a loop (a sampler's
    ``fori_loop``, the warm start's ``scan``) than this form, which stays as fast as outside.
    """
    kh, kw, cin, cout = kernel.shape
    patches = lax.conv_general_dilated_patches(
        x, (kh, kw), (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )  # features ordered (channel, row, column)
    matrix = jnp.reshape(jnp.transpose(kernel, (2, 0, 1, 3)), (cin * kh * kw, cout))
    return math.sqrt(2 / (kh * kw * cin)) * (patches @ matrix) + bias


def _avg_pool(x):
    """2×2 average pooling with stride 2 over the spatial axes of NHWC images (odd edges drop)."""
    window = (1, _POOL_SIZE, _POOL_SIZE, 1)
    return lax.reduce_window(x, 0.0, lax.add, window, window, "VALID") / _POOL_SIZE**2


def _check_positive_int(name: str, value) -> None:
    """Raise unless ``value`` is an integer of at least 1."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")


def _check_targets(y, expected: tuple) -> None:
    """Targets of another shape would broadcast against the outputs instead of pairing up."""
    if y is not None and tuple(jnp.shape(y)) != expected:
        raise ValueError(f"y must have shape {expected} for these inputs, got {jnp.shape(y)}.")


def _check_common(prior_scale, batch_size) -> None:
    """Raise unless ``prior_scale`` is positive and ``batch_size`` is ``None`` or positive."""
    if not prior_scale > 0:
        raise ValueError(f"prior_scale must be positive, got {prior_scale!r}.")
    if batch_size is not None:
        _check_positive_int("batch_size", batch_size)


def _check_mlp(num_outputs, hidden, likelihood, noise, parametrization) -> Optional[float]:
    """Raise unless :func:`mlp`'s arguments are valid; the fixed noise scale, else ``None``."""
    if likelihood not in _LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {_LIKELIHOODS}, got {likelihood!r}.")
    if parametrization not in _PARAMETRIZATIONS:
        raise ValueError(
            f"parametrization must be one of {_PARAMETRIZATIONS}, got {parametrization!r}."
        )
    fixed_noise = None
    if isinstance(noise, str):
        if noise not in _NOISES:
            raise ValueError(f"noise must be one of {_NOISES} or a positive number, got {noise!r}.")
    elif isinstance(noise, numbers.Real) and not isinstance(noise, bool) and noise > 0:
        fixed_noise = float(noise)
    else:
        raise ValueError(f"noise must be one of {_NOISES} or a positive number, got {noise!r}.")
    if likelihood == "categorical" and noise != "learned":
        raise ValueError(f"noise={noise!r} is for the Gaussian likelihood only.")
    _check_positive_int("num_outputs", num_outputs)
    if likelihood == "categorical" and num_outputs < 2:
        raise ValueError(
            f"A categorical likelihood needs num_outputs >= 2 classes, got {num_outputs}."
        )
    for width in hidden:
        _check_positive_int("every hidden width", width)
    return fixed_noise


def mlp(
    num_outputs: int = 1,
    hidden: Sequence[int] = (50,),
    *,
    likelihood: str = "gaussian",
    noise="learned",
    parametrization: str = "ntk",
    activation: Callable = jax.nn.relu,
    prior_scale: float = 1.0,
    batch_size: Optional[int] = None,
) -> Callable:
    """A fully connected Bayesian neural network for regression or classification.

    The model ``model(X, y=None)`` takes ``X`` of shape ``(N, D)`` (any trailing shape
    ``(N, ...)`` is flattened to ``(N, D)``) and computes
    ``f(x) = dense_L(a(… a(dense_0(x))))`` with the activation ``a`` between layers and the
    layers of the module docstring (sites ``"dense0.kernel"``, ``"dense0.bias"``, …, layer
    ``L = len(hidden)`` the output layer). The observed site ``"obs"`` is

    * ``likelihood="gaussian"``: ``y ~ Normal(μ(x), σ(x))``, with ``noise``

      - ``"learned"`` (default): ``μ = f``, one ``σ`` for every datum, the site
        ``"noise_scale"`` ``σ ~ HalfNormal(1)``;
      - ``"heteroscedastic"``: the output layer has ``2·num_outputs`` units, ``μ`` the first
        ``num_outputs`` and ``σ(x) = softplus(·) + 10⁻⁶`` the others (the network of
        Lakshminarayanan et al. 2017, and of ``sklearn-contrib-bde``);
      - a positive number: a fixed ``σ``, no site.

      Standardise ``y`` (and ``X``): the prior on the function and on ``σ`` is on the scale
      of 1. With ``num_outputs=1`` the output axis is dropped (``y`` of shape ``(N,)``);
      otherwise ``y`` is ``(N, num_outputs)``.
    * ``likelihood="categorical"``: ``y ~ Categorical(logits=f(x))``, ``y`` of shape ``(N,)``
      with integer labels in ``[0, num_outputs)``.

    The activation defaults to ReLU, as in the deep ensembles of Lakshminarayanan et al.
    (2017); ``jnp.tanh`` fits the diabetes data as well.

    :param num_outputs: output units: 1 (or the number of targets) for regression, the number
        of classes for classification.
    :param hidden: widths of the hidden layers; ``()`` gives a linear (or softmax) regression.
    :param likelihood: ``"gaussian"`` or ``"categorical"``.
    :param noise: the Gaussian likelihood's scale: ``"learned"``, ``"heteroscedastic"`` or a
        positive number (above); only ``"learned"`` (the default, ignored) with
        ``"categorical"``.
    :param parametrization: ``"ntk"`` (default; ``√(2/m) xW + b``, module docstring) or
        ``"standard"`` (``xW + b``; start optimizers at :func:`init_to_fan_in`).
    :param activation: elementwise nonlinearity after every hidden layer.
    :param prior_scale: standard deviation ``s`` of the isotropic prior on every weight.
    :param batch_size: ``subsample_size`` of the data plate (the kernels' minibatch size);
        ``None`` means no subsampling (every evaluation uses the full data).
    :return: the NumPyro model ``model(X, y=None)``.
    :raises ValueError: an unknown likelihood, noise or parametrisation, a noise other than
        ``"learned"`` with ``"categorical"``, fewer than 2 classes, or a non-positive size or
        scale; and, from the model, ``y`` of another shape than above.
    """
    hidden = tuple(hidden)
    fixed_noise = _check_mlp(num_outputs, hidden, likelihood, noise, parametrization)
    _check_common(prior_scale, batch_size)
    names = _layer_names("dense", len(hidden) + 1)
    dense = _dense if parametrization == "ntk" else _dense_standard
    heteroscedastic = likelihood == "gaussian" and noise == "heteroscedastic"
    num_units = 2 * num_outputs if heteroscedastic else num_outputs

    def model(X, y=None):
        one_per_datum = likelihood == "categorical" or num_outputs == 1
        _check_targets(y, (X.shape[0],) if one_per_datum else (X.shape[0], num_outputs))
        sizes = (math.prod(X.shape[1:]),) + hidden + (num_units,)
        layers = [
            _layer(name, (fan_in, fan_out), prior_scale)
            for name, fan_in, fan_out in zip(names, sizes[:-1], sizes[1:], strict=True)
        ]
        noise_scale = fixed_noise  # None when learned or heteroscedastic
        if likelihood == "gaussian" and noise == "learned":
            noise_scale = numpyro.sample("noise_scale", dist.HalfNormal(1.0))
        with numpyro.plate("data", X.shape[0], subsample_size=batch_size):
            Xb = numpyro.subsample(X, event_dim=X.ndim - 1)
            yb = None if y is None else numpyro.subsample(y, event_dim=jnp.ndim(y) - 1)
            h = jnp.reshape(Xb, (Xb.shape[0], -1))
            for kernel, bias in layers[:-1]:
                h = activation(dense(h, kernel, bias))
            f = dense(h, *layers[-1])
            if likelihood == "categorical":
                obs_dist = dist.Categorical(logits=f)
            else:
                mean, scale = f[..., :num_outputs], noise_scale
                if heteroscedastic:
                    scale = jax.nn.softplus(f[..., num_outputs:]) + _MIN_SCALE
                if num_outputs == 1:
                    obs_dist = dist.Normal(
                        mean[..., 0], scale[..., 0] if heteroscedastic else scale
                    )
                else:
                    obs_dist = dist.Normal(mean, scale).to_event(1)
            numpyro.sample("obs", obs_dist, obs=yb)

    return model


def lenet(
    num_classes: int = 10,
    *,
    channels: Sequence[int] = (8, 16),
    hidden: int = 64,
    prior_scale: float = 1.0,
    batch_size: Optional[int] = None,
) -> Callable:
    """A small LeNet-style Bayesian convolutional network for image classification.

    The model ``model(X, y=None)`` takes images ``X`` of shape ``(N, H, W)`` (one channel) or
    ``(N, H, W, C)`` and labels ``y`` of shape ``(N,)`` in ``[0, num_classes)``, and computes

    ``conv0`` (3×3, ``SAME``, ``channels[0]``) → ReLU → 2×2 average pool → ``conv1`` (3×3,
    ``SAME``, ``channels[1]``) → ReLU → 2×2 average pool → flatten → ``dense0`` (``hidden``)
    → ReLU → ``dense1`` (``num_classes``) → ``obs ~ Categorical(logits)``,

    with the sites ``"conv0.kernel"`` (shape ``(3, 3, C, channels[0])``, HWIO),
    ``"conv0.bias"``, ``"conv1.kernel"``, ``"conv1.bias"``, ``"dense0.kernel"`` (shape
    ``(⌊H/4⌋·⌊W/4⌋·channels[1], hidden)``), ``"dense0.bias"``, ``"dense1.kernel"``,
    ``"dense1.bias"``, parametrised as in the module docstring. Pooling drops an odd last row
    or column. The 8×8 scikit-learn digits (:func:`numpyro_sgmc.bde.datasets.digits`) give 2×2
    feature maps before ``dense0``. The convolution–subsampling stack is that of LeNet-5
    (LeCun et al. 1998), whose subsampling layers also average 2×2 neighbourhoods.

    :param num_classes: number of classes (output units).
    :param channels: output channels of the two convolutions.
    :param hidden: width of the hidden dense layer.
    :param prior_scale: standard deviation ``s`` of the isotropic prior on every weight.
    :param batch_size: ``subsample_size`` of the data plate; ``None`` means no subsampling.
    :return: the NumPyro model ``model(X, y=None)``.
    :raises ValueError: fewer than 2 classes, not two channel counts, or a non-positive size
        or scale; and, from the model, images that are not 3-d or 4-d or smaller than 4×4, or
        labels that are not ``(N,)``.
    """
    _check_positive_int("num_classes", num_classes)
    if num_classes < 2:
        raise ValueError(f"lenet needs num_classes >= 2, got {num_classes}.")
    channels = tuple(channels)
    if len(channels) != 2:
        raise ValueError(f"channels must give the two convolutions' widths, got {channels!r}.")
    for width in channels + (hidden,):
        _check_positive_int("every channel count and hidden", width)
    _check_common(prior_scale, batch_size)

    def model(X, y=None):
        if X.ndim not in (3, 4):
            raise ValueError(
                f"lenet takes images of shape (N, H, W) or (N, H, W, C), got shape {X.shape}."
            )
        height, width = X.shape[1:3]
        if min(height, width) < _POOL_SIZE**2:
            raise ValueError(f"lenet needs images of at least 4x4 pixels, got {height}x{width}.")
        _check_targets(y, X.shape[:1])
        in_channels = X.shape[3] if X.ndim == 4 else 1
        k = _CONV_SIZE
        flat = (height // _POOL_SIZE // _POOL_SIZE) * (width // _POOL_SIZE // _POOL_SIZE)
        conv0 = _layer("conv0", (k, k, in_channels, channels[0]), prior_scale)
        conv1 = _layer("conv1", (k, k, channels[0], channels[1]), prior_scale)
        dense0 = _layer("dense0", (flat * channels[1], hidden), prior_scale)
        dense1 = _layer("dense1", (hidden, num_classes), prior_scale)
        with numpyro.plate("data", X.shape[0], subsample_size=batch_size):
            Xb = numpyro.subsample(X, event_dim=X.ndim - 1)
            yb = None if y is None else numpyro.subsample(y, event_dim=0)
            h = Xb if X.ndim == 4 else Xb[..., None]
            h = _avg_pool(jax.nn.relu(_conv(h, *conv0)))
            h = _avg_pool(jax.nn.relu(_conv(h, *conv1)))
            h = jax.nn.relu(_dense(jnp.reshape(h, (h.shape[0], -1)), *dense0))
            numpyro.sample("obs", dist.Categorical(logits=_dense(h, *dense1)), obs=yb)

    return model
