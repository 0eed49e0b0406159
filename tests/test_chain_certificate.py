"""The certificates of issue 34 on plain arrays: one for a chain of cheap tiers
(``distill.calibration.joint``), and those for served traffic (``distill.calibration.traffic``).

Validity is checked by simulation where the truth is known: tiers whose answers agree with the
teacher with a known probability at each score, so every threshold's true agreement is exact.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import binom

from distill.calibration.fits import Fit, in_temperature_part
from distill.calibration.joint import (
    CHAIN_METHOD,
    certify_chains,
    certify_routed,
    chain_thresholds,
    equal_disagreement_path,
)
from distill.calibration.maths import CalibrationError, threshold_for_agreement
from distill.calibration.results import QuestionTier
from distill.calibration.traffic import Window, stratified_pvalue, traffic_threshold

TARGET, DELTA = 0.9, 0.05


def draw_chain(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two tiers with uniform scores: the first disagrees with probability 0.3 (1 - s), the
    second 0.5 (1 - s) (a weaker tier), independently."""
    scores = rng.random((2, n))
    wrong = rng.random((2, n)) < np.asarray([[0.3], [0.5]]) * (1 - scores)
    return scores, ~wrong


def true_agreement(thresholds: list[float | None]) -> float:
    """1 - P(tier 1 keeps and is wrong) - P(tier 1 does not keep, tier 2 keeps and is wrong), exact."""
    t1, t2 = (np.inf if t is None else t for t in thresholds)
    keep1 = max(0.0, 1 - t1)
    risk1 = 0.3 * (1 - min(t1, 1.0)) ** 2 / 2 if keep1 else 0.0
    risk2 = (1 - keep1) * (0.5 * (1 - min(t2, 1.0)) ** 2 / 2 if t2 < 1 else 0.0)
    return 1 - risk1 - risk2


def test_the_path_lowers_every_threshold_together_and_depends_on_its_part_alone() -> None:
    rng = np.random.default_rng(0)
    scores, correct = draw_chain(600, rng)
    path = rng.random(600) < 0.3
    vectors = equal_disagreement_path(scores[:, path], correct[:, path])
    assert len(vectors) > 2
    assert all(np.all(later <= earlier) for earlier, later in itertools.pairwise(vectors))
    flipped = correct.copy()
    flipped[:, ~path] = ~flipped[:, ~path]  # the tested items' outcomes never move the path
    again = equal_disagreement_path(scores[:, path], flipped[:, path])
    assert all(np.array_equal(a, b) for a, b in zip(vectors, again, strict=True))


def test_the_chain_certificate_holds_on_at_least_1_minus_delta_of_draws() -> None:
    rng = np.random.default_rng(1)
    failures, kept = 0, []
    for _ in range(200):
        scores, correct = draw_chain(800, rng)
        result = chain_thresholds(scores, correct, rng.random(800) < 0.3, TARGET, DELTA)
        failures += true_agreement(result.thresholds) < TARGET
        kept.append(sum(result.kept))
    assert failures <= 200 * DELTA + 3 * np.sqrt(200 * DELTA)  # 10 expected at most, 3 sd of slack
    assert np.mean(kept) > 0.5  # and it keeps something worth having


def test_the_chain_states_what_it_certified() -> None:
    rng = np.random.default_rng(2)
    scores, correct = draw_chain(1000, rng)
    result = chain_thresholds(scores, correct, rng.random(1000) < 0.3, TARGET, DELTA)
    assert result.reachable and result.lower_bound >= TARGET and result.n_path + result.n_test == 1000
    assert "one certificate for the chain" in result.message()
    nothing = chain_thresholds(scores[:, :20], correct[:, :20], np.arange(20) < 6, 0.999, DELTA)
    assert nothing.thresholds == [None, None] and not nothing.reachable
    assert "every cheap tier keeps nothing" in nothing.message()
    with pytest.raises(CalibrationError, match="target must be a number in"):
        chain_thresholds(scores, correct, np.zeros(1000, bool), 1.5, DELTA)


def test_certify_chains_gives_every_tier_of_a_question_the_chains_facts() -> None:
    rng = np.random.default_rng(3)
    scores, correct = draw_chain(400, rng)
    ids = [f"item-{i}" for i in range(400)]

    def fit(k: int) -> Fit:
        return Fit(QuestionTier.model_construct(threshold=0.5, question="q", tier=f"t{k}"),
                   {i: (float(s), bool(c)) for i, s, c in zip(ids, scores[k], correct[k], strict=True)})

    fits = {"q": {"t0": fit(0), "t1": fit(1)}, "alone": {"t0": fit(0)}}
    certify_chains(fits, ["t0", "t1"], TARGET, DELTA)
    first, second = fits["q"]["t0"].result, fits["q"]["t1"].result
    assert first.method == second.method == CHAIN_METHOD
    assert first.lower_bound == second.lower_bound and first.target == TARGET
    assert fits["alone"]["t0"].result.threshold == 0.5  # one tier: its own certificate stands


def test_a_chain_a_payoff_cut_is_certified_again_on_the_tiers_that_stay() -> None:
    rng = np.random.default_rng(5)
    scores, correct = draw_chain(600, rng)
    extra = rng.random(600)  # a third tier, as good as the second
    ids = [f"item-{i}" for i in range(600)]
    middle = (extra, rng.random(600) >= 0.5 * (1 - extra))
    columns = [(scores[0], correct[0]), middle, (scores[1], correct[1])]

    def fit(k: int) -> Fit:
        column, agrees = columns[k]
        return Fit(QuestionTier.model_construct(threshold=0.5 + k / 10, question="q", tier=f"t{k}"),
                   {i: (float(s), bool(c)) for i, s, c in zip(ids, column, agrees, strict=True)})

    fits = {"q": {f"t{k}": fit(k) for k in range(3)}}
    alone = {"q": {name: fit.result for name, fit in fits["q"].items()}}
    certify_chains(fits, ["t0", "t1", "t2"], TARGET, DELTA)
    three = {name: fit.result.threshold for name, fit in fits["q"].items()}
    certify_routed(fits, alone, ["t0", "t2"], TARGET, DELTA)  # the middle tier taken out
    items = sorted(ids)
    again = chain_thresholds(np.asarray([[fits["q"][t].scores[i][0] for i in items] for t in ("t0", "t2")]),
                             np.asarray([[fits["q"][t].scores[i][1] for i in items] for t in ("t0", "t2")]),
                             np.asarray([in_temperature_part(i) for i in items]), TARGET, DELTA)
    assert [fits["q"][t].result.threshold for t in ("t0", "t2")] == again.thresholds
    assert fits["q"]["t1"].result.threshold == three["t1"]  # the tier taken out keeps its record
    certify_routed(fits, alone, ["t0"], TARGET, DELTA)  # one tier left: its own certificate again
    assert fits["q"]["t0"].result == alone["q"]["t0"]


def test_the_stratified_test_on_a_census_alone_is_the_exact_binomial_one() -> None:
    rng = np.random.default_rng(4)
    score = rng.random(700)
    correct = rng.random(700) < 0.8 + 0.2 * score
    every = np.ones(700, bool)
    result = traffic_threshold(score, correct, every, every, Window(700, 0, 0.02), TARGET, DELTA)
    assert result.threshold == threshold_for_agreement(score, correct, TARGET, DELTA).threshold


@pytest.mark.parametrize("split", [0.0, 0.5, 1.0])
def test_the_stratified_p_value_is_valid_wherever_the_disagreements_hide(split: float) -> None:
    """At agreement exactly 1 - alpha, with the disagreements split between escalated and kept
    items in any proportion, the p-value is at most delta with probability at most delta."""
    rng = np.random.default_rng(5)
    window, alpha = Window(census=150, served=600, audit_share=0.2), 0.05
    b = split * alpha
    draws = 300
    census = rng.binomial(window.census, alpha, draws)
    cells = rng.multinomial(window.served, [alpha - b, b * window.audit_share,
                                            1 - alpha + b - b * window.audit_share], draws)
    rejected = sum(stratified_pvalue(int(c + e), int(k), window, alpha) <= DELTA
                   for c, (e, k, _) in zip(census, cells, strict=True))
    assert rejected <= draws * DELTA + 3 * np.sqrt(draws * DELTA)


def test_the_stratified_p_value_spends_escalated_and_audited_disagreements_differently() -> None:
    window = Window(census=0, served=2000, audit_share=0.1)
    base = stratified_pvalue(2, 0, window, 0.02)
    assert stratified_pvalue(3, 0, window, 0.02) >= base  # one more escalated disagreement
    assert stratified_pvalue(2, 1, window, 0.02) >= stratified_pvalue(3, 0, window, 0.02)
    # with nothing kept hidden (b = 0) the count is binomial: the p-value is at least that
    assert base >= float(binom.cdf(2, 2000, 0.02)) - 1e-12


def test_traffic_methods_refuse_what_they_cannot_read() -> None:
    score, flags = np.ones(3), np.ones(3, bool)
    with pytest.raises(CalibrationError, match="method must be one of"):
        traffic_threshold(score, flags, flags, flags, Window(3, 0, 0.1), TARGET, DELTA, "guess")  # type: ignore[arg-type]
    with pytest.raises(CalibrationError, match="every item labelled always or drawn uniformly"):
        traffic_threshold(score, flags, ~flags, ~flags, Window(3, 0, 0.1), TARGET, DELTA)
    with pytest.raises(CalibrationError, match="audit_share must be in"):
        Window(3, 1, 0.0)
