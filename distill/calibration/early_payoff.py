"""Taking out a middle tier that cannot pay before it has scored every calibration state.

Scoring a small GGUF tier on every calibration state is most of a calibration's time (the demo's
gemma-3-270m: 106 s of about 145), and ``payoff`` may then take that tier out for costing more
than it saves, so the time was spent measuring a tier that is thrown away. Here the tier is first
scored on a seeded sample of the states that reach it past the tiers below, and what it could
save is estimated generously: per question, the most confident answers of the sample, as many as
its wrong answers do not contradict the tier's target (a one-sided binomial test), which is more
than a certificate keeps. The tier is taken out without scoring the rest only where it costs more than
MARGIN times that estimate; otherwise it is scored on every state and weighed by ``payoff`` as
before. Taking a tier out only sends more to the teacher, and the thresholds are then certified
on the tiers that stay, so the certificate is untouched either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import binom

from cascade.bundle.sections import TierPayoff
from cascade.cost.pricing import TierPricing
from cascade.hashing import seeded_unit
from cascade.questions import Question
from cascade.readout.prompts import render_state
from cascade.thresholds import CERTIFIED_SCORE, threshold_score
from cascade.tiers.base import Item, Tier, TierSpec
from distill.calibration.fits import fit_all, keeps
from distill.calibration.inputs import Labels
from distill.calibration.payoff import Fits, top_seconds
from distill.calibration.results import TierCost
from distill.calibration.scoring import Probabilities, score_tier

SAMPLE_STATES = 48
"""States the tier reads before it is judged: at the demo's 0.44 s a state, about 20 s."""
SAMPLE_SALT = "cascade-payoff-sample-v1"
MARGIN = 2.0
"""The tier is taken out early only where it costs more than twice the most it could save."""
DOUBT = 0.05
"""How unlikely the sample's wrong answers must be at the target before they bound what is kept."""


@dataclass(frozen=True)
class Judge:
    """What a middle tier is judged early by: the per-tier target and delta its thresholds are
    certified at, and the top tier's pricing (the seconds it would save), got when first needed
    (timing a local teacher takes a while)."""

    target: float
    delta: float
    top: Callable[[], TierPricing]


@dataclass
class Scored:
    """The cheap tiers scored: ``names`` and ``probs`` of those scored on every state (cheapest
    first), the cost of each (a tier taken out early: on its sample), and the early payoffs."""

    names: list[str] = field(default_factory=list)
    probs: list[Probabilities] = field(default_factory=list)
    costs: dict[str, TierCost] = field(default_factory=dict)
    early: dict[str, TierPayoff] = field(default_factory=dict)


def score_cheap(tiers: Sequence[Tier], specs: Sequence[TierSpec], items: list[Item], labels: Labels,
                questions: Mapping[str, Question], progress: bool, judge: Judge | None) -> Scored:
    """Score every cheap tier on ``items``, cheapest first; with ``judge``, a tier above the first
    is read on a seeded sample of the states that reach it first, and taken out there where it
    cannot pay (``judged_early``). A tier that might pay is then scored on every state (its
    sample again among them: the batches the cost is fitted on stay whole)."""
    scored = Scored()
    for tier, spec in zip(tiers, specs, strict=True):
        if judge is not None and scored.names:
            payoff = _judged(tier, spec, scored, items, labels, questions, progress, judge)
            if payoff is not None:
                scored.early[spec.name] = payoff
                continue
        probs, cost = score_tier(tier, spec.kind, items, labels, questions, progress)
        scored.names.append(spec.name)
        scored.probs.append(probs)
        scored.costs[spec.name] = cost
    return scored


def _judged(tier: Tier, spec: TierSpec, scored: Scored, items: list[Item], labels: Labels,
            questions: Mapping[str, Question], progress: bool, judge: Judge) -> TierPayoff | None:
    """The early payoff of one middle tier, or None (it might pay, or too few states reach it
    for a sample to save time)."""
    fits, _ = fit_all(scored.names, scored.probs, labels, list(questions), judge.target, judge.delta, None)
    reached = reaching(items, fits, scored.names, labels)
    if len(reached) <= 2 * SAMPLE_STATES:
        return None
    sample = reached[:SAMPLE_STATES]
    probs, cost = score_tier(tier, spec.kind, sample, labels, questions, progress)
    payoff = judged_early(sample, len(reached), probs, cost, (fits, scored.names), labels, judge.target,
                          judge.top(), questions)
    if payoff is not None:
        scored.costs[spec.name] = cost
    return payoff


def reaching(items: Sequence[Item], fits: Fits, below: Sequence[str], labels: Labels) -> list[Item]:
    """The states some labelled question of which no tier of ``below`` keeps, in a seeded order
    (a hash of the id), so that the sample is their first ``SAMPLE_STATES`` and the same on
    every run."""
    def reaches(item: Item) -> bool:
        return any(item.id in rows and not any(keeps(fits.get(qid, {}).get(t), item.id) for t in below)
                   for qid, rows in labels.items())
    found = [item for item in items if reaches(item)]
    return sorted(found, key=lambda item: seeded_unit(SAMPLE_SALT, item.id, "\0"))


def judged_early(sample: Sequence[Item], reached: int, probs: Probabilities, cost: TierCost,
                 below: tuple[Fits, Sequence[str]], labels: Labels, target: float, top: TierPricing,
                 questions: Mapping[str, Question]) -> TierPayoff | None:
    """The payoff of a tier taken out on ``sample`` (of ``reached`` states that reach it past
    ``below``: the fits of the tiers under it, and their names), or None where it might pay and
    must be scored on every state."""
    kept = {qid: _most_kept(rows, labels[qid], target) for qid, rows in probs.items()}
    fits, tiers = below
    saved, resolved = 0.0, 0
    for item in sample:
        reach = [qid for qid in questions if item.id in labels.get(qid, {})
                 and not any(keeps(fits.get(qid, {}).get(t), item.id) for t in tiers)]
        left = [qid for qid in reach if item.id not in kept.get(qid, set())]
        saved += top_seconds(top, render_state(item.state), reach, questions) - top_seconds(
            top, render_state(item.state), left, questions)
        resolved += bool(reach) and not left
    per_state = cost.seconds / max(cost.states, 1)
    scale = reached / max(len(sample), 1)  # the sample's figures, for every state that reaches it
    spent, could_save = reached * per_state, saved * scale
    if spent <= MARGIN * could_save:
        return None
    reason = (f"taken out of the cascade before scoring every state: on a seeded sample of {len(sample)} "
              f"of the {reached} calibration states that reach it, it costs {per_state:.3g} s a state, "
              f"{spent:.3g} s on all of them, and could save the top tier at most about {could_save:.3g} s "
              f"(keeping the most confident answers the sample does not contradict at the target), under "
              f"1/{MARGIN:g} of its cost; keep it with --keep-costly-tiers")
    return TierPayoff(states_reached=reached, states_resolved=round(resolved * scale),
                      seconds_cost=spent, seconds_saved=could_save, scored_states=cost.states, kept=False,
                      reason=reason)


def _most_kept(rows: Mapping[str, np.ndarray], teacher: Mapping[str, int], target: float) -> set[str]:
    """The ids a threshold could keep at most: the most confident ones, as many as the sample
    does not contradict (the wrong answers among the first k are not significantly more than
    (1 - target) x k: one-sided binomial at ``DOUBT``). Generous on purpose: on 48 states a
    strict plug-in keeps nothing after one early disagreement, and would take out tiers that
    pay (bench/early_payoff.py)."""
    ids = [i for i in rows if i in teacher]
    if not ids:
        return set()
    stacked = np.stack([rows[i] for i in ids])
    score = threshold_score(stacked, CERTIFIED_SCORE)
    agree = stacked.argmax(axis=1) == np.asarray([teacher[i] for i in ids])
    order = np.argsort(-score, kind="stable")
    wrong = np.cumsum(~agree[order])
    plausible = binom.sf(wrong - 1, np.arange(1, len(ids) + 1), 1 - target) >= DOUBT
    good = np.flatnonzero(plausible)
    return {ids[j] for j in order[: good[-1] + 1]} if good.size else set()
