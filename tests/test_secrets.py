"""Data at rest and secrets: a run with secrets planted in every input shows none of them anywhere.

``cascade serve`` runs as a real process (a pass-through whose upstream URL carries a password,
with an API key and an upstream key), in front of a real upstream on loopback that answers,
fails, stalls, redirects, drops the connection and sends a broken body in turn; every response
(body and headers), the process's stdout and stderr (its log) and ``--help`` are searched for
each planted secret. Malformed and unreachable store URLs are given to the command line the same
way. The stores it writes (the database and SQLite's side files) are readable by their owner alone,
whatever the umask. The collector's queue holds customer text in memory: it is bounded by bytes
as well as by count.
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from servers import free_port, serving, until

from cascade.collect.collector import Collector, size_of
from cascade.collect.record import CollectedItem, collected_item
from cascade.errors import OpenPortError, UpstreamError
from cascade.private import HIDDEN, redact_text, redact_url, url_secrets
from cascade.questions import parse_request
from cascade.serve.edge import add_wire
from cascade.serve.proxy import create_proxy_app
from cascade.teachers.connect import open_client
from cascade.teachers.identity import EndpointIdentity
from cascade.teachers.settings import UpstreamSettings
from cascade.tiers.base import Item
from cascade.tiers.upstream import UpstreamTier
from distill.loop.collected import StoreTraffic, collected
from distill.store import LabelStore, StoreError, StoreURL, Teacher

TEACHER_PW = "Tpw-8c1e55"
API_KEY = "Akey-51f0aa"
WRONG_KEY = "Wkey-90d2c3"
UPSTREAM_KEY = "Ukey-3b7e18"
PG_PW = "Ppw-e4a962"
PG_SSL = "Pssl-0f7d21"
SECRETS = (TEACHER_PW, API_KEY, WRONG_KEY, UPSTREAM_KEY, PG_PW, PG_SSL)
STATE = "Help! My payouts have been failing for three days."
URGENT = {"type": "noul", "instructions": "Does this convey urgency?"}


def _leaks(*texts: str) -> list[str]:
    """The planted secrets found in ``texts``, percent-encoded or base64'd forms aside."""
    whole = "\n".join(texts)
    return [secret for secret in SECRETS if secret in whole]


class _Handler(BaseHTTPRequestHandler):
    """A System One upstream whose answer is the server's ``mode``."""

    server: _Upstream

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        if self.server.mode == "drop":
            self.close_connection = True
            return
        self._send(200, json.dumps({"models": [{"name": "m-secret-test"}]}).encode())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        mode = self.server.mode
        if mode == "drop":  # no answer at all: the connection closes
            self.close_connection = True
            return
        if mode == "slow":
            time.sleep(3.0)  # past the proxy's --upstream-timeout 1; then nobody reads it
        if mode in ("ok", "slow", "wrong"):
            kind = "choice" if mode == "wrong" else "noul"
            asked = json.loads(body)["questions"]
            answers = {qid: {"type": kind, "noul": 0.7} for qid in asked}
            self._send(200, json.dumps({"model": "m-secret-test", "answers": answers}).encode())
        elif mode == "fail":
            self._send(500, b'{"error": {"message": "the upstream broke"}}')
        elif mode == "busy":
            self._send(503, b'{"error": {"message": "busy"}}', {"Retry-After": "0"})
        elif mode == "limit":
            self._send(429, b'{"error": {"message": "slow down"}}', {"Retry-After": "0"})
        elif mode == "refuse":
            self._send(422, b'{"error": {"message": "questions.x: unknown type"}}')
        elif mode == "redirect":
            self._send(302, b"", {"Location": f"http://user:{TEACHER_PW}@elsewhere.invalid/v1/systemone"})
        elif mode == "notjson":
            self._send(200, b"<html>not json</html>", content_type="text/html")
        elif mode == "badgzip":
            self._send(200, b"this is not gzip", {"Content-Encoding": "gzip"})

    def _send(self, status: int, content: bytes, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(content)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(content)
        except (BrokenPipeError, ConnectionResetError):  # the proxy gave up on a slow answer
            pass


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True
    mode = "ok"


@contextmanager
def _upstream() -> Iterator[_Upstream]:
    server = _Upstream(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _secret_url(server: _Upstream) -> str:
    return f"http://user:{TEACHER_PW}@127.0.0.1:{server.server_address[1]}/v1/systemone"


@dataclass
class _Said:
    """What a ``cascade`` process wrote: filled in once it has ended."""

    code: int | None = None
    stdout: str = ""
    stderr: str = ""


def _env() -> dict[str, str]:
    return {**os.environ, "CASCADE_UPSTREAM_KEY": UPSTREAM_KEY, "PYTHONUNBUFFERED": "1"}


def _cascade(*args: str) -> _Said:
    """``cascade ARGS`` run to its end."""
    done = subprocess.run([sys.executable, "-m", "distill.cli", *args], capture_output=True, text=True,
                          env=_env(), timeout=300)
    return _Said(done.returncode, done.stdout, done.stderr)


@contextmanager
def _serve(tmp: Path, *args: str) -> Iterator[tuple[str, _Said]]:
    """``cascade serve ARGS`` as a process of its own with umask 0 (every file it makes would be
    world-readable unless it says otherwise), until the block ends; yields its base URL and what
    it said, read once it stopped (SIGTERM)."""
    port = free_port()
    out, err = tmp / "serve.stdout", tmp / "serve.stderr"
    said = _Said()
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "distill.cli", "serve", *args, "--port", str(port)],
                                   stdout=stdout, stderr=stderr, env=_env(), umask=0)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert process.poll() is None, err.read_text()
            try:
                return httpx.get(f"{base}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        until(up, "cascade serve answers /health")
        yield base, said
    finally:
        process.terminate()
        said.code = process.wait(timeout=60)
        said.stdout, said.stderr = out.read_text(), err.read_text()


def _store_files(store: Path) -> list[Path]:
    """A SQLite store's database and the side files SQLite keeps beside it while it is open."""
    return [store, store.with_name(store.name + "-wal"), store.with_name(store.name + "-shm")]


def _text(response: httpx.Response) -> str:
    return f"{response.status_code} {dict(response.headers)} {response.text}"


def test_no_planted_secret_reaches_a_response_the_log_or_the_help(tmp_path: Path) -> None:
    store = tmp_path / "traffic.sqlite"
    seen: dict[str, httpx.Response] = {}
    with _upstream() as upstream, _serve(tmp_path, "--teacher", _secret_url(upstream), "--api-key", API_KEY,
                                         "--upstream-timeout", "1", "--max-body", "4096",
                                         "--collect", str(store)) as (base, said):
        good = {"Authorization": f"Bearer {API_KEY}"}
        request = {"state": STATE, "questions": {"urgent": URGENT}}
        with httpx.Client(base_url=base, timeout=60) as client:
            seen["no key"] = client.post("/v1/systemone", json=request)
            seen["wrong key"] = client.post("/v1/systemone", json=request,
                                            headers={"Authorization": f"Bearer {WRONG_KEY}"})
            seen["too large"] = client.post("/v1/systemone", json={**request, "state": "x" * 8000},
                                            headers=good)
            seen["encoding"] = client.post("/v1/systemone", content=b"{}",
                                           headers={**good, "Content-Encoding": "br"})
            seen["no route"] = client.get("/v1/nothing", headers=good)
            for mode in ("ok", "wrong", "fail", "busy", "limit", "refuse", "redirect", "notjson", "slow",
                         "drop", "badgzip"):
                upstream.mode = mode
                seen[mode] = httpx.post(f"{base}/v1/systemone", json=request, timeout=60,  # a connection
                                        headers={**good, "X-Request-Id": f"rid-{mode}"})  # of its own each
            upstream.mode = "drop"
            seen["models, dropped"] = client.get("/v1/models", headers=good)
            upstream.mode = "ok"
            packed = gzip.compress(json.dumps(request).encode())
            seen["compressed"] = client.post("/v1/systemone", content=packed, headers={
                **good, "Content-Encoding": "gzip", "Content-Type": "application/json"})
            for path in ("/health", "/metrics", "/openapi.json", "/docs"):
                seen[path] = client.get(path, headers=good)
            collected = re.compile(r'cascade_collect\w*\{outcome="collected"\} 2\.0')
            until(lambda: collected.search(client.get("/metrics", headers=good).text) is not None,
                  "both answered requests are collected")
            modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in _store_files(store)}
    statuses = {name: response.status_code for name, response in seen.items()
                if name not in ("badgzip", "/openapi.json", "/docs")}  # served or not: either way, grepped
    assert statuses == {
        "no key": 401, "wrong key": 401, "too large": 413, "encoding": 415, "no route": 404, "ok": 200,
        "wrong": 200, "fail": 502, "busy": 503, "limit": 429, "refuse": 422, "redirect": 502, "notjson": 502,
        "slow": 504, "drop": 502, "models, dropped": 502, "compressed": 200, "/health": 200, "/metrics": 200}
    # a body that does not inflate is the upstream's wrong answer (502), never a bug of ours
    assert seen["badgzip"].status_code == 502, seen["badgzip"].text
    assert seen["badgzip"].json()["error"]["code"] == "upstream_answer"
    shown = f"http://user:{HIDDEN}@127.0.0.1:"
    assert all(shown in seen[mode].text for mode in ("fail", "redirect", "notjson", "slow", "drop"))
    assert _leaks(*(_text(response) for response in seen.values())) == []
    assert _leaks(said.stdout, said.stderr) == [] and said.code == 0
    assert f"passing requests through to {shown}" in said.stderr  # the banner names the URL, redacted
    assert "not collected" in said.stderr and shown in said.stderr  # the wrong answer, said in the log
    assert modes == {"traffic.sqlite": 0o600, "traffic.sqlite-wal": 0o600, "traffic.sqlite-shm": 0o600}
    helped = _cascade("serve", "--help")
    assert helped.code == 0 and "--collect" in helped.stdout
    assert _leaks(helped.stdout, helped.stderr) == []


def test_store_urls_that_fail_are_named_without_their_secrets(tmp_path: Path) -> None:
    teacher = f"http://user:{TEACHER_PW}@127.0.0.1:{free_port()}/v1/systemone"
    unreachable = f"postgresql://u:{PG_PW}@127.0.0.1:1/db?sslpassword={PG_SSL}"
    malformed = f"postgresql://u:{PG_PW}@[::1/db?sslpassword={PG_SSL}"
    cut = f"postgresql://u:{PG_PW}@{PG_SSL}@127.0.0.1:1/db"  # an unencoded @ in the password
    runs = {
        "unreachable": _cascade("serve", "--teacher", teacher, "--collect", unreachable),
        "malformed": _cascade("serve", "--teacher", teacher, "--collect", malformed),
        "cut": _cascade("serve", "--teacher", teacher, "--collect", cut),
        "audit store": _cascade("audit", "--bundle", str(tmp_path), "--store", malformed),
        "teacher port": _cascade("serve", "--teacher", f"http://user:{TEACHER_PW}@127.0.0.1:port/v1/systemone"),
    }
    for name, said in runs.items():
        assert said.code == 2 and said.stderr.strip(), name
        assert _leaks(said.stdout, said.stderr) == [], (name, said.stderr)
    assert f"postgresql://u:{HIDDEN}@127.0.0.1:1/db?sslpassword={HIDDEN}" in runs["unreachable"].stderr
    assert "argument --collect: postgresql://u:***@[::1/db?sslpassword=*** is not a valid URL" in \
        runs["malformed"].stderr
    assert "CascadeError: the upstream URL http://user:***@127.0.0.1:port/v1/systemone cannot be read" in \
        runs["teacher port"].stderr


def test_redaction_covers_urls_conninfo_and_text() -> None:
    cases = {
        f"postgresql://u:{PG_PW}@h:5432/db?sslpassword={PG_SSL}&application_name=x":
            "postgresql://u:***@h:5432/db?sslpassword=***&application_name=x",
        f"postgresql://h/db?password={PG_PW}": "postgresql://h/db?password=***",
        f"host=h user=u password={PG_PW} sslpassword='{PG_SSL} x'":
            "host=h user=u password=*** sslpassword=***",
        f"http://user:{TEACHER_PW}@127.0.0.1:9/v1/systemone": "http://user:***@127.0.0.1:9/v1/systemone",
        f"http://user:{TEACHER_PW}/x@host/v1": "http://user:***@host/v1",  # an unencoded /: hidden too
        "https://decide.example.com/v1/systemone": "https://decide.example.com/v1/systemone",
        # an upstream's key in its query: echoed whole by "the upstream ... is unreachable" before
        f"http://h:9/v1/systemone?api_key={TEACHER_PW}&model=m": "http://h:9/v1/systemone?api_key=***&model=m",
        f"https://h/v1/systemone?token={TEACHER_PW}&sig={TEACHER_PW}": "https://h/v1/systemone?token=***&sig=***",
        # a token as the user part, and an auth= pair: echoed in the log, every 502 and /openapi.json
        f"http://{TEACHER_PW}@127.0.0.1:9/v1/systemone": "http://***@127.0.0.1:9/v1/systemone",
        f"https://h/v1/systemone?auth={TEACHER_PW}": "https://h/v1/systemone?auth=***",
        "postgresql://u@h/db": "postgresql://u@h/db",  # a database's lone user is a name
        f"https://f.azurewebsites.net/api/v1/systemone?code={TEACHER_PW}": "https://f.azurewebsites.net/api/v1/systemone?code=***",
    }
    assert {url: redact_url(url) for url in cases} == cases
    text = f"got 'postgresql://u:{PG_PW}@h/db' and PGPASSWORD=\"{PG_SSL}\" from http://u:{TEACHER_PW}@h/v1)"
    assert _leaks(redact_text(text)) == [] and "postgresql://u:***@h/db" in redact_text(text)
    assert _leaks(redact_text(f"cannot reach http://{TEACHER_PW}@h/v1 now")) == []
    assert TEACHER_PW in url_secrets(f"https://{TEACHER_PW}@h/v1")
    url = StoreURL(f"postgresql://u:{PG_PW}@h/db?sslpassword={PG_SSL}")
    assert _leaks(str(url), repr(url), url.scrub(f"FATAL: bad {PG_PW} and {PG_SSL}")) == []
    with pytest.raises(StoreError, match=r"is not a valid URL") as caught:
        StoreURL(f"postgresql://u:{PG_PW}@[::1/db")
    assert _leaks(str(caught.value)) == []


def test_the_upstream_is_named_without_its_password_in_answers_errors_and_the_schema() -> None:
    questions = parse_request({"state": STATE, "questions": {"urgent": URGENT}}).questions
    with _upstream() as upstream:
        settings = UpstreamSettings(_secret_url(upstream), retries=0)
        tier = UpstreamTier("teacher", open_client(settings))
        try:
            said = [tier.ran_on, settings.shown]
            answered = tier.ask(Item("i1", STATE), questions)
            for mode in ("wrong", "fail", "redirect", "notjson", "drop"):
                upstream.mode = mode
                with pytest.raises(UpstreamError) as caught:
                    tier.ask(Item("i1", STATE), questions)
                said.append(f"{type(caught.value).__name__}: {caught.value}")
        finally:
            tier.close()
        app = create_proxy_app(open_client(settings))
        said += [app.description, json.dumps(app.openapi())]
    assert answered.distributions["urgent"].tolist() == pytest.approx([0.7, 0.3])
    assert _leaks(*said) == [] and all(f"user:{HIDDEN}@" in line for line in said[:7])


def test_a_bug_answers_500_with_the_request_id_only(caplog: pytest.LogCaptureFixture) -> None:
    """The 500 handler, reached by a route that really raises: the client gets its request id, the
    log the traceback, both without the secrets the exception quoted."""
    app = FastAPI()
    add_wire(app)

    @app.get("/fails")
    async def fails() -> None:
        raise RuntimeError(f"cannot reach http://user:{TEACHER_PW}@10.0.0.1/v1 with password={PG_PW}")

    with caplog.at_level(logging.ERROR, logger="cascade.serve"), serving(app, wait=False) as base:
        response = httpx.get(f"{base}/fails", headers={"X-Request-Id": "rid-bug-7"}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 500 and response.headers["x-request-id"] == "rid-bug-7"
    assert "rid-bug-7" in error["message"] and "RuntimeError" not in error["message"]
    assert _leaks(response.text) == [] and "cannot reach" not in response.text
    logged = caplog.text
    assert "rid-bug-7" in logged and "RuntimeError: cannot reach http://user:***@10.0.0.1/v1" in logged
    assert "Traceback" in logged and _leaks(logged) == []


def test_store_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "labels.sqlite"
    before = os.umask(0)
    try:
        with LabelStore(path, Teacher(kind="external", model="gold")) as store:
            store.put_item("e1", {"q0": {"a": 0.25, "b": 0.75}})
            modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in _store_files(path)}
    finally:
        os.umask(before)
    assert modes == {"labels.sqlite": 0o600, "labels.sqlite-wal": 0o600, "labels.sqlite-shm": 0o600}


def test_the_collector_queue_is_bounded_by_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store that is slow for real (another writer holds its lock): past the byte budget, one
    item drawn at random among the waiting ones and the newcomer is dropped and counted, said once;
    the queued ones are written when the store frees, each with its survival of those draws."""
    import sqlite3

    store = tmp_path / "traffic.sqlite"
    questions = parse_request({"state": STATE, "questions": {"urgent": URGENT}}).questions

    def item(k: int, inclusion: float | None = None) -> CollectedItem:
        return collected_item(f"r{k}", questions, f"{STATE} {k}", {"urgent": np.array([0.7, 0.3])},
                              EndpointIdentity(model="m1"), 0.0, inclusion)

    sink = StoreTraffic(store)
    sink.append(item(0))
    blocker = sqlite3.connect(store, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the store's writer now waits for this lock
    collector = Collector(sink, max_queue_bytes=1000)
    try:
        with caplog.at_level(logging.WARNING, logger="cascade.collect"):
            collector.offer(functools.partial(item, 1), size=400)
            deadline = time.monotonic() + 60
            while len(collector._queue) and time.monotonic() < deadline:  # the writer holds r1, waiting
                time.sleep(0.01)
            for k in range(2, 6):
                collector.offer(functools.partial(item, k), size=400)  # 400, 800, then past 1000 twice
            counts, waiting = dict(collector.counts), collector.queued_bytes
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    collector.close()
    sink.close()
    assert counts["dropped"] == 2 and waiting == 800
    assert collector.counts["collected"] == 3 and collector.queued_bytes == 0
    kept = list(collected(store))
    assert [i.request_id for i in kept[:2]] == ["r0", "r1"] and len(kept) == 4
    # r1 was being written, never drawn; of r2 and r3, each draw (2 waiting + the newcomer) spared
    # each with 2/3, and r5 witnessed only its own draw (r4, if kept, both)
    survivals = {i.request_id: i.inclusion for i in kept[1:]}
    assert survivals["r1"] == 1.0
    assert sorted(survivals.values())[:2] == pytest.approx([4 / 9, 4 / 9 if "r5" not in survivals else 2 / 3])
    said = [r.getMessage() for r in caplog.records if "queue is full" in r.getMessage()]
    assert len(said) == 1 and "counted as dropped" in said[0]


def test_a_collector_stopping_on_a_store_that_stalls_returns_after_its_drain(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another writer holds the store's lock (for real) while the server stops: ``close`` gives
    the writer its drain, then returns, the items still queued counted as dropped and said; the
    write under way lands once the lock is freed."""
    import sqlite3

    store = tmp_path / "traffic.sqlite"
    questions = parse_request({"state": STATE, "questions": {"urgent": URGENT}}).questions

    def item(k: int, inclusion: float) -> CollectedItem:
        return collected_item(f"r{k}", questions, f"{STATE} {k}", {"urgent": np.array([0.7, 0.3])},
                              EndpointIdentity(model="m1"), 0.0, inclusion)

    sink = StoreTraffic(store)
    sink.append(item(0, 1.0))
    blocker = sqlite3.connect(store, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the store's writer now waits for this lock
    collector = Collector(sink)
    try:
        with caplog.at_level(logging.WARNING, logger="cascade.collect"):
            for k in range(1, 4):
                collector.offer(functools.partial(item, k))
            until(lambda: len(collector._queue) == 2, "the writer waiting on r1")
            stopping = threading.Thread(target=collector.close, args=(0.2,))
            stopping.start()
            stopping.join(60)
            returned = not stopping.is_alive()
            counts = dict(collector.counts)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert returned and counts["dropped"] == 2 and counts["collected"] == 0  # r1 was being written
    until(lambda: collector.counts["collected"] == 1, "the write under way, once the lock is freed")
    sink.close()
    assert [i.request_id for i in collected(store)] == ["r0", "r1"]
    said = [r.getMessage() for r in caplog.records if "left unwritten" in r.getMessage()]
    assert said == ["collect: 2 items left unwritten: the store took none of them within 0.2 s of stopping"]
    assert (size_of(b"abc"), size_of("\u00e9"), size_of({"a": 1})) == (3, 2, len('{"a": 1}'))


def test_a_ray_config_refuses_secrets_and_is_its_owners_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The replicas' flags went into the config as given (an --api-key, a URL's password), and Ray
    copies them into its logs (mode 0644) and its dashboard's API, for any user of a node to read:
    they are refused, saying where the secret goes instead. The config itself is written 0644 by a
    plain write: it is its owner's alone."""
    pytest.importorskip("yaml", reason="the ray-serve extra brings PyYAML")
    from distill.cli import main

    monkeypatch.delenv("CASCADE_API_KEY", raising=False)
    out = tmp_path / "serve.yaml"
    base = ["ray-config", "--bundle", str(tmp_path / "b"), "--out", str(out)]
    teacher = ["--teacher", "http://gpu:9000/v1/systemone"]
    with pytest.raises(SystemExit):
        main([*base, *teacher, "--port", "70000"])
    assert "argument --port: must be at most 65535; got 70000" in capsys.readouterr().err
    secret_url = f"http://user:{TEACHER_PW}@gpu:9000/v1/systemone"
    store = f"postgresql://u:{TEACHER_PW}@db/labels"
    for flags, said in (([*teacher, "--", "--api-key", API_KEY], "set $CASCADE_API_KEY on every Ray node"),
                        ([*teacher, "--", "--metrics-key=" + API_KEY], "$CASCADE_METRICS_KEY"),
                        (["--teacher", secret_url], "holds a password"),
                        ([*teacher, "--", "--audit-store", store], "PGPASSWORD"),
                        ([*teacher, "--", f"--collect={store}"], "PGPASSWORD"),  # its value unread
                        ([*teacher, "--", "--audit-store", f"postgresql:///labels?password={TEACHER_PW}"],
                         "PGPASSWORD")):
        assert main([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert said in err and _leaks("", err) == [], err
    assert not out.exists()
    monkeypatch.setenv("CASCADE_API_KEY", API_KEY)
    old = os.umask(0o022)  # the usual umask: a plain write gives 0644
    try:
        assert main([*base, *teacher, "--host", "0.0.0.0"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and API_KEY not in out.read_text()
    assert _leaks(*capsys.readouterr()) == []


def test_a_ray_config_keys_the_teacher_route_as_it_keys_the_cascade(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The teacher application shares the proxy's port: it took any caller (the key's flags went to
    the cheap application alone), and with $CASCADE_API_KEY set on the nodes (KubeRay's manifest) it
    checked the key and refused the cheap replicas' escalations, which sent none. Each replica is
    also told the open host, so that one started where no key is set refuses to start."""
    pytest.importorskip("yaml", reason="the ray-serve extra brings PyYAML")
    import yaml

    from cascade.serve.lifecycle import check_auth
    from distill.cli import main
    from distill.cli.serve.command import options_of
    from distill.cli.serve.replicas import serve_args

    gguf, out = tmp_path / "t.gguf", tmp_path / "serve.yaml"
    gguf.write_bytes(b"")
    base = ["ray-config", "--bundle", str(tmp_path / "b"), "--teacher", str(gguf), "--out", str(out),
            "--host", "0.0.0.0"]
    monkeypatch.delenv("CASCADE_API_KEY", raising=False)
    assert main(base) == 2
    assert "set $CASCADE_API_KEY here and on every Ray node" in capsys.readouterr().err
    monkeypatch.setenv("CASCADE_API_KEY", API_KEY)  # the KubeRay way: in every node's environment
    assert main(base) == 0
    assert "set it on every Ray node" in capsys.readouterr().err
    written = yaml.safe_load(out.read_text())["applications"]
    apps = {app["name"]: serve_args(app["args"]["argv"]) for app in written}
    assert apps["cascade"].upstream_key_env == "CASCADE_API_KEY"  # what the cheap replicas send the teacher
    for replica in apps.values():
        assert check_auth(options_of(replica), False, forwardable=False).key == API_KEY
    monkeypatch.delenv("CASCADE_API_KEY")  # a node without it: each replica refuses to start
    for replica in apps.values():
        with pytest.raises(OpenPortError, match="opens the port to other machines"):
            check_auth(options_of(replica), False, forwardable=False)


def test_customer_text_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    """``collected --out DIR`` wrote the states through a link planted at DIR/corpus.jsonl, to
    wherever it pointed."""
    from cascade.private import private_text

    elsewhere, planted = tmp_path / "elsewhere.txt", tmp_path / "corpus.jsonl"
    elsewhere.write_text("theirs\n")
    planted.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="is a symbolic link"):
        private_text(planted)
    assert elsewhere.read_text() == "theirs\n"
    with private_text(tmp_path / "fine.jsonl") as handle:
        handle.write("ours\n")
    assert stat.S_IMODE((tmp_path / "fine.jsonl").stat().st_mode) == 0o600
