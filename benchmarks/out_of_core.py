"""Data from disk: the README recipe on memory-mapped ``.npy`` files, end to end.

Logistic regression with ``d = 10`` float32 features (``--rows``, default 10^8: 4.4 GB;
10^9 is 44 GB, beyond this machine's 24 GiB of RAM). The steps, each timed:

1. **write**: the rows are generated i.i.d. in chunks straight into ``.npy`` files
   (``np.lib.format.open_memmap``); i.i.d. rows are already in random order, which
   ``batch_sampling="blocks"`` needs (data in another order: ``shuffle_to_disk`` first);
2. **autotune** on the memory maps: the warm start on a row sample, the Newton passes, the
   information rows, the control variates' centre (setup epochs: passes over the file);
3. **sampling** with ``run_kernel``, whose batches are read from the file on a background
   thread ahead of the steps that use them (``numpyro_sgmc.data.streaming``), progress bar
   in epochs: ``--draws`` kept draws one predicted autocorrelation time apart
   (``report.draws_for``), so about as many effective draws;
4. **check**: the draws against the exact Laplace posterior, computed over the file in
   float64 chunks by Newton's method (and ``check_run``).

It prints the bytes each phase read from disk (``/proc/self/io``), the peak anonymous memory
of the process (``RssAnon``, which leaves out the page cache that holds the file), and the
step throughput of one kernel fed from the whole file, from its first ``--memory-rows``
(default 10^7) and on those rows in memory. ``--in-memory`` also runs the
whole recipe on the rows loaded into memory, side by side (data that fit in RAM). Run:
``python benchmarks/out_of_core.py --rows 1e8 --in-memory``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_sgmc import SGLDFP, autotune, check_run, run_kernel

D = 10
PRIOR_SD = 10.0
CHUNK = 2**21  # rows per chunk of the writer and of the float64 Laplace


def model(X, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, PRIOR_SD).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("rows", X.shape[0], subsample_size=1000):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ beta), obs=yb)


def write(directory: str, n: int, seed: int = 0):
    """``X`` (n × D) and ``y`` (n) as float32 ``.npy`` files, written chunk by chunk."""
    rng = np.random.default_rng(seed)
    beta = np.linspace(-1.0, 1.0, D) / np.sqrt(D)
    X = np.lib.format.open_memmap(os.path.join(directory, "X.npy"), "w+", np.float32, (n, D))
    y = np.lib.format.open_memmap(os.path.join(directory, "y.npy"), "w+", np.float32, (n,))
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        x = rng.standard_normal((b - a, D), dtype=np.float32)
        X[a:b] = x
        y[a:b] = rng.random(b - a) < 1.0 / (1.0 + np.exp(-(x @ beta)))
    X.flush(), y.flush()
    del X, y
    return tuple(np.load(os.path.join(directory, f), mmap_mode="r") for f in ("X.npy", "y.npy"))


def laplace(X, y, iterations: int = 30):
    """The exact Laplace posterior ``(mode, covariance)`` over all rows, float64, by Newton's
    method in chunks (each iteration one pass over the file)."""
    beta = np.zeros(D)
    for _ in range(iterations):
        grad, hess = -beta / PRIOR_SD**2, -np.eye(D) / PRIOR_SD**2
        for a in range(0, len(y), CHUNK):
            x = np.asarray(X[a : a + CHUNK], np.float64)
            p = 1.0 / (1.0 + np.exp(-(x @ beta)))
            grad += x.T @ (np.asarray(y[a : a + CHUNK], np.float64) - p)
            hess -= (x * (p * (1 - p))[:, None]).T @ x
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    return beta, np.linalg.inv(-hess)


def disk_reads() -> int:
    """Bytes this process has read from storage (Linux ``/proc/self/io``: page-cache hits and
    the file's pages already in memory do not count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


class AnonymousPeak:
    """The peak ``RssAnon`` of this process (Linux), sampled every 50 ms on a thread."""

    def __init__(self):
        self.peak, self.running = self.now(), True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    @staticmethod
    def now() -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return float(line.split()[1]) * 1024
        return float("nan")

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.05)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return max(self.peak, self.now())


def recipe(label, X, y, exact, draws):
    """autotune, run_kernel, the draws against ``exact``; prints one line per phase."""
    mode, cov = exact
    size = X.nbytes + y.nbytes
    start, read = time.perf_counter(), disk_reads()
    kernel, report = autotune(model, jax.random.key(0), X, y, batch_sampling="blocks")
    tuned, tune_read = time.perf_counter() - start, disk_reads() - read
    thinning = report.draws_for(1.0)  # kept draws about one autocorrelation time apart
    batch = sum(report.batch_size.values())
    start, read = time.perf_counter(), disk_reads()
    run = run_kernel(kernel, jax.random.key(1), X, y, num_samples=draws, thinning=thinning,
                     num_chains=1, progress_bar=True)  # fmt: skip
    sampled, run_read = time.perf_counter() - start, disk_reads() - read
    z = run.get_samples()["beta"]
    error = np.linalg.norm(np.cov(z.T) - cov) / np.linalg.norm(cov)
    ratio = np.sqrt(np.diag(np.cov(z.T)) / np.diag(cov))
    offset = np.max(np.abs(z.mean(0) - mode) / np.sqrt(np.diag(cov)))
    print(f"{label}: autotune {tuned:.1f} s ({report.setup_epochs:.2f} setup epochs; "
          f"{tune_read / size:.2f} files' worth read from disk), sampling {sampled:.1f} s "
          f"({run.num_draws * kernel.num_steps * batch / len(y):.3g} epochs of batches of "
          f"{batch}, {draws} draws thinned by {thinning}, "
          f"{run.num_draws * kernel.num_steps / sampled:.0f} steps/s with the start; "
          f"{run_read / size:.2f} files' worth read from disk)")  # fmt: skip
    print(
        f"  against the exact Laplace: covariance error {error:.3f} (relative Frobenius), "
        f"sd ratio {ratio.min():.3f}-{ratio.max():.3f}, mean offset {offset:.2f} sds"
    )
    check_run(run, report)  # prints its table


def throughput(kernel, X, y, rows: int, mode):
    """Steps per second of ``kernel`` fed from the whole file, from its first ``rows`` rows
    (the file's pages cached), and on those rows in memory, started at the mode (the control
    variates' centre). A run's start makes a pass over its data for the centre's gradient, so
    the rate is that of the steps alone: runs continued from a started one (``previous=``),
    the extra steps of a long continuation over a short one over the extra time, the median
    of three pairs."""
    Xs, ys = X[:rows], y[:rows]
    init = {"beta": np.asarray(mode, np.float32)}
    cases = [(f"{len(y):.3g} rows from the file", (X, y)),
             (f"{rows:.3g} rows from the file", (Xs, ys)),
             (f"{rows:.3g} rows in memory", (np.array(Xs), np.array(ys)))]  # fmt: skip
    out = {}
    for label, data in cases:
        started = run_kernel(kernel, jax.random.key(2), *data, num_samples=3, init_params=init)
        longer, rates = 600, []
        for _ in range(3):
            times = []
            for draws in (30, 30 + longer):
                start = time.perf_counter()
                run_kernel(kernel, None, *data, num_samples=draws, previous=started,
                           progress_bar=False)  # fmt: skip
                times.append(time.perf_counter() - start)
            rates.append(longer * kernel.num_steps / (times[1] - times[0]))
        out[label] = float(np.median(rates))
    memory = out[cases[-1][0]]
    print("step throughput (SGLD-FP, b = 1000, blocks): " + ", ".join(
        f"{label} {rate:.0f} steps/s ({rate / memory:.2f}x)" for label, rate in out.items()
    ))  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=float, default=1e8)
    parser.add_argument("--draws", type=int, default=2000, help="kept draws, an IAT apart")
    parser.add_argument("--memory-rows", type=float, default=1e7)
    parser.add_argument("--in-memory", action="store_true", help="the recipe in memory too")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    n = int(args.rows)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        peak = AnonymousPeak()
        start = time.perf_counter()
        X, y = write(directory, n)
        print(f"{n:.3g} rows x {D} float32 ({(X.nbytes + y.nbytes) / 1e9:.1f} GB): written in "
              f"{time.perf_counter() - start:.1f} s")  # fmt: skip
        start = time.perf_counter()
        exact = laplace(X, y)
        print(f"exact float64 Laplace over the file: {time.perf_counter() - start:.1f} s")
        recipe("from the file", X, y, exact, args.draws)
        print(f"peak anonymous memory (RssAnon): {peak.stop() / 2**30:.2f} GiB")
        kernel = SGLDFP(model, 1e-7, num_steps=100, batch_sampling="blocks")
        throughput(kernel, X, y, min(n, int(args.memory_rows)), exact[0])
        if args.in_memory:
            recipe("in memory", np.array(X), np.array(y), exact, args.draws)


if __name__ == "__main__":
    main()
