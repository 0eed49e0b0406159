"""The teacher check: is a question's teacher reading the inputs at all, before anything is certified?

A certificate only says the cascade agrees with its teacher. A teacher that answers one option
whatever it reads, or picks by option position, gets a perfect certificate for a cascade that
answers nothing. Per question, from the labels in a store:

- the answer distribution and ``top_share``, the share of the most frequent answer: at
  ``COLLAPSE_SHARE`` or more the labels have collapsed onto one answer;
- ``spread``, how far each item's distribution lies from the mean distribution (mean total
  variation distance): a teacher reading its inputs moves with them, one following a prior or
  the option positions hands every item nearly the same vector;
- ``first_share``, the share of items whose top answer is the first-listed option, against
  ``1 / k``, what a balanced order gives on a balanced set;
- the mean letter mass (the probability the readout put on the option letters at all), where the
  store recorded it, and agreement with a gold field of the corpus, where one is named.

Thresholds, measured (bench/labels and 150-item gemma-3-270m runs; docs/benchmarks):
Qwen2.5-Coder-1.5B, which reads: spread 0.26-0.56, top share 0.32-0.48, first share 0.15-0.30.
Qwen2.5-Coder-0.5B on AG News (probabilities falling A > B > C > D on most items): spread 0.050,
first share 0.78. gemma-3-270m: AG News first option on 98.7%, SMS "spam" on 99.3%, spread
0.04-0.06. ``MIN_SPREAD`` = 0.10 lies between the two groups; a question whose true answer is
that rare (about 5% of items) sits near both lines, which is why a finding can be accepted.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from cascade.errors import CorpusError
from cascade.questions import Question
from distill.store import LabelStore

COLLAPSE_SHARE = 0.95
MIN_SPREAD = 0.10
LOW_LETTER_MASS = 0.5
MIN_ITEMS = 20
"""Below this many labelled items a question is reported, not judged."""
ACCEPT_FLAG = "--accept-degenerate-teacher"


class QuestionCheck(BaseModel):
    """One question's teacher check; ``findings`` says what is wrong, empty when nothing is."""

    question: str
    items: int
    answers: dict[str, int]
    top_share: float
    first_share: float
    balanced_share: float
    spread: float
    letter_mass: float | None = None
    gold_items: int = 0
    gold_unmatched: int = 0
    gold_agreement: float | None = None
    findings: list[str] = []

    @property
    def flagged(self) -> bool:
        return bool(self.findings)

    def line(self) -> str:
        """One line of figures, then the findings, for a command's output."""
        top = max(self.answers, key=self.answers.__getitem__) if self.answers else "-"
        mass = f", letter mass {self.letter_mass:.2f}" if self.letter_mass is not None else ""
        gold = (f", gold agreement {self.gold_agreement:.3f} on {self.gold_items}"
                if self.gold_agreement is not None else "")
        if self.gold_unmatched:
            gold += f" ({self.gold_unmatched} gold values name none of the options {list(self.answers)})"
        text = (f"teacher check {self.question}: {self.items} items, top answer {top!r} on "
                f"{self.top_share:.1%}, first-listed option on {self.first_share:.1%} (balanced "
                f"{self.balanced_share:.0%}), spread {self.spread:.3f}{mass}{gold}")
        return text + "".join(f"\n  DEGENERATE TEACHER: {finding}" for finding in self.findings)


def judge(labels: Mapping[str, Mapping[str, Mapping[str, float]]], questions: Mapping[str, Question],
          masses: Mapping[str, Mapping[str, float]] | None = None,
          gold: Mapping[str, Any] | None = None) -> list[QuestionCheck]:
    """Every question's check on ``labels`` (question -> item -> probabilities), with the letter
    masses recorded for those items (question -> item -> mass) and a gold field where given."""
    checks = []
    for qid, question in questions.items():
        rows = labels.get(qid, {})
        recorded = (masses or {}).get(qid, {})
        checks.append(_check(qid, question, rows, [recorded[i] for i in rows if i in recorded], gold or {}))
    return checks


def judge_store(store: LabelStore, questions: Mapping[str, Question], gold: Mapping[str, Any] | None = None,
                items: Collection[str] | None = None) -> list[QuestionCheck]:
    """``judge`` on the labels in ``store`` (only ``items`` where given)."""
    wanted = set(items) if items is not None else None
    labels = {qid: {item: probs for item, probs in store.labels(qid).items()
                    if wanted is None or item in wanted} for qid in questions}
    return judge(labels, questions, {qid: store.letter_masses(qid) for qid in questions}, gold)


def refusal(checks: list[QuestionCheck]) -> str:
    """Why a certificate is refused for these flagged questions, and how to go on anyway."""
    found = "; ".join(f"{c.question}: {' / '.join(c.findings)}" for c in checks)
    return (f"the teacher's labels are degenerate, so a certificate against them would say nothing: "
            f"{found}. Label with a teacher that reads the inputs (a larger model, --permutations to "
            f"cancel position bias), or certify anyway with `cascade calibrate {ACCEPT_FLAG}` "
            "(accept_degenerate_teacher=True): the report then puts this finding above the guarantee, "
            "and a retrain or promotion gate of that bundle accepts it too")


def _check(qid: str, question: Question, labels: Mapping[str, Mapping[str, float]],
           masses: list[float], gold: Mapping[str, Any]) -> QuestionCheck:
    keys = question.option_keys()
    rows = np.array([[probs.get(key, 0.0) for key in keys] for probs in labels.values()])
    rows = rows.reshape(-1, len(keys))
    top = rows.argmax(axis=1) if len(rows) else np.zeros(0, int)
    counts = np.bincount(top, minlength=len(keys))
    n = len(rows)
    check = QuestionCheck(
        question=qid, items=n, answers={keys[i]: int(c) for i, c in enumerate(counts) if c},
        top_share=float(counts.max() / n) if n else 0.0,
        first_share=float(counts[0] / n) if n else 0.0, balanced_share=1 / len(keys),
        spread=float(0.5 * np.abs(rows - rows.mean(axis=0)).sum(axis=1).mean()) if n else 0.0,
        letter_mass=float(np.mean(masses)) if masses else None)
    _agree_with_gold(check, labels, keys, gold)
    check.findings = _findings(check, keys)
    return check


def _agree_with_gold(check: QuestionCheck, labels: Mapping[str, Mapping[str, float]], keys: list[str],
                     gold: Mapping[str, Any]) -> None:
    named = [(probs, gold_key(gold[item], keys)) for item, probs in labels.items() if item in gold]
    pairs = [(probs, key) for probs, key in named if key is not None]
    check.gold_unmatched = len(named) - len(pairs)
    if pairs:
        check.gold_items = len(pairs)
        agreed = sum(max(probs, key=lambda k: probs[k]) == key for probs, key in pairs)
        check.gold_agreement = agreed / len(pairs)


def gold_key(value: Any, keys: list[str]) -> str | None:
    """The option key a gold value names: a key itself, a bool, yes/no or 1/0 for a noul question, a
    level number for a score question; None when it names none of them."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    text = str(value).strip().lower()
    if keys == ["true", "false"]:
        text = {"yes": "true", "no": "false", "1": "true", "0": "false"}.get(text, text)
    return next((key for key in keys if key.lower() == text), None)


def _findings(check: QuestionCheck, keys: list[str]) -> list[str]:
    if check.items < MIN_ITEMS:
        return []
    found = []
    if check.top_share >= COLLAPSE_SHARE:
        top = max(check.answers, key=check.answers.__getitem__)
        found.append(f"the labels collapse onto {top!r} ({check.top_share:.1%} of items, at least "
                     f"{COLLAPSE_SHARE:.0%} flags): a certificate against them says nothing")
    if check.spread < MIN_SPREAD:
        leads = check.first_share > 2 * check.balanced_share
        lead = (f"; the first-listed option leads on {check.first_share:.0%} of items "
                f"(balanced {check.balanced_share:.0%})" if leads else "")
        found.append(f"its answers barely move with the input (spread {check.spread:.3f} < {MIN_SPREAD}): "
                     f"a prior or the option positions, not a reading{lead}")
    if check.letter_mass is not None and check.letter_mass < LOW_LETTER_MASS:
        found.append(f"the option letters hold only {check.letter_mass:.2f} of the readout's probability "
                     f"on average (< {LOW_LETTER_MASS}): the model wanted to answer something else")
    return found


def flagged(checks: list[QuestionCheck]) -> list[QuestionCheck]:
    return [check for check in checks if check.flagged]


def read_gold(corpus: Path, field: str) -> dict[str, Any]:
    """item id -> the corpus's gold value in ``field`` (items without it are left out)."""
    gold: dict[str, Any] = {}
    try:
        with Path(corpus).open(encoding="utf-8") as lines:
            for line in lines:
                row = json.loads(line) if line.strip() else None
                if isinstance(row, dict) and field in row and "id" in row:
                    gold[str(row["id"])] = row[field]
    except (OSError, json.JSONDecodeError) as exc:
        raise CorpusError(f"cannot read gold field {field!r} from {corpus}: {exc}") from exc
    if not gold:
        raise CorpusError(f"no row of {corpus} has the gold field {field!r}; check --gold-field")
    return gold
