"""``cascade serve --escalation-share`` (and ``cascade decide``'s): the teacher's answers to what
the cascade escalated are kept in the bundle's label store, apart from the audits, and a retrain
reads them as training evidence only.

gemma-3-270m is the live teacher; the bundle's routes are fixed (``servers``): "urgent" stays at
the encoder and "department" always goes to the teacher.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpora import QUESTIONS_JSON, corpus_items
from servers import ESCALATED, KEPT, free_port, running, serving_bundle, until

from cascade.audit.sample import AuditSampler
from cascade.bundle.manifest import Bundle, Manifest
from cascade.collect.collector import Collector
from cascade.collect.escalation import EscalationRecord
from cascade.errors import CascadeError
from cascade.routing.budget import Budget
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig
from cascade.serve.engine import Engine
from cascade.serve.engine_settings import EngineSettings
from distill.cli import main
from distill.loop.auditing import auditor_for, bundle_teacher
from distill.loop.escalations import StoreEscalations, escalations
from distill.loop.evidence import CERTIFYING, gather
from distill.store import LabelStore, Teacher

PATIENT = EngineSettings(max_wait=600.0)
STATES = [item.text for item in corpus_items()[100:106]]
SAME = 1e-9
"""How far a kept label may be from the answer the client got: the same float64 numbers, read
back from JSON (a temperature of 1 leaves the teacher's distribution as it is)."""


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("kept") / "support", gemma_path)


def kept_in(store: Path, bundle_dir: Path, share: float = 1.0, max_items: int | None = None
            ) -> Collector[EscalationRecord]:
    sink = StoreEscalations(store, bundle_teacher(Bundle.load(bundle_dir).manifest))
    return Collector(sink, share, max_items, seed="s", what="escalations")


def ask(base: str, state: str, *qids: str) -> dict[str, Any]:
    body = {"state": state, "questions": {qid: QUESTIONS_JSON[qid] for qid in qids}}
    reply = httpx.post(f"{base}/v1/systemone", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def metrics_of(base: str) -> str:
    return httpx.get(f"{base}/metrics", timeout=30).text


def test_the_teachers_answers_to_escalated_questions_are_kept_apart_from_the_audits(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    store = tmp_path / "labels.sqlite"
    collector = kept_in(store, bundle_dir)
    config = ServeConfig(engine=PATIENT, escalations=collector,
                         audit=lambda c: auditor_for(c, store, 1.0, "s", "alarm")[0])
    load = lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2)  # noqa: E731
    try:
        with running(load, config) as base:
            replies = [ask(base, state, KEPT, ESCALATED) for state in STATES]
            ask(base, STATES[0], KEPT)  # nothing escalated: nothing kept
            until(lambda: 'cascade_audits_total{outcome="audited"} 7.0' in metrics_of(base), "the 7 audits")
            metrics = metrics_of(base)
    finally:
        collector.sink.close()  # type: ignore[attr-defined]
    assert all(r["answers"][ESCALATED]["x_routing"]["tier"] == "teacher" for r in replies)
    assert all(r["answers"][KEPT]["x_routing"]["tier"] == "encoder" for r in replies)
    assert f'cascade_escalations_kept_total{{outcome="collected"}} {float(len(STATES))}' in metrics
    with LabelStore.open_existing(store) as opened:
        kept = [record for _, record in opened.escalations_after(0)]
        audits = opened.audits()
        evidence = gather(opened, Bundle.load(bundle_dir).manifest.parsed_questions(), None)
    assert [record.state for record in kept] == STATES
    for record, reply in zip(kept, replies, strict=True):
        assert record.item_id.startswith("escalation:") and set(record.teacher) == {ESCALATED}
        answered = reply["answers"][ESCALATED]["probabilities"]
        assert record.teacher[ESCALATED].keys() == answered.keys()
        assert all(abs(record.teacher[ESCALATED][k] - answered[k]) <= SAME for k in answered)
        assert record.calibration_version == reply["audit"]["calibration_version"]
        assert record.prompt_hashes.keys() == {ESCALATED}
    # the audit saw all 7 requests, and no escalation is among its records (the drift watch's stream)
    assert len(audits) == len(STATES) + 1 and not any(a.item_id.startswith("escalation:") for a in audits)
    # each state was audited and escalated (the first one audited twice): one observation each, kept
    # under the audit (which may certify)
    assert dict(evidence.origins) == {"audit": len(STATES)} and evidence.duplicates == len(STATES) + 1


def test_evidence_reads_escalations_as_training_only(bundle_dir: Path, gemma_path: Path,
                                                    tmp_path: Path) -> None:
    store = tmp_path / "labels.sqlite"
    collector = kept_in(store, bundle_dir, max_items=2)
    load = lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2)  # noqa: E731
    try:
        with running(load, ServeConfig(engine=PATIENT, escalations=collector)) as base:
            for state in STATES[:3]:
                ask(base, state, ESCALATED)
            metrics = metrics_of(base)
    finally:
        collector.sink.close()  # type: ignore[attr-defined]
    assert 'cascade_escalations_kept_total{outcome="full"} 1.0' in metrics
    with LabelStore.open_existing(store) as opened:
        evidence = gather(opened, Bundle.load(bundle_dir).manifest.parsed_questions(), None)
        assert opened.escalation_count() == 2 and not opened.audits()
        assert len(list(escalations(opened))) == 2
    assert dict(evidence.origins) == {"escalation": 2} and not evidence.ids(CERTIFYING["all"])


def no_threshold_for(bundle_dir: Path, qid: str, directory: Path) -> Path:
    """A copy of ``bundle_dir`` holding no threshold for ``qid``: routing sends it up whatever the item."""
    bundle = Bundle.load(bundle_dir)
    data = bundle.manifest.model_dump(mode="json")
    data["thresholds"].pop(qid)
    Bundle(Manifest.model_validate(data), bundle.directory).save(directory)
    return directory


def test_routing_sends_a_question_up_whatever_the_item_only_without_a_threshold_or_a_budget(
        bundle_dir: Path, tmp_path: Path) -> None:
    bare = no_threshold_for(bundle_dir, ESCALATED, tmp_path / "bare")
    with Cascade.load(bundle_dir, labels={KEPT: {}}, threads=1) as held, \
            Cascade.load(bare, labels={KEPT: {}}, threads=1) as young:
        assert not held.sends_every_item_up(ESCALATED, Budget())  # a threshold of 1.0 is a choice
        assert young.sends_every_item_up(ESCALATED, Budget())
        assert not young.sends_every_item_up(KEPT, Budget())
        for bound in (Budget(ms_per_call=1e6), Budget(max_escalation_fraction=1.0)):
            assert not young.sends_every_item_up(ESCALATED, bound)  # a budget may keep an answer
        held.demoted.add(ESCALATED)  # a drift alarm's demotion sends it up whatever the item
        assert held.sends_every_item_up(ESCALATED, Budget())


def test_escalations_of_a_question_sent_up_whatever_the_item_are_a_census_that_certifies(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    bare = no_threshold_for(bundle_dir, ESCALATED, tmp_path / "bare")
    store = tmp_path / "labels.sqlite"
    collector = kept_in(store, bare)
    load = lambda: Cascade.load(bare, teacher=gemma_path, threads=2)  # noqa: E731
    try:
        with running(load, ServeConfig(engine=PATIENT, escalations=collector)) as base:
            census = [ask(base, state, KEPT, ESCALATED) for state in STATES[:3]]
            body = {"state": STATES[3], "questions": {ESCALATED: QUESTIONS_JSON[ESCALATED]},
                    "x_budget": {"ms_per_call": 1e6}}  # bounded: not a census, though it went up
            assert httpx.post(f"{base}/v1/systemone", json=body, timeout=120).status_code == 200
            until(lambda: collector.counts["collected"] == 4, "the 4 escalations kept")
    finally:
        collector.sink.close()  # type: ignore[attr-defined]
    assert all(r["answers"][ESCALATED]["x_routing"]["tier"] == "teacher" for r in census)
    with LabelStore.open_existing(store) as opened:
        kept = [record for _, record in opened.escalations_after(0)]
        evidence = gather(opened, Bundle.load(bare).manifest.parsed_questions(), None)
    assert [(record.state, record.census) for record in kept] == [
        *((state, (ESCALATED,)) for state in STATES[:3]), (STATES[3], ())]
    assert [record.inclusion for record in kept] == [1.0] * 4  # the share; the queue dropped none
    assert dict(evidence.origins) == {"census escalation": 3, "escalation": 1}
    assert evidence.ids(CERTIFYING["traffic"]) == {record.item_id for record in kept[:3]}


def test_no_escalation_is_kept_from_a_teacher_the_certificate_does_not_name(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    store = tmp_path / "labels.sqlite"
    collector = kept_in(store, bundle_dir)
    cascade = Cascade.load(bundle_dir, teacher=gemma_path, threads=2)
    cascade.certified = False  # as --accept-other-teacher loads another teacher
    try:
        with running(lambda: cascade, ServeConfig(engine=PATIENT, escalations=collector)) as base:
            reply = ask(base, STATES[0], ESCALATED)
    finally:
        collector.sink.close()  # type: ignore[attr-defined]
    assert reply["answers"][ESCALATED]["x_routing"]["tier"] == "teacher"
    assert collector.counts["collected"] == 0 and not store.exists()


def test_keeping_escalations_needs_a_live_teacher(bundle_dir: Path, tmp_path: Path) -> None:
    with Cascade.load(bundle_dir, labels={KEPT: {}}, threads=1) as replay, \
            pytest.raises(CascadeError, match="needs a live teacher"):
        Engine(replay, escalations=kept_in(tmp_path / "labels.sqlite", bundle_dir))


def serve_command(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distill.cli", "serve", "--port", str(free_port()), *extra],
                          capture_output=True, text=True, timeout=300)


def test_the_command_refuses_escalations_it_cannot_keep_before_it_listens(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path) -> None:
    common = ["--bundle", str(bundle_dir), "--teacher", str(gemma_path), "--escalation-share", "1"]
    no_store = serve_command(*common)
    assert no_store.returncode != 0 and no_store.stderr.rstrip().endswith("store: give --audit-store")
    other = serve_command(*common, "--audit-store", "x.sqlite", "--accept-other-teacher")
    assert other.returncode != 0 and "--accept-other-teacher runs another" in other.stderr
    bad = serve_command(*common[:-1], "1.5")
    assert bad.returncode == 2 and "must be a share in [0, 1]; got '1.5'" in bad.stderr
    foreign = tmp_path / "foreign.sqlite"
    with LabelStore(foreign, Teacher(kind="external", model="someone else")) as store:
        store.put_item("x", {KEPT: {"true": 1.0, "false": 0.0}})
    refused = serve_command(*common, "--audit-store", str(foreign), "--audit-share", "0")
    assert refused.returncode != 0 and "made by another teacher" in refused.stderr
    assert "serving" not in refused.stderr  # refused before the port opened


def test_decide_keeps_the_escalations_of_its_share_and_a_rerun_adds_none(
        bundle_dir: Path, gemma_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``cascade decide --escalation-share``: each kept label is the teacher's answer the decision
    line holds; the share is drawn by item id, so a rerun over the same ids keeps the same ones."""
    corpus, out, store = tmp_path / "c.jsonl", tmp_path / "d.jsonl", tmp_path / "labels.sqlite"
    rows = [{"id": f"i{n}", "text": state} for n, state in enumerate(STATES)]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["decide", "--bundle", str(bundle_dir), "--corpus", str(corpus), "--out", str(out), "--teacher",
            str(gemma_path), "--threads", "2", "--batch-size", "4", "--audit-store", str(store),
            "--audit-share", "0", "--escalation-share", "0.5", "--escalation-seed", "s"]
    assert main(args) == 0
    decided = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    with LabelStore.open_existing(store) as opened:
        kept = [record for _, record in opened.escalations_after(0)]
        assert not opened.audits()
    chosen = [f"i{n}" for n in range(len(STATES)) if AuditSampler(0.5, "s").chosen(f"i{n}")]
    assert 0 < len(chosen) < len(STATES) and [record.request_id for record in kept] == chosen
    assert {record.inclusion for record in kept} == {0.5}  # drawn by item id at the share, written at once
    assert f"{len(chosen)} escalations kept in {store}" in capsys.readouterr().out
    for record in kept:  # every question the teacher answered about the item, as the line holds it
        answers = decided[record.request_id]["answers"]
        by_teacher = {qid for qid, answer in answers.items() if answer["x_routing"]["tier"] == "teacher"}
        assert set(record.teacher) == by_teacher and ESCALATED in by_teacher
        assert record.state == STATES[int(record.request_id[1:])]
        for qid, label in record.teacher.items():
            answer = answers[qid]  # a noul answer says P(yes) alone
            said = answer.get("probabilities") or {"true": answer["noul"], "false": 1 - answer["noul"]}
            assert label.keys() == said.keys() and all(abs(label[k] - p) <= SAME for k, p in said.items())
    out.unlink()  # decided again from the start: the same items are chosen, each kept again
    assert main(args) == 0
    with LabelStore.open_existing(store) as opened:
        assert [record.request_id for _, record in opened.escalations_after(0)] == chosen * 2
    refused = main([*args, "--accept-other-teacher"])
    assert refused == 2 and "--accept-other-teacher runs another" in capsys.readouterr().err
