"""A running ``cascade serve`` takes a promoted bundle without dropping a request.

``--bundle`` is a link (or a pointer file) that a promotion replaces in one rename
(``cascade.serve.swap``). Requests are driven through the swap from several clients and counted:
every one is answered (none refused, none lost), by exactly one version, each client sees the old
version and then only the new one, and /metrics counts the same. The drift watch starts again on
the new calibration version. Through the command, SIGHUP takes the promotion at once. Ten swaps in
a row leave one cascade alive, and no more store descriptors or threads than one swap does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pgserver
import pytest
from corpora import QUESTIONS_JSON, corpus_items
from prometheus_client.parser import text_string_to_metric_families
from servers import KEPT, free_port, serving, serving_bundle, until

from bench.swap_memory import recalibrated
from cascade.bundle.manifest import Bundle
from cascade.routing.router import Cascade
from cascade.serve.app import BundleSource, ServeConfig, create_app
from cascade.serve.engine_settings import EngineSettings
from distill.loop.auditing import StoreAudits, auditor_for

pytest_plugins = ("pgfixtures",)  # halting_postgres
STATE = corpus_items()[5].text
CLIENTS, MOST = 4, 2500  # each client stops after MOST requests at the latest


@pytest.fixture(scope="module")
def versions(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, Path]:
    """Two calibrations of one bundle, in folders side by side (as promotions leave them)."""
    root = tmp_path_factory.mktemp("promoted")
    first = serving_bundle(trained_bundle, root / "v1", gemma_path)
    return first, recalibrated(first, root / "v2", 2)


def point(link: Path, target: Path) -> None:
    """Replace the link in one rename, as ``cascade promote`` does."""
    fresh = link.with_name(link.name + ".tmp")
    fresh.unlink(missing_ok=True)
    fresh.symlink_to(target.name)
    os.replace(fresh, link)


def drive(base: str, stop: threading.Event, seen: list[tuple[int, int, str]], client: int) -> None:
    body = {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
    with httpx.Client(timeout=120) as http:
        for _ in range(MOST):
            if stop.is_set():
                return
            reply = http.post(f"{base}/v1/systemone", json=body)
            version = reply.json()["audit"]["calibration_version"] if reply.status_code == 200 else ""
            seen.append((client, reply.status_code, version))


def test_requests_driven_through_a_swap_are_each_answered_by_exactly_one_version(
        versions: tuple[Path, Path], gemma_path: Path, tmp_path: Path) -> None:
    first, second = versions
    link = first.parent / "current"
    point(link, first)
    old, new = (Bundle.load(v).manifest.calibration.version() for v in versions)
    source = BundleSource(link, lambda d: Cascade.load(d, teacher=gemma_path, threads=1), interval=0.05)
    audit = lambda cascade: auditor_for(cascade, tmp_path / "audits.sqlite", 0.05, "s", "alarm")[0]  # noqa: E731
    app = create_app(None, ServeConfig(bundle=source, audit=audit, engine=EngineSettings(max_wait=600.0)))
    seen: list[tuple[int, int, str]] = []
    stop = threading.Event()
    with serving(app) as base:
        clients = [threading.Thread(target=drive, args=(base, stop, seen, k)) for k in range(CLIENTS)]
        for client in clients:
            client.start()
        until(lambda: len(seen) >= 20, "requests answered by the first version")
        point(link, second)
        until(lambda: sum(v == new for _, _, v in list(seen)) >= 20 or not any(c.is_alive() for c in clients),
              "requests answered by the promoted version")
        stop.set()
        for client in clients:
            client.join(timeout=300)
        text = httpx.get(f"{base}/metrics", timeout=30).text
        watch = app.state.loaded.serving.engine.auditor.watch
    assert [status for _, status, _ in seen] == [200] * len(seen)  # none refused, none lost
    by_version = Counter(v for _, _, v in seen)
    assert set(by_version) == {old, new} and by_version[new] >= 20
    for k in range(CLIENTS):  # each client: the old version, then only the new one
        mine = [v for c, _, v in seen if c == k]
        assert mine == sorted(mine, key=lambda v: v == new)
    for version, n in by_version.items():  # both folders hold the bundle named v1
        line = f'cascade_version_requests_total{{bundle="v1",calibration_version="{version}"}} {float(n)}'
        assert line in text
    assert 'cascade_bundle_swaps_total{outcome="taken"} 1.0' in text
    assert watch is not None and watch.calibration_version == new


def counted(text: str) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """/metrics' counters, parsed: each counter family's samples by (name, labels)."""
    return {family.name: {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                          for sample in family.samples if not sample.name.endswith("_created")}
            for family in text_string_to_metric_families(text) if family.type == "counter"}


def test_metrics_scraped_around_a_swap_count_on_from_the_retired_bundle(
        versions: tuple[Path, Path], gemma_path: Path, tmp_path: Path) -> None:
    """Every running total is a counter, and across a swap it keeps what the retired bundle
    counted: two scrapes differ by what happened between them."""
    first, second = versions
    link = first.parent / "current-for-metrics"
    point(link, first)
    source = BundleSource(link, lambda d: Cascade.load(d, teacher=gemma_path, threads=1), interval=0.05)
    audit = lambda cascade: auditor_for(cascade, tmp_path / "audits.sqlite", 1.0, "s", "alarm")[0]  # noqa: E731
    app = create_app(None, ServeConfig(bundle=source, audit=audit, engine=EngineSettings(max_wait=600.0)))
    states = iter(item.text for item in corpus_items()[10:20])
    with serving(app) as base, httpx.Client(timeout=120) as http:
        def ask() -> None:
            body = {"state": next(states), "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
            assert http.post(f"{base}/v1/systemone", json=body).status_code == 200

        def audited() -> float:
            found = counted(http.get(f"{base}/metrics").text)["cascade_audits"]
            return found[("cascade_audits_total", (("outcome", "audited"),))]

        for _ in range(3):
            ask()
        until(lambda: audited() == 3, "the first bundle's 3 audits")
        before = counted(http.get(f"{base}/metrics").text)
        point(link, second)
        until(lambda: app.state.loaded.serving.version.directory == second.resolve(), "the swap")
        for _ in range(2):
            ask()
        until(lambda: audited() == 5, "the second bundle's 2 audits, on top of the first's 3")
        after = counted(http.get(f"{base}/metrics").text)
    for total in ("cascade_audits", "cascade_abandoned_requests", "cascade_bundle_swaps", "cascade_upstream",
                  "cascade_upstream_cost", "cascade_requests", "cascade_answers"):
        assert total in before and total in after, total  # exported as counters (NAME_total)
    assert after["cascade_escalations_kept"] == {}  # a counter, with no samples where none are kept
    for family, samples in before.items():  # nothing went down, nothing vanished
        assert all(after[family].get(key, -1) >= value for key, value in samples.items()), family

    def grew(family: str, **labels: str) -> float:
        key = (f"{family}_total", tuple(sorted(labels.items())))
        return after[family][key] - before[family].get(key, 0.0)

    assert grew("cascade_requests", code="200") == 2
    assert grew("cascade_audits", outcome="audited") == 2
    assert grew("cascade_bundle_swaps", outcome="taken") == 1
    assert grew("cascade_abandoned_requests") == 0
    assert sum(after["cascade_answers"].values()) - sum(before["cascade_answers"].values()) == 2


def test_sighup_takes_a_promoted_bundle_named_by_a_pointer_file(versions: tuple[Path, Path],
                                                                gemma_path: Path) -> None:
    first = versions[0]
    pointer = first.parent / "CURRENT"
    pointer.write_text("v1\n")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "distill.cli", "serve", "--bundle", str(pointer),
                               "--teacher", str(gemma_path), "--port", str(port), "--threads", "1",
                               "--watch-bundle", "0"], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        until(lambda: _status(base) == "ok", "the server loaded")
        before = _version(base)
        fresh = pointer.with_name("CURRENT.tmp")
        fresh.write_text("v2\n")
        os.replace(fresh, pointer)
        server.send_signal(signal.SIGHUP)
        until(lambda: _version(base) != before, "the promoted bundle serving after SIGHUP")
        after = _version(base)
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=120)
    assert server.returncode == 0, stderr
    assert (before, after) == tuple(Bundle.load(v).manifest.calibration.version() for v in versions)
    assert "bundle_swapped" in stderr


def _status(base: str) -> str:
    try:
        return str(httpx.get(f"{base}/health", timeout=5).json()["status"])
    except httpx.TransportError:
        return "down"


def _version(base: str) -> Any:
    body = {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
    return httpx.post(f"{base}/v1/systemone", json=body, timeout=60).json()["audit"]["calibration_version"]


def _held(store: Path) -> tuple[Counter[str], int]:
    """The server's threads alive by name (numbers dropped; not the event loop's pool, which grows
    with the calls that overlap), and the descriptors open on ``store``."""
    names = Counter("".join(c for c in thread.name if not c.isdigit()) for thread in threading.enumerate()
                    if thread.name.startswith("cascade-"))
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # one closed meanwhile
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return names, sum(link.startswith(str(store)) for link in links)


def test_repeated_promotions_leave_no_model_connection_nor_thread_behind(
        versions: tuple[Path, Path], gemma_path: Path, tmp_path: Path) -> None:
    """A server lives through many promotions: each retired bundle's models, workers, audit
    threads and store connection are let go (the audit hook is the command's own), and collected by
    the server itself once its engine stops (``cascade.serve.memory``: before, retired bundles
    lived on in reference cycles until the collector happened to run), so that after each of ten
    swaps one cascade lives and the store is held as after the first; the server's metrics keep
    the totals of the engines alive and one sum of those let go; and ``/metrics`` keeps
    the per-version series of the serving bundle and the three it replaced last, not of all six
    versions it served."""
    first, second = versions
    every = [first, second, *(recalibrated(first, first.parent / f"v{day}", day) for day in range(3, 7))]
    link, store = first.parent / "current-for-leaks", tmp_path / "audits.sqlite"
    point(link, first)
    loaded: list[weakref.ref[Cascade]] = []

    def load(directory: Path) -> Cascade:
        cascade = Cascade.load(directory, teacher=gemma_path, threads=1)
        loaded.append(weakref.ref(cascade))
        return cascade

    body = {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
    held = []
    with StoreAudits(store, 1.0, "s", "alarm") as audits:
        app = create_app(None, ServeConfig(bundle=BundleSource(link, load, interval=0.05), audit=audits,
                                           engine=EngineSettings(max_wait=600.0)))
        with serving(app) as base, httpx.Client(timeout=120) as http:
            for swap in range(10):
                target = every[(swap + 1) % len(every)]
                point(link, target)
                until(lambda t=target: app.state.loaded.serving.version.directory == t.resolve(), "the swap")
                assert http.post(f"{base}/v1/systemone", json=body).status_code == 200
                until(lambda n=swap: f'cascade_audits_total{{outcome="audited"}} {float(n + 1)}'
                      in http.get(f"{base}/metrics").text, "its audit written")
                # the watch counts the swap once swap() returned, its retiring thread started
                until(lambda n=swap: app.state.loaded.watch.swaps == n + 1, "the swap counted")
                until(lambda: not any(t.name.startswith("cascade-retire") for t in threading.enumerate()),
                      "the retired bundle's engine stopped")
                held.append((sum(ref() is not None for ref in loaded), *_held(store)))
            scraped = http.get(f"{base}/metrics").text.splitlines()
            tracked = len(app.state.loaded.metrics._engines)  # the rest folded into one total
    assert len(loaded) == 11 and [live for live, _, _ in held] == [1] * 10
    assert tracked == 2  # the serving engine, and the one its swap retired (alive at that swap)
    assert 'cascade_audits_total{outcome="audited"} 10.0' in scraped  # none lost in the folding
    shown = [line for line in scraped if line.startswith("cascade_bundle_info{")]
    assert len(shown) == 4 and sum(line.endswith(" 1.0") for line in shown) == 1
    assert len([line for line in scraped if line.startswith("cascade_version_requests_total{")]) == 4
    # the first swap's measure may come before SQLite opened its -wal file; from the second on
    assert all(h[1:] == held[1][1:] for h in held[1:]) and held[1][2] > 0


def test_a_promotion_made_while_the_audit_store_is_down_is_taken_once_it_is_back(
        versions: tuple[Path, Path], gemma_path: Path, halting_postgres: pgserver.Server,
        caplog: pytest.LogCaptureFixture) -> None:
    """The new bundle's drift watch must read the audits before it serves, and the store's
    PostgreSQL server is halted (for real) as the promotion lands: the old bundle keeps serving,
    the new one is not marked failed, and it is taken once the store answers. (Before, it was
    marked failed and never tried again until the next promotion.)"""
    first, second = versions
    link = first.parent / "current-while-down"
    point(link, first)
    load = lambda directory: Cascade.load(directory, teacher=gemma_path, threads=1)  # noqa: E731
    caplog.set_level(logging.WARNING, logger="cascade")
    body = {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
    with StoreAudits(halting_postgres.url, 1.0, "s", "alarm") as audits:
        app = create_app(None, ServeConfig(bundle=BundleSource(link, load, interval=0.05), audit=audits))
        with serving(app) as base, httpx.Client(timeout=120) as http:
            halting_postgres.halt()
            try:
                point(link, second)
                until(lambda: "waits for its audit store" in caplog.text, "the promotion waiting")
                assert http.post(f"{base}/v1/systemone", json=body).status_code == 200
                assert app.state.loaded.serving.version.directory == first.resolve()
            finally:
                halting_postgres.resume()
            watch = app.state.loaded.watch  # counts a swap once the new bundle serves: wait for both
            until(lambda: watch.swaps == 1, "the swap", 300)
            assert app.state.loaded.serving.version.directory == second.resolve() and watch.failures == 0
