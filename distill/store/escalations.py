"""The store's ``escalations`` table: the requests a serving cascade escalated, whose teacher
labels (in ``labels``, under each record's ``escalation:`` id) it kept to retrain on.

A table apart from ``audits``: audits are a uniform sample that the drift watch counts, and
escalations are the items the serving cascade chose, which it must never count. Made on the first
write (one statement both engines read), so stores made before it existed open unchanged and read
as holding none.
"""

from __future__ import annotations

import json

from cascade.collect.escalation import EscalationRecord
from distill.store.backend import Backend

TABLE = "escalations"
_DDL = """CREATE TABLE IF NOT EXISTS escalations (
    seq BIGINT PRIMARY KEY,
    item_id TEXT NOT NULL UNIQUE,
    request_id TEXT NOT NULL,
    state TEXT NOT NULL,
    calibration_version TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
)"""
ESCALATION_PAGE = 400


def put_escalation_row(db: Backend, record: EscalationRecord, made: bool) -> None:
    """Append ``record``'s row inside the caller's transaction, past ``db.serialise()`` (its labels
    are the caller's to insert); ``made``: the table is known to exist already."""
    if not made:
        db.execute(_DDL)
    db.execute(
        "INSERT INTO escalations (seq, item_id, request_id, state, calibration_version, created_at) "
        "SELECT COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ? FROM escalations",
        (record.item_id, record.request_id, json.dumps(record.state), record.calibration_version, record.at))


def escalation_rows_after(db: Backend, position: int, limit: int = ESCALATION_PAGE
                          ) -> list[tuple[int, str, str, str, str, float]]:
    """Up to ``limit`` rows past ``position`` in order: (seq, item, request, state JSON, calibration
    version, time); none in a store without the table."""
    if TABLE not in db.tables():
        return []
    return db.execute("SELECT seq, item_id, request_id, state, calibration_version, created_at "
                      "FROM escalations WHERE seq > ? ORDER BY seq LIMIT ?", (position, limit)).fetchall()


def escalation_count(db: Backend) -> int:
    if TABLE not in db.tables():
        return 0
    return int(db.execute("SELECT COUNT(*) FROM escalations").fetchone()[0])
