"""Coverage of every target's intervals, with references in the same run (issue 18).

``numpyro_sgmc.calibration.calibrate`` on four models, ``R`` replicates each (default 200),
``n`` rows per replicate (default 2,000), every target, and references computed on the same
data sets:

* **hetero**: linear regression ``y ~ N(Xθ, σ)`` (``θ ~ N(0, 10)``, ``σ ~ HalfNormal(5)``;
  three equicorrelated covariates, ``ρ = 0.5``) fitted to data whose noise sd is
  ``0.3 + 1.5|x₁|`` (heteroscedastic, not normal given ``σ``). Pseudo-true value: the mean is
  right, so ``θ* = (1, 0, -1)``, and ``σ*² = E[(0.3 + 1.5|x₁|)²] = 2.34 + 0.9·sqrt(2/π)``;
* **counts**: Poisson regression (log link, ``θ ~ N(0, 10)``, an intercept and two correlated
  covariates) fitted to negative-binomial counts (concentration 1.5): the mean is right, so
  ``θ* = (0.5, 0.4, -0.3)``, and the counts' variance is about twice the Poisson's;
* **logistic**: logistic regression on ``(1, t, x)`` (``t`` a fair coin, ``x ~ N(0, 1)``)
  fitted to data whose logit is ``-1 + t + 0.5x + 3tx``: the interaction is omitted.
  Pseudo-true value: the root of the population score equation, solved by Newton steps with
  the expectation over ``x`` by 80-point Gauss–Hermite quadrature (exact to float64);
* **wellspec**: the same logistic model, well specified (logit ``θ₀ + θ₁x₁ + θ₂x₂``,
  ``ρ = 0.5``, ``θ ~ N(0, 1)``), at ``θ* = (-0.5, 1, -0.5)``; and simulation-based calibration
  of its posterior: ``θ`` drawn from the prior and the data from the model
  (``calibration.prior_simulator``), ``R`` more replicates.

Targets: ``posterior``, ``bagged`` (``w = 1``), ``local_fiducial`` (the sandwich) and
``mix`` with weights ``(0.5, 0.5)`` (``0.5·S + 0.5·J⁻¹``, the bagged posterior with
bootstrap size ``2n``). Intervals are equal-tailed quantiles of the constrained draws
(``report.draws_for(ess)`` of them, ``--ess``, default 500). References, on every replicate
unless said:

* **classical**: Wald intervals ``θ̂ ± z·se`` of the maximum-likelihood fit (no prior), ``se``
  from the inverse observed information ``H⁻¹``;
* **HC0**: the same with the sandwich ``H⁻¹(Σᵢ gᵢgᵢᵀ)H⁻¹`` (White's, no small-sample
  correction), ``gᵢ`` the per-datum scores;
* **bootstrap**: percentile intervals of the MLE over ``--bootstrap`` (200) nonparametric
  resamples, fitted together (``vmap`` over the resampling weights);
* **NUTS**: NumPyro's NUTS on the full data (the same model under ``full_data``), 500 warm-up
  and 1,000 draws, on every ``--nuts-every``-th replicate (default 20: 10 of 200).

``σ``'s Wald intervals are built on ``log σ`` (the unconstrained coordinate the library samples
in) and mapped by ``exp``. The MLE is found by 25 Newton steps from the pseudo-true value
(each model's log-likelihood is concave, or nearly so, near it); the bootstrap's 8 start at
the data's MLE.

Run: ``python benchmarks/calibration.py`` (every model, R = 200; about 5 s per replicate on
a shared 2-core machine, so about 75 minutes in one process; ``--models`` splits them over
processes), ``--replicates 20 --models counts`` for a quick look. ``--plots DIR`` writes the
figures (default ``docs/images/calibration``), ``--save DIR`` the measurements (``.npz``) and
``--load DIR[,DIR...]`` redraws tables and figures from saved measurements without running
anything (chunks run with ``--first-seed`` into several directories are joined).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import traceback
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import lax, random
from numpyro.infer import MCMC, NUTS
from scipy import stats

from numpyro_sgmc import calibration, full_data

TARGETS = (
    "posterior",
    "bagged",
    "local_fiducial",
    {"target": "mix", "weights": (0.5, 0.5)},
)
NEWTON_STEPS = 25  # from the pseudo-true value; the bootstrap's from the data's MLE: 8


# ---------------------------------------------------------------------------------- models


def linear_model(X, y=None):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(5.0))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Normal(Xb @ theta, sigma), obs=yb)


def poisson_model(X, y=None):
    theta = numpyro.sample("theta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Poisson(jnp.exp(Xb @ theta)), obs=yb)


def logistic_model(X, y=None, prior_scale=10.0):
    theta = numpyro.sample("theta", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0], subsample_size=100):
        Xb = numpyro.subsample(X, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ theta), obs=yb)


def wellspec_model(X, y=None):
    logistic_model(X, y, prior_scale=1.0)


# per-datum log-likelihoods in the unconstrained coordinates (σ as log σ), for the references


def linear_loglik(u, x, y):
    theta, log_sigma = u[:-1], u[-1]
    return -log_sigma - 0.5 * (y - x @ theta) ** 2 * jnp.exp(-2 * log_sigma)


def poisson_loglik(u, x, y):
    eta = x @ u
    return y * eta - jnp.exp(eta)


def logistic_loglik(u, x, y):
    eta = x @ u
    return y * eta - jnp.logaddexp(0.0, eta)


def equicorrelated(rng, n, d, rho=0.5):
    cov = (1 - rho) * np.eye(d) + rho * np.ones((d, d))
    return rng.multivariate_normal(np.zeros(d), cov, size=n)


def simulate_hetero(n):
    def simulate(seed):
        rng = np.random.default_rng(seed)
        X = equicorrelated(rng, n, 3)
        y = X @ np.array([1.0, 0.0, -1.0]) + (0.3 + 1.5 * np.abs(X[:, 0])) * rng.standard_normal(n)
        return jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32)

    return simulate


def simulate_counts(n, concentration=1.5):
    def simulate(seed):
        rng = np.random.default_rng(seed)
        Z = equicorrelated(rng, n, 2, rho=0.6)
        X = np.column_stack([np.ones(n), 0.5 * Z])
        mean = np.exp(X @ np.array([0.5, 0.4, -0.3]))
        y = rng.negative_binomial(concentration, concentration / (concentration + mean))
        return jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32)

    return simulate


INTERACTION = np.array([-1.0, 1.0, 0.5, 3.0])  # logit = (1, t, x, t·x) @ INTERACTION


def simulate_interaction(n):
    def simulate(seed):
        rng = np.random.default_rng(seed)
        t, x = 1.0 * (rng.random(n) < 0.5), rng.standard_normal(n)
        logit = np.column_stack([np.ones(n), t, x, t * x]) @ INTERACTION
        y = rng.random(n) < 1 / (1 + np.exp(-logit))
        X = np.column_stack([np.ones(n), t, x])
        return jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32)

    return simulate


def interaction_pseudo_true() -> np.ndarray:
    """The root of ``E[(y - σ(θ·(1, t, x)))(1, t, x)] = 0`` under the data's law: Newton steps,
    the expectation over ``t`` exact and over ``x ~ N(0, 1)`` by Gauss–Hermite quadrature."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    weights = weights / weights.sum()
    rows, mass = [], []
    for t in (0.0, 1.0):
        rows.append(np.column_stack([np.ones_like(nodes), np.full_like(nodes, t), nodes]))
        mass.append(0.5 * weights)
    Z, w = np.concatenate(rows), np.concatenate(mass)
    p_true = 1 / (1 + np.exp(-(np.column_stack([Z, Z[:, 1] * Z[:, 2]]) @ INTERACTION)))
    theta = np.zeros(3)
    for _ in range(50):
        p = 1 / (1 + np.exp(-Z @ theta))
        score = Z.T @ (w * (p_true - p))
        info = (Z * (w * p * (1 - p))[:, None]).T @ Z
        theta = theta + np.linalg.solve(info, score)
    return theta


def wellspec_covariates(n):
    def covariates(seed):
        rng = np.random.default_rng(10**6 + seed)
        return (jnp.asarray(np.column_stack([np.ones(n), equicorrelated(rng, n, 2)]), jnp.float32),)

    return covariates


def simulate_wellspec(n, theta=(-0.5, 1.0, -0.5)):
    covariates = wellspec_covariates(n)

    def simulate(seed):
        (X,) = covariates(seed)
        rng = np.random.default_rng(seed)
        p = 1 / (1 + np.exp(-np.asarray(X, np.float64) @ np.asarray(theta)))
        return X, jnp.asarray(rng.random(n) < p, jnp.float32)

    return simulate


class Problem(NamedTuple):
    """One benchmark model: the NumPyro model, the data-generating process, the pseudo-true
    value (constrained sites), the log-likelihood for the references, and how the flat
    unconstrained vector of the references maps to the sites."""

    model: Callable
    simulate: Callable
    truth: dict
    loglik: Callable
    unflatten: Callable  # flat unconstrained u -> {site: (slice, is_log)}
    description: str


def problems(n: int) -> dict:
    sigma_star = float(np.sqrt(0.09 + 0.9 * np.sqrt(2 / np.pi) + 2.25))
    theta_sites = {"theta": (slice(0, 3), False)}
    return {
        "hetero": Problem(
            linear_model,
            simulate_hetero(n),
            {"theta": np.array([1.0, 0.0, -1.0]), "sigma": np.array(sigma_star)},
            linear_loglik,
            {"theta": (slice(0, 3), False), "sigma": (slice(3, 4), True)},
            f"heteroscedastic linear regression, n = {n}",
        ),
        "counts": Problem(
            poisson_model,
            simulate_counts(n),
            {"theta": np.array([0.5, 0.4, -0.3])},
            poisson_loglik,
            theta_sites,
            f"Poisson regression on negative-binomial counts (concentration 1.5), n = {n}",
        ),
        "logistic": Problem(
            logistic_model,
            simulate_interaction(n),
            {"theta": interaction_pseudo_true()},
            logistic_loglik,
            theta_sites,
            f"logistic regression, omitted treatment × covariate interaction, n = {n}",
        ),
        "wellspec": Problem(
            wellspec_model,
            simulate_wellspec(n),
            {"theta": np.array([-0.5, 1.0, -0.5])},
            logistic_loglik,
            theta_sites,
            f"well-specified logistic regression, n = {n}",
        ),
    }


# ------------------------------------------------------------------------------ references


def flat_truth(problem: Problem) -> np.ndarray:
    u = np.zeros(sum(s.stop - s.start for s, _ in problem.unflatten.values()))
    for site, (where, is_log) in problem.unflatten.items():
        value = np.reshape(problem.truth[site], -1)
        u[where] = np.log(value) if is_log else value
    return u


def newton(loglik, u0, X, y, weights, steps=NEWTON_STEPS):
    """``steps`` Newton steps on ``Σᵢ wᵢ l(u; xᵢ, yᵢ)`` from ``u0``."""

    def total(u):
        return jnp.sum(weights * jax.vmap(loglik, (None, 0, 0))(u, X, y))

    def step(u, _):
        return u - jnp.linalg.solve(jax.hessian(total)(u), jax.grad(total)(u)), None

    return lax.scan(step, u0, length=steps)[0]


def make_references(
    problem: Problem,
    num_bootstrap: int,
    nuts_every: int,
    num_replicates: int,
    nuts: MCMC,
    first_seed: int = 0,
) -> dict:
    loglik, u_star = problem.loglik, jnp.asarray(flat_truth(problem), jnp.float32)

    @jax.jit
    def fit(X, y):
        u = newton(loglik, u_star, X, y, jnp.ones(X.shape[0]))
        H = -jax.hessian(lambda v: jnp.sum(jax.vmap(loglik, (None, 0, 0))(v, X, y)))(u)
        G = jax.vmap(jax.grad(loglik), (None, 0, 0))(u, X, y)
        Hinv = jnp.linalg.inv(H)
        return u, jnp.sqrt(jnp.diag(Hinv)), jnp.sqrt(jnp.diag(Hinv @ G.T @ G @ Hinv))

    @jax.jit
    def bootstrap(key, X, y, u_hat):
        n = X.shape[0]
        counts = jax.vmap(lambda k: jnp.bincount(random.randint(k, (n,), 0, n), length=n))(
            random.split(key, num_bootstrap)
        )
        return jax.vmap(lambda w: newton(loglik, u_hat, X, y, w, 8))(counts.astype(jnp.float32))

    def wald(kind):
        def reference(key, X, y):
            u, se_classical, se_hc0 = (np.asarray(a, np.float64) for a in fit(X, y))
            se = se_classical if kind == "classical" else se_hc0
            out = {}
            for site, (where, is_log) in problem.unflatten.items():
                shape = np.shape(problem.truth[site])
                m, s = u[where].reshape(shape), se[where].reshape(shape)
                out[site] = stats.lognorm(s=s, scale=np.exp(m)) if is_log else stats.norm(m, s)
            return out

        return reference

    def bootstrap_reference(key, X, y):
        u_hat, _, _ = fit(X, y)
        draws = np.asarray(bootstrap(key, X, y, u_hat), np.float64)
        out = {}
        for site, (where, is_log) in problem.unflatten.items():
            x = draws[:, where].reshape((num_bootstrap,) + np.shape(problem.truth[site]))
            out[site] = np.exp(x) if is_log else x
        return out

    def nuts_reference(key, X, y):
        nuts.run(key, X, y)
        return {k: np.asarray(v) for k, v in nuts.get_samples().items()}

    return {
        "classical": wald("classical"),
        "HC0": wald("HC0"),
        "bootstrap": bootstrap_reference,
        "NUTS": (nuts_reference, range(first_seed, first_seed + num_replicates, nuts_every)),
    }


# ---------------------------------------------------------------------------------- output


def save(result: calibration.Calibration, path: Path) -> None:
    fields = result._asdict()
    failures = np.array([tuple(f) for f in result.failures], dtype=object).reshape(-1, 3)
    warned = np.array([tuple(f) for f in result.warnings], dtype=object).reshape(-1, 3)
    fields.update(failures=failures, warnings=warned)
    np.savez(path, **{k: np.asarray(v, dtype=object) for k, v in fields.items()})


def load(path: Path) -> calibration.Calibration:
    data = np.load(path, allow_pickle=True)
    kw = {k: data[k] for k in data.files}
    for k in ("truth", "lower", "upper", "ranks", "predicted", "seconds", "seeds"):
        kw[k] = kw[k].astype(np.float64 if k != "seeds" else np.int64)
    for k in ("methods", "names", "levels"):
        kw[k] = tuple(kw[k].tolist())
    kw["num_ranks"] = int(kw["num_ranks"])
    checked = kw.pop("checked", None)  # absent, or None saved as a 0-d object array
    if checked is not None and checked.ndim == 2:
        kw["checked"] = checked.astype(np.float64)
    kw["failures"] = tuple(
        calibration.Failure(str(m), int(s), str(t)) for m, s, t in kw["failures"]
    )
    kw["warnings"] = tuple(
        calibration.Failure(str(m), int(s), str(t)) for m, s, t in kw["warnings"]
    )
    return calibration.Calibration(**kw)


def markdown_table(result: calibration.Calibration, level: float) -> str:
    """Coverage (%) ± binomial se [Table 1 prediction]; bold where more than two binomial
    standard errors (at the nominal level) from nominal."""
    k = result.levels.index(level)
    head = "| method | R | " + " | ".join(f"`{n}`" for n in result.names) + " |"
    lines = [head, "|" + "---|" * (len(result.names) + 2)]
    z = result.z_scores
    for m, method in enumerate(result.methods):
        cells = []
        for i in range(len(result.names)):
            c, se = result.coverage[m, k, i], result.coverage_se[m, k, i]
            p = result.predicted_coverage[m, k, i]
            pred = f" [{100 * p:.1f}]" if np.isfinite(p) else ""
            cell = f"{100 * c:.1f} ± {100 * se:.1f}"
            cells.append((f"**{cell}**" if abs(z[m, k, i]) > 2 else cell) + pred)
        lines.append(f"| {method} | {result.num_valid[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def width_table(result: calibration.Calibration, level: float, relative_to: str) -> str:
    k, base = result.levels.index(level), result.methods.index(relative_to)
    lines = [
        "| method | " + " | ".join(f"`{n}`" for n in result.names) + " |",
        "|" + "---|" * (len(result.names) + 1),
    ]
    for m, method in enumerate(result.methods):
        cells = [
            f"{result.width[m, k, i]:.4g} ({result.width[m, k, i] / result.width[base, k, i]:.2f})"
            for i in range(len(result.names))
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def nuts_comparison(result: calibration.Calibration) -> str:
    """Our posterior's 95% intervals against NUTS's on the replicates NUTS ran on."""
    nuts = result.methods.index("NUTS")
    post = result.methods.index("posterior")
    k = result.levels.index(0.95)
    both = result.ran[nuts] & result.ran[post]
    if not both.any():
        return "NUTS ran on no replicate"
    wn = result.upper[nuts, both, k] - result.lower[nuts, both, k]
    wp = result.upper[post, both, k] - result.lower[post, both, k]
    ends = np.abs(
        np.concatenate([result.lower[post, both, k] - result.lower[nuts, both, k],
                        result.upper[post, both, k] - result.upper[nuts, both, k]])
    ) / np.concatenate([wn, wn])  # fmt: skip
    ratio = wp / wn
    parts = [
        f"on the {both.sum()} replicates NUTS ran: posterior / NUTS 95% width "
        + ", ".join(
            f"{n} {r.mean():.3f} ± {r.std(ddof=1) / np.sqrt(len(r)):.3f}"
            for n, r in zip(result.names, ratio.T, strict=True)
        ),
        f"interval ends differ from NUTS's by {100 * ends.mean():.1f}% of its width on average "
        f"(largest {100 * ends.max():.1f}%)",
    ]
    return "; ".join(parts)


def plots(result, sbc, name: str, problem: Problem, directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    fig = calibration.plot_coverage(result, title=f"{name}: {problem.description}")
    fig.savefig(directory / f"{name}_coverage.png", dpi=110)
    fig = calibration.plot_widths(result, 0.95, relative_to="HC0")
    fig.savefig(directory / f"{name}_widths.png", dpi=110)
    if sbc is not None:
        fig = calibration.plot_ranks(sbc, "posterior", bins=10)
        fig.savefig(directory / f"{name}_sbc.png", dpi=110)
    plt.close("all")


def markdown_section(name, problem, result, sbc) -> str:
    """The docs page's section for one model: tables, figures, references' agreement."""
    R = len(result.seeds)
    truth = ", ".join(
        f"`{k}` = {np.round(np.asarray(v), 4).tolist()}" for k, v in problem.truth.items()
    )
    found = {kind: len(f) for kind, f in (("failed", result.failures), ("warned", result.warnings))}
    lines = [
        f"### `{name}`: {problem.description}, R = {R}",
        "",
        f"Pseudo-true value: {truth}. Runs that raised: {found['failed']}; that warned: "
        f"{found['warned']}"
        + (
            " ("
            + ", ".join(sorted({f"{w.method}: {w.message.split(':')[0]}" for w in result.warnings}))
            + ")"
            if result.warnings
            else ""
        )  # fmt: skip
        + ". Table 1 rows chosen: "
        + "; ".join(
            f"{m} {calibration._rows(result.rows[k])}"
            for k, m in enumerate(result.methods)
            if any(result.rows[k])
        )
        + ".",
        "",
        "Coverage of the 95% intervals (%, ± binomial se, [Table 1 prediction]; **bold**: more "
        "than 2 se from nominal):",
        "",
        markdown_table(result, 0.95),
        "",
    ]
    for level in (0.5, 0.8):
        lines += [f"{100 * level:g}% intervals:", "", markdown_table(result, level), ""]
    lines += [
        "Mean width of the 95% intervals (and its ratio to HC0's):",
        "",
        width_table(result, 0.95, "HC0"),
        "",
        "NUTS against our posterior: " + nuts_comparison(result) + ".",
        "",
        "Median wall time per replicate (tuning and run, or the reference): "
        + ", ".join(
            f"{m} {calibration._median(result.seconds[k]):.2f} s"
            for k, m in enumerate(result.methods)
        )
        + ".",
        "",
        f"![coverage, {name}](images/calibration/{name}_coverage.png)",
        f"![widths, {name}](images/calibration/{name}_widths.png)",
        "",
    ]
    if sbc is not None:
        test = sbc.sbc("posterior", bins=10)
        lines += [
            f"**Simulation-based calibration** of the posterior, R = {len(sbc.seeds)}: θ from "
            "the prior N(0, 1), data from the model; ranks of the true value among "
            f"{sbc.num_ranks - 1} thinned draws, chi-square on 10 bins (dof 9):",
            "",
            "| parameter | χ² | p | counts per bin |",
            "|---|---|---|---|",
        ]
        for i, n in enumerate(test.names):
            counts = " ".join(str(int(c)) for c in test.counts[i])
            lines.append(f"| `{n}` | {test.statistic[i]:.2f} | {test.p_value[i]:.3f} | {counts} |")
        lines += [
            "",
            "Coverage of the same replicates' posterior intervals (%, ± se):",
            "",
            markdown_table(sbc, 0.95),
            "",
            f"![SBC ranks, {name}](images/calibration/{name}_sbc.png)",
            "",
        ]
    return "\n".join(lines)


def report(name, problem, result, sbc, seconds) -> str:
    lines = [
        f"== {name}: {problem.description}; R = {len(result.seeds)} ({seconds / 60:.1f} min)",
        "pseudo-true value: "
        + ", ".join(
            f"{k} = {np.round(np.asarray(v), 4).tolist()}" for k, v in problem.truth.items()
        ),
        result.table(),
        nuts_comparison(result),
    ]
    for kind, found in (("failed", result.failures), ("warned", result.warnings)):
        methods = sorted({f.method for f in found})
        lines.append(f"{len(found)} runs {kind}" + (f" ({', '.join(methods)})" if found else ""))
        lines.extend(f"  {f.method}, seed {f.seed}: {f.message[:160]}" for f in found[:5])
    if sbc is not None:
        lines.append(f"simulation-based calibration of the posterior, R = {len(sbc.seeds)}")
        lines.append(str(sbc.sbc("posterior", bins=10)))
        lines.append(sbc.table(0.95))
    lines.append("\nmarkdown, 95%:\n" + markdown_table(result, 0.95))
    for level in (0.5, 0.8):
        lines.append(f"\nmarkdown, {100 * level:g}%:\n" + markdown_table(result, level))
    lines.append("\nmarkdown widths, 95% (/ HC0):\n" + width_table(result, 0.95, "HC0"))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicates", type=int, default=200)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--ess", type=float, default=500)
    parser.add_argument("--models", default="hetero,counts,logistic,wellspec")
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--nuts-every", type=int, default=20)
    parser.add_argument("--plots", default="docs/images/calibration")
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="seeds first, first + 1, ...: run chunks"
    )
    parser.add_argument("--markdown", default=None, help="append the docs sections to FILE")
    parser.add_argument(
        "--sbc-replicates", type=int, default=None, help="R of the SBC (default --replicates)"
    )
    parser.add_argument(
        "--sbc-only", action="store_true", help="wellspec: run (and save) the SBC alone"
    )
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, numpyro {numpyro.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores; R = {args.replicates}, n = {args.rows}, "
        f"ESS {args.ess:g}, bootstrap {args.bootstrap}, NUTS on every "
        f"{args.nuts_every}th replicate",
        flush=True,
    )
    every = problems(args.rows)
    for name in args.models.split(","):
        problem = every[name]
        start = time.perf_counter()
        try:
            result, sbc = measure(name, problem, args)
        except Exception:  # noqa: BLE001 - one model's set-up error must not lose the others
            print(f"== {name}: failed\n{traceback.format_exc()}", flush=True)
            continue
        print(report(name, problem, result, sbc, time.perf_counter() - start), flush=True)
        if args.markdown:
            with open(args.markdown, "a", encoding="utf-8") as out:
                out.write(markdown_section(name, problem, result, sbc) + "\n")
        if args.plots:
            plots(result, sbc, name, problem, Path(args.plots))


def simulation_based_calibration(problem: Problem, args) -> calibration.Calibration:
    """The posterior's SBC on the well-specified model: ``θ`` from the prior, data from the
    model on the benchmark's covariates."""
    simulate = calibration.prior_simulator(
        problem.model, wellspec_covariates(args.rows), random.key(1), observed="y"
    )
    return calibration.calibrate(
        problem.model,
        simulate,
        None,
        random.key(2),
        targets=("posterior",),
        num_replicates=args.sbc_replicates or args.replicates,
        ess=args.ess,
        first_seed=args.first_seed,
    )


def measure(name: str, problem: Problem, args):
    """The calibration of one model (and its SBC for ``wellspec``), run or loaded."""
    if args.load:  # chunks of one model in several directories are joined
        directories = [Path(d) for d in args.load.split(",")]
        found = [load(d / f"{name}.npz") for d in directories if (d / f"{name}.npz").exists()]
        chunks = [
            load(d / f"{name}_sbc.npz") for d in directories if (d / f"{name}_sbc.npz").exists()
        ]
        if not found:
            raise FileNotFoundError(f"No {name}.npz in {args.load}.")
        sbc = calibration.concatenate(chunks) if chunks else None
        return calibration.concatenate(found), sbc
    if args.sbc_only:
        sbc = simulation_based_calibration(problem, args)
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            save(sbc, Path(args.save) / f"{name}_sbc.npz")
        print(sbc.table(0.95), sbc.sbc("posterior", bins=10), sep="\n", flush=True)
        raise SystemExit(0)
    nuts = MCMC(
        NUTS(full_data(problem.model)),
        num_warmup=500,
        num_samples=1000,
        progress_bar=False,
        jit_model_args=True,
    )
    result = calibration.calibrate(
        problem.model,
        problem.simulate,
        problem.truth,
        random.key(0),
        targets=TARGETS,
        num_replicates=args.replicates,
        ess=args.ess,
        first_seed=args.first_seed,
        references=make_references(
            problem, args.bootstrap, args.nuts_every, args.replicates, nuts, args.first_seed
        ),
    )
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        save(result, Path(args.save) / f"{name}.npz")
    sbc = None
    if name == "wellspec":
        sbc = simulation_based_calibration(problem, args)
        if args.save:
            save(sbc, Path(args.save) / f"{name}_sbc.npz")
    return result, sbc


if __name__ == "__main__":
    main()
