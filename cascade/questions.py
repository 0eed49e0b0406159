"""System One wire types: decision requests, typed questions and their answers.

A request carries one ``state`` (text, or a JSON object or array) and named ``questions``::

    {"state": "Help! My payouts have been failing for three days.",
     "questions": {"urgent": {"type": "noul", "instructions": "Does this convey urgency?"}},
     "model": "optional model name"}

``noul`` asks yes or no; its optional ``criteria`` say what ``true`` and ``false`` mean. ``choice``
picks one of 2-16 options; its ``criteria`` map option keys (shown to a model as letters A-P) to
descriptions. ``score`` picks one of 2-10 ordered levels; its ``criteria`` list the level legends,
level 0 first. Instructions are text or a JSON object; descriptions and legends are text, JSON or
null.

A response maps each question id to an answer holding the whole distribution over the options,
the headline value (``noul``, ``choice`` or ``score``), a confidence, and how the numbers were
made (``readout``, ``calibrated``), plus the ``usage`` the call cost.

``parse_request`` is the one entry point for untrusted input: every malformed request becomes a
``RequestError`` with one line per problem, each starting with the field path.
"""

import json
import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from cascade.calibration_math import ThresholdScore
from cascade.errors import RequestError

OPTION_LETTERS = "ABCDEFGHIJKLMNOP"
MIN_OPTIONS, MAX_OPTIONS = 2, len(OPTION_LETTERS)
MIN_LEVELS, MAX_LEVELS = 2, 10
QUESTION_TYPES = ("noul", "choice", "score")
PROBABILITY_TOLERANCE = 1e-6

State = str | dict[str, Any] | list[Any]
Instructions = str | dict[str, Any]

_ALLOWED_TYPES = ", ".join(repr(name) for name in QUESTION_TYPES)
_SHAPES = {
    "noul": "an object with optional 'true' and 'false' descriptions",
    "choice": f"an object mapping {MIN_OPTIONS} to {MAX_OPTIONS} option keys to descriptions",
    "score": f"an array of {MIN_LEVELS} to {MAX_LEVELS} level legends",
}
_REQUIRED = {
    "state": "the text or JSON object/array to decide about",
    "questions": "an object mapping question ids to questions",
    "instructions": "what the question asks, as text or a JSON object",
}
_FIELDS = {0: "'state', 'questions', 'model'", 2: "'type', 'instructions', 'criteria'"}


def _kind(value: Any) -> str:
    """Name a value's JSON kind, so that messages speak the request's language, not Python's."""
    if value is None:
        return "null"
    kinds = ((bool, "boolean"), (int | float, "number"), (str, "text"), (dict, "object"),
             (list, "array"))
    return next((name for cls, name in kinds if isinstance(value, cls)), type(value).__name__)


def _as_text(value: Any) -> str | None:
    """Render JSON compactly, so that equal content gives an equal prompt and prompt hash."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _instructions(value: Any) -> Instructions:
    if not isinstance(value, str | dict):
        raise ValueError(f"must be text or a JSON object; got {_kind(value)}")
    if not (value.strip() if isinstance(value, str) else value):
        raise ValueError("is blank; say what the question asks, as text or a JSON object")
    return value


def _check_description(value: Any, what: str = "") -> Any:
    if value is not None and not isinstance(value, str | dict | list):
        raise ValueError(f"{what}must be text, a JSON object, a JSON array or null; "
                         f"got {_kind(value)}")
    return value


def _distribution(probabilities: Sequence[float], keys: list[str]) -> list[float]:
    """Check a scorer's numbers and remove float drift, so that every answer sums to exactly 1."""
    values = [float(p) for p in probabilities]
    if len(values) != len(keys):
        raise ValueError(f"probabilities: expected {len(keys)}, one per option {keys}; "
                         f"got {len(values)}")
    bad = [p for p in values if not math.isfinite(p) or p < 0]
    if bad:
        raise ValueError(f"probabilities: each must be finite and >= 0; got {bad[0]!r}")
    total = math.fsum(values)
    if abs(total - 1.0) > PROBABILITY_TOLERANCE:
        raise ValueError(f"probabilities: must sum to 1 within {PROBABILITY_TOLERANCE}; "
                         f"got sum {total!r}")
    return [p / total for p in values]


def _argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one on ties, so that answers are deterministic."""
    return max(range(len(values)), key=values.__getitem__)


def confidence(probabilities: Sequence[float]) -> float:
    """The largest probability: the chance, by the scorer's own numbers, that its argmax is right.

    Unlike entropy or the top-two margin, it is itself a probability of the answer reported, so a
    threshold on it reads directly ("accept when at least 90% sure"), and once calibrated it means
    expected agreement whatever the number of options, so thresholds compare across questions.
    """
    if len(probabilities) == 0:
        raise ValueError("probabilities: empty; need one per option")
    return float(max(probabilities))


class Readout(BaseModel):
    """How a logit-readout scorer made its raw probabilities, so that answers can be reproduced.

    ``prompt_hash`` is the sha256 hex of the exact prompt text(s); ``letter_mass`` the share of the
    whole vocabulary's probability on the option letters (mean over the ``permutations`` option
    orders averaged), low when the model wanted to say something else; ``excerpt`` the policy
    applied to the state (e.g. ``"head_tail:1024"``), None when the whole state was read.
    """

    model_config = ConfigDict(protected_namespaces=())

    model: str
    model_sha256: str | None = None
    prompt_version: str
    prompt_hash: str
    letter_mass: float
    permutations: int = 1
    excerpt: str | None = None


class Routing(BaseModel):
    """Which cascade tier gave an answer, what it cost, and why it stopped there.

    ``threshold`` is the one the answer cleared (or, when ``budget_limited``, failed: the budget
    could not pay to escalate it); None for the top tier, which answers whatever its confidence.
    It is compared with ``raw_score``, the tier's raw probabilities (before temperature scaling)
    reduced to the score named by ``threshold_on``: ``margin``, the top probability's lead over
    the runner-up, or ``top``, the top probability (a schema-1 bundle). ``raw_confidence`` is the
    raw top probability; the answer's ``confidence`` is the top probability after temperature.
    ``cost_ms`` is this answer's share of the predicted cost of every tier it went through.
    ``input_cut`` says how the answering tier shortened the state (e.g. the encoder's token
    limit), None when it read it whole. ``certified`` is False when the cascade escalates to
    a teacher other than the one its thresholds were certified against (accepted explicitly):
    its agreement target then says nothing about these answers. ``over_budget`` is True when the
    budget could not pay for this answer and it was given anyway: no lower tier had an answer to
    keep in its place (no head for the question, say), so it went up regardless.
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


class _AnswerBase(BaseModel):
    """What every answer carries besides its headline value: the distribution and its provenance."""

    probabilities: dict[str, float]
    confidence: float
    calibrated: bool = False
    readout: Readout | None = None
    routing: Routing | None = None


class NoulAnswer(_AnswerBase):
    type: Literal["noul"] = "noul"
    noul: float


class ChoiceAnswer(_AnswerBase):
    type: Literal["choice"] = "choice"
    choice: str


class ScoreAnswer(_AnswerBase):
    type: Literal["score"] = "score"
    score: float
    level: int
    legend: Any


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class _Question(BaseModel):
    """What every question type shares; subclasses narrow ``type`` and add ``criteria``."""

    model_config = ConfigDict(extra="forbid")

    type: str
    instructions: Instructions

    _check_instructions = field_validator("instructions", mode="plain")(_instructions)

    @abstractmethod
    def option_keys(self) -> list[str]:
        """Answer keys, in the order probabilities are given and option letters are assigned."""

    @abstractmethod
    def option_texts(self) -> list[str | None]:
        """Each option's description as prompt text, None where the request gives none."""

    @abstractmethod
    def _answer(self, p: list[float], readout: Readout | None, calibrated: bool) -> Answer: ...

    def instructions_text(self) -> str:
        return _as_text(self.instructions) or ""

    def answer(
        self,
        probabilities: Sequence[float],
        readout: Readout | None = None,
        calibrated: bool = False,
    ) -> Answer:
        """Type a distribution (in ``option_keys()`` order) as this question's answer.

        Numbers that are not a distribution raise ``ValueError`` rather than being normalised
        away: only float drift within 1e-6 is a rounding matter, anything more is a scorer bug.
        """
        return self._answer(_distribution(probabilities, self.option_keys()), readout, calibrated)


class NoulCriteria(BaseModel):
    """What yes and what no mean; either may be left out."""

    model_config = ConfigDict(extra="forbid")

    true: Any = None
    false: Any = None

    _check = field_validator("true", "false", mode="plain")(_check_description)


class NoulQuestion(_Question):
    type: Literal["noul"]
    criteria: NoulCriteria | None = None

    @field_validator("criteria", mode="before")
    @classmethod
    def _check_criteria(cls, value: Any) -> Any:
        if value is None or isinstance(value, NoulCriteria):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"a noul question's criteria must be {_SHAPES['noul']}; "
                             f"got {_kind(value)}")
        for key in value:
            if key not in ("true", "false"):
                raise ValueError(f"unknown key {key!r}; a noul question's criteria are "
                                 f"{_SHAPES['noul']}")
        return value

    def option_keys(self) -> list[str]:
        return ["true", "false"]

    def option_texts(self) -> list[str | None]:
        if self.criteria is None:
            return [None, None]
        return [_as_text(self.criteria.true), _as_text(self.criteria.false)]

    def _answer(self, p: list[float], readout: Readout | None, calibrated: bool) -> Answer:
        yes = p[0]
        return NoulAnswer(noul=yes, probabilities={"true": yes, "false": 1.0 - yes},
                          confidence=confidence([yes, 1.0 - yes]), calibrated=calibrated,
                          readout=readout)


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    criteria: dict[str, Any]

    @field_validator("criteria", mode="plain")
    @classmethod
    def _check_criteria(cls, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise ValueError(f"a choice question's criteria must be {_SHAPES['choice']}; "
                             f"got {_kind(value)}")
        if not MIN_OPTIONS <= len(value) <= MAX_OPTIONS:
            raise ValueError(f"a choice question takes {MIN_OPTIONS} to {MAX_OPTIONS} options "
                             f"(letters A-{OPTION_LETTERS[-1]}); got {len(value)}")
        for key, description in value.items():
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"option key {key!r} is empty; give each option a name")
            _check_description(description, f"option {key!r}: description ")
        return dict(value)

    def option_keys(self) -> list[str]:
        return list(self.criteria)

    def option_texts(self) -> list[str | None]:
        return [_as_text(description) for description in self.criteria.values()]

    def _answer(self, p: list[float], readout: Readout | None, calibrated: bool) -> Answer:
        keys = self.option_keys()
        return ChoiceAnswer(choice=keys[_argmax(p)], probabilities=dict(zip(keys, p, strict=True)),
                            confidence=confidence(p), calibrated=calibrated, readout=readout)


class ScoreQuestion(_Question):
    type: Literal["score"]
    criteria: list[Any]

    @field_validator("criteria", mode="plain")
    @classmethod
    def _check_criteria(cls, value: Any) -> list[Any]:
        if not isinstance(value, list | tuple):
            raise ValueError(f"a score question's criteria must be {_SHAPES['score']}; "
                             f"got {_kind(value)}")
        if not MIN_LEVELS <= len(value) <= MAX_LEVELS:
            raise ValueError(f"a score question takes {MIN_LEVELS} to {MAX_LEVELS} levels; "
                             f"got {len(value)}")
        for level, legend in enumerate(value):
            _check_description(legend, f"level {level} legend ")
        return list(value)

    def option_keys(self) -> list[str]:
        return [str(level) for level in range(len(self.criteria))]

    def option_texts(self) -> list[str | None]:
        return [_as_text(legend) for legend in self.criteria]

    def _answer(self, p: list[float], readout: Readout | None, calibrated: bool) -> Answer:
        level = _argmax(p)
        return ScoreAnswer(score=math.fsum(i * q for i, q in enumerate(p)), level=level,
                           legend=self.criteria[level],
                           probabilities=dict(zip(self.option_keys(), p, strict=True)),
                           confidence=confidence(p), calibrated=calibrated, readout=readout)


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class DecisionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: State
    questions: dict[str, Question]
    model: str | None = None

    @field_validator("state", mode="plain")
    @classmethod
    def _check_state(cls, value: Any) -> State:
        if not isinstance(value, str | dict | list):
            raise ValueError(f"must be text or a JSON object or array; got {_kind(value)}")
        if not (value.strip() if isinstance(value, str) else value):
            raise ValueError(f"is empty; give {_REQUIRED['state']}")
        return value

    @field_validator("questions", mode="before")
    @classmethod
    def _check_questions(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ValueError(f"must be {_REQUIRED['questions']}; got {_kind(value)}")
        if not value:
            raise ValueError("is empty; ask at least one question")
        for qid in value:
            if not isinstance(qid, str) or not qid.strip():
                raise ValueError(f"question id {qid!r} is empty; give each question a name")
        return value


class TierUsage(BaseModel):
    """One tier's part of a routed call about one state: the seconds the router predicted when it
    chose what to ask (what a budget was charged) beside the seconds the tier took, so that the
    prediction can be checked against what was spent."""

    predicted_seconds: float = 0.0
    seconds: float = 0.0


class Usage(BaseModel):
    """What a call cost: prefill is the cost, so tokens and passes are counted, not answers.

    ``ran_on`` maps each model (a tier's name when routed, the GGUF's file name from a scorer)
    to where it ran: device, GPU layers, threads, ONNX Runtime provider, and any setting the
    machine changed from what was asked, so that nothing about the device is silent. ``tiers``
    (routed calls only) holds each tier's predicted and measured seconds for the state.
    """

    questions: int = 0
    prompt_tokens: int = 0  # tokens run through a model
    forward_passes: int = 0  # llama_decode calls
    seconds: float = 0.0
    ran_on: dict[str, str] = {}
    tiers: dict[str, TierUsage] = {}


class DecisionResponse(BaseModel):
    answers: dict[str, Answer]
    usage: Usage


def parse_request(data: str | bytes | Mapping[str, Any]) -> DecisionRequest:
    """Validate an untrusted request once, here, so that everything downstream can trust it."""
    if isinstance(data, str | bytes | bytearray):
        data = _loads(data)
    if not isinstance(data, Mapping):
        raise RequestError(f"request: must be a JSON object with 'state' and 'questions'; "
                           f"got {_kind(data)}")
    try:
        return DecisionRequest.model_validate(dict(data))
    except ValidationError as error:
        raise RequestError("\n".join(_problem(e) for e in error.errors())) from None


def _loads(text: str | bytes | bytearray) -> Any:
    """Parse JSON, refusing what ``json`` would let through silently: repeated keys and NaN."""
    repeated: dict[int, str] = {}

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) < len(pairs):
            keys = [key for key, _ in pairs]
            repeated[id(obj)] = next(k for i, k in enumerate(keys) if k in keys[:i])
        return obj

    def refuse_constant(name: str) -> Any:
        raise RequestError(f"request: invalid JSON: {name} is not a JSON value")

    try:
        if not isinstance(text, str):
            text = bytes(text).decode("utf-8")
        data = json.loads(text, object_pairs_hook=pairs_hook, parse_constant=refuse_constant)
        found = _find_repeated(data, (), repeated) if repeated else None
    except UnicodeDecodeError as error:
        raise RequestError(f"request: not UTF-8 ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise RequestError(f"request: invalid JSON at line {error.lineno}, column {error.colno}: "
                           f"{error.msg}") from None
    except RecursionError:
        raise RequestError("request: JSON nested too deeply") from None
    if found is not None:
        path, key = found
        criteria = len(path) == 3 and path[0] == "questions" and path[2] == "criteria"
        option = "option " if criteria else ""
        raise RequestError(f"{_path(path)}: duplicate {option}key {key!r}")
    return data


def _find_repeated(value: Any, path: tuple[str, ...], repeated: dict[int, str]) -> Any:
    """Path and key of the first object (depth first) that the JSON text gave a key twice."""
    if isinstance(value, dict) and id(value) in repeated:
        return path, repeated[id(value)]
    if not isinstance(value, dict | list):
        return None
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        if found := _find_repeated(item, (*path, str(key)), repeated):
            return found
    return None


def _path(loc: Sequence[Any]) -> str:
    return ".".join(str(part) for part in loc) or "request"


def _problem(error: ErrorDetails) -> str:
    """One line for one pydantic problem: the request's field path, then what to fix."""
    raw, kind, value = tuple(error["loc"]), error["type"], error["input"]
    tagged = len(raw) > 2 and raw[0] == "questions" and raw[2] in QUESTION_TYPES
    loc = raw[:2] + raw[3:] if tagged else raw
    if kind == "value_error":
        return f"{_path(loc)}: {error.get('ctx', {}).get('error', error['msg'])}"
    if kind == "extra_forbidden":
        allowed = f"; allowed: {_FIELDS[len(loc) - 1]}" if len(loc) - 1 in _FIELDS else ""
        return f"{_path(loc[:-1])}: unknown field {loc[-1]!r}{allowed}"
    if kind == "union_tag_not_found":
        return f"{_path(loc)}.type: missing; allowed types: {_ALLOWED_TYPES}"
    if kind == "union_tag_invalid":
        return f"{_path(loc)}.type: unknown type {value['type']!r}; allowed types: {_ALLOWED_TYPES}"
    if kind in ("model_attributes_type", "model_type", "dict_type"):
        return f"{_path(loc)}: must be a JSON object; got {_kind(value)}"
    if kind == "string_type":
        return f"{_path(loc)}: must be text; got {_kind(value)}"
    if kind == "missing":
        field = str(loc[-1])
        hint = _SHAPES[str(raw[2])] if field == "criteria" and tagged else _REQUIRED.get(field)
        return f"{_path(loc)}: missing; give {hint}" if hint else f"{_path(loc)}: missing"
    return f"{_path(loc)}: {error['msg']}"
