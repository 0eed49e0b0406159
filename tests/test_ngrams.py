"""Hashed word n-grams: stable columns, idf from the training texts, unit rows, safe files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.errors import ModelError
from cascade.heads import SoftmaxHead

TRAIN = ["free prize now", "call me now", "see you at noon", "free entry, call now"]


@pytest.fixture(scope="module")
def fitted() -> NgramFeatures:
    return NgramFeatures().fit(TRAIN)


def test_columns_are_pinned_across_library_versions(fitted: NgramFeatures) -> None:
    # saved bundles hold weights by column: a changed hash or tokenizer would silently scramble them
    row = fitted.transform(["Free prize!"])
    assert sorted(row.indices.tolist()) == [23338, 25385, 25710]  # "free", "prize", "free prize"


def test_rows_have_unit_length_and_case_does_not_matter(fitted: NgramFeatures) -> None:
    X = fitted.transform(["FREE prize now", "free prize now", "nothing known here"])
    np.testing.assert_allclose(sp.linalg.norm(X, axis=1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(X[0].toarray(), X[1].toarray())


def test_common_words_weigh_less_than_rare_ones(fitted: NgramFeatures) -> None:
    row = fitted.transform(["now noon"]).toarray()[0]
    now, noon = (fitted.transform([word]).indices[0] for word in ("now", "noon"))
    assert row[now] < row[noon]  # "now" is in 3 of 4 training texts, "noon" in 1
    assert fitted.idf_[now] == pytest.approx(np.log(5 / 4) + 1)


def test_repeated_words_count_sublinearly(fitted: NgramFeatures) -> None:
    once, thrice = fitted.transform(["call now", "call call call now"]).toarray()
    call, now = (fitted.transform([word]).indices[0] for word in ("call", "now"))
    # "call call call" also adds the bigram "call call"; the ratio of call to now is what moves
    assert (thrice[call] / thrice[now]) / (once[call] / once[now]) == pytest.approx(1 + np.log(3))


def test_empty_text_gives_an_empty_row(fitted: NgramFeatures) -> None:
    assert fitted.transform([""]).nnz == 0
    assert fitted.transform([]).shape == (0, fitted.n_features)


def test_save_and_load_give_the_same_rows(fitted: NgramFeatures, tmp_path: Path) -> None:
    fitted.save(tmp_path / "ngrams.npz")
    loaded = NgramFeatures.load(tmp_path / "ngrams.npz")
    assert (loaded.n_features, loaded.ngram_range) == (fitted.n_features, fitted.ngram_range)
    texts = ["free entry now", "see you"]
    np.testing.assert_array_equal(loaded.transform(texts).toarray(), fitted.transform(texts).toarray())


@pytest.mark.parametrize("content, message", [
    (b"not a zip", r"cannot read n-gram features file .*bad.npz"),
    ({"idf": np.ones(4), "ngram_range": np.array([2, 1])}, r"ngram_range \[2, 1\]; expected"),
    ({"idf": np.array([1.0, np.inf]), "ngram_range": np.array([1, 2])}, r"idf of shape \(2,\)"),
    ({"idf": np.ones(4)}, r"cannot read n-gram features file"),
])
def test_a_bad_file_is_refused_with_its_path(tmp_path: Path, content: object, message: str) -> None:
    path = tmp_path / "bad.npz"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        np.savez(path, **content)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match=message):
        NgramFeatures.load(path)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one text"):
        NgramFeatures().fit([])
    with pytest.raises(TypeError, match="not one string"):
        NgramFeatures().fit("free prize")


def test_beside_puts_the_ngrams_right_of_the_embedding(fitted: NgramFeatures) -> None:
    embeddings = np.arange(6, dtype=float).reshape(2, 3)
    assert beside(embeddings, None, ["a", "b"]) is embeddings
    X = beside(embeddings, fitted, ["free prize", "call now"])
    assert isinstance(X, sp.csr_matrix) and X.shape == (2, 3 + fitted.n_features)
    np.testing.assert_array_equal(X[:, :3].toarray(), embeddings)
    np.testing.assert_array_equal(X[:, 3:].toarray(), fitted.transform(["free prize", "call now"]).toarray())


def test_a_head_fits_sparse_rows_as_it_fits_the_same_rows_dense(fitted: NgramFeatures) -> None:
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(["free", "prize", "call", "now", "see", "you"], 4)) for _ in range(60)]
    X = beside(rng.normal(size=(60, 5)), fitted, texts)
    assert isinstance(X, sp.csr_matrix)
    Y = np.eye(2)[[int("free" in t) for t in texts]]
    sparse, dense = SoftmaxHead(C=3.0).fit(X, Y), SoftmaxHead(C=3.0).fit(X.toarray(), Y)
    np.testing.assert_allclose(sparse.predict_proba(X), dense.predict_proba(X.toarray()), atol=1e-5)
    np.testing.assert_allclose(sparse.predict_proba(X).sum(axis=1), 1.0)
    assert (sparse.predict(X) == Y.argmax(axis=1)).mean() > 0.9
