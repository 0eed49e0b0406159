"""The teacher check (distill.calibration.teacher_check): collapsed, position-driven and letter-starved labels
are flagged; a teacher that reads its inputs is not; gold agreement is measured where given."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cascade.errors import CorpusError
from cascade.questions import parse_request
from distill.calibration.teacher_check import MIN_ITEMS, flagged, gold_key, judge_store, read_gold
from distill.store import LabelStore, Teacher

QUESTIONS = parse_request({"state": "x", "questions": {
    "topic": {"type": "choice", "instructions": "Which topic?",
              "criteria": {"world": None, "sports": None, "business": None, "scitech": None}},
    "urgent": {"type": "noul", "instructions": "Urgent?"}}}).questions
KEYS = ["world", "sports", "business", "scitech"]


def _store(tmp_path: Path, topic: list[list[float]], urgent: list[float], mass: float = 0.9) -> LabelStore:
    store = LabelStore(tmp_path / "labels.db", Teacher(kind="external", model="t"))
    for n, (row, yes) in enumerate(zip(topic, urgent, strict=True)):
        store.put_item(f"e{n}", {"topic": dict(zip(KEYS, row, strict=True)),
                                 "urgent": {"true": yes, "false": 1 - yes}}, {},
                       {"topic": mass, "urgent": mass})
    return store


def _reading(n: int, seed: int = 0) -> list[list[float]]:
    """Confident answers that follow the item: a balanced mix of the four topics."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        row = rng.dirichlet([0.3] * 4)
        row[i % 4] += 2.0
        rows.append(list(row / row.sum()))
    return rows


def test_a_teacher_that_reads_its_inputs_is_not_flagged(tmp_path: Path) -> None:
    n = 80
    with _store(tmp_path, _reading(n), [0.9 if i % 3 else 0.1 for i in range(n)]) as store:
        checks = judge_store(store, QUESTIONS)
    assert flagged(checks) == []
    topic = checks[0]
    assert topic.items == n and topic.top_share == pytest.approx(0.25) and topic.spread > 0.3
    assert topic.letter_mass == pytest.approx(0.9)


def test_collapsed_and_position_driven_labels_are_flagged_with_why(tmp_path: Path) -> None:
    n = 60
    rng = np.random.default_rng(1)
    prior = [list(np.array([0.34, 0.28, 0.19, 0.19]) + rng.normal(0, 0.01, 4).clip(-0.01, 0.01))
             for _ in range(n)]  # the 0.5B's shape on AG News: A > B > C > D whatever it reads
    prior = [list(np.array(row) / sum(row)) for row in prior]
    with _store(tmp_path, prior, [0.97] * n) as store:
        topic, urgent = judge_store(store, QUESTIONS)
    assert "barely move with the input" in " ".join(topic.findings)
    assert "the first-listed option leads on 100% of items (balanced 25%)" in topic.line()
    assert urgent.flagged and "collapse onto 'true' (100.0% of items" in urgent.findings[0]


def test_a_low_letter_mass_is_flagged_and_few_items_are_not_judged(tmp_path: Path) -> None:
    with _store(tmp_path, _reading(40), [0.9 if i % 2 else 0.1 for i in range(40)], mass=0.12) as store:
        checks = judge_store(store, QUESTIONS)
        assert all("letters hold only 0.12" in " ".join(c.findings) for c in checks)
        few = judge_store(store, QUESTIONS, items=[f"e{n}" for n in range(MIN_ITEMS - 1)])
    assert flagged(few) == [] and few[0].items == MIN_ITEMS - 1


def test_gold_agreement_is_measured_on_the_items_with_a_gold_value(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": f"e{n}", "text": "t", "label": KEYS[n % 4] if n < 30 else "Sci/Tech"} for n in range(40)]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    gold = read_gold(corpus, "label")
    with _store(tmp_path, _reading(40), [0.9] * 40) as store:
        topic = judge_store(store, QUESTIONS, gold)[0]
    assert topic.gold_items == 30 and topic.gold_agreement == 1.0 and topic.gold_unmatched == 10
    assert "10 gold values name none of the options" in topic.line()
    with pytest.raises(CorpusError, match=r"no row of .* has the gold field 'stars'"):
        read_gold(corpus, "stars")
    keys = ["true", "false"]
    named = [gold_key(v, keys) for v in (True, "no", "YES", 1, "maybe")]
    assert named == ["true", "false", "true", "true", None]
    assert gold_key(3, ["0", "1", "2", "3"]) == "3"


def test_calibration_refuses_a_collapsed_question_and_the_report_leads_with_it_when_accepted(
    tmp_path: Path, encoder: object, embedding_cache: Path
) -> None:
    """A teacher that answers "billing" on 98% of the support messages: training fits a head (two
    answers occur), calibration refuses to certify against those labels, and with the override
    it certifies and the report puts the finding above the guarantee."""
    from corpora import QUESTIONS, corpus_items, label_rows, train, write_jsonl

    from cascade.bundle.manifest import Bundle
    from distill.calibration.maths import CalibrationError
    from distill.calibration.options import CalibrationOptions
    from distill.calibration.run import calibrate_bundle
    from distill.demo.synthetic import write_corpus
    from distill.labelling.transfer import import_labels
    from distill.loop.retrain import retrain_bundle
    from distill.options import CorpusInput, RunOptions
    from distill.reports.calibration_report import write_report

    items = corpus_items()
    rows = [row for row in label_rows(items) if row["question"] != "department"]
    keys = list(QUESTIONS["department"].option_keys())
    rows += [{"id": item.id, "question": "department", "answer": keys[1] if n % 60 == 0 else keys[0]}
             for n, item in enumerate(items)]
    corpus = write_corpus(items, tmp_path / "corpus.jsonl")
    with LabelStore(tmp_path / "labels.sqlite", Teacher(kind="external", model="one answer")) as store:
        import_labels(store, write_jsonl(tmp_path / "labels.jsonl", rows), QUESTIONS)
    bundle = train(corpus, tmp_path / "labels.sqlite", tmp_path / "bundle", encoder, embedding_cache)  # type: ignore[arg-type]
    assert "department" in bundle.heads
    run = RunOptions(progress=False, cache_dir=embedding_cache, flops_per_second=1e11)
    with LabelStore.open_existing(tmp_path / "labels.sqlite") as store:
        with pytest.raises(CalibrationError, match=r"degenerate.* department: the labels collapse onto "
                           rf"'{keys[0]}'.*--accept-degenerate-teacher"):
            calibrate_bundle(bundle, CorpusInput(corpus), store, CalibrationOptions(target=0.9), run=run,
                             encoder=encoder)  # type: ignore[arg-type]
        result = calibrate_bundle(bundle, CorpusInput(corpus), store,
                                  CalibrationOptions(target=0.9, accept_degenerate_teacher=True), run=run,
                                  encoder=encoder)
    assert [c.question for c in result.teacher_checks if c.flagged] == ["department"]
    page = write_report(result, bundle, tmp_path / "report").read_text()
    assert page.index("The teacher check: DEGENERATE LABELS") < page.index("What the guarantee means")
    # the acceptance sticks to the bundle: its retrain refused every attempt before, advising a
    # flag `cascade retrain` does not take, and `cascade loop` logged that failure for ever
    accepted = Bundle.load(bundle.directory)
    assert accepted.manifest.calibration.degenerate_accepted is True
    with LabelStore.open_existing(tmp_path / "labels.sqlite") as store:
        retrained = retrain_bundle(accepted, store, tmp_path / "retrained", CorpusInput(corpus), run=run,
                                   encoder=encoder, teacher_items=0)  # type: ignore[arg-type]
    assert retrained.bundle.manifest.calibration.degenerate_accepted is True
