"""shuffle_to_disk: a uniformly random common order of the rows, written in bounded memory."""

import math

import jax
import numpy as np
import pytest
from scipy import stats

from numpyro_sgmc import shuffle_to_disk


def test_rows_stay_together_and_each_appears_once(tmp_path):
    """Many buckets (a buffer of 4 KiB for 200 KiB of data): the arrays share one order, every
    row appears once, and the results are read-only memory maps of ``.npy`` files."""
    n = 10_007
    rng = np.random.default_rng(0)
    images = rng.standard_normal((n, 2, 3)).astype(np.float32)
    source = np.lib.format.open_memmap(tmp_path / "images.npy", mode="w+", shape=images.shape,
                                       dtype=images.dtype)  # fmt: skip
    source[:] = images
    source.flush()
    data = {"images": np.load(tmp_path / "images.npy", mmap_mode="r"), "row": np.arange(n)}
    out = shuffle_to_disk(jax.random.key(0), data, tmp_path / "shuffled", 4096, progress=False)
    assert set(out) == {"images", "row"} and all(isinstance(a, np.memmap) for a in out.values())
    assert not out["row"].flags.writeable
    assert np.array_equal(np.sort(out["row"]), np.arange(n))
    assert np.array_equal(out["images"], images[out["row"]])
    assert not np.array_equal(out["row"], np.arange(n))
    assert sorted(p.name for p in (tmp_path / "shuffled").iterdir()) == ["images.npy", "row.npy"]


@pytest.mark.parametrize(
    "memory_bytes",
    [pytest.param(64, marks=pytest.mark.slow), 2**20],  # 7 s, 5 s
    ids=["two buckets", "one bucket"],
)
def test_every_order_is_equally_likely(tmp_path, memory_bytes):
    """Over 2400 keys, the 24 orders of 4 rows each come about 100 times: a chi-square test
    at level 0.001 (with two buckets, the bucket sizes and contents make the order too)."""
    counts = {}
    for k in range(2400):
        (order,) = shuffle_to_disk(jax.random.key(k), [np.arange(4)], tmp_path / str(k),
                                   memory_bytes, progress=False)  # fmt: skip
        counts[tuple(order)] = counts.get(tuple(order), 0) + 1
    observed = np.array(list(counts.values()) + [0] * (math.factorial(4) - len(counts)))
    statistic = stats.chisquare(observed).statistic
    assert statistic < stats.chi2.ppf(0.999, df=23), counts


def test_the_order_is_the_keys(tmp_path):
    x = np.arange(1000)
    (a,) = shuffle_to_disk(jax.random.key(3), (x,), tmp_path / "a", 1024, progress=False)
    (b,) = shuffle_to_disk(jax.random.key(3), (x,), tmp_path / "b", 1024, progress=False)
    (c,) = shuffle_to_disk(jax.random.key(4), (x,), tmp_path / "c", 1024, progress=False)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_bad_input_is_said(tmp_path):
    with pytest.raises(ValueError, match=r"same number of rows, got X: 10, y: 9"):
        shuffle_to_disk(jax.random.key(0), {"X": np.zeros((10, 2)), "y": np.zeros(9)}, tmp_path)
    with pytest.raises(ValueError, match="smaller than 8 rows"):
        shuffle_to_disk(jax.random.key(0), {"X": np.zeros((10, 100))}, tmp_path, memory_bytes=100)
    with pytest.raises(TypeError, match=r"\{name: array\}"):
        shuffle_to_disk(jax.random.key(0), np.zeros(3), tmp_path)
    shuffle_to_disk(jax.random.key(0), {"X": np.arange(5)}, tmp_path, progress=False)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        shuffle_to_disk(jax.random.key(1), {"X": np.arange(5)}, tmp_path, progress=False)
    (again,) = shuffle_to_disk(jax.random.key(1), [np.arange(5)], tmp_path, progress=False)
    out = shuffle_to_disk(jax.random.key(1), {"X": np.arange(5)}, tmp_path, progress=False,
                          overwrite=True)  # fmt: skip
    assert np.array_equal(out["X"], again)
    # nothing of the work is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.npy", "arr_0.npy"]


def test_the_files_are_in_jax_dtypes(tmp_path):
    """float64 and int64 are written as the float32 and int32 JAX computes in (so the kernels
    use the files as they are); ``jax_dtypes=False`` keeps them; integers beyond int32 are an
    error that names the array and the fix."""
    x = np.linspace(0.0, 1.0, 50)
    codes = np.arange(50, dtype=np.int64)
    out = shuffle_to_disk(jax.random.key(0), {"x": x, "c": codes}, tmp_path / "a", 256,
                          progress=False)  # fmt: skip
    assert out["x"].dtype == np.float32 and out["c"].dtype == np.int32
    assert np.array_equal(out["x"], x.astype(np.float32)[out["c"]])
    kept = shuffle_to_disk(jax.random.key(0), {"x": x}, tmp_path / "b", progress=False,
                           jax_dtypes=False)  # fmt: skip
    assert kept["x"].dtype == np.float64
    with pytest.raises(ValueError, match=r"'big' holds integers beyond int32.*jax_dtypes=False"):
        shuffle_to_disk(jax.random.key(0), {"big": codes * 2**40}, tmp_path / "c", progress=False)


def test_a_cast_of_a_memory_map_larger_than_half_the_memory_is_refused(tmp_path, monkeypatch):
    """A float64 memory map would be read whole into memory to cast it to float32: where that
    copy is more than half the machine's memory (here a machine of 1 MiB) autotune refuses,
    naming the sizes and shuffle_to_disk; the float32 copy that writes runs."""
    from numpyro_sgmc import autotune
    from numpyro_sgmc.data import validation
    from problems import linear_regression, make_linear_regression

    problem = make_linear_regression(n=50_000)
    path = tmp_path / "X.npy"
    source = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=problem.X.shape)
    source[:] = np.asarray(problem.X)
    source.flush()
    X = np.load(path, mmap_mode="r")
    monkeypatch.setattr(validation, "physical_memory", lambda: 2.0**20)
    with pytest.raises(ValueError, match=r"argument 'X' \(position 0\) is a memory map of dtype "
                       r"float64 and 0.0\d+ GiB.*numpyro_sgmc.shuffle_to_disk"):  # fmt: skip
        autotune(linear_regression, jax.random.key(0), X, np.asarray(problem.y))
    data = shuffle_to_disk(jax.random.key(1), {"X": X, "y": np.asarray(problem.y)}, tmp_path / "s",
                           progress=False)  # fmt: skip
    assert data["X"].dtype == np.float32
    _, report = autotune(linear_regression, jax.random.key(0), data["X"], data["y"])
    assert np.all(np.isfinite(report.predicted_sd))


class _ChunkedStore:
    """An array-like that is not a NumPy array (as zarr, h5py and tensorstore arrays are): a
    shape, a dtype, row slices and ``__array__``, which reads all of it."""

    def __init__(self, data):
        self.data, self.shape, self.dtype = data, data.shape, data.dtype

    def __getitem__(self, key):
        return self.data[key]

    def __len__(self):
        return len(self.data)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.data, dtype)


def test_a_store_larger_than_half_the_memory_is_refused_and_converted_in_chunks(
    tmp_path, monkeypatch
):
    from numpyro_sgmc import autotune
    from numpyro_sgmc.data import validation
    from problems import linear_regression, make_linear_regression

    problem = make_linear_regression(n=1000)
    store = _ChunkedStore(np.asarray(problem.X))
    _, small = autotune(linear_regression, jax.random.key(0), store, np.asarray(problem.y))
    monkeypatch.setattr(validation, "physical_memory", lambda: 2.0**14)
    with pytest.raises(ValueError, match=r"argument 'X' \(position 0\) is a test_on_disk\._Chunke"
                       r"dStore of 1.1\de-05 GiB.*numpyro_sgmc.shuffle_to_disk"):  # fmt: skip
        autotune(linear_regression, jax.random.key(0), store, np.asarray(problem.y))
    data = shuffle_to_disk(jax.random.key(1), {"X": store, "y": np.asarray(problem.y)},
                           tmp_path / "s", progress=False)  # fmt: skip
    _, report = autotune(linear_regression, jax.random.key(0), data["X"], data["y"])
    np.testing.assert_allclose(report.predicted_sd, small.predicted_sd, rtol=1e-3)
