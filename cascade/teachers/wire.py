"""An upstream's answers read as a teacher's distributions, wrong shapes refused.

System One servers answer a noul question with ``noul`` (P(yes)), a choice with
``probabilities`` by option key, a score with ``probabilities`` by level "0".."N-1" (see
cascade.answers). A teacher's distribution is what labels, escalations and audits use, so an
answer is taken only where it is exactly one: every asked question answered and no other, of its
type, keys exactly the question's, values finite and >= 0, summing to 1 within
``SUM_TOLERANCE``, the headline value (``choice``, ``score``) agreeing with them. Anything else is
an ``UpstreamAnswerError`` that names the question and what was wrong; nothing is repaired.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from cascade.errors import UpstreamAnswerError
from cascade.questions import Question, renormalised
from cascade.teachers.identity import EndpointIdentity, identity_of

SUM_TOLERANCE = 1e-3
"""How far from 1 an upstream's probabilities may sum: JSON numbers rounded to 4 places, not a
distribution that is off (jevcompat's ``score-sum`` fault sums to 0.8)."""
SCORE_TOLERANCE = 1e-3
"""Per level, how far a score's ``score`` may be from its distribution's expectation."""


class UpstreamAnswer(BaseModel):
    """One answer as an upstream sends it; what each type needs is checked in ``distribution``."""

    model_config = ConfigDict(extra="allow")

    type: str
    noul: float | None = None
    choice: str | None = None
    score: float | None = None
    probabilities: dict[str, float] | None = None


class UpstreamResponse(BaseModel):
    """An upstream's 200 body: the fields a teacher reads; the rest is allowed and ignored."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    answers: dict[str, UpstreamAnswer]
    audit: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None

    @property
    def input_tokens(self) -> int:
        """The prompt tokens the upstream reports (0 where it reports none or not a count)."""
        value = (self.usage or {}).get("input_tokens")
        return value if isinstance(value, int) and value >= 0 else 0

    def identity(self) -> EndpointIdentity:
        return identity_of(self.model, self.audit, list(self.answers))


def read_response(data: Any, url: str) -> UpstreamResponse:
    """An upstream's 200 body as a response, or an ``UpstreamAnswerError`` saying what is not."""
    try:
        return UpstreamResponse.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise UpstreamAnswerError(f"the upstream {url} answered 200 with a body that is not a System One "
                                  f"response: {where}: {first['msg']}; check that the URL is a "
                                  "/v1/systemone endpoint") from None


def distributions(response: UpstreamResponse, questions: Mapping[str, Question], url: str
                  ) -> dict[str, np.ndarray]:
    """Per asked question, the upstream's distribution in ``option_keys()`` order."""
    asked, answered = set(questions), set(response.answers)
    if asked != answered:
        missing, extra = sorted(asked - answered), sorted(answered - asked)
        raise UpstreamAnswerError(f"the upstream {url} answered questions {sorted(answered)}, asked "
                                  f"{sorted(asked)} (missing {missing}, not asked {extra}); its answers "
                                  "are refused whole")
    return {qid: distribution(response.answers[qid], question, f"{url}: answers.{qid}")
            for qid, question in questions.items()}


def distribution(answer: UpstreamAnswer, question: Question, where: str) -> np.ndarray:
    """One answer's distribution over ``question.option_keys()``, or the error naming ``where``."""
    if answer.type != question.type:
        raise UpstreamAnswerError(f"{where}: type {answer.type!r}, for a {question.type} question")
    if question.type == "noul":
        return np.asarray(_noul(answer, where))
    keys = question.option_keys()
    probs = answer.probabilities
    if probs is None or set(probs) != set(keys):
        raise UpstreamAnswerError(f"{where}: probabilities keyed {sorted(probs or {})}; the question's "
                                  f"keys are {sorted(keys)}")
    values = _checked([probs[key] for key in keys], where)
    _check_headline(answer, question.type, keys, values, where)
    return np.asarray(values)


def _noul(answer: UpstreamAnswer, where: str) -> list[float]:
    p = answer.noul
    if p is None or not math.isfinite(p) or not 0.0 <= p <= 1.0:
        raise UpstreamAnswerError(f"{where}: noul {p!r}; a noul answer is P(yes), a number in [0, 1]")
    return [p, 1.0 - p]


def _checked(values: list[float], where: str) -> list[float]:
    """``cascade.questions.renormalised`` within ``SUM_TOLERANCE``, refused as the upstream's fault."""
    try:
        return renormalised(values, SUM_TOLERANCE)
    except ValueError as exc:
        raise UpstreamAnswerError(f"{where}: {exc}: not a distribution") from None


def _check_headline(answer: UpstreamAnswer, kind: str, keys: list[str], values: list[float],
                    where: str) -> None:
    """The answer's own ``choice`` or ``score`` must be what its probabilities say."""
    if kind == "choice":
        top = max(values)
        best = [key for key, v in zip(keys, values, strict=True) if v >= top - 1e-9]
        if answer.choice not in best:
            raise UpstreamAnswerError(f"{where}: choice {answer.choice!r} is not its most probable "
                                      f"option {best[0]!r}; the answer contradicts itself")
        return
    expected = math.fsum(i * v for i, v in enumerate(values))
    if answer.score is None or abs(answer.score - expected) > SCORE_TOLERANCE * len(values):
        raise UpstreamAnswerError(f"{where}: score {answer.score!r} is not its probabilities' "
                                  f"expectation {expected:.4f}; the answer contradicts itself")
