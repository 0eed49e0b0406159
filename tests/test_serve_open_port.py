"""``cascade serve`` on an open port: safe defaults, and forwarded auth without gaps.

The refusals are tested through the command's own ``main`` (nothing binds a port for them). The
servers are real, on loopback: the cascade app over the session's trained bundle, the
pass-through, and as their upstream jevcompat 0.1.1's reference mock, which can require a key.
Its ``requests`` counts only the POSTs its key check lets through, so the mock here runs under a
subclass of its own request handler that also counts every request it is sent (``Counted``):
that is how a test sees that a junk key reached the upstream once. A revoked key's re-check is
driven by a clock the test moves (the key tables take one), never by waiting.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpora import QUESTIONS_JSON, corpus_items
from jevcompat.mock import Handler, MockConfig
from servers import KEPT, MOCK_MODEL, free_port, serving, serving_bundle, until

from cascade.bundle.manifest import Bundle
from cascade.errors import CascadeError
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig, create_app
from cascade.serve.auth import MAX_KEY_CHECKS
from cascade.serve.engine_settings import EngineSettings
from cascade.serve.lifecycle import ServeOptions, check_auth
from cascade.serve.proxy import ProxyConfig, create_proxy_app
from cascade.teachers.client import UpstreamClient
from cascade.teachers.keys import AcceptedKeys, KeySource, Pauses, Refusal, RejectedKeys, is_loopback
from cascade.teachers.settings import UpstreamSettings
from distill.cli import main

STATE = corpus_items()[5].text  # like the training messages, so that the encoder's gate lets it in
GOOD, JUNK, OTHER = "k1", "junk-key", "k2"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Counted:
    """jevcompat's mock on a thread, each request it is sent counted (method, path, its
    Authorization, its Content-Encoding) before its own handler answers it."""

    url: str
    config: MockConfig
    seen: list[tuple[str, str, str | None, str | None]] = field(default_factory=list)

    def calls(self, authorization: str | None = None, method: str = "POST") -> int:
        return sum(1 for m, _, auth, _ in self.seen if m == method and auth == authorization)


@contextmanager
def counted_mock(**config: Any) -> Iterator[Counted]:
    cfg = MockConfig(**config)
    counted = Counted("", cfg)

    class Counting(Handler):
        def _count(self) -> None:
            counted.seen.append((self.command, self.path, self.headers.get("Authorization"),
                                 self.headers.get("Content-Encoding")))

        def do_GET(self) -> None:
            self._count()
            super().do_GET()

        def do_POST(self) -> None:
            self._count()
            super().do_POST()

    Counting.cfg = cfg
    server = ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    counted.url = f"http://127.0.0.1:{server.server_address[1]}/v1/systemone"
    try:
        yield counted
    finally:
        server.shutdown()
        server.server_close()


def ask(base: str, key: str | None, state: str = STATE) -> httpx.Response:
    return httpx.post(f"{base}/v1/systemone", json={"state": state, "model": MOCK_MODEL,
                                                    "questions": {KEPT: QUESTIONS_JSON[KEPT]}},
                      headers=bearer(key) if key else {}, timeout=60)


# --- refused before anything binds or loads: through the command itself ---


def command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    """``cascade ARGV`` run through its main: its exit status and the lines it wrote to stderr."""
    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_host_beyond_loopback_without_a_key_is_refused_in_one_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CASCADE_API_KEY", raising=False)
    url = f"http://127.0.0.1:{free_port()}/v1/systemone"
    for argv in (["serve", "--teacher", url, "--host", "0.0.0.0"],
                 ["serve", "--teacher", str(tmp_path / "teacher.gguf"), "--host", "10.1.2.3"],
                 ["serve", "--bundle", str(tmp_path / "none"), "--teacher", url, "--host", "example.com"]):
        code, lines = command(capsys, *argv)
        assert code == 2 and len(lines) == 1, lines
        assert "opens the port to other machines" in lines[0] and "--api-key" in lines[0] \
            and "--insecure-no-auth" in lines[0]
    assert "--forward-auth" in command(capsys, "serve", "--teacher", url, "--host", "0.0.0.0")[1][0]
    # a teacher served alone cannot forward auth, so its refusal does not offer it
    assert "--forward-auth" not in command(capsys, "serve", "--teacher", str(tmp_path / "t.gguf"),
                                           "--host", "0.0.0.0")[1][0]


def test_forward_auth_with_an_api_key_is_refused_in_one_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CASCADE_API_KEY", raising=False)
    url = f"http://127.0.0.1:{free_port()}/v1/systemone"
    code, lines = command(capsys, "serve", "--teacher", url, "--forward-auth", "--api-key", "secret-1")
    assert code == 2 and len(lines) == 1 and "give one of them" in lines[0] and "--api-key" in lines[0]
    monkeypatch.setenv("CASCADE_API_KEY", "secret-2")  # the variable is a key as much as the flag
    code, lines = command(capsys, "serve", "--teacher", url, "--forward-auth")
    assert code == 2 and len(lines) == 1 and "$CASCADE_API_KEY" in lines[0]
    assert not any(secret in line for line in lines for secret in ("secret-1", "secret-2"))
    with pytest.raises(CascadeError, match="give one of them"):  # the library refuses it too
        create_app(None, ServeConfig(api_key="k", engine=EngineSettings(forward_auth=True)))


def test_loopback_needs_no_key_and_a_key_or_forwarded_auth_opens_any_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CASCADE_API_KEY", raising=False)
    monkeypatch.setenv("CASCADE_METRICS_KEY", "scrape")
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host) and check_auth(ServeOptions(host=host), False, True).key is None
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "", "10.0.0.1", "gpu-box", "localhost.x"))
    assert check_auth(ServeOptions(host="0.0.0.0", api_key="k"), False, True).key == "k"
    assert check_auth(ServeOptions(host="0.0.0.0"), True, True).warning is None
    assert check_auth(ServeOptions(host="0.0.0.0"), True, True).metrics_key == "scrape"


@pytest.mark.parametrize("key", ["s3cret-key\n", " s3cret-key", "s3cret key", "s3cret-clé"])
def test_a_key_no_client_can_send_is_refused_in_one_line_never_echoed(
        key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key read from a file with its newline, or one outside printable ASCII (a header is read
    as latin-1, not UTF-8), refused every caller with a 401 while the server said auth was on."""
    monkeypatch.delenv("CASCADE_API_KEY", raising=False)
    for options, given in ((ServeOptions(host="0.0.0.0", api_key=key), "--api-key"),
                           (ServeOptions(metrics_key=key), "--metrics-key")):
        with pytest.raises(CascadeError, match=f"the key given by {given} holds a space") as refused:
            check_auth(options, False, True)
        assert "s3cret" not in str(refused.value)
    monkeypatch.setenv("CASCADE_API_KEY", key)
    with pytest.raises(CascadeError, match=r"the key given by \$CASCADE_API_KEY holds"):
        check_auth(ServeOptions(), False, True)


def test_insecure_no_auth_serves_an_open_port_with_one_warning_and_a_key_in_the_clear_gets_one() -> None:
    """A pass-through on every interface, with no key checked, to an upstream on another machine
    over plain http:// (192.0.2.1: a documentation address, never called here) with a key."""
    port, secret = free_port(), "upstream-secret-397"
    command = [sys.executable, "-m", "distill.cli", "serve", "--teacher", "http://192.0.2.1:9/v1/systemone",
               "--host", "0.0.0.0", "--port", str(port), "--insecure-no-auth"]
    env = {**os.environ, "CASCADE_UPSTREAM_KEY": secret}
    env.pop("CASCADE_API_KEY", None)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        def up() -> bool:
            assert process.poll() is None, process.communicate()[1]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        until(up, "the pass-through answers /health")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert metrics.status_code == 200  # open on purpose: nothing is checked
    lines = stderr.splitlines()
    assert len([line for line in lines if "--insecure-no-auth" in line]) == 1, stderr
    assert len([line for line in lines if "over plain http://" in line]) == 1, stderr
    assert secret not in stderr


def test_a_key_bound_for_another_machine_over_http_is_warned_of_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPEN_PORT_TEST_KEY", "the-upstream-key")
    key = KeySource(env="OPEN_PORT_TEST_KEY")
    caplog.set_level(logging.WARNING, "cascade.upstream")
    far = f"http://192.0.2.1:{free_port()}/v1/systemone"
    clients = [UpstreamClient(UpstreamSettings(far, key=key)), UpstreamClient(UpstreamSettings(far, key=key)),
               UpstreamClient(UpstreamSettings(f"https://192.0.2.1:{free_port()}/v1/systemone", key=key)),
               UpstreamClient(UpstreamSettings(f"http://127.0.0.1:{free_port()}/v1/systemone", key=key)),
               UpstreamClient(UpstreamSettings(f"http://192.0.2.1:{free_port()}/v1/systemone"))]  # no key
    forwarding = UpstreamClient(UpstreamSettings(f"http://192.0.2.2:{free_port()}/v1/systemone",
                                                 forward_auth=True))
    for client in [*clients, forwarding]:
        client.close()
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 2, warned
    assert far in warned[0] and "the upstream key" in warned[0] and "callers' keys" in warned[1]
    assert not any("the-upstream-key" in line for line in warned)


# --- /metrics and the docs ---


@contextmanager
def proxy(url: str, **config: Any) -> Iterator[str]:
    """A pass-through to ``url`` (jevcompat's mock, which needs a model name) on loopback."""
    settings = {k: config.pop(k) for k in ("forward_auth", "compress", "key") if k in config}
    client = UpstreamClient(UpstreamSettings(url, model=MOCK_MODEL, **settings))
    with serving(create_proxy_app(client, ProxyConfig(**config))) as base:
        yield base


def test_metrics_take_the_key_or_their_own_and_the_docs_are_off_unless_asked_for() -> None:
    docs = ("/docs", "/redoc", "/openapi.json")
    with counted_mock() as mock:
        with proxy(mock.url, api_key="api") as base:
            assert httpx.get(f"{base}/metrics").status_code == 401
            assert httpx.get(f"{base}/metrics", headers=bearer("wrong")).status_code == 401
            assert httpx.get(f"{base}/metrics", headers=bearer("api")).status_code == 200
            assert [httpx.get(f"{base}{path}").status_code for path in docs] == [404, 404, 404]
            assert httpx.get(f"{base}/health").status_code == 200  # a load balancer needs no key
        with proxy(mock.url, api_key="api", metrics_key="scrape", docs=True) as base:
            assert httpx.get(f"{base}/metrics", headers=bearer("api")).status_code == 401
            assert httpx.get(f"{base}/metrics", headers=bearer("scrape")).status_code == 200
            assert httpx.get(f"{base}/v1/models", headers=bearer("scrape")).status_code == 401
            assert [httpx.get(f"{base}{path}").status_code for path in docs] == [200, 200, 200]


# --- the pass-through validates and compresses what it forwards ---


def test_the_pass_through_refuses_an_invalid_request_itself_and_compresses_what_it_forwards() -> None:
    long_state = STATE + " More detail about the failing payouts." * 60  # over 1 KiB: compressed
    with counted_mock() as mock, proxy(mock.url, compress="auto") as base:
        invalid = (b'{"state": "x"}', b"not json", b'{"state": "x", "questions": {"q": {"type": "nope"}}}')
        bad = [httpx.post(f"{base}/v1/systemone", content=content, timeout=30) for content in invalid]
        refused = len(mock.seen)
        first = ask(base, None, long_state)
        encodings = [encoding for *_, encoding in mock.seen]
        second = ask(base, None, long_state)
    assert [reply.status_code for reply in bad] == [422, 422, 422] and refused == 0
    assert all(reply.json()["error"]["code"] == "invalid_request" and reply.json()["detail"] for reply in bad)
    # zstd first, as the cascade's own upstream calls: the mock reads bodies as they come and refuses
    # it, then gzip, then plain, which the client keeps
    assert first.status_code == second.status_code == 200
    assert encodings == ["zstd", "gzip", None] and mock.seen[-1][3] is None


def test_the_pass_through_refuses_a_junk_key_from_its_cache_and_checks_metrics_upstream() -> None:
    with counted_mock(key=GOOD) as mock, proxy(mock.url, forward_auth=True) as base:
        junk = [ask(base, JUNK) for _ in range(3)]
        models = httpx.get(f"{base}/v1/models", headers=bearer(JUNK), timeout=30)
        metrics_junk = httpx.get(f"{base}/metrics", headers=bearer(JUNK), timeout=30)
        good = ask(base, GOOD)
        metrics_good = httpx.get(f"{base}/metrics", headers=bearer(GOOD), timeout=30)
    assert [reply.status_code for reply in junk] == [401, 401, 401]
    assert junk[0].content == junk[2].content  # the upstream's own refusal, given back from the cache
    assert (models.status_code, metrics_junk.status_code) == (401, 401)
    assert len([call for call in mock.seen if call[2] == f"Bearer {JUNK}"]) == 1  # one call for five requests
    assert (good.status_code, metrics_good.status_code) == (200, 200)


@contextmanager
def slow_to_refuse(release: threading.Event, **config: Any) -> Iterator[str]:
    """jevcompat's mock, its /v1/models holding a key other than its own until ``release`` (an
    upstream slow to refuse: seven seconds seen); yields its URL."""
    cfg = MockConfig(**config)

    class Slow(Handler):
        def do_GET(self) -> None:
            if self.path.endswith("/models") and self.headers.get("Authorization") != f"Bearer {cfg.key}":
                release.wait(120)
            super().do_GET()

    Slow.cfg = cfg
    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/systemone"
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_junk_keys_checked_upstream_never_hold_what_a_known_callers_request_needs() -> None:
    """Before, checking a junk key for /metrics ran on the event loop's default pool (six threads
    on two cores), which validation uses too, and a pass-through's /v1/models on its forwarding
    pool: keys the upstream is slow to refuse held them, and a known caller's request waited
    behind them. Now at most MAX_KEY_CHECKS run, on threads of their own; the rest get 503 at once."""
    release = threading.Event()
    with slow_to_refuse(release, key=GOOD) as url, proxy(url, forward_auth=True) as base:
        assert ask(base, GOOD).status_code == 200  # a key the upstream has answered: never checked again
        with ThreadPoolExecutor(12) as callers:
            junk = [callers.submit(httpx.get, f"{base}{path}", headers=bearer(f"junk-{n}"), timeout=120)
                    for n, path in enumerate(["/metrics", "/v1/models"] * 6)]
            until(lambda: sum(f.done() for f in junk) == len(junk) - MAX_KEY_CHECKS,
                  "the checks past the bound refused at once", 60)
            busy = [f.result() for f in junk if f.done()]
            assert all(r.status_code == 503 and r.headers["retry-after"] == "1" for r in busy)
            assert ask(base, GOOD).status_code == 200  # while the checks hang upstream
            release.set()
            held = [f.result().status_code for f in junk if f.result() not in busy]
    assert held == [401] * MAX_KEY_CHECKS


# --- forwarded auth on the cascade: every route checked, revocation within the re-check ---


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("open-port") / "support", gemma_path)


@contextmanager
def forwarding(bundle_dir: Path, url: str, clock: Callable[[], float], **config: Any) -> Iterator[str]:
    """The cascade with forwarded auth in front of ``url``, its key tables on ``clock``."""

    def load() -> Cascade:
        cascade = Cascade.load(bundle_dir, teacher=UpstreamSettings(url, model=MOCK_MODEL, forward_auth=True),
                               threads=1, accept_other_teacher=True)
        client = cascade.tiers[-1].client  # type: ignore[attr-defined]
        client.accepted.clock = client.rejected.clock = client.pauses.clock = clock
        return cascade

    settings = ServeConfig(engine=EngineSettings(forward_auth=True, max_wait=600.0), **config)
    with serving(create_app(load, settings)) as base:
        yield base


def test_forwarded_auth_checks_every_route_and_a_junk_key_costs_one_upstream_call(bundle_dir: Path) -> None:
    clock = Clock()
    with counted_mock(key=GOOD) as mock, forwarding(bundle_dir, mock.url, clock) as base:
        models = {key: httpx.get(f"{base}/v1/models", headers=bearer(key) if key else {}, timeout=60)
                  for key in (GOOD, JUNK, None)}
        metrics = {key: httpx.get(f"{base}/metrics", headers=bearer(key) if key else {}, timeout=60)
                   for key in (GOOD, JUNK, None)}
        junk = [ask(base, JUNK) for _ in range(3)]
        anonymous = [ask(base, None) for _ in range(2)]
        docs = httpx.get(f"{base}/docs", timeout=60)
    assert {key: reply.status_code for key, reply in models.items()} == {GOOD: 200, JUNK: 401, None: 403}
    assert models[GOOD].json()["models"][0]["name"] == "support"  # the bundle's, once the upstream vouched
    assert {key: reply.status_code for key, reply in metrics.items()} == {GOOD: 200, JUNK: 401, None: 403}
    assert [reply.status_code for reply in junk + anonymous] == [401, 401, 401, 403, 403]
    # each refused key reached the upstream once, however many requests and routes it was sent to
    assert mock.calls(f"Bearer {JUNK}", "GET") + mock.calls(f"Bearer {JUNK}") == 1
    assert mock.calls(None, "GET") + mock.calls(None) == 1
    assert docs.status_code == 404


def test_a_revoked_key_loses_local_answers_within_the_recheck_interval(bundle_dir: Path) -> None:
    clock = Clock()
    with counted_mock(key=GOOD) as mock, \
            forwarding(bundle_dir, mock.url, clock, metrics_key="scrape") as base:
        first = ask(base, GOOD)  # not vouched for yet: the upstream answers, and accepts the key
        local = ask(base, GOOD)
        sent = mock.calls(f"Bearer {GOOD}")
        mock.config.key = OTHER  # revoked upstream
        clock.now += 59  # within the re-check interval the key keeps local answers...
        still = ask(base, GOOD)
        clock.now += 2  # ...and past it, its next request goes upstream whole
        rechecked = ask(base, GOOD)
        after = ask(base, GOOD)
        calls = mock.calls(f"Bearer {GOOD}")
        scraped = httpx.get(f"{base}/metrics", headers=bearer("scrape"), timeout=60)
        not_scraped = httpx.get(f"{base}/metrics", headers=bearer(OTHER), timeout=60)
    assert first.json()["answers"][KEPT]["x_routing"]["upstream"] is True
    assert local.json()["answers"][KEPT]["x_routing"]["tier"] == "encoder" and sent == 1
    assert still.status_code == 200 and still.json()["answers"][KEPT]["x_routing"]["tier"] == "encoder"
    assert (rechecked.status_code, after.status_code) == (401, 401)
    assert calls == 2  # the re-check, then the cached refusal
    assert (scraped.status_code, not_scraped.status_code) == (200, 401)  # a metrics key of its own


# --- the tables are bounded ---


def test_every_key_table_prunes_ended_entries_and_holds_at_most_its_size() -> None:
    clock = Clock()
    accepted, rejected, pauses = AcceptedKeys(60, clock, size=3), RejectedKeys(10, clock, size=3), \
        Pauses(clock, size=3)
    refusal = Refusal(401, b'{"detail": "no"}', "application/json")
    for n in range(10):
        accepted.accept(f"Bearer a{n}")
        rejected.reject(f"Bearer r{n}", refusal)
        pauses.pause(f"Bearer p{n}", 30)
    assert (len(accepted), len(rejected), len(pauses)) == (3, 3, 3)
    assert accepted.accepted("Bearer a9") and not accepted.accepted("Bearer a0")  # the oldest went first
    assert rejected.refusal("Bearer r9") == refusal and rejected.refusal("Bearer r0") is None
    assert pauses.left("Bearer p9") == 30 and pauses.left("Bearer p0") == 0
    clock.now += 61  # every entry has ended: the next write drops them
    accepted.accept("Bearer fresh")
    rejected.reject("Bearer fresh", refusal)
    pauses.pause("Bearer fresh", 1)
    assert (len(accepted), len(rejected), len(pauses)) == (1, 1, 1)
    clock.now += 11
    assert rejected.refusal("Bearer fresh") is None  # a refusal is remembered for a short time only
    rejected.reject("Bearer x", refusal)
    rejected.clear("Bearer x")  # an acceptance clears a refusal at once
    assert rejected.refusal("Bearer x") is None
