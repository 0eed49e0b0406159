"""What a calibration run writes into its bundle's manifest: thresholds, temperatures, facts."""

from __future__ import annotations

from datetime import datetime, timezone

from cascade.bundle.manifest import SCHEMA_VERSION, Manifest
from cascade.bundle.sections import CalibrationSection, MeasuredCost, QuestionFacts, ReplayShares
from cascade.thresholds import CERTIFIED_SCORE
from distill.calibration.fits import TEMPERATURE_SALT
from distill.calibration.results import CalibrationResult


def calibration_section(result: CalibrationResult) -> CalibrationSection:
    """The manifest's ``calibration`` section: settings, per-question facts, costs."""
    questions: dict[str, dict[str, QuestionFacts]] = {}
    for fit in result.calibrations:
        questions.setdefault(fit.question, {})[fit.tier] = fit.facts()
    skipped: dict[str, dict[str, str]] = {}
    for skip in result.skipped:
        skipped.setdefault(skip.question, {})[skip.tier] = skip.reason
    return CalibrationSection(
        calibrated_at=datetime.now(timezone.utc).isoformat(),
        mode=result.mode, target=result.target, delta=result.delta,
        escalation_fraction=result.escalation_fraction, cheap_tiers=result.cheap_tiers,
        tier_target=result.tier_target, tier_delta=result.tier_delta, items=result.items,
        family_wise=result.family_wise, family_size=result.family_size,
        unlabelled_items=result.unlabelled_items,
        temperature_share=result.temperature_share, temperature_salt=TEMPERATURE_SALT,
        questions=questions, skipped=skipped,
        cascade={qid: ReplayShares.model_validate(shares.model_dump(exclude={"question"}))
                 for qid, shares in result.cascades.items()},
        costs={cost.tier: MeasuredCost(seconds_per_state=cost.seconds_per_state,
                                       seconds_per_token=cost.seconds_per_token)
               for cost in [*result.costs.values(), *filter(None, [result.teacher_cost])]},
        flops_per_second=result.flops_per_second, payoffs=result.payoffs,
        source=None if result.source == "calibration" else result.source, audits=result.audits,
        certificate=result.certificate,
        degenerate_accepted=True if result.mode == "agreement" and any(
            check.flagged for check in result.teacher_checks) else None,
    )


def updated_manifest(manifest: Manifest, result: CalibrationResult) -> Manifest:
    """The manifest with the new thresholds, temperatures and facts, validated again.

    A run rewrites every (question, cheap tier) threshold, so all of them are then on
    ``CERTIFIED_SCORE`` (schema 2), whatever score an older bundle's were on, and certify the
    encoder's vectors of each text alone (schema 3). A tier taken out of the cascade (it cost
    more than it saved) keeps its facts for the record, and empty thresholds (one taken out on a
    sample, ``distill.calibration.early_payoff``, has no facts: its thresholds are emptied).
    """
    thresholds = {qid: dict(row) for qid, row in manifest.thresholds.items()}
    temperatures = {qid: dict(row) for qid, row in manifest.temperatures.items()}
    for skip in result.skipped:
        thresholds.setdefault(skip.question, {})[skip.tier] = None
        temperatures.setdefault(skip.question, {})[skip.tier] = 1.0
    dropped = result.dropped()
    for fit in result.calibrations:
        thresholds.setdefault(fit.question, {})[fit.tier] = None if fit.tier in dropped else fit.threshold
        temperatures.setdefault(fit.question, {})[fit.tier] = fit.temperature
    for row in thresholds.values():  # a tier taken out before it was scored on every state has no fit
        row.update(dict.fromkeys(dropped & row.keys()))
    data = manifest.model_dump() | {"schema_version": SCHEMA_VERSION, "threshold_on": CERTIFIED_SCORE,
                                    "thresholds": thresholds, "temperatures": temperatures,
                                    "calibration": calibration_section(result).model_dump()}
    return Manifest.model_validate(data)
