"""``cascade serve`` against hostile clients: every request is bounded before any work is done.

A real server on loopback (the session's bundle, gemma-3-270m live as the teacher), run with the
uvicorn settings ``cascade serve`` uses, its escalations kept in a sink this test reads. Each
attack ends in a clear 4xx (or 503 with Retry-After) that names its limit, ``/health`` answers
throughout, and nothing reaches the store. Traffic goes to loopback only, every loop bounded in
count and time. The forwarded-auth attacks (junk keys, a revoked key) are in
test_serve_open_port.py, with the upstream that checks keys.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpora import QUESTIONS_JSON, corpus_items
from servers import ESCALATED, KEPT, running, serving_bundle

from cascade.bundle.manifest import Bundle
from cascade.collect.collector import Collector
from cascade.collect.escalation import EscalationRecord
from cascade.readout.prompts import render_state, state_size
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig
from cascade.serve.engine_settings import EngineSettings
from cascade.serve.lifecycle import ServeOptions
from cascade.serve.limits import RequestLimits

STATE = corpus_items()[5].text
LIMITS = RequestLimits(state_chars=20_000, questions=8, options_total=64, question_chars=4_000)
"""Smaller than the defaults, so that the worst request they allow runs in seconds on 2 cores."""
DEADLINE = 1.0
"""Seconds a client has for a request's head, and again for its body, on this server."""
MAX_BODY = 1024 * 1024


class ListSink:
    """Where the server's escalations go: a list this test reads (the store's interface)."""

    def __init__(self) -> None:
        self.items: list[EscalationRecord] = []

    def append(self, item: EscalationRecord) -> None:
        self.items.append(item)

    def count(self) -> int:
        return len(self.items)


@pytest.fixture(scope="module")
def kept() -> ListSink:
    return ListSink()


@pytest.fixture(scope="module")
def url(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory,
        kept: ListSink) -> Iterator[str]:
    bundle_dir = serving_bundle(trained_bundle, tmp_path_factory.mktemp("hostile") / "support", gemma_path)
    config = ServeConfig(max_body=MAX_BODY, engine=EngineSettings(max_wait=600.0), limits=LIMITS,
                         escalations=Collector(kept, what="escalations"), receive_timeout=DEADLINE)
    options = ServeOptions(max_connections=24, receive_timeout=DEADLINE)
    with running(lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2), config,
                 options=options) as base:
        yield base


def post(url: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/systemone", json=body, timeout=120, **kwargs)


def refused(reply: httpx.Response, status: int, limit: str) -> str:
    """The refusal's message, checked to be ``status`` naming ``limit`` and its flag."""
    assert reply.status_code == status, reply.text[:500]
    error = reply.json()["error"]
    assert error["code"] == "limit_exceeded" and f"({limit};" in error["message"], error
    assert f"--limit-{limit.replace('_', '-')}" in error["message"]
    return str(error["message"])


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def choice(n: int, word: str = "option") -> dict[str, Any]:
    return {"type": "choice", "instructions": "Which fits?",
            "criteria": {f"{word}{i}": None for i in range(n)}}


def test_the_rendered_size_is_computed_exactly_without_rendering() -> None:
    states: list[Any] = [" text ", nested(5), {"a": [1, 2.5, None, True, {}], "é": {"b": "x\n\"y\""}},
                         [[], {}, [[1]], {"k": []}], json.loads(json.dumps({"q": [nested(3)] * 3}))]
    for state in states:
        assert state_size(state).chars == len(render_state(state))
    assert [state_size(s).depth for s in (" text ", nested(5), [[], {}])] == [0, 5, 1]
    assert state_size(nested(900), max_depth=32).depth == 33  # the walk stops past the limit


def test_a_state_nested_900_deep_is_refused_before_it_is_rendered(url: str, kept: ListSink) -> None:
    """The attack that stalled the server: 40 copies of an array nested 900 deep (a 72 KB body
    that indented JSON renders to tens of MB)."""
    message = refused(post(url, {"state": [nested(900)] * 40, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}),
                      422, "state_depth")
    assert message.startswith("state: more than 32 levels of nesting in a JSON state")
    assert kept.items == []


def test_a_state_that_renders_past_its_limit_is_refused_though_its_body_is_small(url: str) -> None:
    wide = [nested(20)] * 40  # 1.7 KB of JSON, 25 KB rendered: the indent is what grows
    assert len(json.dumps(wide)) < 2_000 and state_size(wide).chars > LIMITS.state_chars
    refused(post(url, {"state": wide, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}), 413, "state_chars")


def test_ten_thousand_questions_are_refused_by_their_count(url: str) -> None:
    body = {"state": STATE, "questions": {f"q{i}": QUESTIONS_JSON[KEPT] for i in range(10_000)}}
    message = refused(post(url, body), 413, "questions")
    assert "10,000 questions in one request" in message


def test_many_questions_of_255_options_are_refused_by_their_total(url: str) -> None:
    body = {"state": STATE, "questions": {f"q{i}": choice(255) for i in range(4)}}
    message = refused(post(url, body), 413, "options_total")
    assert "1,020 options summed" in message


def test_a_zip_bomb_is_refused_after_inflating_past_the_body_limit(url: str) -> None:
    bomb = gzip.compress(json.dumps({"state": "a" * (64 * MAX_BODY), "questions": {}}).encode())
    assert len(bomb) < MAX_BODY // 4
    reply = httpx.post(f"{url}/v1/systemone", content=bomb, timeout=60,
                       headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


def worst_request() -> dict[str, Any]:
    """About the most work LIMITS allow: questions up to the count, all but one foreign to the
    bundle (the teacher reads them), their options near the total, about a state the teacher's
    context holds. None is an escalation of a bundle question, so none is kept."""
    foreign = {f"f{i}": choice(8, f"w{i}x") for i in range(LIMITS.questions - 1)}
    return {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT], **foreign}}


def test_health_answers_while_the_worst_allowed_request_is_in_flight(url: str) -> None:
    """The request's parsing, rendering and reading run off the event loop: /health is answered
    again and again while it is in flight (counted, not timed)."""
    body = worst_request()
    assert 2 + sum(len(q["criteria"]) for q in body["questions"].values() if q["type"] == "choice") \
        <= LIMITS.options_total
    answer: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answer.append(post(url, body)))
    worker.start()
    health: list[int] = []
    deadline = time.monotonic() + 300
    while worker.is_alive() and time.monotonic() < deadline:
        health.append(httpx.get(f"{url}/health", timeout=30).status_code)
    worker.join(timeout=300)
    assert answer and answer[0].status_code == 200, answer[0].text[:500] if answer else "no answer"
    assert len(answer[0].json()["answers"]) == LIMITS.questions
    assert len(health) >= 3 and set(health) == {200}, health


def test_a_slowloris_head_is_cut_off_and_health_answers_meanwhile(url: str) -> None:
    """Clients that trickle a request's head a byte at a time are closed at the deadline; the
    server answers others throughout, and its connection slots come back."""
    sockets = [socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)
               for _ in range(20)]
    for conn in sockets:
        conn.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n")
    closed: set[int] = set()
    answered = 0
    until = time.monotonic() + 10 * DEADLINE
    while len(closed) < len(sockets) and time.monotonic() < until:
        for n, conn in enumerate(sockets):
            if n not in closed and not _trickle(conn):
                closed.add(n)
        answered += httpx.get(f"{url}/health", timeout=5).status_code == 200
        time.sleep(0.1)
    for conn in sockets:
        conn.close()
    assert len(closed) == len(sockets)  # every trickler cut off within the bound
    assert answered >= 3
    assert post(url, {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}).status_code == 200


def _trickle(conn: socket.socket) -> bool:
    """Send one more header byte; False once the server has closed the connection."""
    try:
        conn.sendall(b"X")
        conn.settimeout(0.01)
        return conn.recv(1) != b""
    except TimeoutError:
        return True
    except OSError:
        return False


def test_a_slow_body_gets_a_408(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10 * DEADLINE) as conn:
        conn.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"state\": ")
        reply = b""  # sent nothing more: the body's deadline passes, then the server closes
        while chunk := conn.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_timeout" in reply


def test_idle_connections_past_the_limit_refuse_no_client_and_are_closed(url: str) -> None:
    """uvicorn's limit counted them: every request, /health too, got its plain 503 until the
    deadline. Each new connection now closes the one waiting longest for a head."""
    port = int(url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(30)]
    try:
        time.sleep(0.2)  # the server has taken them all; none sends a byte
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert post(url, {"state": STATE, "questions": {"u": QUESTIONS_JSON[KEPT]}}).status_code == 200
        assert all(conn.recv(1) == b"" for conn in idle)  # closed, to make room or at the deadline
    finally:
        for conn in idle:
            conn.close()


def raw_post(url: str, body: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/systemone", content=body.encode(), timeout=120,
                      headers={"Content-Type": "application/json"}, **kwargs)


def count(url: str, code: int) -> float:
    """``cascade_requests_total`` for one status code, from /metrics (0 before the first)."""
    prefix = f'cascade_requests_total{{code="{code}"}} '
    return sum(float(line.removeprefix(prefix)) for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith(prefix))


KQ = '{"u":' + json.dumps(QUESTIONS_JSON[KEPT]) + "}"
SURROGATE = "\\ud800"
"""A lone surrogate, as a JSON escape (valid JSON, not valid Unicode)."""


def doc(state: str, questions: str = KQ, tail: str = "") -> str:
    """A request body written by hand: JSON text ``json.dumps`` would not write."""
    return '{"state":' + state + ',"questions":' + questions + tail + "}"


@pytest.mark.parametrize(("body", "where"), [
    (doc('"x"', tail=',"n":' + "1" * 4301), "an integer of 4,301 digits"),
    (doc('{"a":1e999}'), "the number 1e999 is too large for a float"),
    (doc('"x"', tail=',"x_budget":{"ms_per_call":1' + "0" * 400 + "}"),
     "budget.ms_per_call: must be a finite number"),
    (doc('"x"', tail=',"x_budget":{"self":1}'), "budget.self: Extra inputs are not permitted"),
    (doc(f'"{SURROGATE} hi"'), "state: a key or text holds a lone surrogate"),
    (doc(f'{{"{SURROGATE}":"a"}}'), "state: a key or text holds a lone surrogate"),
    (doc('"hi"', f'{{"u":{{"type":"noul","instructions":"Is it {SURROGATE}?"}}}}'),
     "questions.u.instructions: a key or text"),
    (doc('"hi"', '{"u":{"type":"choice","instructions":"Which?","criteria":{"' + SURROGATE
         + '":"a","b":"c"}}}'),
     "questions.u.criteria: a key or text"),
    (doc('"hi"', '{"' + SURROGATE + '":' + json.dumps(QUESTIONS_JSON[KEPT]) + "}"),
     "questions: a key or text"),
])
def test_numbers_and_text_no_float_or_utf8_holds_are_a_422_not_a_bug(url: str, body: str, where: str) -> None:
    """Each of these was a 500 (a traceback "this is a bug"): Python's 4,300-digit bound on int,
    an int past a float in a budget, a budget key named ``self`` (a keyword argument twice), a lone
    surrogate escape that tokenizers cannot encode."""
    bugs = count(url, 500)
    reply = raw_post(url, body)
    assert reply.status_code == 422, reply.text[:300]
    assert reply.json()["error"]["code"] == "invalid_request" and where in reply.json()["error"]["message"]
    assert count(url, 500) == bugs


@pytest.mark.parametrize("field", ["instructions", "criteria"])
def test_a_question_nested_past_the_depth_limit_is_refused_before_it_is_read(url: str, field: str) -> None:
    question = {"type": "noul", "instructions": nested(300)} if field == "instructions" else \
        {"type": "choice", "instructions": "Which?", "criteria": {"a": nested(300), "b": None}}
    message = refused(post(url, {"state": STATE, "questions": {"q": question}}), 422, "state_depth")
    assert message.startswith(f"questions.q.{field}: more than 32 levels of nesting")


def test_choice_keys_count_toward_the_question_characters_as_their_texts_do(url: str) -> None:
    """A prompt reads each key beside its text, so a long key is as much to read as a long text."""
    long = [f"option {i:02d} " + "z" * 90 for i in range(45)]  # 45 x 100 characters > 4,000
    as_keys = {"type": "choice", "instructions": "Which?", "criteria": dict.fromkeys(long)}
    as_texts = {"type": "choice", "instructions": "Which?",
                "criteria": {f"k{i}": text for i, text in enumerate(long)}}
    for question in (as_keys, as_texts):
        refused(post(url, {"state": STATE, "questions": {"q": question}}), 413, "question_chars")


def test_health_answers_head_and_a_trailing_slash_is_not_redirected(url: str) -> None:
    head = httpx.head(f"{url}/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    slash = httpx.post(f"{url}/v1/systemone/", json={}, headers={"Host": "evil.example"}, timeout=10)
    assert slash.status_code == 404 and "location" not in slash.headers  # no open redirect


def test_a_client_that_hangs_up_mid_body_is_counted_gone_not_logged_as_a_bug(
        url: str, caplog: pytest.LogCaptureFixture) -> None:
    gone, bugs = count(url, 499), count(url, 500)
    host, port = url.removeprefix("http://").split(":")
    with caplog.at_level("ERROR"), socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"state\": \"hal")
        time.sleep(0.2)
    until = time.monotonic() + 10
    while count(url, 499) == gone and time.monotonic() < until:
        time.sleep(0.05)
    assert count(url, 499) == gone + 1 and count(url, 500) == bugs
    assert not [r for r in caplog.records if "is a bug" in r.getMessage()]


def test_a_bug_is_counted_and_logged_as_every_answer_is(url: str, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A failure that cannot be caused for real any more: a bug, put in for this test."""
    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug put in for this test")

    monkeypatch.setattr("cascade.serve.app._submit", broken)
    bugs = count(url, 500)
    with caplog.at_level("INFO"):
        reply = post(url, {"state": STATE, "questions": {KEPT: QUESTIONS_JSON[KEPT]}})
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
    assert "a bug put in" not in reply.text  # the exception's words stay in the log
    assert count(url, 500) == bugs + 1
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith("{")]
    assert any(line.get("status") == 500 and line.get("error") == "internal_error" for line in lines)


def test_no_refused_request_reaches_the_store_and_an_answered_one_does(url: str, kept: ListSink) -> None:
    """Runs after the attacks above (pytest keeps file order): none left an escalation."""
    assert kept.items == []
    reply = post(url, {"state": STATE, "questions": {ESCALATED: QUESTIONS_JSON[ESCALATED]}})
    assert reply.status_code == 200
    until = time.monotonic() + 30
    while not kept.items and time.monotonic() < until:
        time.sleep(0.05)
    assert len(kept.items) == 1


def test_a_surrogate_pair_is_one_character_and_passes(url: str) -> None:
    """After the store check above: it is answered, so it may be kept."""
    reply = raw_post(url, doc('"smile \\ud83d\\ude00"'))
    assert reply.status_code == 200 and set(reply.json()["answers"]) == {"u"}
