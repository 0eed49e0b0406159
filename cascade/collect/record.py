"""One collected request: the state, the questions as the client sent them, the upstream's answer
to each as a distribution, and the identity the answer stated.

A pass-through in front of a teacher URL (``cascade serve --teacher URL --collect S``) starts a
cascade from zero data: the traffic it forwards is labelled by the teacher as it passes. What a
trainer needs from it is the teacher's full distribution per question (not only its argmax), the
question's content (so that the same question asked under two ids is one question), and the
teacher's identity (so that labels from two teachers never mix: a store refuses the second).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cascade.questions import Question, State, parse_request
from cascade.teachers.identity import EndpointIdentity


class CollectedItem(BaseModel):
    """``questions``: each question's wire JSON under the client's id; ``answers``: per question
    id, the upstream's probabilities by option key (noul: ``true``/``false``); ``identity``: the
    teacher the answer named; ``at``: seconds since the epoch; ``inclusion``: the probability it
    was collected (the share times its survival of the collector's queue; None in items collected
    before it was kept)."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    request_id: str
    state: State
    questions: dict[str, dict[str, Any]]
    answers: dict[str, dict[str, float]]
    identity: EndpointIdentity
    at: float
    inclusion: float | None = Field(default=None, gt=0, le=1)

    def parsed_questions(self) -> dict[str, Question]:
        """The questions as typed objects (they were valid when collected)."""
        return dict(parse_request({"state": self.state, "questions": self.questions}).questions)

    @property
    def state_sha256(self) -> str:
        """The state's content hash: the same state collected twice is one training item."""
        return hashlib.sha256(json.dumps(self.state, sort_keys=True).encode()).hexdigest()


def collected_item(request_id: str, questions: Mapping[str, Question], state: State,
                   distributions: Mapping[str, Any], identity: EndpointIdentity, at: float,
                   inclusion: float | None = None) -> CollectedItem:
    """The record of one answered request; ``distributions`` per question id in ``option_keys()``
    order (as ``cascade.teachers.wire.distributions`` reads them); ``inclusion``: the
    probability it was collected."""
    wire = {qid: q.model_dump(mode="json", exclude_none=True) for qid, q in questions.items()}
    answers = {qid: dict(zip(questions[qid].option_keys(), map(float, probs), strict=True))
               for qid, probs in distributions.items()}
    return CollectedItem(request_id=request_id, state=state, questions=wire, answers=answers,
                         identity=identity, at=at, inclusion=inclusion)
