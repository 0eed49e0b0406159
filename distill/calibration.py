"""Calibrating a bundle: temperatures, acceptance thresholds and tier costs from held-out items.

Only the bundle's "calibration" part is used: the heads never saw it, so what the tiers do on it
is what they will do on new items. Thresholds are on each tier's RAW top probability, a score
fixed before any calibration item was drawn, so every calibration item certifies them: the
finite-sample certificate assumes exactly that, and a score fitted on the same items would
spend part of it. The temperature only rescales the probabilities answers report (and orders
escalations under a budget); it never moves which answers are kept. It is fitted on a part of
the calibration items picked by a hash of their id (30%), and its reliability diagrams are
drawn on the rest.

With several cheap tiers (the encoder tier and GGUF middle tiers), the error budget
``1 - target`` and ``delta`` are split evenly across them: each tier is certified to disagree
with the teacher on at most ``(1 - target) / m`` of all items at level ``delta / m``. A tier in
the cascade sees only what earlier tiers escalated, so its disagreement there is at most its
disagreement on all items; and by the union bound all m certificates hold together with
probability at least ``1 - delta``, so the cascade agrees with the teacher on at least
``target`` of new items with that probability.

That statement is per question: each question spends its own ``delta``, so with Q questions
all Q statements hold together only with probability at least ``1 - Q x delta``. With
``family_wise=True`` delta is split over the Q questions too (Bonferroni: each (question, tier)
certificate at level ``delta / (m x Q)``), and then all Q hold at once with probability at
least ``1 - delta``, at a cost in coverage that the report shows.

In budget mode each cheap tier escalates the given share F of the calibration items that
reach it (its threshold is set on those, after the tiers below it have kept theirs), so the
teacher answers about ``F ** m`` of them; the agreement that follows is reported.

A GGUF middle tier is scored on every question of the bundle at once per state, through a
scorer that decodes as many branches together as the router's: the router asks it exactly
that batch (``cascade.router.Cascade._shape``), so the numbers certified are the ones routing
reads, not those of another batch shape.
"""

from __future__ import annotations

import hashlib
import math
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel
from scipy.optimize import nnls
from tqdm import tqdm

from cascade.bundle import Bundle, EncoderTier, GgufTier, Manifest, SplitInfo
from cascade.cost import measure_cpu_flops
from cascade.encoder import Encoder
from cascade.placement import Placement, Placements, for_tier
from cascade.prompts import render_state
from cascade.questions import Question
from cascade.readout import Scorer, branch_slots
from cascade.tiers import Answers, Asked, HeadsTier, Item, ReadoutTier, Tier
from distill.calibrate import (
    CalibrationError,
    ThresholdResult,
    apply_temperature,
    clopper_pearson_lower,
    confidence_and_agreement,
    fit_temperature,
    reliability_curve,
    threshold_for_agreement,
    threshold_for_budget,
)
from distill.corpus import BadLine, OnError, read_corpus
from distill.split import part_of
from distill.store import LabelStore

TEMPERATURE_SHARE = 0.3
TEMPERATURE_SALT = "cascade-temperature-v1"
MIN_TEMPERATURE_ITEMS = 10
CURVE_POINTS = 200
FACTS = ("n", "n_temperature", "n_threshold", "temperature", "temperature_note", "ece_before",
         "ece_after", "threshold", "kept_share", "agreement", "agreement_kept", "lower_bound",
         "reachable", "message", "method", "target", "delta")
"""The fields of a QuestionTier that go into the manifest (the figures stay in the report)."""


class TierCost(BaseModel):
    """What running a cheap tier on the calibration items cost on this machine.

    ``seconds_per_state`` and ``seconds_per_token`` add up, as in the router's cost model: a
    state of t tokens costs ``seconds_per_state + t * seconds_per_token``.
    """

    tier: str
    kind: Literal["encoder", "gguf"]
    states: int
    tokens: int
    seconds: float
    batches: int
    seconds_per_state: float
    seconds_per_token: float


class QuestionTier(BaseModel):
    """One question calibrated on one cheap tier, with the figures a report draws.

    The threshold is on the tier's RAW top probability and is certified on all n items
    (``n_threshold``): the temperature never moves which answers are kept, so no item has to be
    set aside from the certificate for it; in budget mode ``n_threshold`` counts the items that
    reach the tier, the ones its threshold is set on and its ``kept_share`` and ``agreement``
    are over. ``agreement`` is the cascade agreement on those items
    (escalated items count as agreeing: the teacher answers them); ``agreement_kept`` the agreement
    on kept items only (None when nothing is kept). ``target`` and ``delta`` are this tier's share
    of the budget. The coverage curve is over all n items; ECEs and reliability curves over the
    ``n - n_temperature`` items the temperature was not fitted on. ``confusion[i][j]`` counts items
    the teacher answered option i and the tier option j (temperature does not move an argmax).
    """

    question: str
    tier: str
    n: int
    n_temperature: int
    n_threshold: int
    temperature: float
    temperature_note: str | None
    ece_before: float
    ece_after: float
    threshold: float | None
    kept_share: float
    agreement: float
    agreement_kept: float | None
    lower_bound: float
    reachable: bool
    message: str
    method: str
    target: float | None
    delta: float
    reliability_before: dict[str, Any]
    reliability_after: dict[str, Any]
    curve: dict[str, list[float]]
    confusion: list[list[int]]

    def facts(self) -> dict[str, Any]:
        return self.model_dump(include=set(FACTS))


class CascadeShares(BaseModel):
    """The whole cascade replayed on one question's threshold-part items with the new thresholds."""

    question: str
    n: int
    answered_by: dict[str, float]
    agreement: float


class Skipped(BaseModel):
    """A (question, tier) left uncalibrated: its threshold stays None (always escalate)."""

    question: str
    tier: str
    reason: str


class CalibrationResult(BaseModel):
    """Everything a calibration run decided and measured; the manifest keeps its facts.

    ``family_size`` counts the questions with calibration labels, the ones a certificate is
    about; ``family_wise`` says whether delta was split over them (all hold at once) or spent
    on each (each holds on its own). ``unlabelled_items`` counts corpus items of the
    calibration part with no teacher label at all (the teacher skipped them: over-long, or
    failed under ``--on-error skip``): they never entered calibration, so nothing here is
    certified about items like them, though the router still answers them.
    """

    bundle: str
    name: str
    target: float
    delta: float
    escalation_fraction: float | None
    tier_target: float
    tier_delta: float
    cheap_tiers: list[str]
    teacher_tier: str
    items: int
    temperature_share: float
    calibrations: list[QuestionTier]
    cascades: dict[str, CascadeShares]
    skipped: list[Skipped]
    costs: dict[str, TierCost]
    flops_per_second: float
    family_wise: bool = False
    family_size: int = 1
    unlabelled_items: int = 0

    @property
    def mode(self) -> Literal["agreement", "budget"]:
        return "agreement" if self.escalation_fraction is None else "budget"

    def manifest_calibration(self) -> dict[str, Any]:
        """The ``calibration`` dict of the manifest: settings, per-question facts, costs."""
        questions: dict[str, dict[str, Any]] = {}
        for fit in self.calibrations:
            questions.setdefault(fit.question, {})[fit.tier] = fit.facts()
        skipped: dict[str, dict[str, str]] = {}
        for skip in self.skipped:
            skipped.setdefault(skip.question, {})[skip.tier] = skip.reason
        return {
            "calibrated_at": datetime.now(timezone.utc).isoformat(),
            "mode": self.mode, "target": self.target, "delta": self.delta,
            "escalation_fraction": self.escalation_fraction, "cheap_tiers": self.cheap_tiers,
            "tier_target": self.tier_target, "tier_delta": self.tier_delta, "items": self.items,
            "family_wise": self.family_wise, "family_size": self.family_size,
            "unlabelled_items": self.unlabelled_items,
            "temperature_share": self.temperature_share, "temperature_salt": TEMPERATURE_SALT,
            "questions": questions, "skipped": skipped,
            "cascade": {qid: shares.model_dump(exclude={"question"})
                        for qid, shares in self.cascades.items()},
            "costs": {name: {"seconds_per_state": cost.seconds_per_state,
                             "seconds_per_token": cost.seconds_per_token}
                      for name, cost in self.costs.items()},
            "flops_per_second": self.flops_per_second,
        }


@dataclass
class _Fit:
    """A calibrated (question, tier) and its threshold-part scores, for replaying the cascade."""

    result: QuestionTier
    scores: dict[str, tuple[float, bool]]


Probabilities = dict[str, dict[str, np.ndarray]]
"""question id -> item id -> raw probabilities (option_keys order) from one tier."""


def calibrate_bundle(
    bundle: Bundle,
    corpus_path: Path,
    store: LabelStore,
    target: float = 0.98,
    delta: float = 0.05,
    escalation_fraction: float | None = None,
    text_field: str = "text",
    progress: bool = True,
    *,
    encoder: Encoder | None = None,
    scorers: Mapping[str, Scorer] | None = None,
    flops_per_second: float | None = None,
    placement: Placements = None,
    family_wise: bool = False,
    on_error: OnError = "stop",
    on_bad: Callable[[BadLine], None] | None = None,
) -> CalibrationResult:
    """Calibrate every cheap tier of ``bundle`` on its calibration items and save the bundle.

    Thresholds are certified for ``target`` agreement with the teacher at level ``delta``; with
    ``escalation_fraction`` (budget mode) each cheap tier instead escalates that share of what
    it sees and the agreement that follows is reported. A target that cannot be certified
    leaves the threshold None and the result's message says what is reachable. ``encoder`` and
    ``scorers`` (tier name -> open Scorer) reuse loaded models; they must be the pinned files.
    ``placement`` says where the GGUF tiers it opens run (cascade.placement).
    ``flops_per_second`` is this machine's throughput for roofline costs of tiers without a
    measurement (an external teacher); measured with numpy when not given. ``family_wise``
    splits ``delta`` over the questions too, so that every question meets the target at once
    with probability ``1 - delta`` (by default each does on its own); not with a budget mode,
    which certifies nothing. A bad corpus line stops the run, or with ``on_error="skip"`` goes
    to ``on_bad``, as ``read_corpus`` does (a calibration item on it is then reported missing).
    """
    _check_arguments(target, delta, escalation_fraction, family_wise)
    if flops_per_second is not None and not (_is_number(flops_per_second) and flops_per_second > 0):
        raise CalibrationError(f"flops_per_second must be a number > 0; got {flops_per_second!r}")
    manifest = bundle.manifest
    _check_teacher(manifest, store)
    bundle.verify()
    questions = manifest.parsed_questions()
    labels = _calibration_labels(store, questions, bundle.split_ids()["calibration"], manifest.name)
    items, unlabelled = _calibration_items(Path(corpus_path), text_field, labels, manifest.split,
                                           on_error, on_bad)
    cheap = manifest.tiers[:-1]
    if not cheap:
        raise CalibrationError(f"bundle {manifest.name!r} has only its top tier: there is no cheap "
                               "tier to calibrate; train one with `cascade train`")
    family = sum(1 for rows in labels.values() if rows)
    tier_target = 1 - (1 - target) / len(cheap)
    tier_delta = delta / len(cheap) / (family if family_wise else 1)
    with ExitStack() as stack:
        opened = [_scorer(spec, scorers, stack, placement, len(questions)) for spec in cheap]
        scored = [_score_tier(spec, bundle, items, labels, questions, progress, encoder, scorer)
                  for spec, scorer in zip(cheap, opened, strict=True)]
    names, teacher = [spec.name for spec in cheap], manifest.tiers[-1].name
    fits, skipped = _fit_all(names, [probs for probs, _ in scored], labels, list(questions),
                             tier_target, tier_delta, escalation_fraction)
    result = CalibrationResult(
        bundle=str(bundle.directory.resolve()), name=manifest.name, target=target, delta=delta,
        escalation_fraction=escalation_fraction, tier_target=tier_target, tier_delta=tier_delta,
        cheap_tiers=names, teacher_tier=teacher, items=len(items),
        temperature_share=TEMPERATURE_SHARE,
        calibrations=[fit.result for qid in questions for fit in fits.get(qid, {}).values()],
        cascades={qid: _replay(qid, names, by_tier, teacher) for qid, by_tier in fits.items()},
        skipped=skipped, costs={cost.tier: cost for _, cost in scored},
        flops_per_second=flops_per_second if flops_per_second is not None else measure_cpu_flops(),
        family_wise=family_wise, family_size=family, unlabelled_items=unlabelled,
    )
    Bundle(_updated_manifest(manifest, result), bundle.directory, bundle.heads).save()
    return result


def _fit_all(
    tiers: list[str],
    probs: list[Probabilities],
    labels: Mapping[str, Mapping[str, int]],
    questions: list[str],
    target: float,
    delta: float,
    escalation_fraction: float | None,
) -> tuple[dict[str, dict[str, _Fit]], list[Skipped]]:
    """Every (question, tier) calibrated, or skipped with the reason: question -> tier -> fit.

    Tiers go cheapest first, so that in budget mode each one's threshold is set on what the
    ones below it escalate under their new thresholds.
    """
    fits: dict[str, dict[str, _Fit]] = {}
    skipped: list[Skipped] = []
    for k, (tier, by_question) in enumerate(zip(tiers, probs, strict=True)):
        for qid in questions:
            below = fits.get(qid, {})
            reach = None if escalation_fraction is None else {
                item for item in labels[qid] if not any(_keeps(below.get(t), item) for t in tiers[:k])}
            outcome = _calibrate(qid, tier, by_question.get(qid), labels[qid], target, delta,
                                 escalation_fraction, reach)
            if isinstance(outcome, Skipped):
                skipped.append(outcome)
            else:
                fits.setdefault(qid, {})[tier] = outcome
    return fits, skipped


def _check_arguments(target: float, delta: float, escalation_fraction: float | None,
                     family_wise: bool) -> None:
    for name, value in (("target", target), ("delta", delta)):
        if not _is_number(value) or not 0 < value < 1:
            raise CalibrationError(f"{name} must be a number in (0, 1); got {value!r}")
    if escalation_fraction is not None and (
        not _is_number(escalation_fraction) or not 0 <= escalation_fraction <= 1
    ):
        raise CalibrationError(f"escalation_fraction must be None or a number in [0, 1]; got "
                               f"{escalation_fraction!r}")
    if not isinstance(family_wise, bool):
        raise CalibrationError(f"family_wise must be True or False; got {family_wise!r}")
    if family_wise and escalation_fraction is not None:
        raise CalibrationError("family_wise splits delta over the questions' certificates, and budget "
                               "mode (escalation_fraction) certifies nothing; give one or the other")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_teacher(manifest: Manifest, store: LabelStore) -> None:
    """Thresholds certify agreement with ONE teacher: the one whose labels trained the bundle."""
    ours, theirs = manifest.teacher.model_dump(), store.teacher.model_dump()
    if ours != theirs:
        raise CalibrationError(f"label store {store.path} holds labels of the teacher {theirs}, but "
                               f"bundle {manifest.name!r} was trained on labels of {ours}; calibrate "
                               "with the store the bundle was trained from")


def _calibration_labels(
    store: LabelStore, questions: Mapping[str, Question], ids: Sequence[str], name: str
) -> dict[str, dict[str, int]]:
    """question id -> calibration item id -> the teacher's answer (argmax, option_keys index)."""
    wanted = set(ids)
    labels: dict[str, dict[str, int]] = {}
    for qid, question in questions.items():
        keys = question.option_keys()
        rows = {item: probs for item, probs in store.labels(qid).items() if item in wanted}
        for item, probs in rows.items():
            if sorted(probs) != sorted(keys):
                raise CalibrationError(f"the stored label of item {item!r} for question {qid!r} has "
                                       f"options {sorted(probs)}, but the bundle's question has "
                                       f"{keys}: the store does not belong to this bundle")
        labels[qid] = {item: int(np.argmax([probs[k] for k in keys])) for item, probs in rows.items()}
    if not any(labels.values()):
        raise CalibrationError(f"none of the {len(wanted)} calibration items of bundle {name!r} has "
                               f"a teacher label in {store.path}; give the store the bundle was "
                               "trained from")
    return labels


def _calibration_items(
    corpus: Path, text_field: str, labels: Mapping[str, Mapping[str, int]], split: SplitInfo,
    on_error: OnError, on_bad: Callable[[BadLine], None] | None,
) -> tuple[list[Item], int]:
    """The labelled calibration items' states, in corpus order (every one must be found), and
    how many corpus items fall in the calibration part with no teacher label at all.

    The split places an id by its hash alone, so an item the teacher skipped (too long for its
    context, or failed) has a part too: counting those says what calibration never saw.
    """
    wanted = set().union(*(set(rows) for rows in labels.values()))
    items, unlabelled = [], 0
    for row in read_corpus(corpus, text_field, on_error, on_bad):
        if row.id in wanted:
            items.append(Item(row.id, row.state))
        elif part_of(row.id, split.fractions, split.salt) == "calibration":
            unlabelled += 1
    missing = wanted - {item.id for item in items}
    if missing:
        raise CalibrationError(f"{len(missing)} of the {len(wanted)} calibration items are not in "
                               f"corpus {corpus} (for example {min(missing)!r}); give the corpus "
                               "the bundle was trained on")
    return items, unlabelled


def _scorer(spec: Any, scorers: Mapping[str, Scorer] | None, stack: ExitStack,
            placement: Placements, questions: int) -> Scorer | None:
    """The open scorer of a GGUF tier: the caller's (checked against the pin) or a new one, placed
    where ``placement`` says (over the tier's default in the bundle).

    Either decodes the ``questions`` x permutations branches of a state in the groups the
    router's scorer does (``cascade.readout.branch_slots``): the batch shape
    moves the numbers, and thresholds must certify the ones routing reads.
    """
    if not isinstance(spec, GgufTier):
        return None
    needed = questions * spec.permutations
    branches = branch_slots(questions, spec.permutations)
    given = (scorers or {}).get(spec.name)
    if given is None:
        place = (for_tier(placement, spec.name) or Placement()).over(spec.default_placement())
        scorer = Scorer.placed(spec.model.path, place, branches, template=spec.template)
        stack.callback(scorer.close)
        return scorer
    if given.model_sha256 != spec.model.sha256:
        raise CalibrationError(f"scorers[{spec.name!r}] runs {given.model.path} (sha256 "
                               f"{given.model_sha256}); tier {spec.name!r} pins {spec.model.path} "
                               f"(sha256 {spec.model.sha256})")
    if min(given.ctx.config.max_branches, needed) != branches:
        raise CalibrationError(f"scorers[{spec.name!r}] decodes at most {given.ctx.config.max_branches} "
                               f"branches at once, and the router {branches} of the {needed} a state "
                               "needs: the batches would differ, and so would the numbers; open it "
                               f"with max_branches={branches}")
    return given


def _encoder(spec: EncoderTier, given: Encoder | None) -> Encoder:
    if given is None:
        return Encoder(spec.files(), max_length=spec.max_length)
    if given.sha256 != spec.model.sha256 or given.max_length != spec.max_length:
        raise CalibrationError(f"encoder runs {given.files.model} (sha256 {given.sha256}, max_length "
                               f"{given.max_length}); tier {spec.name!r} pins {spec.model.path} "
                               f"(sha256 {spec.model.sha256}, max_length {spec.max_length})")
    return given


def _score_tier(
    spec: Any,
    bundle: Bundle,
    items: list[Item],
    labels: Mapping[str, Mapping[str, int]],
    questions: Mapping[str, Question],
    progress: bool,
    encoder: Encoder | None,
    scorer: Scorer | None,
) -> tuple[Probabilities, TierCost]:
    """Raw probabilities of one cheap tier for every labelled question it answers, and its cost.

    The encoder tier runs in batches of similar length, as the encoder batches (batches of
    different token totals are what splits its cost into per state and per token); a readout
    tier runs one state at a time. One warm-up state first keeps first-call setup out.

    A readout tier is asked every question of the bundle about each state, in the bundle's
    order, whatever was labelled: the router asks a GGUF middle tier exactly that batch
    (``Cascade._shape``), and a fan-out's numbers move with the batch decoded together, so
    this is what makes the thresholds certify the numbers routing reads. Only the labelled
    answers are kept.
    """
    if isinstance(spec, EncoderTier):
        tier: Tier = HeadsTier(spec.name, _encoder(spec, encoder), bundle.heads, ngrams=bundle.ngrams)
        answered = [qid for qid in questions if qid in bundle.heads]
    elif scorer is not None:
        tier = ReadoutTier(spec.name, scorer, permutations=spec.permutations)
        answered = list(questions)
    else:
        raise CalibrationError(f"tier {spec.name!r} of kind {spec.kind!r} cannot be calibrated")
    asked_all = [[qid for qid in answered if item.id in labels[qid]] for item in items]
    used = [(item, qids if isinstance(tier, HeadsTier) else answered)
            for item, qids in zip(items, asked_all, strict=True) if qids]
    counter: _TokenCounter
    if isinstance(tier, HeadsTier):
        counts = tier.encoder.token_counts([render_state(item.state) for item, _ in used])
        used = [used[i] for i in np.argsort(counts, kind="stable")]
        counter, size = _EncoderTokens(sorted(counts)), tier.encoder.batch_size
    else:
        counter, size = _DecodedTokens(scorer), 1
    states, asked = [item for item, _ in used], [qids for _, qids in used]
    tier.answer(states[:1], asked[:1], questions)
    counter.reset()
    answers, batches = _timed_answers(tier, states, asked, questions, size, progress, counter)
    return _by_question(states, answers, labels), _tier_cost(spec, batches)


@dataclass(frozen=True)
class _Batch:
    states: int
    tokens: int
    seconds: float


class _TokenCounter(ABC):
    """Tokens a tier ran for the batch ``rows`` of the states it was given."""

    @abstractmethod
    def reset(self) -> None:
        """Forget work done so far (the warm-up)."""

    @abstractmethod
    def __call__(self, rows: slice) -> int:
        """Tokens of the batch just answered."""


class _EncoderTokens(_TokenCounter):
    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def reset(self) -> None:
        """Counts come from the texts, not from a running total: nothing to forget."""

    def __call__(self, rows: slice) -> int:
        return sum(self.counts[rows])


class _DecodedTokens(_TokenCounter):
    """The scorer's decoded prompt tokens since the previous batch."""

    def __init__(self, scorer: Scorer | None) -> None:
        if scorer is None:
            raise CalibrationError("a readout tier needs an open scorer")
        self.scorer = scorer
        self.seen = scorer.ctx.decoded_tokens

    def reset(self) -> None:
        self.seen = self.scorer.ctx.decoded_tokens

    def __call__(self, rows: slice) -> int:
        before, self.seen = self.seen, self.scorer.ctx.decoded_tokens
        return self.seen - before


def _timed_answers(
    tier: Tier,
    items: list[Item],
    asked: Asked,
    questions: Mapping[str, Question],
    size: int,
    progress: bool,
    tokens: _TokenCounter,
) -> tuple[Answers, list[_Batch]]:
    """The tier's answers batch by batch, with the seconds spent inside ``answer`` for each."""
    answers: Answers = []
    batches: list[_Batch] = []
    with tqdm(total=len(items), disable=not progress, unit="state", desc=f"tier {tier.name}") as bar:
        for start in range(0, len(items), size):
            rows = slice(start, start + size)
            began = time.perf_counter()
            answers += tier.answer(items[rows], asked[rows], questions)
            seconds = time.perf_counter() - began
            batches.append(_Batch(len(items[rows]), tokens(rows), seconds))
            bar.update(len(items[rows]))
    return answers, batches


def _tier_cost(spec: Any, batches: list[_Batch]) -> TierCost:
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
    return TierCost(tier=spec.name, kind=spec.kind, states=int(states.sum()), tokens=int(tokens.sum()),
                    seconds=float(seconds.sum()), batches=len(batches),
                    seconds_per_state=float(per_state), seconds_per_token=float(per_token))


def _by_question(items: list[Item], answers: Answers, labels: Mapping[str, Mapping[str, int]]
                 ) -> Probabilities:
    """The answers by question, only where the teacher's label is there to compare with."""
    probs: Probabilities = {}
    for item, answer in zip(items, answers, strict=True):
        for qid, row in answer.items():
            if item.id in labels[qid]:
                probs.setdefault(qid, {})[item.id] = row
    return probs


def in_temperature_part(item_id: str) -> bool:
    """Whether a calibration item fits the temperature (True) or tests the threshold (False).

    A hash of the id, so the split is the same on every run and for every tier and question.
    """
    digest = hashlib.sha256(f"{TEMPERATURE_SALT}\0{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < TEMPERATURE_SHARE


def _calibrate(
    qid: str,
    tier: str,
    probs: Mapping[str, np.ndarray] | None,
    labels: Mapping[str, int],
    target: float,
    delta: float,
    escalation_fraction: float | None,
    reach: set[str] | None = None,
) -> _Fit | Skipped:
    """Temperature on one part, its reliability on the other; the raw-confidence threshold and
    coverage on all items. Skipped when impossible.

    In budget mode the threshold is set on the items in ``reach`` (those the tiers below this
    one escalate; None: all), so that the tier escalates the share of what it sees that the
    budget names, as the router will make it do.
    """
    if not labels:
        return Skipped(question=qid, tier=tier, reason="no calibration item has a teacher label for "
                       "this question; label some, retrain and calibrate again")
    if probs is None:
        return Skipped(question=qid, tier=tier, reason="the tier does not answer this question "
                       "(no head); it starts one tier up")
    ids = sorted(probs)
    held = [i for i in ids if not in_temperature_part(i)]
    if not held:
        return Skipped(question=qid, tier=tier, reason=f"none of its {len(ids)} calibration items "
                       "fell outside the temperature part; label more items")
    fitting = [i for i in ids if in_temperature_part(i)]
    temperature, note = _temperature(probs, labels, fitting)
    every, teacher_every = _stack(probs, ids), _labels(labels, ids)
    confidence, correct = confidence_and_agreement(every, teacher_every)
    seen = np.asarray([reach is None or i in reach for i in ids])
    if escalation_fraction is None:
        chosen = threshold_for_agreement(confidence, correct, target, delta)
    else:
        chosen = _budget_threshold(confidence[seen], correct[seen], escalation_fraction, delta)
    raw, teacher = _stack(probs, held), _labels(labels, held)
    before = reliability_curve(raw, teacher)
    after = reliability_curve(apply_temperature(raw, temperature), teacher)
    result = QuestionTier(
        question=qid, tier=tier, n=len(ids), n_temperature=len(fitting), n_threshold=int(seen.sum()),
        temperature=temperature, temperature_note=note,
        ece_before=before["ece"], ece_after=after["ece"], **_threshold_facts(chosen),
        reliability_before=before, reliability_after=after,
        curve=_coverage_curve(confidence, correct, delta),
        confusion=_confusion(every, teacher_every),
    )
    return _Fit(result, {i: (float(c), bool(a)) for i, c, a in zip(ids, confidence, correct, strict=True)})


def _budget_threshold(
    confidence: np.ndarray, correct: np.ndarray, escalation_fraction: float, delta: float
) -> ThresholdResult:
    """``threshold_for_budget`` on the items that reach the tier; when none does, keep nothing."""
    if len(confidence):
        return threshold_for_budget(confidence, correct, escalation_fraction, delta)
    return ThresholdResult(threshold=None, kept_share=0.0, agreement_kept=math.nan,
                           agreement_cascade=1.0, lower_bound=1.0, n=0, reachable=True,
                           method="budget", target=None, delta=delta,
                           message="no calibration item reaches this tier (the tiers below keep "
                           "them all); it keeps nothing")


def _stack(probs: Mapping[str, np.ndarray], ids: list[str]) -> np.ndarray:
    return np.stack([probs[i] for i in ids])


def _labels(labels: Mapping[str, int], ids: list[str]) -> np.ndarray:
    return np.asarray([labels[i] for i in ids], dtype=np.int64)


def _temperature(
    probs: Mapping[str, np.ndarray], labels: Mapping[str, int], ids: list[str]
) -> tuple[float, str | None]:
    """T fitted on the items ``ids``, or 1.0 with the reason when they cannot pin it down.

    T never touches the guarantee (thresholds are on raw confidences); a T at a search bound
    would only squash the probabilities answers report into ties.
    """
    if len(ids) < MIN_TEMPERATURE_ITEMS:
        return 1.0, (f"only {len(ids)} items in the temperature part (fewer than "
                     f"{MIN_TEMPERATURE_ITEMS}); T left at 1.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        temperature = fit_temperature(_stack(probs, ids), _labels(labels, ids))
    at_bound = [w for w in caught if "stopped at the bound" in str(w.message)]
    for other in (w for w in caught if w not in at_bound):
        warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
    if not at_bound:
        return temperature, None
    why = ("every answer agrees with the teacher, so sharper always fits better" if temperature < 1
           else "the answers look no better than chance, so flatter always fits better")
    return 1.0, (f"the fit on {len(ids)} items stopped at the bound T={temperature:.3g} ({why}); "
                 "T left at 1.0")


def _threshold_facts(chosen: ThresholdResult) -> dict[str, Any]:
    kept = chosen.agreement_kept
    return {
        "threshold": chosen.threshold, "kept_share": chosen.kept_share,
        "agreement": chosen.agreement_cascade,
        "agreement_kept": None if math.isnan(kept) else kept, "lower_bound": chosen.lower_bound,
        "reachable": chosen.reachable, "message": chosen.message, "method": chosen.method,
        "target": chosen.target, "delta": chosen.delta,
    }


def _coverage_curve(confidence: np.ndarray, correct: np.ndarray, delta: float) -> dict[str, list[float]]:
    """Share kept, cascade agreement and its 1 - delta lower bound as the threshold falls.

    At most CURVE_POINTS of the distinct thresholds, spread evenly over the ranking.
    """
    n = len(confidence)
    order = np.argsort(-confidence, kind="stable")
    ranked = confidence[order]
    wrong = np.cumsum(~correct[order])
    ends = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    picks = np.unique(np.linspace(0, len(ends) - 1, min(CURVE_POINTS, len(ends))).round().astype(int))
    ends = ends[picks]
    return {
        "threshold": ranked[ends].tolist(),
        "kept_share": ((ends + 1) / n).tolist(),
        "agreement": (1 - wrong[ends] / n).tolist(),
        "lower_bound": [clopper_pearson_lower(int(n - w), n, delta) for w in wrong[ends]],
    }


def _confusion(probs: np.ndarray, teacher: np.ndarray) -> list[list[int]]:
    k = probs.shape[1]
    matrix = np.zeros((k, k), dtype=np.int64)
    np.add.at(matrix, (teacher, probs.argmax(axis=1)), 1)
    return matrix.tolist()


def _replay(qid: str, tiers: list[str], fits: Mapping[str, _Fit], teacher: str) -> CascadeShares:
    """Route each threshold-part item through the calibrated tiers: who answers, and agreement."""
    ids = sorted(set().union(*(set(fit.scores) for fit in fits.values())))
    answered = dict.fromkeys([*tiers, teacher], 0)
    wrong = 0
    for item in ids:
        keeper = next((name for name in tiers if _keeps(fits.get(name), item)), teacher)
        answered[keeper] += 1
        if keeper != teacher:
            wrong += not fits[keeper].scores[item][1]
    n = len(ids)
    return CascadeShares(question=qid, n=n, answered_by={k: v / n for k, v in answered.items()},
                         agreement=1 - wrong / n)


def _keeps(fit: _Fit | None, item: str) -> bool:
    if fit is None or fit.result.threshold is None or item not in fit.scores:
        return False
    return fit.scores[item][0] >= fit.result.threshold


def _updated_manifest(manifest: Manifest, result: CalibrationResult) -> Manifest:
    """The manifest with the new thresholds, temperatures and facts, validated again."""
    thresholds = {qid: dict(row) for qid, row in manifest.thresholds.items()}
    temperatures = {qid: dict(row) for qid, row in manifest.temperatures.items()}
    for skip in result.skipped:
        thresholds.setdefault(skip.question, {})[skip.tier] = None
        temperatures.setdefault(skip.question, {})[skip.tier] = 1.0
    for fit in result.calibrations:
        thresholds.setdefault(fit.question, {})[fit.tier] = fit.threshold
        temperatures.setdefault(fit.question, {})[fit.tier] = fit.temperature
    data = manifest.model_dump() | {"thresholds": thresholds, "temperatures": temperatures,
                                    "calibration": result.manifest_calibration()}
    return Manifest.model_validate(data)
