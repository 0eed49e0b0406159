"""Certificates from served traffic, where which items the teacher labelled depends on how the
serving cascade routed them.

A serving cascade's escalations are labelled with probability 1 and are the hard items; what it
kept is labelled only where the audit drew it (probability ``audit_share``). Pooled as if they were
a uniform sample they over-represent the hard items, so they may train a head but certify a
threshold only through an estimator that knows how each item was chosen. Per question, over the
calibration part's window of traffic (``Window``: items every one of which was labelled, a
collected stretch or a corpus, and items the serving cascade routed), four methods:

- ``uniform``: the uniformly drawn items alone (the census and the audits), the exact binomial
  Learn-then-Test of ``maths.threshold_for_agreement``. Valid; it uses no escalation.
- ``stratified``: every labelled item. Each disagreement counts 1 where the item was labelled with
  probability 1 and 1 / audit_share where only the audit could have labelled it (the
  Horvitz-Thompson count); the count is tested with its exact distribution (multinomial), at the
  least favourable split of the disagreements between the escalated and the kept items.
- ``betting``: the same weighted losses, 0 for every unlabelled item, in a seeded random order,
  tested by betting (Waudby-Smith and Ramdas 2024) on a fixed grid of thresholds.
- ``pooled``: every labelled item as if uniform. Not valid; here to be measured.

bench/traffic_evidence.py measures them on AG News replays; docs/retraining.md says which is
the default and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.stats import binom

from distill.calibration.maths import CalibrationError, _candidates, threshold_for_agreement

Method = Literal["uniform", "stratified", "betting", "pooled"]
METHODS: tuple[Method, ...] = ("uniform", "stratified", "betting", "pooled")
NUISANCE_GRID = 201
"""Splits of the null's disagreements between escalated and kept items tried for the worst one."""
BETTING_GRID = 1 - np.logspace(-4, 0, 400)
"""Thresholds the betting test walks, strict to lax: fixed before any item is seen, since its
stakes do not rank thresholds monotonically."""
MAX_STAKE = 0.75
BETTING_SEED = 0


@dataclass(frozen=True)
class Window:
    """A calibration part of traffic: ``census`` items of which every one was labelled, and
    ``served`` items the serving cascade routed (its escalations labelled, what it kept audited
    with probability ``audit_share``). Both count every item, labelled or not."""

    census: int
    served: int
    audit_share: float

    def __post_init__(self) -> None:
        if self.census < 0 or self.served < 0 or self.census + self.served < 1:
            raise CalibrationError(f"a window needs a whole number >= 0 of census and served items, "
                                   f"at least one in all; got {self.census} and {self.served}")
        if not 0 < self.audit_share <= 1:
            raise CalibrationError(f"audit_share must be in (0, 1]; got {self.audit_share!r}")


@dataclass(frozen=True)
class TrafficResult:
    """A threshold certified on traffic (None: keeps nothing), the share of the window's traffic
    it is estimated to keep (weighted by how each item was drawn), and how."""

    threshold: float | None
    kept_share: float
    method: Method
    target: float
    delta: float


def traffic_threshold(score: np.ndarray, correct: np.ndarray, always: np.ndarray, uniform: np.ndarray,
                      window: Window, target: float, delta: float, method: Method = "stratified"
                      ) -> TrafficResult:
    """The lowest threshold ``method`` certifies for ``target`` agreement at level ``delta``.

    Per labelled item of the window: its score and whether the tier agrees with the teacher;
    ``always``: labelled with probability 1 (census, or escalated by the serving cascade);
    ``uniform``: drawn uniformly (census, or audited).
    """
    score, correct = np.asarray(score, dtype=np.float64), np.asarray(correct, dtype=bool)
    always, uniform = np.asarray(always, dtype=bool), np.asarray(uniform, dtype=bool)
    if method not in METHODS:
        raise CalibrationError(f"method must be one of {list(METHODS)}; got {method!r}")
    if not (score.shape == correct.shape == always.shape == uniform.shape) or np.any(~always & ~uniform):
        raise CalibrationError("score, correct, always and uniform must be arrays of one shape, and every "
                               "item labelled always or drawn uniformly")
    if method in ("uniform", "pooled"):
        rows = uniform if method == "uniform" else np.ones_like(uniform)
        threshold = _plain(score[rows], correct[rows], target, delta) if rows.any() else None
    elif method == "stratified":
        threshold = _stratified(score, correct, always, window, 1 - target, delta)
    else:
        threshold = _betting(score, correct, always, window, 1 - target, delta)
    return TrafficResult(threshold, _kept_share(score, always, window, threshold), method, target, delta)


def _plain(score: np.ndarray, correct: np.ndarray, target: float, delta: float) -> float | None:
    return threshold_for_agreement(score, correct, target, delta).threshold


def _kept_share(score: np.ndarray, always: np.ndarray, window: Window, threshold: float | None) -> float:
    """The Horvitz-Thompson share of the window's items the threshold keeps."""
    if threshold is None:
        return 0.0
    weight = np.where(always, 1.0, 1 / window.audit_share)
    return float(np.sum(weight * (score >= threshold)) / (window.census + window.served))


def _stratified(score: np.ndarray, correct: np.ndarray, always: np.ndarray, window: Window, alpha: float,
                delta: float) -> float | None:
    """The lowest candidate whose weighted disagreement count the exact test rejects at delta.

    The count only grows as the threshold falls and the test's p-value only grows with the count,
    so the fixed-sequence scan stops where a binary search over the candidates does.
    """
    order = np.argsort(-score, kind="stable")
    thresholds, kept, _ = _candidates(score, correct)
    ends = kept - 1
    first = np.cumsum(~correct[order] & always[order])[ends]
    second = np.cumsum(~correct[order] & ~always[order])[ends]
    low, high = 0, len(thresholds)  # candidates[:low] pass; candidates[high:] fail
    while low < high:
        middle = (low + high) // 2
        if stratified_pvalue(int(first[middle]), int(second[middle]), window, alpha) <= delta:
            low = middle + 1
        else:
            high = middle
    return float(thresholds[low - 1]) if low else None


def stratified_pvalue(first: int, second: int, window: Window, alpha: float) -> float:
    """P(weighted count <= first + second / audit_share) at the least favourable null: agreement
    exactly 1 - alpha, its disagreements split between escalated and kept items as they most
    resemble this count.

    ``first``: disagreements among items labelled with probability 1; ``second``: among kept items
    the audit labelled. A census item disagrees with probability alpha; a served one is an
    escalated disagreement with probability a and an audited kept one with probability b x share,
    a + b = alpha (multinomial), so the count's law is known for each b; the worst b of
    NUISANCE_GRID is taken.
    """
    p = window.audit_share
    total = first + second / p
    b = np.linspace(0.0, alpha, NUISANCE_GRID)
    escalated = np.clip((alpha - b) / np.maximum(1 - b * p, 1e-12), 0.0, 1.0)
    mass = np.zeros(NUISANCE_GRID)
    for j in range(min(second + math.floor(p * first + 1e-9), window.served) + 1):
        room = math.floor(total - j / p + 1e-9)
        if room < 0:
            break
        k = np.arange(room + 1)
        census = np.cumsum(binom.pmf(k, window.census, alpha))  # P(census disagreements <= k)
        served = binom.pmf(k[None, :], window.served - j, escalated[:, None])
        mass += binom.pmf(j, window.served, b * p) * (served @ census[::-1])
    return float(mass.max())


def _betting(score: np.ndarray, correct: np.ndarray, always: np.ndarray, window: Window, alpha: float,
             delta: float) -> float | None:
    """The lowest grid threshold before the first one a betting test cannot certify.

    Each of the window's items is a loss in [0, 1]: its weighted disagreement times the audit
    share (0 where unlabelled), placed at a seeded random position (the order is independent of
    the losses, so they are exchangeable). Against "mean loss >= alpha x share" a gambler stakes
    ``lam`` on each, sized from the earlier ones (Waudby-Smith and Ramdas's fixed-n plug-in,
    truncated at MAX_STAKE); the hypothesis is rejected when the wealth reaches 1 / delta
    (Ville's inequality).
    """
    p, n = (window.audit_share if window.served else 1.0), window.census + window.served
    if len(score) > n:
        raise CalibrationError(f"the window counts {n} items but {len(score)} are labelled")
    level = alpha * p
    position = np.random.default_rng(BETTING_SEED).permutation(n)[: len(score)]
    wrong = ~correct[:, None] & (score[:, None] >= BETTING_GRID[None, :])
    losses = np.zeros((n, len(BETTING_GRID)))
    losses[position] = wrong * np.where(always, p, 1.0)[:, None]
    seen = np.arange(1, n + 1)[:, None]
    mean = (level + np.cumsum(losses, axis=0)) / (seen + 1)
    before = np.vstack([np.full((1, len(BETTING_GRID)), level), mean[:-1]])
    spread = (level * (1 - level) + np.cumsum((losses - before) ** 2, axis=0)) / (seen + 1)
    spread = np.vstack([np.full((1, len(BETTING_GRID)), level * (1 - level)), spread[:-1]])
    stake = np.minimum(MAX_STAKE / (1 - level), np.sqrt(2 * math.log(1 / delta) / (n * spread)))
    wealth = np.cumsum(np.log1p(stake * (level - losses)), axis=0)
    passed = np.logical_and.accumulate(wealth.max(axis=0) >= math.log(1 / delta))
    return float(BETTING_GRID[int(passed.sum()) - 1]) if passed.any() else None
