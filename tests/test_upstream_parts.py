"""The upstream client's parts that need no server: identity comparison, reading answers as
distributions, admission by expected wait, keys and pauses (on a clock the test moves, so no
assertion depends on time passing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cascade.errors import (
    CascadeError,
    QueueFullError,
    TeacherChangedError,
    UpstreamAnswerError,
    UpstreamFailed,
    WorkTooLargeError,
)
from cascade.questions import parse_request
from cascade.teachers.admission import Admission, work_of
from cascade.teachers.client import UpstreamClient, retry_after
from cascade.teachers.identity import EndpointIdentity, IdentityWatch, identity_of
from cascade.teachers.keys import AcceptedKeys, KeySource, Pauses
from cascade.teachers.settings import UpstreamSettings
from cascade.teachers.wire import distributions, read_response

QUESTIONS = parse_request({"state": "x", "questions": {
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "team": {"type": "choice", "instructions": "Which team?",
             "criteria": {"billing": "money", "tech": "bugs"}},
    "sev": {"type": "score", "instructions": "How severe?", "criteria": ["low", "mid", "high"]}}}).questions
GOOD = {"model": "m1", "answers": {
    "urgent": {"type": "noul", "noul": 0.8},
    "team": {"type": "choice", "choice": "tech", "probabilities": {"billing": 0.25, "tech": 0.75},
             "confidence": 0.75},
    "sev": {"type": "score", "score": 0.9, "legend": {"0": "low", "1": "mid", "2": "high"},
            "probabilities": {"0": 0.3, "1": 0.5, "2": 0.2}, "confidence": 0.5}},
    "audit": {"model_hash": "h1", "calibration_version": "c1", "prompt_template_sha256": ["a", "b", "c"]}}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_answers_become_distributions_in_option_key_order() -> None:
    got = distributions(read_response(GOOD, "u"), QUESTIONS, "u")
    assert {q: v.tolist() for q, v in got.items()} == {
        "urgent": pytest.approx([0.8, 0.2]), "team": pytest.approx([0.25, 0.75]),
        "sev": pytest.approx([0.3, 0.5, 0.2])}


def _broken(change: Any) -> dict[str, Any]:
    data: dict[str, Any] = {**GOOD, "answers": {q: dict(a) for q, a in GOOD["answers"].items()}}
    change(data["answers"])
    return data


@pytest.mark.parametrize(("change", "says"), [
    (lambda a: a.pop("sev"), r"missing \['sev'\]"),
    (lambda a: a.update(extra={"type": "noul", "noul": 0.5}), r"not asked \['extra'\]"),
    (lambda a: a["urgent"].update(noul=1.3), r"answers.urgent: noul 1.3"),
    (lambda a: a["urgent"].update(type="boolean"), r"type 'boolean', for a noul question"),
    (lambda a: a["team"].update(probabilities={"Billing": 0.25, "Tech": 0.75}),
     r"keyed \['Billing', 'Tech'\]"),
    (lambda a: a["team"].update(probabilities={"billing": 0.45, "tech": 0.75}), r"got sum 1.2"),
    (lambda a: a["team"].update(choice="billing"),
     r"choice 'billing' is not its most probable option 'tech'"),
    (lambda a: a["sev"].update(probabilities={"1": 0.3, "2": 0.5, "3": 0.2}), r"keyed \['1', '2', '3'\]"),
    (lambda a: a["sev"].update(score=1.0), r"score 1.0 is not its probabilities' expectation 0.9000"),
    (lambda a: a["sev"]["probabilities"].update({"0": float("nan")}), r"finite and >= 0; got nan"),
])
def test_a_wrong_shape_is_refused_naming_the_question(change: Any, says: str) -> None:
    with pytest.raises(UpstreamAnswerError, match=says):
        distributions(read_response(_broken(change), "http://u"), QUESTIONS, "http://u")


def test_a_body_that_is_not_a_response_is_refused() -> None:
    with pytest.raises(UpstreamAnswerError, match=r"answers: Field required.*/v1/systemone endpoint"):
        read_response({"choices": []}, "http://u")


def test_identity_comes_from_model_and_audit_and_names_what_changed() -> None:
    seen = read_response(GOOD, "u").identity()
    assert seen == EndpointIdentity(model="m1", model_hash="h1", calibration_version="c1",
                                    templates={"urgent": "a", "team": "b", "sev": "c"})
    other = identity_of("m2", {"model_hash": "h1", "prompt_template_sha256": ["a", "x"]}, ["urgent", "team"])
    assert seen.changes(other) == ["model 'm1' is now 'm2'", "calibration_version 'c1' is now None",
                                   "question 'team''s prompt_template_sha256 b... is now x..."]
    assert EndpointIdentity(model_hash="h1").changes(other) == []  # states only the hash
    assert identity_of("m", {"prompt_template_sha256": ["a"]}, ["p", "q"]).templates == {}  # not one each


def test_the_watch_pins_the_first_answer_and_catches_a_swap() -> None:
    watch = IdentityWatch("http://u", EndpointIdentity(model_hash="h1"))
    watch.check(EndpointIdentity(model="m1", model_hash="h1", templates={"a": "t"}))
    watch.check(EndpointIdentity(model="m1", model_hash="h1", templates={"b": "u"}))  # a new question
    assert watch.pinned == EndpointIdentity(model="m1", model_hash="h1", templates={"a": "t", "b": "u"})
    with pytest.raises(TeacherChangedError, match=r"no longer the teacher it answered as before .*"
                                                  r"model 'm1' is now 'm2'"):
        watch.check(EndpointIdentity(model="m2", model_hash="h1"))
    fresh = IdentityWatch("http://u", EndpointIdentity(model_hash="h1"))
    with pytest.raises(TeacherChangedError, match=r"certified against .* model_hash 'h1' is now 'h2'"):
        fresh.check(EndpointIdentity(model="m1", model_hash="h2"))


def test_admission_admits_while_the_expected_wait_fits_and_says_when_to_retry() -> None:
    clock = Clock()
    gate = Admission(max_wait=2.5, first_guess=1.0, clock=clock)
    tickets = [gate.enter() for _ in range(3)]  # waits 0, 1 and 2 s
    with pytest.raises(QueueFullError, match=r"3 request\(s\) ahead \(3 unit\(s\) of work\), an expected "
                       r"wait of 3.0 s") as refused:
        gate.enter()
    assert (refused.value.status, refused.value.headers) == (503, {"Retry-After": "1"})
    started = gate.started(tickets[0])
    clock.now += 2.0  # the first one took 2 s: the measured time replaces the guess
    gate.done(tickets[0], started)
    assert gate.service == 2.0
    with pytest.raises(QueueFullError) as refused:  # 2 ahead x 2 s = 4 s, 1.5 s past 2.5 s
        gate.enter()
    assert refused.value.retry_after == 2
    gate.done(tickets[1], None)  # failed before its service: no time measured
    gate.enter()  # 1 ahead x 2 s fits
    assert (gate.inside, gate.service) == (2, 2.0)


def test_a_request_in_service_longer_than_the_mean_raises_the_estimate() -> None:
    clock = Clock()
    gate = Admission(max_wait=5.0, first_guess=0.1, clock=clock)
    gate.started(gate.enter())
    clock.now += 6.0  # running for 6 s already: nobody behind it waits less
    with pytest.raises(QueueFullError, match=r"expected wait of 6\.0 s"):
        gate.enter()


def test_admission_counts_the_work_waiting_not_the_requests() -> None:
    """One request of ten units ahead is as long a wait as ten of one unit: a request that asks a
    hundred questions about a long state cannot pass as one."""
    clock = Clock()
    gate = Admission(max_wait=5.0, first_guess=1.0, clock=clock)
    big = gate.enter(work_of(10_000))  # 10 units: admitted, a slot is free
    assert big.work == 10.0 and work_of(10) == 1.0  # a short request is one unit
    with pytest.raises(QueueFullError, match=r"1 request\(s\) ahead \(10 unit\(s\) of work\), an expected "
                       r"wait of 10.0 s"):
        gate.enter()
    start = gate.started(big)
    clock.now += 2.0  # ten units took 2 s: 0.2 s a unit
    gate.done(big, start)
    assert gate.service == pytest.approx(0.2)
    small = [gate.enter() for _ in range(3)]  # 0, 1 and 2 units ahead x 0.2 s
    assert len(small) == 3 and gate.inside == 3
    gate.enter(work_of(25_000))  # 3 units ahead x 0.2 s = 0.6 s fits
    # a request whose own 26 units would take 5.2 s in service is refused, however short the queue
    # (3 units, 0.6 s alone, would only be queued: below ALONE_FROM a request is an ordinary one)
    with pytest.raises(WorkTooLargeError, match=r"26 unit\(s\) of work .* about 5.2 s .* past the 5 s") \
            as big:
        gate.enter(work_of(26_000))
    assert (big.value.status, big.value.headers) == (413, {})  # waiting would not help
    # four requests ahead would be 0.8 s by their count; their 28 units are 5.6 s
    with pytest.raises(QueueFullError, match=r"4 request\(s\) ahead \(28 unit\(s\) of work\), an expected "
                       r"wait of 5.6 s"):
        gate.enter()


def test_keys_come_from_a_variable_or_a_file_reread_when_it_changes(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSTREAM_KEY", "from-env")
    source = KeySource(env="UPSTREAM_KEY", file=tmp_path / "key")
    assert source.read() == "from-env"  # no file yet
    (tmp_path / "key").write_text("first\n")
    assert source.read() == "first"
    (tmp_path / "key").write_text("second-key\n")  # rotated: another size, so another stat
    assert source.read() == "second-key"
    monkeypatch.delenv("UPSTREAM_KEY")
    assert KeySource(env="UPSTREAM_KEY").read() is None


def test_a_key_a_header_cannot_carry_or_a_missing_key_file_is_refused_unquoted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key with a line break went into the header, and httpx's error quoted it, key and all, in
    a 502 a client got; a non-ASCII one was a 500 on every call; a mistyped key file fell back to
    the environment's key, unsaid."""
    for key in ("s3cr3t-key\nrotated", "s3cr3t-k\u00e9y", "s3cr3t key"):
        monkeypatch.setenv("UPSTREAM_KEY", key)
        with pytest.raises(CascadeError, match=r"an HTTP header cannot carry") as caught:
            UpstreamClient(UpstreamSettings(url="http://127.0.0.1:9/v1/systemone",
                                            key=KeySource(env="UPSTREAM_KEY")))
        assert "s3cr3t" not in str(caught.value)
    monkeypatch.setenv("UPSTREAM_KEY", "good-key")
    with pytest.raises(CascadeError, match=r"upstream key file .*typo.key does not exist"):
        UpstreamClient(UpstreamSettings(url="http://127.0.0.1:9/v1/systemone",
                                        key=KeySource(env="UPSTREAM_KEY", file=tmp_path / "typo.key")))


def test_a_key_file_rotated_to_something_unsendable_is_a_502_not_a_bug(tmp_path: Path) -> None:
    """The file is re-read when it changes: rewritten with a line break, or in bytes that are not
    UTF-8, every call was a 500 "this is a bug" (or a UnicodeDecodeError traceback at start); an
    empty key file started the server with no key, unsaid."""
    key = tmp_path / "key"
    key.write_text("good-key\n")
    source = KeySource(file=key)
    source.check()
    key.write_text("s3cr3t\nrotated\n")
    with pytest.raises(UpstreamFailed, match="holds a character an HTTP header cannot carry") as caught:
        source.read()
    assert caught.value.status == 502 and "s3cr3t" not in str(caught.value)
    key.write_bytes(b"\xff\xfes3cr3t-bin-key")
    with pytest.raises(UpstreamFailed, match="is not UTF-8 text"):
        source.read()
    key.write_text("\n")
    with pytest.raises(CascadeError, match="holds no key"):
        KeySource(file=key).check()
    # emptied or removed while serving: calls went out with no key, unsaid
    with pytest.raises(UpstreamFailed, match="holds no key") as caught:
        source.read()
    assert caught.value.status == 502
    key.unlink()
    with pytest.raises(UpstreamFailed, match=r"upstream key file .*key is gone; put the key back"):
        source.read()
    key.mkdir()
    with pytest.raises(UpstreamFailed, match=r"cannot read the upstream key file .*Is a directory"):
        source.read()


def test_the_models_route_keeps_the_query_after_its_path() -> None:
    """"/models" went after the query: the upstream read GET /v1/systemone?api_key=K/models."""
    for url, models in (("http://h:9/v1/systemone?api_key=K", "http://h:9/v1/models?api_key=K"),
                        ("https://h/v1/systemone/", "https://h/v1/models")):
        client = UpstreamClient(UpstreamSettings(url=url))
        assert client.models_url == models
        client.close()


def test_accepted_keys_expire_and_are_revoked_at_once() -> None:
    clock = Clock()
    keys = AcceptedKeys(remember=60, clock=clock)
    keys.accept("Bearer a")
    assert keys.accepted("Bearer a") and not keys.accepted("Bearer b")
    clock.now += 61
    assert not keys.accepted("Bearer a")
    keys.accept("Bearer a")
    keys.revoke("Bearer a")
    assert not keys.accepted("Bearer a")


def test_a_pause_holds_per_key_and_is_never_shortened() -> None:
    clock = Clock()
    pauses = Pauses(clock)
    pauses.pause("Bearer a", 30)
    pauses.pause("Bearer a", 5)
    assert (pauses.left("Bearer a"), pauses.left("Bearer b")) == (30, 0)
    clock.now += 31
    assert pauses.left("Bearer a") == 0


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert (retry_after("7"), retry_after(None), retry_after("soon")) == (7.0, None, None)
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: no wait
    assert np.isclose(retry_after("0.5") or 0, 0.5)


def test_the_routing_package_loads_without_httpx() -> None:
    """A bundle with a GGUF teacher needs none of the upstream extra: httpx is imported only when
    an upstream is opened."""
    code = ("import sys\nfrom cascade.routing.router import Cascade\nimport cascade.tiers.upstream\n"
            "print('httpx' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr


def test_an_endpoint_teacher_goes_from_a_store_into_a_bundle_and_back_out_as_expected() -> None:
    from cascade.bundle.manifest import TeacherInfo
    from distill.store import Teacher

    identity = EndpointIdentity(model="jev-1.13.0", model_hash="h1", calibration_version="c1",
                                templates={"urgent": "a"})
    stored = Teacher.of_endpoint(identity)
    assert "templates\":{}" in (stored.identity or "")  # templates live in each label's prompt hash
    info = TeacherInfo.model_validate(stored.model_dump())  # as cascade train writes the manifest
    assert info.endpoint_identity() == EndpointIdentity(model="jev-1.13.0", model_hash="h1",
                                                        calibration_version="c1")
    assert info.model_dump() == stored.model_dump()  # calibration and evaluation compare them
    assert Teacher.model_validate(info.model_dump()) == stored  # as the auditor reads it back
    gguf = {"kind": "gguf", "model": "m", "model_sha256": "a" * 64, "prompt_version": "v"}
    assert TeacherInfo(**gguf).model_dump() == Teacher(**gguf).model_dump() == gguf
    with pytest.raises(ValueError, match="kind 'endpoint', and only one, has an identity"):
        Teacher(kind="external", model="x", identity=stored.identity)


def test_a_url_password_beside_a_key_is_said_in_one_line_without_the_password(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """httpx sends a URL's user and password as Basic auth in place of an Authorization header:
    the key never goes, and that is said."""
    from cascade.teachers.client import UpstreamClient
    from cascade.teachers.settings import UpstreamSettings

    url = "http://bob:s3cret@127.0.0.1:9/v1/systemone"
    monkeypatch.setenv("UPSTREAM_KEY_TEST", "k")
    for settings in ({"key": KeySource(env="UPSTREAM_KEY_TEST")}, {"forward_auth": True}, {}):
        caplog.clear()
        with caplog.at_level("WARNING", logger="cascade.upstream"):
            UpstreamClient(UpstreamSettings(url=url, **settings)).close()  # type: ignore[arg-type]
        said = [r.getMessage() for r in caplog.records if "carries a user and password" in r.getMessage()]
        assert len(said) == (1 if settings else 0) and all("s3cret" not in line for line in said)
