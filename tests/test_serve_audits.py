"""Audits that keep up with a busy server, each with a known inclusion probability.

The deferral queue's random drops give every audit a survival probability whose inverse is an
unbiased weight; the store keeps it, with the routed counts, on both backends; and ``cascade
serve`` over real HTTP on loopback audits every chosen item of a burst through a real upstream
teacher server (gemma-3-270m, the bundle's certified teacher), and with a local teacher defers
audits behind live requests and drops the overflow at random, counted by reason in ``/metrics``.
Every wait is bounded on a condition (``servers.until``), never on the time taken.
"""

from __future__ import annotations

import random
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pgserver
import pytest
from corpora import QUESTIONS_JSON, corpus_items
from servers import KEPT, running, serving_bundle, teacher_server, until, upstream

from cascade.audit.auditor import Auditor
from cascade.audit.record import AuditRecord, SystemAnswer
from cascade.audit.stream import StreamFollower
from cascade.audit.watch import DriftWatch
from cascade.bundle.manifest import Bundle
from cascade.collect.escalation import EscalationRecord
from cascade.collect.record import collected_item
from cascade.deferral import DeferralQueue, Deferred
from cascade.questions import parse_request
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig
from cascade.serve.audit_pool import AuditPool
from cascade.serve.engine_settings import EngineSettings
from cascade.teachers.identity import EndpointIdentity
from cascade.teachers.settings import UpstreamSettings
from distill.loop.auditing import StoreSink, auditor_for, stored_audits
from distill.loop.collected import StoreTraffic, collected
from distill.store import LabelStore
from distill.store.records import Teacher

pytest_plugins = ("pgfixtures",)  # place: the store test on both backends; halting_postgres
OUTCOMES = ("audited", "dropped", "failed", "unreadable")


def test_a_full_queue_drops_at_random_and_the_inverse_survival_weighs_each_audit_up_to_the_whole() -> None:
    """A slow taker (one audit taken per three deferred) behind a queue of 4: two thirds are
    dropped. Dropping the newcomer by rule would leave every survival at 1, and the weights would
    add up to the audits taken, a third of the whole; drawn at random, they add up to the whole."""
    put = 30_000
    for seed in range(3):
        queue: DeferralQueue[int] = DeferralQueue(4, random.Random(seed))
        taken, dropped_waiting, weight = 0, 0, 0.0
        for n in range(put):
            dropped = queue.put(n)
            assert len(dropped) <= 1
            dropped_waiting += sum(d != n for d in dropped)
            if n % 3 == 0 and (deferred := queue.take()) is not None:
                if n % 7 == 0:  # an upstream asked to wait: put back, its survival kept
                    queue.put_back(deferred)
                    continue
                assert 0 < deferred.survival <= 1
                taken, weight = taken + 1, weight + 1 / deferred.survival
        while (deferred := queue.take()) is not None:
            taken, weight = taken + 1, weight + 1 / deferred.survival
        assert taken < put / 2 and dropped_waiting > put / 4
        assert abs(weight - put) < 0.02 * put


def test_a_queue_bounded_by_size_draws_until_what_waits_fits_and_still_weighs_up_to_the_whole() -> None:
    """Items of sizes 1-9 behind a budget of 20 (and a count bound never reached): a large
    newcomer takes several draws, each uniform among what waits and itself. The inverse
    survivals of what is taken still add up to every item put, and to every byte put: the sizes
    set how many draws there were, not who is spared in one. An item larger than the budget is
    dropped at once, without a draw."""
    put = 40_000
    for seed in range(3):
        rng = random.Random(seed + 10)
        queue: DeferralQueue[int] = DeferralQueue(1000, random.Random(seed), max_size=20)
        sizes = [rng.randint(1, 9) for _ in range(put)]
        weight = weighed_bytes = 0.0
        several = 0
        for n, size in enumerate(sizes):
            dropped = queue.put(n, size)
            several += len(dropped) > 1
            assert queue.size <= 20 and queue.size == sum(s for *_, s in queue._waiting)
            if n % 4 == 0 and (deferred := queue.take()) is not None:
                assert deferred.size == sizes[deferred.item]
                weight += 1 / deferred.survival
                weighed_bytes += deferred.size / deferred.survival
        while (deferred := queue.take()) is not None:
            weight += 1 / deferred.survival
            weighed_bytes += deferred.size / deferred.survival
        assert several > put / 20  # a newcomer often dropped more than one
        assert abs(weight - put) < 0.03 * put
        assert abs(weighed_bytes - sum(sizes)) < 0.03 * sum(sizes)
    assert DeferralQueue[str](4, max_size=5).put("large", 6) == ["large"]


def test_a_stopping_store_thread_writes_what_waits_unless_a_write_outlasts_the_drain() -> None:
    """The store's thread (an ``AuditPool`` of one) given a drain: it takes every audit still
    waiting where the store keeps up; where a write stalls, ``stop`` returns once the drain is
    spent, the audits behind it left waiting (the engine counts them dropped, stopped)."""
    done: list[int] = []
    writing, freed = threading.Event(), threading.Event()

    def write(deferred: Deferred[int]) -> None:
        writing.set()
        if deferred.item == 0 and not freed.is_set():
            freed.wait(60)  # a store that stalls until the test frees it
        done.append(deferred.item)

    for stalled in (False, True):
        done.clear()
        writes: DeferralQueue[int] = DeferralQueue(8)
        for n in range(3):
            writes.put(n)
        if not stalled:
            freed.set()
        pool = AuditPool("store", writes, write, 1)
        pool.wake()
        assert writing.wait(60)  # the first write has begun
        pool.stop(drain=0.5 if stalled else 60)
        left = len(writes)
        freed.set()
        for thread in pool._threads:
            thread.join(60)
        assert (done, left) == (([0], 2) if stalled else ([0, 1, 2], 0))
        freed.clear()
        writing.clear()


def test_the_store_keeps_each_audit_s_inclusion_probability_and_routed_counts(
        place: Callable[[str], str]) -> None:
    path = place("labels.db")
    teacher = Teacher(kind="gguf", model="m.gguf", model_sha256="0" * 64, prompt_version="v1")
    record = AuditRecord(item_id="audit:r:1", state="state", calibration_version="v", at=1.0,
                         teacher={"team": {"billing": 0.7, "sales": 0.3}},
                         system={"team": SystemAnswer(answer="billing", tier="encoder")},
                         inclusion=0.25, routed={"team": 7})
    sink = StoreSink(path, teacher)
    try:
        sink(record)
        sink(record.model_copy(update={"item_id": "audit:r:2", "inclusion": None, "routed": {}}))
    finally:
        sink.close()
    with LabelStore.open_existing(path) as store:
        read = store.audits()
    assert [(r.inclusion, r.routed) for r in read] == [(0.25, {"team": 7}), (None, {})]
    with pytest.raises(ValueError, match="inclusion"):  # a probability of 0 would be an infinite weight
        AuditRecord.model_validate(record.model_dump() | {"inclusion": 0.0})


def test_the_store_keeps_the_inclusion_of_each_escalation_and_collected_request(
        place: Callable[[str], str]) -> None:
    """Census escalations and collected traffic certify as uniform draws: each keeps the
    probability its collector kept it with, as an audit does (None where it was not known)."""
    teacher = Teacher(kind="gguf", model="m.gguf", model_sha256="0" * 64, prompt_version="v1")
    escalated = EscalationRecord(item_id="escalation:r1.a", request_id="r1", state="state",
                                 calibration_version="v", at=1.0,
                                 teacher={"team": {"billing": 0.7, "sales": 0.3}}, census=("team",),
                                 inclusion=0.125)
    questions = parse_request({"state": "s", "questions": {"urgent": QUESTIONS_JSON[KEPT]}}).questions
    forwarded = [collected_item(f"r{k}", questions, f"s{k}", {"urgent": [0.7, 0.3]},
                                EndpointIdentity(model="m1"), 0.0, inclusion)
                 for k, inclusion in ((0, 0.5), (1, None))]
    with LabelStore(place("labels.db"), teacher) as store:
        store.put_escalation(escalated)
        store.put_escalation(escalated.model_copy(update={"item_id": "escalation:r1.b", "inclusion": None}))
        assert [r.inclusion for _, r in store.escalations_after(0)] == [0.125, None]
    traffic = place("traffic.db")
    sink = StoreTraffic(traffic)
    try:
        for item in forwarded:
            sink.append(item)
    finally:
        sink.close()
    assert [item.inclusion for item in collected(traffic)] == [0.5, None]


def test_a_watch_whose_read_stalls_on_the_store_stops_within_its_wait(postgres_url: str) -> None:
    """Another session holds an exclusive lock on the audits (for real, on PostgreSQL): the
    follower's read waits for it. Closing the follower (a swap retiring its bundle, a shutdown)
    returns after its wait instead of with the lock, and so does closing its store (which the read
    holds): the read closes the connection as it ends."""
    import psycopg

    teacher = Teacher(kind="gguf", model="m.gguf", model_sha256="0" * 64, prompt_version="v1")
    sink = StoreSink(postgres_url, teacher)
    sink(AuditRecord(item_id="audit:r:1", state="s", calibration_version="v", at=1.0,
                     teacher={"team": {"billing": 1.0}}))
    follower = StreamFollower(DriftWatch(["team"], 0.9, 0.05, "v"), sink, lambda qid: None)
    assert follower.catch_up() == 1
    waiting = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND state = 'active' "
               "AND query LIKE '%FROM audits%'")
    with psycopg.connect(postgres_url) as locker, psycopg.connect(postgres_url, autocommit=True) as seer:
        locker.execute("LOCK TABLE audits IN ACCESS EXCLUSIVE MODE")
        follower.follow(0.05)  # each statement of ``seer`` reads the activity afresh
        until(lambda: seer.execute(waiting).fetchone() == (1,), "the follower's read waiting on the lock")
        returned = []
        for close in (follower.close, sink.shared.close):  # as Auditor.close: the watch, then the store
            closing = threading.Thread(target=close, args=(0.2,))
            closing.start()
            closing.join(60)
            returned.append(not closing.is_alive())
        locker.rollback()
    assert returned == [True, True]
    until(lambda: sink.shared._store is None, "the read, once freed, closing the connection")


def test_a_store_made_before_the_design_columns_reads_them_as_unknown_and_gains_them_when_written(
        tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    teacher = Teacher(kind="gguf", model="m.gguf", model_sha256="0" * 64, prompt_version="v1")
    LabelStore(path, teacher).close()
    with sqlite3.connect(path) as db:  # the audits table as the cascade before them made it
        db.execute("ALTER TABLE audits DROP COLUMN inclusion")
        db.execute("ALTER TABLE audits DROP COLUMN routed")
        db.execute("INSERT INTO audits (item_id, state, calibration_version, system, created_at, seq) "
                   "VALUES ('audit:r:0', '\"old\"', 'v', '{}', 0.0, 1)")
    db.close()
    with LabelStore.open_existing(path) as store:
        assert [(r.item_id, r.inclusion, r.routed) for r in store.audits()] == [("audit:r:0", None, {})]
    with LabelStore(path, teacher) as store:
        store.put_audit(AuditRecord(item_id="audit:r:1", state="new", calibration_version="v", at=1.0,
                                    teacher={"team": {"billing": 1.0}}, inclusion=0.5, routed={"team": 2}))
        assert [(r.inclusion, r.routed) for r in store.audits()] == [(None, {}), (0.5, {"team": 2})]
        escalated = EscalationRecord(item_id="escalation:r.0", request_id="r", state="s",
                                     calibration_version="v", at=1.0, teacher={"team": {"billing": 1.0}},
                                     inclusion=0.5)
        store.put_escalation(escalated)
    with sqlite3.connect(path) as db:  # the escalations table as the cascade before inclusion made it
        db.execute("ALTER TABLE escalations DROP COLUMN inclusion")
    db.close()
    with LabelStore(path, teacher) as store:
        assert [r.inclusion for _, r in store.escalations_after(0)] == [None]
        store.put_escalation(escalated.model_copy(update={"item_id": "escalation:r.1"}))
        assert [r.inclusion for _, r in store.escalations_after(0)] == [None, 0.5]


# --- cascade serve under a burst ---


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("audits") / "support", gemma_path)


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path) -> Iterator[Any]:
    """The teacher server, admitting every request however long it waits: these tests count
    audits, not refusals, and a loaded machine can push gemma's wait past the 8 s default."""
    with upstream(teacher_server(gemma_path, None, "--max-wait", "600")) as server:
        yield server


def auditing(store: Path | str, sinks: list[StoreSink]) -> Callable[[Cascade], Auditor | None]:
    """The server's audit hook: every answered request chosen (share 1), the alarm only reported
    (so that every request keeps its route), the records in ``store``."""
    def audit(cascade: Cascade) -> Auditor | None:
        auditor, sink = auditor_for(cascade, store, 1.0, "s", "alarm")
        assert sink is not None
        sinks.append(sink)
        return auditor
    return audit


def burst(base: str, n: int, clients: int = 8, questions: tuple[str, ...] = (KEPT,)) -> list[int]:
    """``n`` requests of ``questions`` (default: the one the encoder keeps), from ``clients`` at
    once: their statuses."""
    texts = [item.text for item in corpus_items()]

    def one(k: int) -> int:
        body = {"state": f"{texts[k % len(texts)]} (case {k})",
                "questions": {qid: QUESTIONS_JSON[qid] for qid in questions}}
        reply = httpx.post(f"{base}/v1/systemone", json=body, timeout=120)
        if reply.status_code != 200:  # printed: pytest shows it beside a failed assertion
            print(f"request {k}: {reply.status_code} {reply.text[:300]}")
        return reply.status_code
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(n)))


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def settled(base: str, n: int) -> Callable[[], bool]:  # gemma on shared cores: bounded at 600 s
    """Whether every one of ``n`` chosen audits has an outcome."""
    names = [f'cascade_audits_total{{outcome="{o}"}}' for o in OUTCOMES]
    return lambda: sum(metrics(base).get(name, 0.0) for name in names) >= n


def audited_burst(load: Callable[[], Cascade], engine: EngineSettings, store: Path,
                  n: int, questions: tuple[str, ...] = (KEPT,)) -> dict[str, float]:
    """``burst`` of ``n`` requests at a server auditing each into ``store``, all answered 200;
    its metrics once every chosen audit has an outcome."""
    sinks = list[StoreSink]()
    with running(load, ServeConfig(engine=engine, audit=auditing(store, sinks))) as base:
        assert burst(base, n, questions=questions) == [200] * n
        until(settled(base, n), "every chosen audit has an outcome", 600)
        seen = metrics(base)
    for sink in sinks:
        sink.close()
    return seen


def young_copy(bundle_dir: Path, to: Path) -> tuple[str, ...]:
    """A copy of the bundle with no threshold (every question goes to the teacher); its questions."""
    shutil.copytree(bundle_dir, to)
    manifest = Bundle.load(to).manifest
    bare = {qid: dict.fromkeys(row) for qid, row in manifest.thresholds.items()}
    Bundle(manifest.model_copy(update={"thresholds": bare}), to).save()
    return tuple(manifest.questions)


def test_with_an_upstream_teacher_every_item_of_a_burst_is_audited_on_the_upstream_s_capacity(
        bundle_dir: Path, gemma_server: Any, tmp_path: Path) -> None:
    """16 requests from 8 clients, answered at the encoder, each chosen for audit: the audits run
    on the upstream (a teacher server on one thread: 2 at once, waited for as long as it takes),
    never waiting for local requests, so none is dropped and each record carries inclusion 1 and
    its routed count."""
    n = 16
    patient = UpstreamSettings(gemma_server.url, read_timeout=120, deadline=120)
    load = lambda: Cascade.load(bundle_dir, teacher=patient, threads=1)  # noqa: E731
    seen = audited_burst(load, EngineSettings(audit_in_flight=2), tmp_path / "labels.sqlite", n)
    assert seen['cascade_audits_total{outcome="audited"}'] == n
    assert seen['cascade_audits_dropped_total{reason="queue_full"}'] == 0
    assert seen["cascade_audit_share_asked"] == 1.0 and seen["cascade_audit_share_realised"] == 1.0
    assert seen['cascade_audit_requests_total{count="eligible"}'] == n
    assert seen[f'cascade_audit_routed_total{{question="{KEPT}"}}'] == n
    assert seen['cascade_upstream_total{count="audit_calls"}'] == n  # each answer was the encoder's
    assert seen["cascade_audits_answered_above_total"] == 0
    records = stored_audits(tmp_path / "labels.sqlite")
    assert len(records) == n and {r.inclusion for r in records} == {1.0}
    assert sorted(r.routed[KEPT] for r in records) == list(range(1, n + 1))  # each item counted once


def test_an_item_the_upstream_answered_on_every_question_is_audited_with_no_second_call(
        bundle_dir: Path, gemma_server: Any, tmp_path: Path) -> None:
    """A young cascade (no threshold: every question goes upstream) audited at share 1: each
    audit records the answers its request already got from the teacher, so the upstream sees no
    audit call, and every record agrees with the system by construction."""
    young = tmp_path / "young"
    n, every = 6, young_copy(bundle_dir, young)
    patient = UpstreamSettings(gemma_server.url, read_timeout=120, deadline=120)
    load = lambda: Cascade.load(young, teacher=patient, threads=1)  # noqa: E731
    # every request waits on the upstream's admission: patient, as a loaded machine may be slow
    patient_engine = EngineSettings(audit_in_flight=2, max_wait=600)
    seen = audited_burst(load, patient_engine, tmp_path / "labels.sqlite", n, every)
    assert seen['cascade_audits_total{outcome="audited"}'] == n == seen["cascade_audits_answered_above_total"]
    assert seen['cascade_upstream_total{count="audit_calls"}'] == 0
    assert seen['cascade_upstream_total{count="calls"}'] == n  # the requests' own
    records = stored_audits(tmp_path / "labels.sqlite")
    assert len(records) == n and all(set(r.teacher) == set(every) == set(r.system) for r in records)
    assert all(r.agreed(qid) and r.system[qid].tier == "teacher" for r in records for qid in every)


def test_with_a_local_teacher_an_audit_of_an_item_it_answered_never_waits_for_it_and_is_not_dropped(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    """The burst of the test below, behind the same audit queue of 1, but every question sent up:
    each audit needs no teacher, so none waits for the busy teacher's worker and none is dropped,
    and every record carries inclusion 1 (the share asked for)."""
    n, every = 12, young_copy(bundle_dir, tmp_path / "young")
    load = lambda: Cascade.load(tmp_path / "young", teacher=gemma_path, threads=2)  # noqa: E731
    patient = EngineSettings(audit_queue=1, max_wait=600)  # every request admitted, on a loaded machine too
    seen = audited_burst(load, patient, tmp_path / "labels.sqlite", n, every)
    assert seen['cascade_audits_total{outcome="audited"}'] == n == seen["cascade_audits_answered_above_total"]
    assert seen['cascade_audits_dropped_total{reason="queue_full"}'] == 0
    records = stored_audits(tmp_path / "labels.sqlite")
    assert len(records) == n and {r.inclusion for r in records} == {1.0}
    assert all(r.agreed(qid) and r.system[qid].tier == "teacher" for r in records for qid in every)


def test_a_store_that_stalls_holds_up_no_request_and_its_audits_are_written_once_it_frees(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    """Another writer holds the store's write lock (a real SQLite lock, as a stalled replica or a
    long migration would) while requests keep coming to a local teacher, every question sent up:
    each is answered while the lock is held, since the workers hand audits to the store's own
    thread instead of writing them. Released, the waiting audits are written: none failed or lost.
    (A worker that wrote them itself waited out the store's 30 s busy timeout per audit, and each
    of those writes failed.)"""
    n, every = 4, young_copy(bundle_dir, tmp_path / "young")
    store, sinks = tmp_path / "labels.sqlite", list[StoreSink]()
    load = lambda: Cascade.load(tmp_path / "young", teacher=gemma_path, threads=2)  # noqa: E731
    with running(load, ServeConfig(audit=auditing(store, sinks))) as base:
        assert burst(base, 1, clients=1, questions=every) == [200]  # the store is made at the first
        until(settled(base, 1), "the first audit written", 600)
        lock = sqlite3.connect(store, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            statuses = [burst(base, 1, clients=1, questions=every)[0] for _ in range(n)]
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        until(settled(base, n + 1), "every audit has an outcome", 600)
        seen = metrics(base)
    for sink in sinks:
        sink.close()
    assert statuses == [200] * n
    assert seen['cascade_audits_total{outcome="audited"}'] == n + 1
    assert seen.get('cascade_audits_total{outcome="failed"}', 0.0) == 0
    assert len(stored_audits(store)) == n + 1


def test_audits_made_while_the_postgresql_store_is_down_are_written_once_it_is_back(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path, halting_postgres: pgserver.Server) -> None:
    """The store's PostgreSQL server halts (every session ended, new ones refused) while requests
    keep coming, then starts again: every request is answered meanwhile, ``/metrics`` says how long
    the store has been down, and every audit is written once the store answers, none failed or
    lost. (Before, each audit the store could not take was counted failed and lost.)"""
    n, every = 4, young_copy(bundle_dir, tmp_path / "young")
    url, sinks = halting_postgres.url, list[StoreSink]()
    load = lambda: Cascade.load(tmp_path / "young", teacher=gemma_path, threads=2)  # noqa: E731
    with running(load, ServeConfig(audit=auditing(url, sinks))) as base:
        assert burst(base, 1, clients=1, questions=every) == [200]
        until(settled(base, 1), "the first audit written", 600)
        halting_postgres.halt()
        try:
            statuses = [burst(base, 1, clients=1, questions=every)[0] for _ in range(n)]
            until(lambda: metrics(base)["cascade_store_unavailable_seconds"] > 0, "/metrics saying so")
        finally:
            halting_postgres.resume()
        until(settled(base, n + 1), "every audit has an outcome", 600)
        seen = metrics(base)
    assert seen["cascade_store_unavailable_seconds"] == 0
    for sink in sinks:
        sink.close()
    assert statuses == [200] * n
    assert seen['cascade_audits_total{outcome="audited"}'] == n + 1
    assert seen.get('cascade_audits_total{outcome="failed"}', 0.0) == 0
    assert len(stored_audits(url)) == n + 1


def test_audits_an_upstream_refuses_with_503_wait_its_retry_after_and_are_none_of_them_lost(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    """A teacher server that admits a request only while nothing waits (``--max-wait 0.01``),
    four audits sent at once, and no client retry: the upstream refuses some with 503 and
    Retry-After. Each refused audit is put back and every audit thread waits out the pause
    (``cascade_audit_pauses_total`` counts them), then it is audited: none dropped, failed or lost, and each
    record still carries inclusion 1."""
    n = 8
    with upstream(teacher_server(gemma_path, None, "--max-wait", "0.01")) as strict:
        impatient = UpstreamSettings(strict.url, read_timeout=120, deadline=120, retries=0)
        load = lambda: Cascade.load(bundle_dir, teacher=impatient, threads=1)  # noqa: E731
        seen = audited_burst(load, EngineSettings(audit_in_flight=4), tmp_path / "labels.sqlite", n)
    assert seen['cascade_audit_pauses_total'] >= 1  # the upstream did refuse some
    assert seen['cascade_audits_total{outcome="audited"}'] == n
    assert seen.get('cascade_audits_total{outcome="failed"}', 0.0) == 0
    assert seen['cascade_audits_dropped_total{reason="queue_full"}'] == 0
    records = stored_audits(tmp_path / "labels.sqlite")
    assert len(records) == n and {r.inclusion for r in records} == {1.0}


def test_with_a_local_teacher_audits_wait_for_live_requests_and_the_overflow_is_dropped_at_random(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    """A burst behind an audit queue of 1 on the local teacher's one worker: the audits it cannot
    take are dropped, counted with their reason, and every stored record carries its inclusion
    probability, the share times its survival of the random drops."""
    n = 12
    load = lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2)  # noqa: E731
    patient = EngineSettings(audit_queue=1, max_wait=600)  # every request admitted, on a loaded machine too
    seen = audited_burst(load, patient, tmp_path / "labels.sqlite", n)
    audited = seen['cascade_audits_total{outcome="audited"}']
    dropped = seen['cascade_audits_dropped_total{reason="queue_full"}']
    assert dropped >= 1 and seen['cascade_audits_total{outcome="dropped"}'] == dropped
    assert audited + dropped == n == seen['cascade_audit_requests_total{count="chosen"}']
    assert seen["cascade_audit_share_asked"] == 1.0 and seen["cascade_audit_share_realised"] == audited / n
    records = stored_audits(tmp_path / "labels.sqlite")
    assert len(records) == audited
    assert all(r.inclusion is not None and 0 < r.inclusion <= 1 for r in records)
    assert all(1 <= r.routed[KEPT] <= n for r in records)
