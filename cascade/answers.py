"""System One answers and responses, typed as the ecosystem's clients type them.

A response is typed as System One clients type it (avrik-sdk, jev-style and typesafe-sdk parse it
unchanged)::

    {"model": "support-v1",
     "answers": {"urgent": {"type": "noul", "noul": 0.91},
                 "team": {"type": "choice", "choice": "billing", "probabilities": {...},
                          "confidence": 0.83},
                 "severity": {"type": "score", "score": 1.2, "legend": {"0": "Minor", ...},
                              "probabilities": {"0": 0.1, ...}, "confidence": 0.6}},
     "usage": {"input_tokens": 152, "output_tokens": 0},
     "audit": {"model_hash": ..., "calibration_version": ..., "prompt_template_sha256": [...],
               "allowed_token_set_hash": [...], "input_tokens": [...], "backend": ..., "precision": ...}}

Everything only this project knows sits under keys prefixed ``x_`` (``x_routing``, ``x_readout``
and ``x_calibrated`` on an answer, ``x_cascade`` in usage), which strict clients ignore. A noul
answer's distribution is its ``noul`` (the probability of true); its ``probabilities`` and
``confidence`` stay attributes here and are left off the wire. A choice or score answer's
``confidence`` follows the formula TypeSafe documents (``choice_confidence``, ``score_confidence``).
``audit`` stays unprefixed although it is this project's: avrik-sdk's ``Decision`` requires it by
that name (docs/wire-format.md, "Conformance").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from cascade.thresholds import ThresholdScore


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one on ties, so that answers are deterministic."""
    return max(range(len(values)), key=values.__getitem__)


def choice_confidence(probabilities: Sequence[float]) -> float:
    """A choice answer's ``confidence``: the top probability's way from a uniform guess to
    certainty, (k * p_max - 1) / (k - 1) for k options (0: uniform, 1: all on one option).

    The formula TypeSafe documents and System One clients read (avrik-sdk's ``Answer.confidence``,
    jev-style's ``adapter.confidence``, jevcompat's ``confidence.formula``), so a client's review
    threshold means what it means against any System One server. Nothing routes on it: thresholds
    are certified on the tier's raw probabilities (``cascade.thresholds.threshold_score``).
    """
    if len(probabilities) == 0:
        raise ValueError("probabilities: empty; need one per option")
    k = len(probabilities)
    if k == 1:
        return 1.0
    return min(1.0, max(0.0, (k * float(max(probabilities)) - 1.0) / (k - 1.0)))


def score_confidence(probabilities: Sequence[float]) -> float:
    """A score answer's ``confidence``: TypeSafe's ordinal formula, which also counts how far the
    probability sits from the most probable level m (the first on ties):
    max(0, 1 - sum_i p_i |i - m| / s), s the same spread of a uniform distribution,
    (1/n) sum_i |i - (n - 1)/2|. Like ``choice_confidence``, for clients only."""
    if len(probabilities) == 0:
        raise ValueError("probabilities: empty; need one per level")
    n = len(probabilities)
    if n == 1:
        return 1.0
    mode = argmax(probabilities)
    spread = math.fsum(float(p) * abs(i - mode) for i, p in enumerate(probabilities))
    uniform = math.fsum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return min(1.0, max(0.0, 1.0 - spread / uniform))


class Readout(BaseModel):
    """How a logit-readout scorer made its raw probabilities, so that answers can be reproduced.

    ``prompt_hash`` is the sha256 hex of the exact prompt text(s); ``letter_mass`` the share of the
    whole vocabulary's probability on the option letters (mean over the ``permutations`` option
    orders averaged), low when the model wanted to say something else; ``excerpt`` the policy
    applied to the state (e.g. ``"head_tail:1024"``), None when the whole state was read;
    ``tokens`` the prompt tokens of the question's prompts (all orders, shared prefix included).
    """

    model_config = ConfigDict(protected_namespaces=())

    model: str
    model_sha256: str | None = None
    prompt_version: str
    prompt_hash: str
    letter_mass: float
    permutations: int = 1
    excerpt: str | None = None
    tokens: int = 0


class Routing(BaseModel):
    """Which cascade tier gave an answer, what it cost, and why it stopped there.

    ``threshold`` is the one the answer cleared (or, when ``budget_limited``, failed: the budget
    could not pay to escalate it); None for the top tier, which answers whatever its confidence.
    It is compared with ``raw_score``, the tier's raw probabilities (before temperature scaling)
    reduced to the score named by ``threshold_on``: ``margin``, the top probability's lead over
    the runner-up, or ``top``, the top probability (a schema-1 bundle). ``raw_confidence`` is the
    raw top probability; the answer's ``confidence`` is the clients' formula
    (``choice_confidence``, ``score_confidence``) on its reported probabilities, after temperature.
    ``cost_ms`` is this answer's share of the predicted cost of every tier it went through.
    ``input_cut`` says how the answering tier shortened the state (e.g. the encoder's token
    limit), None when it read it whole. ``certified`` is False when the cascade escalates to
    a teacher other than the one its thresholds were certified against (accepted explicitly):
    its agreement target then says nothing about these answers. ``over_budget`` is True when the
    budget could not pay for this answer and it was given anyway: no lower tier had an answer to
    keep in its place (no head for the question, say), so it went up regardless.
    ``overloaded`` is True when a server's teacher queue was full and the answer was kept below
    instead (also ``budget_limited``, and not ``certified``). ``covered`` is False for a question
    the bundle does not hold (another instructions text, say), which a server answers with the
    teacher alone: no threshold was ever certified for it. ``demoted`` is True when a drift
    alarm on audited traffic took the question's cheap tiers out of its route (``cascade.audit``);
    ``unfamiliar`` when the encoder's gate found the state unlike its training items and sent it
    up (``cascade.encoder.familiar``). ``too_long_for`` names the GGUF tiers whose context could not
    hold the question's prompt about this state: it went past them, unread. ``uncovered_why``
    says, for a question not ``covered`` that has a bundle question's instructions, what differs.
    ``demoted_why`` says why a ``demoted`` answer skipped the cheap tiers (a drift alarm, or a
    teacher whose identity changed). ``upstream`` is True for an answer an upstream System One
    server gave (a URL teacher), False for one a model of this process computed.
    """

    tier: str
    cost_ms: float
    threshold: float | None
    raw_confidence: float
    raw_score: float
    threshold_on: ThresholdScore
    calibrated: bool
    budget_limited: bool = False
    input_cut: str | None = None
    certified: bool = True
    over_budget: bool = False
    overloaded: bool = False
    covered: bool = True
    demoted: bool = False
    unfamiliar: bool = False
    too_long_for: list[str] = Field(default_factory=list)
    uncovered_why: str | None = None
    demoted_why: str | None = None
    upstream: bool = False


def _x(name: str) -> Any:
    """A field only this project knows: ``x_``-prefixed on the wire (strict clients ignore such
    keys), left off when None, and read back under either name."""
    return Field(None, serialization_alias=f"x_{name}", validation_alias=AliasChoices(f"x_{name}", name),
                 exclude_if=lambda value: value is None)


class _AnswerBase(BaseModel):
    """What every answer carries besides its headline value: how its numbers were made."""

    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)

    calibrated: bool = Field(False, serialization_alias="x_calibrated",
                             validation_alias=AliasChoices("x_calibrated", "calibrated"))
    readout: Readout | None = _x("readout")
    routing: Routing | None = _x("routing")


class NoulAnswer(_AnswerBase):
    """``noul`` is the probability of true: the whole distribution, so it is all the wire carries."""

    type: Literal["noul"] = "noul"
    noul: float

    @property
    def probabilities(self) -> dict[str, float]:
        return {"true": self.noul, "false": 1.0 - self.noul}

    @property
    def confidence(self) -> float:
        """As a two-option choice's (``choice_confidence``): |2 * noul - 1|."""
        return choice_confidence([self.noul, 1.0 - self.noul])


class ChoiceAnswer(_AnswerBase):
    type: Literal["choice"] = "choice"
    choice: str
    probabilities: dict[str, float]
    confidence: float


class ScoreAnswer(_AnswerBase):
    """``score`` is the expected level; ``legend`` and ``probabilities`` are keyed by level,
    "0" to "N-1", the legend echoing each level's text."""

    type: Literal["score"] = "score"
    score: float
    legend: dict[str, str]
    probabilities: dict[str, float]
    confidence: float

    @property
    def level(self) -> int:
        """The most probable level (the first on ties)."""
        return argmax(list(self.probabilities.values()))


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class TierUsage(BaseModel):
    """One tier's part of a routed call about one state: the seconds the router predicted when it
    chose what to ask (what a budget was charged) beside the seconds the tier took, so that the
    prediction can be checked against what was spent."""

    predicted_seconds: float = 0.0
    seconds: float = 0.0


_CASCADE_USAGE = ("questions", "forward_passes", "seconds", "ran_on", "tiers")


class Usage(BaseModel):
    """What a call cost: prefill is the cost, so tokens and passes are counted, not answers.

    ``input_tokens`` counts the tokens every model of the call read, the encoder's included;
    nothing is generated, so ``output_tokens`` is 0. The rest goes under ``x_cascade`` on the
    wire. ``ran_on`` maps each model (a tier's name when routed, the
    GGUF's file name from a scorer) to where it ran: device, GPU layers, threads, ONNX Runtime
    provider, and any setting the machine changed from what was asked, so that nothing about the
    device is silent. ``tiers`` (routed calls only) holds each tier's predicted and measured
    seconds for the state.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    questions: int = 0
    forward_passes: int = 0  # llama_decode calls
    seconds: float = 0.0
    ran_on: dict[str, str] = {}
    tiers: dict[str, TierUsage] = {}

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        return {**{k: v for k, v in data.items() if k not in _CASCADE_USAGE},
                "x_cascade": {k: data[k] for k in _CASCADE_USAGE if k in data}}

    @model_validator(mode="before")
    @classmethod
    def _from_wire(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and isinstance(data.get("x_cascade"), Mapping):
            return {**{k: v for k, v in data.items() if k != "x_cascade"}, **data["x_cascade"]}
        return data


class Audit(BaseModel):
    """How a response was made, in the fields System One clients record (avrik-sdk requires them).

    The lists have one entry per question, in the response's order: ``prompt_template_sha256``
    identifies the readout prompt of the question (prompt version and question block, without the
    state), ``allowed_token_set_hash`` the option letters it may be answered with and the keys
    they stand for, ``input_tokens`` the tokens the answering model read for it. ``model_hash`` is
    the sha256 of the GGUF (a scorer) or of the bundle's manifest (a cascade, which pins every
    tier's file); ``calibration_version`` names the calibration the thresholds came from.
    """

    model_config = ConfigDict(protected_namespaces=())

    model_hash: str
    calibration_version: str
    prompt_template_sha256: list[str]
    allowed_token_set_hash: list[str]
    input_tokens: list[int]
    backend: str
    precision: str


class QuestionError(BaseModel):
    """Why one question of a request has no answer, while the others do: ``input_too_long``
    (no tier that may answer it could read the state, and the input policy cuts none)."""

    code: str
    message: str


class DecisionResponse(BaseModel):
    """``errors`` (``x_errors`` on the wire, absent when empty) holds the asked questions left
    without an answer, each with why; every other asked question is in ``answers``."""

    model_config = ConfigDict(protected_namespaces=(), serialize_by_alias=True, validate_by_name=True)

    model: str
    answers: dict[str, Answer]
    usage: Usage
    audit: Audit
    errors: dict[str, QuestionError] | None = _x("errors")
