"""The promotion gate's rule: which bundle to serve, decided by a paired comparison with measured
errors, at levels that keep the chosen bundle's certificate valid after the choice.

Why not compare certified shares: at a 0.98 target a certificate on a few hundred items keeps what
lies above about the second disagreement, so its share moves 10-20 points from one draw to the
next and "candidate >= serving" is close to a coin toss (bench/promotion_gate.py measures it).

The choosing statistic is the *plug-in* share: per question, the largest share of items (most
confident first) whose cascade agreement with the teacher on the items is at least a target, i.e.
the position of the (1 - target) x n-th disagreement rather than the second. It is averaged over a
*band* of targets: from the user's up to the one the certificate at the gate's level effectively
asks of the n items both bundles are certified on (it keeps down to where the disagreements among
them reach the largest count w whose Clopper-Pearson bound still passes: plug-in at 1 - w/n, about
0.99 on 800 items, 0.987 on 1,600). A bundle serves its certificate's thresholds, which sit at the
top of that band now and move down it as evidence grows; the user's target alone missed candidates
that rank better only at the top (fine-tuned encoders kept 7-13 points more held-out items at equal
plug-in shares). Both bundles are scored on the same held-out items, so their shares are compared
*paired*: the items are resampled together (a paired bootstrap), which keeps what the two bundles
share (the hard items are hard for both) out of the noise. The candidate is promoted only where the
one-sided ``1 - ALPHA`` percentile lower bound on (candidate share - serving share), averaged over
the questions and the band, is above 0: a tie never promotes, since its bound is at most 0. The
level is set by simulation (``ALPHA``) for the errors that cost share: a worse candidate promoted,
a better one refused.

The choice looks at the same items that certify, so the certificates are made valid for any
choice: both bundles are certified at half the level (Learn then Test with a Bonferroni split over
the two), so that with probability ``1 - delta`` both certificates hold at once, whichever is
chosen. Splitting the items into a choosing and a certifying part instead halves the items of each
step; the simulation shows the half level costs less (see docs/retraining.md). Repeated attempts
against one serving bundle reuse its held-out items, so the k-th attempt since the last promotion
spends ``delta x 6 / (pi^2 k^2)`` (these sum to delta over every attempt), counted from the
promotions log.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta

from distill.calibration.joint import equal_disagreement_path

RULE = "paired-band-bootstrap"
"""The name the promotions log gives this rule."""
ALPHA = 0.2
"""One-sided level of the choosing rule: a candidate exactly as good as the serving bundle is
promoted in about this share of attempts. Not 0.05: promoting an equal bundle costs no validity
(both certificates hold whichever is chosen) and no share, while at 0.05 a candidate 5 points
better is promoted in under 60% of runs at n = 2,000 (bench/promotion_gate.py); at 0.2 one 5
points worse is promoted, over the band, with both bundles certified on the items weighed, in
4.5% of runs at 300 certifying + 300 evaluation items and 0.2% at 1,000 + 1,000 (6.0% on 300
certifying items with no evaluation part)."""
RESAMPLES = 1000
"""Paired bootstrap resamples: enough for the 5% quantile to move by well under a point."""
BAND_POINTS = 5
"""Targets in the band, evenly spaced: the user's, the certificate's effective one, three between."""
SEED = 20261203
"""The resampling is seeded, so a gate decides the same way on the same evidence."""


@dataclass(frozen=True)
class Question:
    """One question's evidence for one bundle: ``items`` indexes the gate's common item list,
    ``scores`` rank the items (higher is kept first; NaN: never kept), ``correct`` says whether the
    answer kept there agrees with the teacher."""

    items: np.ndarray
    scores: np.ndarray
    correct: np.ndarray


@dataclass(frozen=True)
class Comparison:
    """The paired statistic: the mean over the questions and the band's ``targets`` of candidate
    minus serving plug-in share on the items, and its one-sided ``1 - alpha`` bootstrap lower
    bound."""

    serving_share: float
    candidate_share: float
    difference: float
    lower_bound: float
    alpha: float
    resamples: int
    targets: tuple[float, ...]

    @property
    def promotes(self) -> bool:
        """Strictly above 0: a tie (bound 0) never promotes."""
        return self.lower_bound > 0


def attempt_delta(delta: float, attempt: int) -> float:
    """The delta the ``attempt``-th gate against one serving bundle may spend (1-based): the terms
    ``6 / (pi^2 k^2)`` sum to 1, so every attempt on the same held-out items together spend delta."""
    if attempt < 1:
        raise ValueError(f"attempt must be a whole number >= 1; got {attempt!r}")
    return delta * 6 / (math.pi ** 2 * attempt ** 2)


def certificate_delta(delta: float, attempt: int) -> float:
    """Each bundle's certificate level: half the attempt's delta (Bonferroni over the two)."""
    return attempt_delta(delta, attempt) / 2


def band(target: float, certifying: int, delta: float, points: int = BAND_POINTS) -> tuple[float, ...]:
    """The targets the gate averages over: ``points`` evenly spaced from ``target`` up to the
    agreement a certificate at ``delta`` on ``certifying`` items effectively asks (1 - w/n, w the
    most disagreements among the n items whose Clopper-Pearson lower bound on agreement, at
    ``delta``, is still >= target; 1 where none pass)."""
    if certifying < 1 or points < 1:
        raise ValueError(f"band needs certifying items and points >= 1; got {certifying!r}, {points!r}")
    wrong = np.arange(certifying)
    passing = wrong[beta.ppf(delta, certifying - wrong, wrong + 1) >= target]
    strict = 1 - passing.max() / certifying if passing.size else 1.0
    return tuple(float(t) for t in np.linspace(target, max(strict, target), points))


def plugin_share(scores: np.ndarray, correct: np.ndarray, target: float) -> float:
    """The largest share kept, most confident first and ties whole, with agreement >= target on
    these items (escalated items agree: the teacher answers them)."""
    weights = np.ones((1, len(scores)))
    return float(weighted_shares(weights, scores, correct, np.arange(len(scores)), target)[0])


def compare(serving: Sequence[Question], candidate: Sequence[Question], items: int,
            targets: Sequence[float], *, alpha: float = ALPHA, resamples: int = RESAMPLES,
            seed: int = SEED) -> Comparison:
    """Candidate against serving on the same ``items`` held-out items, questions in one order:
    the plug-in shares on the items, averaged over the questions and ``targets`` (``band``), and
    the paired bootstrap bound on their mean difference."""
    if len(serving) != len(candidate) or not serving:
        raise ValueError("compare needs the same questions, at least one, for both bundles")
    if not targets:
        raise ValueError("compare needs at least one target")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, items, size=(resamples, items)) + items * np.arange(1, resamples + 1)[:, None]
    weights = np.bincount(draws.ravel(), minlength=(resamples + 1) * items).reshape(resamples + 1, items)
    weights = weights.astype(np.int32)
    weights[0] = 1  # row 0: the items as they are; the others: how often each item was drawn
    means = {}
    for name, questions in (("serving", serving), ("candidate", candidate)):
        means[name] = np.mean([weighted_shares(weights, q.scores, q.correct, q.items, target)
                               for q in questions for target in targets], axis=0)
    difference = means["candidate"] - means["serving"]
    return Comparison(serving_share=float(means["serving"][0]), candidate_share=float(means["candidate"][0]),
                      difference=float(difference[0]), lower_bound=float(np.quantile(difference[1:], alpha)),
                      alpha=alpha, resamples=resamples, targets=tuple(targets))


def weighted_shares(weights: np.ndarray, scores: np.ndarray, correct: np.ndarray, items: np.ndarray,
            target: float) -> np.ndarray:
    """Per row of item weights (a resample), the plug-in share: cut only between distinct scores,
    before the tie group of the first disagreement that takes the weighted disagreements past
    (1 - target) of the weight (disagreements only grow down the ranking, so the cuts that pass
    are a prefix)."""
    order = np.argsort(-np.nan_to_num(scores, nan=-np.inf), kind="stable")
    answered = int(np.isfinite(scores).sum())
    total = np.maximum(weights[:, items].sum(axis=1), 1)
    if answered == 0:
        return np.zeros(len(weights))
    ranked, kept_order = scores[order[:answered]], order[:answered]
    w = weights[:, items[kept_order]]
    kept = np.cumsum(w, axis=1)
    wrong_at = np.flatnonzero(~correct[kept_order])
    wrong = np.cumsum(w[:, wrong_at], axis=1)
    ends = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    passing = (wrong <= (1 - target) * total[:, None] + 1e-9).sum(axis=1)
    first_over = np.append(wrong_at, answered)[passing]  # answered: no disagreement goes over
    last = np.searchsorted(ends, first_over) - (passing < len(wrong_at))
    rows = np.arange(len(weights))
    return np.where(last >= 0, kept[rows, ends[np.clip(last, 0, len(ends) - 1)]] / total, 0.0)


def chain_ranks(scores: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One score per item for a chain of cheap tiers ((tiers, items) raw scores, NaN: no answer):
    minus the step of the chain's path (``joint.equal_disagreement_path``, built on all the items)
    at which the item is first kept, and whether the tier keeping it there agrees. With one tier
    this is its own score's ranking."""
    if len(scores) == 1:
        return scores[0], correct[0]
    vectors = np.asarray(equal_disagreement_path(scores, correct))
    with np.errstate(invalid="ignore"):
        clears = scores[None, :, :] >= vectors[:, :, None]  # (steps, tiers, items)
    clears &= np.isfinite(scores)[None]
    kept = clears.any(axis=1)
    n = scores.shape[1]
    step = np.where(kept.any(axis=0), kept.argmax(axis=0), -1)
    rank = np.where(step >= 0, -step.astype(np.float64), np.nan)
    keeper = clears[np.maximum(step, 0), :, np.arange(n)].argmax(axis=1)
    return rank, np.where(step >= 0, correct[keeper, np.arange(n)], True)
