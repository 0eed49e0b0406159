"""The calibration run: temperatures, acceptance thresholds and tier costs from held-out items.

By default only the bundle's "calibration" part is used: the heads never saw it, so what the
tiers do on it is what they will do on new items. With ``source="audit"`` the store's audited
live items certify instead (the heads never saw those either: a seeded uniform sample of the
traffic, answered by the teacher on every question), and the certificate is then about new items
from that traffic; ``"both"`` pools them, which certifies the pooled mixture and is the one to
choose only where the two come from one distribution (``inputs``).

Thresholds are on each tier's RAW probabilities reduced to one score, the top probability's lead
over the runner-up (``cascade.thresholds``): a score fixed before any calibration item was
drawn, so every calibration item certifies them: the finite-sample certificate assumes exactly
that, and a score fitted on the same items would spend part of it. The temperature only rescales
the probabilities answers report (and orders escalations under a budget); it never moves which
answers are kept. It is fitted on a part of the calibration items picked by a hash of their id
(30%), and its reliability diagrams are drawn on the rest.

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
that batch (``cascade.routing.router.Cascade._shape``), so the numbers certified are the ones routing
reads, not those of another batch shape.

A teacher that can run here (a GGUF top tier) is timed on a few calibration items the same way,
so that the router's cost model and the report price it from seconds measured on this machine
rather than from its weights on the roofline; a teacher known only by its labels cannot be, and
the result says why (``teacher_cost_note``).

A middle tier must also pay its way: what it costs on the calibration states that reach it
against the top tier's work it saves there (``payoff``). One that costs more is taken out of the
cascade unless the caller keeps it, which only sends more to the teacher.

This module ties the steps together; each lives in its own module of this package: ``inputs``
(labels and items), ``scoring`` (running and timing a tier), ``fits`` (per question and tier,
and the replay), ``payoff`` (whether a middle tier pays), ``manifest`` (what is written back),
``maths`` (the statistics) and ``results`` (what the run returns).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from cascade.bundle.manifest import Bundle
from cascade.checks import is_finite
from cascade.corpus import BadLine, OnError
from cascade.cost.pricing import TierCost as PriceCost
from cascade.cost.pricing import TierPricing
from cascade.cost.roofline import measure_cpu_flops
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import RouterError
from cascade.readout.placement import Placements
from cascade.readout.scorer import Scorer
from cascade.tiers.base import Build, Item, Tier
from cascade.tiers.kinds import build_tiers, close_tiers, kind_of
from distill.calibration.fits import TEMPERATURE_SHARE, fit_all, replay
from distill.calibration.inputs import (
    SOURCES,
    Labels,
    Source,
    audit_inputs,
    calibration_items,
    calibration_labels,
    check_teacher,
    merged,
)
from distill.calibration.manifest import updated_manifest
from distill.calibration.maths import CalibrationError
from distill.calibration.payoff import tier_payoffs
from distill.calibration.results import CalibrationResult, TierCost
from distill.calibration.scoring import score_tier
from distill.store import LabelStore

TEACHER_ITEMS = 16
"""Calibration items a runnable teacher is timed on: enough for its seconds per state and per
token to settle (a readout's cost is nearly linear in tokens), few enough that a 4B on a CPU
adds about a minute."""


def calibrate_bundle(
    bundle: Bundle,
    corpus_path: Path | None,
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
    teacher_items: int = TEACHER_ITEMS,
    keep_costly_tiers: bool = False,
    source: Source = "calibration",
    audits_since: float | None = None,
) -> CalibrationResult:
    """Calibrate every cheap tier of ``bundle`` on its calibration items and save the bundle.

    Thresholds are certified for ``target`` agreement with the teacher at level ``delta``; with
    ``escalation_fraction`` (budget mode) each cheap tier instead escalates that share of what
    it sees and the agreement that follows is reported. A target that cannot be certified
    leaves the threshold None and the result's message says what is reachable. ``encoder`` and
    ``scorers`` (tier name -> open Scorer) reuse loaded models; they must be the pinned files.
    ``placement`` says where the GGUF tiers it opens run (cascade.readout.placement).
    ``flops_per_second`` is this machine's throughput for roofline costs of tiers without a
    measurement (an external teacher); measured with numpy when not given. ``family_wise``
    splits ``delta`` over the questions too, so that every question meets the target at once
    with probability ``1 - delta`` (by default each does on its own); not with a budget mode,
    which certifies nothing. A bad corpus line stops the run, or with ``on_error="skip"`` goes
    to ``on_bad``, as ``read_corpus`` does (a calibration item on it is then reported missing).
    ``teacher_items`` calibration items time a GGUF teacher (0: price it on the roofline).
    A middle tier that costs more than it saves the top tier is taken out of the cascade
    (``distill.calibration.payoff``), unless ``keep_costly_tiers``. ``source`` picks the items that
    certify: the calibration part (of ``corpus_path``), the store's audits (those audited at or
    after ``audits_since``, a Unix time, where given; no corpus needed) or both.
    """
    _check_arguments(target, delta, escalation_fraction, family_wise)
    if source not in SOURCES:
        raise CalibrationError(f"source must be one of {', '.join(SOURCES)}; got {source!r}")
    if not isinstance(teacher_items, int) or isinstance(teacher_items, bool) or teacher_items < 0:
        raise CalibrationError(f"teacher_items must be a whole number >= 0; got {teacher_items!r}")
    if flops_per_second is not None and not (is_finite(flops_per_second) and flops_per_second > 0):
        raise CalibrationError(f"flops_per_second must be a number > 0; got {flops_per_second!r}")
    manifest = bundle.manifest
    check_teacher(manifest, store)
    bundle.verify()
    questions = manifest.parsed_questions()
    labels: Labels = {}
    items: list[Item] = []
    unlabelled, audits = 0, None
    if source != "audit":
        if corpus_path is None:
            raise CalibrationError(f"calibrating on {source!r} reads the calibration part's states from "
                                   "the corpus the bundle was trained on: give it (--corpus), or "
                                   "calibrate on the audits alone (--calibrate-on audit)")
        labels = calibration_labels(store, questions, bundle.split_ids()["calibration"], manifest.name)
        items, unlabelled = calibration_items(Path(corpus_path), text_field, labels, manifest.split,
                                              on_error, on_bad)
    if source != "calibration":
        audited, audit_items, audits = audit_inputs(store, questions, audits_since)
        labels, items = merged(labels, audited), items + audit_items
    cheap = manifest.tiers[:-1]
    if not cheap:
        raise CalibrationError(f"bundle {manifest.name!r} has only its top tier: there is no cheap "
                               "tier to calibrate; train one with `cascade train`")
    family = sum(1 for rows in labels.values() if rows)
    tier_target = 1 - (1 - target) / len(cheap)
    tier_delta = delta / len(cheap) / (family if family_wise else 1)
    build = Build(placements=placement, encoder=encoder, scorers=scorers or {})
    tiers = _open(bundle, build)
    try:
        scored = [score_tier(tier, spec.kind, items, labels, questions, progress)
                  for tier, spec in zip(tiers, cheap, strict=True)]
    finally:
        close_tiers(tiers)
    teacher_cost, teacher_note = _time_teacher(bundle, build, items[:teacher_items], labels, progress)
    names, teacher = [spec.name for spec in cheap], manifest.tiers[-1].name
    fits, skipped = fit_all(names, [probs for probs, _ in scored], labels, list(questions),
                            tier_target, tier_delta, escalation_fraction)
    flops = flops_per_second if flops_per_second is not None else measure_cpu_flops()
    costs = {cost.tier: cost for _, cost in scored}
    payoffs = tier_payoffs(names, fits, items, costs, _top_pricing(bundle, teacher_cost, flops),
                           questions, keep_costly_tiers)
    routed = [name for name in names if name not in payoffs or payoffs[name].kept]
    result = CalibrationResult(
        bundle=str(bundle.directory.resolve()), name=manifest.name, target=target, delta=delta,
        escalation_fraction=escalation_fraction, tier_target=tier_target, tier_delta=tier_delta,
        cheap_tiers=names, teacher_tier=teacher, items=len(items),
        temperature_share=TEMPERATURE_SHARE,
        calibrations=[fit.result for qid in questions for fit in fits.get(qid, {}).values()],
        cascades={qid: replay(qid, routed, by_tier, teacher) for qid, by_tier in fits.items()},
        skipped=skipped, costs=costs, flops_per_second=flops, payoffs=payoffs,
        family_wise=family_wise, family_size=family, unlabelled_items=unlabelled,
        teacher_cost=teacher_cost, teacher_cost_note=teacher_note, source=source, audits=audits,
    )
    Bundle(updated_manifest(manifest, result), bundle.directory, bundle.heads).save()
    return result


def _check_arguments(target: float, delta: float, escalation_fraction: float | None,
                     family_wise: bool) -> None:
    for name, value in (("target", target), ("delta", delta)):
        if not is_finite(value) or not 0 < value < 1:
            raise CalibrationError(f"{name} must be a number in (0, 1); got {value!r}")
    if escalation_fraction is not None and (
        not is_finite(escalation_fraction) or not 0 <= escalation_fraction <= 1
    ):
        raise CalibrationError(f"escalation_fraction must be None or a number in [0, 1]; got "
                               f"{escalation_fraction!r}")
    if not isinstance(family_wise, bool):
        raise CalibrationError(f"family_wise must be True or False; got {family_wise!r}")
    if family_wise and escalation_fraction is not None:
        raise CalibrationError("family_wise splits delta over the questions' certificates, and budget "
                               "mode (escalation_fraction) certifies nothing; give one or the other")


def _time_teacher(bundle: Bundle, build: Build, items: list[Item], labels: Labels,
                  progress: bool) -> tuple[TierCost | None, str]:
    """The top tier's measured cost on ``items``, or None and why it could not be measured.

    It is asked every question of the bundle per state, as when a whole state escalates; its
    answers are not used (the store's labels are the teacher's).
    """
    top = bundle.manifest.tiers[-1]
    if not items:
        return None, "not timed (teacher_items=0): priced on the roofline"
    try:
        kind_of(top).check_top(top, bundle.manifest.name, build)
    except RouterError:
        return None, (f"the top tier {top.name!r} is known by its labels only (kind {top.kind!r}), "
                      "so there is no model to time here: priced on the roofline")
    [tier] = build_tiers(bundle, build, [top])
    try:
        _, cost = score_tier(tier, top.kind, items, labels, bundle.manifest.parsed_questions(), progress)
    finally:
        close_tiers([tier])
    return cost, f"measured on {cost.states} calibration states on this machine"


def _top_pricing(bundle: Bundle, measured: TierCost | None, flops_per_second: float) -> TierPricing:
    """The top tier priced as a replay of its labels prices it (no model loads): from the seconds
    measured here, else from its weights on the roofline."""
    top = bundle.manifest.tiers[-1]
    [tier] = build_tiers(bundle, Build(labels={}), [top])
    if measured is not None:
        return tier.pricing(PriceCost(measured.seconds_per_state, measured.seconds_per_token))
    return tier.pricing(PriceCost(0.0, tier.flops_per_token() / flops_per_second, "roofline"))


def _open(bundle: Bundle, build: Build) -> list[Tier]:
    """The bundle's cheap tiers, built as the router builds them (``cascade.tiers.kinds``): a GGUF
    tier's scorer decodes the batches the router's does, since the batch shape moves the numbers
    and thresholds must certify the ones routing reads. A model the caller gave that is not the
    one its tier pins is refused."""
    try:
        return build_tiers(bundle, build, bundle.manifest.tiers[:-1])
    except RouterError as exc:
        raise CalibrationError(str(exc)) from None
