"""The network models (one site per layer kernel and bias, the isotropic prior, fits by Adam)
and the bundled datasets (shapes, scales, a seeded partition of the rows)."""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from numpyro.handlers import block, seed, substitute, trace
from numpyro.infer.util import constrain_fn, log_density, potential_energy

from numpyro_sgmc.bde.datasets import diabetes, digits
from numpyro_sgmc.bde.networks import lenet, mlp
from numpyro_sgmc.bde.predictive import evaluate


@pytest.fixture(scope="module")
def digit_split():
    return digits(seed=0)


@pytest.fixture(scope="module")
def diabetes_split():
    return diabetes(seed=0)


def model_trace(model, *args):
    """The model's trace, run abstractly (:func:`jax.eval_shape`): shapes, nothing compiled."""
    sites = {}
    jax.eval_shape(lambda: sites.update(trace(seed(model, 0)).get_trace(*args)))
    return sites


def sample_sites(model, *args):
    return {name: s for name, s in model_trace(model, *args).items() if s["type"] == "sample"}


def shapes(sites):
    return {name: tuple(site["value"].shape) for name, site in sites.items()}


def random_params(sites, rng_seed=0):
    """Standard normal values (absolute values for the positive noise_scale) of latent sites."""
    rng = np.random.default_rng(rng_seed)
    return {
        name: jnp.asarray(np.abs(v) if name == "noise_scale" else v, jnp.float32)
        for name, site in sites.items()
        if not site["is_observed"]
        for v in [rng.standard_normal(site["value"].shape)]
    }


def init_to_uniform(model, X, y, rng_seed=0):
    """Unconstrained values uniform on (-2, 2) for every latent site, as NumPyro's
    ``init_to_uniform`` draws them (``initialize_model`` also checks them eagerly, op by op,
    which costs more than the fit here)."""
    rng = np.random.default_rng(rng_seed)
    return {
        name: jnp.asarray(rng.uniform(-2.0, 2.0, site["value"].shape), jnp.float32)
        for name, site in sample_sites(model, X, y).items()
        if not site["is_observed"]
    }


def adam_mode(model, X, y, num_steps, learning_rate=1e-2):
    """Full-batch Adam on the potential per datum from ``init_to_uniform``."""
    optimizer = optax.adam(learning_rate)

    def step(carry, _):
        z, state = carry
        loss, grad = jax.value_and_grad(
            lambda z: potential_energy(model, (X, y), {}, z) / X.shape[0]
        )(z)
        updates, state = optimizer.update(grad, state, z)
        return (optax.apply_updates(z, updates), state), loss

    @jax.jit
    def fit(z):
        (z, _), losses = lax.scan(step, (z, optimizer.init(z)), None, length=num_steps)
        return constrain_fn(model, (X, y), {}, z), losses

    params, losses = fit(init_to_uniform(model, X, y))
    return params, np.asarray(losses)


def test_mlp_has_one_site_per_kernel_and_bias():
    X, y = jnp.ones((7, 3)), jnp.zeros(7)
    sites = sample_sites(mlp(1, hidden=(5, 4)), X, y)
    assert shapes(sites) == {
        "dense0.kernel": (3, 5),
        "dense0.bias": (5,),
        "dense1.kernel": (5, 4),
        "dense1.bias": (4,),
        "dense2.kernel": (4, 1),
        "dense2.bias": (1,),
        "noise_scale": (),
        "obs": (7,),
    }
    for name, site in sites.items():
        if name == "obs":
            assert site["is_observed"] and [f.name for f in site["cond_indep_stack"]] == ["data"]
        else:  # a global site whose whole array is one event: one parameter group
            assert not site["is_observed"] and not site["cond_indep_stack"]
            assert site["fn"].batch_shape == () and site["fn"].event_shape == site["value"].shape


def test_mlp_categorical_multi_output_and_image_inputs():
    X = jnp.ones((7, 2, 3))  # trailing axes are flattened
    sites = sample_sites(mlp(4, hidden=(5,), likelihood="categorical"), X, jnp.zeros(7, int))
    assert "noise_scale" not in sites
    assert shapes(sites)["dense0.kernel"] == (6, 5)
    assert sites["obs"]["fn"].logits.shape == (7, 4)
    sites = sample_sites(mlp(2, hidden=()), jnp.ones((7, 3)), jnp.zeros((7, 2)))
    assert sites["obs"]["fn"].event_shape == (2,) and shapes(sites)["dense0.kernel"] == (3, 2)


def test_layer_names_sort_in_layer_order():
    sites = sample_sites(mlp(1, hidden=(2,) * 11), jnp.ones((3, 2)), jnp.zeros(3))
    layers = [name.split(".")[0] for name in sorted(sites) if name.startswith("dense")]
    assert layers == [f"dense{i:02d}" for i in range(12) for _ in range(2)]


def test_lenet_sites_on_digit_images(digit_split):
    X, y = digit_split.X_train[:5], digit_split.y_train[:5]
    model = lenet()
    sites = sample_sites(model, X, y)
    assert shapes(sites) == {
        "conv0.kernel": (3, 3, 1, 8),
        "conv0.bias": (8,),
        "conv1.kernel": (3, 3, 8, 16),
        "conv1.bias": (16,),
        "dense0.kernel": (2 * 2 * 16, 64),
        "dense0.bias": (64,),
        "dense1.kernel": (64, 10),
        "dense1.bias": (10,),
        "obs": (5,),
    }
    assert shapes(sample_sites(model, X[..., None], y)) == shapes(sites)  # explicit channel
    params = random_params(sites, rng_seed=1)
    logits = jax.jit(
        lambda params: trace(substitute(seed(model, 0), params)).get_trace(X)["obs"]["fn"].logits
    )(params)
    assert logits.shape == (5, 10) and np.all(np.isfinite(logits))
    assert 0.1 < float(jnp.std(logits)) < 10  # He-scaled: logits of order 1 under the prior


def test_lenet_other_sizes_and_bad_images():
    model = lenet(3, channels=(2, 4), hidden=6)
    sites = sample_sites(model, jnp.ones((4, 10, 9, 3)), jnp.zeros(4, int))  # odd edges drop
    assert shapes(sites)["conv0.kernel"] == (3, 3, 3, 2)
    assert shapes(sites)["dense0.kernel"] == (2 * 2 * 4, 6)
    assert sites["obs"]["fn"].logits.shape == (4, 3)
    with pytest.raises(ValueError, match=r"\(N, H, W\) or \(N, H, W, C\)"):
        sample_sites(model, jnp.ones((4, 64)))
    with pytest.raises(ValueError, match="at least 4x4"):
        sample_sites(model, jnp.ones((4, 3, 8)))
    with pytest.raises(ValueError, match=r"y must have shape \(4,\)"):
        sample_sites(model, jnp.ones((4, 8, 8)), jnp.zeros((4, 1), int))


def test_targets_of_the_wrong_shape_are_refused():
    X = jnp.ones((7, 3))
    with pytest.raises(ValueError, match=r"y must have shape \(7,\) for these inputs"):
        sample_sites(mlp(), X, jnp.zeros((7, 1)))  # would broadcast to (7, 7) otherwise
    with pytest.raises(ValueError, match=r"y must have shape \(7, 2\)"):
        sample_sites(mlp(2), X, jnp.zeros(7))


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: mlp(likelihood="poisson"), "likelihood must be one of"),
        (lambda: mlp(1, likelihood="categorical"), "num_outputs >= 2"),
        (lambda: mlp(hidden=(4, 0)), "hidden width"),
        (lambda: mlp(prior_scale=0.0), "prior_scale"),
        (lambda: lenet(batch_size=0), "batch_size"),
        (lambda: lenet(channels=(8,)), "two convolutions"),
        (lambda: lenet(1), "num_classes >= 2"),
    ],
)
def test_bad_arguments(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_batch_size_is_the_data_plate_subsample_size():
    y = jnp.zeros(20)
    for model, X, b in [
        (mlp(batch_size=6), jnp.ones((20, 3)), 6),
        (lenet(batch_size=4), jnp.ones((20, 8, 8)), 4),
    ]:
        sites = model_trace(model, X, y)
        assert sites["data"]["args"] == (20, b) and sites["obs"]["value"].shape == (b,)
    assert model_trace(mlp(), jnp.ones((20, 3)), y)["data"]["args"] == (20, None)


def test_prior_is_isotropic_normal():
    X, y = jnp.ones((6, 4)), jnp.zeros(6)
    s = 0.7
    model = mlp(hidden=(5, 3), prior_scale=s)
    params = random_params(sample_sites(model, X, y))
    prior_log_density = jax.jit(
        lambda params: log_density(block(model, hide=["obs"]), (X, y), {}, params)[0]
    )(params)
    expected = 0.0
    for name, value in params.items():
        w = np.asarray(value, np.float64)
        if name == "noise_scale":  # HalfNormal(1)
            expected += math.log(2) - 0.5 * w**2 - 0.5 * math.log(2 * math.pi)
        else:
            expected += np.sum(-0.5 * (w / s) ** 2 - math.log(s) - 0.5 * math.log(2 * math.pi))
    assert len(params) == 7  # three kernels, three biases, the noise scale
    np.testing.assert_allclose(prior_log_density, expected, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("network", ["mlp", "lenet"])
def test_adam_fits_digits(network, digit_split):
    X, y = jnp.asarray(digit_split.X_train[:600]), jnp.asarray(digit_split.y_train[:600])
    model = mlp(10, likelihood="categorical") if network == "mlp" else lenet()
    params, losses = adam_mode(model, X, y, num_steps=200, learning_rate=2e-2)
    assert losses[-1] < 0.7 * losses[0]
    metrics = evaluate(model, {name: v[None] for name, v in params.items()}, X, y=y)
    assert metrics["accuracy"] > 0.8, metrics


def test_adam_fits_diabetes(diabetes_split):
    split = diabetes_split
    model = mlp()
    params, losses = adam_mode(model, jnp.asarray(split.X_train), jnp.asarray(split.y_train), 300)
    assert losses[-20:].mean() < 0.7 * losses[:20].mean()
    draws = {name: v[None] for name, v in params.items()}
    metrics = evaluate(model, draws, split.X_test, y=split.y_test)
    # a linear regression has a test RMSE of about 0.7 standard deviations on these data
    assert metrics["rmse"] < 0.85, metrics
    assert 0.2 < float(params["noise_scale"]) < 1.0


def test_digits_split(digit_split):
    split = digit_split
    assert [a.shape for a in split[:4]] == [(1438, 8, 8), (1438,), (359, 8, 8), (359,)]
    assert split.X_train.dtype == np.float32 and split.y_train.dtype == np.int32
    assert split.X_train.min() == 0.0 and split.X_train.max() == 1.0
    assert set(np.unique(split.y_test)) == set(range(10))
    assert split.y_mean is None and split.y_scale is None
    # the two parts partition the rows of the bundled data
    from sklearn.datasets import load_digits

    full = load_digits()
    rows = np.concatenate(
        [
            np.column_stack([split.X_train.reshape(-1, 64) * 16, split.y_train]),
            np.column_stack([split.X_test.reshape(-1, 64) * 16, split.y_test]),
        ]
    )
    original = np.column_stack([full.data, full.target])
    np.testing.assert_array_equal(np.unique(rows, axis=0), np.unique(original, axis=0))
    assert len(rows) == len(original)
    # a seeded split: the same seed gives the same rows, another seed other rows
    again, other = digits(seed=0), digits(seed=1)
    for a, b in zip(split[:4], again[:4], strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(split.y_train, other.y_train)
    assert len(digits(test_fraction=0.5).y_test) == round(0.5 * 1797)


def test_diabetes_split(diabetes_split):
    split = diabetes_split
    assert [a.shape for a in split[:4]] == [(354, 10), (354,), (88, 10), (88,)]
    assert all(a.dtype == np.float32 for a in split[:4])
    np.testing.assert_allclose(split.X_train.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(split.X_train.std(0), 1.0, rtol=1e-5)
    np.testing.assert_allclose([split.y_train.mean(), split.y_train.std()], [0, 1], atol=1e-5)
    # y_mean and y_scale undo the standardisation; train and test partition the targets
    from sklearn.datasets import load_diabetes

    target = load_diabetes().target
    restored = np.concatenate([split.y_train, split.y_test]) * split.y_scale + split.y_mean
    np.testing.assert_allclose(np.sort(restored), np.sort(target), rtol=1e-5)
    np.testing.assert_array_equal(diabetes(seed=0).y_test, split.y_test)


def test_bad_test_fraction():
    for fraction in (0.0, 1.0, 1e-4):
        with pytest.raises(ValueError, match="test_fraction"):
            digits(test_fraction=fraction)


def test_missing_sklearn_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(ImportError, match=r'pip install "numpyro-sgmc\[examples\]"'):
        diabetes()


# ---- the regression networks and data of the sklearn-contrib-bde anchor ----------------


def test_mlp_heteroscedastic_standard_likelihood_by_hand():
    """``noise="heteroscedastic"``, ``parametrization="standard"``: ``h = xW + b``, the output
    layer's two units the mean and ``softplus(·) + 1e-6`` scale; no ``noise_scale`` site."""
    X = jnp.asarray(np.random.default_rng(1).standard_normal((9, 3)), jnp.float32)
    y = jnp.linspace(-1.0, 1.0, 9)
    model = mlp(1, hidden=(4,), noise="heteroscedastic", parametrization="standard")
    sites = sample_sites(model, X, y)
    assert shapes(sites)["dense1.kernel"] == (4, 2) and "noise_scale" not in sites
    params = random_params(sites)
    got = (
        log_density(model, (X, y), {}, params)[0]
        - log_density(block(model, hide=["obs"]), (X, y), {}, params)[0]
    )
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h = np.maximum(np.asarray(X, np.float64) @ p["dense0.kernel"] + p["dense0.bias"], 0)
    out = h @ p["dense1.kernel"] + p["dense1.bias"]
    scale = np.log1p(np.exp(out[:, 1])) + 1e-6
    expected = np.sum(-0.5 * ((np.asarray(y) - out[:, 0]) / scale) ** 2 - np.log(scale))
    expected -= 9 * 0.5 * math.log(2 * math.pi)
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_mlp_fixed_noise_has_no_noise_site():
    X, y = jnp.ones((5, 2)), jnp.zeros(5)
    sites = trace(seed(mlp(1, hidden=(3,), noise=0.5), 0)).get_trace(X, y)
    assert "noise_scale" not in sites
    np.testing.assert_array_equal(sites["obs"]["fn"].scale, 0.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(noise="huge"), "noise must be one of"),
        (dict(noise=-1.0), "noise must be one of"),
        (dict(noise=True), "noise must be one of"),
        (dict(parametrization="mup"), "parametrization must be one of"),
        (dict(num_outputs=3, likelihood="categorical", noise=1.0), "Gaussian likelihood only"),
    ],
)
def test_bad_noise_and_parametrization(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mlp(**kwargs)


def test_init_to_fan_in_is_lecun():
    """Kernels ``N(0, 1/m)`` (the sample variance of ``N`` entries within 4 of its relative
    standard deviations ``√(2/N)``), biases zero, other sites by ``init_to_median``."""
    from numpyro_sgmc.bde import init_to_fan_in

    model = mlp(1, hidden=(200, 100))
    X, y = jnp.ones((4, 50)), jnp.zeros(4)
    sites = trace(substitute(seed(model, 0), substitute_fn=init_to_fan_in)).get_trace(X, y)
    for name, fan_in in (("dense0.kernel", 50), ("dense1.kernel", 200), ("dense2.kernel", 100)):
        w = np.asarray(sites[name]["value"], np.float64)
        assert w.mean() == pytest.approx(0.0, abs=4 / math.sqrt(fan_in * w.size))
        assert w.var() * fan_in == pytest.approx(1.0, abs=4 * math.sqrt(2 / w.size))
    for name in ("dense0.bias", "dense1.bias", "dense2.bias"):
        np.testing.assert_array_equal(sites[name]["value"], 0.0)
    assert float(sites["noise_scale"]["value"]) > 0  # init_to_median: a median of 15 draws


@pytest.mark.parametrize(
    "loader, rows, features",
    [("airfoil", 1503, 5), ("concrete", 1030, 8), ("bike_sharing", 17379, 12)],
)
def test_bundled_regression_splits_are_sklearns(loader, rows, features):
    """The split is ``train_test_split(test_size=0.2, random_state=seed)`` and the scaling
    ``StandardScaler`` fitted on the training rows, as ``sklearn-contrib-bde``'s benchmark."""
    from sklearn.model_selection import train_test_split

    from numpyro_sgmc import bde

    split = getattr(bde, loader)(seed=0)
    num_test = math.ceil(0.2 * rows)
    assert [a.shape for a in split[:4]] == [
        (rows - num_test, features),
        (rows - num_test,),
        (num_test, features),
        (num_test,),
    ]
    assert all(a.dtype == np.float32 for a in split[:4])
    np.testing.assert_allclose([split.y_train.mean(), split.y_train.std()], [0, 1], atol=1e-5)
    np.testing.assert_allclose(split.X_train.mean(0), 0.0, atol=1e-4)
    np.testing.assert_allclose(split.X_train.std(0), 1.0, rtol=1e-4)
    # same rows as scikit-learn's split of the row indices
    train, test = train_test_split(np.arange(rows), test_size=0.2, random_state=0)
    target = np.concatenate([split.y_train, split.y_test]) * split.y_scale + split.y_mean
    order = np.argsort(np.concatenate([train, test]))
    other = getattr(bde, loader)(seed=1)
    assert not np.array_equal(split.y_test, other.y_test)
    restored = np.concatenate([other.y_train, other.y_test]) * other.y_scale + other.y_mean
    train1, test1 = train_test_split(np.arange(rows), test_size=0.2, random_state=1)
    np.testing.assert_allclose(
        restored[np.argsort(np.concatenate([train1, test1]))], target[order], rtol=1e-5, atol=1e-3
    )


def test_bundled_data_are_the_files_the_readme_lists():
    """The gzip files decompress to the SHA-256 sums in ``numpyro_sgmc/bde/data/README.md``."""
    import gzip
    import hashlib
    import re
    from importlib import resources

    folder = resources.files("numpyro_sgmc.bde").joinpath("data")
    listed = dict(
        (name, digest)
        for digest, name in re.findall(
            r"([0-9a-f]{64})  (\S+)", folder.joinpath("README.md").read_text()
        )
    )
    files = {"airfoil.csv": "airfoil.csv.gz", "concrete.data": "concrete.data.gz"}
    files["hour.csv"] = "bike_sharing_hour.csv.gz"
    assert set(listed) == set(files)
    for name, packed in files.items():
        raw = gzip.decompress(folder.joinpath(packed).read_bytes())
        assert hashlib.sha256(raw).hexdigest() == listed[name], name
