"""Soft-label heads on real embeddings of generated support messages: billing or technical?"""

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import LogisticRegression

from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import ModelError
from cascade.heads import HeadStack, SoftmaxHead, load_heads, save_heads
from distill.demo.synthetic import generate

N_BILLING, N_TECHNICAL, N_TRAIN = 150, 250, 280


@pytest.fixture(scope="module")
def messages(encoder: Encoder) -> tuple[np.ndarray, np.ndarray]:
    """400 embedded messages (150 for the billing team, 250 for the technical one, shuffled) and
    their 0/1 "billing" labels: the department the generator wrote each message for."""
    items = generate(1400, seed=0)
    chosen = [item for item in items if item.department == "billing"][:N_BILLING]
    chosen += [item for item in items if item.department == "technical"][:N_TECHNICAL]
    assert len(chosen) == N_BILLING + N_TECHNICAL
    np.random.default_rng(0).shuffle(chosen)
    X = encoder.encode([item.text for item in chosen])
    return X, np.array([item.department == "billing" for item in chosen], dtype=int)


@pytest.fixture(scope="module")
def head(messages: tuple[np.ndarray, np.ndarray]) -> SoftmaxHead:
    X, y = messages
    return SoftmaxHead().fit(X[:N_TRAIN], np.eye(2)[y[:N_TRAIN]])


def test_head_beats_the_majority_baseline(messages: tuple[np.ndarray, np.ndarray], head: SoftmaxHead) -> None:
    X, y = messages
    held_out = y[N_TRAIN:]
    baseline = max(held_out.mean(), 1 - held_out.mean())
    accuracy = (head.predict(X[N_TRAIN:]) == held_out).mean()
    assert accuracy >= 0.9
    assert accuracy >= baseline + 0.2


def test_probabilities_are_distributions(messages: tuple[np.ndarray, np.ndarray], head: SoftmaxHead) -> None:
    proba = head.predict_proba(messages[0])
    assert proba.shape == (len(messages[0]), 2)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    assert head.coef_.shape == (2, 384)
    assert head.intercept_.shape == (2,)
    assert (head.n_classes_, head.n_features_in_) == (2, 384)


def test_one_hot_labels_match_sklearn_binomial_regression(
    messages: tuple[np.ndarray, np.ndarray], head: SoftmaxHead
) -> None:
    X, y = messages
    reference = LogisticRegression(C=2.0, tol=1e-8, max_iter=1000).fit(X[:N_TRAIN], y[:N_TRAIN])
    np.testing.assert_allclose(head.predict_proba(X), reference.predict_proba(X), atol=1e-3)


def test_soft_labels_reproduce_class_balance(messages: tuple[np.ndarray, np.ndarray]) -> None:
    """The third class is never the argmax, yet keeps its column and its share."""
    X, y = messages
    Y = np.where(y[:, None] == 1, [0.2, 0.7, 0.1], [0.85, 0.05, 0.1])
    proba = SoftmaxHead().fit(X, Y).predict_proba(X)
    assert proba.shape == (len(X), 3)
    np.testing.assert_allclose(proba.mean(axis=0), Y.mean(axis=0), atol=1e-3)


def test_a_class_without_mass_keeps_its_column(messages: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = messages
    Y = np.hstack([np.eye(2)[y], np.zeros((len(y), 1))])
    proba = SoftmaxHead().fit(X, Y).predict_proba(X)
    assert proba.shape == (len(X), 3)
    assert proba[:, 2].max() < 0.01
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)


def test_sample_weight_acts_as_repetition(messages: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = messages[0][:120], np.eye(2)[messages[1][:120]]
    weights = np.ones(len(X))
    weights[:40] = 2.0
    weighted = SoftmaxHead().fit(X, y, sample_weight=weights)
    repeated = SoftmaxHead().fit(np.vstack([X, X[:40]]), np.vstack([y, y[:40]]))
    np.testing.assert_allclose(weighted.predict_proba(X), repeated.predict_proba(X), atol=1e-4)


def test_arrays_round_trip(messages: tuple[np.ndarray, np.ndarray], head: SoftmaxHead) -> None:
    rebuilt = SoftmaxHead.from_arrays(head.to_arrays())
    np.testing.assert_array_equal(rebuilt.predict_proba(messages[0]), head.predict_proba(messages[0]))
    assert rebuilt.get_params() == head.get_params()


def test_save_load_round_trip_without_pickle(
    tmp_path: Path, messages: tuple[np.ndarray, np.ndarray], head: SoftmaxHead
) -> None:
    path = tmp_path / "heads.npz"
    soft = SoftmaxHead(C=0.5).fit(messages[0], np.full((len(messages[0]), 3), 1 / 3))
    save_heads(path, {"is_billing": head, "tone": soft})
    with np.load(path, allow_pickle=False) as archive:
        assert set(archive.files) == {
            f"{q}/{name}" for q in ("is_billing", "tone") for name in ("coef", "intercept", "C", "max_iter")
        }
    loaded = load_heads(path)
    assert sorted(loaded) == ["is_billing", "tone"]
    np.testing.assert_array_equal(loaded["is_billing"].predict_proba(messages[0]),
                                  head.predict_proba(messages[0]))
    np.testing.assert_array_equal(loaded["tone"].predict_proba(messages[0]), soft.predict_proba(messages[0]))
    assert loaded["tone"].C == 0.5


def test_unfitted_head_refuses_to_predict() -> None:
    with pytest.raises(NotFittedError):
        SoftmaxHead().predict_proba(np.zeros((1, 3)))
    with pytest.raises(NotFittedError):
        SoftmaxHead().to_arrays()


def test_clone_keeps_parameters() -> None:
    assert clone(SoftmaxHead(C=0.25, max_iter=50)).get_params() == {"C": 0.25, "max_iter": 50}


X_SMALL = np.random.default_rng(1).normal(size=(6, 4))
Y_SMALL = np.eye(2)[[0, 1, 0, 1, 1, 0]]


@pytest.mark.parametrize(
    ("Y", "match"),
    [
        (Y_SMALL[:5], "Y has 5 rows but X has 6"),
        (np.array([0, 1, 0, 1, 1, 0]), r"Y must be an \(n, k\) array .* One-hot encode"),
        (np.ones((6, 1)), "at least 2"),
        (Y_SMALL * 0.5, "probability distributions"),
        (Y_SMALL * 2 - 0.5, "probability distributions"),
    ],
)
def test_bad_labels_are_explained(Y: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SoftmaxHead().fit(X_SMALL, Y)


def test_bad_sample_weight_is_explained() -> None:
    with pytest.raises(ValueError, match="sample_weight must be 6 finite non-negative"):
        SoftmaxHead().fit(X_SMALL, Y_SMALL, sample_weight=np.ones(5))


@pytest.mark.parametrize(
    ("params", "match"),
    [({"C": 0.0}, "'C' parameter .* > 0; got 0.0"), ({"max_iter": 0}, "'max_iter' parameter")],
)
def test_bad_parameters_are_explained(params: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SoftmaxHead(**params).fit(X_SMALL, Y_SMALL)  # type: ignore[arg-type]


def test_wrong_feature_count_is_explained() -> None:
    head = SoftmaxHead().fit(X_SMALL, Y_SMALL)
    with pytest.raises(ValueError, match="X has 3 features, but this head was fitted on 4"):
        head.predict_proba(X_SMALL[:, :3])


def test_question_ids_with_a_slash_are_refused(tmp_path: Path) -> None:
    head = SoftmaxHead().fit(X_SMALL, Y_SMALL)
    with pytest.raises(ValueError, match="question id"):
        save_heads(tmp_path / "heads.npz", {"a/b": head})


def test_bad_heads_files_name_the_path(tmp_path: Path) -> None:
    absent = tmp_path / "absent.npz"
    with pytest.raises(ModelError, match=str(absent)):
        load_heads(absent)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip archive")
    with pytest.raises(ModelError, match=str(garbage)):
        load_heads(garbage)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, allow_pickle=True, **{"q/coef": np.array([{"x": 1}], dtype=object)})
    with pytest.raises(ModelError, match=str(pickled)):
        load_heads(pickled)


def test_inconsistent_arrays_are_refused(tmp_path: Path) -> None:
    arrays = SoftmaxHead().fit(X_SMALL, Y_SMALL).to_arrays()
    path = tmp_path / "heads.npz"
    np.savez(path, allow_pickle=False, **{f"q/{k}": v for k, v in arrays.items() if k != "C"})
    with pytest.raises(ModelError, match=r"question 'q'.* lack \['C'\]"):
        load_heads(path)
    np.savez(
        path, allow_pickle=False, **{f"q/{k}": v[:1] if k == "intercept" else v for k, v in arrays.items()}
    )
    with pytest.raises(ModelError, match="intercept shape"):
        load_heads(path)


def test_a_stack_answers_what_each_head_answers(messages: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = messages
    rng = np.random.default_rng(1)
    heads = {"billing": SoftmaxHead().fit(X, np.eye(2)[y]),
             "tone": SoftmaxHead().fit(X, rng.dirichlet(np.ones(3), size=len(X)))}
    stacked = HeadStack(heads).predict_proba(X[:7])
    assert list(stacked) == ["billing", "tone"]
    for qid, head in heads.items():
        np.testing.assert_allclose(stacked[qid], head.predict_proba(X[:7]), rtol=0, atol=1e-12)
    sparse = HeadStack(heads).predict_proba(sp.csr_matrix(X[:7]))
    np.testing.assert_allclose(sparse["tone"], stacked["tone"], rtol=0, atol=1e-12)


def test_a_stack_refuses_heads_of_different_widths(messages: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = messages
    narrow = SoftmaxHead().fit(X[:, :5], np.eye(2)[y])
    with pytest.raises(ValueError, match=r"heads read \[5, \d+\] features; a stack needs one width"):
        HeadStack({"a": narrow, "b": SoftmaxHead().fit(X, np.eye(2)[y])})


def test_an_empty_stack_answers_nothing() -> None:
    assert HeadStack({}).questions == [] and HeadStack({}).bounds.tolist() == [0]
