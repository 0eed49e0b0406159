"""``cascade serve`` over real HTTP: the server on a loopback port, called with httpx and with the
published System One SDKs' own code (avrik-sdk, jev-style, typesafe-sdk), gemma-3-270m live as
the teacher. Routes are fixed by the bundle (``servers``): "urgent" stays at the encoder,
"department" goes to the teacher.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import zstandard
from corpora import QUESTIONS_JSON, corpus_items
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from servers import ESCALATED, KEPT, free_port, running, serving_bundle

from cascade.answers import DecisionResponse
from cascade.bundle.manifest import Bundle
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig
from cascade.serve.engine_settings import EngineSettings

STATE = corpus_items()[5].text  # like the training messages, so that the encoder's gate lets it in
SCORE = {"type": "score", "instructions": "How severe is the problem?",
         "criteria": ["Minor", {"label": "Degraded", "description": "works, slowly"}, "Blocking"]}
KEY = "test-key-123"


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("serve") / "support", gemma_path)


def loader(bundle_dir: Path, gemma_path: Path) -> Any:
    return lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2)


PATIENT = ServeConfig(engine=EngineSettings(max_wait=600.0), docs=True)
"""A queue that admits every request these tests send, however slow the shared cores are, and the
OpenAPI schema served (off by default), which the fuzzing test reads."""


@pytest.fixture(scope="module")
def url(bundle_dir: Path, gemma_path: Path) -> Iterator[str]:
    with running(loader(bundle_dir, gemma_path), PATIENT) as base:
        yield base


@pytest.fixture(scope="module")
def keyed(bundle_dir: Path, gemma_path: Path) -> Iterator[str]:
    with running(loader(bundle_dir, gemma_path), ServeConfig(api_key=KEY, max_body=4096)) as base:
        yield base


def post(url: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/systemone", json=body, timeout=60, **kwargs)


def questions(*ids: str) -> dict[str, Any]:
    return {qid: QUESTIONS_JSON[qid] for qid in ids}


# --- the SDKs' own code ---


def test_avrik_sdk_gets_noul_choice_and_score(url: str) -> None:
    from avrik_sdk import Client, choice, noul, score

    department = QUESTIONS_JSON[ESCALATED]["criteria"]
    with Client(url) as client:
        asked = {KEPT: noul(QUESTIONS_JSON[KEPT]["instructions"]),
                 ESCALATED: choice(QUESTIONS_JSON[ESCALATED]["instructions"], department),
                 "severity": score(SCORE["instructions"], ["Minor", "Degraded", "Blocking"])}
        decision = client.decide(STATE, asked)
        assert 0 <= decision[KEPT].noul <= 1
        assert decision[ESCALATED].choice in department
        assert decision["severity"].legend == {"0": "Minor", "1": "Degraded", "2": "Blocking"}
        assert decision.usage.output_tokens == 0 and decision.usage.input_tokens > 0
        assert decision.audit.model_hash and len(decision.audit.input_tokens) == 3
        assert [m.name for m in client.models()] == ["support"]
        assert client.health().status == "ok"


def test_jev_style_gets_noul_choice_and_score(url: str) -> None:
    from jev_style import JevStyle, choice, noul, score

    with JevStyle(base_url=url) as jev:
        out = jev.decide(STATE, {"u": noul(QUESTIONS_JSON[KEPT]["instructions"]),
                                 "d": choice(QUESTIONS_JSON[ESCALATED]["instructions"],
                                             QUESTIONS_JSON[ESCALATED]["criteria"]),
                                 "s": score(SCORE["instructions"], SCORE["criteria"])})
    answers = out["answers"]
    assert answers["u"]["x_routing"]["tier"] == "encoder"  # the bundle's question, under another id
    assert answers["d"]["x_routing"]["tier"] == "teacher"
    assert answers["s"]["legend"] == {"0": "Minor", "1": "Degraded", "2": "Blocking"}
    assert sum(answers["s"]["probabilities"].values()) == pytest.approx(1.0)


def test_typesafe_sdk_sends_zstd_and_a_key(keyed: str) -> None:
    from typesafe_sdk import Choice, Noul, RetryPolicy, Score, TypeSafeClient

    # compression="zstd" raises unless the SDK can send zstd (its zstd extra): bodies over 1 KiB go so
    with TypeSafeClient(api_key=KEY, base_url=keyed, retry=RetryPolicy(max_retries=0),
                        compression="zstd") as client:
        long_state = STATE + " " + "We have tried every fix in the runbook. " * 40  # > 1 KiB: zstd
        reply = client.system_one(long_state, {
            "u": Noul(instructions=QUESTIONS_JSON[KEPT]["instructions"]),
            "d": Choice(instructions=QUESTIONS_JSON[ESCALATED]["instructions"],
                        criteria=QUESTIONS_JSON[ESCALATED]["criteria"]),
            "s": Score(instructions=SCORE["instructions"], criteria=["Minor", "Degraded", "Blocking"])})
        assert 0 <= reply.nouls["u"].noul <= 1
        assert reply.choices["d"].choice in QUESTIONS_JSON[ESCALATED]["criteria"]
        assert set(reply.scores["s"].legend) == {0, 1, 2}
        assert reply.request_id.startswith("req_")
        assert [m.name for m in client.models.list().models] == ["support"]


# --- the wire shape and its errors ---


def test_the_response_is_the_wire_shape_with_routing_under_x_keys(url: str) -> None:
    reply = post(url, {"state": STATE, "questions": questions(KEPT, ESCALATED), "model": "anything"})
    assert reply.status_code == 200
    body = reply.json()
    assert set(body) == {"model", "answers", "usage", "audit"}
    assert set(body["answers"][KEPT]) >= {"type", "noul", "x_routing"}
    assert "probabilities" not in body["answers"][KEPT]
    assert body["answers"][KEPT]["x_routing"]["tier"] == "encoder"
    assert body["answers"][ESCALATED]["x_routing"]["tier"] == "teacher"
    assert isinstance(body["usage"]["input_tokens"], int) and body["usage"]["output_tokens"] == 0
    assert set(body["usage"]["x_cascade"]["tiers"]) == {"encoder", "teacher"}
    audit = body["audit"]
    assert audit["calibration_version"].startswith("2026-12-01T00:00:00Z+")
    assert audit["backend"] == "onnxruntime+llama.cpp" and audit["precision"] == "int8+Q4_K_M"
    assert len(audit["prompt_template_sha256"]) == len(audit["input_tokens"]) == 2
    assert DecisionResponse.model_validate(body).answers[ESCALATED].routing.certified


def test_a_question_the_bundle_does_not_hold_is_answered_by_the_teacher_alone(url: str) -> None:
    edited = {**QUESTIONS_JSON[KEPT], "instructions": "Is the sender angry?"}
    body = post(url, {"state": STATE, "questions": {KEPT: edited, "s": SCORE}}).json()
    for qid in (KEPT, "s"):
        routing = body["answers"][qid]["x_routing"]
        assert (routing["tier"], routing["covered"], routing["certified"]) == ("teacher", False, False)
        assert routing["uncovered_why"] is None
    # the bundle's question with its options named but not described (as an SDK helper builds it
    # from a list of keys): not the question the thresholds certify, and the answer says why
    bare = {**QUESTIONS_JSON[ESCALATED], "criteria": dict.fromkeys(QUESTIONS_JSON[ESCALATED]["criteria"])}
    routing = post(url, {"state": STATE, "questions": {"d": bare}}).json()["answers"]["d"]["x_routing"]
    assert (routing["tier"], routing["covered"]) == ("teacher", False)
    assert routing["uncovered_why"].startswith(f"the bundle's question {ESCALATED!r} has these instructions "
                                               "but other option descriptions (criteria)")


def test_request_ids_are_echoed_and_made(url: str) -> None:
    given = post(url, {"state": STATE, "questions": questions(KEPT)}, headers={"X-Request-Id": "abc-1"})
    assert given.headers["x-request-id"] == given.headers["x-typesafe-request-id"] == "abc-1"
    made = httpx.get(f"{url}/v1/models")
    assert made.headers["x-request-id"].startswith("req_")
    assert made.json() == {"models": [{"name": "support", "description": made.json()["models"][0][
        "description"], "release_date": made.json()["models"][0]["release_date"]}]}


def error(reply: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["error"]["code"] == code and body["error"]["message"]
    if status == 422:  # TypeSafe's shapes: one line per problem, else the type and message
        assert body["detail"] and body["detail"][0]["loc"][0] == "body"
    else:
        assert body["detail"] == {"error_type": body["error"]["type"], "message": body["error"]["message"]}
    assert reply.headers["x-request-id"]
    return body


def test_a_bad_request_is_a_422_that_names_the_field(url: str) -> None:
    bad = {"state": STATE,
           "questions": {"q": {"type": "choice", "instructions": "Which?", "criteria": ["a"]}}}
    body = error(post(url, bad), 422, "invalid_request")
    assert body["error"]["field"] == "questions.q.criteria" and body["error"]["question"] == "q"
    assert body["detail"][0]["loc"] == ["body", "questions", "q", "criteria"]
    error(httpx.post(f"{url}/v1/systemone", content=b"{not json", timeout=30), 422, "invalid_request")
    error(post(url, {"state": STATE, "questions": questions(KEPT), "x_budget": {"ms_per_call": -1}}),
          422, "invalid_request")


def test_compressed_bodies_are_read_and_limited_after_inflating(keyed: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = json.dumps({"state": STATE, "questions": questions(KEPT)}).encode()
    for encoding, packed in (("gzip", gzip.compress(body)), ("zstd", zstandard.compress(body))):
        reply = httpx.post(f"{keyed}/v1/systemone", content=packed, timeout=60,
                           headers={**headers, "Content-Encoding": encoding})
        assert reply.status_code == 200, reply.text
    bomb = gzip.compress(json.dumps({"state": "x" * 100_000, "questions": {}}).encode())
    assert len(bomb) < 4096  # under the limit as sent, over it once inflated
    error(httpx.post(f"{keyed}/v1/systemone", content=bomb, timeout=30,
                     headers={**headers, "Content-Encoding": "gzip"}), 413, "request_too_large")
    error(httpx.post(f"{keyed}/v1/systemone", content=b"x" * 5000, timeout=30, headers=headers),
          413, "request_too_large")
    error(httpx.post(f"{keyed}/v1/systemone", content=body, timeout=30,
                     headers={**headers, "Content-Encoding": "br"}), 415, "unsupported_encoding")


def test_a_key_is_checked_only_when_one_is_configured(url: str, keyed: str) -> None:
    body = {"state": STATE, "questions": questions(KEPT)}
    assert post(url, body, headers={"Authorization": "Bearer whatever"}).status_code == 200
    error(post(keyed, body), 401, "unauthorized")
    error(post(keyed, body, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
    assert httpx.get(f"{keyed}/health").json() == {"status": "ok"}


def test_health_says_503_while_the_models_load(bundle_dir: Path, gemma_path: Path) -> None:
    release = threading.Event()

    def slow() -> Cascade:
        release.wait(60)
        return loader(bundle_dir, gemma_path)()

    with running(slow, wait=False) as base:
        for path in ("/health", "/healthz"):
            reply = httpx.get(f"{base}{path}")
            assert (reply.status_code, reply.json()) == (503, {"status": "loading"})
            assert reply.headers["retry-after"]
        error(post(base, {"state": STATE, "questions": questions(KEPT)}), 503, "loading")
        release.set()


# --- concurrency ---


def route_alone_and_together(url: str, bodies: list[dict[str, Any]]) -> tuple[list, list]:
    alone = [post(url, body).json() for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: post(url, body).json(), bodies))
    return alone, together


def test_the_same_request_gets_the_same_answer_alone_and_in_a_concurrent_batch(url: str) -> None:
    """Tolerance 0: the encoder gives each text the same vector in any batch, and llama.cpp
    reads each state on its own."""
    states = [item.text for item in corpus_items()[10:18]]
    bodies = [{"state": s, "questions": questions(KEPT, ESCALATED)} for s in states]
    alone, together = route_alone_and_together(url, bodies)
    assert [one["answers"] for one in alone] == [many["answers"] for many in together]


def test_two_ids_for_one_bundle_question_and_a_budget_header(url: str) -> None:
    asked = {"a": QUESTIONS_JSON[ESCALATED], "b": QUESTIONS_JSON[ESCALATED], KEPT: QUESTIONS_JSON[KEPT]}
    body = post(url, {"state": STATE, "questions": asked}).json()
    assert list(body["answers"]) == ["a", "b", KEPT]
    assert body["answers"]["a"] == body["answers"]["b"]
    held = post(url, {"state": STATE, "questions": questions(ESCALATED)},
                headers={"X-Cascade-Max-Escalation": "0"}).json()["answers"][ESCALATED]["x_routing"]
    assert (held["tier"], held["budget_limited"]) == ("encoder", True)
    error(post(url, {"state": STATE, "questions": questions(KEPT)},
               headers={"X-Cascade-Budget-Ms": "lots"}), 422, "invalid_request")


def test_with_recorded_labels_on_top_an_unknown_question_is_a_422(bundle_dir: Path) -> None:
    def replay() -> Cascade:
        return Cascade.load(bundle_dir, labels={KEPT: {}, ESCALATED: {}}, threads=1)

    with running(replay) as base:
        body = error(post(base, {"state": STATE, "questions": {"s": SCORE}}), 422, "unknown_question")
        assert body["error"]["question"] == "s" and "--teacher" in body["error"]["message"]


def test_metrics_count_requests_answers_and_queues(url: str) -> None:
    post(url, {"state": STATE, "questions": questions(KEPT, ESCALATED)})
    text = httpx.get(f"{url}/metrics").text
    for line in ('cascade_requests_total{code="200"}',
                 'cascade_answers_total{question="urgent",tier="encoder"}',
                 'cascade_answers_total{question="department",tier="teacher"}',
                 'cascade_queue_depth{tier="teacher"}',
                 'cascade_tier_seconds_bucket{le="0.001",tier="encoder"}',
                 "cascade_escalation_share ", "cascade_request_seconds_count "):
        assert line in text, line


def escalating(n: int) -> list[dict[str, Any]]:
    return [{"state": f"{STATE} Case {k}: " + "the export stalls at row 40,000. " * 12,
             "questions": questions(ESCALATED)} for k in range(n)]


def test_an_encoder_answer_never_waits_behind_the_teachers_queue(url: str) -> None:
    with ThreadPoolExecutor(6) as pool:
        hard = [pool.submit(post, url, body) for body in escalating(6)]
        while 'cascade_queue_depth{tier="teacher"} 0.0' in httpx.get(f"{url}/metrics").text:
            assert not all(f.done() for f in hard), "the teacher's queue never filled"
        easy = post(url, {"state": STATE, "questions": questions(KEPT)})
        assert easy.status_code == 200
        assert not all(f.done() for f in hard)  # answered while escalations still waited
        assert [f.result().status_code for f in hard] == [200] * 6


def test_a_refusal_no_budget_could_avoid_does_not_advise_one(bundle_dir: Path, gemma_path: Path) -> None:
    """A question the bundle does not hold goes to the teacher whatever the budget: the refusal
    advised a budget (x_budget) or --overload keep all the same."""
    config = ServeConfig(engine=EngineSettings(max_wait=0.5))
    foreign = {"type": "noul", "instructions": "Does this message mention a refund of exactly 41 euros?"}
    bodies = [{**body, "questions": {"refund41": foreign}} for body in escalating(10)]
    with running(loader(bundle_dir, gemma_path), config) as base, ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda body: post(base, body), bodies))
    refused = [r for r in replies if r.status_code == 503]
    assert refused and all("no budget keeps this request below the teacher" in r.json()["error"]["message"]
                           and "--overload keep" not in r.json()["error"]["message"] for r in refused)


@pytest.mark.parametrize("overload", ["refuse", "keep"])
def test_a_full_teacher_queue_refuses_with_retry_after_or_keeps_the_answer_below(
    bundle_dir: Path, gemma_path: Path, overload: str
) -> None:
    # the first read is guessed at 1 s, so a second request waiting is past 0.5 s: refused or kept
    config = ServeConfig(engine=EngineSettings(max_wait=0.5, overload=overload))  # type: ignore[arg-type]
    with running(loader(bundle_dir, gemma_path), config) as base, ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda body: post(base, body), escalating(10)))
    codes = [r.status_code for r in replies]
    assert len(codes) == 10 and set(codes) <= {200, 503}  # none lost
    if overload == "refuse":
        refused = [r for r in replies if r.status_code == 503]
        assert refused and all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert {error(r, 503, "queue_full")["error"]["code"] for r in refused} == {"queue_full"}
        # the encoder answered each: a budget, or --overload keep, would keep it below
        assert all("--overload keep" in r.json()["error"]["message"] for r in refused)
    else:
        assert codes == [200] * 10
        routes = [r.json()["answers"][ESCALATED]["x_routing"] for r in replies]
        kept = [x for x in routes if x["overloaded"]]
        assert kept and all((x["tier"], x["budget_limited"], x["certified"]) == ("encoder", True, False)
                            for x in kept)


# --- the command: SIGTERM; the schema: fuzzing ---


def test_sigterm_finishes_the_request_in_flight_and_exits_0(bundle_dir: Path, gemma_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "distill.cli", "serve", "--bundle", str(bundle_dir), "--teacher",
               str(gemma_path), "--port", str(port), "--threads", "2"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        with ThreadPoolExecutor(1) as pool:
            flight = pool.submit(post, base, escalating(1)[0] | {"state": STATE + " x" * 1500})
            while 'cascade_queue_depth{tier="teacher"}' not in httpx.get(f"{base}/metrics").text:
                time.sleep(0.01)
            time.sleep(0.2)  # the request is read and routed: now it waits for the teacher
            server.send_signal(signal.SIGTERM)
            reply = flight.result()
        code = server.wait(timeout=60)
    finally:
        server.kill()
        stderr = server.stderr.read() if server.stderr else ""
    assert (reply.status_code, code) == (200, 0), f"{reply.text[:500]}\n{stderr[-3000:]}"
    assert '"status": 200' in stderr  # the request's log line


def test_fuzzing_the_servers_own_schema_finds_no_server_error(url: str) -> None:
    """Bounded (40 seeded examples per operation): every generated request, valid or not, gets
    an answer or a 4xx, never a 5xx."""
    before = answered(url)
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/systemone", "/v1/models"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            case.call_and_validate(checks=[not_a_server_error])

        call()
    assert answered(url) - before >= 40  # the decisions route was called, not skipped


def answered(url: str) -> float:
    """Requests /v1/systemone answered so far, any status, from /metrics."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("cascade_requests_total{"))


BLOCK_SERVE_EXTRA = """\
import importlib.abc, sys
class NoServeExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "prometheus_client", "zstandard"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, NoServeExtra())
"""


def test_without_the_serve_extra_routing_works_and_serve_says_how_to_install_it(
    bundle_dir: Path, tmp_path: Path
) -> None:
    route = BLOCK_SERVE_EXTRA + (
        "from cascade.routing.router import Cascade\n"
        f"with Cascade.load({str(bundle_dir)!r}, labels={{'urgent': {{}}, 'department': {{}}}}) as c:\n"
        f"    print(c.decide({STATE!r}, questions=['urgent']).answers['urgent'].routing.tier)\n")
    done = subprocess.run([sys.executable, "-c", route], capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip()) == (0, "encoder"), done.stderr
    argv = ["serve", "--bundle", str(bundle_dir)]
    serve = BLOCK_SERVE_EXTRA + f"from distill.cli import main\nsys.exit(main({argv!r}))"
    done = subprocess.run([sys.executable, "-c", serve], capture_output=True, text=True)
    assert done.returncode == 2 and "pip install -e '.[serve]'" in done.stderr, done.stderr


def test_a_state_longer_than_the_teachers_context_never_fails_the_request(
    bundle_dir: Path, gemma_path: Path
) -> None:
    """The encoder answers what it may keep; an escalated bundle question keeps the encoder's
    answer, marked not certified; a question only the teacher could answer gets its own error in
    x_errors, counted in /metrics. A client (jev-style's own code) gets a 200."""
    from jev_style import JevStyle, choice, noul, score

    from cascade.readout.placement import Placement

    short_context = {"teacher": Placement(n_ctx=256, threads=2)}
    load = lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2, placement=short_context)  # noqa: E731
    with running(load) as base, JevStyle(base_url=base) as jev:
        out = jev.decide(" ".join([STATE] * 12), {
            "u": noul(QUESTIONS_JSON[KEPT]["instructions"]),
            "d": choice(QUESTIONS_JSON[ESCALATED]["instructions"], QUESTIONS_JSON[ESCALATED]["criteria"]),
            "s": score(SCORE["instructions"], SCORE["criteria"])})
        metrics = httpx.get(f"{base}/metrics").text
    answers = out["answers"]
    assert answers["u"]["x_routing"]["tier"] == "encoder" and answers["u"]["x_routing"]["certified"]
    kept = answers["d"]["x_routing"]
    assert (kept["tier"], kept["certified"], kept["too_long_for"]) == ("encoder", False, ["teacher"])
    assert "s" not in answers and out["x_errors"]["s"]["code"] == "input_too_long"
    assert "the context holds 256" in out["x_errors"]["s"]["message"]
    assert 'cascade_question_errors_total{code="input_too_long",question="(not in bundle)"} 1.0' in metrics
    assert 'cascade_uncertified_answers_total{reason="too_long"} 1.0' in metrics


def test_serve_refuses_another_teacher_before_it_opens_its_port(bundle_dir: Path, tmp_path: Path) -> None:
    """What can be refused without loading a model is refused first: nothing ever listens."""
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF not the teacher the bundle was certified against")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "distill.cli", "serve", "--bundle", str(bundle_dir),
                               "--teacher", str(other), "--port", str(port)],
                              stderr=subprocess.PIPE, text=True)
    listened = False
    while server.poll() is None:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
            listened = True
        except httpx.TransportError:
            time.sleep(0.05)
    stderr = server.stderr.read() if server.stderr else ""
    assert (server.returncode, listened) == (2, False), stderr
    assert "RouterError: bundle 'support' cannot escalate to" in stderr and "Traceback" not in stderr
