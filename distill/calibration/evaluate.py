"""Replay a bundle's cascade on its held-out evaluation items and measure what it delivers.

Thresholds were chosen on the calibration part and the heads fitted on the train part, so only
the "evaluation" part says how the cascade does on new items: how often its answers agree with
the teacher's (argmax equal), which tier answered what, and what it costs against the teacher
answering everything. Escalations are answered from the label store (the teacher's recorded
answers), so a replay runs no teacher and agrees with it on every escalated question by design.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel
from tqdm import tqdm

from cascade.answers import Answer, DecisionResponse, Routing
from cascade.bundle.manifest import Bundle, Manifest
from cascade.checks import is_int
from cascade.corpus import CorpusItem
from cascade.cost.upstream import UpstreamPrice
from cascade.errors import CascadeError
from cascade.routing.budget import Budget
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from distill.calibration.teacher_traffic import TeacherTraffic
from distill.options import CorpusInput, RunOptions, option, refuse
from distill.store import LabelStore
from distill.store.texts import checked

EVALUATION = "evaluation"
BATCH_ITEMS = 256


class EvaluationError(CascadeError, ValueError):
    """An evaluation cannot run: no labelled evaluation items, labels of another teacher."""


class TierShare(BaseModel):
    name: str
    share: float


class TierSpend(BaseModel):
    """One tier over the evaluation: the seconds the router predicted for what it asked the tier
    (what a budget is charged) beside the seconds the tier took here, to check the prediction."""

    name: str
    predicted_seconds: float
    spent_seconds: float


class QuestionEvaluation(BaseModel):
    """One question over the evaluation items that have its teacher label."""

    items: int
    agreement: float
    tiers: list[TierShare]
    budget_limited: float
    target: float | None
    """The agreement certified; None in budget mode (nothing certified) and uncalibrated."""
    threshold: dict[str, float | None]


class Evaluation(BaseModel):
    """What the cascade delivers on held-out items; ``cost_ratio`` is cascade / teacher alone."""

    bundle: str
    items: int
    answers: int
    agreement: float
    cost_ratio: float
    cascade_seconds: float
    teacher_seconds: float
    budget: Budget
    budget_limited: float
    tiers: list[TierShare]
    questions: dict[str, QuestionEvaluation]
    spend: list[TierSpend] = []
    over_budget: float = 0.0
    teacher_traffic: TeacherTraffic | None = None
    """The calls a teacher behind a URL would get (one per item with any answer from the top tier,
    holding only those questions) against one per item forwarded whole."""


def evaluate_bundle(
    bundle_dir: Path,
    corpus: CorpusInput,
    store: LabelStore,
    budget: Budget | None = None,
    batch_items: int = BATCH_ITEMS,
    *,
    run: RunOptions | None = None,
) -> Evaluation:
    """Route every evaluation item of the ``corpus`` through the bundle, asking the questions the
    store has a teacher label for; the budget applies to each batch of ``batch_items``.

    The corpus is read by the text field the bundle was trained with unless it names one.
    ``run``: progress bars, the encoder's device, the embedding cache training filled (it
    embedded these items already, so the encoder tier looks them up; None: none), where GGUF
    middle tiers run (cascade.readout.placement), and the throughput that prices tiers without
    a measured cost.
    """
    corpus = option("evaluate_bundle", "corpus", corpus, CorpusInput)
    run = option("evaluate_bundle", "run", run, RunOptions, RunOptions())
    if not is_int(batch_items) or batch_items < 1:
        refuse("evaluate_bundle", "batch_items", batch_items, "a whole number >= 1")
    bundle = Bundle.load(Path(bundle_dir))
    manifest = bundle.manifest
    _check_teacher(manifest, store)
    labels = {qid: store.labels(qid) for qid in manifest.questions}
    lines = checked(store, corpus.read(manifest.training.text_field), corpus.path)
    items, asked = _evaluation_items(bundle, lines, corpus.path, labels)
    budget = budget if budget is not None else Budget()
    cascade = Cascade.load(bundle.directory, labels=labels, device=run.device,
                           flops_per_second=run.flops_per_second, cache_dir=run.cache_dir,
                           placement=run.placement, threads=run.threads)
    top = manifest.tiers[-1].name
    responses: list[DecisionResponse] = []
    teacher_seconds = 0.0
    with cascade, tqdm(total=len(items), unit="item", disable=not run.progress) as bar:
        for chunk, chunk_asked in _batches(items, asked, batch_items):
            responses += cascade.route(chunk, chunk_asked, budget)
            costs = cascade.costs.batch(chunk)
            teacher_seconds += sum(costs.seconds(top, i, q) for i, q in enumerate(chunk_asked))
            bar.update(len(chunk))
    return _summarise(manifest, bundle.directory, items, responses, labels, budget, teacher_seconds)


def _check_teacher(manifest: Manifest, store: LabelStore) -> None:
    """Agreement with another teacher's labels would measure nothing the bundle promises."""
    if store.teacher.model_dump() != manifest.teacher.model_dump():
        raise EvaluationError(f"label store {store.path} holds labels of teacher "
                              f"{store.teacher.model!r}, but bundle {manifest.name!r} was trained "
                              f"and calibrated on {manifest.teacher.model!r}; give that teacher's store")


def _evaluation_items(
    bundle: Bundle, lines: Iterable[CorpusItem], corpus: Path, labels: Mapping[str, Mapping[str, Any]]
) -> tuple[list[Item], list[list[str]]]:
    """Corpus items of the bundle's evaluation part, each with the questions it has labels for."""
    wanted = set(bundle.split_ids().get(EVALUATION, []))
    items, asked = [], []
    for row in lines:
        qids = [qid for qid, by_item in labels.items() if row.id in by_item]
        if row.id in wanted and qids:
            items.append(Item(row.id, row.state))
            asked.append(qids)
    if not items:
        raise EvaluationError(f"no item of {corpus} is both in the evaluation part of bundle "
                              f"{bundle.directory} ({len(wanted)} ids) and labelled in the store; "
                              "give the corpus and store the bundle was trained on")
    return items, asked


def _batches(items: Sequence[Item], asked: Sequence[list[str]], size: int
             ) -> Iterator[tuple[Sequence[Item], Sequence[list[str]]]]:
    for start in range(0, len(items), size):
        yield items[start : start + size], asked[start : start + size]


def _agrees(answer: Answer, label: Mapping[str, float]) -> bool:
    keys = list(answer.probabilities)
    mine = int(np.argmax([answer.probabilities[k] for k in keys]))
    theirs = int(np.argmax([label[k] for k in keys]))
    return mine == theirs


def _summarise(
    manifest: Manifest,
    directory: Path,
    items: Sequence[Item],
    responses: Sequence[DecisionResponse],
    labels: Mapping[str, Mapping[str, Mapping[str, float]]],
    budget: Budget,
    teacher_seconds: float,
) -> Evaluation:
    tier_names = [tier.name for tier in manifest.tiers]
    per_question: dict[str, list[tuple[bool, str, bool]]] = {qid: [] for qid in manifest.questions}
    cascade_ms = 0.0
    for item, response in zip(items, responses, strict=True):
        for qid, answer in response.answers.items():
            routing = _routing(answer, item.id, qid)
            cascade_ms += routing.cost_ms
            per_question[qid].append((_agrees(answer, labels[qid][item.id]), routing.tier,
                                      routing.budget_limited))
    everything = [row for rows in per_question.values() for row in rows]
    over = [answer.routing.over_budget for r in responses for answer in r.answers.values()
            if answer.routing is not None]
    top = [sum(row[1] == tier_names[-1] for row in _rows(r)) for r in responses]
    return Evaluation(
        bundle=str(Path(directory).resolve()),
        items=len(items),
        answers=len(everything),
        agreement=_mean(row[0] for row in everything),
        cost_ratio=cascade_ms / 1e3 / teacher_seconds if teacher_seconds > 0 else float("nan"),
        cascade_seconds=cascade_ms / 1e3,
        teacher_seconds=teacher_seconds,
        budget=budget,
        budget_limited=_mean(row[2] for row in everything),
        tiers=_shares(tier_names, everything),
        questions={qid: _question(manifest, qid, rows, tier_names)
                   for qid, rows in per_question.items() if rows},
        spend=_spend(tier_names, responses),
        over_budget=_mean(over),
        teacher_traffic=TeacherTraffic(items=len(responses), asked=sum(len(r.answers) for r in responses),
                                       calls=sum(1 for n in top if n), sent=sum(top)),
    )


def _rows(response: DecisionResponse) -> list[tuple[bool, str, bool]]:
    return [(False, a.routing.tier, False) for a in response.answers.values() if a.routing is not None]


def _spend(tier_names: list[str], responses: Sequence[DecisionResponse]) -> list[TierSpend]:
    """Per tier, predicted and measured seconds summed over every state it was asked about."""
    rows = [r.usage.tiers for r in responses]
    return [TierSpend(name=name,
                      predicted_seconds=sum(t[name].predicted_seconds for t in rows if name in t),
                      spent_seconds=sum(t[name].seconds for t in rows if name in t))
            for name in tier_names]


def _routing(answer: Answer, item: str, qid: str) -> Routing:
    if answer.routing is None:
        raise EvaluationError(f"the answer to {qid!r} about item {item!r} has no routing; the "
                              "cascade router sets it on every answer, so this is a bug")
    return answer.routing


def _question(manifest: Manifest, qid: str, rows: list[tuple[bool, str, bool]],
              tier_names: list[str]) -> QuestionEvaluation:
    return QuestionEvaluation(
        items=len(rows),
        agreement=_mean(row[0] for row in rows),
        tiers=_shares(tier_names, rows),
        budget_limited=_mean(row[2] for row in rows),
        target=manifest.calibration.certified_target,
        threshold={name: manifest.threshold(qid, name) for name in tier_names[:-1]},
    )


def _shares(tier_names: list[str], rows: Sequence[tuple[bool, str, bool]]) -> list[TierShare]:
    counts = Counter(row[1] for row in rows)
    return [TierShare(name=name, share=counts[name] / len(rows) if rows else 0.0) for name in tier_names]


def _mean(values: Iterable[bool]) -> float:
    flags = list(values)
    return sum(flags) / len(flags) if flags else float("nan")


def format_evaluation(evaluation: Evaluation, price: UpstreamPrice | None = None) -> str:
    """The table ``cascade evaluate`` prints: one row per question, then the totals (what a teacher
    behind a URL would be sent, at ``price`` where given)."""
    names = [tier.name for tier in evaluation.tiers]
    header = ["question", "n", "agreement", "target", *names, "budget-limited"]
    rows = [header]
    for qid, q in evaluation.questions.items():
        target = "-" if q.target is None else f"{q.target:.3f}"
        rows.append([qid, str(q.items), f"{q.agreement:.4f}", target,
                     *(f"{t.share:.1%}" for t in q.tiers), f"{q.budget_limited:.1%}"])
    rows.append(["all", str(evaluation.answers), f"{evaluation.agreement:.4f}", "-",
                 *(f"{t.share:.1%}" for t in evaluation.tiers), f"{evaluation.budget_limited:.1%}"])
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.append(f"{evaluation.items} evaluation items; predicted cost {evaluation.cascade_seconds:.3g} s "
                 f"vs teacher alone {evaluation.teacher_seconds:.3g} s: cost ratio "
                 f"{evaluation.cost_ratio:.3f}")
    if evaluation.teacher_traffic is not None and evaluation.teacher_traffic.items:
        lines.append(evaluation.teacher_traffic.line(price))
    if evaluation.over_budget > 0:
        lines.append(f"over budget: {evaluation.over_budget:.1%} of answers went up although the "
                     "budget could not pay (no lower tier had an answer to keep)")
    return "\n".join([*lines, "", *_spend_lines(evaluation.spend)])


def _spend_lines(spend: Sequence[TierSpend]) -> list[str]:
    """Predicted against spent seconds per tier, with why the two may differ by design."""
    rows = [("tier", "predicted s", "spent s")]
    rows += [(t.name, f"{t.predicted_seconds:.3g}", f"{t.spent_seconds:.3g}") for t in spend]
    widths = [max(len(row[c]) for row in rows) for c in range(3)]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in
                       enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.append("spent: measured on this machine; the top tier replays the teacher's recorded "
                 "labels and cached embeddings are looked up, so their spent seconds are not their cost")
    return lines
