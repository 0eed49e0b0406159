"""``cascade serve --teacher URL`` without a bundle: a transparent pass-through that may collect.

Real upstreams on loopback: jevcompat 0.1.1's reference mock (deterministic, so its answers can be
compared byte for byte) and the project's own teacher server (a tiny llama: fast to load, and it
states an identity of its own, unlike the mock). A published SDK's own code calls the proxy.
The collected store is read back as a trainer reads it (``distill.loop.collected``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import (
    MOCK_MODEL,
    Upstream,
    free_port,
    jevcompat_mock,
    mock_at,
    serving,
    teacher_server,
    until,
    upstream,
)
from tinymodels import tiny_llama_path

from cascade.collect.collector import Collector
from cascade.questions import parse_request
from cascade.serve.proxy import ProxyConfig, create_proxy_app
from cascade.teachers.connect import open_client
from cascade.teachers.settings import UpstreamSettings
from distill.loop.collected import StoreTraffic, census, collected, training_set
from distill.store import LabelStore

STATE = "Help! My payouts have been failing for three days."
URGENT: dict[str, Any] = {"type": "noul", "instructions": "Does this convey urgency?"}
TEAM: dict[str, Any] = {"type": "choice", "instructions": "Which team should handle this?",
        "criteria": {"billing": "Payments, refunds", "technical": "Bugs, outages"}}
RARE = {"type": "score", "instructions": "How severe is it?", "criteria": ["Minor", "Degraded", "Blocking"]}


def body(state: str = STATE, **questions: Any) -> dict[str, Any]:
    return {"state": state, "model": MOCK_MODEL, "questions": questions or {"urgent": URGENT, "team": TEAM}}


@contextmanager
def proxy(url: str, store: Path | None = None, share: float = 1.0, max_items: int | None = None,
          **settings: Any) -> Iterator[str]:
    """A pass-through to ``url`` on loopback (collecting into ``store`` where given); the
    collector has written everything once the block ends."""
    collector = Collector(StoreTraffic(store), share, max_items) if store is not None else None
    app = create_proxy_app(open_client(UpstreamSettings(url, **settings)), ProxyConfig(collector=collector))
    try:
        with serving(app) as base:
            yield base
    finally:
        if collector is not None:
            collector.sink.close()  # type: ignore[attr-defined]


def test_the_upstreams_answers_come_back_unchanged(tmp_path: Path) -> None:
    with mock_at() as (url, cfg), proxy(url) as base:
        direct = httpx.post(url, json=body(), timeout=30)
        through = httpx.post(f"{base}/v1/systemone", json=body(), timeout=30)
        refused = httpx.post(f"{base}/v1/systemone", json={**body(), "model": "no-such-model"}, timeout=30)
        refused_direct = httpx.post(url, json={**body(), "model": "no-such-model"}, timeout=30)
        models = httpx.get(f"{base}/v1/models", timeout=30)
    assert (through.status_code, through.content) == (200, direct.content)
    assert through.headers["x-typesafe-request-id"] == direct.headers["x-typesafe-request-id"] == "req_mock"
    assert (refused.status_code, refused.content) == (refused_direct.status_code, refused_direct.content) \
        and refused.status_code == 400
    assert models.status_code == 200 and cfg.requests >= 2


def test_a_request_naming_no_model_is_sent_with_the_upstream_model() -> None:
    """--upstream-model was ignored by the pass-through: a client whose SDK names no model (as
    avrik-sdk's) got the 422 of an upstream that requires one. One naming a model keeps it."""
    nameless = {k: v for k, v in body().items() if k != "model"}
    with mock_at() as (url, _):
        with proxy(url) as base:
            assert httpx.post(f"{base}/v1/systemone", json=nameless, timeout=30).status_code == 422
        with proxy(url, model=MOCK_MODEL) as base:
            through = httpx.post(f"{base}/v1/systemone", json=nameless, timeout=30)
            named = httpx.post(f"{base}/v1/systemone", json={**body(), "model": "no-such-model"}, timeout=30)
    assert through.status_code == 200 and set(through.json()["answers"]) == {"urgent", "team"}
    assert named.status_code == 400


def test_a_published_sdk_calls_the_proxy(tmp_path_factory: pytest.TempPathFactory) -> None:
    from avrik_sdk import Client, choice, noul

    tiny = tiny_llama_path(tmp_path_factory.mktemp("tiny"))
    with upstream(teacher_server(tiny)) as server, proxy(server.url) as base, Client(base) as client:
        decision = client.decide(STATE, {"urgent": noul(URGENT["instructions"]),
                                         "team": choice(TEAM["instructions"], TEAM["criteria"])},
                                 request_id="sdk-1")
        direct = httpx.post(server.url, json={"state": STATE, "questions": {"urgent": URGENT}}, timeout=60)
    urgent = decision["urgent"].noul
    assert urgent is not None and 0 <= urgent <= 1 and decision["team"].choice in TEAM["criteria"]
    assert decision.audit.model_hash == direct.json()["audit"]["model_hash"]  # the teacher's own answer


def test_collected_traffic_is_counted_by_question_content_and_becomes_a_training_set(tmp_path: Path) -> None:
    store = tmp_path / "traffic.sqlite"
    with mock_at() as (url, _), proxy(url, store) as base:
        for k in range(6):
            ids = ("urgent", "team") if k % 2 else ("is_urgent", "dept")  # one question, two names
            asked = {ids[0]: URGENT, ids[1]: TEAM} | ({"sev": RARE} if k == 0 else {})
            assert httpx.post(f"{base}/v1/systemone", json=body(f"{STATE} Case {k % 5}.", **asked),
                              timeout=30).status_code == 200
        httpx.post(f"{base}/v1/systemone", content=b"not json", timeout=30)  # forwarded, not collected
    items = list(collected(store))
    assert len(items) == 6 and items[0].identity.model == "jevcompat-mock-0.1"
    assert {item.inclusion for item in items} == {1.0}  # the share; the collector's queue dropped none
    assert items[0].answers["is_urgent"].keys() == {"true", "false"}
    found = census(items, min_count=3)
    assert [(q.id, q.count) for q in found.heads] == [("dept", 5), ("is_urgent", 5)] or \
        [(q.id, q.count) for q in found.heads] == [("team", 5), ("urgent", 5)]
    assert [(q.question.type, q.count) for q in found.rest] == [("score", 1)]
    assert found.states == 5
    again = training_set(store, tmp_path / "train", min_count=3)
    questions = json.loads((tmp_path / "train" / "questions.json").read_text())["questions"]
    corpus = (tmp_path / "train" / "corpus.jsonl").read_text().splitlines()
    assert set(questions) == {q.id for q in again.heads} and len(corpus) == 5
    done = subprocess.run([sys.executable, "-m", "distill.cli", "collected", "--store", str(store),
                           "--min-count", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "6 collected request(s), 5 distinct state(s)" in done.stdout


def test_a_question_reworded_under_its_id_gets_an_id_of_its_own(tmp_path: Path) -> None:
    """Clients changed what "urgent" asks: the second training set mapped "urgent" to the new
    wording while the store held the old wording's labels under it, and training learnt the new
    question from both."""
    store, reworded = tmp_path / "traffic.sqlite", {**URGENT, "instructions": "Is the sender happy?"}
    for n, (question, case, asked) in enumerate(((URGENT, "Case", 3), (reworded, "Other", 5))):
        with mock_at() as (url, _), proxy(url, store) as base:  # the new wording asked most: "urgent"
            for k in range(asked):
                assert httpx.post(f"{base}/v1/systemone", json=body(f"{STATE} {case} {k}.", urgent=question),
                                  timeout=30).status_code == 200
        training_set(store, tmp_path / f"w{n}", min_count=3)
    questions = json.loads((tmp_path / "w1" / "questions.json").read_text())["questions"]
    ids = {questions[qid]["instructions"]: qid for qid in questions}
    assert ids[URGENT["instructions"]] != ids[reworded["instructions"]]
    rows = [json.loads(line) for line in (tmp_path / "w1" / "corpus.jsonl").read_text().splitlines()]
    new_items = {row["id"] for row in rows if "Other" in row["text"]}
    with LabelStore.open_existing(store) as opened:
        assert set(opened.labels(ids[reworded["instructions"]])) == new_items  # none of the old wording's
        opened.check_questions(parse_request({"state": "-", "questions": questions}).questions)


def test_collection_keeps_its_share_and_size_and_stops_at_another_teacher(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    store = tmp_path / "traffic.sqlite"
    with mock_at() as (url, _), proxy(url, store, share=1.0, max_items=3) as base:
        codes = [httpx.post(f"{base}/v1/systemone", json=body(f"{STATE} {k}"), timeout=30).status_code
                 for k in range(5)]
        counts = httpx.get(f"{base}/metrics", timeout=30).text
    assert codes == [200] * 5 and len(list(collected(store))) == 3
    assert 'cascade_collect_total{outcome="full"} 2.0' in counts
    tiny = tiny_llama_path(tmp_path_factory.mktemp("tiny"))
    with upstream(teacher_server(tiny)) as server, proxy(server.url, store) as base:
        other = httpx.post(f"{base}/v1/systemone", json={"state": STATE, "questions": {"urgent": URGENT}},
                           timeout=60)
        failed = 'cascade_collect_total{outcome="failed"} 1.0'
        until(lambda: failed in httpx.get(f"{base}/metrics", timeout=30).text,
              "the store refused another teacher's answer")
    assert other.status_code == 200  # the client is answered; the store refuses another teacher
    assert len(list(collected(store))) == 3


def test_the_proxy_passes_failures_on_with_retry_after(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/systemone"
    with proxy(url, read_timeout=1.0, deadline=2.0) as base:
        with upstream(jevcompat_mock(port=port)) as server:
            ok = httpx.post(f"{base}/v1/systemone", json=body(), timeout=30)
            server.pause()
            slow = httpx.post(f"{base}/v1/systemone", json=body(), timeout=30)
            server.kill()
        dead = httpx.post(f"{base}/v1/systemone", json=body(), timeout=30)
    assert ok.status_code == 200
    assert (slow.status_code, slow.headers["retry-after"]) == (504, "1")
    assert (dead.status_code, dead.headers["retry-after"]) == (502, "1")


def test_from_zero_data_collected_traffic_trains_a_bundle_served_in_front_of_the_same_url(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The zero-data tutorial (docs/upstream.md): pass through and collect, `cascade collected`,
    train and calibrate with no teacher model, then the bundle escalates to the same URL, certified."""
    from cascade.routing.router import Cascade
    from distill.cli import main

    store, data, bundle = tmp_path / "traffic.sqlite", tmp_path / "data", tmp_path / "support-v1"
    topics = ["payout failed", "invoice is wrong", "the app crashes", "login is broken", "refund please",
              "server down", "charged twice", "export has a bug"]
    with mock_at() as (url, _):
        with proxy(url, store) as base:
            for k in range(120):
                state = f"Ticket {k}: {topics[k % 8]} and {topics[(k * 3) % 8]}."
                assert httpx.post(f"{base}/v1/systemone", json=body(state), timeout=30).status_code == 200
        assert main(["collected", "--store", str(store), "--min-count", "50", "--out", str(data)]) == 0
        assert (data / "corpus.jsonl").stat().st_mode & 0o777 == 0o600  # the states: customer text
        assert main(["train", "--questions", str(data / "questions.json"), "--corpus",
                     str(data / "corpus.jsonl"), "--store", str(store), "--bundle", str(bundle)]) == 0
        assert main(["calibrate", "--bundle", str(bundle), "--corpus", str(data / "corpus.jsonl"), "--store",
                     str(store), "--target-agreement", "0.6", "--delta", "0.2", "--report",
                     str(tmp_path / "report"), "--upstream-price", "request=0.01,unit=EUR"]) == 0
        said = capsys.readouterr().out
        traffic = json.loads((tmp_path / "report" / "report.json").read_text())["teacher_traffic"]
        assert traffic["items"] > traffic["calls"] > 0 and traffic["asked"] == 2 * traffic["items"]
        spent, saved = 0.01 * traffic["calls"], 0.01 * (traffic["items"] - traffic["calls"])
        assert (f"a teacher behind a URL gets {traffic['calls']} calls for {traffic['items']} items" in said
                and said.count(f"{spent:.4g} EUR spent, {saved:.4g} EUR saved") == 1)
        assert main(["evaluate", "--bundle", str(bundle), "--corpus", str(data / "corpus.jsonl"), "--store",
                     str(store), "--json", str(tmp_path / "e.json"), "--upstream-price", "question=1"]) == 0
        evaluated = json.loads((tmp_path / "e.json").read_text())["teacher_traffic"]
        line = next(x for x in capsys.readouterr().out.splitlines() if "a teacher behind a URL" in x)
        assert line.endswith(f"{evaluated['sent']:.4g} USD spent, "
                             f"{evaluated['asked'] - evaluated['sent']:.4g} USD saved")
        with Cascade.load(bundle, teacher=UpstreamSettings(url, model=MOCK_MODEL), threads=1) as cascade:
            answers = [a for k in range(20)
                       for a in cascade.decide(f"Ticket {k}: {topics[k % 8]}.").answers.values()]
    routings = [a.routing for a in answers if a.routing is not None]
    assert len(routings) == len(answers) == 40 and all(r.certified for r in routings)
    assert all(r.upstream == (r.tier == "teacher") for r in routings)


def test_the_server_logs_no_line_per_forwarded_request() -> None:
    """Its stderr says what it serves and what goes wrong, not each upstream call (the HTTP client
    logs those at INFO, the level the server logs at)."""
    port = free_port()
    with upstream(jevcompat_mock()) as mock:
        command = [sys.executable, "-m", "distill.cli", "serve", "--teacher", mock.url, "--port", str(port),
                   "--upstream-model", MOCK_MODEL]
        with upstream(Upstream(command, port, ready="/health").wait_ready()) as server:
            replies = [httpx.post(f"{server.base}/v1/systemone", json=body(f"state {n}"), timeout=30)
                       for n in range(3)]
            said = server.stderr()
    assert [reply.status_code for reply in replies] == [200] * 3
    assert "passing requests through to" in said and "HTTP Request" not in said and mock.url in said
