"""Per-question classifiers on encoder vectors, trained on the teacher's soft labels.

A head is multinomial logistic regression whose targets are probability rows, not class ids:
the teacher's full distribution carries how sure it was, which a hard argmax would throw away.
With one-hot rows it is scikit-learn's multinomial ``LogisticRegression(C=C)`` for three or
more classes and its binomial ``LogisticRegression(C=2 * C)`` for two (the symmetric softmax
splits the weight vector between two rows, halving the penalty). Heads are stored as plain
arrays in one ``.npz`` so that loading a bundle never runs pickle.
"""

from __future__ import annotations

import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import scipy.sparse as sp
from scipy.optimize import minimize
from scipy.special import log_softmax, softmax
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils.validation import check_array, check_is_fitted

from cascade.atomic import write_atomically
from cascade.checks import is_integer, is_real
from cascade.errors import ModelError

_ROW_SUM_TOLERANCE = 1e-4
Matrix: TypeAlias = np.ndarray | sp.csr_matrix
"""Features: dense, or sparse rows (an embedding with n-grams beside it, cascade.encoder.ngrams)."""
_ARRAY_NAMES = ("coef", "intercept", "C", "max_iter")


class SoftmaxHead(ClassifierMixin, BaseEstimator):
    """Soft-label multinomial logistic regression: minimises 0.5*|W|^2 + C * sum_i w_i CE(Y_i, p_i).

    The intercept is not penalised, so at the optimum the weighted mean predicted distribution
    on the training set equals the weighted mean label: the head keeps the teacher's class
    balance. ``classes_`` are the column indices 0..k-1.
    """

    def __init__(self, C: float = 1.0, max_iter: int = 500) -> None:
        self.C = C
        self.max_iter = max_iter

    def fit(self, X: Matrix, Y: np.ndarray, sample_weight: Any = None) -> SoftmaxHead:
        """Fit to ``Y``, an (n, k) array of probability rows (one-hot rows for hard labels)."""
        self._check_params()
        X, Y, weights = _check_fit_data(X, Y, sample_weight)
        n_classes, n_features = Y.shape[1], X.shape[1]
        result = minimize(
            _loss_and_gradient,
            np.zeros(n_classes * (n_features + 1)),
            args=(X, Y, weights * self.C),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": self.max_iter},
        )
        if not result.success:
            warnings.warn(
                f"SoftmaxHead did not converge in max_iter={self.max_iter} iterations "
                f"({result.message}); raise max_iter or scale the features",
                ConvergenceWarning,
                stacklevel=2,
            )
        self._set_fitted(*_unpack(result.x, n_classes, n_features))
        self.n_iter_ = int(result.nit)
        return self

    def predict_proba(self, X: Matrix) -> np.ndarray:
        """(n, k) class probabilities; rows sum to 1."""
        check_is_fitted(self)
        X = check_array(X, dtype=np.float64, accept_sparse="csr")
        if X.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {X.shape[1]} features, but this head was fitted on "
                f"{self.n_features_in_}; embed with the encoder the head was trained on"
            )
        return softmax(np.asarray(X @ self.coef_.T) + self.intercept_, axis=1)

    def predict(self, X: Matrix) -> np.ndarray:
        """The most probable column index for each row."""
        return np.argmax(self.predict_proba(X), axis=1)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The fitted state and parameters as plain arrays, for ``np.savez``."""
        check_is_fitted(self)
        return {
            "coef": self.coef_,
            "intercept": self.intercept_,
            "C": np.asarray(self.C, dtype=np.float64),
            "max_iter": np.asarray(self.max_iter, dtype=np.int64),
        }

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> SoftmaxHead:
        """Rebuild a fitted head from ``to_arrays`` output; ModelError if they do not fit."""
        missing = [name for name in _ARRAY_NAMES if name not in arrays]
        if missing:
            raise ModelError(f"head arrays lack {missing}; expected {list(_ARRAY_NAMES)}")
        coef, intercept, C, max_iter = (np.asarray(arrays[name]) for name in _ARRAY_NAMES)
        if coef.ndim != 2 or coef.shape[0] < 2 or intercept.shape != (coef.shape[0],):
            raise ModelError(
                f"head arrays have coef shape {coef.shape} and intercept shape "
                f"{intercept.shape}; expected (k, d) with k >= 2 and (k,)"
            )
        if C.shape != () or max_iter.shape != ():
            raise ModelError(f"head arrays C and max_iter must be scalars; got {C!r}, {max_iter!r}")
        head = cls(C=float(C), max_iter=int(max_iter))
        head._set_fitted(coef.astype(np.float64), intercept.astype(np.float64))
        return head

    def _set_fitted(self, coef: np.ndarray, intercept: np.ndarray) -> None:
        self.coef_ = coef
        self.intercept_ = intercept
        self.n_classes_ = coef.shape[0]
        self.n_features_in_ = coef.shape[1]
        self.classes_ = np.arange(self.n_classes_)

    def _check_params(self) -> None:
        """Checked when fit starts, not in __init__, so that set_params is checked too."""
        if not is_real(self.C) or not self.C > 0:
            raise ValueError(f"The 'C' parameter of SoftmaxHead must be a float > 0; got {self.C!r}")
        if not is_integer(self.max_iter) or self.max_iter < 1:
            raise ValueError(
                f"The 'max_iter' parameter of SoftmaxHead must be an int >= 1; got {self.max_iter!r}"
            )


class HeadStack:
    """Every question's head as one weight matrix: one product per batch, however many questions.

    With n-gram columns a head's input is a sparse row, and a sparse product costs a fixed ~0.1 ms
    of dispatch whatever its size; sixteen heads one state at a time would pay it sixteen times.
    """

    def __init__(self, heads: Mapping[str, SoftmaxHead]) -> None:
        widths = {head.n_features_in_ for head in heads.values()}
        if len(widths) > 1:
            raise ValueError(f"heads read {sorted(widths)} features; a stack needs one width")
        self.questions = list(heads)
        columns = [head.coef_.T for head in heads.values()]
        self.weights = np.ascontiguousarray(np.hstack(columns)) if columns else np.zeros((0, 0))
        self.intercept = np.concatenate([head.intercept_ for head in heads.values()] or [np.zeros(0)])
        self.bounds = np.cumsum([0, *(head.n_classes_ for head in heads.values())])

    def predict_proba(self, X: Matrix) -> dict[str, np.ndarray]:
        """Question id -> (n, k) probabilities of its head; rows sum to 1."""
        logits = np.asarray(X @ self.weights) + self.intercept
        return {qid: softmax(logits[:, start:end], axis=1)
                for qid, start, end in zip(self.questions, self.bounds[:-1], self.bounds[1:], strict=True)}


def save_heads(path: Path, heads: Mapping[str, SoftmaxHead]) -> None:
    """Write every head into one ``.npz`` under ``<question_id>/<array>`` keys, atomically."""
    arrays: dict[str, np.ndarray] = {}
    for question_id, head in heads.items():
        if not question_id or "/" in question_id:
            raise ValueError(f"question id must be non-empty and without '/'; got {question_id!r}")
        for name, array in head.to_arrays().items():
            arrays[f"{question_id}/{name}"] = array
    save_arrays(path, arrays)


def save_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Plain arrays into one ``.npz`` (no pickle), atomically: a crash leaves the old file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda out: np.savez(out, allow_pickle=False, **arrays))


def load_heads(path: Path) -> dict[str, SoftmaxHead]:
    """Read heads written by ``save_heads``; ModelError naming the file if it cannot serve."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ModelError(f"cannot read heads file {path}: {exc}") from exc
    heads = {}
    for question_id, head_arrays in _group_by_question(path, arrays).items():
        try:
            heads[question_id] = SoftmaxHead.from_arrays(head_arrays)
        except ModelError as exc:
            raise ModelError(f"heads file {path}, question {question_id!r}: {exc}") from exc
    return heads


def _group_by_question(path: Path, arrays: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for key, array in arrays.items():
        question_id, _, name = key.rpartition("/")
        if not question_id:
            raise ModelError(f"heads file {path} has key {key!r}; expected '<question_id>/<name>'")
        grouped.setdefault(question_id, {})[name] = array
    return grouped


def _check_fit_data(X: Any, Y: Any, sample_weight: Any) -> tuple[Matrix, np.ndarray, np.ndarray]:
    """Validate once at the boundary; the loss function then trusts its inputs."""
    X = check_array(X, dtype=np.float64, accept_sparse="csr")
    if np.ndim(Y) != 2:
        raise ValueError(
            f"Y must be an (n, k) array of probability rows; got shape {np.shape(Y)}. "
            "One-hot encode hard labels"
        )
    Y = check_array(Y, dtype=np.float64)
    if Y.shape[0] != X.shape[0]:
        raise ValueError(f"Y has {Y.shape[0]} rows but X has {X.shape[0]}; they must match")
    if Y.shape[1] < 2:
        raise ValueError(f"Y must have one column per class, at least 2; got shape {Y.shape}")
    if (Y < 0).any() or not np.allclose(Y.sum(axis=1), 1.0, rtol=0, atol=_ROW_SUM_TOLERANCE):
        raise ValueError(
            "Y rows must be probability distributions (non-negative, summing to 1 within "
            f"{_ROW_SUM_TOLERANCE}); one-hot encode hard labels"
        )
    return X, Y / Y.sum(axis=1, keepdims=True), _check_weights(sample_weight, X.shape[0])


def _check_weights(sample_weight: Any, n_samples: int) -> np.ndarray:
    if sample_weight is None:
        return np.ones(n_samples)
    weights = np.asarray(sample_weight, dtype=np.float64)
    if weights.shape != (n_samples,) or not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError(
            f"sample_weight must be {n_samples} finite non-negative numbers (one per row of X); "
            f"got shape {weights.shape}"
        )
    return weights


def _unpack(theta: np.ndarray, n_classes: int, n_features: int) -> tuple[np.ndarray, np.ndarray]:
    coef = theta[: n_classes * n_features].reshape(n_classes, n_features)
    return coef, theta[n_classes * n_features :]


def _loss_and_gradient(
    theta: np.ndarray, X: Matrix, Y: np.ndarray, weights: np.ndarray
) -> tuple[float, np.ndarray]:
    """Weighted soft-label cross-entropy plus 0.5*|W|^2, and its gradient (rows of Y sum to 1)."""
    coef, intercept = _unpack(theta, Y.shape[1], X.shape[1])
    log_p = log_softmax(np.asarray(X @ coef.T) + intercept, axis=1)
    loss = -np.sum(weights[:, None] * Y * log_p) + 0.5 * np.sum(coef * coef)
    residual = weights[:, None] * (np.exp(log_p) - Y)
    gradient = np.concatenate([(np.asarray(X.T @ residual).T + coef).ravel(), residual.sum(axis=0)])
    return float(loss), gradient
