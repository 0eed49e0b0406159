"""The teacher check (distill.teacher_check): collapsed, position-driven and letter-starved labels
are flagged; a teacher that reads its inputs is not; gold agreement is measured where given."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cascade.errors import CorpusError
from cascade.questions import parse_request
from distill.store import LabelStore, Teacher
from distill.teacher_check import MIN_ITEMS, check_teacher, flagged, gold_key, read_gold

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
        checks = check_teacher(store, QUESTIONS)
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
        topic, urgent = check_teacher(store, QUESTIONS)
    assert "barely move with the input" in " ".join(topic.findings)
    assert "the first-listed option leads on 100% of items (balanced 25%)" in topic.line()
    assert urgent.flagged and "collapse onto 'true' (100.0% of items" in urgent.findings[0]


def test_a_low_letter_mass_is_flagged_and_few_items_are_not_judged(tmp_path: Path) -> None:
    with _store(tmp_path, _reading(40), [0.9 if i % 2 else 0.1 for i in range(40)], mass=0.12) as store:
        checks = check_teacher(store, QUESTIONS)
        assert all("letters hold only 0.12" in " ".join(c.findings) for c in checks)
        few = check_teacher(store, QUESTIONS, items=[f"e{n}" for n in range(MIN_ITEMS - 1)])
    assert flagged(few) == [] and few[0].items == MIN_ITEMS - 1


def test_gold_agreement_is_measured_on_the_items_with_a_gold_value(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": f"e{n}", "text": "t", "label": KEYS[n % 4] if n < 30 else "Sci/Tech"} for n in range(40)]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    gold = read_gold(corpus, "label")
    with _store(tmp_path, _reading(40), [0.9] * 40) as store:
        topic = check_teacher(store, QUESTIONS, gold)[0]
    assert topic.gold_items == 30 and topic.gold_agreement == 1.0 and topic.gold_unmatched == 10
    assert "10 gold values name none of the options" in topic.line()
    with pytest.raises(CorpusError, match=r"no row of .* has the gold field 'stars'"):
        read_gold(corpus, "stars")
    keys = ["true", "false"]
    named = [gold_key(v, keys) for v in (True, "no", "YES", 1, "maybe")]
    assert named == ["true", "false", "true", "true", None]
    assert gold_key(3, ["0", "1", "2", "3"]) == "3"
