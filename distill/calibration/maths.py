"""The maths of calibration: temperature scaling, and thresholds with a finite-sample guarantee.

A threshold here is certified, not fitted: on new items from the calibration items' distribution,
the cascade's agreement with the teacher is at least the target with probability at least
``1 - delta``. Pure numpy/scipy on arrays: ``probs`` are (n, k) probability rows, ``teacher`` the
teacher's argmax per row (or its (n, k) rows where soft labels help). See docs/guarantee.md.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, softmax
from scipy.stats import beta

from cascade.checks import is_finite, is_integer, is_real
from cascade.errors import CascadeError, TemperatureError
from cascade.thresholds import apply_temperature as runtime_temperature

ROW_SUM_TOLERANCE = 1e-4
TEMPERATURE_BOUNDS = (0.05, 20.0)
METHODS = ("ltt", "clopper_pearson")
_LOG_FLOOR = 1e-300
"""Probabilities are clipped here before the log: p^(1/T) of an exact zero stays zero anyway."""

ScoreKind = Literal["probs", "logits"]


class CalibrationError(CascadeError, ValueError):
    """Calibration inputs are malformed (shapes, ranges, labels) or a parameter is out of range."""


@dataclass(frozen=True)
class ThresholdResult:
    """An acceptance threshold for one (question, tier) and what it does on the calibration data.

    ``threshold`` None means the tier keeps nothing (every item escalates). ``agreement_kept`` is
    nan when nothing is kept. ``agreement_cascade`` counts escalated items as agreeing, since the
    teacher answers them. ``lower_bound`` is the one-sided ``1 - delta`` lower confidence bound on
    the cascade agreement at ``threshold`` (1.0 when nothing is kept). ``target`` is None in
    budget mode, where the share kept is fixed and the agreement is what follows from it.
    """

    threshold: float | None
    kept_share: float
    agreement_kept: float
    agreement_cascade: float
    lower_bound: float
    n: int
    reachable: bool
    method: str
    message: str
    target: float | None
    delta: float


def fit_temperature(
    scores: Any,
    teacher: Any,
    *,
    kind: ScoreKind = "probs",
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
) -> float:
    """The temperature T that minimises the NLL of ``softmax(log p / T)`` against the teacher.

    One scalar per (question, tier) because it fixes over- or under-confidence without moving
    the argmax, so it can never change which answer a tier gives, only when it is trusted.
    ``scores`` are probability rows (``kind="probs"``) or logits (``kind="logits"``; the same
    thing for T, but without the underflow of tiny probabilities). ``teacher`` is (n,) labels or
    (n, k) soft rows; soft rows use the teacher's own uncertainty as the target. The NLL is
    convex in 1/T, so a bounded scalar search on log T finds the optimum; a result on a bound
    warns, since then the data do not pin T down (for example every argmax agrees).
    """
    _check_bounds(bounds)
    log_p = _log_scores(scores, kind)
    target = _teacher_rows(teacher, log_p.shape)
    low, high = np.log(bounds[0]), np.log(bounds[1])
    result = minimize_scalar(
        _nll, bounds=(low, high), args=(log_p, target), method="bounded", options={"xatol": 1e-6}
    )
    temperature = float(np.exp(result.x))
    if min(result.x - low, high - result.x) < 1e-4:
        warnings.warn(
            f"fit_temperature stopped at the bound T={temperature:.4g} of bounds={bounds}: the NLL "
            "keeps falling past it (for example when the tier agrees with every teacher label); "
            "calibrate on more items or widen bounds",
            UserWarning,
            stacklevel=2,
        )
    return temperature


def apply_temperature(scores: Any, temperature: float, *, kind: ScoreKind = "probs") -> np.ndarray:
    """``softmax(log p / T)`` (or ``softmax(logits / T)``): rows sum to 1, argmax unchanged.

    Probabilities go through the router's own formula (``cascade.thresholds``), so that a
    threshold set here is compared with exactly the numbers the router computes.
    """
    if kind == "probs":
        try:
            return runtime_temperature(_check_probs(scores), temperature)
        except TemperatureError as exc:
            raise CalibrationError(str(exc)) from None
    if not (is_finite(temperature) and temperature > 0):
        raise CalibrationError(f"temperature must be a finite float > 0; got {temperature!r}")
    return np.asarray(softmax(_log_scores(scores, kind) / temperature, axis=1))


def confidence_and_agreement(probs: Any, teacher: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the tier's top probability, and whether its argmax is the teacher's label."""
    probs = _check_probs(probs)
    labels = _teacher_labels(teacher, probs.shape)
    return probs.max(axis=1), probs.argmax(axis=1) == labels


def expected_calibration_error(probs: Any, teacher: Any, bins: int = 15) -> float:
    """Top-label ECE: the count-weighted mean |accuracy - confidence| over equal-width bins."""
    curve = reliability_curve(probs, teacher, bins)
    return float(curve["ece"])


def reliability_curve(probs: Any, teacher: Any, bins: int = 15) -> dict[str, Any]:
    """Per non-empty bin of top-label confidence: its edges, mean confidence, accuracy, count.

    Bins are equal-width on [0, 1], closed on the right ((lower, upper], the first also holds 0).
    Empty bins are left out, so every value is a plain float or int and the dict goes to JSON
    as it is; ``ece`` is included so that a report cannot show a curve and a different ECE.
    """
    if not is_integer(bins) or bins < 1:
        raise CalibrationError(f"bins must be an int >= 1; got {bins!r}")
    confidence, correct = confidence_and_agreement(probs, teacher)
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.searchsorted(edges[1:-1], confidence, side="left")
    count = np.bincount(index, minlength=bins)
    filled = np.flatnonzero(count)
    mean_confidence = np.bincount(index, confidence, bins)[filled] / count[filled]
    accuracy = np.bincount(index, correct, bins)[filled] / count[filled]
    ece = float(np.sum(count[filled] * np.abs(accuracy - mean_confidence)) / len(confidence))
    return {
        "lower": edges[filled].tolist(),
        "upper": edges[filled + 1].tolist(),
        "confidence": mean_confidence.tolist(),
        "accuracy": accuracy.tolist(),
        "count": count[filled].tolist(),
        "ece": ece,
    }


def clopper_pearson_lower(successes: int, n: int, delta: float) -> float:
    """One-sided exact lower bound L: P(Binomial(n, p) >= successes) <= delta for every p < L.

    So P(p < L) <= delta over repeated samples. 0 when there are no successes; delta ** (1 / n)
    when every trial succeeded, which is why a high target needs a minimum number of items.
    """
    if not is_integer(n) or n < 0:
        raise CalibrationError(f"n must be an int >= 0; got {n!r}")
    if not is_integer(successes) or not 0 <= successes <= n:
        raise CalibrationError(f"successes must be an int in [0, n={n}]; got {successes!r}")
    _check_open_unit("delta", delta)
    return float(_cp_lower(np.asarray([successes]), n, delta)[0])


def threshold_for_agreement(
    confidence: Any,
    correct: Any,
    target: float = 0.98,
    delta: float = 0.05,
    method: str = "ltt",
) -> ThresholdResult:
    """The lowest threshold whose cascade agreement is certified >= ``target`` at level ``delta``.

    Candidates are the distinct calibration confidences, scanned from strict to lax; at each the
    null hypothesis H0: risk(t) > 1 - target (risk = share of all n items kept AND wrong) is
    tested with the exact binomial test, i.e. rejected when the Clopper-Pearson lower bound on
    the agreement, from the n - wrong agreeing items out of n, is >= target.

    ``method="ltt"`` (Learn then Test, Angelopoulos et al. 2021, with fixed-sequence testing):
    each test runs at the full level delta and the scan stops at the first non-rejection. The
    order (strict to lax) is fixed before looking at the outcomes, so a wrong certification
    needs the first true null in the sequence to be rejected, which happens with probability at
    most delta: no multiplicity correction is needed. The candidates come from the data, which
    the textbook argument does not cover, but monotonicity does: the risk and the wrong count
    both only grow as t falls, so returning a t whose agreement is below target means the test
    also rejects at the highest such threshold t* (fewer wrong there), a fixed point where H0
    is true; that exact level-delta test rejects with probability at most delta.

    ``method="clopper_pearson"``: each candidate is checked on its own at level delta / m (m
    candidates, a Bonferroni union bound) and the lowest passing one is taken. Valid by the
    same argument at the smaller level, which is why it keeps less; it is here for comparison.

    Both guarantees are about new items from the distribution of the calibration items, which
    must not have been used to train the tier.
    """
    _check_open_unit("target", target)
    _check_open_unit("delta", delta)
    if method not in METHODS:
        raise CalibrationError(f"method must be one of {list(METHODS)}; got {method!r}")
    confidence, correct = _check_scores(confidence, correct)
    n = len(confidence)
    thresholds, kept, wrong = _candidates(confidence, correct)
    level = delta if method == "ltt" else delta / len(thresholds)
    lower = _cp_lower(n - wrong, n, level)
    passed = lower >= target
    certified = np.logical_and.accumulate(passed) if method == "ltt" else passed
    if not certified.any():
        return _unreachable(n, float(lower[0]), target, delta, level, method)
    last = int(np.flatnonzero(certified)[-1])
    result = _summary(float(thresholds[last]), int(kept[last]), int(wrong[last]), n, float(lower[last]))
    return ThresholdResult(
        **result,
        reachable=True,
        method=method,
        message=_kept_message(result, n, delta, f"target {target}"),
        target=target,
        delta=delta,
    )


def budget_keep_mask(confidence: Any, escalation_fraction: float) -> np.ndarray:
    """Which items to keep when at most ``escalation_fraction`` of them may escalate.

    The n - floor(fraction * n) most confident are kept; ties are broken by position (the earlier
    item is kept), as a router escalating a batch's least confident questions first would do.
    """
    confidence = _check_confidence(confidence)
    _check_fraction(escalation_fraction)
    n = len(confidence)
    n_keep = n - math.floor(escalation_fraction * n + 1e-9)
    order = np.argsort(-confidence, kind="stable")
    mask = np.zeros(n, dtype=bool)
    mask[order[:n_keep]] = True
    return mask


def threshold_for_budget(
    confidence: Any, correct: Any, escalation_fraction: float, delta: float = 0.05
) -> ThresholdResult:
    """Keep the (1 - fraction) most confident items; report the agreement that yields.

    ``threshold`` is the lowest kept confidence (ties split as in ``budget_keep_mask``).
    ``lower_bound`` is the Clopper-Pearson bound at that threshold as if it had been fixed in
    advance. It is not: it is a quantile of the calibration confidences. But the kept count is
    then fixed and the choice looks at confidences only, so the wrong count varies less than
    the binomial the bound assumes, and the bound stays (asymptotically) conservative.
    """
    _check_open_unit("delta", delta)
    confidence, correct = _check_scores(confidence, correct)
    keep = budget_keep_mask(confidence, escalation_fraction)
    n, n_keep, n_wrong = len(confidence), int(keep.sum()), int((keep & ~correct).sum())
    if n_keep == 0:
        message = f"escalation_fraction {escalation_fraction} escalates all {n} items; the tier keeps none"
        return _nothing_kept(n, "budget", message, None, delta, reachable=True)
    lower = float(_cp_lower(np.asarray([n - n_wrong]), n, delta)[0])
    result = _summary(float(confidence[keep].min()), n_keep, n_wrong, n, lower)
    budget = f"escalation budget {escalation_fraction}"
    return ThresholdResult(
        **result,
        reachable=True,
        method="budget",
        message=_kept_message(result, n, delta, budget),
        target=None,
        delta=delta,
    )


def _nll(log_temperature: float, log_p: np.ndarray, target: np.ndarray) -> float:
    log_q = log_softmax(log_p / np.exp(log_temperature), axis=1)
    return float(-np.sum(target * log_q) / len(log_p))


def _cp_lower(successes: np.ndarray, n: int, delta: float) -> np.ndarray:
    """Vectorised ``clopper_pearson_lower``; trusts its inputs."""
    safe = np.maximum(successes, 1)
    return np.where(successes > 0, beta.ppf(delta, safe, n - safe + 1), 0.0)


def _candidates(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, ...]:
    """Distinct confidences from high to low, with the kept and the kept-and-wrong counts at each."""
    order = np.argsort(-confidence, kind="stable")
    ranked = confidence[order]
    cumulative_wrong = np.cumsum(~correct[order])
    ends = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    return ranked[ends], ends + 1, cumulative_wrong[ends]


def _summary(threshold: float, kept: int, wrong: int, n: int, lower: float) -> dict[str, Any]:
    return {
        "threshold": threshold,
        "kept_share": kept / n,
        "agreement_kept": (kept - wrong) / kept,
        "agreement_cascade": 1.0 - wrong / n,
        "lower_bound": lower,
        "n": n,
    }


def _kept_message(result: dict[str, Any], n: int, delta: float, goal: str) -> str:
    return (
        f"keeps {result['kept_share']:.1%} of {n} items (score >= {result['threshold']:.6g}); "
        f"cascade agreement >= {result['lower_bound']:.4f} with {1 - delta:.0%} confidence "
        f"({goal}; empirical {result['agreement_cascade']:.4f})"
    )


def _unreachable(
    n: int, best: float, target: float, delta: float, level: float, method: str
) -> ThresholdResult:
    """Nothing certifiable: say what is, and what would help."""
    needed = _items_needed(target, level)
    if n < needed:
        advice = f"label at least {needed} items or lower the target"
    else:
        advice = (
            "the tier's most confident answers disagree with the teacher; "
            "lower the target or improve the tier"
        )
    message = (
        f"target {target} not reachable with {n} items: the best certifiable is {best:.4f} "
        f"(at {1 - delta:.0%} confidence); {advice}; until then the tier keeps nothing"
    )
    return _nothing_kept(n, method, message, target, delta, reachable=False)


def _nothing_kept(
    n: int, method: str, message: str, target: float | None, delta: float, *, reachable: bool
) -> ThresholdResult:
    return ThresholdResult(
        threshold=None,
        kept_share=0.0,
        agreement_kept=math.nan,
        agreement_cascade=1.0,
        lower_bound=1.0,
        n=n,
        reachable=reachable,
        method=method,
        message=message,
        target=target,
        delta=delta,
    )


def _items_needed(target: float, level: float) -> int:
    """The fewest items with which a perfect top answer certifies ``target``: level ** (1/n) >= target."""
    needed = max(1, math.ceil(math.log(level) / math.log(target)))
    while level ** (1 / needed) < target:
        needed += 1
    return needed


def _log_scores(scores: Any, kind: str) -> np.ndarray:
    if kind == "probs":
        return np.log(np.maximum(_check_probs(scores), _LOG_FLOOR))
    if kind == "logits":
        logits = _as_float_matrix(scores, "logits")
        return np.asarray(log_softmax(logits, axis=1))
    raise CalibrationError(f"kind must be 'probs' or 'logits'; got {kind!r}")


def _as_float_matrix(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 2:
        raise CalibrationError(
            f"{name} must be a 2-D array (n >= 1 rows, k >= 2 columns); got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise CalibrationError(
            f"{name} must be finite; got NaN or inf in {int((~np.isfinite(array)).sum())} cells"
        )
    return array


def _check_probs(probs: Any, name: str = "probs") -> np.ndarray:
    array = _as_float_matrix(probs, name)
    sums = array.sum(axis=1)
    bad = np.flatnonzero((array < 0).any(axis=1) | (np.abs(sums - 1) > ROW_SUM_TOLERANCE))
    if bad.size:
        raise CalibrationError(
            f"{name} rows must be non-negative and sum to 1 (within {ROW_SUM_TOLERANCE}); row "
            f"{bad[0]} sums to {sums[bad[0]]:.6g} ({bad.size} bad rows); pass kind='logits' for logits"
        )
    return array


def _teacher_rows(teacher: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The teacher as (n, k) target rows: one-hot for labels, as given for soft rows."""
    if np.ndim(teacher) == 2:
        rows = _check_probs(teacher, "teacher")
        if rows.shape != shape:
            raise CalibrationError(f"teacher rows have shape {rows.shape}; expected {shape}, like the scores")
        return rows
    return np.eye(shape[1])[_teacher_labels(teacher, shape)]


def _teacher_labels(teacher: Any, shape: tuple[int, ...]) -> np.ndarray:
    if np.ndim(teacher) == 2:
        return _teacher_rows(teacher, shape).argmax(axis=1)
    labels = np.asarray(teacher)
    if labels.shape != shape[:1] or not np.issubdtype(labels.dtype, np.integer):
        raise CalibrationError(
            f"teacher must be ({shape[0]},) int labels or {shape} probability rows; "
            f"got shape {labels.shape} dtype {labels.dtype}"
        )
    if labels.min() < 0 or labels.max() >= shape[1]:
        raise CalibrationError(
            f"teacher labels must be in [0, {shape[1]}); got {labels.min()}..{labels.max()}"
        )
    return labels


def _check_confidence(confidence: Any) -> np.ndarray:
    array = np.asarray(confidence, dtype=np.float64)
    if array.ndim != 1 or array.size < 1:
        raise CalibrationError(
            f"confidence must be a 1-D array with at least 1 item; got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise CalibrationError("confidence must be finite; got NaN or inf")
    return array


def _check_scores(confidence: Any, correct: Any) -> tuple[np.ndarray, np.ndarray]:
    conf = _check_confidence(confidence)
    agree = np.asarray(correct)
    if agree.shape != conf.shape:
        raise CalibrationError(f"correct has shape {agree.shape}; expected {conf.shape}, like confidence")
    if agree.dtype != bool and not np.isin(agree, (0, 1)).all():
        raise CalibrationError("correct must be booleans (tier argmax == teacher argmax) or 0/1")
    return conf, agree.astype(bool)


def _check_open_unit(name: str, value: Any) -> None:
    if not is_real(value) or not 0 < value < 1:
        raise CalibrationError(f"{name} must be a float in (0, 1); got {value!r}")


def _check_fraction(value: Any) -> None:
    if not is_real(value) or not 0 <= value <= 1:
        raise CalibrationError(f"escalation_fraction must be a float in [0, 1]; got {value!r}")


def _check_bounds(bounds: tuple[float, float]) -> None:
    if len(bounds) != 2 or not all(is_real(b) and b > 0 for b in bounds) or not bounds[0] < bounds[1]:
        raise CalibrationError(f"bounds must be (low, high) with 0 < low < high; got {bounds!r}")
