"""Benchmark datasets, split and scaled for the examples and the benchmarks; no download.

Two ship inside scikit-learn: the 8×8 handwritten digits (1797 images, 10 classes) and the
diabetes progression data (442 patients, 10 covariates, a continuous target). Three regression
data sets from the UCI Machine Learning Repository are bundled with this package
(``numpyro_sgmc/bde/data``, the copies of the ``sklearn-contrib-bde`` wheel; sources and
licences in that folder's ``README.md``): airfoil self-noise, concrete compressive strength and
hourly bike sharing, the data of the regression benchmark of ``sklearn-contrib-bde``'s paper.

Each loader shuffles the rows with a seeded NumPy permutation and splits them into a training
and a test part; the rows of either part are in random order, as ``batch_sampling="blocks"``
needs. Arrays are NumPy: ``float32`` inputs and targets, ``int32`` labels.

The bundled UCI sets are split as scikit-learn's ``train_test_split(X, y,
test_size=test_fraction, random_state=seed)`` (computed without scikit-learn) and their inputs
and target standardised with the training rows' mean and standard deviation
(``StandardScaler``): with the defaults, the split and scaling of the regression benchmark of
``sklearn-contrib-bde`` (its ``paper/scripts/benchmark.py``, split seed 0). Their
:class:`Split` carries ``float32`` arrays with ``y_mean`` and ``y_scale`` to undo the
target's standardisation.

scikit-learn (for :func:`digits` and :func:`diabetes` only) is an optional dependency:
``pip install "numpyro-sgmc[examples]"``.
"""

from __future__ import annotations

import csv
import gzip
import math
from importlib import resources
from typing import NamedTuple, Optional

import numpy as np

__all__ = ["Split", "airfoil", "bike_sharing", "concrete", "diabetes", "digits"]


class Split(NamedTuple):
    """A training/test split.

    :param X_train: training inputs.
    :param y_train: training targets or labels.
    :param X_test: test inputs.
    :param y_test: test targets or labels.
    :param y_mean: the training mean subtracted from a standardised target (``None`` when
        the target is not standardised); ``y * y_scale + y_mean`` is on the original scale.
    :param y_scale: the training standard deviation a standardised target was divided by
        (``None`` when it is not standardised); an RMSE times ``y_scale`` is on the original
        scale.
    """

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    y_mean: Optional[float] = None
    y_scale: Optional[float] = None


def _sklearn_datasets():
    try:
        from sklearn import datasets
    except ImportError as err:
        raise ImportError(
            "The bundled datasets are read with scikit-learn, which is not installed. "
            'Install it with: pip install "numpyro-sgmc[examples]"'
        ) from err
    return datasets


def _num_test(num_rows: int, test_fraction: float, rounding) -> int:
    """The number of test rows, ``rounding(test_fraction · num_rows)``, leaving both parts
    non-empty."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction!r}.")
    num_test = rounding(test_fraction * num_rows)
    if not 0 < num_test < num_rows:
        raise ValueError(
            f"test_fraction={test_fraction} leaves an empty training or test set of "
            f"{num_rows} rows."
        )
    return num_test


def _split_indices(num_rows: int, seed: int, test_fraction: float) -> tuple:
    """``(train, test)`` row indices: a seeded permutation, its first part the test rows."""
    num_test = _num_test(num_rows, test_fraction, round)
    order = np.random.default_rng(seed).permutation(num_rows)
    return order[num_test:], order[:num_test]


def _standardise(train: np.ndarray, test: np.ndarray) -> tuple:
    """Both arrays centred and scaled by the training mean and standard deviation (axis 0);
    a column that is constant on the training rows is only centred (scale 1)."""
    mean, scale = train.mean(axis=0), train.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    return (train - mean) / scale, (test - mean) / scale, mean, scale


def digits(seed: int = 0, test_fraction: float = 0.2) -> Split:
    """The scikit-learn handwritten digits: 1797 grey-scale 8×8 images of the digits 0–9.

    Pixel intensities (integers 0–16) are divided by 16, so ``X`` lies in ``[0, 1]``; images
    keep their shape, ``(N, 8, 8)``, for :func:`numpyro_sgmc.bde.networks.lenet` (the MLP
    flattens them). Source: the UCI "Optical Recognition of Handwritten Digits" test set
    (E. Alpaydin, C. Kaynak, 1998), as bundled by ``sklearn.datasets.load_digits``.

    :param seed: seed of the NumPy permutation that splits the rows.
    :param test_fraction: fraction of the rows held out for testing.
    :return: a :class:`Split` with ``float32`` images and ``int32`` labels; ``y_mean`` and
        ``y_scale`` are ``None``.
    :raises ImportError: scikit-learn is not installed.
    :raises ValueError: ``test_fraction`` leaves no training or no test row.
    """
    data = _sklearn_datasets().load_digits()
    train, test = _split_indices(len(data.target), seed, test_fraction)
    X = (data.images / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    return Split(X[train], y[train], X[test], y[test])


def diabetes(seed: int = 0, test_fraction: float = 0.2) -> Split:
    """The scikit-learn diabetes data: disease progression of 442 patients, 10 covariates.

    Inputs and target are standardised with the training rows' mean and standard deviation
    (each covariate separately), so the test rows are scaled exactly as the training rows;
    the target's mean and scale are kept on the :class:`Split`. Source: B. Efron, T. Hastie,
    I. Johnstone, R. Tibshirani, *Least Angle Regression*, Annals of Statistics 2004, as
    bundled by ``sklearn.datasets.load_diabetes``.

    :param seed: seed of the NumPy permutation that splits the rows.
    :param test_fraction: fraction of the rows held out for testing.
    :return: a :class:`Split` with ``float32`` arrays ``X`` ``(N, 10)`` and ``y`` ``(N,)``,
        and ``y_mean``, ``y_scale`` (Python floats) to undo the target's standardisation.
    :raises ImportError: scikit-learn is not installed.
    :raises ValueError: ``test_fraction`` leaves no training or no test row.
    """
    data = _sklearn_datasets().load_diabetes(scaled=False)
    train, test = _split_indices(len(data.target), seed, test_fraction)
    X_train, X_test, _, _ = _standardise(data.data[train], data.data[test])
    y_train, y_test, y_mean, y_scale = _standardise(data.target[train], data.target[test])
    return Split(
        X_train.astype(np.float32),
        y_train.astype(np.float32),
        X_test.astype(np.float32),
        y_test.astype(np.float32),
        float(y_mean),
        float(y_scale),
    )


def _bundled_rows(filename: str, delimiter: Optional[str], header: bool) -> tuple:
    """``(column names or None, rows as lists of strings)`` of a gzip file in ``data/``."""
    with resources.files("numpyro_sgmc.bde").joinpath("data", filename).open("rb") as raw:
        with gzip.open(raw, "rt", newline="") as text:
            if delimiter is None:  # whitespace-separated
                rows = [line.split() for line in text if line.strip()]
            else:
                rows = [row for row in csv.reader(text, delimiter=delimiter) if row]
    return (rows[0], rows[1:]) if header else (None, rows)


def _sklearn_split(num_rows: int, seed: int, test_fraction: float) -> tuple:
    """``(train, test)`` row indices of ``sklearn.model_selection.train_test_split(...,
    test_size=test_fraction, random_state=seed)``: ``⌈f·N⌉`` test rows, the first of a legacy
    ``RandomState(seed)`` permutation."""
    num_test = _num_test(num_rows, test_fraction, math.ceil)
    order = np.random.RandomState(seed).permutation(num_rows)
    return order[num_test:], order[:num_test]


def _regression_split(X: np.ndarray, y: np.ndarray, seed: int, test_fraction: float) -> Split:
    """Split as scikit-learn's ``train_test_split`` and standardise ``X`` and ``y`` with the
    training rows' mean and standard deviation (scikit-learn's ``StandardScaler``)."""
    train, test = _sklearn_split(len(y), seed, test_fraction)
    X_train, X_test, _, _ = _standardise(X[train], X[test])
    y_train, y_test, y_mean, y_scale = _standardise(y[train], y[test])
    return Split(
        X_train.astype(np.float32),
        y_train.astype(np.float32),
        X_test.astype(np.float32),
        y_test.astype(np.float32),
        float(y_mean),
        float(y_scale),
    )


def airfoil(seed: int = 0, test_fraction: float = 0.2) -> Split:
    """NASA's airfoil self-noise data: 1503 wind-tunnel measurements, 5 inputs.

    Inputs: frequency (Hz), angle of attack (degrees), chord length (m), free-stream velocity
    (m/s), suction-side displacement thickness (m); target: scaled sound pressure level (dB).
    Source: T. Brooks, D. Pope, M. Marcolini, *Airfoil Self-Noise and Prediction*, NASA
    RP-1218, 1989, via the UCI Machine Learning Repository (bundled, no download).

    Split and standardised as every bundled UCI set (module docstring).

    :param seed: ``random_state`` of the split.
    :param test_fraction: ``test_size`` of the split.
    :return: a :class:`Split`, ``X`` ``(N, 5)``, ``y`` ``(N,)``.
    :raises ValueError: ``test_fraction`` leaves no training or no test row.
    """
    _, rows = _bundled_rows("airfoil.csv.gz", ",", header=True)
    data = np.asarray(rows, dtype=np.float64)
    return _regression_split(data[:, :-1], data[:, -1], seed, test_fraction)


def concrete(seed: int = 0, test_fraction: float = 0.2) -> Split:
    """Compressive strength of 1030 concrete samples, 8 inputs.

    Inputs: cement, blast-furnace slag, fly ash, water, superplasticizer, coarse and fine
    aggregate (kg per m³ of mixture) and age (days); target: compressive strength (MPa).
    Source: I.-C. Yeh, *Modeling of strength of high-performance concrete using artificial
    neural networks*, Cement and Concrete Research 1998, via the UCI Machine Learning
    Repository (bundled, no download).

    Split and standardised as every bundled UCI set (module docstring).

    :param seed: ``random_state`` of the split.
    :param test_fraction: ``test_size`` of the split.
    :return: a :class:`Split`, ``X`` ``(N, 8)``, ``y`` ``(N,)``.
    :raises ValueError: ``test_fraction`` leaves no training or no test row.
    """
    _, rows = _bundled_rows("concrete.data.gz", None, header=False)
    data = np.asarray(rows, dtype=np.float64)
    return _regression_split(data[:, :-1], data[:, -1], seed, test_fraction)


_BIKE_DROPPED = ("instant", "dteday", "casual", "registered", "cnt")


def bike_sharing(seed: int = 0, test_fraction: float = 0.2) -> Split:
    """Hourly rental counts of Washington D.C.'s Capital Bikeshare, 2011–2012: 17379 hours.

    Inputs (12): season, year, month, hour, holiday, weekday, working day, weather situation,
    normalised temperature, felt temperature, humidity and wind speed; target: the count of
    rentals (``cnt``). The record index, the date and the two counts that sum to the target
    (casual and registered users) are dropped. Source: H. Fanaee-T, J. Gama, *Event labeling
    combining ensemble detectors and background knowledge*, Progress in Artificial
    Intelligence 2013, via the UCI Machine Learning Repository (bundled, no download).

    Split and standardised as every bundled UCI set (module docstring).

    :param seed: ``random_state`` of the split.
    :param test_fraction: ``test_size`` of the split.
    :return: a :class:`Split`, ``X`` ``(N, 12)``, ``y`` ``(N,)``.
    :raises ValueError: ``test_fraction`` leaves no training or no test row.
    """
    names, rows = _bundled_rows("bike_sharing_hour.csv.gz", ",", header=True)
    inputs = [i for i, name in enumerate(names) if name not in _BIKE_DROPPED]
    target = names.index("cnt")
    X = np.asarray([[row[i] for i in inputs] for row in rows], dtype=np.float64)
    y = np.asarray([row[target] for row in rows], dtype=np.float64)
    return _regression_split(X, y, seed, test_fraction)
