"""The manifest's ``calibration`` and ``training`` sections, typed.

Training writes ``training`` and calibration writes ``calibration``; the router, the cost model
and the commands read them back. Typed here, a malformed section (a cost that is not a number, a
misspelt key) is refused when the bundle loads, naming the field, instead of being read back
through guards that each reader repeats. Strict: a JSON string or a boolean where a number
belongs is refused, not converted.

Every field has a default, because a section is filled in as far as the bundle got: a bundle
fresh from training has an empty ``calibration``, and bundles calibrated before a field existed
lack it (``family_wise``, ``family_size`` and ``unlabelled_items`` came later; their defaults
say what those bundles did). A section is written back with the fields it was given only
(``Manifest`` dumps it with ``exclude_unset``), so loading and saving a bundle never adds keys.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _non_negative(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"must be a finite number >= 0; got {value!r}")
    return value


def _positive(value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a finite number > 0; got {value!r}")
    return value


def _instant(value: str) -> str:
    try:
        zone = datetime.fromisoformat(value).tzinfo
    except ValueError:
        zone = None
    if zone is None:
        raise ValueError(f"must be an ISO 8601 time with its zone (2026-12-07T09:31:43+00:00); got {value!r}")
    return value


NonNegative = Annotated[float, AfterValidator(_non_negative)]
Positive = Annotated[float, AfterValidator(_positive)]
Instant = Annotated[str, AfterValidator(_instant)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class QuestionFacts(_Section):
    """What calibration decided for one (question, tier), as the manifest keeps it.

    The figures behind it (reliability curves, coverage curve, confusion) stay in the report.
    ``temperature_note`` says why T was left at 1.0 where it could not be fitted (None: fitted).
    """

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


class MeasuredCost(_Section):
    """A tier's cost measured on the calibration items: a state of t tokens costs
    ``seconds_per_state + t x seconds_per_token``, as the router's cost model adds them."""

    seconds_per_state: NonNegative
    seconds_per_token: NonNegative


class ReplayShares(_Section):
    """One question's calibration items replayed through the new thresholds: the share each tier
    answered, and the cascade's agreement with the teacher."""

    n: int
    answered_by: dict[str, float]
    agreement: float


class TierPayoff(_Section):
    """What a cheap tier above the first cost and saved the top tier on the calibration items, in
    predicted seconds (``distill.calibration.payoff``), and whether it stays in the cascade.

    ``kept`` False: calibration took it out (its thresholds are empty and the router does not
    even load it); ``reason`` gives the figures in words.
    """

    states_reached: int
    states_resolved: int
    seconds_cost: NonNegative
    seconds_saved: NonNegative
    scored_states: int
    kept: bool
    reason: str


def dropped_tiers(payoffs: dict[str, TierPayoff]) -> set[str]:
    """The tiers of ``payoffs`` calibration took out of the cascade: they cost more than they saved."""
    return {tier for tier, payoff in payoffs.items() if not payoff.kept}


class AuditSpan(_Section):
    """The audited items a calibration certified on: how many, and when the first and last were
    audited (ISO 8601, UTC)."""

    items: int
    first: str
    last: str


class CalibrationSection(_Section):
    """The settings of the last calibration, its per-(question, tier) facts and the tier costs.

    ``questions`` and ``skipped`` map question -> tier -> facts, or why the pair was left
    uncalibrated; ``cascade`` is by question and ``costs`` by tier name. ``flops_per_second`` is
    the throughput that prices tiers without a measured cost (an external teacher) on the roofline.
    ``source`` says which labelled items certified ("audit" or "both" with the audited ``audits``;
    None: the calibration part alone, as before audits existed). ``certificate``: how several cheap
    tiers shared the target and delta ("joint": one certificate for the chain; "split", or None
    before issue 34: each tier its share). ``asked_delta``: where a promotion gate certified these
    thresholds, the delta it was asked for, of which ``delta`` is the share it spent here; a
    retrain of this bundle asks for ``asked_delta`` again, not the smaller share (None: ``delta``
    is what was asked). ``evidence_after``: where a drift alarm refuted a certificate before this
    one, when it rose (ISO 8601, UTC): these thresholds rest only on items labelled after it, and a
    gate against this bundle weighs only those (None: no alarm came before).
    ``degenerate_accepted``: certified although the teacher check flagged its labels (``cascade
    calibrate --accept-degenerate-teacher``); a retrain and a promotion gate of it accept them too,
    where they refused every attempt before (None: nothing flagged, or before it was recorded).
    """

    calibrated_at: str | None = None
    mode: Literal["agreement", "budget"] | None = None
    target: float | None = None
    delta: float | None = None
    escalation_fraction: float | None = None
    cheap_tiers: list[str] = []
    tier_target: float | None = None
    tier_delta: float | None = None
    items: int | None = None
    family_wise: bool = False
    family_size: int = 1
    unlabelled_items: int = 0
    temperature_share: float | None = None
    temperature_salt: str | None = None
    questions: dict[str, dict[str, QuestionFacts]] = {}
    skipped: dict[str, dict[str, str]] = {}
    cascade: dict[str, ReplayShares] = {}
    costs: dict[str, MeasuredCost] = {}
    flops_per_second: Positive | None = None
    payoffs: dict[str, TierPayoff] = {}
    source: Literal["audit", "both"] | None = None
    audits: AuditSpan | None = None
    certificate: Literal["joint", "split"] | None = None
    asked_delta: float | None = None
    evidence_after: Instant | None = None
    degenerate_accepted: bool | None = None

    def version(self) -> str:
        """When the thresholds were certified and a digest of the calibration that certified them:
        what answers' audits name, and what audited traffic is counted against. Fields added since
        are left out where unset, so that a bundle calibrated before keeps its version."""
        if self.calibrated_at is None:
            return "uncalibrated"
        added = ("source", "audits", "certificate", "asked_delta", "evidence_after", "degenerate_accepted")
        unset = {name for name in added if getattr(self, name) is None}
        digest = hashlib.sha256(self.model_dump_json(exclude=unset).encode()).hexdigest()
        return f"{self.calibrated_at}+{digest[:12]}"

    @property
    def certified_target(self) -> float | None:
        """The agreement the thresholds certify, which a drift alarm may watch and a server may
        promise: None before calibration and in budget mode, which sets the thresholds by the share
        escalated and certifies nothing (it still records the ``target`` it was given)."""
        return None if self.mode == "budget" else self.target

    def dropped(self) -> set[str]:
        """Cheap tiers calibration took out of the cascade: they cost more than they saved."""
        return dropped_tiers(self.payoffs)

    def facts(self, question: str, tier: str) -> QuestionFacts | None:
        """What calibration recorded for (question, tier); None where it recorded nothing."""
        return self.questions.get(question, {}).get(tier)


class FinetuneEpoch(_Section):
    """One fine-tuning epoch: its mean train loss, and the held-out loss that picks the epoch."""

    epoch: int
    train_loss: float
    held_out_loss: float
    held_out_agreement: float
    seconds: NonNegative


class EncoderParity(_Section):
    """The int8 export's vectors against the float model's on real texts: cosine per text."""

    texts: int
    min_cosine: float
    mean_cosine: float


class FinetuneSection(_Section):
    """How the encoder itself was fine-tuned on the teacher's labels (distill.training.finetune), and how
    far its int8 export is from the float model it was trained as."""

    base_model: str
    train_items: int
    held_out_items: int
    epochs: list[FinetuneEpoch]
    best_epoch: int
    seed: int
    batch_size: int
    body_learning_rate: Positive
    head_learning_rate: Positive
    max_length: int
    torch_version: str
    parity: EncoderParity | None = None


class LayerCandidate(_Section):
    """A layer ``cascade train --mid-layer auto`` tried (distill.training.mid_layer), scored on held-out
    train items: its argmax agreement with the teacher, the share kept at the target, and the
    estimated cost per item as a share of the teacher's."""

    layer: int = Field(ge=1)
    agreement: float
    kept: float
    cost: float


class TrainingSection(_Section):
    """How the encoder tier was trained: the heads' C, whether they read n-grams, how many items
    were labelled and newly embedded, the embedding cache, and the corpus field of the states."""

    C: float | None = None
    ngrams: bool | None = None
    min_train_labels: int | None = None
    labelled_items: int | None = None
    new_embeddings: int | None = None
    embedding_cache: str | None = None
    text_field: str | None = None
    finetune: FinetuneSection | None = None  # None: the shared encoder, frozen
    mid_layer: list[LayerCandidate] | None = None  # the layers a mid-layer "auto" tried
