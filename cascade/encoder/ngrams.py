"""Hashed word n-grams beside the sentence embedding: the words a short encoder vector blurs.

A mean-pooled sentence embedding keeps what a text is about and loses which words it used; a
head that also sees the words ranks its answers better, which is what lets the fast tier keep
more questions at the same certified agreement (bench/cascade_goals.py). The words are hashed
into a fixed number of columns (scikit-learn's ``HashingVectorizer``: murmurhash3, no vocabulary
to store), weighted by sublinear term frequency times the inverse document frequency learnt on
the training texts, and L2-normalised like the embedding, so the two blocks weigh alike.
The fitted state is one array, saved as ``.npz`` without pickle.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.feature_extraction.text import HashingVectorizer
from sklearn.preprocessing import normalize
from sklearn.utils.validation import check_is_fitted

from cascade.errors import ModelError
from cascade.heads import Matrix, save_arrays

DEFAULT_FEATURES = 2**16
DEFAULT_NGRAMS = (1, 2)


class NgramFeatures(TransformerMixin, BaseEstimator):
    """Texts -> (n, n_features) sparse tf-idf rows of hashed word n-grams, each of unit length.

    ``idf_`` holds one weight per hashed column: ln((1 + n) / (1 + df)) + 1, scikit-learn's
    smoothed idf, so a column no training text used still gets a finite weight.
    """

    def __init__(
        self, n_features: int = DEFAULT_FEATURES, ngram_range: tuple[int, int] = DEFAULT_NGRAMS
    ) -> None:
        self.n_features = n_features
        self.ngram_range = ngram_range

    def fit(self, texts: Sequence[str], y: object = None) -> NgramFeatures:
        """Learn the idf weights from ``texts`` (the training part only: the rest is held out)."""
        counts = self._counts(texts)
        if counts.shape[0] == 0:
            raise ValueError("NgramFeatures.fit needs at least one text")
        document_frequency = np.bincount(counts.indices, minlength=self.n_features)
        self.idf_ = np.log((1 + counts.shape[0]) / (1 + document_frequency)) + 1.0
        self.n_features_out_ = self.n_features
        return self

    def transform(self, texts: Sequence[str]) -> sp.csr_matrix:
        check_is_fitted(self)
        counts = self._counts(texts)
        if counts.shape[0] == 0:
            return counts
        counts.data = (1.0 + np.log(counts.data)) * self.idf_[counts.indices]
        return normalize(counts, norm="l2", copy=False)

    def save(self, path: Path) -> None:
        """Write the fitted state as plain arrays, atomically."""
        check_is_fitted(self)
        save_arrays(path, {"idf": self.idf_, "ngram_range": np.asarray(self.ngram_range, dtype=np.int64)})

    @classmethod
    def load(cls, path: Path) -> NgramFeatures:
        """Read what ``save`` wrote; ModelError naming the file if it cannot serve."""
        try:
            with np.load(path, allow_pickle=False) as archive:
                idf, ngram_range = np.asarray(archive["idf"]), np.asarray(archive["ngram_range"])
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
            raise ModelError(f"cannot read n-gram features file {path}: {exc}") from exc
        low, high = (int(n) for n in ngram_range) if ngram_range.shape == (2,) else (0, -1)
        if idf.ndim != 1 or idf.size < 1 or not 1 <= low <= high or not np.isfinite(idf).all():
            raise ModelError(f"n-gram features file {path} holds idf of shape {idf.shape} and "
                             f"ngram_range {ngram_range.tolist()}; expected (n,) and (low, high)")
        features = cls(n_features=int(idf.size), ngram_range=(low, high))
        features.idf_ = idf.astype(np.float64)
        features.n_features_out_ = features.n_features
        return features

    def _counts(self, texts: Sequence[str]) -> sp.csr_matrix:
        if isinstance(texts, str):
            raise TypeError("NgramFeatures takes a sequence of texts, not one string")
        if not texts:
            return sp.csr_matrix((0, self.n_features), dtype=np.float64)
        counts: sp.csr_matrix = _hasher(self.n_features, tuple(self.ngram_range)).transform(list(texts))
        counts.sum_duplicates()
        return counts


@lru_cache(maxsize=8)
def _hasher(n_features: int, ngram_range: tuple[int, int]) -> HashingVectorizer:
    """Stateless, so one per setting serves every call (building one costs more than hashing a text)."""
    return HashingVectorizer(n_features=n_features, ngram_range=ngram_range, alternate_sign=False,
                             norm=None, dtype=np.float64)


def beside(embeddings: np.ndarray, ngrams: NgramFeatures | None, texts: Sequence[str]) -> Matrix:
    """What a head reads: the embeddings alone, or with the texts' n-gram rows to their right."""
    if ngrams is None:
        return embeddings
    return sp.hstack([sp.csr_matrix(embeddings), ngrams.transform(texts)], format="csr")
