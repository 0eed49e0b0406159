"""One certificate for a chain of cheap tiers: their thresholds certified together, against the
agreement of the whole system, at the full target and the full delta.

The split certificate gives each of m cheap tiers (1 - target) / m of the error budget and delta / m
of the confidence, so each tier keeps as if the others did not exist and a second tier makes the
first keep less. Here one Learn-then-Test fixed-sequence test runs along an ordered path of
threshold VECTORS (one threshold per tier), testing at each "the system agrees with the teacher
on at least target of new items" with the exact binomial test at level delta, and stops at the
first vector it cannot certify (Angelopoulos et al. 2021, "Learn then Test").

Fixed-sequence testing controls the family-wise error at delta for any order fixed before the
tested items are seen, so the path is built on one part of the calibration items (the part the
temperature is fitted on, 30% by a hash of the id: ``fits.in_temperature_part``) and tested on
the others. The path lowers one tier's threshold by one step at a time, always the step whose
next answers have the lowest disagreement rate (an isotonic fit of disagreement on score, per
tier, on the path part): every tier is lowered at one level of local disagreement, and equal
marginal disagreement is where no shift of kept items between tiers keeps more for the same
errors, so the path passes near the best vectors; its steps are as fine as the path part's
scores, so the test stops close to the last vector it can certify. With one cheap tier nothing
is split and the ordinary certificate (``maths.threshold_for_agreement``, on all items) is the
same statement. See docs/guarantee.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.isotonic import IsotonicRegression

from distill.calibration.fits import Fit, in_temperature_part
from distill.calibration.maths import CalibrationError, _cp_lower
from distill.calibration.results import QuestionTier

CHAIN_METHOD = "ltt-chain"
PRIOR_ITEMS = 5.0
"""Weight, in items, of a tier's overall disagreement rate in each stretch of its path estimate."""
"""What a chain-certified threshold's facts name as their method."""


@dataclass(frozen=True)
class ChainResult:
    """The thresholds certified for a chain of cheap tiers, cheapest first, and what they do on
    the tested items.

    ``thresholds[k]`` None: tier k keeps nothing. ``kept[k]``: the share of the tested items tier k
    answers in the chain (those the tiers before it escalate and it keeps). ``lower_bound``: the
    one-sided ``1 - delta`` bound on the system's agreement at the chosen vector (1.0 when
    nothing is kept). ``steps``: vectors on the path; ``tested``: how many the test passed.
    """

    thresholds: list[float | None]
    kept: list[float]
    agreement: float
    lower_bound: float
    n_path: int
    n_test: int
    steps: int
    tested: int
    target: float
    delta: float

    @property
    def reachable(self) -> bool:
        return self.tested > 0

    def message(self) -> str:
        """One line for the report: what the chain keeps, or why it keeps nothing."""
        if not self.reachable:
            return (f"target {self.target} not certified for the chain on {self.n_test} tested items "
                    f"(path of {self.steps} vectors built on {self.n_path}): every cheap tier keeps "
                    "nothing; label more items or lower the target")
        shares = ", ".join(f"{share:.1%}" for share in self.kept)
        return (f"the chain keeps {sum(self.kept):.1%} of {self.n_test} tested items ({shares} per "
                f"tier); system agreement >= {self.lower_bound:.4f} with {1 - self.delta:.0%} "
                f"confidence (target {self.target}, one certificate for the chain; empirical "
                f"{self.agreement:.4f})")


def chain_thresholds(scores: Sequence[np.ndarray] | np.ndarray, correct: Sequence[np.ndarray] | np.ndarray,
                     path: np.ndarray, target: float, delta: float) -> ChainResult:
    """Certify one threshold per tier so that the chain agrees with the teacher on at least
    ``target`` of new items, with probability ``1 - delta``.

    ``scores[k]``: tier k's raw score per item (NaN where it gives no answer: it never keeps that
    item); ``correct[k]``: whether its answer is the teacher's; ``path``: the items that build
    the path (the others test it; neither part may have trained a tier).
    """
    scores_, correct_, path_ = _checked(scores, correct, path, target, delta)
    vectors = equal_disagreement_path(scores_[:, path_], correct_[:, path_])
    test_scores, test_correct = scores_[:, ~path_], correct_[:, ~path_]
    n = test_scores.shape[1]
    wrong = np.asarray([_outcome(test_scores, test_correct, v)[1] for v in vectors], dtype=np.int64)
    lower = _cp_lower(n - wrong, n, delta) if n else np.zeros(len(vectors))
    passed = np.logical_and.accumulate(lower >= target)
    tested = int(passed.sum())
    chosen = vectors[tested - 1] if tested else np.full(len(scores_), np.inf)
    kept, errors = _outcome(test_scores, test_correct, chosen)
    return ChainResult(
        thresholds=[None if not np.isfinite(t) else float(t) for t in chosen],
        kept=[float(k) / max(n, 1) for k in kept], agreement=1 - errors / max(n, 1),
        lower_bound=float(lower[tested - 1]) if tested else 1.0, n_path=int(path_.sum()), n_test=n,
        steps=len(vectors), tested=tested, target=target, delta=delta)


def equal_disagreement_path(scores: np.ndarray, correct: np.ndarray) -> list[np.ndarray]:
    """Threshold vectors from strict to lax, one tier's threshold lowered by one step at a time:
    the step whose next answers have the lowest fitted disagreement rate (ties: the cheaper tier,
    then the higher score), so that every tier is lowered at one level of local disagreement
    (inf: a tier keeping nothing yet). ``scores`` and ``correct`` are (tiers, items) on the path
    part."""
    fits = [_disagreement_fit(s, c) for s, c in zip(scores, correct, strict=True)]
    steps = sorted((float(rate), k, -float(score)) for k, (grid, rates) in enumerate(fits)
                   for score, rate in zip(grid, rates, strict=True))
    vector = np.full(len(fits), np.inf)
    vectors = [vector.copy()]
    for _, k, negative in steps:
        vector[k] = -negative
        vectors.append(vector.copy())
    return vectors


def _disagreement_fit(scores: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct answered scores (descending) and the disagreement rate at each: an isotonic
    fit (the rate falls as the score rises, as a threshold's ranking assumes), each of its flat
    stretches shrunk toward the tier's overall rate by PRIOR_ITEMS, so that a few answers that
    happen to agree do not send a weak tier in ahead of a strong one."""
    answered = np.isfinite(scores)
    if not answered.any():
        return np.empty(0), np.empty(0)
    x, wrong = scores[answered], (~correct[answered]).astype(np.float64)
    grid = np.unique(x)[::-1]
    fitted = IsotonicRegression(increasing=False, out_of_bounds="clip").fit(x, wrong).predict(x)
    _, stretch, sizes = np.unique(fitted, return_inverse=True, return_counts=True)
    shrunk = (fitted * sizes[stretch] + PRIOR_ITEMS * wrong.mean()) / (sizes[stretch] + PRIOR_ITEMS)
    at = {float(score): float(rate) for score, rate in zip(x, shrunk, strict=True)}
    return grid, np.maximum.accumulate(np.asarray([at[float(score)] for score in grid]))


def _outcome(scores: np.ndarray, correct: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, int]:
    """Per tier, how many items it keeps in the chain; and how many kept answers disagree."""
    with np.errstate(invalid="ignore"):
        clears = scores >= thresholds[:, None]
    clears &= np.isfinite(scores)
    first = np.where(clears.any(axis=0), clears.argmax(axis=0), -1)
    kept = np.asarray([int((first == k).sum()) for k in range(len(scores))])
    items = np.flatnonzero(first >= 0)
    wrong = int((~correct[first[items], items]).sum())
    return kept, wrong


def _checked(scores: Sequence[np.ndarray] | np.ndarray, correct: Sequence[np.ndarray] | np.ndarray,
             path: np.ndarray, target: float, delta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    for name, value in (("target", target), ("delta", delta)):
        if not 0 < value < 1:
            raise CalibrationError(f"{name} must be a number in (0, 1); got {value!r}")
    s = np.asarray(scores, dtype=np.float64)
    c = np.asarray(correct, dtype=bool)
    p = np.asarray(path, dtype=bool)
    if s.ndim != 2 or s.shape != c.shape or p.shape != s.shape[1:] or len(s) < 1:
        raise CalibrationError(f"scores and correct must be (tiers, items) arrays of one shape and path "
                               f"(items,); got {s.shape}, {c.shape} and {p.shape}")
    return s, c, p


def certify_chains(fits: dict[str, dict[str, Fit]], tiers: Sequence[str], target: float, delta: float
                   ) -> None:
    """Replace the thresholds of every question two or more cheap tiers answer by the chain's
    (``chain_thresholds`` on the calibration items each fit scored), in place. A question one tier
    answers keeps its own certificate, which is already at the full target and delta."""
    for by_tier in fits.values():
        names = [name for name in tiers if name in by_tier]
        if len(names) < 2:
            continue
        items = sorted(set().union(*(by_tier[name].scores for name in names)))
        scores = np.full((len(names), len(items)), np.nan)
        correct = np.ones((len(names), len(items)), dtype=bool)
        for k, name in enumerate(names):
            for j, item in enumerate(items):
                if item in by_tier[name].scores:
                    scores[k, j], correct[k, j] = by_tier[name].scores[item]
        path = np.asarray([in_temperature_part(item) for item in items])
        chain = chain_thresholds(scores, correct, path, target, delta)
        for k, name in enumerate(names):
            by_tier[name].result = by_tier[name].result.model_copy(update=_chain_facts(chain, k))


def certify_routed(fits: dict[str, dict[str, Fit]], alone: dict[str, dict[str, QuestionTier]],
                   routed: Sequence[str], target: float, delta: float) -> None:
    """After a payoff took a tier out of a certified chain, in place: the tiers that stay get their
    own results back (``alone``: each fit's result before ``certify_chains``) and are certified
    again as the chain they now are. With three or more cheap tiers the items the removed tier kept
    go to the next cheap tier, not to the teacher, so the old chain's certificate says nothing about
    them; a question one tier answers now keeps that tier's own certificate."""
    for qid, by_tier in fits.items():
        for name in routed:
            if name in by_tier:
                by_tier[name].result = alone[qid][name]
    certify_chains(fits, routed, target, delta)


def _chain_facts(chain: ChainResult, k: int) -> dict[str, object]:
    """One tier's facts under the chain's certificate: its threshold and share, the system's bound."""
    return {"threshold": chain.thresholds[k], "kept_share": chain.kept[k], "agreement": chain.agreement,
            "agreement_kept": None, "lower_bound": chain.lower_bound, "reachable": chain.reachable,
            "message": chain.message(), "method": CHAIN_METHOD, "target": chain.target, "delta": chain.delta,
            "n_threshold": chain.n_test}
