"""A store that goes away while a server writes to it: a PostgreSQL server halted and started
again for real (a throwaway cluster of this test's own, on loopback), and a write retried after
its commit. The writers wait the outage out with the items queued, and lose none of them."""

from __future__ import annotations

import functools
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pgserver
import pytest
from corpora import QUESTIONS_JSON
from servers import KEPT, until

import distill.store.sqlite as sqlite_backend
from cascade.backoff import down_for
from cascade.collect.collector import Collector
from cascade.collect.escalation import EscalationRecord
from cascade.collect.record import CollectedItem, collected_item
from cascade.questions import parse_request
from cascade.teachers.identity import EndpointIdentity
from distill.loop.collected import StoreTraffic, collected
from distill.loop.escalations import StoreEscalations
from distill.store import LabelStore, Teacher

pytest_plugins = ("pgfixtures",)  # halting_postgres; place: the retried write on both backends
GGUF = Teacher(kind="gguf", model="m.gguf", model_sha256="0" * 64, prompt_version="v1")
TEACHER = {"team": {"billing": 0.7, "technical": 0.2, "sales": 0.1}}


def escalation(n: int, inclusion: float = 1.0) -> EscalationRecord:
    return EscalationRecord(item_id=f"escalation:r{n}.x", request_id=f"r{n}", state=f"state {n}",
                            calibration_version="v", at=float(n), teacher=TEACHER, inclusion=inclusion)


def forwarded(n: int, inclusion: float = 1.0) -> CollectedItem:
    questions = parse_request({"state": "s", "questions": {"urgent": QUESTIONS_JSON[KEPT]}}).questions
    return collected_item(f"r{n}", questions, f"state {n}", {"urgent": [0.7, 0.3]},
                          EndpointIdentity(model="m1"), float(n), inclusion)


@pytest.mark.parametrize("kind", ["escalations", "traffic"])
def test_items_collected_while_postgresql_is_down_wait_and_are_all_stored_once_it_is_back(
        halting_postgres: pgserver.Server, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """The server halts (every session ended, new ones refused) between two items, five more come
    while it is down, and it starts again: the collector waits with them queued, then writes them
    all, in order, each once. None is counted failed or dropped, and the collector never stops
    (before, the lost connection's error stopped it with an alarm, for good, and the items that
    came meanwhile were lost)."""
    url = halting_postgres.url
    sink: StoreEscalations | StoreTraffic = (StoreEscalations(url, GGUF) if kind == "escalations"
                                             else StoreTraffic(url))
    make: Callable[[int, float], EscalationRecord | CollectedItem] = (
        escalation if kind == "escalations" else forwarded)
    collector = Collector(sink, share=1.0, what=kind)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="cascade")
    try:
        collector.offer(functools.partial(make, 0))
        until(lambda: collector.counts["collected"] == 1, "the first item written")
        halting_postgres.halt()
        for n in range(1, 6):
            collector.offer(functools.partial(make, n))
        until(lambda: "the store is unavailable" in caplog.text, "the writer meeting the outage")
        assert collector.stopped is None and collector.counts["collected"] == 1
        assert down_for(collector.backoff) > 0  # what /metrics states
        halting_postgres.resume()
        until(lambda: collector.counts["collected"] == 6, "every item written once the server is back")
        assert down_for(collector.backoff) == 0
    finally:
        collector.close()
        sink.close()
    assert collector.counts["failed"] == collector.counts["dropped"] == 0
    assert "the store answers again after" in caplog.text
    if kind == "escalations":
        with LabelStore.open_existing(halting_postgres.url) as store:
            ids = [record.request_id for _, record in store.escalations_after(0)]
    else:
        ids = [item.request_id for item in collected(halting_postgres.url)]
    assert ids == [f"r{n}" for n in range(6)]


def test_a_collector_stopping_while_the_store_is_still_down_returns_after_its_drain(
        halting_postgres: pgserver.Server) -> None:
    """A store that stays down never holds up a shutdown: the collector gives its drain, then
    counts what it could not write as dropped."""
    sink = StoreEscalations(halting_postgres.url, GGUF)
    collector = Collector(sink, share=1.0, what="escalations")
    halting_postgres.halt()
    try:
        for n in range(3):
            collector.offer(functools.partial(escalation, n))
        collector.close(drain=0.5)
    finally:
        sink.close()
        halting_postgres.resume()
    assert collector.counts["dropped"] == 3 and collector.counts["collected"] == 0
    assert collector.stopped is None


def test_a_write_retried_after_its_commit_is_stored_once(place: Callable[[str], str]) -> None:
    """A connection that ends as its transaction commits leaves the writer not knowing whether
    the store took the item: it writes it again, and the store keeps one."""
    with LabelStore(place("labels.db"), GGUF) as store:
        for record in (escalation(0), escalation(0), escalation(1)):
            store.put_escalation(record)
        assert [record.request_id for _, record in store.escalations_after(0)] == ["r0", "r1"]


def test_escalations_wait_out_a_sqlite_lock_held_past_the_busy_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Another writer holds a SQLite store's lock for longer than a write waits for it (30 s; 0.2 s
    here): the store is unavailable, not broken, so the collector keeps the items and writes them
    once the lock is let go. (Before, each was counted failed and lost.)"""
    monkeypatch.setattr(sqlite_backend, "BUSY_WAIT", 0.2)
    path = tmp_path / "labels.db"
    LabelStore(path, GGUF).close()
    sink = StoreEscalations(path, GGUF)
    collector = Collector(sink, share=1.0, what="escalations")
    caplog.set_level(logging.WARNING, logger="cascade")
    lock = sqlite3.connect(path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        for n in range(2):
            collector.offer(functools.partial(escalation, n))
        until(lambda: "stayed locked by another writer for 0.2 s" in caplog.text, "a write meeting the lock")
        lock.execute("ROLLBACK")
        until(lambda: collector.counts["collected"] == 2, "both written once the lock is let go")
    finally:
        lock.close()
        collector.close()
        sink.close()
    assert collector.counts["failed"] == collector.counts["dropped"] == 0
    with LabelStore.open_existing(path) as store:
        assert [record.request_id for _, record in store.escalations_after(0)] == ["r0", "r1"]
