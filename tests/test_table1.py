"""Table 1 (``docs/theory.md`` §4): targets, rows, and the tunings the autotuner uses.

No models: a random SPD ``J`` and a different ``I`` (a sandwich far from ``J⁻¹``). Each
tuning's prediction is recomputed independently with ``theory.stationary_covariance`` from its
``(h, β, Γ, Λ)``: the exact-noise rows must hit their target exactly, the natural-noise rows
within their stated ``O(h)``, and the paper's constants must be the limits of the exact ones.
"""

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest

from numpyro_sgmc import theory
from numpyro_sgmc.theory import ROWS, TABLE_1, InfeasibleTuning, target_covariance, tune

N, B = 10_000, 100
ROOT = Path(__file__).resolve().parents[1]


def spd(rng, eigenvalues):
    q, _ = np.linalg.qr(rng.standard_normal((len(eigenvalues), len(eigenvalues))))
    return (q * np.asarray(eigenvalues)) @ q.T


@pytest.fixture(scope="module")
def info():
    rng = np.random.default_rng(20240601)
    J = spd(rng, [0.5, 1.0, 2.0, 4.0])
    I = spd(rng, [0.3, 1.5, 2.5, 6.0])
    J_inv = np.linalg.inv(J)
    S = J_inv @ I @ J_inv
    assert np.linalg.norm(S - J_inv) / np.linalg.norm(J_inv) > 0.5
    return J, I, S


def rel(x, y):
    x, y = np.asarray(x), np.asarray(y)
    return np.linalg.norm(x - y) / np.linalg.norm(y)


def recomputed(t, J, I, hessians=None):
    """The discrete-Lyapunov covariance of tuning ``t``, from its ``(h, β, Γ, Λ)`` alone."""
    if t.control_variates and hessians is None:
        hessians = lambda sigma: sigma * 0.0  # noqa: E731  no Hessian spread: no gradient noise
    fields = ("step_size", "batch_size", "inverse_temperature", "preconditioner")
    fields += ("noise_preconditioner", "control_variates")
    given = {field: getattr(t, field) for field in fields}
    hessians = hessians if t.control_variates else None
    return np.asarray(theory.stationary_covariance(J, I, num_data=N, hessians=hessians, **given))


def test_rows_and_their_display_strings_are_the_docs_table():
    names = ("P1", "P2", "P3", "P4", "P5", "B", "F", "G", "A", "F-cv", "B-cv", "G-cv")
    assert tuple(r.name for r in TABLE_1) == names
    assert all(ROWS[r.name] is r for r in TABLE_1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ROWS["F"].target = "J⁻¹"
    assert (ROWS["F"].drift, ROWS["F"].noise, ROWS["F"].target) == ("J⁻¹", "–", "S")
    # the user's copy of the theory (docs/theory.md §4) shows the same table
    text = (ROOT / "docs" / "theory.md").read_text(encoding="utf-8")
    section = text[text.index("## 4. Table 1") :]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| row") and "---" not in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.setdefault(cells[0], cells)
    for row in TABLE_1:
        shown = [re.sub(r"\\\(|\\\)", "", c) for c in rows[row.name]]
        assert len(shown) == 8, (row.name, shown)
        assert shown[0] == row.name and shown[1] == row.algorithm, (row.name, shown)


@pytest.mark.parametrize(
    "target, kwargs, weights",
    [
        ("posterior", {}, (0.0, 1.0)),
        ("posterior", {"weight": 2.0}, (0.0, 2.0)),
        ("bagged", {}, (1.0, 1.0)),
        ("bagged", {"weight": 0.5}, (0.5, 0.5)),
        ("local_fiducial", {}, (1.0, 0.0)),
        ("sandwich", {}, (1.0, 0.0)),
        ("mix", {"weights": (0.3, 0.9)}, (0.3, 0.9)),
    ],
)
def test_target_weights(target, kwargs, weights):
    assert theory.target_weights(target, **kwargs) == weights


def test_target_covariances(info):
    J, I, S = info
    J_inv = np.linalg.inv(J)
    np.testing.assert_allclose(target_covariance(J, I, (0, 1)), J_inv, rtol=1e-12)
    np.testing.assert_allclose(target_covariance(J, I, (1, 0)), S, rtol=1e-12)
    np.testing.assert_allclose(target_covariance(J, I, (0.5, 0.5)), 0.5 * (S + J_inv), rtol=1e-12)
    np.testing.assert_allclose(
        target_covariance(J, I, (0.3, 0.9)), 0.3 * S + 0.9 * J_inv, rtol=1e-12
    )
    diagonal = target_covariance(np.diag(J), np.diag(I), (1, 0))
    assert isinstance(diagonal, theory.linear.Diagonal)  # a diagonal problem stays O(d)
    np.testing.assert_allclose(diagonal.values, np.diag(I) / np.diag(J) ** 2, rtol=1e-12)


def test_which_rows_reach_which_target():
    assert theory.rows_reaching((0, 1)) == ["P4", "P5"]
    assert theory.rows_reaching((0, 2)) == ["P4"]
    assert theory.rows_reaching((1, 0)) == ["F", "F-cv"]
    assert theory.rows_reaching((0.7, 0.7)) == ["B", "B-cv"]
    assert theory.rows_reaching((0.6, 0.8)) == ["G", "G-cv"]


EXACT = {  # rows whose injected noise makes the discrete prediction the target
    "P4": dict(step_size=1.0),
    "B": dict(weights=(0.7, 0.7)),
    "G": dict(weights=(0.6, 0.8)),
    "F-cv": dict(weights=(1.0, 0.0), step_size=1.0),
    "B-cv": dict(weights=(0.7, 0.7), step_size=0.5),
    "G-cv": dict(weights=(0.6, 0.8), step_size=1.0),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_noise_rows_hit_their_target(info, name):
    J, I, _ = info
    t = tune(name, J, I, batch_size=B, num_data=N, **EXACT[name])
    weights = EXACT[name].get("weights", (0.0, 1.0))
    Q = np.asarray(target_covariance(J, I, weights))
    np.testing.assert_allclose(np.asarray(t.target) * N, Q, rtol=1e-12)
    np.testing.assert_allclose(recomputed(t, J, I) * N, Q, rtol=1e-9)
    assert np.all(np.linalg.eigvalsh(np.asarray(t.noise_preconditioner)) > 0)
    # the plain Λ = Γ misses the target by the step's O(h) discretisation bias
    plain = t._replace(noise_preconditioner=t.preconditioner)
    assert rel(recomputed(plain, J, I) * N, Q) > t.step_size / 20


def test_natural_noise_rows(info):
    J, I, S = info
    J_inv = np.linalg.inv(J)
    f = tune("F", J, I, batch_size=B, num_data=N)  # exact step: the sandwich itself
    assert f.step_size == pytest.approx(4 * B / (N + B)) and math.isinf(f.inverse_temperature)
    assert f.noise_preconditioner is None and not f.control_variates
    np.testing.assert_allclose(recomputed(f, J, I) * N, S, rtol=1e-9)
    np.testing.assert_allclose(np.asarray(f.preconditioner), J_inv, rtol=1e-12)
    b = tune("B", J, I, batch_size=B, num_data=N, weights=(0.7, 0.7))
    assert b.step_size == pytest.approx(4 * 0.7 * B / (N + 0.7 * B))
    assert b.inverse_temperature == pytest.approx(N / 0.7)
    p5 = tune("P5", J, I, batch_size=B, num_data=N)  # the table's c_h = 4c_b, O(h) off J⁻¹
    assert p5.step_size == 4 * B / N and math.isinf(p5.inverse_temperature)
    np.testing.assert_allclose(np.asarray(p5.preconditioner), np.linalg.inv(I), rtol=1e-12)
    assert rel(recomputed(p5, J, I) * N, J_inv) < 2 * p5.step_size
    np.testing.assert_allclose(p5.covariance, recomputed(p5, J, I), rtol=1e-12)


def test_the_exact_constants_tend_to_the_tables(info):
    J, I, _ = info
    for n in (10**4, 10**6):
        g = tune("G", J, I, batch_size=B, num_data=n, weights=(0.6, 0.8))
        # c_h = 4 w1 c_b: h n / b -> 4 w1 with an O(b/n) gap
        assert abs(g.step_size * n / B - 4 * 0.6) <= 4 * 0.6 * (0.6 * B / n) * 1.0001


@pytest.mark.parametrize("name", ["P1", "P2"])
def test_p1_p2_bias_is_linear_in_h_n_over_b(info, name):
    J, I, S = info
    J_inv = np.linalg.inv(J)
    errors = []
    for c_h in (1.0, 0.01):
        t = tune(name, J, I, batch_size=B, num_data=N, c_h=c_h)
        errors.append(rel(recomputed(t, J, I) * N, J_inv))
    assert errors[0] > 1e-3
    np.testing.assert_allclose(errors[1], errors[0] / 100, rtol=0.02)


def test_mixing_in_epochs_is_the_tables(info):
    J, I, _ = info
    lam_min = np.min(np.linalg.eigvalsh(J))
    expect = {  # the linearised chain is exact: 4/(h λmin) - 1 iterations, b/n epochs each
        ("F", None): 1.0,
        ("B", (0.7, 0.7)): 1 / 0.7,
        ("G", (0.6, 0.8)): 1 / 0.6,
        ("P5", None): 1 / np.min(np.linalg.eigvals(np.linalg.inv(I) @ J).real) - B / N,
    }
    for (name, weights), epochs in expect.items():
        t = tune(name, J, I, batch_size=B, num_data=N, weights=weights)
        np.testing.assert_allclose(t.mixing(J, N).epochs, epochs, rtol=1e-9, err_msg=name)
    p3 = tune("P3", J, I, batch_size=B, num_data=N, c_h=200.0)
    np.testing.assert_allclose(p3.mixing(J, N).epochs, 4 * B / (200 * lam_min) - B / N, rtol=1e-9)
    cv = tune("F-cv", J, I, batch_size=B, num_data=N, weights=(1, 0), step_size=1.0)
    assert cv.mixing(J, N).iterations == pytest.approx(3.0)  # a few iterations, at any n


def test_control_variate_rows_with_the_hessian_noise_term(info):
    J, I, _ = info
    rng = np.random.default_rng(13)
    X = rng.standard_normal((500, 4)) * rng.exponential(1.0, (500, 1))
    H = -np.einsum("ni,nj->nij", X, X)
    J = -H.mean(axis=0)
    noise = theory.gradient_noise(batch_size=B, hessians=H, control_variates=True)
    for name, kw in (("P4", dict(step_size=1.0)), ("F-cv", dict(weights=(1, 0), step_size=1.0))):
        t = tune(name, J, I, batch_size=B, num_data=N, noise=noise, **kw)
        assert 0.01 < t.noise_fraction < 1
        Q = np.asarray(target_covariance(J, I, kw.get("weights", (0, 1))))
        np.testing.assert_allclose(recomputed(t, J, I, hessians=H) * N, Q, rtol=1e-7)
    # a batch too small for the heavy-tailed Hessians: no injected noise can reach the target
    tiny = theory.gradient_noise(batch_size=1, hessians=H, control_variates=True)
    with pytest.raises(InfeasibleTuning, match="times the noise the target covariance needs"):
        tune("P4", J, I, batch_size=1, num_data=N, noise=tiny, step_size=1.0)


def test_bad_rows_and_constants_are_named(info):
    J, I, _ = info
    common = dict(batch_size=B, num_data=N)
    with pytest.raises(ValueError, match="P1, P2, P3, P4, P5, B, F, G, A, F-cv"):
        tune("X", J, I, **common)
    with pytest.raises(ValueError, match="does not reach"):
        tune("F", J, I, weights=(0, 1), **common)
    with pytest.raises(ValueError, match="needs weights"):
        tune("B", J, I, **common)
    with pytest.raises(ValueError, match="non-negative"):
        tune("G", J, I, weights=(0.5, -0.5), **common)
    with pytest.raises(ValueError, match="w1 = w2 = 0"):
        tune("G", J, I, weights=(0.0, 0.0), **common)
    with pytest.raises(ValueError, match="needs c_h"):
        tune("P3", J, I, **common)
    with pytest.raises(ValueError, match="fixes its step-size constant"):
        tune("F", J, I, c_h=400.0, **common)
    with pytest.raises(ValueError, match="Unknown target 'typo'"):
        theory.target_weights("typo")
    with pytest.raises(ValueError, match="weights=\\(w1, w2\\)"):
        theory.target_weights("mix")


def test_a_row_is_its_data(info):
    """What a row is lives in its fields: a new row is one ``Row`` (here P4 under another
    name), and ``tune`` and the step rule treat it as they treat P4."""
    J, I, _ = info
    twin = dataclasses.replace(ROWS["P4"], name="P4-twin")
    a = tune(twin, J, I, batch_size=B, num_data=N, step_size=0.5)
    b = tune("P4", J, I, batch_size=B, num_data=N, step_size=0.5)
    assert a.row == "P4-twin" and a.control_variates and math.isfinite(a.inverse_temperature)
    np.testing.assert_allclose(a.noise_preconditioner, b.noise_preconditioner, rtol=1e-12)
    # a forced field changes the tuning the way the field says: no injected noise is SGD
    sgd = dataclasses.replace(ROWS["F"], name="F-twin", reach="sandwich")
    assert tune(sgd, J, I, batch_size=B, num_data=N).noise_preconditioner is None
    with pytest.raises(ValueError, match="reach='typo' is not one of"):
        dataclasses.replace(ROWS["F"], reach="typo")
    with pytest.raises(ValueError, match="step='4w1' is not one of"):
        dataclasses.replace(ROWS["F"], step="4w1")


def test_step_rule_is_the_tables():
    b, n = 50, 2000
    assert theory.step_rule("F", b, n) == pytest.approx(4 * b / (n + b))  # w1 = 1
    assert theory.step_rule("B", b, n, (0.5, 0.5)) == pytest.approx(2 * b / (n + 0.5 * b))
    assert theory.step_rule("P5", b, n) == pytest.approx(4 * b / n)
    assert theory.step_rule("P4", b, n, step_size=0.3) == 0.3
    assert theory.step_rule("P2", b, n, c_h=2.0, c_b=4.0) == pytest.approx(0.5 * b / n)
    with pytest.raises(ValueError, match="fixes its step-size constant"):
        theory.step_rule("G", b, n, (0.5, 0.5), step_size=0.1)
    with pytest.raises(ValueError, match="pass c_h, not step_size"):
        theory.step_rule("P1", b, n, step_size=0.1)
    # β as the rows say: n/w₂ (∞ without a J⁻¹ part), n for the control-variate rows
    assert theory.inverse_temperature("G", n, (0.5, 0.25)) == n / 0.25
    assert theory.inverse_temperature("G", n, (0.5, 0.0)) == math.inf
    assert theory.inverse_temperature("G-cv", n, (0.5, 0.25)) == n
    assert theory.inverse_temperature("F", n, (1.0, 0.0)) == math.inf
