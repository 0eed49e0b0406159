"""The calibration run: temperatures, acceptance thresholds and tier costs from held-out items.

``calibrate_bundle`` certifies each cheap tier's threshold (on its raw margin, fixed before any
calibration item is drawn) so that the cascade agrees with the teacher on at least ``target`` of
new items with probability ``1 - delta`` (per question, or for all at once with
``family_wise``), on the bundle's calibration part, the store's audits, or both; it times the
tiers, takes out a middle tier that does not pay, and writes the result into the bundle. The
steps live in this package's other modules (``inputs``, ``scoring``, ``fits``, ``payoff``,
``early_payoff``, ``manifest``, ``maths``, ``results``). See docs/guarantee.md for the statistics and
docs/distilling.md for the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property

from cascade.bundle.manifest import MANIFEST_NAME, Bundle, Manifest
from cascade.cost.pricing import TEACHER_PARAMS, TierPricing
from cascade.cost.pricing import TierCost as PriceCost
from cascade.cost.roofline import measure_cpu_flops
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import RouterError, TeacherChangedError, UpstreamError
from cascade.hashing import file_sha256
from cascade.readout.scorer import Scorer
from cascade.routing.endpoint import same_endpoint
from cascade.teachers.settings import UpstreamSettings
from cascade.tiers.base import Build, Item, Tier
from cascade.tiers.kinds import build_tiers, close_tiers, kind_of
from distill.calibration.early_payoff import Judge, score_cheap
from distill.calibration.fits import TEMPERATURE_SHARE, fit_all, replay
from distill.calibration.inputs import (
    Labels,
    audit_inputs,
    calibration_items,
    calibration_labels,
    check_teacher,
    merged,
)
from distill.calibration.joint import certify_chains, certify_routed
from distill.calibration.manifest import updated_manifest
from distill.calibration.maths import CalibrationError
from distill.calibration.options import CalibrationOptions
from distill.calibration.payoff import teacher_traffic, tier_payoffs
from distill.calibration.results import CalibrationResult, TierCost
from distill.calibration.scoring import score_tier
from distill.calibration.teacher_check import flagged, judge_store, refusal
from distill.options import CorpusInput, RunOptions, option
from distill.store import LabelStore
from distill.training.run import bundle_lock


def calibrate_bundle(
    bundle: Bundle,
    corpus: CorpusInput | None,
    store: LabelStore,
    options: CalibrationOptions | None = None,
    *,
    run: RunOptions | None = None,
    encoder: Encoder | None = None,
    scorers: Mapping[str, Scorer] | None = None,
    teacher: UpstreamSettings | None = None,
) -> CalibrationResult:
    """Calibrate every cheap tier of ``bundle`` and save the result into it (``options``: what is
    certified and on which items, ``distill.calibration.options``; default: 0.98 at delta 0.05 on
    the calibration part).

    A target that cannot be certified leaves the threshold None and the result's message says
    what is reachable. ``corpus`` is the corpus the bundle was trained on (its text field by
    default); a calibration item on a line it skips is reported missing. ``run``: progress bars,
    where the GGUF tiers it opens run, the encoder's device and embedding cache, and this
    machine's throughput for roofline costs of tiers without a measurement (an external teacher;
    measured with numpy when not given). ``encoder`` and ``scorers`` (tier name -> open Scorer)
    reuse loaded models; they must be the pinned files. A middle tier that costs more than it
    saves the top tier is taken out of the cascade (``distill.calibration.payoff``; one that
    cannot pay on a seeded sample before it reads every state, ``distill.calibration.early_payoff``),
    unless kept. The teacher check (``distill.calibration.teacher_check``) runs on the labels that
    certify: degenerate ones are refused unless accepted. ``teacher``: the System One endpoint to
    time the top tier through, its answers checked against the identity the bundle's labels state;
    without it a teacher behind a URL is priced on the roofline.
    """
    options = option("calibrate_bundle", "options", options, CalibrationOptions, CalibrationOptions())
    run = option("calibrate_bundle", "run", run, RunOptions, RunOptions())
    if corpus is not None:
        corpus = option("calibrate_bundle", "corpus", corpus, CorpusInput)
    loaded = file_sha256(bundle.directory / MANIFEST_NAME)  # saved only where no train wrote it since
    manifest = bundle.manifest
    check_teacher(manifest, store)
    bundle.verify()
    questions = manifest.parsed_questions()
    labels: Labels = {}
    items: list[Item] = []
    unlabelled, audits = 0, None
    if options.source != "audit":
        if corpus is None:
            raise CalibrationError("calibrating on the calibration part reads its states from "
                                   "the corpus the bundle was trained on: give it (--corpus), or "
                                   "calibrate on the audits alone (--calibrate-on traffic)")
        ids = bundle.split_ids()["calibration"] if options.held_out is None else sorted(options.held_out)
        labels = calibration_labels(store, questions, ids, manifest.name)
        items, unlabelled = calibration_items(store, corpus, manifest.training.text_field, labels,
                                                manifest.split)
    if options.source != "calibration":
        audited, audit_items, audits = audit_inputs(store, questions, options.audits_since)
        labels, items = merged(labels, audited), items + audit_items
    checks = judge_store(store, questions, items={item for rows in labels.values() for item in rows})
    cheap = manifest.tiers[:-1]
    if not cheap:
        raise CalibrationError(f"bundle {manifest.name!r} has only its top tier: there is no cheap "
                               "tier to calibrate; train one with `cascade train`")
    family = sum(1 for rows in labels.values() if rows)
    shares = len(cheap) if options.certificate == "split" else 1
    tier_target = 1 - (1 - options.target) / shares
    tier_delta = options.delta / shares / (family if options.family_wise else 1)
    build = Build(device=run.device, cache_dir=run.cache_dir, placements=run.placement, encoder=encoder,
                  threads=run.threads, scorers=scorers or {})
    timed = None  # a URL teacher is timed first: one that is not the labels' fails before any scoring
    if teacher is not None:
        build = _through(bundle, build, option("calibrate_bundle", "teacher", teacher, UpstreamSettings))
        timed = _time_teacher(bundle, build, items[:options.teacher_items], labels, run.progress)
    top_tier = _TopTier(bundle, build, items[:options.teacher_items], labels, run, timed)
    judge = None if options.keep_costly_tiers or options.escalation_fraction is not None else Judge(
        tier_target, tier_delta, lambda: top_tier.pricing)
    tiers = _open(bundle, build)
    try:
        # what a cheap tier answers gets a options.certificate: refused on degenerate labels (budget mode
        # certifies nothing, so there the check is reported only)
        answerable = {qid for tier in tiers for qid in questions if tier.can_answer(qid)}
        refused = [check for check in flagged(checks) if check.question in answerable]
        if refused and not options.accept_degenerate_teacher and options.escalation_fraction is None:
            raise CalibrationError(refusal(refused))
        scored = score_cheap(tiers, cheap, items, labels, questions, run.progress, judge)
    finally:
        close_tiers(tiers)
    if options.certificate == "split":  # the tiers taken out early share no part of the error budget
        tier_target = 1 - (1 - options.target) / len(scored.names)
        tier_delta = options.delta / len(scored.names) / (family if options.family_wise else 1)
    names, top = [spec.name for spec in cheap], manifest.tiers[-1].name
    fits, skipped = fit_all(scored.names, scored.probs, labels, list(questions),
                            tier_target, tier_delta, options.escalation_fraction)
    alone = {qid: {name: fit.result for name, fit in by_tier.items()} for qid, by_tier in fits.items()}
    if options.certificate == "joint" and options.escalation_fraction is None:
        certify_chains(fits, scored.names, tier_target, tier_delta)
    costs, (teacher_cost, teacher_note), flops = scored.costs, top_tier.timing, top_tier.flops
    payoffs = scored.early | tier_payoffs(scored.names, fits, items, costs, top_tier.pricing, questions,
                                          options.keep_costly_tiers)
    routed = [name for name in scored.names if payoffs.get(name) is None or payoffs[name].kept]
    if options.certificate == "joint" and options.escalation_fraction is None and routed != scored.names:
        certify_routed(fits, alone, routed, tier_target, tier_delta)  # the chain that stays
    result = CalibrationResult(
        bundle=str(bundle.directory.resolve()), name=manifest.name, target=options.target,
        delta=options.delta,
        escalation_fraction=options.escalation_fraction, tier_target=tier_target, tier_delta=tier_delta,
        cheap_tiers=names, teacher_tier=top, items=len(items),
        temperature_share=TEMPERATURE_SHARE,
        calibrations=[fit.result for qid in questions for fit in fits.get(qid, {}).values()],
        cascades={qid: replay(qid, routed, by_tier, top) for qid, by_tier in fits.items()},
        item_scores={qid: {name: fit.scores for name, fit in by_tier.items()}
                     for qid, by_tier in fits.items()},
        skipped=skipped, costs=costs, flops_per_second=flops, payoffs=payoffs,
        family_wise=options.family_wise, family_size=family, unlabelled_items=unlabelled,
        teacher_cost=teacher_cost, teacher_cost_note=teacher_note, source=options.source, audits=audits,
        teacher_checks=checks, certificate=options.certificate,
        teacher_traffic=teacher_traffic(names, fits, payoffs),
    )
    if options.save:
        _save(bundle, updated_manifest(manifest, result), loaded)
    return result


def _save(bundle: Bundle, manifest: Manifest, loaded: str) -> None:
    """Save the calibrated manifest, under the bundle's lock, unless the bundle changed since it was
    loaded (``loaded``: its manifest's hash): a `cascade train` of it meanwhile wrote new heads,
    and the old manifest over them would leave a bundle that cannot load."""
    with bundle_lock(bundle.directory):
        if file_sha256(bundle.directory / MANIFEST_NAME) != loaded:
            raise CalibrationError(f"bundle {bundle.directory} changed while it was calibrated (trained "
                                   "again?); nothing was saved: calibrate it again")
        Bundle(manifest, bundle.directory, bundle.heads).save()


class _TopTier:
    """The top tier's cost, timed once when first asked: by a middle tier judged early
    (``distill.calibration.early_payoff``, while the cheap tiers are open), else after scoring."""

    def __init__(self, bundle: Bundle, build: Build, items: list[Item], labels: Labels, run: RunOptions,
                 timed: tuple[TierCost | None, str] | None) -> None:
        self._bundle, self._build, self._items, self._labels, self._run = bundle, build, items, labels, run
        self._timed = timed

    @cached_property
    def timing(self) -> tuple[TierCost | None, str]:
        """Its measured cost (None: priced on the roofline), and how it was got."""
        return self._timed or _time_teacher(self._bundle, self._build, self._items, self._labels,
                                            self._run.progress)

    @cached_property
    def flops(self) -> float:
        """This machine's FLOP/s (the roofline's), as given or measured once."""
        given = self._run.flops_per_second
        return given if given is not None else measure_cpu_flops()

    @cached_property
    def pricing(self) -> TierPricing:
        """What it costs to answer, as the payoffs weigh it."""
        return _top_pricing(self._bundle, self.timing[0], self.flops)


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
