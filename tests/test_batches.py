"""Batch index samplers: the keyed permutation, distinct indices, epochs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_sgmc.data.batches import batch_sampler, permuted_index, shuffle_rows
from numpyro_sgmc.data.subsample import SubsamplePlate


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 12345, 2**16 + 1])
def test_permuted_index_is_a_bijection(n):
    for seed in range(3):
        out = np.asarray(permuted_index(jax.random.key(seed), jnp.arange(n), n))
        np.testing.assert_array_equal(np.sort(out), np.arange(n))


@pytest.mark.parametrize("n", [10, 37])
def test_pairs_of_permuted_indices_are_uniform(n):
    """(π(0), π(1)) over 20000 keys is uniform on the n(n-1) ordered pairs of distinct values.

    Pairwise uniformity is what the ``(n-b)/(n-1)`` variance of a batch relies on; 4 Feistel
    rounds fail this at n = 10 (z = 55), 8 pass.
    """
    keys = jax.random.split(jax.random.key(0), 20000)
    pair = np.asarray(jax.vmap(lambda k: permuted_index(k, jnp.arange(2), n))(keys))
    counts = np.zeros((n, n))
    np.add.at(counts, (pair[:, 0], pair[:, 1]), 1)
    assert np.all(np.diag(counts) == 0)
    expected = len(keys) / (n * (n - 1))
    off = ~np.eye(n, dtype=bool)
    chi2 = np.sum((counts[off] - expected) ** 2 / expected)
    dof = n * (n - 1) - 1
    assert (chi2 - dof) / np.sqrt(2 * dof) < 4.0


def test_without_replacement_draws_distinct_indices():
    plates = (SubsamplePlate("data", 1000, 300),)
    sampler = batch_sampler(plates, "without_replacement")
    for seed in range(5):
        batch, _ = sampler.draw(sampler.init(jax.random.key(0)), jax.random.key(seed))
        idx = np.asarray(batch.indices["data"])
        assert idx.shape == (300,) and len(set(idx.tolist())) == 300
        assert idx.min() >= 0 and idx.max() < 1000


@pytest.mark.slow
def test_epochs_visit_each_datum_at_most_once_per_epoch():
    plates = (SubsamplePlate("a", 103, 10), SubsamplePlate("b", 40, 8))
    sampler = batch_sampler(plates, "epochs")
    state = sampler.init(jax.random.key(1))
    seen = {"a": [], "b": []}
    for t in range(20):
        batch, state = sampler.draw(state, jax.random.key(100 + t))
        for name in seen:
            seen[name].append(np.asarray(batch.indices[name]))
    a = np.stack(seen["a"])  # 10 steps per epoch, 3 left out each epoch
    for epoch in (a[:10], a[10:20]):
        assert len(set(epoch.ravel().tolist())) == 100
    assert set(a[:10].ravel().tolist()) != set(a[10:20].ravel().tolist()) or not np.array_equal(
        a[:10], a[10:20]
    )
    b = np.stack(seen["b"])  # 5 steps per epoch: every datum exactly once
    for epoch in b.reshape(4, 5, 8):
        np.testing.assert_array_equal(np.sort(epoch.ravel()), np.arange(40))


def test_full_batch_is_the_data_in_order():
    plates = (SubsamplePlate("data", 50, 50),)
    for method in ("with_replacement", "without_replacement", "epochs", "blocks"):
        sampler = batch_sampler(plates, method)
        batch, _ = sampler.draw(sampler.init(jax.random.key(0)), jax.random.key(1))
        np.testing.assert_array_equal(batch.indices["data"], np.arange(50))


def test_unknown_method():
    with pytest.raises(ValueError, match="Unknown batch_sampling 'shuffle'.*epochs"):
        batch_sampler((SubsamplePlate("data", 10, 2),), "shuffle")


def test_blocks_are_consecutive_rows_wrapping_around():
    plates = (SubsamplePlate("data", 50, 20),)
    sampler = batch_sampler(plates, "blocks")
    for seed in range(20):
        batch, _ = sampler.draw((), jax.random.key(seed))
        idx = np.asarray(batch.indices["data"])
        np.testing.assert_array_equal(idx, (idx[0] + np.arange(20)) % 50)


def test_shuffle_rows_keeps_rows_together():
    X = np.arange(20.0).reshape(10, 2)
    y = np.arange(10.0)
    Xs, ys = shuffle_rows(jax.random.key(0), X, y)
    np.testing.assert_array_equal(np.asarray(Xs)[:, 0], 2 * np.asarray(ys))
    assert sorted(np.asarray(ys).tolist()) == list(range(10))
    assert not np.array_equal(np.asarray(ys), y)
    np.testing.assert_array_equal(shuffle_rows(jax.random.key(0), y), ys)
    with pytest.raises(ValueError, match="same number of rows"):
        shuffle_rows(jax.random.key(0), X, y[:5])
