"""Which of a request's questions the bundle holds: matched by content, never by id alone.

Clients name questions as they like ("q1", "urgent", ...), so an id says nothing; what the
thresholds certify is a question's content: its type, the text of its instructions and its
options as a prompt reads them. A request question with the content of a bundle question gets the
cascade under whatever id it has; one with the id of a bundle question but other content (edited
instructions, another option) is not that question, and is answered by the teacher alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cascade.questions import Question


def content_key(question: Question) -> tuple[object, ...]:
    """What a question's answers depend on: the same key gives the same prompt and heads."""
    return (question.type, question.instructions_text(), tuple(question.option_keys()),
            tuple(question.option_texts()))


@dataclass(frozen=True)
class Matched:
    """A request's questions split: ``bundle`` maps each request id the bundle holds to the
    bundle's id for it; ``foreign`` holds the others, by request id; ``near`` says, for a foreign
    question that has a bundle question's type and instructions, what differs (an SDK helper
    that leaves out the criteria, say), so its answer says why the bundle did not cover it."""

    bundle: dict[str, str]
    foreign: dict[str, Question]
    near: dict[str, str] = field(default_factory=dict)

    @property
    def asked(self) -> list[str]:
        """The bundle questions to route, each once (two request ids may ask the same one)."""
        return list(dict.fromkeys(self.bundle.values()))


class QuestionIndex:
    """A bundle's questions by content, built once per server."""

    def __init__(self, questions: Mapping[str, Question]) -> None:
        self._by_content: dict[tuple[object, ...], str] = {}
        self._by_text: dict[tuple[str, str], tuple[str, Question]] = {}
        for qid, question in questions.items():
            self._by_content.setdefault(content_key(question), qid)
            self._by_text.setdefault((question.type, question.instructions_text()), (qid, question))

    def match(self, questions: Mapping[str, Question]) -> Matched:
        bundle: dict[str, str] = {}
        foreign: dict[str, Question] = {}
        near: dict[str, str] = {}
        for qid, question in questions.items():
            known = self._by_content.get(content_key(question))
            if known is not None:
                bundle[qid] = known
                continue
            foreign[qid] = question
            if (why := self._near(question)) is not None:
                near[qid] = why
        return Matched(bundle, foreign, near)

    def _near(self, question: Question) -> str | None:
        """What keeps a question with a bundle question's type and instructions from matching it."""
        found = self._by_text.get((question.type, question.instructions_text()))
        if found is None:
            return None
        known, theirs = found
        what = ("option keys" if question.option_keys() != theirs.option_keys() else
                "option descriptions (criteria)")
        return (f"the bundle's question {known!r} has these instructions but other {what}: its "
                f"thresholds certify that question only; send its {what} to be routed")
