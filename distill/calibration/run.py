"""The calibration run: temperatures, acceptance thresholds and tier costs from held-out items.

``calibrate_bundle`` certifies each cheap tier's threshold (on its raw margin, fixed before any
calibration item is drawn) so that the cascade agrees with the teacher on at least ``target`` of
new items with probability ``1 - delta`` (per question, or for all at once with
``family_wise``), on the bundle's calibration part, the store's audits, or both; it times the
tiers, takes out a middle tier that does not pay, and writes the result into the bundle. The
steps live in this package's other modules (``inputs``, ``scoring``, ``fits``, ``payoff``,
``manifest``, ``maths``, ``results``). See docs/guarantee.md for the statistics and
docs/distilling.md for the run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from cascade.bundle.manifest import Bundle
from cascade.checks import is_finite
from cascade.cost.pricing import TEACHER_PARAMS, TierPricing
from cascade.cost.pricing import TierCost as PriceCost
from cascade.cost.roofline import measure_cpu_flops
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import RouterError, TeacherChangedError, UpstreamError
from cascade.readout.scorer import Scorer
from cascade.routing.endpoint import same_endpoint
from cascade.teachers.settings import UpstreamSettings
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
from distill.calibration.joint import certify_chains
from distill.calibration.manifest import updated_manifest
from distill.calibration.maths import CalibrationError
from distill.calibration.payoff import teacher_traffic, tier_payoffs
from distill.calibration.results import CERTIFICATES, CalibrationResult, Certificate, TierCost
from distill.calibration.scoring import score_tier
from distill.calibration.teacher_check import flagged, judge_store, refusal
from distill.options import CorpusInput, RunOptions, option
from distill.store import LabelStore

TEACHER_ITEMS = 16
"""Calibration items a runnable teacher is timed on: enough for its seconds per state and per
token to settle (a readout's cost is nearly linear in tokens), few enough that a 4B on a CPU
adds about a minute."""


def calibrate_bundle(
    bundle: Bundle,
    corpus: CorpusInput | None,
    store: LabelStore,
    target: float = 0.98,
    delta: float = 0.05,
    escalation_fraction: float | None = None,
    *,
    run: RunOptions | None = None,
    encoder: Encoder | None = None,
    scorers: Mapping[str, Scorer] | None = None,
    family_wise: bool = False,
    teacher_items: int = TEACHER_ITEMS,
    keep_costly_tiers: bool = False,
    source: Source = "calibration",
    audits_since: float | None = None,
    accept_degenerate_teacher: bool = False,
    certificate: Certificate = "joint",
    held_out: Collection[str] | None = None,
    save: bool = True,
    teacher: UpstreamSettings | None = None,
) -> CalibrationResult:
    """Calibrate every cheap tier of ``bundle`` on its calibration items and save the bundle.

    Thresholds are certified for ``target`` agreement with the teacher at level ``delta``; with
    ``escalation_fraction`` (budget mode) each cheap tier instead escalates that share of what
    it sees and the agreement that follows is reported. A target that cannot be certified
    leaves the threshold None and the result's message says what is reachable. ``corpus`` is the
    corpus the bundle was trained on (its text field by default); a calibration item on a line it
    skips is reported missing. ``run``: progress bars, where the GGUF tiers it opens run, the
    encoder's device and embedding cache, and this machine's throughput for roofline costs of
    tiers without a measurement (an external teacher; measured with numpy when not given).
    ``encoder`` and ``scorers`` (tier name -> open Scorer) reuse loaded models; they must be the
    pinned files. ``family_wise`` splits ``delta`` over the questions too, so that every question
    meets the target at once with probability ``1 - delta`` (by default each does on its own);
    not with a budget mode, which certifies nothing. ``teacher_items`` calibration items time a
    GGUF teacher (0: price it on the roofline). A middle tier that costs more than it saves the
    top tier is taken out of the cascade (``distill.calibration.payoff``), unless
    ``keep_costly_tiers``. ``source`` picks the items that certify: the calibration part (of
    ``corpus``), the store's audits (those audited at or after ``audits_since``, a Unix time,
    where given; no corpus needed) or both. The teacher check (``distill.calibration.teacher_check``) runs on
    the labels that certify: degenerate ones are refused unless ``accept_degenerate_teacher``.
    ``certificate``: "joint" certifies the thresholds of all cheap tiers together against the
    system's agreement at the full target and delta (``distill.calibration.joint``); "split" gives
    each of m cheap tiers (1 - target) / m and delta / m, as before issue 34 (one cheap tier: the
    same). ``held_out``: the item ids that certify in place of the bundle's calibration part (a
    candidate's held-out evidence, ``distill.loop.promote``; none may have trained the bundle);
    ``save``: write the result into the bundle (False: only return it). ``teacher``: the System
    One endpoint to time the top tier through (``teacher_items`` calls), its answers checked
    against the identity the bundle's labels state; without it a teacher behind a URL is priced
    on the roofline.
    """
    run = option("calibrate_bundle", "run", run, RunOptions, RunOptions())
    if corpus is not None:
        corpus = option("calibrate_bundle", "corpus", corpus, CorpusInput)
    _check_arguments(target, delta, escalation_fraction, family_wise)
    if certificate not in CERTIFICATES:
        raise CalibrationError(f"certificate must be one of {', '.join(CERTIFICATES)}; got {certificate!r}")
    if source not in SOURCES:
        raise CalibrationError(f"source must be one of {', '.join(SOURCES)}; got {source!r}")
    if not isinstance(teacher_items, int) or isinstance(teacher_items, bool) or teacher_items < 0:
        raise CalibrationError(f"teacher_items must be a whole number >= 0; got {teacher_items!r}")
    manifest = bundle.manifest
    check_teacher(manifest, store)
    bundle.verify()
    questions = manifest.parsed_questions()
    labels: Labels = {}
    items: list[Item] = []
    unlabelled, audits = 0, None
    if source != "audit":
        if corpus is None:
            raise CalibrationError(f"calibrating on {source!r} reads the calibration part's states from "
                                   "the corpus the bundle was trained on: give it (--corpus), or "
                                   "calibrate on the audits alone (--calibrate-on audit)")
        ids = bundle.split_ids()["calibration"] if held_out is None else sorted(held_out)
        labels = calibration_labels(store, questions, ids, manifest.name)
        items, unlabelled = calibration_items(corpus, manifest.training.text_field, labels, manifest.split)
    if source != "calibration":
        audited, audit_items, audits = audit_inputs(store, questions, audits_since)
        labels, items = merged(labels, audited), items + audit_items
    checks = judge_store(store, questions, items={item for rows in labels.values() for item in rows})
    cheap = manifest.tiers[:-1]
    if not cheap:
        raise CalibrationError(f"bundle {manifest.name!r} has only its top tier: there is no cheap "
                               "tier to calibrate; train one with `cascade train`")
    family = sum(1 for rows in labels.values() if rows)
    shares = len(cheap) if certificate == "split" else 1
    tier_target = 1 - (1 - target) / shares
    tier_delta = delta / shares / (family if family_wise else 1)
    build = Build(device=run.device, cache_dir=run.cache_dir, placements=run.placement, encoder=encoder,
                  threads=run.threads, scorers=scorers or {})
    timed = None  # a URL teacher is timed first: one that is not the labels' fails before any scoring
    if teacher is not None:
        build = _through(bundle, build, option("calibrate_bundle", "teacher", teacher, UpstreamSettings))
        timed = _time_teacher(bundle, build, items[:teacher_items], labels, run.progress)
    tiers = _open(bundle, build)
    try:
        # what a cheap tier answers gets a certificate: refused on degenerate labels (budget mode
        # certifies nothing, so there the check is reported only)
        answerable = {qid for tier in tiers for qid in questions if tier.can_answer(qid)}
        refused = [check for check in flagged(checks) if check.question in answerable]
        if refused and not accept_degenerate_teacher and escalation_fraction is None:
            raise CalibrationError(refusal(refused))
        scored = [score_tier(tier, spec.kind, items, labels, questions, run.progress)
                  for tier, spec in zip(tiers, cheap, strict=True)]
    finally:
        close_tiers(tiers)
    teacher_cost, teacher_note = timed or _time_teacher(bundle, build, items[:teacher_items], labels,
                                                        run.progress)
    names, top = [spec.name for spec in cheap], manifest.tiers[-1].name
    fits, skipped = fit_all(names, [probs for probs, _ in scored], labels, list(questions),
                            tier_target, tier_delta, escalation_fraction)
    if certificate == "joint" and escalation_fraction is None:
        certify_chains(fits, names, tier_target, tier_delta)
    flops = run.flops_per_second if run.flops_per_second is not None else measure_cpu_flops()
    costs = {cost.tier: cost for _, cost in scored}
    payoffs = tier_payoffs(names, fits, items, costs, _top_pricing(bundle, teacher_cost, flops),
                           questions, keep_costly_tiers)
    routed = [name for name in names if name not in payoffs or payoffs[name].kept]
    result = CalibrationResult(
        bundle=str(bundle.directory.resolve()), name=manifest.name, target=target, delta=delta,
        escalation_fraction=escalation_fraction, tier_target=tier_target, tier_delta=tier_delta,
        cheap_tiers=names, teacher_tier=top, items=len(items),
        temperature_share=TEMPERATURE_SHARE,
        calibrations=[fit.result for qid in questions for fit in fits.get(qid, {}).values()],
        cascades={qid: replay(qid, routed, by_tier, top) for qid, by_tier in fits.items()},
        skipped=skipped, costs=costs, flops_per_second=flops, payoffs=payoffs,
        family_wise=family_wise, family_size=family, unlabelled_items=unlabelled,
        teacher_cost=teacher_cost, teacher_cost_note=teacher_note, source=source, audits=audits,
        teacher_checks=checks, certificate=certificate, teacher_traffic=teacher_traffic(names, fits, payoffs),
    )
    if save:
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


def _through(bundle: Bundle, build: Build, teacher: UpstreamSettings) -> Build:
    """``build`` with the top tier answered through ``teacher``, which must state the identity
    the bundle's labels came with (checked at every answer)."""
    try:
        _, expected = same_endpoint(bundle.manifest, teacher.url, accept=False)
    except RouterError:
        labels = bundle.manifest.teacher
        raise CalibrationError(f"bundle {bundle.manifest.name!r} was labelled by {labels.kind} labels "
                               f"({labels.model!r}), which state no identity the answers of {teacher.shown} "
                               "could be checked against, so it cannot be timed as their teacher: leave "
                               "out --teacher (the teacher is then priced on the roofline)") from None
    return replace(build, upstream=teacher, upstream_identity=expected)


def _time_teacher(bundle: Bundle, build: Build, items: list[Item], labels: Labels,
                  progress: bool) -> tuple[TierCost | None, str]:
    """The top tier's measured cost on ``items``, or None and why it could not be measured.

    It is asked every question of the bundle per state, as when a whole state escalates; its
    answers are not used (the store's labels are the teacher's). Through a URL (``build.upstream``)
    the seconds are what a call takes from here: the network and the upstream's queue included.
    """
    top, teacher = bundle.manifest.tiers[-1], bundle.manifest.teacher
    if not items:
        return None, "not timed (teacher_items=0): priced on the roofline"
    if teacher.kind == "endpoint" and build.upstream is None:
        return None, (f"the top tier {top.name!r} is the System One endpoint the labels came from "
                      f"(model {teacher.model!r}), not timed without its URL (--teacher URL): priced on "
                      f"the roofline as a {TEACHER_PARAMS / 1e9:.0f}B model")
    try:
        kind_of(top).check_top(top, bundle.manifest.name, build)
    except RouterError:
        return None, (f"the top tier {top.name!r} is known by its labels only (kind {top.kind!r}), "
                      "so there is no model to time here: priced on the roofline")
    [tier] = build_tiers(bundle, build, [top])
    try:
        _, cost = score_tier(tier, top.kind, items, labels, bundle.manifest.parsed_questions(), progress)
    except TeacherChangedError as exc:
        raise CalibrationError(f"the teacher behind the URL is not the one the bundle's labels came from: "
                               f"{exc}") from None
    except UpstreamError as exc:
        raise CalibrationError(f"timing the teacher failed: {exc}") from None
    finally:
        close_tiers([tier])
    if build.upstream is not None:
        return cost, (f"measured on {cost.states} calibration states through {build.upstream.shown} "
                      "(the network and the upstream's queue included)")
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
