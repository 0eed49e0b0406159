"""Whether each cheap tier above the first pays its way: its cost against the top tier's work it saves.

On the calibration items, with the new thresholds, a middle tier (a small GGUF between the encoder
and the teacher) costs its measured seconds on every state that reaches it and saves the teacher
the questions it keeps; where too few states reach it to say (MIN_REACHED), it is weighed on every
state it read, figures that exist, rather than taken out on none. One that costs more is taken
out of the cascade unless the caller keeps it; that only sends more to the teacher, so the
certificate still holds. ``teacher_traffic`` counts, with the tiers kept, what a teacher behind
a URL would be sent. See docs/distilling.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cascade.bundle.sections import TierPayoff
from cascade.cost.pricing import TierPricing
from cascade.questions import Question
from cascade.readout.prompts import render_state
from cascade.tiers.base import Item
from distill.calibration.fits import Fit, keeps
from distill.calibration.results import TierCost
from distill.calibration.teacher_traffic import TeacherTraffic

Fits = Mapping[str, Mapping[str, Fit]]
"""question id -> tier -> fit, as ``fit_all`` returns them."""
MIN_REACHED = 20
"""Fewest calibration states reaching a tier for its payoff to be weighed on them alone: with
none, it would be taken out on "costs 0 s, saves 0 s", though it answers escalations in use."""


def tier_payoffs(tiers: Sequence[str], fits: Fits, items: Sequence[Item], costs: Mapping[str, TierCost],
                 top: TierPricing, questions: Mapping[str, Question], keep: bool,
                 min_reached: int = MIN_REACHED) -> dict[str, TierPayoff]:
    """The payoff of every cheap tier after the first, cheapest first; a tier taken out is absent
    from the tiers below the next one. ``keep``: record the figures but take nothing out;
    ``min_reached``: fewest states reaching a tier for them alone to weigh it."""
    texts = {item.id: render_state(item.state) for item in items}
    payoffs: dict[str, TierPayoff] = {}
    for k, tier in enumerate(tiers[1:], start=1):
        below = [name for name in tiers[:k] if payoffs.get(name) is None or payoffs[name].kept]
        payoffs[tier] = _payoff(tier, below, fits, texts, costs[tier], top, questions, keep, min_reached)
    return payoffs


def _payoff(tier: str, below: list[str], fits: Fits, texts: Mapping[str, str], cost: TierCost,
            top: TierPricing, questions: Mapping[str, Question], keep: bool, min_reached: int) -> TierPayoff:
    """The tier weighed on the calibration states that reach it; where fewer than ``min_reached``
    do, on every state it read, as if each reached it (those figures exist: it was run on all)."""
    per_state = cost.seconds / max(cost.states, 1)
    reached, resolved, saved = _weigh(tier, below, fits, texts, top, questions)
    basis = f"on {reached} calibration states that reached it"
    if reached < min_reached:
        read, resolved, saved = _weigh(tier, [], fits, texts, top, questions)
        basis = (f"only {reached} calibration states reached it (fewer than {min_reached}), so it is "
                 f"weighed on all {read} it read, as if each reached it: on those")
        spent = read * per_state
    else:
        spent = reached * per_state
    pays = saved > spent
    words = (f"{basis}, it costs {spent:.3g} s and saves the top tier {saved:.3g} s (it answered every "
             f"question of {resolved} of them)")
    reason = (f"kept: {words}" if pays else
              f"kept as asked, though it costs more than it saves: {words}" if keep else
              f"taken out of the cascade: {words}; keep it with --keep-costly-tiers")
    return TierPayoff(states_reached=reached, states_resolved=resolved, seconds_cost=spent,
                      seconds_saved=saved, scored_states=cost.states, kept=pays or keep, reason=reason)


def _weigh(tier: str, below: list[str], fits: Fits, texts: Mapping[str, str], top: TierPricing,
           questions: Mapping[str, Question]) -> tuple[int, int, float]:
    """States that reach ``tier`` past ``below``, those it answers whole, the top tier's seconds saved."""
    reached = resolved = 0
    saved = 0.0
    for item, labelled in _labelled(fits).items():
        reach = [q for q in labelled if not any(keeps(fits[q].get(t), item) for t in below)]
        if not reach:
            continue
        escalated = [q for q in reach if not keeps(fits[q].get(tier), item)]
        reached += 1
        resolved += not escalated
        saved += top_seconds(top, texts[item], reach, questions) - top_seconds(
            top, texts[item], escalated, questions)
    return reached, resolved, saved


def teacher_traffic(tiers: Sequence[str], fits: Fits, payoffs: Mapping[str, TierPayoff]) -> TeacherTraffic:
    """On the certifying items, with the cheap tiers the payoffs kept: the calls a teacher behind a
    URL gets (one per item with any question left, holding only those) and the questions sent."""
    kept = [tier for tier in tiers if tier not in payoffs or payoffs[tier].kept]
    items = asked = calls = sent = 0
    for item, labelled in _labelled(fits).items():
        left = [q for q in labelled if not any(keeps(fits[q].get(t), item) for t in kept)]
        items, asked, calls, sent = items + 1, asked + len(labelled), calls + bool(left), sent + len(left)
    return TeacherTraffic(items=items, asked=asked, calls=calls, sent=sent)


def _labelled(fits: Fits) -> dict[str, list[str]]:
    """Threshold-part item -> the questions calibrated on it, in the bundle's order."""
    out: dict[str, list[str]] = {}
    for qid, by_tier in fits.items():
        for item in set().union(*(fit.scores for fit in by_tier.values())):
            out.setdefault(item, []).append(qid)
    return out


def top_seconds(top: TierPricing, text: str, qids: Sequence[str],
                 questions: Mapping[str, Question]) -> float:
    """Predicted seconds of the top tier answering ``qids`` about one state (0 for none)."""
    if not qids:
        return 0.0
    tokens = top.prompt_tokens(text) + sum(top.suffix_tokens(q, questions[q]) for q in qids)
    return top.cost.seconds_per_state + tokens * top.cost.seconds_per_token
