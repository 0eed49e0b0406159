"""The promotion gate's rule (``distill.loop.gate``) on data small enough to check by hand, and on
draws where the better bundle is known; the gate run on real bundles is in tests/test_retrain.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distill.calibration.maths import threshold_for_agreement
from distill.loop.gate import (
    Question,
    attempt_delta,
    band,
    certificate_delta,
    chain_ranks,
    compare,
    plugin_share,
)


def test_the_plug_in_share_stops_before_the_disagreement_that_breaks_the_target() -> None:
    scores = np.asarray([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    correct = np.asarray([True, True, False, True, True, False, True, True, True, True])
    assert plugin_share(scores, correct, 0.9) == pytest.approx(0.5)  # 1 wrong of 10 allowed; the 2nd at 0.4
    assert plugin_share(scores, correct, 0.95) == pytest.approx(0.2)  # none allowed: stop before 0.7
    tied = np.asarray([0.9, 0.8, 0.7, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    assert plugin_share(tied, correct, 0.95) == pytest.approx(0.2)  # a tie is kept or escalated whole
    assert plugin_share(np.full(10, np.nan), correct, 0.9) == 0.0  # never answered: nothing kept


def draw(rng: np.random.Generator, n: int, slope: float) -> Question:
    """A bundle whose answers disagree with probability slope x (1 - score)^2."""
    scores = rng.random(n)
    return Question(np.arange(n), scores, rng.random(n) >= slope * (1 - scores) ** 2)


def test_a_tie_never_promotes_and_a_clearly_better_candidate_does() -> None:
    rng = np.random.default_rng(0)
    same = draw(rng, 1000, 0.3)
    tie = compare([same], [same], 1000, (0.98,))
    assert tie.difference == 0 and tie.lower_bound == 0 and not tie.promotes
    better = compare([draw(rng, 1000, 0.6)], [draw(rng, 1000, 0.1)], 1000, (0.98,))
    assert better.promotes and better.candidate_share > better.serving_share
    worse = compare([draw(rng, 1000, 0.1)], [draw(rng, 1000, 0.6)], 1000, (0.98,))
    assert not worse.promotes and worse.lower_bound < 0


def test_the_comparison_is_paired_on_the_items_and_seeded() -> None:
    rng = np.random.default_rng(1)
    serving, candidate = draw(rng, 500, 0.3), draw(rng, 500, 0.2)
    once, again = (compare([serving], [candidate], 500, (0.95,), seed=7) for _ in range(2))
    assert once == again
    shuffled = rng.permutation(500)  # the same evidence, the items listed in another order
    moved = [Question(np.argsort(shuffled)[q.items], q.scores, q.correct) for q in (serving, candidate)]
    assert compare([moved[0]], [moved[1]], 500, (0.95,), seed=7).difference == pytest.approx(once.difference)


def test_the_band_ends_where_the_certificate_on_the_certifying_items_stops() -> None:
    level = certificate_delta(0.05, 1)
    targets = band(0.98, 1000, level)
    assert targets[0] == 0.98 and len(targets) == 5 and list(targets) == sorted(targets)
    assert targets[-1] == pytest.approx(0.99)  # 10 disagreements of 1,000 still certify at this level, 11 not
    rng = np.random.default_rng(3)
    for slope in (0.1, 0.3, 0.6):
        q = draw(rng, 1000, slope)
        certified = threshold_for_agreement(q.scores, q.correct, 0.98, level).kept_share
        assert plugin_share(q.scores, q.correct, targets[-1]) == pytest.approx(certified)
    assert band(0.98, 100, level) == (0.98, 0.985, 0.99, 0.995, 1.0)  # too few items: nothing may disagree
    with pytest.raises(ValueError, match="band needs"):
        band(0.98, 0, level)


def test_a_candidate_that_ranks_better_only_at_the_top_is_promoted_over_the_band_not_at_the_target() -> None:
    n = 1000
    scores = np.linspace(1, 0, n, endpoint=False)

    def bundle(wrong_at_top: np.ndarray) -> Question:
        correct = np.ones(n, dtype=bool)
        correct[wrong_at_top] = False
        correct[800::5] = False  # both: the 21st disagreement at item 800, hard items below it
        return Question(np.arange(n), scores, correct)

    serving = bundle(np.arange(20, 800, 39)[:20])  # 20 disagreements spread over the top 800
    candidate = bundle(np.arange(600, 800, 10))  # as many, all under the top 600
    targets = band(0.98, n, certificate_delta(0.05, 1))
    at_target = compare([serving], [candidate], n, (0.98,))
    assert at_target.difference == 0 and not at_target.promotes  # both keep 80% at 0.98
    over_band = compare([serving], [candidate], n, targets)
    assert over_band.promotes and over_band.targets == targets
    assert not compare([candidate], [serving], n, targets).promotes
    with pytest.raises(ValueError, match="at least one target"):
        compare([serving], [candidate], n, ())


def test_every_attempt_spends_its_share_of_delta_and_the_shares_sum_to_delta() -> None:
    assert attempt_delta(0.05, 1) == pytest.approx(0.05 * 6 / math.pi ** 2)
    assert certificate_delta(0.05, 2) == pytest.approx(attempt_delta(0.05, 2) / 2)
    assert sum(attempt_delta(0.05, k) for k in range(1, 100_000)) == pytest.approx(0.05, rel=1e-4)
    with pytest.raises(ValueError, match="attempt must be"):
        attempt_delta(0.05, 0)


def test_every_certificate_a_bundle_serves_between_promotions_holds_together_within_081_delta() -> None:
    # the union bound behind a refresh (distill.loop.promote): its promotion's certificate, at most
    # half a first attempt's share, and every later gate's certificate of it, half of each attempt's
    promoted = max(certificate_delta(0.05, k) for k in range(1, 10))
    gates = sum(certificate_delta(0.05, k) for k in range(1, 100_000))
    assert promoted == certificate_delta(0.05, 1) == pytest.approx(0.30 * 0.05, rel=0.02)
    assert promoted + gates == pytest.approx(0.81 * 0.05, rel=0.01) and promoted + gates < 0.05


def test_a_chain_is_ranked_by_when_its_path_first_keeps_an_item() -> None:
    one = np.asarray([[0.9, 0.1, 0.5]])
    rank, agrees = chain_ranks(one, np.asarray([[True, False, True]]))
    assert np.array_equal(rank, one[0]) and agrees.tolist() == [True, False, True]
    rng = np.random.default_rng(2)
    scores = rng.random((2, 300))
    scores[1, :10] = np.nan  # the second tier gives no answer there
    correct = rng.random((2, 300)) > 0.2 * (1 - scores)
    rank, agrees = chain_ranks(scores, correct)
    assert np.isfinite(rank).sum() >= 290 and rank.shape == agrees.shape == (300,)
    top = int(np.nanargmax(rank))  # the first item kept is kept by the tier whose score is highest there
    keeper = int(np.nanargmax(scores[:, top] - np.nanmax(scores, axis=1)))
    assert agrees[top] == correct[keeper, top] or np.isnan(scores[keeper, top])
