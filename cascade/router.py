"""The router: each question goes up the tiers, cheapest first, until one is confident enough.

At every tier only the questions still open are asked. A tier's raw distribution is scaled by
the (question, tier) temperature, its confidence is the top probability, and the answer is kept
when that clears the (question, tier) threshold (None: never kept); the top tier answers what
reaches it, whatever its confidence. A question a tier cannot answer (no head) starts one tier up.

A budget bounds the predicted cost of a call (``ms_per_call``) or the share of its questions the
top tier may answer (``max_escalation_fraction``). When it cannot pay for every escalation the
least confident questions escalate first, strictly in that order, and the others keep their best
lower-tier answer marked ``routing.budget_limited``: a budget never changes an answer silently.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from cascade.bundle import Bundle, EncoderTier, ExternalTier, GgufTier, Manifest
from cascade.calibration_math import apply_temperature
from cascade.costmodel import BatchCost, CostModel
from cascade.encoder import Device, EmbeddingCache, Encoder
from cascade.errors import CascadeError, RequestError
from cascade.questions import Answer, DecisionResponse, Question, Readout, Routing, State, Usage
from cascade.readout import Scorer
from cascade.tiers import HeadsTier, Item, LabelsTier, ReadoutTier, Tier

MAX_BRANCHES = 64
Labels = Mapping[str, Mapping[str, Mapping[str, float]]]
"""question id -> item id -> probabilities: the shape of a label store's labels."""


class RouterError(CascadeError, ValueError):
    """A cascade cannot be built as asked: a missing teacher, conflicting arguments."""


class Budget(BaseModel):
    """What one call may spend; None leaves that bound off.

    ``ms_per_call``: predicted milliseconds per state; a batch pools ``ms_per_call x states``, so
    its least confident questions escalate first wherever they are. ``max_escalation_fraction``:
    the most the top tier may answer, as a share of all questions asked in the call (those with
    no lower tier to answer them count, and go up regardless).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ms_per_call: float | None = None
    max_escalation_fraction: float | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = "; ".join(
                f"budget.{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors())
            raise RequestError(problems) from None

    @field_validator("ms_per_call", mode="before")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"must be a finite number of milliseconds > 0, or None; got {value!r}")
        return value

    @field_validator("max_escalation_fraction", mode="before")
    @classmethod
    def _fraction(cls, value: Any) -> Any:
        if value is not None and not (_is_number(value) and 0 <= value <= 1):
            raise ValueError(f"must be a number in [0, 1], or None; got {value!r}")
        return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class _Pick:
    """The current answer to one question about one state, from the highest tier asked so far."""

    tier: int
    raw: np.ndarray
    probs: np.ndarray
    threshold: float | None
    calibrated: bool
    readout: Readout | None = None
    budget_limited: bool = False

    @property
    def confidence(self) -> float:
        """Calibrated: what orders escalations across questions under a budget."""
        return float(self.probs.max())

    @property
    def accepted(self) -> bool:
        """Thresholds are certified on the tier's raw top probability (distill.calibration)."""
        return self.threshold is not None and float(self.raw.max()) >= self.threshold


@dataclass
class _Run:
    """One routing call's state: answers so far, what each tier answered, and the budget spent."""

    items: Sequence[Item]
    asked: Sequence[Sequence[str]]
    costs: BatchCost
    n_tiers: int
    picks: list[dict[str, _Pick]] = field(init=False)
    answered: list[list[list[str]]] = field(init=False)  # tier -> item -> question ids answered
    usage: list[Usage] = field(init=False)
    spent: float = 0.0
    top_used: int = 0

    def __post_init__(self) -> None:
        self.picks = [{} for _ in self.items]
        self.answered = [[[] for _ in self.items] for _ in range(self.n_tiers)]
        self.usage = [Usage(questions=len(qids)) for qids in self.asked]


class Cascade:
    """Tiers of a bundle, with the manifest's thresholds and temperatures and a cost model."""

    def __init__(self, manifest: Manifest, tiers: Sequence[Tier], costs: CostModel) -> None:
        self.manifest = manifest
        self.tiers = list(tiers)
        self.costs = costs
        self.questions: dict[str, Question] = manifest.parsed_questions()

    @classmethod
    def load(
        cls,
        bundle_dir: Path,
        teacher: Path | None = None,
        labels: Labels | None = None,
        device: Device = "cpu",
        flops_per_second: float | None = None,
        cache_dir: Path | None = None,
        threads: int | None = None,
    ) -> Cascade:
        """Load a bundle's tiers; ``teacher`` (a GGUF) or ``labels`` answer an external top tier.

        ``labels`` also replace a GGUF top tier, to replay a cascade on labelled items without
        running the teacher. ``flops_per_second`` prices tiers without measured costs.
        ``cache_dir`` holds an embedding cache (as training keeps one) that the encoder tier
        reads and fills, for replays on items embedded before. ``threads``: CPU threads of each
        model (default: all cores; fewer where other work shares the machine).
        """
        if teacher is not None and labels is not None:
            raise RouterError("give teacher (a GGUF to run) or labels (recorded answers), not both")
        bundle = Bundle.load(Path(bundle_dir))
        _check_top(bundle.manifest, teacher, labels)
        tiers: list[Tier] = []
        try:
            for spec in bundle.manifest.tiers:
                tiers.append(_runtime_tier(spec, bundle, _Options(teacher, labels, device, cache_dir,
                                                                  threads)))
            costs = CostModel.for_tiers(bundle.manifest, tiers, flops_per_second)
        except BaseException:
            _close(tiers)
            raise
        return cls(bundle.manifest, tiers, costs)

    def close(self) -> None:
        """Free the llama.cpp models of readout tiers."""
        _close(self.tiers)

    def __enter__(self) -> Cascade:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def decide(
        self, state: State, budget: Budget | None = None, questions: Sequence[str] | None = None
    ) -> DecisionResponse:
        """Answer the bundle's questions (or the ``questions`` named) about one state."""
        return self.decide_batch([Item("state", state)], budget, questions)[0]

    def decide_batch(
        self, items: Sequence[Item], budget: Budget | None = None, questions: Sequence[str] | None = None
    ) -> list[DecisionResponse]:
        """Answer the same questions about every item; the budget is shared by the batch."""
        qids = self._question_ids(questions)
        return self.route(items, [qids] * len(items), budget)

    def route(
        self, items: Sequence[Item], asked: Sequence[Sequence[str]], budget: Budget | None = None
    ) -> list[DecisionResponse]:
        """Answer ``asked[i]`` (bundle question ids) about ``items[i]``, one response per item."""
        _check_items(items, asked, self.questions)
        budget = budget if budget is not None else Budget()
        run = _Run(items, asked, self.costs.batch(items), len(self.tiers))
        sent = [list(qids) for qids in asked]
        for t in range(len(self.tiers)):
            self._ask(run, t, [[q for q in qids if self._may_keep(q, t, budget)] for qids in sent])
            if t == 0:
                run.spent = sum(run.costs.seconds(self.tiers[0].name, i, q)
                                for i, q in enumerate(run.answered[0]))
            if t + 1 < len(self.tiers):
                sent = self._escalate(run, t, sent, budget)
        return [self._response(run, i) for i in range(len(items))]

    def _question_ids(self, questions: Sequence[str] | None) -> list[str]:
        if questions is None:
            return list(self.questions)
        if isinstance(questions, str):
            raise RequestError(f"questions must be a list of question ids; got the string {questions!r}")
        unknown = [q for q in questions if q not in self.questions]
        if unknown or not questions:
            raise RequestError(f"questions must name at least one of the bundle's questions "
                               f"{list(self.questions)}; got {list(questions)}")
        return list(dict.fromkeys(questions))

    def _may_keep(self, qid: str, t: int, budget: Budget) -> bool:
        """Whether tier ``t``'s answer to ``qid`` could be the one returned. Below the top, a
        threshold of None never accepts; only a budget that stops the escalation keeps such an
        answer, so without one the tier is not asked at all and the question goes straight up."""
        top = t == len(self.tiers) - 1
        bounded = budget.ms_per_call is not None or budget.max_escalation_fraction is not None
        return top or bounded or self.manifest.threshold(qid, self.tiers[t].name) is not None

    def _ask(self, run: _Run, t: int, sent: list[list[str]]) -> None:
        """Ask tier ``t`` the questions sent to it; record its (temperature-scaled) answers."""
        if not any(sent):
            return
        tier, top = self.tiers[t], t == len(self.tiers) - 1
        started = time.perf_counter()
        reply = tier.reply(run.items, sent, self.questions)
        seconds = (time.perf_counter() - started) / sum(1 for qids in sent if qids)
        for i, qids in enumerate(sent):
            if qids:
                run.usage[i] = _add(run.usage[i], reply.usage[i], seconds)
            for qid in qids:
                if qid not in reply.answers[i]:
                    if top:
                        raise CascadeError(f"the top tier {tier.name!r} did not answer question "
                                           f"{qid!r} about item {run.items[i].id!r}")
                    continue
                raw = reply.answers[i][qid]
                probs = apply_temperature(raw, self.manifest.temperature(qid, tier.name))
                threshold = None if top else self.manifest.threshold(qid, tier.name)
                readout = reply.readouts[i].get(qid)
                run.picks[i][qid] = _Pick(t, raw, probs, threshold, self._fitted(qid, t), readout)
                run.answered[t][i].append(qid)

    def _fitted(self, qid: str, t: int) -> bool:
        """Whether calibration fitted a temperature for (question, tier).

        Calibration records its facts per (question, tier) in ``calibration["questions"]``, with a
        ``temperature_note`` saying why T was left at 1.0 when it could not be fitted; a bundle
        fresh from training holds placeholder temperatures of 1.0 and no facts. The top tier is
        the reference the others are calibrated against, so it never is.
        """
        facts = self.manifest.calibration.get("questions", {})
        facts = facts.get(qid, {}) if isinstance(facts, Mapping) else {}
        row = facts.get(self.tiers[t].name) if isinstance(facts, Mapping) else None
        top = t == len(self.tiers) - 1
        return not top and isinstance(row, Mapping) and row.get("temperature_note") is None

    def _escalate(self, run: _Run, t: int, sent: list[list[str]], budget: Budget) -> list[list[str]]:
        """What tier ``t + 1`` is asked: questions tier ``t`` could not answer (always), then the
        ones it was not confident about, least confident first, while the budget lasts."""
        up, top = self.tiers[t + 1].name, t + 1 == len(self.tiers) - 1
        plan = [[q for q in qids if q not in run.answered[t][i]] for i, qids in enumerate(sent)]
        run.spent += sum(run.costs.seconds(up, i, qids) for i, qids in enumerate(plan))
        run.top_used += sum(map(len, plan)) if top else 0
        seconds, top_share = _allowance(budget, run, top)
        blocked = False
        for _, i, _, qid in self._unsure(run, t):
            extra = run.costs.seconds(up, i, [*plan[i], qid]) - run.costs.seconds(up, i, plan[i])
            blocked = blocked or run.spent + extra > seconds or run.top_used + top > top_share
            if blocked:
                run.picks[i][qid].budget_limited = True
                continue
            plan[i].append(qid)
            run.spent += extra
            run.top_used += top
        return [sorted(qids, key=list(run.asked[i]).index) for i, qids in enumerate(plan)]

    def _unsure(self, run: _Run, t: int) -> list[tuple[float, int, int, str]]:
        """Tier ``t``'s answers below their threshold as (confidence, item, position, question),
        least confident first; ties go to the earlier item and question."""
        unsure = []
        for i, qids in enumerate(run.answered[t]):
            for qid in qids:
                pick = run.picks[i][qid]
                if not pick.accepted:
                    unsure.append((pick.confidence, i, list(run.asked[i]).index(qid), qid))
        return sorted(unsure)

    def _response(self, run: _Run, i: int) -> DecisionResponse:
        shares: dict[str, float] = dict.fromkeys(run.asked[i], 0.0)
        for t, tier in enumerate(self.tiers):
            qids = run.answered[t][i]
            for qid in qids:
                shares[qid] += 1e3 * run.costs.seconds(tier.name, i, qids) / len(qids)
        answers: dict[str, Answer] = {}
        for qid in run.asked[i]:
            pick = run.picks[i][qid]
            routing = Routing(tier=self.tiers[pick.tier].name, cost_ms=shares[qid],
                              threshold=pick.threshold, raw_confidence=float(pick.raw.max()),
                              calibrated=pick.calibrated,
                              budget_limited=pick.budget_limited)
            answer = self.questions[qid].answer(pick.probs.tolist(), calibrated=pick.calibrated,
                                                readout=pick.readout)
            answers[qid] = answer.model_copy(update={"routing": routing})
        return DecisionResponse(answers=answers, usage=run.usage[i])


def _allowance(budget: Budget, run: _Run, top: bool) -> tuple[float, float]:
    """The call's predicted seconds (pooled over its items) and, when escalating to the top
    tier, the number of questions that tier may answer; inf where the budget sets no bound."""
    seconds = math.inf
    if budget.ms_per_call is not None:
        seconds = budget.ms_per_call * len(run.items) / 1e3 * (1 + 1e-9)  # float slack
    share = math.inf
    if top and budget.max_escalation_fraction is not None:
        share = math.floor(budget.max_escalation_fraction * sum(map(len, run.asked)) + 1e-9)
    return seconds, share


def _add(total: Usage, more: Usage, seconds: float) -> Usage:
    return Usage(questions=total.questions, prompt_tokens=total.prompt_tokens + more.prompt_tokens,
                 forward_passes=total.forward_passes + more.forward_passes,
                 seconds=total.seconds + seconds)


def _check_items(items: Sequence[Item], asked: Sequence[Sequence[str]],
                 questions: Mapping[str, Question]) -> None:
    """Refuse what would fail deep inside a tier, naming the item."""
    if len(items) != len(asked):
        raise RequestError(f"asked must list the question ids of each item: {len(items)} items, "
                           f"{len(asked)} lists")
    for n, (item, qids) in enumerate(zip(items, asked, strict=True)):
        state = item.state
        if not isinstance(state, str | dict | list) or not (state.strip() if isinstance(state, str)
                                                            else state):
            raise RequestError(f"items[{n}] (id {item.id!r}): state must be non-empty text or a "
                               f"JSON object or array; got {state!r:.60}")
        unknown = [q for q in qids if q not in questions]
        if not qids or unknown or len(set(qids)) < len(qids):
            raise RequestError(f"items[{n}] (id {item.id!r}): asked must list distinct question ids "
                               f"of the bundle {list(questions)}; got {list(qids)}")


def _check_top(manifest: Manifest, teacher: Path | None, labels: Labels | None) -> None:
    """Before loading any model: can the top tier answer what reaches it?"""
    top = manifest.tiers[-1]
    if isinstance(top, ExternalTier) and teacher is None and labels is None:
        raise RouterError(
            f"bundle {manifest.name!r} ends in the external tier {top.name!r} (labels "
            f"{top.labels!r}), which cannot run: give --teacher PATH.gguf (teacher=) to answer "
            "the questions the lower tiers escalate, or labels= to replay recorded answers")
    if isinstance(top, GgufTier) and teacher is not None:
        raise RouterError(f"bundle {manifest.name!r} already runs its pinned GGUF {top.model.path} "
                          f"as the top tier {top.name!r}; drop --teacher / teacher=")
    if teacher is not None and not Path(teacher).is_file():
        raise RouterError(f"teacher model {teacher} not found; give the path of a .gguf file")


@dataclass(frozen=True)
class _Options:
    """How ``Cascade.load`` was asked to build the runtime tiers."""

    teacher: Path | None
    labels: Labels | None
    device: Device
    cache_dir: Path | None
    threads: int | None


def _runtime_tier(spec: Any, bundle: Bundle, options: _Options) -> Tier:
    questions = len(bundle.manifest.questions)
    top = spec is bundle.manifest.tiers[-1]
    if isinstance(spec, EncoderTier):
        encoder = Encoder(spec.files(), device=options.device, max_length=spec.max_length,
                          threads=options.threads)
        cache = EmbeddingCache(Path(options.cache_dir), encoder) if options.cache_dir else None
        return HeadsTier(spec.name, encoder, bundle.heads, cache, bundle.ngrams)
    if top and options.labels is not None:
        return LabelsTier(spec.name, options.labels)
    if isinstance(spec, GgufTier):
        branches = min(MAX_BRANCHES, questions * spec.permutations)
        scorer = Scorer(spec.model.path, n_ctx=spec.n_ctx, max_branches=branches,
                        n_threads=options.threads, template=spec.template)
        return ReadoutTier(spec.name, scorer, spec.permutations)
    assert options.teacher is not None  # _check_top refused an external top tier without one
    scorer = Scorer(options.teacher, max_branches=min(MAX_BRANCHES, questions), n_threads=options.threads)
    return ReadoutTier(spec.name, scorer)


def _close(tiers: Sequence[Tier]) -> None:
    for tier in tiers:
        if isinstance(tier, ReadoutTier):
            tier.scorer.close()
