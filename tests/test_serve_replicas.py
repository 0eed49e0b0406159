"""Two ``cascade serve`` replicas on loopback, one PostgreSQL store: the audits of both feed one
drift watch, a drift sent to one replica demotes the question on both, and a replica started
afterwards replays the same state. Also: a store URL that fails is one line before any model loads.
The bundle is ``servers``' (gemma-3-270m live as the teacher, an encoder that disagrees with it on
"urgent" about half the time: a drift the alarm must catch)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from corpora import QUESTIONS_JSON
from servers import KEPT, free_port, serving_bundle
from test_audit import items

from cascade.bundle.manifest import Bundle
from distill.cli import main

pytest_plugins = ("pgfixtures",)
POLL_S = 0.25


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("replicas") / "support", gemma_path)


class Replica:
    """``cascade serve`` in a process of its own, auditing every request into ``store``."""

    def __init__(self, bundle: Path, teacher: Path, store: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (not a pipe: a full one would stall it)
        command = [sys.executable, "-m", "distill.cli", "serve", "--bundle", str(bundle), "--teacher",
                   str(teacher), "--port", str(self.port), "--threads", "1", "--audit-store", store,
                   "--audit-share", "1", "--audit-poll", str(POLL_S)]
        self.requests = 0
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log,
                                        env={**os.environ})

    def wait_ready(self, seconds: float = 180.0) -> Replica:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.stderr()
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"replica on port {self.port} not ready: {self.stderr()}")

    def ask(self, state: str) -> dict:
        """The routing of ``state``'s answer; counted in ``requests`` (each is audited after it)."""
        self.requests += 1
        body = {"state": state, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
        reply = httpx.post(f"{self.base}/v1/systemone", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["answers"][KEPT]["x_routing"]

    def gauge(self, name: str, label: str = f'question="{KEPT}"') -> float:
        text = httpx.get(f"{self.base}/metrics", timeout=30).text
        line = f"{name}{{{label}}}"
        return next((float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)), 0.0)

    def until(self, name: str, value: float, seconds: float = 600.0,
              label: str = f'question="{KEPT}"') -> float:
        """Wait until the gauge reads ``value``; the seconds it took. The bound is generous: each
        audit is a gemma read, and on shared cores thirty of them can take minutes."""
        started = time.monotonic()
        while self.gauge(name, label) != value:
            now = self.gauge(name, label)
            assert time.monotonic() - started < seconds, f"{name}{{{label}}} stayed {now}, not {value}"
            time.sleep(0.02)
        return time.monotonic() - started

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def settled(writers: list[Replica], readers: list[Replica]) -> float:
    """Wait until every audit of ``writers``' requests is in the store and every replica has read
    them all (audits run after the answer is sent, and others read the store every poll); the
    count of audited items they then agree on."""
    for writer in writers:
        writer.until("cascade_audits_total", writer.requests, label='outcome="audited"')
    total = max(writer.gauge("cascade_audited_items") for writer in writers)  # the last to write read all
    for replica in writers + readers:
        replica.until("cascade_audited_items", total)
    return total


def test_two_replicas_share_one_audit_stream_and_one_drift_watch(
    bundle_dir: Path, gemma_path: Path, postgres_url: str
) -> None:
    replicas = [Replica(bundle_dir, gemma_path, postgres_url) for _ in range(2)]
    try:
        a, b = (replica.wait_ready() for replica in replicas)
        states = [item.state for item in items(40)]
        for n in range(3):  # the audits of both feed one watch: each counts all six
            a.ask(states[n])
            b.ask(states[3 + n])
        a.until("cascade_audited_items", 6)
        b.until("cascade_audited_items", 6)
        for state in states[6:]:  # a drift sent to one replica only
            a.ask(state)
            if a.gauge("cascade_demoted") == 1:
                break
        assert a.until("cascade_demoted", 1) >= 0
        lag = b.until("cascade_demoted", 1, seconds=300)
        print(f"demotion held on the other replica {lag:.2f} s after the first had it (poll {POLL_S} s)")
        settled([a, b], [])
        route = b.ask(states[-1])
        assert (route["tier"], route["demoted"]) == ("teacher", True)
        password = postgres_url.split(":")[2].split("@")[0]
        assert all(password not in httpx.get(f"{r.base}/metrics").text for r in (a, b))
        restarted = Replica(bundle_dir, gemma_path, postgres_url)
        replicas.append(restarted)
        restarted.wait_ready()  # the stream replayed while it loaded: demoted from its first request
        assert restarted.gauge("cascade_demoted") == 1
        settled([a, b], [restarted])
        assert "drift alarm on question" in b.stderr(), "the replica that read it says so too"
    finally:
        for replica in replicas:
            replica.stop()
    for replica in replicas:
        assert postgres_url.split(":")[2].split("@")[0] not in replica.stderr(), "no password in the logs"


def test_a_store_url_that_fails_is_one_line_before_any_model_loads(
    bundle_dir: Path, postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    refused = postgres_url.replace(postgres_url.split(":")[2].split("@")[0], "wrong-pw", 1)
    argv = ["serve", "--bundle", str(bundle_dir), "--audit-share", "0.5", "--audit-store", refused,
            "--port", str(free_port())]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "StoreError: PostgreSQL refused the credentials for" in err
    assert "wrong-pw" not in err and "serving" not in err, "refused before the server started"
