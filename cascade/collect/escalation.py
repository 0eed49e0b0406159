"""One escalated request: the state, and the teacher's answer to each bundle question the cascade
sent up about it.

Escalations are the items the fast tier found hard, labelled by the teacher at no extra cost (it
had to answer them anyway). They are not a uniform sample of traffic (the serving cascade chose
them), so a retrain trains on them and never certifies on them (``distill.loop.evidence``), and they
are kept apart from audits: the drift watch counts audits alone.
"""

from __future__ import annotations

from pydantic import ConfigDict

from cascade.collect.labelled import LabelledState

PREFIX = "escalation:"
"""The prefix of every escalation's item id: how a store's labels name where they came from."""


class EscalationRecord(LabelledState):
    """``item_id`` is ``escalation:<request id>.<random>`` (unique, so two requests under one client
    id never meet), ``request_id`` the request's; ``teacher`` holds the escalated bundle questions
    only."""

    model_config = ConfigDict(frozen=True)

    request_id: str
