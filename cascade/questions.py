"""System One requests: the state, the typed questions, and how each question types its answer.

A request carries one ``state`` (text, or a JSON object or array) and named ``questions`` of three
types: ``noul`` (yes or no), ``choice`` (2-255 options, shown to a model as letters A-P, 16 at a
time) and ``score`` (2-10 ordered levels). Requests are read as leniently as System One clients
write them. ``parse_request`` is the one entry point for untrusted input: every malformed request
becomes a ``RequestError`` with one line per problem, each starting with the field path. Answers
are typed in ``cascade.answers``; the wire format in full: docs/wire-format.md.
"""

import hashlib
import json
import math
import re
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from cascade.answers import (
    Answer,
    ChoiceAnswer,
    NoulAnswer,
    Readout,
    ScoreAnswer,
    argmax,
    choice_confidence,
    score_confidence,
)
from cascade.errors import RequestError

OPTION_LETTERS = "ABCDEFGHIJKLMNOP"
MIN_OPTIONS, MAX_OPTIONS = 2, 255  # the Jev API's limit; a prompt letters 16, so more are read in rounds
MIN_LEVELS, MAX_LEVELS = 2, 10
QUESTION_TYPES = ("noul", "choice", "score")
PROBABILITY_TOLERANCE = 1e-6

State = str | dict[str, Any] | list[Any]
Instructions = str | dict[str, Any] | list[Any]

_ALLOWED_TYPES = ", ".join(repr(name) for name in QUESTION_TYPES)
_SHAPES = {
    "noul": "an object with optional 'true' and 'false' descriptions",
    "choice": f"an object mapping {MIN_OPTIONS} to {MAX_OPTIONS} option keys to descriptions",
    "score": f"an array of {MIN_LEVELS} to {MAX_LEVELS} level legends (or an object mapping "
             "level labels to descriptions)",
}
_REQUIRED = {
    "state": "the text or JSON object/array to decide about",
    "questions": "an object mapping question ids to questions",
    "instructions": "what the question asks, as text or JSON",
}


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


class _FieldProblem(ValueError):
    """A problem a whole-question check finds with one of its fields, reported at that field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _label(legend: Any) -> str | None:
    """The label of a ``{"label": ..., "description": ...}`` level (description optional), else None."""
    if isinstance(legend, dict) and isinstance(legend.get("label"), str) and legend["label"].strip() \
            and set(legend) <= {"label", "description"}:
        return str(legend["label"])
    return None


def _instructions(value: Any) -> Instructions | None:
    if value is None:
        return None
    if not isinstance(value, str | dict | list):
        raise ValueError(f"must be text or a JSON object or array; got {_kind(value)}")
    if not (value.strip() if isinstance(value, str) else value):
        raise ValueError("is blank; say what the question asks, as text or JSON")
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
    return renormalised(values)


def renormalised(values: Sequence[float], tolerance: float = PROBABILITY_TOLERANCE) -> list[float]:
    """``values`` renormalised to sum to exactly 1, where they are finite, >= 0 and sum to 1
    within ``tolerance``; else ValueError. The one check for every source of probabilities (a
    scorer here, another System One server with its own looser tolerance)."""
    bad = [p for p in values if not math.isfinite(p) or p < 0]
    if bad:
        raise ValueError(f"probabilities: each must be finite and >= 0; got {bad[0]!r}")
    total = math.fsum(values)
    if abs(total - 1.0) > tolerance:
        raise ValueError(f"probabilities: must sum to 1 within {tolerance}; got sum {total!r}")
    return [p / total for p in values]


class _Question(BaseModel):
    """What every question type shares; subclasses narrow ``type`` and add ``criteria``.

    Instructions may be left out where the criteria describe the options (typesafe-sdk sends
    such questions); the prompt then asks which option applies.
    """

    type: str
    instructions: Instructions | None = None

    _check_instructions = field_validator("instructions", mode="plain")(_instructions)

    @model_validator(mode="after")
    def _something_asked(self) -> "_Question":
        if self.instructions is None and not any(self.option_texts()):
            raise _FieldProblem("instructions", f"missing; give {_REQUIRED['instructions']} (or "
                                "describe the options in criteria)")
        return self

    @abstractmethod
    def option_keys(self) -> list[str]:
        """Answer keys, in the order probabilities are given and option letters are assigned."""

    @abstractmethod
    def option_texts(self) -> list[str | None]:
        """Each option's description as prompt text, None where the request gives none."""

    @abstractmethod
    def _answer(self, p: list[float], readout: Readout | None, calibrated: bool) -> Answer: ...

    def instructions_text(self) -> str:
        return _as_text(self.instructions) or "Which option applies?"

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
        return NoulAnswer(noul=p[0], calibrated=calibrated, readout=readout)


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
            raise ValueError(f"a choice question takes {MIN_OPTIONS} to {MAX_OPTIONS} options; "
                             f"got {len(value)}")
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
        return ChoiceAnswer(choice=keys[argmax(p)], probabilities=dict(zip(keys, p, strict=True)),
                            confidence=choice_confidence(p), calibrated=calibrated, readout=readout)


class ScoreQuestion(_Question):
    """Levels are an array of legends, or one object mapping labels to descriptions, read in its
    order: avrik-sdk's ``score(instructions, levels)`` sends a mapping as it is given, so refusing
    the object form (as jevcompat's ``score.map-rejected`` asks) would break that SDK."""

    type: Literal["score"]
    criteria: list[Any]

    @field_validator("criteria", mode="plain")
    @classmethod
    def _check_criteria(cls, value: Any) -> list[Any]:
        if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
            value = [{"label": key, "description": text} if text is not None else {"label": key}
                     for key, text in value.items()]
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
        """A ``{label, description}`` level reads "label: description" in a prompt."""
        texts = []
        for legend in self.criteria:
            label = _label(legend)
            description = _as_text(legend.get("description")) if label is not None else None
            texts.append(_as_text(legend) if label is None else
                         f"{label}: {description}" if description else label)
        return texts

    def _answer(self, p: list[float], readout: Readout | None, calibrated: bool) -> Answer:
        keys = self.option_keys()
        return ScoreAnswer(score=math.fsum(i * q for i, q in enumerate(p)),
                           legend=dict(zip(keys, self.legends(), strict=True)),
                           probabilities=dict(zip(keys, p, strict=True)),
                           confidence=score_confidence(p), calibrated=calibrated, readout=readout)

    def legends(self) -> list[str]:
        """Each level's text as an answer echoes it: a ``{label}`` object's label, other JSON as
        compact JSON, and the level's number where it has none (a legend is never null)."""
        return [_label(legend) or _as_text(legend) or str(level)
                for level, legend in enumerate(self.criteria)]


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


def wording_sha256(question: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> str:
    """A hash of what a question's prompt reads (its type, instructions, option keys and texts):
    a teacher's labels of one wording are not answers to another."""
    wording = [question.type, question.instructions_text(), question.option_keys(), question.option_texts()]
    return hashlib.sha256(json.dumps(wording, ensure_ascii=False).encode()).hexdigest()


class DecisionRequest(BaseModel):
    """A request; keys other than these are ignored, as System One servers ignore them."""

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
        if (problem := state_problem(value)) is not None:  # a dict built in Python, not parsed JSON
            raise ValueError(problem)
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


def parse_request(data: str | bytes | Mapping[str, Any]) -> DecisionRequest:
    """Validate an untrusted request once, here, so that everything downstream can trust it."""
    if isinstance(data, str | bytes | bytearray):
        data = load_json(data)
    elif isinstance(data, Mapping):  # built in Python: what JSON text could not hold is refused too
        _refuse_surrogates(data, ())
    if not isinstance(data, Mapping):
        raise RequestError(f"request: must be a JSON object with 'state' and 'questions'; "
                           f"got {_kind(data)}")
    try:
        return DecisionRequest.model_validate(dict(data))
    except ValidationError as error:
        raise RequestError("\n".join(_problem(e) for e in error.errors())) from None


MAX_INT_DIGITS = 4300
"""Digits of a JSON integer: Python's own bound on converting text to int (longer is refused)."""


def load_json(text: str | bytes | bytearray) -> Any:
    """Parse JSON, refusing what ``json`` would let through silently or fail on as a bug:
    repeated keys, NaN and Infinity (also as a number too large for a float, ``1e999``), an
    integer past ``MAX_INT_DIGITS`` digits, and text no UTF-8 can hold (a lone surrogate escape,
    ``"\\ud800"``, which no tokenizer or prompt takes)."""
    repeated: dict[int, str] = {}

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) < len(pairs):
            keys = [key for key, _ in pairs]
            repeated[id(obj)] = next(k for i, k in enumerate(keys) if k in keys[:i])
        return obj

    def refuse_constant(name: str) -> Any:
        raise RequestError(f"request: invalid JSON: {name} is not a JSON value")

    def finite(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):
            raise RequestError(f"request: invalid JSON: the number {number[:40]} is too large for a float")
        return value

    def whole(number: str) -> int:
        if len(number.lstrip("-")) > MAX_INT_DIGITS:
            raise RequestError(f"request: invalid JSON: an integer of {len(number.lstrip('-')):,} digits "
                               f"(at most {MAX_INT_DIGITS:,})")
        return int(number)

    try:
        if not isinstance(text, str):
            text = bytes(text).decode("utf-8")
        data = json.loads(text, object_pairs_hook=pairs_hook, parse_constant=refuse_constant,
                          parse_float=finite, parse_int=whole)
        if _SURROGATE_ESCAPE.search(text):
            _refuse_surrogates(data, ())
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


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A surrogate written as an escape: only then can the parsed text hold a lone one."""


def _refuse_surrogates(value: Any, path: tuple[str, ...]) -> None:
    """Refuse, at its path, the first key or text that is not valid Unicode (``invalid_value``)."""
    found = invalid_value(value, path)
    if found is not None:
        raise RequestError(f"{_path(found[0])}: {found[1]}")


_LONE_SURROGATE = ("a key or text holds a lone surrogate escape (\\ud800 to \\udfff without its pair): "
                   "not valid Unicode; send the character itself, or both halves of its pair")


def invalid_value(value: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], str] | None:
    """The path of the first key or text no UTF-8 can hold (a lone surrogate: a pair of escapes
    parses to one character, which passes) or number that is not finite (NaN, which JSON has no
    word for), and why; None when there is none. A state built in Python (the library, a corpus
    line) may hold either, which no tokenizer takes: ``state_problem`` says so. Walked without
    recursion."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path, f"the number {value} is not a JSON value; send a finite number"
        texts = [*value.keys()] if isinstance(value, dict) else [value] if isinstance(value, str) else []
        for text in texts:
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return path, _LONE_SURROGATE
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((item, (*path, str(key))) for key, item in items)
    return None


def state_problem(state: Any) -> str | None:
    """Why ``state`` cannot be read (``invalid_value``, its path within the state), or None."""
    found = invalid_value(state)
    if found is None:
        return None
    return f"{'.'.join(found[0])}: {found[1]}" if found[0] else found[1]


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
        problem = error.get("ctx", {}).get("error", error["msg"])
        if isinstance(problem, _FieldProblem):
            loc = (*loc, problem.field)
        return f"{_path(loc)}: {problem}"
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
