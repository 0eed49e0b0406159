"""Retraining from the store and promoting with a gate (``cascade retrain``, ``cascade promote``).

The serving bundle is the session's, trained on the generated corpus of ``corpora``; a copy of its
store then holds what serving would add: every one of the first 40 corpus states audited again
(duplicates, to be counted once), 120 new states audited, 10 escalations the cascade chose and 20
it sent up whatever the item (census escalations), kept as ``cascade serve --escalation-share``
keeps them, whose labels are the generator's as the corpus's are.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from corpora import HEADED, QUESTIONS, TEACHER, corpus_items

from cascade.audit.record import AuditRecord, SystemAnswer
from cascade.bundle.manifest import Bundle
from cascade.collect.escalation import EscalationRecord
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import CascadeError
from cascade.locks import exclusive
from distill.cli import main
from distill.demo.synthetic import SyntheticItem, generate
from distill.loop.auditing import drift_alarms
from distill.loop.evidence import EvidenceError, state_sha256
from distill.loop.gate import RULE, certificate_delta
from distill.loop.promote import PromoteError, promote
from distill.loop.promotions import latest_promotion, promotions_log
from distill.loop.retrain import RetrainError, RetrainResult, evidence_beside, retrain_bundle
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore, Teacher
from distill.training.split import part_of

TARGET = 0.85
START = 1_800_000_000.0


def record(prefix: str, item: SyntheticItem, n: int) -> AuditRecord:
    return AuditRecord(item_id=f"{prefix}:{item.id}", state=item.text, calibration_version="v0", at=START + n,
                       teacher={qid: item.labels[qid] for qid in HEADED})


@pytest.fixture(scope="module")
def served(labelled: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's store after some serving (see the module's docstring)."""
    path = tmp_path_factory.mktemp("served") / "labels.sqlite"
    shutil.copy(labelled[1], path)
    with LabelStore(path, TEACHER) as store:
        for n, item in enumerate(corpus_items()[:40]):
            store.put_audit(record("audit:r1", item, n))
        for n, item in enumerate(generate(150, seed=5)):
            if n < 120:  # drawn at 0.5, every other one past a queue that dropped half
                store.put_audit(record("audit:r2", item, 100 + n).model_copy(
                    update={"inclusion": 0.5 if n % 2 else 0.25}))
            else:  # as `cascade serve --escalation-share` keeps them
                store.put_escalation(EscalationRecord(
                    item_id=f"escalation:r2.{item.id}", request_id=item.id, state=item.text,
                    calibration_version="v0", at=START + 100 + n,
                    teacher={q: item.labels[q] for q in HEADED}, census=tuple(HEADED) if n >= 130 else (),
                    inclusion=1.0))
    return path


def run(cache: Path) -> RunOptions:
    return RunOptions(progress=False, cache_dir=cache, flops_per_second=1e11)


def retrain(serving: Bundle, store_path: Path, out: Path, corpus: Path | None, encoder: Encoder, cache: Path,
            **kwargs: object) -> RetrainResult:
    with LabelStore.open_existing(store_path) as store:
        return retrain_bundle(serving, store, out, None if corpus is None else CorpusInput(corpus),
                              target=TARGET, run=run(cache), encoder=encoder, teacher_items=0,
                              **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def retrained(trained_bundle: Bundle, served: Path, labelled: tuple[Path, Path], encoder: Encoder,
              embedding_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> RetrainResult:
    out = tmp_path_factory.mktemp("retrained") / "support-r2"
    return retrain(trained_bundle, served, out, labelled[0], encoder, embedding_cache)


def test_a_refused_retrain_leaves_no_customer_text_beside_out(
        trained_bundle: Bundle, served: Path, labelled: tuple[Path, Path], encoder: Encoder,
        embedding_cache: Path, tmp_path: Path) -> None:
    """An --out that is a file: training failed, and the states it was to train on stayed beside
    it, in a hidden file nothing removes."""
    out = tmp_path / "pointer"
    out.write_text("support-v1\n", encoding="utf-8")
    with pytest.raises((CascadeError, OSError)):
        retrain(trained_bundle, served, out, labelled[0], encoder, embedding_cache)
    assert not evidence_beside(out).exists()


def test_every_labelled_state_counts_once_and_keeps_its_part(retrained: RetrainResult,
                                                              trained_bundle: Bundle) -> None:
    evidence = retrained.evidence
    assert len(evidence.items) == 300 + 150 and evidence.duplicates == 40
    assert dict(evidence.origins) == {"corpus": 300, "audit": 120, "escalation": 10, "census escalation": 20}
    assert len({state_sha256(item.state) for item in evidence.items}) == len(evidence.items)
    parts = retrained.bundle.split_ids()
    assert set(trained_bundle.split_ids()["train"]) <= set(parts["train"])
    old_held = set(trained_bundle.split_ids()["calibration"])
    assert old_held <= set(parts["calibration"])  # an item keeps its part as traffic grows
    escalations = {item.id for item in evidence.items if item.origin == "escalation"}
    assert escalations <= set(parts["train"])  # escalations the cascade chose train, never certify
    certified_on = set(retrained.lineage["certified_on"])
    assert certified_on == set(parts["calibration"]) and not certified_on & set(parts["train"])
    census = {item.id for item in evidence.items if item.origin == "census escalation"}
    split = trained_bundle.manifest.split  # placed by their id's hash, as audits are; certify there
    assert {part: census & set(ids) for part, ids in parts.items()} == {
        part: {i for i in census if part_of(i, split.fractions, split.salt) == part} for part in parts}
    assert census & certified_on and census & set(parts["train"])
    assert any(i.startswith("audit:r2:") for i in certified_on)
    drawn = {(item.origin, item.inclusion) for item in evidence.items}  # as each was drawn
    assert drawn == {("corpus", None), ("audit", 0.25), ("audit", 0.5),  # r1's audits repeat the corpus
                     ("census escalation", 1.0), ("escalation", 1.0)}
    evaluated_on = set(retrained.lineage["evaluated_on"])  # weighed by the gate, never certified on
    assert evaluated_on == set(parts["evaluation"]) and not evaluated_on & escalations


def test_the_new_bundle_is_calibrated_on_its_held_out_items_and_names_its_parent(
        retrained: RetrainResult, trained_bundle: Bundle) -> None:
    manifest = retrained.bundle.manifest
    assert manifest.calibration.target == TARGET and manifest.calibration.certificate == "joint"
    assert retrained.calibration.items == len(retrained.lineage["certified_on"])
    assert any(manifest.threshold(qid, "encoder") is not None for qid in HEADED)
    lineage = json.loads((retrained.bundle.directory / "lineage.json").read_text(encoding="utf-8"))
    assert lineage["parent"]["name"] == trained_bundle.manifest.name
    assert lineage["evidence"]["duplicates"] == 40
    lines = (retrained.bundle.directory / "evidence.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 450
    # customer text: its owner's alone, and none left where it trained (a temporary folder before)
    assert (retrained.bundle.directory / "evidence.jsonl").stat().st_mode & 0o777 == 0o600
    assert not evidence_beside(retrained.bundle.directory).exists()


def test_a_retrain_refuses_another_teacher_missing_states_and_its_own_serving_folder(
        trained_bundle: Bundle, served: Path, labelled: tuple[Path, Path], encoder: Encoder,
        embedding_cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.sqlite"
    with LabelStore(other, Teacher(kind="external", model="someone else")) as store:
        store.put_item("x", {"urgent": {"true": 1.0, "false": 0.0}})
    with pytest.raises(RetrainError, match="holds labels of the teacher"):
        retrain(trained_bundle, other, tmp_path / "a", labelled[0], encoder, embedding_cache)
    with pytest.raises(EvidenceError, match="have no state here: give the corpus"):
        retrain(trained_bundle, served, tmp_path / "b", None, encoder, embedding_cache)
    with pytest.raises(RetrainError, match="is the serving bundle"):
        retrain(trained_bundle, served, trained_bundle.directory, labelled[0], encoder, embedding_cache)
    # two into one --out: the calibration and lineage of one could land on the other's training
    with (exclusive(tmp_path / ".c.retrain.lock", RuntimeError),
          pytest.raises(RetrainError, match=rf"another retrain \(pid {os.getpid()}\) is writing")):
        retrain(trained_bundle, served, tmp_path / "c", labelled[0], encoder, embedding_cache)
    assert not (tmp_path / "c").exists()


@pytest.fixture(scope="module")
def weak(trained_bundle: Bundle, served: Path, labelled: tuple[Path, Path], encoder: Encoder,
         embedding_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    """A bundle retrained like ``retrained`` with a head regularised to near-uniform answers."""
    root = tmp_path_factory.mktemp("weak")
    training = trained_bundle.manifest.training.model_copy(update={"C": 1e-6})
    manifest = trained_bundle.manifest.model_copy(update={"training": training})
    parent = Bundle(manifest, trained_bundle.directory).save(root / "parent")
    return retrain(parent, served, root / "weak", labelled[0], encoder, embedding_cache).bundle


def copied(bundle: Bundle, to: Path) -> Path:
    """A bundle's folder copied whole (lineage and evidence too), so a promotion may rewrite it."""
    shutil.copytree(bundle.directory, to)
    return to


def test_a_candidate_that_keeps_clearly_more_is_promoted_with_the_gates_thresholds(
        retrained: RetrainResult, weak: Bundle, served: Path, labelled: tuple[Path, Path], encoder: Encoder,
        embedding_cache: Path, tmp_path: Path) -> None:
    serving = copied(weak, tmp_path / "weak")
    candidate = copied(retrained.bundle, tmp_path / "candidate")
    pointer = tmp_path / "current"
    pointer.write_text(str(serving.resolve()) + "\n", encoding="utf-8")
    with LabelStore.open_existing(served) as store:
        decision = promote(pointer, candidate, store, run=run(embedding_cache), encoder=encoder)
    gate = decision.gate
    assert decision.promoted and gate.rule == RULE and gate.attempt == 1
    assert gate.lower_bound is not None and gate.difference is not None
    assert 0 < gate.lower_bound <= gate.difference
    assert gate.items == len(retrained.lineage["certified_on"]) and set(gate.shares) == set(HEADED)
    evaluated = set(retrained.lineage["evaluated_on"]) - set(weak.split_ids()["train"])
    assert gate.evaluated == len(evaluated) > 0, "the evaluation part is weighed too"
    assert gate.certified_on == "held-out"
    assert decision.reason.startswith(f"promoted: on the same {gate.items} certifying and {gate.evaluated} "
                                      "evaluation held-out items")
    level = certificate_delta(gate.delta, 1)
    assert gate.delta == retrained.bundle.manifest.calibration.delta and gate.certificate_delta == level
    promoted = Bundle.load(candidate).manifest.calibration  # served with the gate's thresholds
    assert promoted.delta == level and promoted.asked_delta == gate.delta
    assert promoted.items == gate.items + gate.evaluated, "certified on both held-out parts"
    assert {facts.delta for row in promoted.questions.values() for facts in row.values()} == {level}
    assert decision.candidate.calibration_version == Bundle.load(candidate).manifest.calibration.version()
    assert decision.candidate.calibration_version != retrained.bundle.manifest.calibration.version()
    named = (pointer.parent / pointer.read_text(encoding="utf-8").strip()).resolve()
    assert named == candidate.resolve()
    assert latest_promotion(promotions_log(pointer)) == decision
    assert decision.serving.name == weak.manifest.name
    # the next retrain asks for the delta the gate was asked for, not the share it spent
    again = retrain(Bundle.load(candidate), served, tmp_path / "again", labelled[0], encoder, embedding_cache)
    assert again.bundle.manifest.calibration.delta == gate.delta > level
    # and the promoted bundle weighed again as a candidate is weighed at that delta too
    other = tmp_path / "other"
    other.write_text(str(copied(weak, tmp_path / "weak-again").resolve()) + "\n", encoding="utf-8")
    with LabelStore.open_existing(served) as store:
        regated = promote(other, candidate, store, run=run(embedding_cache), encoder=encoder)
    assert (regated.gate.delta, regated.gate.certificate_delta) == (gate.delta, level)


def test_a_tie_is_kept_aside_and_each_attempt_spends_less_delta(
        retrained: RetrainResult, served: Path, encoder: Encoder, embedding_cache: Path,
        tmp_path: Path) -> None:
    serving = copied(retrained.bundle, tmp_path / "serving")  # the same heads: every item scores the same
    candidate = copied(retrained.bundle, tmp_path / "candidate")  # renamed: an identical copy is refused
    renamed = retrained.bundle.manifest.model_copy(update={"name": "candidate"})
    Bundle(renamed, candidate).save()
    log = tmp_path / "promotions.jsonl"
    with LabelStore.open_existing(served) as store:
        first, second = (promote(serving, candidate, store, run=run(embedding_cache), encoder=encoder,
                                 log=log) for _ in range(2))
    for attempt, decision in enumerate((first, second), start=1):
        gate = decision.gate
        assert not decision.promoted and decision.reason.startswith("kept aside:")
        assert gate.difference == 0 and gate.lower_bound == 0 and gate.candidate_share == gate.serving_share
        assert gate.attempt == attempt and gate.certificate_delta == certificate_delta(gate.delta, attempt)
    assert second.gate.certificate_delta is not None and first.gate.certificate_delta is not None
    assert second.gate.certificate_delta == pytest.approx(first.gate.certificate_delta / 4)
    assert Bundle.load(candidate).manifest == renamed  # not rewritten when refused
    assert Bundle.load(serving).manifest == retrained.bundle.manifest  # it keeps something: never refreshed
    assert first.refreshed is None and second.refreshed is None
    assert latest_promotion(log) is None


def test_a_folder_promoted_from_a_candidate_refuses_that_candidate_again(
        retrained: RetrainResult, served: Path, tmp_path: Path) -> None:
    """Serving from a folder (a copy of the candidate it promoted), the same candidate again was
    weighed against its own copy: a tie kept aside, an attempt's delta spent, and a
    promotion.json in the bundle serving saying it was not promoted."""
    serving = copied(retrained.bundle, tmp_path / "serving")
    candidate = copied(retrained.bundle, tmp_path / "candidate")
    log = tmp_path / "promotions.jsonl"
    with LabelStore.open_existing(served) as store, \
            pytest.raises(PromoteError, match=r"is the bundle serving already \(a copy of it\)"):
        promote(serving, candidate, store, log=log)
    assert not log.exists()


def test_a_serving_bundle_that_keeps_nothing_serves_the_gates_certificate_when_kept_serving(
        retrained: RetrainResult, served: Path, encoder: Encoder, embedding_cache: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    young = copied(retrained.bundle, tmp_path / "young")  # the same heads, thresholds that keep nothing
    manifest = retrained.bundle.manifest
    bare = {qid: dict.fromkeys(row) for qid, row in manifest.thresholds.items()}
    Bundle(manifest.model_copy(update={"thresholds": bare}), young).save()
    candidate = copied(retrained.bundle, tmp_path / "candidate")
    pointer, log = tmp_path / "current", tmp_path / "current.promotions.jsonl"
    pointer.write_text("young\n", encoding="utf-8")
    status = main(["promote", "--bundle", str(pointer), "--candidate", str(candidate), "--store", str(served),
                   "--cache-dir", str(embedding_cache)])
    assert status == 1 and f"serving now: {tmp_path / 'candidate.serving'}" in capsys.readouterr().out
    [first] = (json.loads(line) for line in log.read_text(encoding="utf-8").splitlines())
    gate = first["gate"]
    assert not first["promoted"] and gate["lower_bound"] == 0 and gate["serving_share"] > 0  # a tie
    assert first["refreshed"] == str(tmp_path / "candidate.serving") and "kept nothing" in first["reason"]
    assert first["previous"] == str(young.resolve())  # logged before the swap, the replaced bundle named
    named = (tmp_path / pointer.read_text(encoding="utf-8").strip()).resolve()
    assert named == (tmp_path / "candidate.serving").resolve()
    refreshed = Bundle.load(named).manifest
    assert refreshed.calibration.delta == gate["certificate_delta"] == certificate_delta(gate["delta"], 1)
    assert refreshed.calibration.asked_delta == gate["delta"] and refreshed.tiers == manifest.tiers
    assert any(t is not None for row in refreshed.thresholds.values() for t in row.values())
    assert Bundle.load(young).manifest.thresholds == bare  # the old folder is left as it was
    with LabelStore.open_existing(served) as store:  # the same bundle: its attempts go on counting
        second = promote(pointer, candidate, store, run=run(embedding_cache), encoder=encoder)
    assert second.gate.attempt == 2 and second.refreshed is None and not second.promoted
    assert (tmp_path / pointer.read_text(encoding="utf-8").strip()).resolve() == named


@pytest.mark.parametrize(("cut", "by_a_gate", "refresh"), [
    (0.999, True, "keeps-more"),  # a gate's thresholds that keep fewer: the gate's fresh ones serve
    (0.999, False, None),  # as few, but calibrate's: they spent all of delta, so they stay
    (0.0, True, None),  # a gate's that keep more: they stay
])
def test_a_serving_bundle_certified_by_a_gate_serves_the_gates_certificate_where_it_keeps_more(
        retrained: RetrainResult, served: Path, encoder: Encoder, embedding_cache: Path, tmp_path: Path,
        cut: float, by_a_gate: bool, refresh: str | None) -> None:
    serving = copied(retrained.bundle, tmp_path / "serving")  # the same heads: a tie, kept aside
    manifest = retrained.bundle.manifest
    asked = manifest.calibration.delta
    moved = {qid: {tier: None if t is None else cut for tier, t in row.items()}
             for qid, row in manifest.thresholds.items()}
    calibration = manifest.calibration.model_copy(update={"asked_delta": asked if by_a_gate else None})
    Bundle(manifest.model_copy(update={"thresholds": moved, "calibration": calibration}), serving).save()
    candidate = copied(retrained.bundle, tmp_path / "candidate")
    pointer = tmp_path / "current"
    pointer.write_text("serving\n", encoding="utf-8")
    with LabelStore.open_existing(served) as store:
        decision = promote(pointer, candidate, store, run=run(embedding_cache), encoder=encoder)
    gate = decision.gate
    assert not decision.promoted and gate.lower_bound == 0 and gate.serving_share > 0
    assert gate.serving_before is not None
    assert (gate.serving_before < gate.serving_share) == (cut > 0.5)  # what the old thresholds keep
    assert decision.refresh == refresh
    named = (tmp_path / pointer.read_text(encoding="utf-8").strip()).resolve()
    if refresh is None:
        assert decision.refreshed is None and named == serving.resolve()
        return
    assert decision.refreshed == str(tmp_path / "candidate.serving") == str(named)
    assert f"keep {gate.serving_before:.1%} of these items" in decision.reason
    refreshed = Bundle.load(named).manifest
    assert refreshed.calibration.delta == gate.certificate_delta == certificate_delta(asked, 1)
    assert refreshed.calibration.asked_delta == asked and refreshed.thresholds != moved


def drifted(item: SyntheticItem, version: str, n: int) -> AuditRecord:
    """An audit of the serving calibration on which its every answer disagrees with the teacher."""
    answers = {qid: SystemAnswer(answer=min(item.labels[qid], key=item.labels[qid].__getitem__),
                                 tier="encoder") for qid in HEADED}
    return record("audit:drift", item, 1000 + n).model_copy(update={"calibration_version": version,
                                                                     "system": answers})


def test_after_a_drift_alarm_the_gate_weighs_and_certifies_only_items_labelled_after_it(
        retrained: RetrainResult, served: Path, labelled: tuple[Path, Path], encoder: Encoder,
        embedding_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serving = copied(retrained.bundle, tmp_path / "serving")
    manifest = retrained.bundle.manifest  # thresholds that keep nothing: kept aside, it is refreshed
    bare = {qid: dict.fromkeys(row) for qid, row in manifest.thresholds.items()}
    Bundle(manifest.model_copy(update={"thresholds": bare}), serving).save()
    store_path = shutil.copy(served, tmp_path / "labels.sqlite")
    items = generate(300, seed=11)
    with LabelStore(store_path, TEACHER) as store:
        for n, item in enumerate(items[:60]):
            store.put_audit(drifted(item, manifest.calibration.version(), n))
        alarms = drift_alarms(manifest, store.audits())
    assert set(alarms) == set(HEADED)
    with (LabelStore.open_existing(store_path) as store,  # nothing after it in the candidate's evidence
          pytest.raises(PromoteError, match=f"drift alarm of {', '.join(sorted(HEADED))}")):
        promote(serving, copied(retrained.bundle, tmp_path / "early"), store, run=run(embedding_cache),
                encoder=encoder, log=tmp_path / "early.jsonl")
    with LabelStore(store_path, TEACHER) as store:  # traffic after the alarm, audited and labelled
        for n, item in enumerate(items[60:]):
            store.put_audit(record("audit:late", item, 2000 + n))
        labelled_at = store.labelled_at()
    after = max(labelled_at[r.item_id] for r in alarms.values())
    out = tmp_path / "later"
    assert main(["retrain", "--bundle", str(serving), "--store", str(store_path),
                 "--corpus", str(labelled[0]), "--out", str(out), "--target-agreement", str(TARGET),
                 "--teacher-items", "0", "--cache-dir", str(embedding_cache)]) == 0
    assert (f"a drift alarm rose on the serving bundle's calibration ({', '.join(sorted(HEADED))}): the "
            "certificate above rests on items labelled before it too") in capsys.readouterr().out
    later = Bundle.load(out)
    lineage = json.loads((out / "lineage.json").read_text(encoding="utf-8"))
    twin = copied(later, tmp_path / "twin")  # the candidate's heads under the alarmed calibration
    Bundle(later.manifest.model_copy(update={"thresholds": bare, "calibration": manifest.calibration}),
           twin).save()
    for bundle, promoted in ((serving, True), (twin, False)):  # better, or a tie: refreshed
        with LabelStore.open_existing(store_path) as store:
            decision = promote(bundle, copied(later, tmp_path / f"later-{promoted}"), store,
                               run=run(embedding_cache), encoder=encoder, log=tmp_path / f"{promoted}.jsonl")
        gate, trained = decision.gate, set(Bundle.load(bundle).split_ids()["train"])
        held = [i for part in ("certified_on", "evaluated_on") for i in lineage[part] if i not in trained]
        late = [i for i in held if labelled_at[i] > after]
        assert 0 < gate.items + gate.evaluated == len(late) and gate.set_aside == len(held) - len(late) > 0
        assert gate.evidence_after is not None
        assert datetime.fromisoformat(gate.evidence_after).timestamp() == pytest.approx(after, abs=1e-5)
        assert f"labelled after the drift alarm of {gate.evidence_after}" in decision.reason
        assert decision.promoted == promoted and decision.refresh == (None if promoted else "kept-nothing")
        swapped = Path(decision.refreshed or tmp_path / f"later-{promoted}")
        assert Bundle.load(swapped).manifest.calibration.evidence_after == gate.evidence_after
    # a bundle so certified keeps its gates to that start, though no alarm rose on it
    swapped_manifest = Bundle.load(swapped).manifest
    ahead = swapped_manifest.calibration.model_copy(update={"evidence_after": "2100-01-01T00:00:00+00:00"})
    Bundle.load(Bundle(swapped_manifest.model_copy(update={"calibration": ahead}), swapped).save().directory)
    with (LabelStore.open_existing(store_path) as store,
          pytest.raises(PromoteError, match="rests on items labelled after an earlier drift alarm")):
        promote(swapped, copied(retrained.bundle, tmp_path / "again"), store, run=run(embedding_cache),
                encoder=encoder, log=tmp_path / "again.jsonl")


def test_a_candidate_from_before_evaluation_ids_were_recorded_is_gated_on_its_certifying_items(
        retrained: RetrainResult, weak: Bundle, served: Path, encoder: Encoder, embedding_cache: Path,
        tmp_path: Path) -> None:
    candidate = copied(retrained.bundle, tmp_path / "candidate")
    lineage = json.loads((candidate / "lineage.json").read_text(encoding="utf-8"))
    del lineage["evaluated_on"]
    (candidate / "lineage.json").write_text(json.dumps(lineage), encoding="utf-8")
    with LabelStore.open_existing(served) as store:
        older = promote(copied(weak, tmp_path / "weak"), candidate, store, run=run(embedding_cache),
                        encoder=encoder, log=tmp_path / "promotions.jsonl").gate
    with LabelStore.open_existing(served) as store:
        newer = promote(copied(weak, tmp_path / "weak2"), copied(retrained.bundle, tmp_path / "candidate2"),
                        store, run=run(embedding_cache), encoder=encoder, log=tmp_path / "p2.jsonl").gate
    assert older.evaluated == 0 < newer.evaluated and older.items == newer.items
    assert older.band is not None and newer.band is not None
    assert older.band[-1] > newer.band[-1], "certified on more items, the band's top asks less of them"
    assert older.candidate_plugin != newer.candidate_plugin, "the rule's shares are over more items"


def test_a_candidate_that_certifies_less_is_kept_aside_with_the_reason(
        trained_bundle: Bundle, weak: Bundle, served: Path, embedding_cache: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    candidate = copied(weak, tmp_path / "weak")
    serving = Bundle(trained_bundle.manifest, trained_bundle.directory).save(tmp_path / "serving")
    log = tmp_path / "promotions.jsonl"
    status = main(["promote", "--bundle", str(serving.directory), "--candidate", str(candidate),
                   "--store", str(served), "--log", str(log), "--cache-dir", str(embedding_cache)])
    assert status == 1
    printed = capsys.readouterr().out
    assert f"rule: {RULE} at one-sided level" in printed and "lower bound" in printed
    [line] = log.read_text(encoding="utf-8").splitlines()
    decision = json.loads(line)
    assert not decision["promoted"] and decision["reason"].startswith("kept aside:")
    assert decision["gate"]["rule"] == RULE and decision["gate"]["lower_bound"] < 0
    assert decision["gate"]["candidate_plugin"] < decision["gate"]["serving_plugin"]
    gate = decision["gate"]
    certified = f"certified on the {gate['items']} certifying and {gate['evaluated']} evaluation held-out"
    assert certified in printed and gate["certified_on"] == "held-out"
    kept = json.loads((candidate / "promotion.json").read_text(encoding="utf-8"))
    assert kept["reason"] == decision["reason"]
    assert Bundle.load(serving.directory).manifest.name == trained_bundle.manifest.name  # untouched
    assert latest_promotion(log) is None


def test_promote_refuses_a_bundle_retrain_did_not_make(trained_bundle: Bundle, served: Path,
                                                        tmp_path: Path) -> None:
    copy = Bundle(trained_bundle.manifest, trained_bundle.directory).save(tmp_path / "copy")
    with (LabelStore.open_existing(served) as store,
          pytest.raises(PromoteError, match=r"has no lineage.json and no evidence.jsonl: .*cascade retrain")):
        promote(trained_bundle.directory, copy.directory, store)


@pytest.mark.parametrize("damage", ["lineage not JSON", "lineage a list", "evidence not JSON",
                                    "evidence cut"])
def test_promote_refuses_a_damaged_candidate_in_one_line(retrained: RetrainResult, served: Path, damage: str,
                                                         tmp_path: Path) -> None:
    """Each was a traceback (JSONDecodeError, AttributeError), or advice (--on-error skip, give
    the corpus) that promote does not take."""
    serving = copied(retrained.bundle, tmp_path / "serving")
    candidate = copied(retrained.bundle, tmp_path / "candidate")
    first = (candidate / "evidence.jsonl").read_text(encoding="utf-8").splitlines()[0] + "\n"
    name, content = {"lineage not JSON": ("lineage.json", "{\"certified_on\": [\"a\""),
                     "lineage a list": ("lineage.json", "[]"),
                     "evidence not JSON": ("evidence.jsonl", "{not json\n"),
                     "evidence cut": ("evidence.jsonl", first)}[damage]
    (candidate / name).write_text(content, encoding="utf-8")
    why = r"is damaged \(not the lineage" if name == "lineage.json" else \
        r"evidence.jsonl is damaged: \d+ of the items it was certified on are not in it .*retrain it$" \
        if damage == "evidence cut" else "evidence.jsonl is damaged: .*retrain it$"
    with LabelStore.open_existing(served) as store, pytest.raises(PromoteError, match=why):
        promote(serving, candidate, store)


def test_the_command_retrains_through_a_link_and_says_what_comes_next(
        trained_bundle: Bundle, served: Path, labelled: tuple[Path, Path], embedding_cache: Path,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "support"
    link.symlink_to(trained_bundle.directory.resolve(), target_is_directory=True)
    out = tmp_path / "support-r2"
    assert main(["retrain", "--bundle", str(link), "--store", str(served), "--corpus", str(labelled[0]),
                 "--out", str(out), "--target-agreement", str(TARGET), "--teacher-items", "0",
                 "--cache-dir", str(embedding_cache), "--calibrate-on", "traffic"]) == 0
    printed = capsys.readouterr().out
    assert ("evidence: 450 labelled states (120 audit, 20 census escalation, 300 corpus, 10 escalation); "
            "40 repeats") in printed
    assert f"next: cascade promote --bundle {link} --candidate {out}" in printed
    assert "drift alarm" not in printed
    lineage = json.loads((out / "lineage.json").read_text(encoding="utf-8"))
    assert lineage["calibrate_on"] == "traffic"
    certified_on = lineage["certified_on"]  # traffic: audits and census escalations, never the corpus
    assert all(i.startswith("audit:") or i.startswith("escalation:r2.") for i in certified_on)
    assert {i.split(":")[0] for i in certified_on} == {"audit", "escalation"}
    with LabelStore.open_existing(served) as store:  # the census escalations were all drawn at 1
        thinned = sum(r.inclusion == 0.25 for r in store.audits() if r.item_id in certified_on)
    assert thinned > 0 and lineage["evidence"]["certified_on_unequal"] == {
        "audit": {"items": thinned, "lowest": 0.25, "highest": 0.5}}
    assert (f"drawn unequally: {thinned} audit drawn at 0.25-0.5 (a queue that dropped at random under "
            "load") in printed


def test_collected_traffic_counts_as_collected_and_each_state_once(tmp_path: Path) -> None:
    from cascade.collect.record import CollectedItem
    from cascade.teachers.identity import EndpointIdentity
    from distill.loop.collected import item_id
    from distill.loop.evidence import gather

    question = {"type": "noul", "instructions": "Is this urgent?"}
    answer = {"true": 0.9, "false": 0.1}
    with LabelStore(tmp_path / "s.sqlite", TEACHER) as store:
        for n, text in enumerate(["help now", "help now", "lunch?"]):
            store.put_traffic(CollectedItem(request_id=f"r{n}", state=text, questions={"urgent": question},
                                            answers={"urgent": answer}, identity=EndpointIdentity(),
                                            at=START))
            store.put_many({item_id(state_sha256(text)): {"urgent": answer}})
        store.put_audit(AuditRecord(item_id="audit:r:1", state="lunch?", calibration_version="v0", at=START,
                                    teacher={"urgent": answer}))
        evidence = gather(store, {"urgent": QUESTIONS["urgent"]}, None)
    assert [item.origin for item in evidence.items] == ["audit", "collected"]  # records first, then traffic
    assert evidence.duplicates == 1  # "lunch?" audited and collected: one item
