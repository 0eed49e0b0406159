"""The inputs of a calibration run: the teacher's labels of the items it certifies on, and their states.

Labels come from the label store the bundle was trained from; either one from elsewhere is
refused, since a threshold certifies agreement with one teacher on one distribution of items.
The items are the bundle's calibration part (states from the corpus it was trained on), the
audited live items the store holds (a seeded uniform sample of recent traffic, each with the
teacher's answer to every bundle question and its state), or both (``Source``). The certificate
is then about new items from the distribution those were drawn from
(``distill.reports.calibration_report.drawn_from`` says which, in words).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Literal

import numpy as np

from cascade.bundle.manifest import Manifest, SplitInfo
from cascade.bundle.sections import AuditSpan
from cascade.questions import Question
from cascade.tiers.base import Item
from distill.calibration.maths import CalibrationError
from distill.options import CorpusInput
from distill.store import LabelStore
from distill.store.texts import checked
from distill.training.split import part_of

Labels = Mapping[str, Mapping[str, int]]
"""question id -> calibration item id -> the teacher's answer (argmax, option_keys index)."""

Source = Literal["calibration", "audit", "both"]
"""Which labelled items certify: the bundle's calibration part, the store's audits, or both."""
SOURCES: tuple[Source, ...] = ("calibration", "audit", "both")


class MissingItemsError(CalibrationError):
    """Items to calibrate on that the corpus does not hold: ``count`` of them, ``example`` one."""

    def __init__(self, message: str, count: int, example: str) -> None:
        super().__init__(message)
        self.count, self.example = count, example


def check_teacher(manifest: Manifest, store: LabelStore) -> None:
    """Thresholds certify agreement with ONE teacher: the one whose labels trained the bundle."""
    ours, theirs = manifest.teacher.model_dump(), store.teacher.model_dump()
    if ours != theirs:
        raise CalibrationError(f"label store {store.path} holds labels of the teacher {theirs}, but "
                               f"bundle {manifest.name!r} was trained on labels of {ours}; give the "
                               "store the bundle was trained from")


def calibration_labels(
    store: LabelStore, questions: Mapping[str, Question], ids: Sequence[str], name: str
) -> dict[str, dict[str, int]]:
    """question id -> calibration item id -> the teacher's answer (argmax, option_keys index)."""
    wanted = set(ids)
    labels: dict[str, dict[str, int]] = {}
    for qid, question in questions.items():
        keys = question.option_keys()
        rows = {item: probs for item, probs in store.labels(qid).items() if item in wanted}
        labels[qid] = {item: _answer(item, qid, probs, keys) for item, probs in rows.items()}
    if not any(labels.values()):
        raise CalibrationError(f"none of the {len(wanted)} calibration items of bundle {name!r} has "
                               f"a teacher label in {store.path}; give the store the bundle was "
                               "trained from")
    return labels


def calibration_items(
    store: LabelStore, corpus: CorpusInput, trained_field: str | None, labels: Labels, split: SplitInfo
) -> tuple[list[Item], int]:
    """The labelled calibration items' states, in corpus order (every one must be found), and
    how many corpus items fall in the calibration part with no teacher label at all;
    ``trained_field``: the text field the bundle was trained on (read unless the corpus names one).

    The split places an id by its hash alone, so an item the teacher skipped (too long for its
    context, or failed) has a part too: counting those says what calibration never saw.
    """
    wanted = set().union(*(set(rows) for rows in labels.values()))
    items, unlabelled = [], 0
    for row in checked(store, corpus.read(trained_field), corpus.path):
        if row.id in wanted:
            items.append(Item(row.id, row.state))
        elif part_of(row.id, split.fractions, split.salt) == "calibration":
            unlabelled += 1
    missing = wanted - {item.id for item in items}
    if missing:
        raise MissingItemsError(f"{len(missing)} of the {len(wanted)} calibration items are not in "
                                f"corpus {corpus.path} (for example {min(missing)!r}); give the corpus "
                                "the bundle was trained on", len(missing), min(missing))
    return items, unlabelled


def _answer(item: str, qid: str, probs: Mapping[str, float], keys: list[str]) -> int:
    """The teacher's answer to ``qid`` about ``item``, as an index of ``keys``."""
    if sorted(probs) != sorted(keys):
        raise CalibrationError(f"the stored label of item {item!r} for question {qid!r} has "
                               f"options {sorted(probs)}, but the bundle's question has "
                               f"{keys}: the store does not belong to this bundle")
    return int(np.argmax([probs[k] for k in keys]))


def audit_inputs(store: LabelStore, questions: Mapping[str, Question], since: float | None
                 ) -> tuple[dict[str, dict[str, int]], list[Item], AuditSpan]:
    """The audited items in ``store`` (those audited at or after ``since``, a Unix time, where
    given): the teacher's answers per question, the states in the order audited, and the span."""
    records = [r for r in store.each_audit() if since is None or r.at >= since]
    if not records:
        after = "" if since is None else f" at or after {_iso(since)}"
        raise CalibrationError(f"label store {store.path} holds no audited items{after}; audit live "
                               "traffic first (`cascade serve` or `cascade decide` with --audit-store "
                               "this store), or calibrate on the calibration part")
    labels: dict[str, dict[str, int]] = {qid: {} for qid in questions}
    for record in records:
        for qid, question in questions.items():
            if qid in record.teacher:
                labels[qid][record.item_id] = _answer(record.item_id, qid, record.teacher[qid],
                                                      question.option_keys())
    items = [Item(r.item_id, r.state) for r in records]
    return labels, items, AuditSpan(items=len(records), first=_iso(records[0].at), last=_iso(records[-1].at))


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


def merged(first: Labels, second: Labels) -> dict[str, dict[str, int]]:
    """Both sets of labels, per question (their item ids never meet: audits are ``audit:`` ids)."""
    return {qid: {**first.get(qid, {}), **second.get(qid, {})} for qid in {*first, *second}}
