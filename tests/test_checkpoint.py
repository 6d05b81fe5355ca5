"""Resuming refuses another run by name; a checkpoint is atomic and says when it is damaged.

A run's fingerprint (model sites and shapes, the kernel's tuning, the data's shapes and 64
hashed rows of each argument) is compared when it is continued, in memory
(``run_kernel(previous=...)``) or from a checkpoint (``load_run``). The checkpoint directory
always holds one complete checkpoint whose files match the SHA-256 its metadata records,
and the one before it; a damaged file is named, with where the run can restart from.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from harness import assert_law
from numpyro_sgmc import SGLD, SGLDFP, ChainInit, Diagonal, load_run, run_kernel
from numpyro_sgmc.running.checkpoint import LATEST, PREVIOUS, CheckpointError
from numpyro_sgmc.theory import stationary_covariance
from problems import PRIOR_SCALE, linear_regression, make_linear_regression, start_near_mode

pytestmark = pytest.mark.filterwarnings("ignore::numpyro_sgmc.diagnostics.StepSizeWarning")


def renamed(X, y=None, noise=1.0, subsample_size=100):
    """:func:`linear_regression` with its coefficients' site named ``beta``."""
    beta = numpyro.sample("beta", dist.Normal(0.0, PRIOR_SCALE).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=subsample_size):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Normal(Xb @ beta, noise), obs=yb)


@pytest.fixture(scope="module")
def problem():
    return make_linear_regression(n=1000)


@pytest.fixture
def written(problem, tmp_path):
    """A run of 6 kept draws with a checkpoint every 2: three checkpoints, the last two kept."""
    kernel = SGLD(linear_regression, 1e-3, num_steps=3)
    run = run_kernel(kernel, jax.random.key(0), problem.X, problem.y, num_samples=6,
                     checkpoint=tmp_path, checkpoint_every=2)  # fmt: skip
    return kernel, run, tmp_path


def test_the_directory_holds_the_last_two_checkpoints(written):
    _, run, directory = written
    assert sorted(os.listdir(directory)) == [
        "checkpoint-previous.json", "checkpoint.json", "draws-0-0.npz", "draws-0-1.npz",
        "draws-0-2.npz", "state-0-1.npz", "state-0-2.npz",
    ]  # fmt: skip
    kernel = run.sampler
    last = load_run(directory, kernel, run.model_args[0], run.model_args[1])
    before = load_run(directory, kernel, *run.model_args, previous_checkpoint=True)
    assert last.num_samples == 6 and before.num_samples == 4
    np.testing.assert_array_equal(last.samples["theta"], run.samples["theta"])
    np.testing.assert_array_equal(before.samples["theta"], run.samples["theta"][:, :4])
    os.remove(directory / "state-0-1.npz")  # the previous checkpoint's alone
    with pytest.raises(CheckpointError) as info:
        load_run(directory, kernel, *run.model_args, previous_checkpoint=True)
    assert f"is damaged: {directory / 'state-0-1.npz'} is missing. The last checkpoint is " in (
        str(info.value)
    )
    assert load_run(directory, kernel, *run.model_args).num_samples == 6


def test_other_data_of_the_same_shape_are_refused(problem, written):
    kernel, run, directory = written
    other = make_linear_regression(n=1000, seed=1)
    with pytest.raises(ValueError) as info:
        load_run(directory, kernel, other.X, other.y)
    message = str(info.value)
    assert f"The checkpoint in {str(directory)!r} is of another run" in message
    assert (
        "the data differ from the run's: argument 'X' (position 0) has other values in 64 of "
        "the 64 rows compared"
    ) in message
    assert "argument 'y' (position 1) has other values in 64 of the 64 rows" in message
    # one changed row among those hashed (the last) is seen, and named
    y = np.asarray(problem.y).copy()
    y[-1] += 1.0
    with pytest.raises(ValueError) as info:
        load_run(directory, kernel, problem.X, y)
    assert (
        "the data differ from the run's: argument 'y' (position 1) has other values in 1 of the "
        "64 rows compared (rows 999)"
    ) in str(info.value)
    assert "argument 'X'" not in str(info.value)
    # the same check in memory
    with pytest.raises(ValueError) as info:
        run_kernel(kernel, None, problem.X, y, num_samples=2, previous=run)
    assert str(info.value).startswith(
        "previous ran on other data: the data differ from the run's: argument 'y' (position 1) "
        "has other values in 1 of the 64 rows compared (rows 999)."
    )


def test_data_of_another_size_are_refused(problem, written):
    kernel, run, directory = written
    with pytest.raises(ValueError) as info:
        load_run(directory, kernel, problem.X[:500], problem.y[:500])
    message = str(info.value)
    assert "argument 'X' (position 0) has shape (500, 3), the run's (1000, 3)" in message
    assert "argument 'y' (position 1) has shape (500,), the run's (1000,)" in message
    assert "plate 'data' differs: n = 1000, batch 100 in the checkpoint, n = 500, batch 100" in (
        message
    )
    with pytest.raises(ValueError, match=r"has shape \(500, 3\), the run's \(1000, 3\)"):
        run_kernel(kernel, None, problem.X[:500], problem.y[:500], num_samples=2, previous=run)


def test_no_data_is_refused_naming_what_load_run_takes(written):
    kernel, _, directory = written
    with pytest.raises(TypeError) as info:
        load_run(directory, kernel)  # the checkpoint holds the draws, not the data
    message = str(info.value)
    assert "load_run(checkpoint, kernel, *model_args, model_kwargs=...) takes the data" in message
    assert "missing a required argument: 'X'" in message


def test_a_renamed_site_is_refused_by_name(problem, written):
    _, _, directory = written
    with pytest.raises(ValueError) as info:
        load_run(directory, SGLD(renamed, 1e-3, num_steps=3), problem.X, problem.y)
    assert (
        "the model's sites differ: 'theta' in the checkpoint, not in this model; 'beta' in "
        "this model, not in the checkpoint"
    ) in str(info.value)


def test_another_step_size_is_refused_naming_both(problem, written):
    _, _, directory = written
    with pytest.raises(ValueError) as info:
        load_run(directory, SGLD(linear_regression, 2e-3, num_steps=3), problem.X, problem.y)
    assert "the step size differs: 0.001 in the checkpoint, 0.002 now" in str(info.value)
    with pytest.raises(ValueError, match="num_steps differs: 3 in the checkpoint, 4 now"):
        load_run(directory, SGLD(linear_regression, 1e-3, num_steps=4), problem.X, problem.y)
    other = SGLD(linear_regression, 1e-3, num_steps=3, batch_size=50)
    with pytest.raises(ValueError, match="plate 'data' differs: n = 1000, batch 100 in the "):
        load_run(directory, other, problem.X, problem.y)
    other = SGLD(linear_regression, 1e-3, num_steps=3, preconditioner=Diagonal(np.full(3, 2.0)))
    with pytest.raises(ValueError, match="preconditioner, mass or friction differs from the chec"):
        load_run(directory, other, problem.X, problem.y)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def _empty(path):
    open(path, "wb").close()


@pytest.mark.parametrize(
    "name, damage, previous_intact",
    [
        ("state-0-2.npz", _truncate, True),
        ("draws-0-2.npz", _flip, True),
        ("checkpoint.json", _empty, True),
        ("draws-0-2.npz", os.remove, True),
        ("checkpoint.json", os.remove, True),
        ("draws-0-0.npz", _flip, False),  # shared by both checkpoints
        ("draws-0-1.npz", _truncate, False),
    ],
)
def test_a_damaged_checkpoint_names_the_file(problem, written, name, damage, previous_intact):
    kernel, run, directory = written
    path = os.path.join(directory, name)
    damage(path)
    with pytest.raises(CheckpointError) as info:
        load_run(directory, kernel, problem.X, problem.y)
    message = str(info.value)
    assert message.startswith(f"The run_kernel checkpoint in {str(directory)!r} is damaged: {path}")
    if previous_intact:
        assert (
            "The previous checkpoint (4 kept draws per chain, 4 draws) is intact: "
            "load_run(..., previous_checkpoint=True) reads it"
        ) in message
        before = load_run(directory, kernel, problem.X, problem.y, previous_checkpoint=True)
        assert before.num_samples == 4
        np.testing.assert_array_equal(before.samples["theta"], run.samples["theta"][:, :4])
        # and continues: the result is the run's 6 draws
        more = run_kernel(kernel, None, problem.X, problem.y, num_samples=2, previous=before)
        np.testing.assert_array_equal(more.samples["theta"], run.samples["theta"])
    else:
        assert "There is no intact previous checkpoint: start the run again." in message
        with pytest.raises(CheckpointError, match="No other checkpoint is intact: start the run"):
            load_run(directory, kernel, problem.X, problem.y, previous_checkpoint=True)


def test_an_empty_directory_and_a_lone_checkpoint(problem, tmp_path):
    kernel = SGLD(linear_regression, 1e-3, num_steps=3)
    with pytest.raises(FileNotFoundError, match="No run_kernel checkpoint in .*no checkpoint.json"):
        load_run(tmp_path, kernel, problem.X, problem.y)
    run_kernel(kernel, jax.random.key(0), problem.X, problem.y, num_samples=2,
               checkpoint=tmp_path, checkpoint_every=2)  # fmt: skip
    assert not os.path.exists(tmp_path / PREVIOUS)
    _truncate(tmp_path / LATEST)
    with pytest.raises(CheckpointError) as info:
        load_run(tmp_path, kernel, problem.X, problem.y)
    assert f"is damaged: {tmp_path / LATEST} is not the metadata it was written as" in str(
        info.value
    )
    assert "There is no intact previous checkpoint: start the run again." in str(info.value)


@pytest.mark.parametrize("failing_write", [1, 2], ids=["draws", "state"])
def test_an_interrupted_write_leaves_the_last_checkpoint(problem, written, monkeypatch,
                                                          failing_write):  # fmt: skip
    """A Ctrl-C inside ``np.savez``, after part of the file is written, while a continuation
    writes its first checkpoint: the directory still holds the run's last one."""
    kernel, run, directory = written
    files = sorted(os.listdir(directory))
    calls = {"n": 0}
    savez = np.savez

    def interrupted(f, **arrays):
        calls["n"] += 1
        if calls["n"] == failing_write:
            f.write(b"PK\x03\x04" + bytes(100))  # the start of a zip file
            raise KeyboardInterrupt
        savez(f, **arrays)

    restored = load_run(directory, kernel, problem.X, problem.y)
    monkeypatch.setattr(np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_kernel(kernel, None, problem.X, problem.y, num_samples=2, previous=restored,
                   checkpoint=directory, checkpoint_every=2)  # fmt: skip
    monkeypatch.setattr(np, "savez", savez)
    left = sorted(os.listdir(directory))
    assert not [n for n in left if n.endswith(".tmp")]
    assert set(files) <= set(left)  # the failed write removed none of the checkpoint's files
    again = load_run(directory, kernel, problem.X, problem.y)
    assert again.num_samples == 6 and again.num_draws == run.num_draws
    np.testing.assert_array_equal(again.samples["theta"], run.samples["theta"])


def test_a_resumed_run_has_the_law_of_one_run(problem, tmp_path):
    """SGLD-FP (exact gradients of a quadratic: the discrete Lyapunov law is exact,
    ``docs/theory.md`` §3), stopped after 300 of 1000 kept draws, restored from its checkpoint
    in a new call and continued: the combined draws are those of one run, with its law."""
    h, num_chains = 0.2, 8
    kernel = SGLDFP(linear_regression, h, num_steps=10)
    init = ChainInit(params=start_near_mode(problem, num_chains, problem.post_cov))
    data = (problem.X, problem.y)
    first = run_kernel(kernel, jax.random.key(3), *data, num_warmup=50, num_samples=300,
                       num_chains=num_chains, init_params=init, checkpoint=tmp_path,
                       checkpoint_every=100)  # fmt: skip
    restored = load_run(tmp_path, kernel, *data)
    assert restored.num_samples == 300 and restored.num_draws == 350
    resumed = run_kernel(kernel, None, *data, num_samples=700, previous=restored)
    assert resumed.samples["theta"].shape == (num_chains, 1000, 3)
    assert resumed.num_draws == 1050 and not resumed.interrupted
    whole = run_kernel(kernel, jax.random.key(3), *data, num_warmup=50, num_samples=1000,
                       num_chains=num_chains, init_params=init)  # fmt: skip
    np.testing.assert_array_equal(resumed.samples["theta"], whole.samples["theta"])
    np.testing.assert_array_equal(first.samples["theta"], whole.samples["theta"][:, :300])
    cov = stationary_covariance(
        problem.J, problem.I, step_size=h, batch_size=100, num_data=problem.n,
        hessians=problem.hessians, control_variates=True,
    )  # fmt: skip
    assert_law(resumed.samples["theta"], mean=problem.mode, cov=cov, label="resumed SGLD-FP")


_SHARDED = textwrap.dedent(
    """
    import json, jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from numpyro_sgmc.running.checkpoint import data_fingerprint

    def model(X, y):
        pass

    X = np.random.default_rng(0).normal(size=(1000, 4)).astype(np.float32)
    mesh = jax.make_mesh((2, 2), ("d", "e"))
    sharded = (jax.device_put(X, NamedSharding(mesh, P("d", "e"))),
               jax.device_put(X[:, 0], NamedSharding(mesh, P("d"))))
    print(json.dumps([data_fingerprint(model, args, {}) for args in ((X, X[:, 0]), sharded)]))
    """
)


def test_a_sharded_array_has_the_fingerprint_of_its_values():
    """Rows read shard by shard (rows and columns split over 4 devices) hash as NumPy's."""
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED], capture_output=True, text=True, timeout=300, check=True
    )
    host, sharded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [len(e["hashes"]) for e in host] == [64, 64]
    assert sharded == host
