"""Calibrating each (question, cheap tier) on its items, and replaying the cascade with the results.

Per (question, tier): the temperature on a part of the items picked by a hash of their id
(TEMPERATURE_SHARE), its reliability on the rest; the threshold on the RAW score the router
compares (``cascade.thresholds.CERTIFIED_SCORE``: the top probability's margin), certified
on all of them (``maths.threshold_for_agreement``), or in budget mode set on the items
that reach the tier (``maths.threshold_for_budget``); the coverage curve and the confusion
matrix the report draws. Then each question's items are routed through the new thresholds to
see which tier answers them and how often the cascade agrees with the teacher.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cascade.hashing import seeded_unit
from cascade.thresholds import CERTIFIED_SCORE, threshold_score
from distill.calibration.inputs import Labels
from distill.calibration.maths import (
    ThresholdResult,
    apply_temperature,
    clopper_pearson_lower,
    confidence_and_agreement,
    fit_temperature,
    reliability_curve,
    threshold_for_agreement,
    threshold_for_budget,
)
from distill.calibration.results import CascadeShares, QuestionTier, Skipped
from distill.calibration.scoring import Probabilities

TEMPERATURE_SHARE = 0.3
TEMPERATURE_SALT = "cascade-temperature-v1"
MIN_TEMPERATURE_ITEMS = 10
CURVE_POINTS = 200


@dataclass
class Fit:
    """A calibrated (question, tier) and its threshold-part scores, for replaying the cascade."""

    result: QuestionTier
    scores: dict[str, tuple[float, bool]]


def fit_all(
    tiers: list[str],
    probs: list[Probabilities],
    labels: Labels,
    questions: list[str],
    target: float,
    delta: float,
    escalation_fraction: float | None,
) -> tuple[dict[str, dict[str, Fit]], list[Skipped]]:
    """Every (question, tier) calibrated, or skipped with the reason: question -> tier -> fit.

    Tiers go cheapest first, so that in budget mode each one's threshold is set on what the
    ones below it escalate under their new thresholds.
    """
    fits: dict[str, dict[str, Fit]] = {}
    skipped: list[Skipped] = []
    for k, (tier, by_question) in enumerate(zip(tiers, probs, strict=True)):
        for qid in questions:
            below = fits.get(qid, {})
            reach = None if escalation_fraction is None else {
                item for item in labels[qid] if not any(keeps(below.get(t), item) for t in tiers[:k])}
            outcome = _calibrate(qid, tier, by_question.get(qid), labels[qid], target, delta,
                                 escalation_fraction, reach)
            if isinstance(outcome, Skipped):
                skipped.append(outcome)
            else:
                fits.setdefault(qid, {})[tier] = outcome
    return fits, skipped


def in_temperature_part(item_id: str) -> bool:
    """Whether a calibration item fits the temperature (True) or tests the threshold (False).

    A hash of the id, so the split is the same on every run and for every tier and question.
    """
    return seeded_unit(TEMPERATURE_SALT, item_id, "\0") < TEMPERATURE_SHARE


def _calibrate(
    qid: str,
    tier: str,
    probs: Mapping[str, np.ndarray] | None,
    labels: Mapping[str, int],
    target: float,
    delta: float,
    escalation_fraction: float | None,
    reach: set[str] | None = None,
) -> Fit | Skipped:
    """Temperature on one part, its reliability on the other; the raw-score threshold and
    coverage on all items. Skipped when impossible.

    In budget mode the threshold is set on the items in ``reach`` (those the tiers below this
    one escalate; None: all), so that the tier escalates the share of what it sees that the
    budget names, as the router will make it do.
    """
    if not labels:
        return Skipped(question=qid, tier=tier, reason="no calibration item has a teacher label for "
                       "this question; label some, retrain and calibrate again")
    if probs is None:
        return Skipped(question=qid, tier=tier, reason="the tier does not answer this question "
                       "(no head); it starts one tier up")
    ids = sorted(probs)
    held = [i for i in ids if not in_temperature_part(i)]
    if not held:
        return Skipped(question=qid, tier=tier, reason=f"none of its {len(ids)} calibration items "
                       "fell outside the temperature part; label more items")
    fitting = [i for i in ids if in_temperature_part(i)]
    temperature, note = _temperature(probs, labels, fitting)
    every, teacher_every = _stack(probs, ids), _labels(labels, ids)
    _, correct = confidence_and_agreement(every, teacher_every)
    confidence = threshold_score(every, CERTIFIED_SCORE)
    seen = np.asarray([reach is None or i in reach for i in ids])
    if escalation_fraction is None:
        chosen = threshold_for_agreement(confidence, correct, target, delta)
    else:
        chosen = _budget_threshold(confidence[seen], correct[seen], escalation_fraction, delta)
    raw, teacher = _stack(probs, held), _labels(labels, held)
    before = reliability_curve(raw, teacher)
    after = reliability_curve(apply_temperature(raw, temperature), teacher)
    result = QuestionTier(
        question=qid, tier=tier, n=len(ids), n_temperature=len(fitting), n_threshold=int(seen.sum()),
        temperature=temperature, temperature_note=note,
        ece_before=before["ece"], ece_after=after["ece"], **_threshold_facts(chosen),
        reliability_before=before, reliability_after=after,
        curve=_coverage_curve(confidence, correct, delta),
        confusion=_confusion(every, teacher_every),
    )
    return Fit(result, {i: (float(c), bool(a)) for i, c, a in zip(ids, confidence, correct, strict=True)})


def _budget_threshold(
    confidence: np.ndarray, correct: np.ndarray, escalation_fraction: float, delta: float
) -> ThresholdResult:
    """``threshold_for_budget`` on the items that reach the tier; when none does, keep nothing."""
    if len(confidence):
        return threshold_for_budget(confidence, correct, escalation_fraction, delta)
    return ThresholdResult(threshold=None, kept_share=0.0, agreement_kept=math.nan,
                           agreement_cascade=1.0, lower_bound=1.0, n=0, reachable=True,
                           method="budget", target=None, delta=delta,
                           message="no calibration item reaches this tier (the tiers below keep "
                           "them all); it keeps nothing")


def _stack(probs: Mapping[str, np.ndarray], ids: list[str]) -> np.ndarray:
    return np.stack([probs[i] for i in ids])


def _labels(labels: Mapping[str, int], ids: list[str]) -> np.ndarray:
    return np.asarray([labels[i] for i in ids], dtype=np.int64)


def _temperature(
    probs: Mapping[str, np.ndarray], labels: Mapping[str, int], ids: list[str]
) -> tuple[float, str | None]:
    """T fitted on the items ``ids``, or 1.0 with the reason when they cannot pin it down.

    T never touches the guarantee (thresholds are on raw scores); a T at a search bound
    would only squash the probabilities answers report into ties.
    """
    if len(ids) < MIN_TEMPERATURE_ITEMS:
        return 1.0, (f"only {len(ids)} items in the temperature part (fewer than "
                     f"{MIN_TEMPERATURE_ITEMS}); T left at 1.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        temperature = fit_temperature(_stack(probs, ids), _labels(labels, ids))
    at_bound = [w for w in caught if "stopped at the bound" in str(w.message)]
    for other in (w for w in caught if w not in at_bound):
        warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
    if not at_bound:
        return temperature, None
    why = ("every answer agrees with the teacher, so sharper always fits better" if temperature < 1
           else "the answers look no better than chance, so flatter always fits better")
    return 1.0, (f"the fit on {len(ids)} items stopped at the bound T={temperature:.3g} ({why}); "
                 "T left at 1.0")


def _threshold_facts(chosen: ThresholdResult) -> dict[str, Any]:
    kept = chosen.agreement_kept
    return {
        "threshold": chosen.threshold, "kept_share": chosen.kept_share,
        "agreement": chosen.agreement_cascade,
        "agreement_kept": None if math.isnan(kept) else kept, "lower_bound": chosen.lower_bound,
        "reachable": chosen.reachable, "message": chosen.message, "method": chosen.method,
        "target": chosen.target, "delta": chosen.delta,
    }


def _coverage_curve(confidence: np.ndarray, correct: np.ndarray, delta: float) -> dict[str, list[float]]:
    """Share kept, cascade agreement and its 1 - delta lower bound as the threshold falls.

    At most CURVE_POINTS of the distinct thresholds, spread evenly over the ranking.
    """
    n = len(confidence)
    order = np.argsort(-confidence, kind="stable")
    ranked = confidence[order]
    wrong = np.cumsum(~correct[order])
    ends = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    picks = np.unique(np.linspace(0, len(ends) - 1, min(CURVE_POINTS, len(ends))).round().astype(int))
    ends = ends[picks]
    return {
        "threshold": ranked[ends].tolist(),
        "kept_share": ((ends + 1) / n).tolist(),
        "agreement": (1 - wrong[ends] / n).tolist(),
        "lower_bound": [clopper_pearson_lower(int(n - w), n, delta) for w in wrong[ends]],
    }


def _confusion(probs: np.ndarray, teacher: np.ndarray) -> list[list[int]]:
    k = probs.shape[1]
    matrix = np.zeros((k, k), dtype=np.int64)
    np.add.at(matrix, (teacher, probs.argmax(axis=1)), 1)
    return matrix.tolist()


def replay(qid: str, tiers: list[str], fits: Mapping[str, Fit], teacher: str) -> CascadeShares:
    """Route each threshold-part item through the calibrated tiers: who answers, and agreement."""
    ids = sorted(set().union(*(set(fit.scores) for fit in fits.values())))
    answered = dict.fromkeys([*tiers, teacher], 0)
    wrong = 0
    for item in ids:
        keeper = next((name for name in tiers if keeps(fits.get(name), item)), teacher)
        answered[keeper] += 1
        if keeper != teacher:
            wrong += not fits[keeper].scores[item][1]
    n = len(ids)
    return CascadeShares(question=qid, n=n, answered_by={k: v / n for k, v in answered.items()},
                         agreement=1 - wrong / n)


def keeps(fit: Fit | None, item: str) -> bool:
    """Whether ``fit``'s tier keeps its answer about threshold-part ``item`` (no fit: never)."""
    if fit is None or fit.result.threshold is None or item not in fit.scores:
        return False
    return fit.scores[item][0] >= fit.result.threshold
