"""jevcompat 0.1.1's conformance suite (``jevcompat test URL``, here its ``runner.run``) against a
real ``cascade serve``: the session's trained bundle, gemma-3-270m live as the teacher (as in
``test_serve``). Every MUST passes. Of the SHOULDs it tests, every one passes but those
docs/wire-format.md ("Conformance") argues: three a published SDK needs as they are, and one a
quantized teacher may miss by less than the decode paths' tolerance (``semantics.batching``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jevcompat import runner
from servers import running, serving_bundle

from cascade.bundle.manifest import Bundle
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig
from cascade.serve.engine_settings import EngineSettings

ARGUED = {
    "score.map-rejected": "avrik-sdk's score() sends a mapping of level labels as it is given",
    "errors.reject-invalid": "its one finding is that map-form score request, answered",
    "response.extensions": "avrik-sdk's Decision requires a top-level `audit`",
}
"""The SHOULDs this server fails on purpose (docs/wire-format.md, "Conformance")."""

WITHIN_DECODE_TOLERANCE = {"semantics.batching"}
"""The teacher reads a request's questions in one batch after one prefill: more questions make
another batch, for which quantized kernels give slightly different numbers. jevcompat allows a
deterministic server 0.05; the decode paths' stated tolerance on gemma is 0.15
(docs/benchmarks/scorer.md). Whether gemma's moves stay under 0.05 depends on the machine (0.025
here). Another order of the same questions is the same batch (``responses.read_order``): no move."""

DECODE_TOLERANCE = 0.15

UNTESTED_WITHOUT_A_KEY = {"auth.bearer", "auth.missing", "auth.invalid"}
"""Auth is off here, so these are not exercised (the last test runs them against a key)."""

NOT_REACHED = {"errors.shape"}
"""Exercised only by a non-422 4xx to an unknown model; this server takes any model name."""

KEY = "conformance-key"
REQUEST_SECONDS = 300.0
RUN_SECONDS = 1800.0
"""Most a request and a whole run may take: a run takes about 2 minutes on two idle cores, but
one request of 255 options read by gemma on cores shared with other work took over 60 s."""


def run(url: str, **options: Any) -> runner.Report:
    """``runner.run`` within ``RUN_SECONDS``, or fail: the server's shutdown ends what is left."""
    reports: list[runner.Report] = []
    thread = threading.Thread(daemon=True, target=lambda: reports.append(
        runner.run(url, timeout=REQUEST_SECONDS, **options)))
    thread.start()
    thread.join(RUN_SECONDS)
    if not reports:
        pytest.fail(f"jevcompat's run did not end within {RUN_SECONDS:.0f} s")
    return reports[0]


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("conformance") / "support", gemma_path)


@pytest.fixture(scope="module")
def report(bundle_dir: Path, gemma_path: Path) -> Iterator[runner.Report]:
    """One run of every case, bounded (``run``); a request past ``REQUEST_SECONDS`` makes the run
    "incomplete", which the tests below refuse. The queue admits every request."""
    config = ServeConfig(engine=EngineSettings(max_wait=600.0))
    with running(lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2), config) as url:
        yield run(url, model="jev-latest")


def statuses(report: runner.Report, level: str) -> dict[str, str]:
    return {r.id: r.status for r in report.results if r.level == level}


def findings(report: runner.Report, *ids: str) -> str:
    """The findings of ``ids``, as the report prints them, for an assertion's message."""
    return "\n".join(f"{r.id}: {f.where} {f.message}" for r in report.results if r.id in ids
                     for f in r.findings)


def test_every_must_passes(report: runner.Report) -> None:
    assert not report.aborted and not report.case_errors and not report.inconclusive
    musts = statuses(report, "MUST")
    failed = [rid for rid, status in musts.items() if status == "fail"]
    assert not failed, findings(report, *failed)
    assert {rid for rid, status in musts.items() if status == "skip"} == {"auth.bearer"}  # auth off
    assert report.verdict == "conformant" and report.summary()["MUST"]["passed"] == 32


def test_every_should_passes_but_the_argued_deviations(report: runner.Report) -> None:
    shoulds = statuses(report, "SHOULD")
    failed = {rid for rid, status in shoulds.items() if status == "fail"}
    assert set(ARGUED) <= failed <= set(ARGUED) | WITHIN_DECODE_TOLERANCE, \
        findings(report, *failed - set(ARGUED))
    assert {rid for rid, status in shoulds.items() if status == "skip"} == \
        (UNTESTED_WITHOUT_A_KEY - {"auth.bearer"}) | NOT_REACHED
    assert report.summary()["SHOULD"] == {"passed": 12 - len(failed), "failed": len(failed),
                                          "skipped": 3, "tested": 12}


def test_a_semantics_check_missed_is_missed_within_the_decode_tolerance(report: runner.Report) -> None:
    """Where adding questions moves an answer past jevcompat's 0.05, it moves it by less than the
    decode paths' tolerance; reordering them moves none."""
    assert statuses(report, "SHOULD")["semantics.question-order"] == "pass"
    for result in report.results:
        if result.id in WITHIN_DECODE_TOLERANCE:
            for finding in result.findings:
                moved = re.search(r" by (\d\.\d+) on average", finding.message)
                assert moved is not None, finding.message
                assert float(moved.group(1)) <= DECODE_TOLERANCE, finding.message


def test_the_deviations_are_exactly_the_argued_ones(report: runner.Report) -> None:
    """Each argued SHOULD fails for its reason and no other: the map-form score question answered,
    and of the unprefixed fields only ``audit``."""
    by_id = {r.id: r for r in report.results}
    assert [f.case for f in by_id["score.map-rejected"].findings] == ["invalid:score-map"]
    assert [f.case for f in by_id["errors.reject-invalid"].findings] == ["invalid:score-map"]
    messages = {f.message for f in by_id["response.extensions"].findings}
    assert messages == {"unprefixed top-level field(s) audit"}


def test_the_auth_requirements_pass_with_a_key(bundle_dir: Path, gemma_path: Path) -> None:
    """The auth cases alone (and the preflight) against a server that takes one key."""
    config = ServeConfig(api_key=KEY, engine=EngineSettings(max_wait=600.0))
    with running(lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2), config) as url:
        keyed = run(url, key=KEY, only={"auth"})
    assert not keyed.aborted and not keyed.inconclusive
    auth = {r.id: r.status for r in keyed.results if r.id in UNTESTED_WITHOUT_A_KEY}
    assert auth == dict.fromkeys(UNTESTED_WITHOUT_A_KEY, "pass"), findings(keyed, *UNTESTED_WITHOUT_A_KEY)
