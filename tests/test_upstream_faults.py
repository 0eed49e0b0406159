"""The upstream client against an upstream that misbehaves in ways no real server here can be
made to: a ``Retry-After`` of ``inf``, a body dripped a byte at a time, an answer nested 200,000
deep, an answer of 33 MiB. A small HTTP server on loopback plays each (the only fake upstream in
the tests: the third-party servers of ``tests/servers.py`` and their fault lists have none of
these). Each call ends in an error a server passes on with its status, never a bug, and a key
paused by one answer is paused for a bounded time."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import zstandard

from cascade.errors import (
    UpstreamAnswerError,
    UpstreamFailed,
    UpstreamRateLimited,
    UpstreamRefused,
    UpstreamTimeout,
)
from cascade.teachers.client import MAX_REPLY_BYTES, MAX_RETRY_AFTER, UpstreamClient, retry_after
from cascade.teachers.keys import KeySource
from cascade.teachers.settings import UpstreamSettings

ANSWER = json.dumps({"model": "m", "answers": {"q": {"type": "noul", "noul": 0.5}}}).encode()
Behaviour = Callable[[BaseHTTPRequestHandler], None]


@pytest.fixture
def upstream() -> Iterator[Callable[[Behaviour], str]]:
    """A loopback server that answers every POST as the test says; yields a setter of how."""
    served: list[Behaviour] = []

    class Misbehaving(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            served[-1](self)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def behave(how: Behaviour) -> str:
        served.append(how)
        return f"http://127.0.0.1:{server.server_address[1]}/v1/systemone"

    try:
        yield behave
    finally:
        server.shutdown()
        server.server_close()


def answer(status: int, body: bytes, **headers: str) -> Behaviour:
    def reply(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return reply


def ask(url: str, **settings: float) -> None:
    client = UpstreamClient(UpstreamSettings(url=url, **settings))  # type: ignore[arg-type]
    try:
        client.post({"state": "x", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}})
    finally:
        client.close()


def test_retry_after_is_bounded_and_never_infinite() -> None:
    assert retry_after("inf") == retry_after("1e300") == MAX_RETRY_AFTER
    assert retry_after("nan") is None and retry_after("-5") == 0.0 and retry_after("7") == 7.0


@pytest.mark.parametrize("status", [429, 503])
def test_an_infinite_retry_after_is_passed_on_bounded_and_pauses_the_key_for_a_bounded_time(
        upstream: Callable[[Behaviour], str], status: int) -> None:
    """It was an OverflowError on every later call: a pass-through down until restarted."""
    url = upstream(answer(status, b'{"error": "busy"}', **{"Retry-After": "inf"}))
    client = UpstreamClient(UpstreamSettings(url=url, deadline=2.0))
    body = {"state": "x", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}
    try:
        for _ in range(2):  # the second call meets the first one's pause (a 429) or asks again (503)
            with pytest.raises(UpstreamRateLimited if status == 429 else UpstreamFailed) as caught:
                client.post(body)
            assert caught.value.retry_after == MAX_RETRY_AFTER
    finally:
        client.close()


def test_a_body_dripped_past_the_deadline_ends_at_the_deadline(upstream: Callable[[Behaviour], str]) -> None:
    """It ran for as long as the drip (the read timeout bounds each wait, not the whole read)."""
    def drip(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(ANSWER)))
        handler.end_headers()
        for byte in ANSWER:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.2)

    # without the deadline: the whole answer, after 10 s or more; said as the read's 1 s before
    with pytest.raises(UpstreamTimeout, match=r"within the call's deadline of 1\.5 s \(\d+\.\d s spent\)"):
        ask(upstream(drip), deadline=1.5, read_timeout=1.0)


def test_headers_dripped_past_the_deadline_end_at_the_deadline(upstream: Callable[[Behaviour], str]) -> None:
    """The deadline was checked only while the body came: a status line and headers dripped a
    byte at a time held the call (and its slot) for minutes, then called it late. The drip here
    would take 30 s; the call must end with the upstream still dripping."""
    sent: list[int] = []

    def drip(handler: BaseHTTPRequestHandler) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Pad: y\r\n" * 14
        for byte in head:
            try:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
            except OSError:  # the client gave up
                return
            sent.append(byte)
            time.sleep(0.15)

    with pytest.raises(UpstreamTimeout, match=r"within the call's deadline of 1\.5 s"):
        ask(upstream(drip), deadline=1.5, read_timeout=1.0)
    assert len(sent) < 200


@pytest.mark.parametrize("head", [b"HTTP/1.1 200 OK\r\nX-Pad: " + b"y" * 200_000 + b"\r\n\r\n",
                                  b"ICY 200 OK\r\n\r\n"])
def test_an_answer_that_is_not_readable_http_is_a_502_sent_once(upstream: Callable[[Behaviour], str],
                                                                 head: bytes) -> None:
    """A head over httpcore's 100 KiB, or a status line that is not HTTP: it was sent three times
    and said "unreachable; check that it runs" of an upstream that had answered each."""
    sent: list[int] = []

    def reply(handler: BaseHTTPRequestHandler) -> None:
        sent.append(1)
        handler.wfile.write(head)

    with pytest.raises(UpstreamAnswerError, match="answered with HTTP this client cannot read") as caught:
        ask(upstream(reply))
    assert caught.value.status == 502 and sent == [1]


def test_a_zstd_answer_is_refused_unread(upstream: Callable[[Behaviour], str]) -> None:
    """Never asked for, yet inflated a whole chunk at once: 32 KB of zeros took 2.3 GB."""
    bomb = zstandard.ZstdCompressor(level=19).compress(b"0" * (64 * 2 ** 20))
    with pytest.raises(UpstreamAnswerError, match="a body in 'zstd', which this client never asks for"):
        ask(upstream(answer(200, bomb, **{"Content-Encoding": "zstd"})))


def echo(status: int) -> Behaviour:
    """An upstream that quotes the request's headers in its refusal, as some debug pages do."""
    def reply(handler: BaseHTTPRequestHandler) -> None:
        answer(status, f"refused; you sent {handler.headers}".encode())(handler)
    return reply


@pytest.mark.parametrize("status", [500, 422, 401])
def test_the_servers_own_key_echoed_by_the_upstream_reaches_no_client(
        upstream: Callable[[Behaviour], str], monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    """A 5xx was quoted (200 characters) and a 4xx relayed whole into what the client gets, key
    and all. And a 401/403 of the server's own key was passed on as the client's: typesafe-sdk
    raised PermissionDenied for a client whose key was valid."""
    monkeypatch.setenv("OWN_KEY", "own-s3cr3t-key")
    client = UpstreamClient(UpstreamSettings(url=upstream(echo(status)), key=KeySource(env="OWN_KEY"),
                                             retries=0))
    body = {"state": "x", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}
    try:
        for _ in range(2):  # the second: the refusal remembered, no call
            with pytest.raises((UpstreamFailed, UpstreamRefused)) as caught:
                client.post(body)
            error = caught.value
            seen = str(error) + (getattr(error, "body", None) or b"").decode()
            assert "own-s3cr3t-key" not in seen and (status == 401 or "***" in seen), seen
            if status == 401:
                assert isinstance(error, UpstreamFailed) and error.status == 502
                assert "refused this server's own upstream key" in str(error)
            if status != 401:
                break
    finally:
        client.close()


def test_the_key_echoed_in_a_header_or_json_escaped_reaches_no_client(
        upstream: Callable[[Behaviour], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An x- header of a refusal is passed on: one echoing the key handed it over; and a key with
    a "/" echoed by a JSON encoder that writes it "\\/" was not masked."""
    monkeypatch.setenv("OWN_KEY", "own/s3cr3t/key")

    def reply(handler: BaseHTTPRequestHandler) -> None:
        sent = handler.headers["Authorization"]
        echoed = b'{"auth": "' + sent.replace("/", "\\/").encode() + b'"}'  # as PHP's json_encode
        answer(400, echoed, **{"X-Debug-Auth": sent})(handler)

    client = UpstreamClient(UpstreamSettings(url=upstream(reply), key=KeySource(env="OWN_KEY"), retries=0))
    try:
        with pytest.raises(UpstreamRefused) as caught:
            client.post({"state": "x", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}})
    finally:
        client.close()
    seen = f"{caught.value} {caught.value.body!r} {caught.value.passed}"
    assert "s3cr3t" not in seen and caught.value.passed.get("x-debug-auth") == "***", seen


def test_a_refusal_of_a_call_sent_with_no_key_says_so(upstream: Callable[[Behaviour], str]) -> None:
    with pytest.raises(UpstreamFailed, match="refused a call this server sent with no key"):
        ask(upstream(answer(401, b"no key")))


def test_a_wrong_route_is_a_502_and_a_5xx_carries_retry_after(upstream: Callable[[Behaviour], str]) -> None:
    """A 404 was relayed as the client's own "no route /v1/systemone", and a 500 (or a 503 with
    no Retry-After) was a 502 with none, where an unreachable upstream said 1 s."""
    with pytest.raises(UpstreamFailed, match="has no System One route there") as caught:
        ask(upstream(answer(404, b"No route /v1/systemone")))
    assert caught.value.status == 502
    for status in (500, 503):
        with pytest.raises(UpstreamFailed) as caught:
            ask(upstream(answer(status, b"boom")), deadline=1.0)
        assert (caught.value.status, caught.value.retry_after) == (502, 1)


def test_an_answer_nested_past_any_parser_is_a_502_not_a_bug(upstream: Callable[[Behaviour], str]) -> None:
    with pytest.raises(UpstreamAnswerError, match="not JSON"):
        ask(upstream(answer(200, b"[" * 200_000 + b"]" * 200_000)))


def test_an_answer_past_the_size_bound_is_a_502_read_no_further(upstream: Callable[[Behaviour], str]) -> None:
    with pytest.raises(UpstreamAnswerError, match="with a body over 32 MiB"):
        ask(upstream(answer(200, ANSWER + b" " * MAX_REPLY_BYTES)))


def judging(encodings: list[str | None], takes_compressed: bool) -> Behaviour:
    """An upstream that refuses (400) a body that says "bad", and one compressed where it does
    not take compression; ``encodings`` records what each request came in."""
    def reply(handler: BaseHTTPRequestHandler) -> None:
        encoding = handler.headers.get("Content-Encoding")
        encodings.append(encoding)
        body = getattr(handler, "body", b"")
        body = gzip.decompress(body) if encoding == "gzip" else \
            zstandard.ZstdDecompressor().decompressobj().decompress(body) if encoding == "zstd" else body
        refused = b'"bad' in body or (encoding is not None and not takes_compressed)
        answer(400 if refused else 200, b'{"error": "no"}' if refused else ANSWER)(handler)
    return reply


def request(word: str) -> dict[str, object]:
    return {"state": f"{word} " + "a long state " * 100, "model": word,
            "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}


@pytest.mark.parametrize(("takes_compressed", "seen"), [
    (True, ["zstd", "zstd", "zstd"]),  # settled on zstd: a bad body is refused once, zstd kept
    (False, ["zstd", "gzip", None, "zstd", "gzip", None, None]),  # a bad body says nothing of zstd
])
def test_a_refused_body_turns_compression_off_only_where_the_plain_body_is_taken(
        upstream: Callable[[Behaviour], str], takes_compressed: bool, seen: list[str | None]) -> None:
    """One request the upstream refused for its own content turned compression off for good."""
    encodings: list[str | None] = []
    client = UpstreamClient(UpstreamSettings(url=upstream(judging(encodings, takes_compressed)),
                                             compress="auto"))
    try:
        words = ["good", "bad", "good"] if takes_compressed else ["bad", "good", "good"]
        for word in words:
            if word == "bad":
                with pytest.raises(UpstreamRefused):
                    client.post(request(word))
            else:
                client.post(request(word))
    finally:
        client.close()
    assert encodings == seen


@pytest.mark.parametrize("status", [400, 429])
def test_a_refusal_carries_the_upstreams_request_id_and_rate_limit_headers(
        upstream: Callable[[Behaviour], str], status: int) -> None:
    """A 2xx's were passed on by a pass-through, a refusal's dropped: where a client needs them."""
    extra = {"X-Request-Id": "up-123", "RateLimit-Remaining": "0", "RateLimit-Reset": "30"}
    url = upstream(answer(status, b'{"error": "no"}', **{"Retry-After": "30", **extra}))
    with pytest.raises(UpstreamRefused if status == 400 else UpstreamRateLimited) as caught:
        ask(url, deadline=1.0)
    headers = {name.lower(): value for name, value in caught.value.headers.items()}
    assert {name.lower(): value for name, value in extra.items()}.items() <= headers.items()
    assert headers["retry-after"] == "30"
