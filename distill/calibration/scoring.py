"""Running a cheap tier on the calibration items: its raw probabilities, timed, and its cost fitted.

The seconds are those spent inside the tier's ``reply``, batch by batch, and are split into
seconds per state and per token the way the router's cost model adds them up
(``cascade.cost.pricing``), so that the costs a budget is charged are the ones measured here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls
from tqdm import tqdm

from cascade.questions import Question
from cascade.readout.placement import say_once
from cascade.readout.prompts import render_state
from cascade.tiers.base import Answers, Asked, Item, Reply, Tier
from distill.calibration.inputs import Labels
from distill.calibration.results import InputCounts, TierCost

Probabilities = dict[str, dict[str, np.ndarray]]
"""question id -> item id -> raw probabilities (option_keys order) from one tier."""


@dataclass(frozen=True)
class _Batch:
    states: int
    tokens: int
    seconds: float


def score_tier(
    tier: Tier,
    kind: str,
    items: list[Item],
    labels: Labels,
    questions: Mapping[str, Question],
    progress: bool,
) -> tuple[Probabilities, TierCost]:
    """Raw probabilities of one cheap tier for every labelled question it answers, and its cost.

    A tier that batches (the encoder) runs in batches of similar length, as it would batch them
    itself (batches of different token totals are what splits its cost into per state and per
    token); the others run one state at a time. One warm-up state first keeps first-call setup
    out. Tokens are the ones the tier reports running (a readout counts its decoded tokens),
    else its count of each state's text.

    A batch-sensitive tier (a readout) is asked every question of the bundle it answers about
    each state, in the bundle's order, whatever was labelled: the router asks a GGUF middle tier
    exactly that batch (``Cascade._shape``), and a fan-out's numbers move with the batch decoded
    together, so this is what makes the thresholds certify the numbers routing reads. Only the
    labelled answers are kept.

    A state the tier leaves to the tiers above (the encoder's gate found it unfamiliar, or its
    prompt is longer than a GGUF tier's context) has no answer here, as routing keeps none: the
    thresholds certify what routing can keep, and the replay and payoffs count the state as sent
    up.
    """
    answered = [qid for qid in questions if tier.can_answer(qid)]
    asked_all = [[qid for qid in answered if item.id in labels[qid]] for item in items]
    used = [(item, answered if tier.batch_sensitive else qids)
            for item, qids in zip(items, asked_all, strict=True) if qids]
    counts: list[int] = []
    if not tier.meters_tokens:
        counts = tier.count_tokens([render_state(item.state) for item, _ in used])
        used = [used[i] for i in np.argsort(counts, kind="stable")]
        counts = sorted(counts)
    states, asked = [item for item, _ in used], [qids for _, qids in used]
    tier.answer(states[:1], asked[:1], questions)
    answers, batches, replies = _timed_answers(tier, states, asked, questions, progress, counts)
    cost = _tier_cost(tier.name, kind, batches)
    cost.inputs = _input_counts(states, replies, labels)
    return _by_question(states, answers, labels), cost


def _input_counts(items: list[Item], replies: list[Reply], labels: Labels) -> dict[str, InputCounts]:
    """Per labelled question, how the tier read its states (each reply covers one batch)."""
    flags = [(unfamiliar, cut is not None, too_long is not None) for reply in replies
             for unfamiliar, cut, too_long in zip(reply.unfamiliar, reply.cuts, reply.too_long, strict=True)]
    counts: dict[str, InputCounts] = {}
    for item, (unfamiliar, cut, too_long) in zip(items, flags, strict=True):
        for qid, rows in labels.items():
            if item.id in rows:
                c = counts.setdefault(qid, InputCounts())
                c.states, c.unfamiliar = c.states + 1, c.unfamiliar + unfamiliar
                c.cut, c.too_long = c.cut + cut, c.too_long + too_long
    return counts


def _timed_answers(
    tier: Tier,
    items: list[Item],
    asked: Asked,
    questions: Mapping[str, Question],
    progress: bool,
    counts: list[int],
) -> tuple[Answers, list[_Batch], list[Reply]]:
    """The tier's answers batch by batch, with the seconds spent inside ``reply`` for each and
    the tokens it ran (as it reports them, or ``counts`` of the states' texts), and the replies."""
    answers: Answers = []
    batches: list[_Batch] = []
    replies: list[Reply] = []
    too_long: list[str] = []
    size = tier.batch_size
    with tqdm(total=len(items), disable=not progress, unit="state", desc=f"tier {tier.name}") as bar:
        for start in range(0, len(items), size):
            rows = slice(start, start + size)
            began = time.perf_counter()
            reply = tier.reply(items[rows], asked[rows], questions)
            seconds = time.perf_counter() - began
            replies.append(reply)
            answers += [{} if strange else answer
                        for answer, strange in zip(reply.answers, reply.unfamiliar, strict=True)]
            too_long += [f"item {item.id!r}: {why}" for item, why in zip(items[rows], reply.too_long,
                                                                          strict=True) if why]
            if tier.meters_tokens:
                tokens = sum(usage.input_tokens for usage in reply.usage)
            else:
                tokens = sum(counts[rows])
            batches.append(_Batch(len(items[rows]), tokens, seconds))
            bar.update(len(items[rows]))
    if too_long:
        say_once(f"tier {tier.name}: {len(too_long)} of {len(items)} calibration states do not fit its "
                 f"context; routing sends them past it, and its thresholds and coverage count only the "
                 f"states it read (first: {too_long[0]})")
    return answers, batches, replies


def _tier_cost(tier: str, kind: str, batches: list[_Batch]) -> TierCost:
    """Split the measured time into seconds per state and per token, as the cost model adds them.

    ``seconds = per_state x states + per_token x tokens``, fitted by non-negative least squares
    over the batches; where the batches cannot separate the two (one batch, or token totals in
    proportion to state counts) all of it is charged per token.
    """
    states = np.asarray([b.states for b in batches], dtype=np.float64)
    tokens = np.asarray([b.tokens for b in batches], dtype=np.float64)
    seconds = np.asarray([b.seconds for b in batches])
    design = np.column_stack([states, tokens])
    if len(batches) >= 2 and np.linalg.matrix_rank(design) == 2:
        per_state, per_token = nnls(design, seconds)[0]
    else:
        per_state, per_token = 0.0, float(seconds.sum() / max(tokens.sum(), 1.0))
    return TierCost(tier=tier, kind=kind, states=int(states.sum()), tokens=int(tokens.sum()),
                    seconds=float(seconds.sum()), batches=len(batches),
                    seconds_per_state=float(per_state), seconds_per_token=float(per_token))


def _by_question(items: list[Item], answers: Answers, labels: Labels) -> Probabilities:
    """The answers by question, only where the teacher's label is there to compare with."""
    probs: Probabilities = {}
    for item, answer in zip(items, answers, strict=True):
        for qid, row in answer.items():
            if item.id in labels[qid]:
                probs.setdefault(qid, {})[item.id] = row
    return probs
