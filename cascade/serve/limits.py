"""The work one request may carry, said in one place, and the one reader of untrusted bodies.

Every request is hostile until bounded. The body's size is bounded as it is read (``max_body``,
after inflating: ``cascade.serve.transport``); what it unpacks into is bounded here, before any
prompt is built or any model runs:

| limit | default | what it bounds | refused with |
|---|---|---|---|
| ``state_chars`` | 100,000 | the state as a prompt reads it (text, or JSON indented by 2) | 413 |
| ``state_depth`` | 32 | how deeply a JSON state, or a question's JSON instructions or criteria, nests | 422 |
| ``questions`` | 64 | questions in one request | 413 |
| ``options`` | 255 | options (or levels) of one question | 422 |
| ``options_total`` | 1,024 | options summed over the request's questions | 413 |
| ``question_chars`` | 100,000 | the questions' instructions, option texts and choice keys, summed | 413 |

The defaults sit far above what the published SDKs send in normal use (a few questions of a few
options about an email or a JSON record) and far below what would hold a worker for long: a
readout reads the state once and each question's blocks (one per 16 options, and the finalists),
so the worst request these allow is one state of 25k tokens and about a hundred short blocks.
Indented JSON is what makes the state's limit a limit on rendering: a state nested 900 deep in a
248 KB body renders to tens of MB, so its rendered length is computed first, without rendering
(``state_size``). ``read_request`` parses, validates and checks one body (``bounded_request`` one
already parsed); it is CPU work, so a handler runs it off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from cascade.questions import MAX_OPTIONS, ChoiceQuestion, DecisionRequest, Question, load_json, parse_request
from cascade.readout.prompts import state_size
from cascade.serve.transport import HttpProblem, Problem

_WHAT = {
    "state_chars": "characters of the state as a prompt reads it (text, or JSON indented by 2)",
    "state_depth": "levels of nesting in a JSON state (or a question's JSON instructions or criteria)",
    "questions": "questions in one request",
    "options": "options (or levels) of one question",
    "options_total": "options summed over the request's questions",
    "question_chars": "characters of the questions' instructions, option texts and choice keys, summed",
}


@dataclass(frozen=True)
class RequestLimits:
    """The work one request may carry (see the module's table); every field a count >= 1."""

    state_chars: int = 100_000
    state_depth: int = 32
    questions: int = 64
    options: int = MAX_OPTIONS
    options_total: int = 1024
    question_chars: int = 100_000

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RequestLimits.{name} must be a whole number >= 1; got {value!r}")
        if self.options > MAX_OPTIONS:
            raise ValueError(f"RequestLimits.options must be at most {MAX_OPTIONS}, the wire's own limit; "
                             f"got {self.options}")

    def check(self, request: DecisionRequest) -> None:
        """Refuse a request past any limit, naming it: the state first (its size is computed
        without rendering it), then the questions."""
        size = state_size(request.state, self.state_depth)
        if size.depth > self.state_depth:  # the walk stopped there: how much deeper is not known
            raise over(422, "state", "state_depth", f"more than {self.state_depth}", self.state_depth)
        if size.chars > self.state_chars:
            raise over(413, "state", "state_chars", size.chars, self.state_chars)
        self._check_questions(request.questions)

    def _check_questions(self, questions: Mapping[str, Question]) -> None:
        if len(questions) > self.questions:
            raise over(413, "questions", "questions", len(questions), self.questions)
        total = chars = 0
        for qid, question in questions.items():
            n = len(question.option_keys())
            if n > self.options:
                raise over(422, f"questions.{qid}.criteria", "options", n, self.options)
            total += n
            chars += len(question.instructions_text()) + sum(len(t or "") for t in question.option_texts())
            if isinstance(question, ChoiceQuestion):  # a prompt reads each key beside its text
                chars += sum(len(key) for key in question.option_keys())
        if total > self.options_total:
            raise over(413, "questions", "options_total", total, self.options_total)
        if chars > self.question_chars:
            raise over(413, "questions", "question_chars", chars, self.question_chars)

    def annotate(self, request: dict[str, Any], components: dict[str, Any]) -> None:
        """Write the limits into the OpenAPI schema of a request (and its question components):
        what JSON Schema can say (questions, options, a text state's length) as keywords, and
        every limit with its meaning under ``x-limits``."""
        request["x-limits"] = {name: {"max": value, "what": _WHAT[name]}
                               for name, value in asdict(self).items()}
        request["properties"]["questions"]["maxProperties"] = self.questions
        request["properties"]["state"]["x-max-rendered-chars"] = self.state_chars
        choice = components.get("ChoiceQuestion", {}).get("properties", {}).get("criteria")
        if choice is not None:
            choice.update(type="object", minProperties=2, maxProperties=self.options)


def over(status: int, path: str, limit: str, got: int | str, allowed: int) -> HttpProblem:
    """The refusal of a request past ``limit``: its status, the field it is at, and the flag."""
    flag = f"--limit-{limit.replace('_', '-')}"
    found = f"{got:,}" if isinstance(got, int) else got
    message = (f"{path}: {found} {_WHAT[limit]}, past this server's limit of {allowed:,} ({limit}; "
               f"the operator sets it with {flag}); send less per request")
    return HttpProblem(status, "limit_exceeded", message, found=[Problem(path, message.partition(": ")[2])])


def bounded_request(data: Any, limits: RequestLimits) -> DecisionRequest:
    """Validate and bound one untrusted request, parsed (``load_json``): ``RequestError`` for a
    malformed one (the caller answers 422), ``HttpProblem`` for one past a limit. The question
    count is checked on the raw JSON first, before thousands of questions are validated."""
    questions = data.get("questions") if isinstance(data, dict) else None
    if isinstance(questions, dict) and len(questions) > limits.questions:
        raise over(413, "questions", "questions", len(questions), limits.questions)
    if isinstance(questions, dict):
        _check_question_depth(questions, limits.state_depth)
    request = parse_request(data)
    limits.check(request)
    return request


def _check_question_depth(questions: Mapping[str, Any], limit: int) -> None:
    """Refuse a question whose JSON instructions or criteria nest past ``limit``, before they are
    validated (a question is JSON too: copied, rendered and logged like the state)."""
    for qid, question in questions.items():
        for field in ("instructions", "criteria"):
            value = question.get(field) if isinstance(question, dict) else None
            if isinstance(value, dict | list) and state_size(value, limit).depth > limit:
                raise over(422, f"questions.{qid}.{field}", "state_depth", f"more than {limit}", limit)


def read_request(body: bytes, limits: RequestLimits) -> DecisionRequest:
    """``bounded_request`` of a body: parsed, validated and bounded (CPU work: off the loop)."""
    return bounded_request(load_json(body), limits)
