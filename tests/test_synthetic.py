"""The demo corpus generator: deterministic, varied, noisy enough, and readable by the pipeline."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from cascade.corpus import load_questions, read_corpus
from distill.demo.synthetic import (
    DEPARTMENTS,
    SEVERITY_LEVELS,
    SyntheticError,
    SyntheticItem,
    demo_questions,
    generate,
    write_corpus,
    write_labels,
    write_questions,
)
from distill.labelling.transfer import import_labels
from distill.store import LabelStore, Teacher

N = 1500


@pytest.fixture(scope="module")
def items() -> list[SyntheticItem]:
    return generate(N, seed=0)


def test_same_seed_same_items_and_small_runs_are_prefixes() -> None:
    assert generate(40, seed=3) == generate(40, seed=3)
    assert generate(15, seed=3) == generate(40, seed=3)[:15]


def test_other_seed_other_items_and_ids() -> None:
    first, second = generate(200, seed=1), generate(200, seed=2)
    assert {item.id for item in first}.isdisjoint(item.id for item in second)
    assert sum(a.text == b.text for a, b in zip(first, second, strict=True)) < 10


def test_texts_are_varied_and_short(items: list[SyntheticItem]) -> None:
    texts = [item.text for item in items]
    assert len(set(texts)) > 0.95 * N
    assert len({text.split("\n\n")[-2] for text in texts}) > 0.8 * N  # distinct bodies too
    assert max(len(text.split()) for text in texts) < 80
    assert all("{" not in text and "}" not in text for text in texts)


def test_every_answer_occurs_latent_and_labelled(items: list[SyntheticItem]) -> None:
    labelled = Counter((qid, key) for item in items for qid, key in item.teacher_answers().items())
    assert {item.department for item in items} == set(DEPARTMENTS)
    assert {item.severity for item in items} == set(range(len(SEVERITY_LEVELS)))
    assert {item.urgent for item in items} == {True, False}
    for qid, question in demo_questions().items():
        for key in question.option_keys():
            assert labelled[(qid, key)] >= 0.05 * N / len(question.option_keys()), (qid, key)


def test_labels_are_soft_and_mostly_follow_the_latent_answers(items: list[SyntheticItem]) -> None:
    questions = demo_questions()
    agree: Counter[str] = Counter()
    for item in items:
        assert list(item.labels) == list(questions)
        for qid, probs in item.labels.items():
            assert list(probs) == questions[qid].option_keys()
            assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-4)
            assert min(probs.values()) > 0 and max(probs.values()) < 1
        answers = item.teacher_answers()
        agree["urgent"] += answers["urgent"] == str(item.urgent).lower()
        agree["department"] += answers["department"] == item.department
        agree["severity"] += answers["severity"] == str(item.severity)
    for qid, count in agree.items():
        assert 0.9 * N < count < 0.995 * N, (qid, count / N)


def test_questions_validate_and_round_trip_through_a_file(tmp_path: Path) -> None:
    questions = demo_questions()
    assert {qid: q.type for qid, q in questions.items()} == {
        "urgent": "noul", "department": "choice", "severity": "score"}
    assert load_questions(write_questions(tmp_path / "q.json")) == questions


def test_corpus_and_labels_files_feed_the_pipeline(tmp_path: Path) -> None:
    sample = generate(60, seed=7)
    corpus = [(item.id, item.state) for item in read_corpus(write_corpus(sample, tmp_path / "c.jsonl"))]
    assert corpus == [(item.id, item.text) for item in sample]
    store = LabelStore(tmp_path / "s.sqlite", Teacher(kind="external", model="generator"))
    with store:
        summary = import_labels(store, write_labels(sample, tmp_path / "l.jsonl"), demo_questions())
        assert (summary.imported, summary.errors) == (60 * 3, [])
        assert store.labels("department")[sample[0].id] == pytest.approx(sample[0].labels["department"])


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "10"])
def test_bad_count_names_the_argument(n: object) -> None:
    with pytest.raises(SyntheticError, match=r"n \(the number of items\)"):
        generate(n)  # type: ignore[arg-type]


def test_bad_seed_names_the_argument() -> None:
    with pytest.raises(SyntheticError, match="seed"):
        generate(3, seed="x")  # type: ignore[arg-type]
