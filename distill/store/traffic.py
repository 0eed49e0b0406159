"""The store's ``traffic`` table: requests a pass-through collected (``cascade.collect``), in the
order the store committed them.

A collected item keeps the client's questions and the teacher's answers as they came: the same
question may arrive under many ids, and the same state more than once. Reading them as training
data (each distinct question by content, each state once) is ``distill.collected``'s job; this
table only keeps every item, whole, in one order. The table is made on the first write (one
statement that both engines read), so stores made before it existed open unchanged and read as
holding no traffic.
"""

from __future__ import annotations

import json

from cascade.collect.record import CollectedItem
from cascade.teachers.identity import EndpointIdentity
from distill.store.backend import Backend

TABLE = "traffic"
_DDL = """CREATE TABLE IF NOT EXISTS traffic (
    seq BIGINT PRIMARY KEY,
    request_id TEXT NOT NULL,
    state TEXT NOT NULL,
    questions TEXT NOT NULL,
    answers TEXT NOT NULL,
    identity TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
)"""
TRAFFIC_PAGE = 400


def put_traffic(db: Backend, item: CollectedItem, made: bool) -> None:
    """Append ``item`` inside the caller's transaction, past ``db.serialise()`` (its number is
    the next in the store's order); ``made``: the table is known to exist already."""
    if not made:
        db.execute(_DDL)
    db.execute(
        "INSERT INTO traffic (seq, request_id, state, questions, answers, identity, created_at) "
        "SELECT COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ?, ? FROM traffic",
        (item.request_id, json.dumps(item.state), json.dumps(item.questions), json.dumps(item.answers),
         item.identity.model_dump_json(), item.at))


def traffic_after(db: Backend, position: int, limit: int = TRAFFIC_PAGE) -> list[tuple[int, CollectedItem]]:
    """Up to ``limit`` items past ``position``, in order, each with its number (none in a store
    without the table)."""
    if TABLE not in db.tables():
        return []
    rows = db.execute("SELECT seq, request_id, state, questions, answers, identity, created_at FROM traffic "
                      "WHERE seq > ? ORDER BY seq LIMIT ?", (position, limit)).fetchall()
    return [(seq, CollectedItem(request_id=rid, state=json.loads(state), questions=json.loads(questions),
                                answers=json.loads(answers),
                                identity=EndpointIdentity.model_validate_json(identity), at=at))
            for seq, rid, state, questions, answers, identity, at in rows]


def traffic_count(db: Backend) -> int:
    if TABLE not in db.tables():
        return 0
    return int(db.execute("SELECT COUNT(*) FROM traffic").fetchone()[0])
