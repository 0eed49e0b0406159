"""A URL as the teacher, against the project's own teacher server: ``cascade serve --teacher
gemma.gguf`` with no bundle, started by the tests on loopback (a process of its own, one thread).

Its answers are the in-process readout's, and state the GGUF's sha256 and each prompt's hash,
so a bundle certified against gemma escalates to the URL certified; a model swapped behind the
same URL is caught at its first answer; its queue refuses by expected wait with Retry-After.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import (
    ESCALATED,
    KEPT,
    MOCK_MODEL,
    free_port,
    jevcompat_mock,
    running,
    serving_bundle,
    teacher_server,
    upstream,
)
from tinymodels import tiny_llama_path

from cascade.bundle.manifest import Bundle
from cascade.errors import RouterError, TeacherChangedError, UpstreamFailed
from cascade.hashing import file_sha256
from cascade.questions import DecisionRequest, Question, parse_request
from cascade.readout.prompts import PROMPT_VERSION, template_sha256
from cascade.readout.scorer import Scorer
from cascade.routing.router import Cascade
from cascade.teachers.client import UpstreamClient
from cascade.teachers.settings import UpstreamSettings
from cascade.tiers.base import Item
from cascade.tiers.upstream import UpstreamTier

STATE = "Help! My payouts have been failing for three days and customers are angry."
REQUEST: DecisionRequest = parse_request({"state": STATE, "questions": {
    "urgent": {"type": "noul", "instructions": "Does this convey urgency?"},
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "Payments, invoicing, refunds", "technical": "Bugs, outages"}},
    "severity": {"type": "score", "instructions": "How severe is the problem?",
                 "criteria": ["Minor", "Degraded", "Blocking"]}}})
QUESTIONS: dict[str, Question] = dict(REQUEST.questions)


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path) -> Iterator[Any]:
    with upstream(teacher_server(gemma_path)) as server:
        yield server


def tier_at(url: str, **settings: Any) -> UpstreamTier:
    return UpstreamTier("teacher", UpstreamClient(UpstreamSettings(url, **settings)))


def ask(tier: UpstreamTier, state: str = STATE) -> dict[str, list[float]]:
    reply = tier.reply([Item("item-1", state)], [list(QUESTIONS)], QUESTIONS)
    return {qid: probs.tolist() for qid, probs in reply.answers[0].items()}


def test_the_teacher_server_answers_as_the_readout_and_states_its_identity(
        gemma_server: Any, gemma_scorer: Scorer, gemma_path: Path) -> None:
    tier = tier_at(gemma_server.url, compress="zstd")  # the server takes zstd bodies
    try:
        got = ask(tier)
    finally:
        tier.close()
    local = gemma_scorer.score(REQUEST)  # type: ignore[attr-defined]
    for qid, answer in local.answers.items():
        assert got[qid] == pytest.approx(list(answer.probabilities.values()), abs=0.02), qid
    pinned = tier.watch.pinned
    assert pinned is not None
    assert (pinned.model, pinned.model_hash) == (gemma_path.name, file_sha256(gemma_path))
    assert pinned.templates == {qid: template_sha256(q, PROMPT_VERSION) for qid, q in QUESTIONS.items()}
    assert httpx.get(f"{gemma_server.base}/v1/models").json()["models"][0]["name"] == gemma_path.name


def test_a_model_swapped_behind_the_same_url_is_caught_at_its_first_answer(
        gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    port = free_port()
    tier = tier_at(f"http://127.0.0.1:{port}/v1/systemone", model=MOCK_MODEL)  # the mock needs a model
    try:
        with upstream(teacher_server(gemma_path, port)):
            ask(tier)
        tiny = tiny_llama_path(tmp_path_factory.mktemp("tiny"))
        with upstream(teacher_server(tiny, port)), pytest.raises(TeacherChangedError) as swapped:
            ask(tier)
        with upstream(jevcompat_mock(port=port)), pytest.raises(TeacherChangedError, match="model_hash"):
            ask(tier, "another state")
    finally:
        tier.close()
    message = str(swapped.value)
    assert f"model '{gemma_path.name}' is now '{tiny.name}'" in message
    assert f"model_hash '{file_sha256(gemma_path)}' is now '{file_sha256(tiny)}'" in message
    assert swapped.value.status == 502


def test_the_teacher_queue_refuses_by_expected_wait_with_retry_after(gemma_path: Path) -> None:
    """Ten requests at once against a queue that admits at most 0.5 s of expected wait (a
    request takes longer than that on one thread): each is answered or refused with 503 and
    Retry-After; none is lost."""
    long_state = STATE + " The dashboard shows error 5021 on every payout." * 20
    body = {"state": long_state, "questions": {q: v.model_dump(mode="json", exclude_none=True)
                                               for q, v in QUESTIONS.items()}}
    with upstream(teacher_server(gemma_path, None, "--max-wait", "0.5")) as server, \
            ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda _: httpx.post(server.url, json=body, timeout=120), range(10)))
        client = UpstreamClient(UpstreamSettings(server.url, retries=0))
        with ThreadPoolExecutor(4) as callers:
            outcomes = list(callers.map(lambda _: _call(client, body), range(4)))
        client.close()
    codes = sorted(r.status_code for r in replies)
    assert codes[0] == 200 and codes[-1] == 503 and set(codes) == {200, 503}
    refused = [r for r in replies if r.status_code == 503]
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert {r.json()["error"]["code"] for r in refused} == {"queue_full"}
    assert set(outcomes) <= {"answered", "503 retry"} and "answered" in outcomes


def _call(client: UpstreamClient, body: dict[str, Any]) -> str:
    try:
        client.post(body)
    except UpstreamFailed as exc:
        return f"{exc.status} retry" if exc.retry_after else f"{exc.status}"
    return "answered"


# --- a bundle escalating to the URL ---


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("upstream") / "support", gemma_path)


def test_a_bundle_certified_against_gemma_escalates_to_its_server_certified(
        bundle_dir: Path, gemma_server: Any) -> None:
    with Cascade.load(bundle_dir, teacher=gemma_server.url, threads=1) as cascade:
        response = cascade.decide(STATE)
    routing = {qid: answer.routing for qid, answer in response.answers.items()}
    assert routing[ESCALATED] is not None and routing[ESCALATED].tier == "teacher"
    assert routing[ESCALATED].certified and routing[KEPT] is not None and routing[KEPT].tier == "encoder"
    assert response.usage.ran_on["teacher"] == f"upstream {gemma_server.url}"


def test_a_bundle_of_external_labels_refuses_a_url_unless_another_teacher_is_accepted(
        bundle_dir: Path, gemma_server: Any, tmp_path: Path) -> None:
    bundle = Bundle.load(bundle_dir)
    data = bundle.manifest.model_dump(mode="json")
    data["teacher"] = {"kind": "external", "model": "someone's labels"}
    external = tmp_path / "external"
    Bundle(type(bundle.manifest).model_validate(data), bundle.directory).save(external)
    with pytest.raises(RouterError, match=r"certified against external labels .* state no identity"):
        Cascade.load(external, teacher=gemma_server.url)
    with Cascade.load(external, teacher=gemma_server.url, accept_other_teacher=True, threads=1) as cascade:
        answer = cascade.decide(STATE).answers[ESCALATED]
    assert answer.routing is not None and not answer.routing.certified


def test_a_server_in_front_of_a_dead_url_answers_502_with_retry_after(
        bundle_dir: Path, gemma_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/systemone"
    # a deadline past any read on shared cores: the alive call must answer, and a closed port on
    # loopback refuses at once whatever the deadline
    load = lambda: Cascade.load(bundle_dir, teacher=UpstreamSettings(url, deadline=120.0), threads=1)  # noqa: E731
    body = {"state": STATE, "questions": {ESCALATED: Bundle.load(bundle_dir).manifest.questions[ESCALATED]}}
    with running(load) as base:
        with upstream(teacher_server(gemma_path, port)):
            alive = httpx.post(f"{base}/v1/systemone", json=body, timeout=60)
        dead = httpx.post(f"{base}/v1/systemone", json=body, timeout=60)
    assert alive.status_code == 200 and alive.json()["answers"][ESCALATED]["x_routing"]["tier"] == "teacher"
    assert (dead.status_code, dead.headers["retry-after"]) == (502, "1")
    assert dead.json()["error"]["code"] == "upstream_unreachable"


def test_cascade_decide_takes_the_url_as_its_teacher(
        bundle_dir: Path, gemma_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distill.cli import main

    field = Bundle.load(bundle_dir).manifest.training.text_field
    corpus, out = tmp_path / "c.jsonl", tmp_path / "out.jsonl"
    corpus.write_text(json.dumps({"id": "one", field: STATE}) + "\n", encoding="utf-8")
    monkeypatch.setenv("CASCADE_UPSTREAM_KEY", "not-checked-by-this-server")
    assert main(["decide", "--bundle", str(bundle_dir), "--corpus", str(corpus), "--out", str(out),
                 "--teacher", gemma_server.url, "--threads", "1"]) == 0
    row = json.loads(out.read_text(encoding="utf-8"))
    escalated = row["answers"][ESCALATED]["x_routing"]
    assert escalated["tier"] == "teacher" and escalated["certified"] and escalated["upstream"]
    assert row["usage"]["x_cascade"]["ran_on"]["teacher"] == f"upstream {gemma_server.url}"
