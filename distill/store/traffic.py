"""The store's ``traffic`` table: requests a pass-through collected (``cascade.collect``), in the
order the store committed them.

A collected item keeps the client's questions and the teacher's answers as they came: the same
question may arrive under many ids, and the same state more than once. Reading them as training
data (each distinct question by content, each state once) is ``distill.loop.collected``'s job; this
table only keeps every item, whole, in one order, with the probability it was collected
(``inclusion``: the share times its survival of the collector's queue). The table is made on the
first write, as every appended table is (``distill.store.appended``).
"""

from __future__ import annotations

import json
from typing import Any

from cascade.collect.record import CollectedItem
from cascade.teachers.identity import EndpointIdentity
from distill.store.appended import AppendedTable
from distill.store.backend import Backend
from distill.store.records import StoreError

TABLE = AppendedTable("traffic", (
    ("request_id", "TEXT NOT NULL"),
    ("state", "TEXT NOT NULL"),
    ("questions", "TEXT NOT NULL"),
    ("answers", "TEXT NOT NULL"),
    ("identity", "TEXT NOT NULL"),
    ("created_at", "DOUBLE PRECISION NOT NULL"),
), added=(("inclusion", "DOUBLE PRECISION"),))
TRAFFIC_PAGE = 400


def put_traffic(db: Backend, item: CollectedItem, made: bool) -> None:
    """Append ``item`` inside the caller's transaction, past ``db.serialise()`` (its number is
    the next in the store's order); ``made``: the table is known to exist already."""
    TABLE.append(db, (item.request_id, json.dumps(item.state), json.dumps(item.questions),
                      json.dumps(item.answers), item.identity.model_dump_json(), item.at,
                      item.inclusion), made)


def traffic_after(db: Backend, position: int, limit: int = TRAFFIC_PAGE) -> list[tuple[int, CollectedItem]]:
    """Up to ``limit`` items past ``position``, in order, each with its number (none in a store
    without the table)."""
    return [(row[0], _item(row[1:], db)) for row in TABLE.after(db, position, limit)]


def _item(row: tuple[Any, ...], db: Backend) -> CollectedItem:
    """One row as a collected item; a row changed outside cascade is refused as damage naming it
    (one bad row was a JSONDecodeError or ValidationError traceback, the store unreadable)."""
    rid, state, questions, answers, identity, at, inclusion = row
    try:
        return CollectedItem(request_id=rid, state=json.loads(state), questions=json.loads(questions),
                             answers=json.loads(answers), at=at, inclusion=inclusion,
                             identity=EndpointIdentity.model_validate_json(identity))
    except (ValueError, TypeError) as exc:  # JSONDecodeError and ValidationError among them
        why = " ".join(str(exc).split())[:200]
        raise StoreError(f"the collected request {rid!r} in {db.location} is damaged ({type(exc).__name__}: "
                         f"{why}); it was changed outside cascade: restore the store from a copy") from None


def traffic_count(db: Backend) -> int:
    return TABLE.count(db)
