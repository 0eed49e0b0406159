"""One audited item: what the system answered and what the teacher answered, on every question.

The teacher reads every bundle question about an audited item (so the audit is also a uniform
sample of labelled recent traffic, to calibrate on); ``system`` holds the cascade's answers to
the questions the request asked, each the answer key it gave and the tier that gave it. An
answer outside the certificate (budget-limited, kept under overload, or a question the bundle
does not hold) is left out of ``system``: the alarm watches the certified system only.
Records are written by a sink the caller gives (``cascade`` never writes a label store itself:
``distill.store.LabelStore.put_audit`` is the one the commands pass).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pydantic import BaseModel, Field

from cascade.answers import Answer, argmax
from cascade.collect.labelled import LabelledState


class SystemAnswer(BaseModel):
    answer: str
    tier: str


class AuditRecord(LabelledState):
    """``item_id`` is ``audit:<run>:<id>`` (unique per auditing run, so it never meets a corpus id
    nor another run's audit of the same item); ``teacher`` holds every bundle question, and
    ``system`` the system's answer to each question the request asked.

    ``inclusion`` (``LabelledState``'s): the share asked for times the chance the audit survived
    the random drops of the full queues it met (``cascade.deferral``). ``routed``: per bundle
    question, how many answered items of this run (the ``<run>`` of the id) had a certified
    answer to it, this one included: the population the audits sample."""

    system: dict[str, SystemAnswer] = Field(default_factory=dict)
    routed: dict[str, int] = Field(default_factory=dict)

    def agreed(self, qid: str) -> bool:
        """Whether the system's answer to ``qid`` is the teacher's most probable one."""
        probabilities = self.teacher[qid]
        return list(probabilities)[argmax(list(probabilities.values()))] == self.system[qid].answer


AuditSink = Callable[[AuditRecord], None]
"""Where audit records go (a label store); called on the thread that audited the item."""


def answer_key(answer: Answer) -> str:
    """The option an answer picked: its most probable key (the first on ties)."""
    keys = list(answer.probabilities)
    return keys[argmax(list(answer.probabilities.values()))]


def certified_answers(answers: Mapping[str, Answer], bundle_ids: Mapping[str, str]
                      ) -> dict[str, SystemAnswer]:
    """The system's answers the certificate covers, by bundle question id."""
    out = {}
    for qid, answer in answers.items():
        routing = answer.routing
        if qid not in bundle_ids or routing is None:
            continue
        if routing.budget_limited or routing.overloaded or not routing.covered or not routing.certified:
            continue
        out[bundle_ids[qid]] = SystemAnswer(answer=answer_key(answer), tier=routing.tier)
    return out
