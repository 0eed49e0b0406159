"""``cascade serve`` with a bundle in front of an upstream URL, over real HTTP on loopback.

The upstreams are real servers started here: the project's own teacher server (gemma-3-270m, the
bundle's certified teacher; a tiny llama to swap in behind the same URL) and jevcompat 0.1.1's
reference mock (in-process where its requests are counted, in a process where it is paused or
killed). The bundle's routes are fixed (``servers``): "urgent" stays at the encoder, "department"
goes upstream. Every request ends answered or refused with a status (and Retry-After where
waiting helps); none is lost, none hangs: every wait below is bounded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpora import QUESTIONS_JSON, corpus_items
from servers import (
    ESCALATED,
    KEPT,
    MOCK_MODEL,
    free_port,
    jevcompat_mock,
    mock_at,
    running,
    serving_bundle,
    teacher_server,
    until,
    upstream,
)
from tinymodels import tiny_llama_path

from cascade.bundle.manifest import Bundle
from cascade.collect.collector import Collector
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig
from cascade.serve.engine_settings import EngineSettings
from cascade.teachers.settings import UpstreamSettings
from distill.loop.auditing import bundle_teacher
from distill.loop.escalations import StoreEscalations
from distill.store import LabelStore

STATE = corpus_items()[5].text  # like the training messages, so that the encoder's gate lets it in
FOREIGN = {"type": "score", "instructions": "How severe is the problem?", "criteria": ["Minor", "Blocking"]}


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("upstream-serve") / "support", gemma_path)


def loader(bundle_dir: Path, url: str, accept: bool = False, **settings: Any) -> Callable[[], Cascade]:
    return lambda: Cascade.load(bundle_dir, teacher=UpstreamSettings(url, **settings), threads=1,
                                accept_other_teacher=accept)


def post(base: str, *qids: str, state: str = STATE, foreign: bool = False, timeout: float = 60,
         **kwargs: Any) -> httpx.Response:
    questions: dict[str, Any] = {qid: QUESTIONS_JSON[qid] for qid in qids}
    if foreign:
        questions["severity"] = FOREIGN
    return httpx.post(f"{base}/v1/systemone", json={"state": state, "questions": questions},
                      timeout=timeout, **kwargs)


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)), 0.0)


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path) -> Iterator[Any]:
    with upstream(teacher_server(gemma_path)) as server:
        yield server


# --- only what is unsure goes upstream, in one request ---


def test_the_unsure_and_the_unknown_questions_go_upstream_in_one_request_and_say_so(
        bundle_dir: Path, gemma_server: Any) -> None:
    with running(loader(bundle_dir, gemma_server.url)) as base:
        reply = post(base, KEPT, ESCALATED, foreign=True)
        local = post(base, KEPT)
        calls, sent = metric(base, 'cascade_upstream_total{count="calls"}'), \
            metric(base, 'cascade_upstream_total{count="sent_questions"}')
        saved = metric(base, 'cascade_upstream_total{count="saved_questions"}')
    assert reply.status_code == 200 and local.status_code == 200
    routes = {qid: a["x_routing"] for qid, a in reply.json()["answers"].items()}
    assert (routes[KEPT]["tier"], routes[KEPT]["upstream"], routes[KEPT]["certified"]) == \
        ("encoder", False, True)
    assert (routes[ESCALATED]["tier"], routes[ESCALATED]["upstream"], routes[ESCALATED]["certified"]) == \
        ("teacher", True, True)
    assert (routes["severity"]["upstream"], routes["severity"]["covered"]) == (True, False)
    assert local.json()["answers"][KEPT]["x_routing"]["upstream"] is False
    # two requests, four questions: one call upstream, of the two questions the bundle could not keep
    assert (calls, sent, saved) == (1, 2, 2)


def test_an_upstream_counted_by_its_own_server_gets_one_request_per_escalated_request(
        bundle_dir: Path) -> None:
    with mock_at() as (url, cfg), running(loader(bundle_dir, url, accept=True, model=MOCK_MODEL)) as base:
        replies = [post(base, KEPT, ESCALATED, foreign=True), post(base, KEPT), post(base, ESCALATED)]
        seen = cfg.requests
    assert [r.status_code for r in replies] == [200] * 3
    assert seen == 2  # the request the encoder answered whole never reached the mock
    answers = replies[0].json()["answers"]
    assert answers[ESCALATED]["x_routing"]["certified"] is False  # another teacher, accepted


# --- the teacher swapped behind the URL ---


def test_a_model_swapped_behind_the_url_voids_the_certificate_and_demotes_every_question(
        bundle_dir: Path, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/systemone"
    tiny = tiny_llama_path(tmp_path_factory.mktemp("tiny"))
    store = tmp_path_factory.mktemp("kept") / "labels.sqlite"
    sink = StoreEscalations(store, bundle_teacher(Bundle.load(bundle_dir).manifest))
    kept = Collector(sink, what="escalations")  # the certified teacher's escalations only
    try:
        with running(loader(bundle_dir, url), ServeConfig(escalations=kept)) as base:
            with upstream(teacher_server(gemma_path, port)):
                before = post(base, KEPT, ESCALATED)
            with upstream(teacher_server(tiny, port)), caplog.at_level(logging.ERROR, "cascade.serve"):
                after = post(base, KEPT, ESCALATED)
                later = post(base, KEPT)
            void = metric(base, "cascade_certificate_void")
            marked = metric(base, 'cascade_uncertified_answers_total{reason="teacher_changed"}')
    finally:
        sink.close()
    assert [r.status_code for r in (before, after, later)] == [200] * 3
    with LabelStore.open_existing(store) as opened:
        escalated = [record for _, record in opened.escalations_after(0)]
    assert len(escalated) == 1 and kept.counts["collected"] == 1  # none from the tiny llama
    answered = before.json()["answers"][ESCALATED]["probabilities"]
    assert escalated[0].teacher[ESCALATED] == pytest.approx(answered, abs=1e-9)
    assert before.json()["answers"][ESCALATED]["x_routing"]["certified"] is True
    for reply in (after, later):
        for answer in reply.json()["answers"].values():
            routing = answer["x_routing"]
            assert (routing["tier"], routing["upstream"], routing["demoted"], routing["certified"]) == \
                ("teacher", True, True, False)
            assert f"model '{gemma_path.name}' is now '{tiny.name}'" in routing["demoted_why"]
    assert void == 1 and marked == 3
    alarms = [r.getMessage() for r in caplog.records if "ALARM certificate void" in r.getMessage()]
    assert len(alarms) == 1


# --- failures a client can act on ---


def test_upstream_failures_are_answered_with_a_status_a_client_can_act_on(bundle_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/systemone"
    fast: dict[str, Any] = {"accept": True, "model": MOCK_MODEL, "read_timeout": 1.0, "deadline": 2.0}
    with running(loader(bundle_dir, url, **fast)) as base:
        with upstream(jevcompat_mock(port=port)) as server:
            ok = post(base, ESCALATED)
            server.pause()
            slow = post(base, ESCALATED)
            server.kill()
        dead = post(base, ESCALATED)
        with upstream(jevcompat_mock(port=port, busy_every=1)):
            busy = post(base, ESCALATED)
        local = post(base, KEPT)  # the encoder's answers never need the upstream
    assert ok.status_code == 200 and local.status_code == 200
    assert (slow.status_code, slow.headers["retry-after"], slow.json()["error"]["code"]) == \
        (504, "1", "upstream_timeout")
    assert (dead.status_code, dead.headers["retry-after"], dead.json()["error"]["code"]) == \
        (502, "1", "upstream_unreachable")
    assert (busy.status_code, busy.headers["retry-after"], busy.json()["error"]["code"]) == \
        (429, "0", "upstream_rate_limited")


def test_another_4xx_from_the_upstream_is_passed_back_unchanged(bundle_dir: Path) -> None:
    with mock_at() as (url, _), running(loader(bundle_dir, url, accept=True, model="no-such-model")) as base:
        reply = post(base, ESCALATED)
        direct = httpx.post(url, json={"state": STATE, "model": "no-such-model",
                                       "questions": {ESCALATED: QUESTIONS_JSON[ESCALATED]}}, timeout=30)
    assert (reply.status_code, reply.content) == (400, direct.content)


def test_the_upstream_queue_admits_by_expected_wait_and_every_refusal_says_when_to_retry(
        bundle_dir: Path, gemma_server: Any) -> None:
    """Twelve escalations at once through one call in flight, admitting 0.5 s of expected wait (a
    call guessed at 1 s until one is measured): some answered, the rest 503 with Retry-After."""
    config = ServeConfig(engine=EngineSettings(max_wait=0.5))
    with running(loader(bundle_dir, gemma_server.url, max_in_flight=1), config) as base, \
            ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda k: post(base, ESCALATED, state=f"{STATE} Case {k}."), range(12)))
    codes = [r.status_code for r in replies]
    assert len(codes) == 12 and set(codes) == {200, 503}
    refused = [r for r in replies if r.status_code == 503]
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert {r.json()["error"]["code"] for r in refused} == {"queue_full"}


def test_a_request_whose_client_has_gone_is_never_sent_upstream(bundle_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/systemone"
    config = ServeConfig(engine=EngineSettings(max_wait=600.0))
    patient: dict[str, Any] = {"accept": True, "model": MOCK_MODEL, "read_timeout": 120.0, "deadline": 120.0,
               "max_in_flight": 1}
    with upstream(jevcompat_mock(port=port)) as server, \
            running(loader(bundle_dir, url, **patient), config) as base, ThreadPoolExecutor(1) as pool:
        server.pause()
        first = pool.submit(post, base, ESCALATED, timeout=120)
        until(lambda: metric(base, "cascade_top_admitted") == 1, "the first request in flight upstream")
        with pytest.raises(httpx.ReadTimeout):
            post(base, ESCALATED, state=f"{STATE} Another case.", timeout=1.0)
        until(lambda: metric(base, 'cascade_requests_total{code="499"}') == 1, "the server saw the client go")
        server.resume()
        assert first.result().status_code == 200
        until(lambda: metric(base, "cascade_abandoned_requests_total") == 1, "the gone request dropped")
        calls = metric(base, 'cascade_upstream_total{count="calls"}')
    assert calls == 1


# --- forwarded auth ---


def test_forwarded_keys_get_local_answers_only_once_the_upstream_accepted_them(bundle_dir: Path) -> None:
    port = free_port()
    config = ServeConfig(engine=EngineSettings(forward_auth=True))
    good, wrong = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer nope"}
    load = loader(bundle_dir, f"http://127.0.0.1:{port}/v1/systemone", accept=True, model=MOCK_MODEL,
                  forward_auth=True)
    with running(load, config) as base:
        with mock_at(port, key="k1") as (_, cfg):
            first = post(base, KEPT, headers=good)  # not vouched for yet: the upstream answers
            asked = cfg.requests
            second = post(base, KEPT, headers=good)  # accepted: the encoder answers
            after = cfg.requests
            refused = post(base, KEPT, headers=wrong)
            anonymous = post(base, KEPT)
        with mock_at(port, key="k2"):  # the upstream no longer takes k1
            revoked = post(base, ESCALATED, headers=good)
            still = post(base, KEPT, headers=good)
    assert first.status_code == 200 and first.json()["answers"][KEPT]["x_routing"]["upstream"] is True
    assert (asked, after) == (1, 1)
    assert second.json()["answers"][KEPT]["x_routing"]["tier"] == "encoder"
    assert refused.status_code == 401 and anonymous.status_code == 403
    assert revoked.status_code == 401 and still.status_code == 401  # revoked at once: no local answer
