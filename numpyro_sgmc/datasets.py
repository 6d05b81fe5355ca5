"""Small benchmark datasets bundled with scikit-learn, split and scaled for the examples.

Both datasets ship inside scikit-learn (no download): the 8×8 handwritten digits (1797 images,
10 classes) and the diabetes progression data (442 patients, 10 covariates, a continuous
target). Each loader shuffles the rows with a seeded NumPy permutation and splits them into a
training and a test part; the rows of either part are in random order, as
``batch_sampling="blocks"`` needs. Arrays are NumPy: ``float32`` inputs and targets,
``int32`` labels.

scikit-learn is an optional dependency: ``pip install "numpyro-sgmc[examples]"``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

__all__ = ["Split", "diabetes", "digits"]


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


def _split_indices(num_rows: int, seed: int, test_fraction: float) -> tuple:
    """``(train, test)`` row indices: a seeded permutation, its first part the test rows."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction!r}.")
    num_test = round(test_fraction * num_rows)
    if not 0 < num_test < num_rows:
        raise ValueError(
            f"test_fraction={test_fraction} leaves an empty training or test set of "
            f"{num_rows} rows."
        )
    order = np.random.default_rng(seed).permutation(num_rows)
    return order[num_test:], order[:num_test]


def _standardise(train: np.ndarray, test: np.ndarray) -> tuple:
    """Both arrays centred and scaled by the training mean and standard deviation (axis 0)."""
    mean, scale = train.mean(axis=0), train.std(axis=0)
    return (train - mean) / scale, (test - mean) / scale, mean, scale


def digits(seed: int = 0, test_fraction: float = 0.2) -> Split:
    """The scikit-learn handwritten digits: 1797 grey-scale 8×8 images of the digits 0–9.

    Pixel intensities (integers 0–16) are divided by 16, so ``X`` lies in ``[0, 1]``; images
    keep their shape, ``(N, 8, 8)``, for :func:`numpyro_sgmc.networks.lenet` (the MLP
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
