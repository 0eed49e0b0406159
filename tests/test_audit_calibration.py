"""Calibrating on what the audit saw (``cascade calibrate --calibrate-on traffic|all``).

The session's trained bundle and its label store; the audits are written by the test into a copy
of the store, as ``LabelStore.put_audit`` writes them: each a corpus item of the calibration part
audited again (its state, the teacher's stored answer to every question), so that a calibration
on the audits must certify exactly what one on the calibration part does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from corpora import HEADED, copy_bundle, read_jsonl

from cascade.audit.record import AuditRecord
from cascade.bundle.manifest import Bundle
from cascade.encoder.onnx_encoder import Encoder
from distill.calibration.maths import CalibrationError
from distill.calibration.options import CalibrationOptions
from distill.calibration.results import CalibrationResult
from distill.calibration.run import calibrate_bundle
from distill.cli import main
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore

TARGET = 0.85
FLOPS = 1e11
START = 1_800_000_000.0
"""When the first audit was made (Unix seconds); one more second per audit."""


@pytest.fixture(scope="module")
def audited_store(trained_bundle: Bundle, labelled: tuple[Path, Path],
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's store holding every calibration item audited again, in corpus order."""
    corpus, store_path = labelled
    path = tmp_path_factory.mktemp("audited") / "labels.sqlite"
    shutil.copy(store_path, path)
    wanted = set(trained_bundle.split_ids()["calibration"])
    rows = [row for row in read_jsonl(corpus) if row["id"] in wanted]
    with LabelStore.open_existing(path) as existing:
        teacher_id = existing.teacher
    with LabelStore(path, teacher_id) as store:
        stored = {qid: store.labels(qid) for qid in HEADED}
        for n, row in enumerate(rows):
            teacher = {qid: stored[qid][row["id"]] for qid in HEADED if row["id"] in stored[qid]}
            store.put_audit(AuditRecord(item_id=f"audit:{row['id']}", state=row["text"],
                                        calibration_version="v0", at=START + n, teacher=teacher))
    return path


def calibrate(bundle: Bundle, corpus: Path | None, store_path: Path, encoder: Encoder,
              **options: Any) -> CalibrationResult:
    with LabelStore.open_existing(store_path) as store:
        return calibrate_bundle(bundle, None if corpus is None else CorpusInput(corpus), store,
                                CalibrationOptions(target=TARGET, teacher_items=0, **options),
                                encoder=encoder, run=RunOptions(progress=False, flops_per_second=FLOPS))


def test_the_audits_certify_what_the_same_items_certify_from_the_corpus(
    trained_bundle: Bundle, labelled: tuple[Path, Path], audited_store: Path, encoder: Encoder,
    tmp_path: Path
) -> None:
    part = calibrate(copy_bundle(trained_bundle, tmp_path / "part"), labelled[0], audited_store, encoder)
    bundle = copy_bundle(trained_bundle, tmp_path / "audit")
    audit = calibrate(bundle, None, audited_store, encoder, source="audit")
    assert (audit.source, audit.items) == ("audit", part.items)
    assert audit.audits is not None and audit.audits.items == part.items
    for qid in HEADED:
        [ours] = [f for f in audit.calibrations if f.question == qid]
        [theirs] = [f for f in part.calibrations if f.question == qid]
        assert (ours.n, ours.threshold, ours.kept_share, ours.agreement) == \
            (theirs.n, theirs.threshold, theirs.kept_share, theirs.agreement)
    section = Bundle.load(bundle.directory).manifest.calibration
    assert section.source == "audit" and section.audits == audit.audits
    assert section.version() != Bundle.load(tmp_path / "part").manifest.calibration.version()


def test_both_pools_the_part_and_the_audits_and_since_keeps_the_recent_ones(
    trained_bundle: Bundle, labelled: tuple[Path, Path], audited_store: Path, encoder: Encoder,
    tmp_path: Path
) -> None:
    both = calibrate(copy_bundle(trained_bundle, tmp_path / "both"), labelled[0], audited_store, encoder,
                     source="both")
    assert both.audits is not None and both.items == 2 * both.audits.items
    half = both.audits.items // 2
    recent = calibrate(copy_bundle(trained_bundle, tmp_path / "recent"), None, audited_store, encoder,
                       source="audit", audits_since=START + half)
    assert recent.audits is not None and recent.items == recent.audits.items == both.audits.items - half
    assert recent.audits.first == "2027-01-15T08:" + f"{half // 60:02d}:{half % 60:02d}+00:00"


def test_calibrating_on_audits_that_are_not_there_says_what_to_do(
    trained_bundle: Bundle, labelled: tuple[Path, Path], audited_store: Path, encoder: Encoder,
    tmp_path: Path
) -> None:
    with pytest.raises(CalibrationError, match="holds no audited items; audit live traffic first"):
        calibrate(copy_bundle(trained_bundle, tmp_path / "none"), None, labelled[1], encoder,
                  source="audit")
    with pytest.raises(CalibrationError, match="no audited items at or after 2027"):
        calibrate(copy_bundle(trained_bundle, tmp_path / "late"), None, audited_store, encoder,
                  source="audit", audits_since=START + 10**6)
    with pytest.raises(CalibrationError, match=r"give it \(--corpus\)"):
        calibrate(copy_bundle(trained_bundle, tmp_path / "corpus"), None, audited_store, encoder,
                  source="both")


def test_cascade_calibrate_on_the_audit_needs_no_corpus_and_says_what_it_certified(
    trained_bundle: Bundle, audited_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = copy_bundle(trained_bundle, tmp_path / "cli")
    args = ["calibrate", "--bundle", str(bundle.directory), "--store", str(audited_store),
            "--calibrate-on", "traffic", "--audits-since", "2027-01-15T08:00:05", "--teacher-items", "0",
            "--target-agreement", str(TARGET), "--report", str(tmp_path / "report")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "certified on new items from the traffic the audit sampled (" in out
    assert "items audited from 2027-01-15T08:00:05+00:00 to" in out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["source"] == "audit" and "the traffic the audit sampled" in report["guarantee"]
    with pytest.raises(SystemExit):
        main([*args[:-2], "--audits-since", "yesterday", "--report", str(tmp_path / "r2")])
    assert "not an ISO 8601 time: 'yesterday'" in capsys.readouterr().err
