"""The serving parts that need no server: the upstream's price and ledger, the bundle path a
promotion replaces (a folder, a link, a pointer file), and the collector's share and size on a
real label store."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

from cascade.collect.collector import Collector
from cascade.collect.record import collected_item
from cascade.cost.upstream import UpstreamLedger, UpstreamPrice
from cascade.errors import CascadeError, QueueFullError
from cascade.questions import parse_request
from cascade.serve.swap import BundleWatch, Version, resolve, version_of
from cascade.teachers.admission import RateAdmission
from cascade.teachers.identity import EndpointIdentity
from distill.loop.collected import StoreTraffic, collected

QUESTIONS = parse_request({"state": "-", "questions": {
    "urgent": {"type": "noul", "instructions": "Does this convey urgency?"}}}).questions


def test_a_price_is_parsed_with_its_unit_and_refused_with_what_to_give() -> None:
    given = UpstreamPrice.parse("request=0.002,question=0.0005,unit=EUR")
    assert given == UpstreamPrice(0.002, 0.0005, "EUR")
    assert UpstreamPrice.parse("question=1") == UpstreamPrice(0.0, 1.0, "USD")
    for bad in ("request", "per=1", "request=-1", "request=x"):
        with pytest.raises(CascadeError, match="--upstream-price"):
            UpstreamPrice.parse(bad)
    with pytest.raises(CascadeError, match="request is given twice"):  # the second silently won
        UpstreamPrice.parse("request=1,request=2,unit=USD")
    with pytest.raises(CascadeError, match="unit= is empty"):  # printed "12  spent"
        UpstreamPrice.parse("request=1,unit=")


def test_the_ledger_prices_what_went_up_against_forwarding_every_request_whole() -> None:
    ledger = UpstreamLedger(UpstreamPrice(1.0, 0.1, "USD"))
    ledger.request(asked=3, sent=0)  # answered here
    ledger.request(asked=3, sent=1, seconds=0.5)  # one question of three went up
    ledger.audit(questions=2)
    book = ledger.ledger()
    assert (book.requests, book.asked, book.calls, book.sent, book.saved_calls, book.saved_questions) == \
        (2, 6, 1, 1, 1, 5)
    assert book.spent == pytest.approx(2 * 1.0 + 3 * 0.1)  # the call, the audit, their questions
    assert book.saved == pytest.approx(2 * 1.0 + 6 * 0.1 - book.spent)


def test_without_a_price_the_ledger_fits_seconds_per_call_and_per_question() -> None:
    ledger = UpstreamLedger()
    for questions in (1, 2, 3, 4):
        ledger.request(asked=4, sent=questions, seconds=0.2 + 0.05 * questions)
    per_request, per_question, unit = ledger.rates()
    assert (per_request, per_question, unit) == (pytest.approx(0.2), pytest.approx(0.05), "s")


def test_the_ledgers_costs_only_grow_as_the_latency_fit_moves() -> None:
    """Priced when they happen: a fit that falls (the first call was slow) reprices nothing, so
    /metrics can export both sums as counters. Priced again at each scrape, forwarded would fall
    from 101 s to about 21 s here."""
    ledger = UpstreamLedger()
    ledger.request(asked=1, sent=1, seconds=1.0)  # the first call: 1 s, so a request costs 1 s
    for _ in range(100):
        ledger.request(asked=1, sent=0)  # answered here: forwarding it would have cost 1 s
    books = [ledger.ledger()]
    for _ in range(9):  # faster calls: the fit falls toward 0.1 s
        ledger.request(asked=1, sent=1, seconds=0.1)
        books.append(ledger.ledger())
    fitted = [(1.0 + 0.1 * k) / (1 + k) for k in range(1, 10)]  # a request's price after each call
    assert ledger.rates()[0] == pytest.approx(fitted[-1])
    assert books[0].forwarded == pytest.approx(101.0) and books[0].spent == pytest.approx(1.0)
    assert books[-1].forwarded == pytest.approx(101.0 + sum(fitted))
    assert books[-1].spent == pytest.approx(1.0 + sum(fitted))
    for earlier, later in itertools.pairwise(books):
        assert later.forwarded >= earlier.forwarded and later.spent >= earlier.spent
    assert books[-1].saved == pytest.approx(books[-1].forwarded - books[-1].spent)


def test_a_bundle_path_is_a_folder_a_link_or_a_pointer_file(tmp_path: Path) -> None:
    for name in ("v1", "v2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(f'{{"name": "{name}"}}')
    link, pointer = tmp_path / "current", tmp_path / "CURRENT"
    link.symlink_to("v1")
    pointer.write_text("v2\n")
    assert resolve(tmp_path / "v1") == resolve(link) == (tmp_path / "v1").resolve()
    assert resolve(pointer) == (tmp_path / "v2").resolve()
    (tmp_path / "empty").write_text("")
    with pytest.raises(CascadeError, match="is empty"):
        resolve(tmp_path / "empty")
    with pytest.raises(CascadeError, match="no bundle at"):
        resolve(tmp_path)


def test_the_watch_swaps_once_per_new_version_and_keeps_serving_past_a_failed_one(tmp_path: Path) -> None:
    for name in ("v1", "v2", "v3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(f'{{"name": "{name}"}}')
    link = tmp_path / "current"
    link.symlink_to("v1")
    swapped: list[Version] = []

    def swap(version: Version) -> None:
        if version.directory.name == "v2":
            raise CascadeError("v2 does not load")
        swapped.append(version)

    watch = BundleWatch(link, version_of(link), swap, interval=0)  # checked here, not on a timer
    try:
        assert not watch.check()
        _repoint(link, "v2")
        assert not watch.check() and not watch.check()  # failed once, not retried until it changes
        assert watch.current.directory.name == "v1" and watch.failures == 1
        _repoint(link, "v3")
        assert watch.check() and not watch.check()
    finally:
        watch.close()
    assert [v.directory.name for v in swapped] == ["v3"] and watch.swaps == 1


def _repoint(link: Path, target: str) -> None:
    fresh = link.with_name("current.tmp")
    fresh.symlink_to(target)
    os.replace(fresh, link)


def test_the_collector_keeps_its_share_and_stops_at_its_size(tmp_path: Path) -> None:
    store = tmp_path / "traffic.sqlite"
    identity = EndpointIdentity(model="m1")

    def item(k: int) -> object:
        return lambda inclusion: collected_item(f"r{k}", QUESTIONS, f"state {k}",
                                                {"urgent": np.array([0.7, 0.3])}, identity, 0.0, inclusion)

    sink = StoreTraffic(store)
    collector = Collector(sink, share=0.5, max_items=5, seed="s")
    for k in range(40):
        collector.offer(item(k))  # type: ignore[arg-type]
    collector.close()
    sink.close()
    counts = collector.counts
    assert counts["collected"] == 5 and counts["full"] + counts["not_chosen"] + 5 == 40
    assert counts["not_chosen"] > 0
    assert [i.answers["urgent"] for i in collected(store)] == [{"true": 0.7, "false": 0.3}] * 5
    assert [i.inclusion for i in collected(store)] == [0.5] * 5  # the share: its queue dropped none
    again = Collector(StoreTraffic(store), share=1.0, max_items=5)  # a restart counts what the store holds
    again.offer(item(99))  # type: ignore[arg-type]
    again.close()
    assert again.counts["full"] == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_upstreams_queue_is_admitted_by_its_measured_throughput() -> None:
    """Four slots upstream: calls end every 0.25 s while busy, though each takes 1 s; the wait is
    the requests ahead over that throughput, not their count times a call's latency."""
    clock = _Clock()
    gate = RateAdmission(max_wait=2.0, first_guess=1.0, clock=clock)
    tickets = [gate.enter() for _ in range(3)]  # 0, 1 and 2 ahead, guessed at 1 s each
    with pytest.raises(QueueFullError, match=r"3 request\(s\) ahead"):
        gate.enter()
    starts = [gate.started(ticket) for ticket in tickets]
    for ticket, start in zip(tickets, starts, strict=True):
        clock.now += 0.25
        gate.done(ticket, start)
    assert gate.service == pytest.approx(0.25, rel=0.3)
    more = [gate.enter() for _ in range(8)]  # 7 ahead x about 0.25 s fits 2 s
    assert len(more) == 8 and gate.inside == 8
    clock.now += 3.0  # nothing ends for 3 s: the upstream stalls, and newcomers are refused
    with pytest.raises(QueueFullError):
        gate.enter()


def test_a_request_that_waited_past_max_wait_is_refused_when_its_service_would_start() -> None:
    clock = _Clock()
    gate = RateAdmission(max_wait=2.0, first_guess=0.5, clock=clock)
    first, second = gate.enter(), gate.enter()  # 1 ahead x 0.5 s: admitted
    assert gate.late(first) is None
    clock.now += 3.5  # the first took 3.5 s, not 0.5: the second has waited past 2 s
    refusal = gate.late(second)
    assert refusal is not None and (refusal.status, refusal.retry_after) == (503, 2)
    assert "waited 3.5 s in its queue" in str(refusal)


def test_a_teacher_served_alone_admits_only_waits_its_cascades_can_read_to_the_end() -> None:
    """A cascade reads its URL teacher for at most ``read_timeout`` (8 s). A teacher served alone
    admitting 8 s of expected wait, as a cascade's own queue does, would let a request wait 8 s and
    then be read past that: a 504 where a 503 with Retry-After was due. So its default leaves at
    least 3 s for the read, and a cascade (or pass-through) keeps 8 s, below the SDKs' 10 s."""
    from cascade.serve.lifecycle import ServeOptions, _wait
    from cascade.serve.teacher import TeacherConfig
    from cascade.teachers.settings import UpstreamSettings

    read = UpstreamSettings("http://127.0.0.1:9/v1/systemone").read_timeout
    assert _wait(ServeOptions(), alone=True) == TeacherConfig().max_wait <= read - 3
    assert _wait(ServeOptions()) == 8.0 < 10
    assert _wait(ServeOptions(max_wait=2.5), alone=True) == _wait(ServeOptions(max_wait=2.5)) == 2.5
