"""One escalated request: the state, and the teacher's answer to each bundle question the cascade
sent up about it.

Escalations are the items the fast tier found hard, labelled by the teacher at no extra cost (it
had to answer them anyway). They are not a uniform sample of traffic (the serving cascade chose
them), so a retrain trains on them and never certifies on them (``distill.loop.evidence``), and they
are kept apart from audits: the drift watch counts audits alone.

Except where no choice was made: a question routing sends up whatever the item (no cheap tier
holds a threshold for it, as in a young cascade that certified nothing yet, or a drift alarm
demoted it: ``Cascade.sends_every_item_up``) is escalated on every request that asks it, so its
kept escalations are a census of that traffic, kept by a seeded share that never reads the
item. ``census`` names those questions, and a retrain may certify on a record all of whose
questions are among them.
"""

from __future__ import annotations

from pydantic import ConfigDict

from cascade.collect.labelled import LabelledState

PREFIX = "escalation:"
"""The prefix of every escalation's item id: how a store's labels name where they came from."""


class EscalationRecord(LabelledState):
    """``item_id`` is ``escalation:<request id>.<random>`` (unique, so two requests under one client
    id never meet), ``request_id`` the request's; ``teacher`` holds the escalated bundle questions
    only; ``census``: those of them routing sent up whatever the item."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    census: tuple[str, ...] = ()

    @property
    def is_census(self) -> bool:
        """Every answer it holds was escalated whatever the item: a uniform draw of traffic."""
        return bool(self.teacher) and set(self.teacher) <= set(self.census)
