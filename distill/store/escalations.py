"""The store's ``escalations`` table: the requests a serving cascade escalated, whose teacher
labels (in ``labels``, under each record's ``escalation:`` id) it kept to retrain on.

A table apart from ``audits``: audits are a uniform sample that the drift watch counts, and
escalations are the items the serving cascade chose, which it must never count. ``census`` lists
the questions routing sent up whatever the item (``cascade.collect.escalation``), ``inclusion``
the probability the record was kept (``cascade.collect.collector``). Made on the first
write, as every appended table is (``distill.store.appended``).
"""

from __future__ import annotations

import json

from cascade.collect.escalation import EscalationRecord
from distill.store.appended import AppendedTable
from distill.store.backend import Backend

TABLE = AppendedTable("escalations", (
    ("item_id", "TEXT NOT NULL UNIQUE"),
    ("request_id", "TEXT NOT NULL"),
    ("state", "TEXT NOT NULL"),
    ("calibration_version", "TEXT NOT NULL"),
    ("created_at", "DOUBLE PRECISION NOT NULL"),
), added=(("census", "TEXT"), ("inclusion", "DOUBLE PRECISION")))
ESCALATION_PAGE = 400


def put_escalation_row(db: Backend, record: EscalationRecord, made: bool) -> None:
    """Append ``record``'s row inside the caller's transaction, past ``db.serialise()`` (its labels
    are the caller's to insert); ``made``: the table is known to exist already."""
    TABLE.append(db, (record.item_id, record.request_id, json.dumps(record.state), record.calibration_version,
                      record.at, json.dumps(record.census), record.inclusion), made)


def escalation_rows_after(db: Backend, position: int, limit: int = ESCALATION_PAGE
                          ) -> list[tuple[int, str, str, str, str, float, str | None, float | None]]:
    """Up to ``limit`` rows past ``position`` in order: (seq, item, request, state JSON, calibration
    version, time, census questions JSON, inclusion probability: None in a row written before each
    was kept); none in a store without the table."""
    return TABLE.after(db, position, limit)


def escalation_count(db: Backend) -> int:
    return TABLE.count(db)
