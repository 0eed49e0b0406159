"""The audit of routed items: the seeded sample, records kept in the label store (kill-safe), the
drift alarm demoting a question and a recalibration bringing it back, ``cascade decide`` and
``cascade serve`` auditing, and ``cascade audit``'s report. The bundle is ``servers``': gemma-3-270m
live as the teacher, the encoder trained on the generator's labels (so on "urgent" it disagrees
with gemma on about half the items: a drift the alarm must catch).
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpora import QUESTIONS_JSON, corpus_items
from servers import KEPT, running, serving_bundle

from cascade.answers import NoulAnswer
from cascade.audit.auditor import Auditor
from cascade.audit.record import AuditRecord, SystemAnswer
from cascade.audit.sample import AuditSampler
from cascade.bundle.manifest import Bundle, Manifest
from cascade.errors import CascadeError
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig, _model_entry
from cascade.serve.engine_settings import EngineSettings
from cascade.tiers.base import Item
from distill.cli import main
from distill.loop.auditing import StoreSink, auditor_for, bundle_teacher, stored_audits
from distill.store import LabelStore, StoreError, Teacher


@pytest.fixture(scope="module")
def bundle_dir(trained_bundle: Bundle, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_bundle(trained_bundle, tmp_path_factory.mktemp("audit") / "support", gemma_path)


def items(n: int, start: int = 0) -> list[Item]:
    return [Item(it.id, it.text) for it in corpus_items()[start:start + n]]


def test_the_sample_is_a_seeded_uniform_share_of_the_keys() -> None:
    sampler = AuditSampler(0.02, seed="s")
    keys = [str(n) for n in range(20_000)]
    chosen = sum(map(sampler.chosen, keys))
    assert abs(chosen - 400) < 3 * (20_000 * 0.02 * 0.98) ** 0.5  # within 3 sigma of 2%
    assert [sampler.chosen(k) for k in keys[:500]] == [AuditSampler(0.02, "s").chosen(k) for k in keys[:500]]
    assert [sampler.chosen(k) for k in keys[:500]] != [AuditSampler(0.02, "t").chosen(k) for k in keys[:500]]
    assert not any(map(AuditSampler(0).chosen, keys[:100])) and all(map(AuditSampler(1).chosen, keys[:100]))
    with pytest.raises(ValueError, match=r"audit share must be a number in \[0, 1\]"):
        AuditSampler(1.5)


def record(n: int, agreed: bool = True) -> AuditRecord:
    teacher = {KEPT: {"true": 0.9, "false": 0.1}}
    answer = "true" if agreed else "false"
    return AuditRecord(item_id=f"audit:{n}", state=f"state {n}", calibration_version="v", at=float(n),
                       teacher=teacher, prompt_hashes={KEPT: "ab" * 32},
                       system={KEPT: SystemAnswer(answer=answer, tier="encoder")})


def test_audits_go_into_the_label_store_as_teacher_labels_tagged_as_audits(
    bundle_dir: Path, tmp_path: Path
) -> None:
    teacher = bundle_teacher(Bundle.load(bundle_dir).manifest)
    sink = StoreSink(tmp_path / "labels.sqlite", teacher)
    for n in range(3):
        sink(record(n, agreed=n != 1))
    sink.close()
    assert stored_audits(tmp_path / "labels.sqlite") == [record(0), record(1, agreed=False), record(2)]
    with LabelStore.open_existing(tmp_path / "labels.sqlite") as store:
        assert set(store.labels(KEPT)) == {"audit:0", "audit:1", "audit:2"}
        created = [label.created_at for label in store.iter_labels()]
    assert all(c > 1e9 for c in created)  # with the time they were written
    # a row damaged by hand or by a disk: one line naming it, not a JSONDecodeError from cascade audit
    for column, value in (("system", "{"), ("state", "not json")):
        with sqlite3.connect(tmp_path / "labels.sqlite") as db:
            kept = db.execute(f"SELECT {column} FROM audits WHERE item_id = 'audit:1'").fetchone()[0]
            db.execute(f"UPDATE audits SET {column} = ? WHERE item_id = 'audit:1'", (value,))
        with pytest.raises(StoreError, match=r"the audit 'audit:1' in .* is damaged \(JSONDecodeError"):
            stored_audits(tmp_path / "labels.sqlite")
        with sqlite3.connect(tmp_path / "labels.sqlite") as db:
            db.execute(f"UPDATE audits SET {column} = ? WHERE item_id = 'audit:1'", (kept,))


KILL_WRITER = """\
import sys
sys.path.insert(0, "tests")
from test_audit import record
from distill.loop.auditing import StoreSink
from distill.store import Teacher
sink = StoreSink(sys.argv[1], Teacher(kind="external", model="tests"))
for n in range(100000):
    sink(record(n))
    if n == 20:
        print("writing", flush=True)
"""


def test_audit_writes_survive_a_sigkill(tmp_path: Path) -> None:
    """Each audit is one transaction: after a kill every audit row has its labels, every audit
    label its row, and the store opens and takes more."""
    path = tmp_path / "labels.sqlite"
    writer = subprocess.Popen([sys.executable, "-c", KILL_WRITER, str(path)], stdout=subprocess.PIPE,
                              text=True)
    assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
    time.sleep(0.2)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    audits = stored_audits(path)
    with LabelStore.open_existing(path) as store:
        labelled = set(store.labels(KEPT))
    assert len(audits) > 20 and {a.item_id for a in audits} == labelled
    assert all(a.teacher == record(0).teacher for a in audits)


def test_a_drifted_question_is_demoted_and_a_recalibration_brings_it_back(
    bundle_dir: Path, gemma_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records: list[AuditRecord] = []
    store = tmp_path / "labels.sqlite"
    every = {qid: qid for qid in QUESTIONS_JSON}
    with Cascade.load(bundle_dir, teacher=gemma_path, threads=2) as cascade:
        sink = StoreSink(store, bundle_teacher(cascade.manifest))
        auditor = Auditor(cascade, AuditSampler(1.0), lambda r: (records.append(r), sink(r)))
        for item in items(16):
            auditor.audit(item, cascade.decide(item.state), every)
            if KEPT in cascade.demoted:
                break
        sink.close()
        assert cascade.demoted == {KEPT}, [r.system for r in records]
        assert auditor.watch is not None and auditor.watch.monitors[KEPT].alarm
        after = cascade.decide(items(1, 40)[0].state, questions=[KEPT]).answers[KEPT].routing
        assert after is not None and (after.tier, after.demoted) == ("teacher", True)
        # a restart replays the audits of this calibration: still demoted
        again = Auditor(cascade, AuditSampler(1.0), records.append)
        again.replay(records)
        assert again.watch is not None and again.watch.demoted == {KEPT}
    recalibrated = tmp_path / "recalibrated"
    shutil.copytree(bundle_dir, recalibrated)
    assert main(["calibrate", "--bundle", str(recalibrated), "--store", str(store), "--calibrate-on",
                 "traffic", "--target-agreement", "0.6", "--teacher-items", "0", "--report",
                 str(tmp_path / "report")]) == 0
    assert f"the traffic the audit sampled ({len(records)} items audited" in capsys.readouterr().out
    with Cascade.load(recalibrated, teacher=gemma_path, threads=2) as cascade:
        threshold = cascade.manifest.threshold(KEPT, "encoder")
        assert threshold is not None  # certified again, on what the audit saw
        fresh, _ = auditor_for(cascade, store, 1.0, "s", "demote")
        assert fresh is not None and fresh.watch is not None and fresh.watch.monitors[KEPT].items == 0
        assert cascade.demoted == set()
        routes = [cascade.decide(item.state, questions=[KEPT]).answers[KEPT].routing for item in items(8, 40)]
        assert all(r is not None and not r.demoted for r in routes)


def test_auditing_needs_a_live_certified_teacher(bundle_dir: Path, gemma_path: Path) -> None:
    with Cascade.load(bundle_dir, labels={KEPT: {}}, threads=1) as replay, \
            pytest.raises(CascadeError, match="needs a live teacher"):
        Auditor(replay, AuditSampler(), lambda _: None)
    assert auditor_for(replay, None, 0.02, "s", "demote") == (None, None)


def test_an_audit_of_an_item_the_teacher_answered_records_those_answers_and_asks_nothing(
        bundle_dir: Path, gemma_path: Path) -> None:
    """Every bundle question escalated: the audit records the teacher's answers the response
    holds (a second read would cost a teacher call); one question answered below, or not asked:
    the teacher reads them all again."""
    records: list[AuditRecord] = []
    with Cascade.load(bundle_dir, teacher=gemma_path, threads=1) as cascade:
        auditor = Auditor(cascade, AuditSampler(1.0), records.append, on_drift="demote")
        assert auditor.watch is not None
        teacher, reads, reply = cascade.tiers[-1], list[int](), cascade.tiers[-1].reply

        def counted(*args: Any) -> Any:  # the real teacher, its reads counted
            reads.append(1)
            return reply(*args)
        teacher.reply = counted  # type: ignore[method-assign]
        every = {qid: qid for qid in cascade.questions}
        state = items(1)[0].state
        auditor.watch.demoted.update(cascade.questions)  # every answer from the teacher
        sent_up = cascade.decide(state)
        assert {a.routing.tier for a in sent_up.answers.values() if a.routing} == {teacher.name}
        asked_before = len(reads)
        record = auditor.audit(Item("a", state), sent_up, every)
        assert record is not None and len(reads) == asked_before  # no teacher call
        held = {qid: [answer.noul, 1 - answer.noul] if isinstance(answer, NoulAnswer)
                else list(answer.probabilities.values()) for qid, answer in sent_up.answers.items()}
        assert record.teacher == {qid: dict(zip(cascade.questions[qid].option_keys(), p, strict=True))
                                  for qid, p in held.items()}
        assert all(abs(sum(p.values()) - 1) < 1e-6 for p in record.teacher.values())
        assert set(record.prompt_hashes) == set(cascade.questions)
        assert all(record.agreed(qid) for qid in record.system)
        one = cascade.decide(state, questions=[KEPT])  # the others not asked: not known
        record = auditor.audit(Item("b", state), one, every)
        assert record is not None and len(reads) == asked_before + 2  # its decision's read, and the audit's
        assert set(record.teacher) == set(cascade.questions)
        assert auditor.answered_above(one, every) is None and auditor.audited == 2


def test_decide_audits_its_sample_and_cascade_audit_reports_it(
    bundle_dir: Path, gemma_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i.id, "text": i.state}) + "\n" for i in items(12)))
    store = tmp_path / "labels.sqlite"
    args = ["decide", "--bundle", str(bundle_dir), "--corpus", str(corpus), "--out",
            str(tmp_path / "d.jsonl"), "--teacher", str(gemma_path), "--threads", "2", "--audit-store",
            str(store), "--audit-share", "1", "--batch-size", "2"]
    assert main(args) == 0
    assert "audited 12 by the teacher" in capsys.readouterr().out
    audits = stored_audits(store)
    run = audits[0].item_id.split(":")[1]  # ids are unique per run: audit:<run>:<corpus id>
    assert [a.item_id for a in audits] == [f"audit:{run}:{i.id}" for i in items(12)]
    assert all(set(a.teacher) == set(QUESTIONS_JSON) for a in audits)
    decided = [json.loads(line) for line in (tmp_path / "d.jsonl").open()]
    # the alarm rose at the 10th audit: the last batch (items 11 and 12) went to the teacher
    assert [row["answers"][KEPT]["x_routing"]["demoted"] for row in decided] == [False] * 10 + [True] * 2
    assert main(["audit", "--bundle", str(bundle_dir), "--store", str(store)]) == 3  # alarm: it said 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith(KEPT))
    assert "raised at audited item" in line and "wealth reached 20" in line and line.split()[1] == "12"
    assert (tmp_path / "labels.audit.png").stat().st_size > 1000
    # a second audited run of the same corpus ids into the same store: no crash, each item counted once
    assert main([*args[:6], str(tmp_path / "d2.jsonl"), *args[7:]]) == 0
    again = stored_audits(store)
    assert len(again) == 24 and len({a.item_id for a in again}) == 24
    assert main(["audit", "--bundle", str(bundle_dir), "--store", str(store)]) == 3
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith(KEPT))
    assert line.split()[1] == "12"
    assert "24 audits in the store: 0 of other calibrations set aside (the alarm watches this one), " \
        "12 repeated states counted once" in out
    # a mistyped store said "0 audited ... quiet", and another teacher's store was read as this bundle's
    assert main(["audit", "--bundle", str(bundle_dir), "--store", str(tmp_path / "typo.sqlite")]) == 2
    assert "no label store at" in capsys.readouterr().err and not (tmp_path / "typo.sqlite").exists()
    with LabelStore(tmp_path / "other.sqlite", Teacher(kind="external", model="someone else")) as other:
        other.put_item("x", {KEPT: {"true": 1.0, "false": 0.0}})
    assert main(["audit", "--bundle", str(bundle_dir), "--store", str(tmp_path / "other.sqlite")]) == 2
    assert "its audits are not this bundle's" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the plot is a PNG whatever its name: said, not written as P.txt.png
        main(["audit", "--bundle", str(bundle_dir), "--store", str(store), "--plot", str(tmp_path / "p.txt")])
    assert main(["audit", "--bundle", str(bundle_dir), "--store", str(store), "--plot",
                 str(tmp_path / "new" / "p.png")]) == 3
    assert (tmp_path / "new" / "p.png").stat().st_size > 1000
    # all of another calibration (the usual case after a recalibration): it said "0 ... quiet", exit 0
    with sqlite3.connect(store) as db:
        db.execute("UPDATE audits SET calibration_version = 'an-older-one'")
    assert main(["audit", "--bundle", str(bundle_dir), "--store", str(store)]) == 1
    out, err = capsys.readouterr()
    assert "24 audits in the store: 24 of other calibrations set aside" in out
    assert "the figures above watch nothing" in err


def test_a_budget_mode_bundle_is_watched_against_no_target(
    bundle_dir: Path, gemma_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Budget mode certifies nothing, yet the target it was given (0.98 by default) was watched:
    the drift alarm demoted its questions, `cascade audit` reported against it, and the server's
    /v1/models said "certified at 0.98"."""
    bundle = Bundle.load(bundle_dir)
    data = bundle.manifest.model_dump(mode="json")
    data["calibration"].update(mode="budget", escalation_fraction=0.3)
    budget = tmp_path / "budget"
    Bundle(Manifest.model_validate(data), bundle.directory).save(budget)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i.id, "text": i.state}) + "\n" for i in items(12)))
    store = tmp_path / "labels.sqlite"
    assert main(["decide", "--bundle", str(budget), "--corpus", str(corpus), "--out",
                 str(tmp_path / "d.jsonl"), "--teacher", str(gemma_path), "--threads", "2",
                 "--audit-store", str(store), "--audit-share", "1", "--batch-size", "2"]) == 0
    assert "audited 12 by the teacher" in capsys.readouterr().out
    decided = [json.loads(line) for line in (tmp_path / "d.jsonl").open()]
    assert not any(row["answers"][KEPT]["x_routing"]["demoted"] for row in decided)  # 2 were
    assert main(["audit", "--bundle", str(budget), "--store", str(store)]) == 2
    assert "calibrated in budget mode (--escalation-fraction), which certifies no agreement" \
        in capsys.readouterr().err
    entry = _model_entry(Cascade.load(budget, teacher=gemma_path))["description"]
    assert "budget mode: each cheap tier escalates 0.3" in entry and "certified at" not in entry


def test_the_server_audits_at_the_lowest_priority_and_counts_what_it_drops(
    bundle_dir: Path, gemma_path: Path, tmp_path: Path
) -> None:
    sinks: list[Any] = []

    def audit(cascade: Cascade) -> Auditor | None:
        auditor, sink = auditor_for(cascade, tmp_path / "labels.sqlite", 1.0, "s", "alarm")
        sinks.append(sink)
        return auditor

    config = ServeConfig(engine=EngineSettings(audit_queue=1), audit=audit)
    load = lambda: Cascade.load(bundle_dir, teacher=gemma_path, threads=2)  # noqa: E731
    with running(load, config) as url:
        body = {"state": items(1)[0].state, "questions": {KEPT: QUESTIONS_JSON[KEPT]}}
        with httpx.Client() as client:
            replies = [client.post(f"{url}/v1/systemone", json=body, timeout=60) for _ in range(6)]
        assert [r.status_code for r in replies] == [200] * 6
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics").text
            done = sum(_gauge(text, f'cascade_audits_total{{outcome="{o}"}}') for o in ("audited", "dropped"))
            if done == 6:
                break
            time.sleep(0.2)
        assert done == 6 and _gauge(text, 'cascade_audits_total{outcome="audited"}') >= 1
        assert _gauge(text, 'cascade_audits_total{outcome="dropped"}') >= 1  # a queue of 1 behind 6 requests
        assert f'cascade_audited_items{{question="{KEPT}"}}' in text
    for sink in sinks:
        sink.close()
    audited = _gauge(text, 'cascade_audits_total{outcome="audited"}')
    assert len(stored_audits(tmp_path / "labels.sqlite")) == audited


def _gauge(text: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)), 0.0)
