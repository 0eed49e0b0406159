"""What a calibration run decides and measures: the schemas of its result.

The manifest keeps the facts of each (question, tier) (``cascade.bundle.sections.QuestionFacts``); the
result adds the figures a report draws from them (reliability and coverage curves, confusion).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cascade.bundle.sections import AuditSpan, QuestionFacts, TierPayoff, dropped_tiers
from distill.calibration.inputs import Source
from distill.calibration.teacher_check import QuestionCheck
from distill.calibration.teacher_traffic import TeacherTraffic

Certificate = Literal["joint", "split"]
"""How the thresholds of several cheap tiers are certified: together against the system's
agreement (``distill.calibration.joint``), or each at its share of the target and delta."""
CERTIFICATES: tuple[Certificate, ...] = ("joint", "split")

FACTS = tuple(QuestionFacts.model_fields)
"""The fields of a QuestionTier that go into the manifest (the figures stay in the report)."""


class InputCounts(BaseModel):
    """What a tier met on one question's calibration states: how many it was asked about, how many
    its unfamiliar-input gate sent up, how many it read cut short (the encoder's token limit, an
    excerpt) and how many were too long for its context."""

    states: int = 0
    unfamiliar: int = 0
    cut: int = 0
    too_long: int = 0

    def line(self, tier: str) -> str | None:
        """One sentence for a report, None where the tier read every state whole."""
        parts = [f"{n} {what}" for n, what in (
            (self.unfamiliar, "sent up by the unfamiliar-input gate (its answers never kept)"),
            (self.cut, "read cut short (the encoder's token limit or an excerpt; calibrated as read)"),
            (self.too_long, "too long for its context (sent up unread)")) if n]
        return f"tier {tier}, of {self.states} states: {', '.join(parts)}" if parts else None


class TierCost(BaseModel):
    """What running a tier on the calibration items cost on this machine, and what it met.

    ``seconds_per_state`` and ``seconds_per_token`` add up, as in the router's cost model: a
    state of t tokens costs ``seconds_per_state + t * seconds_per_token``. ``kind`` is the tier's
    kind in the manifest. ``inputs``: per question, the states it was asked and how it read them.
    """

    tier: str
    kind: str
    states: int
    tokens: int
    seconds: float
    batches: int
    seconds_per_state: float
    seconds_per_token: float
    inputs: dict[str, InputCounts] = {}


class QuestionTier(QuestionFacts):
    """One question calibrated on one cheap tier: the facts the manifest keeps, and the figures a
    report draws. Lax where the manifest's facts are strict: it is made in memory, not read back.

    The threshold is on the tier's RAW score (the top probability's margin over the runner-up:
    ``cascade.thresholds.CERTIFIED_SCORE``) and is certified on all n items
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

    model_config = ConfigDict(extra="ignore", strict=False)

    question: str
    tier: str
    reliability_before: dict[str, Any]
    reliability_after: dict[str, Any]
    curve: dict[str, list[float]]
    confusion: list[list[int]]

    def facts(self) -> QuestionFacts:
        return QuestionFacts.model_validate(self.model_dump(include=set(FACTS)))


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
    certified about items like them, though the router still answers them. ``source`` says which
    labelled items certified (``distill.calibration.inputs.Source``), ``audits`` the audited ones
    among them. ``teacher_checks``: the teacher check on the labels that certified (a flagged one
    certified only because it was accepted). ``certificate``: how several cheap tiers shared the
    target and delta (``Certificate``; with one cheap tier both are the same). ``teacher_traffic``:
    on the certifying items, the calls and questions a teacher behind a URL would get.
    ``item_scores``: question -> cheap tier -> item -> (raw score, agrees with the teacher), on the
    items that certified: what a paired comparison of two bundles on the same items
    (``distill.loop.gate``) reads; kept in memory only (never dumped: a report needs none of it).
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
    teacher_cost: TierCost | None = None
    teacher_cost_note: str = ""
    payoffs: dict[str, TierPayoff] = {}
    source: Source = "calibration"
    audits: AuditSpan | None = None
    teacher_checks: list[QuestionCheck] = []
    certificate: Certificate = "split"
    teacher_traffic: TeacherTraffic | None = None
    item_scores: dict[str, dict[str, dict[str, tuple[float, bool]]]] = Field(default={}, exclude=True)

    def dropped(self) -> set[str]:
        """Cheap tiers taken out of the cascade because they cost more than they saved."""
        return dropped_tiers(self.payoffs)

    @property
    def mode(self) -> Literal["agreement", "budget"]:
        return "agreement" if self.escalation_fraction is None else "budget"
