"""Whether a middle tier pays its way (distill.calibration.payoff), on fits made by hand so that
every figure can be worked out on paper."""

from __future__ import annotations

import numpy as np
import pytest

from cascade.cost.pricing import TierCost as PriceCost
from cascade.cost.pricing import TierPricing, estimate_tokens
from cascade.cost.upstream import UpstreamPrice
from cascade.questions import NoulQuestion
from cascade.tiers.base import Item
from distill.calibration.early_payoff import judged_early, reaching
from distill.calibration.fits import Fit
from distill.calibration.payoff import teacher_traffic, tier_payoffs
from distill.calibration.results import QuestionTier, TierCost

QUESTIONS = {"q1": NoulQuestion(type="noul", instructions="First?"),
             "q2": NoulQuestion(type="noul", instructions="Second?")}
ITEMS = [Item(name, f"state {name}") for name in "abc"]


def fit(kept: str) -> Fit:
    """A fit with threshold 0.5 that keeps the answers about the items named in ``kept``."""
    scores = {item.id: (0.9 if item.id in kept else 0.1, True) for item in ITEMS}
    return Fit(result=QuestionTier.model_construct(threshold=0.5), scores=scores)


# a: the encoder keeps both questions; b: it keeps q1, and the middle tier q2 (b never reaches
# the teacher); c: the encoder keeps nothing, the middle tier q1 (c still reaches the teacher).
FITS = {"q1": {"encoder": fit("ab"), "middle": fit("c")},
        "q2": {"encoder": fit("a"), "middle": fit("b")}}
MIDDLE = TierCost(tier="middle", kind="gguf", states=3, tokens=30, seconds=3.0, batches=3,
                  seconds_per_state=1.0, seconds_per_token=0.0)


def top(seconds_per_state: float) -> TierPricing:
    return TierPricing(PriceCost(seconds_per_state, 0.0), estimate_tokens, fanout=True)


@pytest.mark.parametrize(("top_seconds", "kept"), [(10.0, True), (1.5, False)])
def test_a_middle_tier_is_kept_only_where_the_top_tier_work_it_saves_exceeds_its_cost(
    top_seconds: float, kept: bool
) -> None:
    payoffs = tier_payoffs(["encoder", "middle"], FITS, ITEMS, {"middle": MIDDLE}, top(top_seconds),
                           QUESTIONS, keep=False, min_reached=1)
    payoff = payoffs["middle"]
    # b and c reach it, 1 s each; only b is answered whole, saving the teacher's state of b; c
    # still goes up, so keeping its q1 saves only q1's block (0 s at 0 s per token)
    assert (payoff.states_reached, payoff.states_resolved) == (2, 1)
    assert (payoff.seconds_cost, payoff.seconds_saved) == (2.0, top_seconds)
    assert payoff.kept is kept
    assert payoff.reason.startswith("kept: " if kept else "taken out of the cascade: ")
    assert "2 calibration states that reached it" in payoff.reason


def test_the_block_of_each_question_kept_counts_where_the_state_still_escalates() -> None:
    per_token = TierPricing(PriceCost(0.0, 1.0), estimate_tokens, fanout=True)
    payoff = tier_payoffs(["encoder", "middle"], FITS, ITEMS, {"middle": MIDDLE}, per_token, QUESTIONS,
                          keep=False, min_reached=1)["middle"]
    prompt = per_token.prompt_tokens("state b")
    block = {qid: per_token.suffix_tokens(qid, question) for qid, question in QUESTIONS.items()}
    assert payoff.seconds_saved == pytest.approx(prompt + block["q2"] + block["q1"])


def test_only_tiers_above_the_first_are_judged_and_kept_when_asked() -> None:
    payoffs = tier_payoffs(["encoder", "middle"], FITS, ITEMS, {"middle": MIDDLE}, top(0.1), QUESTIONS,
                           keep=True)
    assert set(payoffs) == {"middle"}
    assert payoffs["middle"].kept and payoffs["middle"].reason.startswith("kept as asked")


def test_a_tier_too_few_states_reach_is_weighed_on_every_state_it_read_not_taken_out_on_nothing() -> None:
    # the encoder keeps every question of every item: no state reaches the middle tier, which
    # read all three; as if each reached it, it answers q1 of c and q2 of b (1 s each, 3 s in all)
    fits = {"q1": {"encoder": fit("abc"), "middle": fit("c")},
            "q2": {"encoder": fit("abc"), "middle": fit("b")}}
    payoff = tier_payoffs(["encoder", "middle"], fits, ITEMS, {"middle": MIDDLE}, top(10.0), QUESTIONS,
                          keep=False)["middle"]
    assert payoff.states_reached == 0 and payoff.seconds_cost == 3.0
    assert payoff.seconds_saved == 0.0 and not payoff.kept  # it never answers a whole state
    assert "only 0 calibration states reached it (fewer than 20)" in payoff.reason
    assert "weighed on all 3 it read" in payoff.reason
    tier = {qid: {"encoder": fit("abc"), "middle": fit("abc")} for qid in QUESTIONS}
    kept = tier_payoffs(["encoder", "middle"], tier, ITEMS, {"middle": MIDDLE}, top(10.0), QUESTIONS,
                        keep=False)["middle"]
    assert kept.kept and kept.seconds_saved == 30.0 and kept.states_resolved == 3


@pytest.mark.parametrize(("top_seconds", "calls", "sent"), [(10.0, 1, 1), (1.5, 2, 3)])
def test_the_teacher_is_sent_one_call_per_item_with_a_question_left_holding_only_those(
        top_seconds: float, calls: int, sent: int) -> None:
    payoffs = tier_payoffs(["encoder", "middle"], FITS, ITEMS, {"middle": MIDDLE}, top(top_seconds),
                           QUESTIONS, keep=False, min_reached=1)
    traffic = teacher_traffic(["encoder", "middle"], FITS, payoffs)
    # the middle tier kept: only c's q2 goes up; taken out: b's q2 and c's q1 and q2
    assert (traffic.items, traffic.asked, traffic.calls, traffic.sent) == (3, 6, calls, sent)
    price = UpstreamPrice(per_request=0.01, per_question=0.001, unit="EUR")
    spent, saved = traffic.spent_and_saved(price)
    assert spent == pytest.approx(calls * 0.01 + sent * 0.001)
    assert spent + saved == pytest.approx(3 * 0.01 + 6 * 0.001)
    assert traffic.line(price).endswith(f"{spent:.4g} EUR spent, {saved:.4g} EUR saved")
    assert f"{calls} calls for 3 items ({1 - calls / 3:.1%} saved)" in traffic.line()


# Judged early (distill.calibration.early_payoff): four sampled states w, x, y, z of 40 that reach
# the tier; on q1 its margins are 0.9, 0.8, 0.6, 0.2, and it agrees with the teacher on w only.
# At target 0.9, the most confident k answers with their wrong count: 1 with 0, 2 with 1 (P(X >= 1)
# = 0.19 at p = 0.1: not a contradiction), 3 with 2 (0.028) and 4 with 3 (0.0037) contradict it. So
# at most w and x are kept, saving the teacher's state of each (10 s): 20 s on the sample, 200 s
# on all 40.
SAMPLE = [Item(name, f"state {name}") for name in "wxyz"]
SAMPLED = {"q1": {"w": np.array([0.95, 0.05]), "x": np.array([0.9, 0.1]), "y": np.array([0.8, 0.2]),
                  "z": np.array([0.6, 0.4])}}
TEACHER = {"q1": {"w": 0, "x": 1, "y": 1, "z": 1}}


@pytest.mark.parametrize(("per_state", "taken_out"), [(6.0, False), (11.0, True)])
def test_a_middle_tier_is_taken_out_on_a_sample_only_where_it_costs_over_twice_what_it_could_save(
    per_state: float, taken_out: bool
) -> None:
    cost = TierCost(tier="middle", kind="gguf", states=4, tokens=40, seconds=4 * per_state, batches=4,
                    seconds_per_state=per_state, seconds_per_token=0.0)
    payoff = judged_early(SAMPLE, 40, SAMPLED, cost, ({}, []), TEACHER, 0.9, top(10.0),
                          {"q1": QUESTIONS["q1"]})
    if not taken_out:  # 240 s against at most 200 saved: it might pay, so it is scored on every state
        assert payoff is None
        return
    assert payoff is not None and not payoff.kept
    assert (payoff.states_reached, payoff.scored_states) == (40, 4)
    assert payoff.states_resolved == 20  # w and x answered whole: 2 of the 4 sampled, so 20 of 40
    assert (payoff.seconds_cost, payoff.seconds_saved) == (pytest.approx(440.0), pytest.approx(200.0))
    assert payoff.reason.startswith("taken out of the cascade before scoring every state: on a seeded "
                                    "sample of 4 of the 40 calibration states that reach it")


def test_a_question_the_tiers_below_keep_saves_nothing_on_the_sample() -> None:
    below = {"q1": {"encoder": Fit(result=QuestionTier.model_construct(threshold=0.5),
                                   scores={i: (0.9, True) for i in "wxyz"})}}
    cost = TierCost(tier="middle", kind="gguf", states=4, tokens=40, seconds=0.4, batches=4,
                    seconds_per_state=0.1, seconds_per_token=0.0)
    payoff = judged_early(SAMPLE, 40, SAMPLED, cost, (below, ["encoder"]), TEACHER, 0.9, top(10.0),
                          {"q1": QUESTIONS["q1"]})
    assert payoff is not None and payoff.seconds_saved == 0.0  # 4 s against nothing it could save


def test_the_states_sampled_are_those_reaching_the_tier_in_an_order_set_by_their_ids() -> None:
    labels = {qid: dict.fromkeys("abc", 0) for qid in QUESTIONS}
    found = reaching(ITEMS, FITS, ["encoder"], labels)
    assert {item.id for item in found} == {"b", "c"}  # the encoder keeps both questions of a
    assert [item.id for item in reaching(list(reversed(ITEMS)), FITS, ["encoder"], labels)] == [
        item.id for item in found]
    assert {item.id for item in reaching(ITEMS, FITS, [], labels)} == {"a", "b", "c"}  # none below
