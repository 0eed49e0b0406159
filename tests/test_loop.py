"""The loop as one command (``cascade loop``): counting new teacher labels, retraining and promoting
once N are new, the decision log, the state a restart resumes from, and the lock.

The serving path is a link to a copy of the session's bundle, as ``cascade serve --bundle`` follows
one; its store is a copy of the session's (corpus labels only), to which the tests add audits and
escalations as serving would. One real retrain in the whole file (the ``looped`` fixture).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
from contextlib import ExitStack, redirect_stdout
from pathlib import Path
from urllib.parse import urlsplit

import pgserver
import pytest
from corpora import HEADED, TEACHER, copy_bundle, corpus_items
from servers import until

from cascade.audit.record import AuditRecord
from cascade.bundle.manifest import Bundle
from cascade.collect.escalation import EscalationRecord
from distill.cli import main
from distill.demo.synthetic import SyntheticItem, generate
from distill.loop.promotions import promotions_log
from distill.loop.watch import VERSION, LoopBusyError, LoopPaths, LoopState, Pending, _lock_served, loop_lock
from distill.store import LabelStore

pytest_plugins = ("pgfixtures",)  # halting_postgres
TARGET = 0.85
START = 1_800_000_000.0
EVERY = 100


def audit(prefix: str, item: SyntheticItem, n: int) -> AuditRecord:
    return AuditRecord(item_id=f"{prefix}:{item.id}", state=item.text, calibration_version="v0", at=START + n,
                       teacher={qid: item.labels[qid] for qid in HEADED})


def escalation(item: SyntheticItem, n: int) -> EscalationRecord:
    return EscalationRecord(item_id=f"escalation:r2.{item.id}", request_id=item.id, state=item.text,
                            calibration_version="v0", at=START + n,
                            teacher={q: item.labels[q] for q in HEADED})


def setup(trained_bundle: Bundle, labelled: tuple[Path, Path], root: Path) -> tuple[Path, Path]:
    """(serving link, store): the link names a copy of the session's bundle; the store holds the
    corpus labels and 40 audits of corpus states, fewer than EVERY."""
    copy_bundle(trained_bundle, root / "support-v1")
    link = root / "support"
    link.symlink_to("support-v1", target_is_directory=True)
    store = root / "labels.sqlite"
    shutil.copy(labelled[1], store)
    with LabelStore(store, TEACHER) as writer:
        for n, item in enumerate(corpus_items()[:40]):
            writer.put_audit(audit("audit:r1", item, n))
    return link, store


def loop(link: Path, store: Path, corpus: Path, cache: Path) -> int:
    return main(["loop", "--bundle", str(link), "--store", str(store), "--corpus", str(corpus),
                 "--every", str(EVERY), "--once", "--target-agreement", str(TARGET), "--teacher-items", "0",
                 "--cache-dir", str(cache)])


def candidates(paths: LoopPaths) -> list[str]:
    """The candidate folders the loop made (not a serving bundle's refreshed copy, CANDIDATE.serving)."""
    return sorted(p.name for p in paths.versions.glob("v-*") if VERSION.fullmatch(p.name))


def log_lines(link: Path) -> list[dict]:
    path = LoopPaths(link).log
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def looped(trained_bundle: Bundle, labelled: tuple[Path, Path], embedding_cache: Path,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """The loop run twice with --once: first on 40 new labels (too few), then on 170 (120 more
    audits and 10 escalations): (link, store, what each run printed)."""
    link, store = setup(trained_bundle, labelled, tmp_path_factory.mktemp("loop"))
    printed = []
    for serving in (False, True):
        if serving:
            with LabelStore(store, TEACHER) as writer:
                for n, item in enumerate(generate(130, seed=5)):
                    if n < 120:
                        writer.put_audit(audit("audit:r2", item, 100 + n))
                    else:
                        writer.put_escalation(escalation(item, 100 + n))
        out = io.StringIO()
        with redirect_stdout(out):  # capsys is per test; this fixture is the module's
            assert loop(link, store, labelled[0], embedding_cache) == 0
        printed.append(out.getvalue())
    return link, store, printed


def test_too_few_new_labels_does_nothing_and_says_so(looped: tuple[Path, Path, list[str]]) -> None:
    printed = looped[2]
    assert ("40 new teacher labels since the last retrain (40 audits, 0 escalations, 0 collected); "
            f"retrains at {EVERY}") in printed[0]
    assert "attempt" not in printed[0]


def test_n_new_labels_retrain_promote_and_log_one_decision(looped: tuple[Path, Path, list[str]]) -> None:
    link, _, printed = looped
    paths = LoopPaths(link)
    [decision] = log_lines(link)
    candidate = paths.versions / "v-0001"
    assert decision["candidate"] == str(candidate) and decision["attempt"] == 1
    assert decision["seen"] == {"audits": 160, "escalations": 10, "collected": 0} and decision["new"] == 170
    [gate] = [json.loads(line) for line in promotions_log(link).read_text(encoding="utf-8").splitlines()]
    assert gate["candidate"]["path"] == str(candidate.resolve())
    assert decision["outcome"] == ("promoted" if gate["promoted"] else "kept aside")
    assert decision["reason"] == gate["reason"]
    assert (link.resolve() == candidate.resolve()) == gate["promoted"]
    # a serving bundle whose thresholds keep nothing (this one) serves the gate's for it when kept
    thresholds = Bundle.load(paths.versions.parent / "support-v1").manifest.thresholds
    young = all(t is None for row in thresholds.values() for t in row.values())
    refresh = young and not gate["promoted"] and gate["gate"]["serving_share"] > 0
    assert gate["refreshed"] == (str(paths.versions / "v-0001.serving") if refresh else None)
    assert (link.resolve() == (paths.versions / "v-0001.serving").resolve()) == refresh
    assert f"attempt 1: 170 new teacher labels (160 audits, 10 escalations, 0 collected); {candidate}: " \
        f"{decision['outcome']}" in printed[1]
    state = LoopState.model_validate_json(paths.state.read_text(encoding="utf-8"))
    assert state == LoopState(mark=170, attempts=1, pending=None)


def test_a_restart_past_the_mark_does_not_retrain_on_the_same_labels(
        looped: tuple[Path, Path, list[str]], labelled: tuple[Path, Path], embedding_cache: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    link, store, _ = looped
    assert loop(link, store, labelled[0], embedding_cache) == 0
    assert "0 new teacher labels since the last retrain" in capsys.readouterr().out
    assert candidates(LoopPaths(link)) == ["v-0001"]
    assert len(log_lines(link)) == 1


def test_a_loop_killed_after_the_gate_decided_takes_its_decision_without_retraining(
        looped: tuple[Path, Path, list[str]], labelled: tuple[Path, Path], embedding_cache: Path) -> None:
    """The state a kill between the gate's log line and the loop's leaves: the candidate pending,
    the mark where it was."""
    link, store, _ = looped
    paths = LoopPaths(link)
    before = paths.state.read_text(encoding="utf-8")
    [decided] = log_lines(link)
    seen = decided["seen"]
    paths.state.write_text(LoopState(mark=0, attempts=1, pending=Pending(candidate=decided["candidate"],
                                                                         seen=seen)).model_dump_json())
    assert loop(link, store, labelled[0], embedding_cache) == 0
    recovered = log_lines(link)[-1]
    assert recovered["outcome"] == decided["outcome"] and recovered["reason"] == decided["reason"]
    assert candidates(paths) == ["v-0001"]  # taken, not retrained
    assert paths.state.read_text(encoding="utf-8").strip() == before.strip()


def test_a_half_made_candidate_is_removed_never_promoted(trained_bundle: Bundle, labelled: tuple[Path, Path],
                                                         embedding_cache: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    link, store = setup(trained_bundle, labelled, tmp_path)
    paths = LoopPaths(link)
    half = paths.versions / "v-0001"
    copy_bundle(trained_bundle, half)  # trained, killed before its evidence and lineage were written
    (paths.versions / ".v-0001.training-x1").mkdir()  # and a staging folder of a killed training
    (paths.versions / "v-0001.serving").mkdir()  # and a refreshed copy its gate began, never swapped in
    seen = {"audits": 40, "escalations": 0, "collected": 0}
    paths.state.write_text(LoopState(mark=40, attempts=1, pending=Pending(candidate=str(half), seen=seen))
                           .model_dump_json())
    assert loop(link, store, labelled[0], embedding_cache) == 0
    [decision] = log_lines(link)
    assert decision["outcome"] == "discarded" and decision["candidate"] == str(half)
    assert not list(paths.versions.glob("*v-0001*")) and link.resolve() == (tmp_path / "support-v1").resolve()
    assert not promotions_log(link).exists()
    assert "0 new teacher labels since the last retrain" in capsys.readouterr().out
    state = LoopState.model_validate_json(paths.state.read_text(encoding="utf-8"))
    assert state == LoopState(mark=40, attempts=1, pending=None)


def test_a_second_loop_on_the_same_path_is_refused_with_one_line(
        trained_bundle: Bundle, labelled: tuple[Path, Path], embedding_cache: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    link, store = setup(trained_bundle, labelled, tmp_path)
    with loop_lock(LoopPaths(link)):  # a loop watching PATH in this process
        assert loop(link, store, labelled[0], embedding_cache) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("LoopBusyError: another `cascade loop` (pid ")
    assert f"holds {LoopPaths(link).lock}" in err[0]
    assert not LoopPaths(link).log.exists() and not LoopPaths(link).state.exists()
    # a loop on the folder the link names: each held its own lock and both retrained one bundle
    folder = link.resolve()
    with loop_lock(LoopPaths(folder)):
        assert loop(link, store, labelled[0], embedding_cache) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"holds {LoopPaths(folder).lock}" in err[0], err
    with ExitStack() as stack:  # and the other way round: the link's loop holds the folder's lock
        assert _lock_served(link, stack, None) == folder
        with pytest.raises(LoopBusyError, match="another `cascade loop`"), loop_lock(LoopPaths(folder)):
            pass


def test_a_loop_rides_out_its_postgresql_store_restarting(
        trained_bundle: Bundle, labelled: tuple[Path, Path], embedding_cache: Path, tmp_path: Path,
        halting_postgres: pgserver.Server) -> None:
    """`cascade loop` is a daemon: its store's PostgreSQL server halting (for real) is said in one
    line, without the password, and looked at again at the next poll; once it is back the loop
    counts again, still running. (Before, the first poll that met the outage ended the loop.)"""
    copy_bundle(trained_bundle, tmp_path / "support-v1")
    link, url = tmp_path / "support", halting_postgres.url
    link.symlink_to("support-v1", target_is_directory=True)
    with LabelStore(url, TEACHER) as writer:
        for n, item in enumerate(corpus_items()[:40]):
            writer.put_audit(audit("audit:r1", item, n))
    command = [sys.executable, "-m", "distill.cli", "loop", "--bundle", str(link), "--store", url, "--corpus",
               str(labelled[0]), "--every", str(EVERY), "--poll", "0.2", "--target-agreement", str(TARGET),
               "--teacher-items", "0", "--cache-dir", str(embedding_cache)]
    lines: list[str] = []
    counted = lambda since: any("new teacher labels" in line for line in lines[since:])  # noqa: E731
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"}) as process:
        assert process.stdout is not None
        threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True).start()
        try:
            until(lambda: counted(0), "the loop counting the store's labels", 300)
            halting_postgres.halt()
            until(lambda: any("the store is unavailable" in line for line in lines), "the outage said")
            halting_postgres.resume()
            back = len(lines)
            until(lambda: counted(back), "the loop counting again once the store is back")
            assert process.poll() is None
        finally:
            process.terminate()
    password = urlsplit(url).password
    assert password and not any(password in line for line in lines)
