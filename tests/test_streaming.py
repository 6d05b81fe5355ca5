"""File-backed data in run_kernel: each batch's rows read from the file ahead of its steps,
the draws of the same run in memory, resume and checkpoints on the file, clear errors."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC

from numpyro_sgmc import SGHMC, SGLD, SGLDFP, autotune, check_run, load_run, run_kernel
from numpyro_sgmc.data import files, streaming
from numpyro_sgmc.data.subsample import SubsamplePlate
from problems import linear_regression, make_linear_regression, make_two_groups, two_groups


def _on_disk(tmp_path, **arrays):
    """The arrays written as ``.npy`` files and opened as read-only memory maps."""
    out = []
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", np.asarray(a))
        out.append(np.load(tmp_path / f"{name}.npy", mmap_mode="r"))
    return out


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=1000)


@pytest.fixture
def reads(monkeypatch):
    """The number of feeds read, with feeds of 8 kB (a few draws each), so that runs cross
    many feed boundaries, the end of warm-up and thinning groups among them."""
    monkeypatch.setattr(streaming, "FEED_BYTES", 8192)
    count = []
    gather = streaming.RowFeed._gather

    def counted(self, indices, steps):
        count.append(steps)
        return gather(self, indices, steps)

    monkeypatch.setattr(streaming.RowFeed, "_gather", counted)
    return count


@pytest.mark.parametrize(
    "kernel, num_chains",
    [
        (SGLD(linear_regression, 1e-3, num_steps=3), 1),
        pytest.param(  # 10 s: the quick suite's 10 minutes
            SGLDFP(linear_regression, 1e-3, num_steps=3, batch_sampling="epochs"),
            3,
            marks=pytest.mark.slow,
        ),
        pytest.param(  # 9 s: the quick suite's 10 minutes
            SGHMC(linear_regression, 5e-4, num_steps=3, batch_sampling="without_replacement"),
            2,
            marks=pytest.mark.slow,
        ),
        (SGLDFP(linear_regression, 1e-3, num_steps=3, batch_sampling="blocks"), 2),
    ],
    ids=["SGLD-1", "SGLDFP-epochs-3", "SGHMC-without-2", "SGLDFP-blocks-2"],
)
@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.CentreWarning")
def test_file_backed_draws_are_the_in_memory_draws(
    tmp_path, problem, reads, kernel, num_chains, monkeypatch
):
    X, y = _on_disk(tmp_path, X=problem.X, y=problem.y)
    settings = dict(num_warmup=23, num_samples=40, thinning=3, num_chains=num_chains)
    in_memory = run_kernel(kernel, jax.random.key(7), problem.X, problem.y, **settings)
    assert not reads
    blocks, read = [], streaming.BlockFile.read
    monkeypatch.setattr(
        streaming.BlockFile,
        "read",
        lambda self, out, first: blocks.append(first) or read(self, out, first),
    )
    from_file = run_kernel(kernel, jax.random.key(7), X, y, **settings)
    assert len(reads) > 5  # feeds of a few draws: many of them
    # "blocks": one read of each file (X, y) per batch of consecutive rows, some of which
    # wrap past the end
    by_blocks = kernel.recipe.options.batch_sampling == "blocks"
    assert len(blocks) == (2 * sum(reads) * num_chains if by_blocks else 0)
    assert sum(reads) >= (23 + 40 * 3) * 3
    for name, value in in_memory.samples.items():
        assert from_file.samples[name].shape == value.shape
        np.testing.assert_allclose(from_file.samples[name], value, rtol=1e-5, atol=1e-6)
    assert from_file.num_draws == in_memory.num_draws == 23 + 40 * 3


@pytest.mark.slow  # 10-23 s: the quick suite's 10 minutes
def test_two_plates_from_files_sample_the_exact_posterior(tmp_path):
    """Two plates of 2000 and 500 rows, both memory-mapped, through autotune, run_kernel and
    check_run; the draws against the exact Gaussian posterior within Monte Carlo error."""
    y1, y2, mean, cov = make_two_groups()
    m1, m2 = _on_disk(tmp_path, y1=y1, y2=y2)
    kernel, report = autotune(two_groups, jax.random.key(0), m1, m2)
    run = run_kernel(kernel, jax.random.key(1), m1, m2, num_samples=2000, num_chains=4)
    # one plate from a file and one in memory: the in-memory one is fed too
    again = run_kernel(kernel, jax.random.key(1), m1, y2, num_samples=2000, num_chains=4)
    for name in ("delta", "mu"):
        np.testing.assert_allclose(run.samples[name], again.samples[name], rtol=1e-5, atol=1e-6)
    samples = run.get_samples(group_by_chain=True)
    z = np.stack([samples["delta"], samples["mu"]], -1)  # (chains, draws, 2)
    sd = np.sqrt(np.diag(cov))
    # batch means over 50 batches per chain: the Monte Carlo error of the mean and the sd
    batches = z.reshape(4, 50, 40, 2)
    se_mean = np.std(batches.mean(2).reshape(-1, 2), axis=0, ddof=1) / np.sqrt(200)
    assert np.all(np.abs(z.reshape(-1, 2).mean(0) - mean) < 4 * se_mean)
    spread = np.sqrt(np.mean((batches - mean) ** 2, axis=2)).reshape(-1, 2)
    se_sd = np.std(spread, axis=0, ddof=1) / np.sqrt(200)
    assert np.all(np.abs(z.reshape(-1, 2).std(0) - sd) < 4 * se_sd + 0.01 * sd)
    assert check_run(run, report).passed


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.CentreWarning")
def test_resume_and_checkpoints_on_file_backed_data(tmp_path, problem, reads):
    X, y = _on_disk(tmp_path, X=problem.X, y=problem.y)
    kernel = SGLDFP(linear_regression, 1e-3, num_steps=3, batch_sampling="blocks")
    settings = dict(num_warmup=10, thinning=2, num_chains=2)
    whole = run_kernel(kernel, jax.random.key(3), X, y, num_samples=50, **settings)
    first = run_kernel(kernel, jax.random.key(3), X, y, num_samples=20, **settings,
                       checkpoint=tmp_path / "run", checkpoint_every=7)  # fmt: skip
    restored = load_run(tmp_path / "run", kernel, X, y)
    continued = run_kernel(kernel, None, X, y, num_samples=30, previous=restored)
    in_memory = run_kernel(kernel, None, problem.X, problem.y, num_samples=30, previous=first)
    for run in (continued, in_memory):
        np.testing.assert_allclose(run.samples["theta"], whole.samples["theta"], rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    other = np.asarray(problem.y).copy()
    other[:64] += 1.0
    (changed,) = _on_disk(tmp_path, other=other)
    with pytest.raises(ValueError, match="previous ran on other data"):
        run_kernel(kernel, None, X, changed, num_samples=5, previous=first)


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.CentreWarning")
def test_a_full_batch_on_a_file_is_read_in_place(tmp_path, problem, reads, monkeypatch):
    """A draw whose rows exceed MAX_DRAW_BYTES (here: any) runs on the file in place: the
    same draws, no feed."""
    monkeypatch.setattr(files, "MAX_DRAW_BYTES", 1)
    X, y = _on_disk(tmp_path, X=problem.X, y=problem.y)
    kernel = SGLD(linear_regression, 1e-3, num_steps=3)
    a = run_kernel(kernel, jax.random.key(2), X, y, num_samples=30)
    b = run_kernel(kernel, jax.random.key(2), problem.X, problem.y, num_samples=30)
    assert not reads
    np.testing.assert_allclose(a.samples["theta"], b.samples["theta"], rtol=1e-5, atol=1e-6)


def test_mcmc_refuses_file_backed_data_and_names_run_kernel(tmp_path, problem):
    X, y = _on_disk(tmp_path, X=problem.X, y=problem.y)
    mcmc = MCMC(SGLD(linear_regression, 1e-3), num_warmup=5, num_samples=5, progress_bar=False)
    shapes = r"file-backed, a memory map or a zarr array \(shape \(1000, 3\), \(1000,\)\)"
    with pytest.raises(ValueError, match=shapes) as e:
        mcmc.run(jax.random.key(0), X, y)
    assert "numpyro_sgmc.run_kernel(kernel, key, *data" in str(e.value)
    assert "np.array(X)" in str(e.value)


def _same_size_plates(a, b):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("a", a.shape[0], subsample_size=10):
        numpyro.sample("ya", dist.Normal(mu, 1.0), obs=numpyro.subsample(a, event_dim=0))
    with numpyro.plate("b", b.shape[0], subsample_size=10):
        numpyro.sample("yb", dist.Normal(mu, 2.0), obs=numpyro.subsample(b, event_dim=0))


def test_plates_of_one_size_on_files_are_refused_by_name(tmp_path):
    a, b = _on_disk(tmp_path, a=np.zeros(200, np.float32), b=np.ones(200, np.float32))
    with pytest.raises(ValueError, match="plates 'a' and 'b' both have 200 rows"):
        run_kernel(SGLD(_same_size_plates, 1e-3), jax.random.key(0), a, b, num_samples=5)


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.CentreWarning")
def test_a_file_written_to_during_a_run_is_an_error(tmp_path, problem, reads, monkeypatch):
    X, y = _on_disk(tmp_path, X=problem.X, y=problem.y)
    kernel = SGLD(linear_regression, 1e-3, num_steps=3)
    gather = streaming.RowFeed._gather

    def written(self, indices, steps):  # another process appends to y while the run reads
        if len(reads) == 3:
            with open(tmp_path / "y.npy", "ab") as f:
                f.write(b"\0" * 4)
        return gather(self, indices, steps)

    monkeypatch.setattr(streaming.RowFeed, "_gather", written)
    with pytest.raises(ValueError, match=r"y\.npy' was written to during the run"):
        run_kernel(kernel, jax.random.key(0), X, y, num_samples=100)


def test_a_zarr_array_changed_during_a_run_is_an_error(tmp_path, problem, reads, monkeypatch):
    """A zarr array is read anew for every feed: a chunk rewritten, or deleted (which zarr
    would read as its fill value), during the run is an error at the next feed."""
    pytest.importorskip("zarr")
    kernel = SGLD(linear_regression, 1e-3, num_steps=3)
    gather = streaming.RowFeed._gather
    for change in ("rewrite", "delete"):
        (tmp_path / change).mkdir()
        X, y = _in_zarr(tmp_path / change, X=np.asarray(problem.X), y=np.asarray(problem.y))

        def changed(self, indices, steps, change=change, y=y):  # another process, mid-run
            if len(reads) == 3:
                chunk = next(p for p in (tmp_path / change / "y.zarr").rglob("*")
                             if p.is_file() and p.name != "zarr.json")  # fmt: skip
                if change == "delete":
                    chunk.unlink()
                else:
                    chunk.write_bytes(chunk.read_bytes())
            return gather(self, indices, steps)

        monkeypatch.setattr(streaming.RowFeed, "_gather", changed)
        reads.clear()
        with pytest.raises(ValueError, match=r"y\.zarr' changed during the run .*fill value"):
            run_kernel(kernel, jax.random.key(0), X, y, num_samples=100)


def _standardised_in_the_model(X, y=None):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    Z = (X - X.mean(0)) / X.std(0)  # the whole argument: in memory every row, fed the batch's
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Zb = numpyro.subsample(Z, event_dim=1)
        numpyro.sample("y", dist.Normal(Zb @ theta, 1.0), obs=numpyro.subsample(y, event_dim=0))


def test_a_model_that_reads_whole_arguments_is_refused_on_files(tmp_path, problem):
    X, y = _on_disk(tmp_path, X=problem.X, y=problem.y)
    kernel = SGLD(_standardised_in_the_model, 1e-4)
    with pytest.raises(ValueError, match=r"uses its per-row arguments beyond its batch's rows"):
        run_kernel(kernel, jax.random.key(0), X, y, num_samples=5)
    with pytest.raises(ValueError, match=r"the tuner and run_kernel give the model only the rows"):
        autotune(_standardised_in_the_model, jax.random.key(0), X, y)
    run_kernel(kernel, jax.random.key(0), problem.X, problem.y, num_samples=5)  # in memory


def test_rows_in_memory_reads_each_distinct_row_once(tmp_path, problem):
    (X, y), n = _on_disk(tmp_path, X=problem.X, y=problem.y), len(problem.y)
    plates = (SubsamplePlate("data", n, 100),)
    idx = np.array([[7, 3, 7, 999, 3], [0, 0, 512, 7, 1]])
    (Xg, yg), rows = files.rows_in_memory((X, y), plates, {"data": idx})
    assert not files.file_backed(Xg) and Xg.shape == (idx.size, X.shape[1])
    np.testing.assert_array_equal(Xg[rows["data"]], X[idx])
    np.testing.assert_array_equal(yg[rows["data"]], y[idx])
    # in file order, padded with the last row to one row per index
    np.testing.assert_array_equal(yg, y[np.r_[np.unique(idx), [999] * 4]])
    memory = (np.asarray(problem.X), np.asarray(problem.y))
    assert files.rows_in_memory(memory, plates, {"data": idx}) == (memory, {"data": idx})


def test_random_access_sees_the_same_bytes_through_any_view(tmp_path, problem, monkeypatch):
    (X,) = _on_disk(tmp_path, X=problem.X)
    assert files.random_access(X, 1) is X  # 12 kB: dense rows, the kernel's read-ahead
    monkeypatch.setattr(files, "SPARSE_GAP", 1)
    for view in (X, X[100:], X[:, 1:], X[::3], X[5:, 2][10:]):
        seen = files.random_access(view, 1)
        assert not np.shares_memory(seen, view)
        np.testing.assert_array_equal(seen, view)
    in_memory = np.asarray(problem.X)
    assert files.random_access(in_memory, 1) is in_memory


@pytest.mark.slow  # 9 s: the quick suite's 10 minutes
@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.LinearizationWarning")
def test_the_tuner_on_files_is_the_tuner_in_memory(tmp_path, monkeypatch):
    """Every pass of autotune over a row sample (the warm start's, here on 600 of 4,000 rows,
    the information, control-variate and linearity rows) reads its rows from the files once,
    sparse rows through their own mapping, and computes what it computes in memory."""
    import numpyro_sgmc.tuner.tuning as tuning

    monkeypatch.setattr(tuning, "WARM_START_SAMPLE_ROWS", 600)
    monkeypatch.setattr(files, "SPARSE_GAP", 1)
    mapped = []
    random_access = files.random_access
    monkeypatch.setattr(
        files, "random_access", lambda x, k: mapped.append(k) or random_access(x, k)
    )
    data = make_linear_regression(n=4000, seed=3)
    X, y = np.asarray(data.X), np.asarray(data.y)
    memory = autotune(linear_regression, jax.random.key(0), X, y)[1]
    assert not mapped
    on_files = autotune(linear_regression, jax.random.key(0), *_on_disk(tmp_path, X=X, y=y))[1]
    assert 600 in mapped and len(mapped) >= 8
    assert on_files.row == memory.row and on_files.batch_size == memory.batch_size
    assert on_files.step_size == pytest.approx(memory.step_size, rel=1e-4)
    for site, value in memory.mode.items():
        np.testing.assert_allclose(on_files.mode[site], value, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        on_files.covariance.as_matrix(3), memory.covariance.as_matrix(3), rtol=1e-3
    )


@pytest.mark.slow  # 9 s: the quick suite's 10 minutes
def test_a_memory_mapped_x_beside_a_y_in_memory_is_the_data_in_memory(tmp_path, problem):
    """A new user's set-up: the covariates memory-mapped, the responses a NumPy array or a
    pandas Series. The start's first rows cut the plate's arguments together (it cut the
    file alone, and NumPyro's shape error named no fix); tuning and draws are those in
    memory."""
    import pandas as pd

    X, y = np.asarray(problem.X), np.asarray(problem.y)
    (on_file,) = _on_disk(tmp_path, X=X)
    memory_kernel, memory = autotune(linear_regression, jax.random.key(0), X, y)
    for responses in (y, pd.Series(y)):
        kernel, mixed = autotune(linear_regression, jax.random.key(0), on_file, responses)
        assert mixed.step_size == pytest.approx(memory.step_size, rel=1e-4)
        np.testing.assert_allclose(mixed.mode["theta"], memory.mode["theta"], rtol=1e-4)
    key = jax.random.key(1)
    run = run_kernel(kernel, key, on_file, pd.Series(y), num_samples=50)
    in_memory = run_kernel(memory_kernel, key, X, y, num_samples=50)
    np.testing.assert_allclose(run.samples["theta"], in_memory.samples["theta"], rtol=1e-4,
                               atol=1e-5)  # fmt: skip


def test_a_file_is_checked_for_non_finite_rows_once_per_version(tmp_path, problem, monkeypatch):
    from numpyro_sgmc.data import validation

    X, y = _on_disk(tmp_path, X=problem.X, y=problem.y)
    passes = []
    count = validation._count_nonfinite_host
    monkeypatch.setattr(validation, "_count_nonfinite_host", lambda x: passes.append(x) or count(x))
    for _ in range(2):
        assert not validation.nonfinite_data(linear_regression, (X, y), {})
    assert len(passes) == 2  # X and y, once each
    written = np.lib.format.open_memmap(tmp_path / "y.npy", "r+")
    written[17] = np.nan
    written.flush()
    del written
    (found,) = validation.nonfinite_data(linear_regression, (X, y), {})
    assert (found.label, found.count, found.first) == ("argument 'y' (position 1)", 1, 17)


def test_the_row_order_check_reads_its_batches_from_the_file(tmp_path, problem):
    """``"blocks"`` on rows sorted by a covariate warns from a file as in memory, with the
    same ratio: the same batches, read once from the file."""
    from numpyro_sgmc.diagnostics import DataOrderWarning

    rows = np.argsort(np.asarray(problem.X)[:, 0])
    ordered = np.asarray(problem.X)[rows], np.asarray(problem.y)[rows]
    kernel = SGLD(linear_regression, 1e-3, batch_sampling="blocks")
    messages = []
    for data in (ordered, _on_disk(tmp_path, X=ordered[0], y=ordered[1])):
        with pytest.warns(DataOrderWarning, match="rows look ordered") as found:
            run_kernel(kernel, jax.random.key(3), *data, num_samples=2)
        messages.append(str(found[0].message))
    assert messages[0] == messages[1]


def test_a_pass_over_files_is_the_pass_in_memory(tmp_path, monkeypatch):
    """The exact potential and gradient over two plates of files, read in host chunks of
    parts of whole multiples of 64 rows (2000 and 500 rows: the last chunks padded, some
    wholly), one part to a chunk or several scanned, at one point and at three at once,
    against the compiled pass over the same rows in memory."""
    from numpyro_sgmc.data import passes
    from numpyro_sgmc.data.model import prepare_model

    y1, y2 = (np.asarray(a, np.float32) for a in make_two_groups()[:2])
    on_files = tuple(_on_disk(tmp_path, y1=y1, y2=y2))
    spec = prepare_model(jax.random.key(0), two_groups, (y1, y2), {}).spec
    points = {"delta": np.array([0.3, -1.0, 2.0], np.float32), "mu": np.float32([0.5, 0, 1])}
    fed = files.fed_rows(on_files, spec.plates)
    for chunk_bytes, chunk_size, partition in [
        (1300, 65536, passes._Chunks(8, 1, {"a": 256, "b": 64})),
        (4000, 150, passes._Chunks(3, 5, {"a": 192, "b": 64})),
    ]:
        monkeypatch.setattr(passes, "CHUNK_BYTES", chunk_bytes)
        assert passes._partition(spec, on_files, fed, chunk_size) == partition
        for k in range(3):
            point = {name: jax.numpy.asarray(v[k]) for name, v in points.items()}
            u, g = passes.exact_gradient(spec, point, (y1, y2), {})
            u_file, g_file = passes.exact_gradient(spec, point, on_files, {}, chunk_size)
            assert u_file == pytest.approx(float(u), rel=1e-6)
            for name in g:
                np.testing.assert_allclose(g_file[name], g[name], rtol=1e-5, atol=1e-7)
        u3, g3 = passes.exact_gradient(spec, points, (y1, y2), {}, batched=True)
        u3_file, g3_file = passes.exact_gradient(spec, points, on_files, {}, chunk_size, True)
        np.testing.assert_allclose(u3_file, u3, rtol=1e-6)
        for name in g3:
            np.testing.assert_allclose(g3_file[name], g3[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # 14 s: the quick suite's 10 minutes
@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.LinearizationWarning")
def test_no_program_receives_a_file_whole(tmp_path, monkeypatch, capfd):
    """autotune, run_kernel (tuned, and a hand-set SGLD-FP whose centre is a pass over the
    files) and check_run on memory maps: every host-to-device transfer JAX makes is of rows
    (a chunk, a batch, a sample), never of a whole file. On an accelerator a whole file would
    be a copy of it in device memory."""
    import numpyro_sgmc.tuner.tuning as tuning
    from numpyro_sgmc.data import passes

    monkeypatch.setattr(tuning, "WARM_START_SAMPLE_ROWS", 2000)
    monkeypatch.setattr(passes, "CHUNK_BYTES", 2**16)
    n = 30_011
    data = make_linear_regression(n=n, seed=5)
    X, y = _on_disk(tmp_path, X=data.X, y=data.y)
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log_explicit"):
        kernel, report = autotune(linear_regression, jax.random.key(0), X, y)
        run = run_kernel(kernel, jax.random.key(1), X, y, num_samples=200, num_chains=2)
        check_run(run, report)
        hand = SGLDFP(linear_regression, 1e-4)
        run_kernel(hand, jax.random.key(2), X, y, num_samples=20, num_chains=2)
    transfers = capfd.readouterr().err
    assert "host-to-device transfer" in transfers  # the guard's log is seen
    whole = [line for line in transfers.splitlines() if f"[{n}" in line]
    assert not whole, whole[:3]


def test_the_tuners_first_pass_over_a_file_is_its_data_check(tmp_path, monkeypatch):
    """autotune reads a file's rows for NaN and infinite values in its first pass over every
    row, not in a pass of its own; a non-finite row past the first rows checked at the start
    is found there, and reported by row as before."""
    import numpyro_sgmc.tuner.tuning as tuning
    from numpyro_sgmc.data import validation

    monkeypatch.setattr(validation, "_FIRST_ROWS", 100)
    checked = []
    count = validation._count_nonfinite_host
    monkeypatch.setattr(
        validation, "_count_nonfinite_host", lambda x: checked.append(len(x)) or count(x)
    )
    data = make_linear_regression(n=4000, seed=3)
    X, y = _on_disk(tmp_path, X=data.X, y=data.y)
    kernel, report = autotune(linear_regression, jax.random.key(0), X, y)
    assert checked == [100, 100]  # X and y: the first rows only
    run_kernel(kernel, jax.random.key(1), X, y, num_samples=5)
    assert checked == [100, 100]  # the pass recorded both files as checked
    bad = np.asarray(data.y).copy()
    bad[3001] = np.nan
    X, y = _on_disk(tmp_path / "..", X=data.X, y=bad)
    for sample in (600, 4000):  # the row in the warm start's sample or not: the same message
        monkeypatch.setattr(tuning, "WARM_START_SAMPLE_ROWS", sample)
        with pytest.raises(ValueError, match=r"in 1 of its 4000 rows \(the first at row 3001\)"):
            autotune(linear_regression, jax.random.key(0), X, y)


def _in_zarr(tmp_path, chunk_rows=128, **arrays):
    """The arrays written as zarr 3 arrays of ``chunk_rows``-row chunks (compressed, zarr's
    default), opened read-only."""
    import zarr

    out = []
    for name, a in arrays.items():
        a = np.asarray(a)
        z = zarr.create_array(store=tmp_path / f"{name}.zarr", shape=a.shape, dtype=a.dtype,
                              chunks=(chunk_rows,) + a.shape[1:])  # fmt: skip
        z[:] = a
        out.append(zarr.open_array(tmp_path / f"{name}.zarr", mode="r"))
    return out


@pytest.mark.slow  # 10-23 s: the quick suite's 10 minutes
@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.LinearizationWarning")
@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.CentreWarning")
def test_zarr_arrays_go_through_the_recipe_as_files_do(tmp_path):
    """autotune, run_kernel (resumed too), check_run and a hand-set SGLD-FP on zarr arrays
    (y stored as float64, read as float32 by chunk): the tuner's report and the draws of the
    same arrays in memory, and MCMC refused by name."""
    data = make_linear_regression(n=4000, seed=3)
    X, y = np.asarray(data.X), np.asarray(data.y)
    Xz, yz = _in_zarr(tmp_path, X=X, y=y.astype(np.float64))
    kernel, report = autotune(linear_regression, jax.random.key(0), Xz, yz)
    memory = autotune(linear_regression, jax.random.key(0), X, y)[1]
    assert report.row == memory.row and report.batch_size == memory.batch_size
    np.testing.assert_allclose(report.mode["theta"], memory.mode["theta"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        report.covariance.as_matrix(3), memory.covariance.as_matrix(3), rtol=1e-3
    )
    settings = dict(num_warmup=10, num_chains=2)
    run = run_kernel(kernel, jax.random.key(1), Xz, yz, num_samples=400, **settings)
    in_memory = run_kernel(kernel, jax.random.key(1), X, y, num_samples=400, **settings)
    np.testing.assert_allclose(run.samples["theta"], in_memory.samples["theta"], rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    assert check_run(run, report).passed
    first = run_kernel(kernel, jax.random.key(1), Xz, yz, num_samples=150, **settings)
    continued = run_kernel(kernel, None, Xz, yz, num_samples=250, previous=first)
    np.testing.assert_allclose(continued.samples["theta"], in_memory.samples["theta"],
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    hand = SGLDFP(linear_regression, 1e-4, batch_sampling="blocks")
    on_zarr = run_kernel(hand, jax.random.key(2), Xz, yz, num_samples=20)
    in_memory = run_kernel(hand, jax.random.key(2), X, y, num_samples=20)
    np.testing.assert_allclose(on_zarr.samples["theta"], in_memory.samples["theta"], rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    mcmc = MCMC(kernel, num_warmup=5, num_samples=5, progress_bar=False)
    with pytest.raises(ValueError, match=r"file-backed, a memory map or a zarr array") as e:
        mcmc.run(jax.random.key(0), Xz, yz)
    assert "numpyro_sgmc.run_kernel(kernel, key, *data" in str(e.value)


def _with_group_table(X, y, table):
    """A model that reads ``table`` whole (one row per group, no plate of its own)."""
    shift = numpyro.sample("shift", dist.Normal(0.0, 10.0))
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Normal(Xb @ theta + shift * table.sum(), 1.0), obs=yb)


def test_zarr_errors_name_the_row_and_the_fix(tmp_path, monkeypatch):
    """A NaN row in a zarr array is found by row; a zarr array that is not a plate's rows is
    refused with the fix (a NumPy array), and the same model runs with one; a draw whose rows
    exceed a feed is refused on zarr (a memory map reads it in place)."""
    data = make_linear_regression(n=1000, seed=3)
    X, y = np.asarray(data.X), np.asarray(data.y)
    bad = y.copy()
    bad[777] = np.inf
    Xz, yz = _in_zarr(tmp_path, X=X, y=bad)
    with pytest.raises(ValueError, match=r"in 1 of its 1000 rows \(the first at row 777\)"):
        autotune(linear_regression, jax.random.key(0), Xz, yz)
    (table,) = _in_zarr(tmp_path, table=np.ones(7, np.float32))
    (tmp_path / "clean").mkdir()
    Xz, yz = _in_zarr(tmp_path / "clean", X=X, y=y)
    kernel = SGLD(_with_group_table, 1e-4)
    with pytest.raises(ValueError, match=r"zarr array of shape \(7,\) is not the data of a "
                       r"subsample plate.*np.asarray\(z\[:\]\)"):  # fmt: skip
        run_kernel(kernel, jax.random.key(0), Xz, yz, table, num_samples=5)
    run_kernel(kernel, jax.random.key(0), Xz, yz, np.asarray(table[:]), num_samples=5)
    monkeypatch.setattr(files, "MAX_DRAW_BYTES", 1000)
    with pytest.raises(ValueError, match=r"a zarr array is only read by rows into memory"):
        run_kernel(SGLD(linear_regression, 1e-4), jax.random.key(0), Xz, yz, num_samples=5)


@pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.LinearizationWarning")
def test_with_blocks_the_warm_start_reads_runs_of_rows(tmp_path, monkeypatch):
    """With batch_sampling="blocks" (rows in random order) the warm start's sample is 64 runs
    of consecutive rows, disjoint, read from the file as such; the tuner on files computes
    what it computes on the same rows in memory."""
    import numpyro_sgmc.tuner.tuning as tuning

    monkeypatch.setattr(tuning, "WARM_START_SAMPLE_ROWS", 640)
    gathered = []
    take_rows = files.take_rows
    monkeypatch.setattr(
        files, "take_rows", lambda x, rows: gathered.append(np.asarray(rows)) or take_rows(x, rows)
    )
    data = make_linear_regression(n=4000, seed=3)
    X, y = np.asarray(data.X), np.asarray(data.y)
    memory = autotune(linear_regression, jax.random.key(0), X, y, batch_sampling="blocks")[1]
    assert not gathered
    on_disk = _on_disk(tmp_path, X=X, y=y)
    on_files = autotune(linear_regression, jax.random.key(0), *on_disk, batch_sampling="blocks")[1]
    sample = next(rows for rows in gathered if len(rows) == 640)
    runs = sample.reshape(64, 10)  # in file order: 64 distinct aligned slots of 10 rows
    assert np.all(runs == runs[:, :1] + np.arange(10)) and np.all(runs[:, 0] % 10 == 0)
    assert len(np.unique(runs[:, 0])) == 64
    assert on_files.row == memory.row and on_files.batch_size == memory.batch_size
    np.testing.assert_allclose(on_files.mode["theta"], memory.mode["theta"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        on_files.covariance.as_matrix(3), memory.covariance.as_matrix(3), rtol=1e-3
    )
