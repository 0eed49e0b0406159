"""What a routing call's escalations teach: the teacher's answers, as a record to keep.

An item's top-tier answers to bundle questions are teacher labels that were paid for anyway;
kept in the bundle's label store (``cascade serve`` and ``cascade decide`` with
``--escalation-share``), a retrain learns from them the items the fast tier found hard. Only
answers of the teacher the certificate names are kept: callers keep none while it is void or
another teacher was accepted, since a store never mixes two teachers.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection

from cascade.collect.escalation import PREFIX, EscalationRecord
from cascade.routing.budget import Run
from cascade.routing.router import Cascade


def escalation_of(cascade: Cascade, run: Run, i: int, request_id: str, at: float,
                  census: Collection[str] | None = None, inclusion: float | None = None
                  ) -> EscalationRecord | None:
    """The teacher's answers about item ``i`` of a finished ``run`` (None where it answered none).
    ``census``: the questions routing sent up whatever the item, as they stood when ``run`` was
    routed (default: as they stand now; a server builds the record later, on another thread, and a
    drift alarm may demote a question meanwhile); ``inclusion``: the probability it was kept."""
    top = len(cascade.tiers) - 1
    if census is None:
        census = sent_up_whatever(cascade, run)
    picks = run.picks[i]
    asked = [qid for qid in run.answered[top][i] if qid in picks and picks[qid].tier == top]
    if not asked:
        return None
    teacher = {qid: dict(zip(cascade.questions[qid].option_keys(), map(float, picks[qid].raw), strict=True))
               for qid in asked}
    hashes = {qid: readout.prompt_hash for qid in asked
              if (readout := picks[qid].readout) is not None and readout.prompt_hash}
    return EscalationRecord(item_id=f"{PREFIX}{request_id}.{uuid.uuid4().hex[:12]}", request_id=request_id,
                            state=run.items[i].state, calibration_version=cascade.calibration_version,
                            at=at, teacher=teacher, prompt_hashes=hashes,
                            census=tuple(qid for qid in asked if qid in census), inclusion=inclusion)


def sent_up_whatever(cascade: Cascade, run: Run) -> frozenset[str]:
    """The questions ``run`` asked that routing sends to the top tier whatever the item."""
    asked = {qid for qids in run.asked for qid in qids}
    return frozenset(qid for qid in asked if cascade.sends_every_item_up(qid, run.budget))
