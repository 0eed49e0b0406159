"""The upstream client and tier against a third-party System One server: jevcompat 0.1.1's
reference mock (``jevcompat mock``), started by the tests on loopback, with its own faults
injected. Where a test counts the requests the server saw, the mock runs in-process from its own
``make_server`` (the same server code, on a thread); where it is killed or paused, in a process.

Every call ends in an answer or an ``UpstreamError`` with the status a server passes on (and
``Retry-After`` where waiting helps); none is lost and none hangs: every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from jevcompat.mock import MockConfig, Running, make_server, respond
from servers import MOCK_MODEL, free_port, jevcompat_mock, until, upstream

from cascade.errors import (
    UpstreamAnswerError,
    UpstreamError,
    UpstreamFailed,
    UpstreamRateLimited,
    UpstreamRefused,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from cascade.questions import Question, parse_request
from cascade.teachers.client import UpstreamClient
from cascade.teachers.keys import KeySource
from cascade.teachers.settings import UpstreamSettings
from cascade.tiers.base import Item
from cascade.tiers.upstream import UpstreamTier

STATE = "Help! My payouts have been failing for three days."
QUESTIONS: dict[str, Question] = parse_request({"state": STATE, "questions": {
    "urgent": {"type": "noul", "instructions": "Does this convey urgency?"},
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"Billing": "Payments, refunds", "Technical": "Bugs", "Café": "Everything else"}},
    "severity": {"type": "score", "instructions": "How severe is it?",
                 "criteria": ["Minor", "Degraded", "Blocking"]}}}).questions


def settings(url: str, **more: Any) -> UpstreamSettings:
    return UpstreamSettings(url, model=MOCK_MODEL, **more)


@contextmanager
def tier_at(url: str, **more: Any) -> Iterator[UpstreamTier]:
    tier = UpstreamTier("teacher", UpstreamClient(settings(url, **more)))
    try:
        yield tier
    finally:
        tier.close()


@contextmanager
def in_process(**config: Any) -> Iterator[tuple[str, MockConfig]]:
    """The mock from its own ``make_server`` on a thread: ``config.requests`` counts what it saw."""
    cfg = MockConfig(**config)
    with Running(cfg) as server:
        yield f"{server.url}/v1/systemone", cfg


def ask(tier: UpstreamTier, *qids: str, state: str = STATE) -> dict[str, list[float]]:
    reply = tier.reply([Item("item-1", state)], [list(qids or QUESTIONS)], QUESTIONS)
    return {qid: probs.tolist() for qid, probs in reply.answers[0].items()}


def body(*qids: str, state: str = STATE) -> dict[str, Any]:
    return {"state": state, "model": MOCK_MODEL, "questions": {
        q: QUESTIONS[q].model_dump(mode="json", exclude_none=True) for q in qids or QUESTIONS}}


# --- answers ---


def test_the_tier_sends_only_the_asked_questions_and_reads_the_servers_own_numbers() -> None:
    with upstream(jevcompat_mock()) as server, tier_at(server.url) as tier:
        got = ask(tier, "team", "severity")
        reply = tier.reply([Item("a", STATE), Item("b", "Another state")], [["urgent"], list(QUESTIONS)],
                           QUESTIONS)
        assert tier.watch.pinned is not None and tier.watch.pinned.model == "jevcompat-mock-0.1"
    truth = respond(MockConfig(), body("team", "severity"))["answers"]  # the mock's own model
    assert set(got) == {"team", "severity"}
    assert got["team"] == pytest.approx(list(truth["team"]["probabilities"].values()))
    assert got["severity"] == pytest.approx(list(truth["severity"]["probabilities"].values()))
    assert [set(a) for a in reply.answers] == [{"urgent"}, set(QUESTIONS)]
    assert reply.usage[1].input_tokens > 0 and reply.usage[1].questions == 3


REFUSED = {
    "noul-range": r"answers\.urgent: noul 1\.\d+; a noul answer is P\(yes\)",
    "choice-sum": r"answers\.team: probabilities: must sum to 1 within 0\.001; got sum 1\.2",
    "score-sum": r"answers\.severity: probabilities: must sum to 1 within 0\.001; got sum 0\.8",
    "choice-key-case": r"answers\.team: probabilities keyed \['billing', 'café', 'technical'\]",
    "nfd-keys": r"answers\.team: probabilities keyed \[.*'Cafe\u0301'",
    "score-keys-1-based": r"answers\.severity: probabilities keyed \['1', '2', '3'\]",
    "extra-answer": r"not asked \['__extra__'\]",
    "first-question-only": r"missing \['severity', 'team'\]",
    "boolean-type": r"answers\.urgent: type 'boolean', for a noul question",
    "choice-second": r"answers\.team: choice '\w+' is not its most probable option",
    "score-argmax": r"answers\.severity: score \d\.0 is not its probabilities' expectation",
    "xssi-200": r"answered 200 with a body that is not JSON: b.\)\]\}",
}


@pytest.mark.parametrize("fault", sorted(REFUSED))
def test_an_answer_of_the_wrong_shape_is_refused_naming_what_is_wrong(fault: str) -> None:
    with upstream(jevcompat_mock(fault)) as server, tier_at(server.url) as tier, \
            pytest.raises(UpstreamAnswerError, match=REFUSED[fault]) as refused:
        ask(tier)
    assert refused.value.status == 502


def test_faults_in_fields_a_teacher_does_not_read_change_nothing() -> None:
    """Confidence, legend, usage and extra keys are not the distribution: the same numbers."""
    harmless = ["no-usage", "float-usage", "nan", "unprefixed-extra", "confidence-over",
                "choice-no-confidence", "score-no-legend", "legend-1-based"]
    with upstream(jevcompat_mock(*harmless)) as server, tier_at(server.url) as tier:
        faulty = ask(tier)
    with upstream(jevcompat_mock()) as server, tier_at(server.url) as tier:
        assert ask(tier) == faulty


# --- failures a client can act on ---


def test_another_4xx_is_passed_back_unchanged_and_not_retried() -> None:
    with in_process() as (url, cfg):
        client = UpstreamClient(settings(url))
        with pytest.raises(UpstreamRefused, match="refused the request: 400") as refused:
            client.post(body() | {"model": "no-such-model"})
        client.close()
    error = refused.value
    assert (error.status, cfg.requests) == (400, 1)
    assert error.body is not None and json.loads(error.body) == {
        "detail": {"error_type": "api_usage_error", "message": "Unknown model: no-such-model"}}
    assert error.content_type == "application/json"


def test_a_500_is_a_502_and_not_retried() -> None:
    with in_process(faults=frozenset({"500-on-unknown-type"})) as (url, cfg):
        client = UpstreamClient(settings(url))
        with pytest.raises(UpstreamFailed, match=r"answered 500 .*KeyError") as failed:
            client.post({"state": STATE, "model": MOCK_MODEL, "questions": {"q": {"type": "verdict"}}})
        client.close()
    assert (failed.value.status, cfg.requests) == (502, 1)


def test_a_429_is_retried_after_its_retry_after_within_the_deadline() -> None:
    with in_process(busy_every=2) as (url, cfg):  # every 2nd request: 429, Retry-After: 0
        with tier_at(url) as tier:
            first, second = ask(tier), ask(tier)
        assert first == second and cfg.requests == 3


def test_a_429_that_persists_is_passed_on_with_its_retry_after() -> None:
    with in_process(busy_every=1) as (url, cfg):
        client = UpstreamClient(settings(url, retries=2))
        with pytest.raises(UpstreamRateLimited, match=r"rate-limiting this key \(429\)") as limited:
            client.post(body())
        client.close()
    assert (limited.value.status, limited.value.headers, cfg.requests) == (429, {"Retry-After": "0"}, 3)


def test_a_paused_key_sends_nothing_until_its_retry_after() -> None:
    with in_process() as (url, cfg):
        client = UpstreamClient(settings(url, deadline=5.0, read_timeout=4.0))
        client.pauses.pause(None, 30)  # as a 429 with Retry-After: 30 on this key leaves it
        with pytest.raises(UpstreamRateLimited) as limited:
            client.post(body())
        client.pauses.pause("Bearer other-key", 30)
        client.close()
    assert (limited.value.status, limited.value.retry_after, cfg.requests) == (429, 30, 0)


def test_an_upstream_that_is_not_there_is_a_502() -> None:
    client = UpstreamClient(settings(f"http://127.0.0.1:{free_port()}/v1/systemone", retries=2))
    with pytest.raises(UpstreamUnreachable, match=r"unreachable \(ConnectError.*after 3 tries") as gone:
        client.post(body())
    client.close()
    assert (gone.value.status, gone.value.headers) == (502, {"Retry-After": "1"})


def test_a_connect_a_full_accept_queue_drops_is_sent_again_within_the_deadline() -> None:
    """A busy upstream whose accept queue is full drops the connect (the kernel would resend it
    only after 1 s): nothing was sent, so the client tries again rather than failing the call.
    The mock's queue is filled for real, and drained only once the first try has given up."""
    server = make_server(MockConfig())
    port = server.server_address[1]
    fillers = _fill_accept_queue(port)
    client = UpstreamClient(settings(f"http://127.0.0.1:{port}/v1/systemone", connect_timeout=0.5))
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.post, body())
        until(lambda: _connecting(port), "the client's first connect")
        until(lambda: not _connecting(port), "the first connect given up")
        for sock in fillers:
            sock.close()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        reply = call.result(timeout=30)
    client.close()
    server.shutdown()
    server.server_close()
    assert reply.tries >= 2 and set(reply.data["answers"]) == set(QUESTIONS)


def test_an_upstream_that_takes_no_connection_at_all_is_a_502_after_every_try() -> None:
    server = make_server(MockConfig())  # listening, never accepting: its queue stays full
    port = server.server_address[1]
    fillers = _fill_accept_queue(port)
    client = UpstreamClient(settings(f"http://127.0.0.1:{port}/v1/systemone", connect_timeout=0.2, retries=2))
    every = r"took no connection within 0\.2 s \(each of 3 tries\)"
    with pytest.raises(UpstreamUnreachable, match=every) as post:
        client.post(body())
    with pytest.raises(UpstreamUnreachable, match=r"took no connection within 0\.2 s; check") as get:
        client.get(client.models_url)
    client.close()
    for sock in fillers:
        sock.close()
    server.server_close()
    assert {(error.value.status, error.value.retry_after) for error in (post, get)} == {(502, 1)}


def _fill_accept_queue(port: int) -> list[socket.socket]:
    """Connections the server never accepted, until the kernel drops the next one."""
    held: list[socket.socket] = []
    while True:
        sock = socket.socket()
        sock.settimeout(0.3)
        try:
            sock.connect(("127.0.0.1", port))
        except TimeoutError:
            sock.close()
            return held
        held.append(sock)


def _connecting(port: int) -> bool:
    """Whether a socket of this machine waits for ``port`` to take its connect (SYN_SENT)."""
    remote = f"0100007F:{port:04X}"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(row.split()[2] == remote and row.split()[3] == "02" for row in rows)


def test_an_upstream_slow_past_the_timeout_is_a_504_then_answers_again() -> None:
    """A paused process takes connections (the kernel's backlog) and never answers."""
    with upstream(jevcompat_mock()) as server, tier_at(server.url, read_timeout=0.5, deadline=1.0) as tier:
        server.pause()
        with pytest.raises(UpstreamTimeout, match=r"did not answer within 0\.5 s") as slow:
            ask(tier)
        server.resume()
        assert set(ask(tier)) == set(QUESTIONS)
    assert (slow.value.status, slow.value.retry_after) == (504, 1)


def test_an_upstream_killed_mid_burst_leaves_no_request_lost_or_hanging() -> None:
    """48 calls: 16 answered (4 at a time: the mock listens with a backlog of 5, and a connect it
    drops is sent again by the kernel after 1 s, past the 1 s connect timeout), then 32 from 16
    threads while the server stops answering and is killed. Every call ends answered or with a
    502/504 and Retry-After."""
    limits = {"connect_timeout": 1.0, "read_timeout": 2.0, "deadline": 3.0, "max_in_flight": 16}
    with upstream(jevcompat_mock()) as server, tier_at(server.url, **limits) as tier, \
            ThreadPoolExecutor(16) as pool:
        with ThreadPoolExecutor(4) as first:
            answered = [first.submit(ask, tier, "team", state=f"{STATE} {n}") for n in range(16)]
        wait(answered, timeout=60)
        server.pause()
        burst = [pool.submit(ask, tier, "team", state=f"{STATE} {n}") for n in range(16, 48)]
        time.sleep(0.3)  # ordering, not timing: let calls reach the paused server before it dies
        server.kill()
        _, pending = wait(answered + burst, timeout=120)
    assert not pending
    outcomes = [_outcome(future.exception()) for future in answered + burst]
    assert outcomes[:16] == ["answered"] * 16 and len(outcomes) == 48
    # the kill continues the paused server for an instant (SIGCONT, then SIGKILL), in which it may
    # answer a call of the burst: answered is an outcome too, and the rest end with a status
    failed = [outcome for outcome in outcomes[16:] if outcome != "answered"]
    assert failed and set(failed) <= {"502 retry 1", "504 retry 1"}


def _outcome(error: BaseException | None) -> str:
    if error is None:
        return "answered"
    assert isinstance(error, UpstreamError), repr(error)
    return f"{error.status} retry {error.retry_after}"


# --- keys and bodies ---


def test_forwarded_auth_remembers_accepted_keys_and_a_401_revokes_one_at_once() -> None:
    port = free_port()
    with upstream(jevcompat_mock(key="key-one", port=port)) as server:
        client = UpstreamClient(UpstreamSettings(server.url, model=MOCK_MODEL, forward_auth=True))
        client.post(body(), authorization="Bearer key-one")
        with pytest.raises(UpstreamRefused) as wrong:
            client.post(body(), authorization="Bearer not-a-key")
        assert client.accepted.accepted("Bearer key-one")
        assert not client.accepted.accepted("Bearer not-a-key")
    assert wrong.value.status == 401 and b"Cannot authenticate" in (wrong.value.body or b"")
    with upstream(jevcompat_mock(key="key-two", port=port)):  # the upstream now refuses key-one
        with pytest.raises(UpstreamRefused):
            client.post(body(), authorization="Bearer key-one")
        assert not client.accepted.accepted("Bearer key-one")
        client.post(body(), authorization="Bearer key-two")
        assert client.accepted.accepted("Bearer key-two")
    client.close()


def test_the_key_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    port, key_file = free_port(), tmp_path / "upstream.key"
    key_file.write_text("key-one\n")
    client = UpstreamClient(settings(f"http://127.0.0.1:{port}/v1/systemone", key=KeySource(file=key_file)))
    with upstream(jevcompat_mock(key="key-one", port=port)):
        client.post(body())
    key_file.write_text("key-two-rotated\n")
    with upstream(jevcompat_mock(key="key-two-rotated", port=port)):
        client.post(body())
    client.close()


def test_auto_compression_falls_back_to_what_the_upstream_takes() -> None:
    """The mock reads bodies as they come: a zstd or gzip body is a 422 to it, the plain one is
    not; the client ends on plain bodies and stays there."""
    long_state = STATE + " More detail." * 200
    with in_process() as (url, cfg):
        client = UpstreamClient(settings(url, compress="auto"))
        first = client.post(body(state=long_state))
        client.post(body(state=long_state))
        client.close()
    assert (first.tries, cfg.requests) == (1, 4)  # zstd, gzip, plain; then plain at once
