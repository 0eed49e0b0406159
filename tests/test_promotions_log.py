"""A promotion made to stick (``distill.loop.promotions``): the decision logged ahead of its swap and
finished by the next run where a kill cut it short, one promotion of a serving path at a time, a
torn log line, a folder swap cut between its renames, and the loop's checks before it writes
anything.

The kills are raised at the point named (the process dying there leaves the same files); the
bundles are copies of the session's, told apart by their names (so by their manifests' hashes).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from corpora import copy_bundle
from test_loop import EVERY, TARGET, setup

from cascade.bundle.manifest import Bundle
from distill.cli import main
from distill.loop import promotions
from distill.loop.promotions import (
    BundleVersion,
    Gate,
    Promotion,
    PromotionBusyError,
    PromotionsLogError,
    carry_out,
    latest_promotion,
    promoting,
    promotions_log,
    records,
)
from distill.loop.watch import LoopPaths, LoopState


class Killed(BaseException):
    """The process dying at this point."""


def named(bundle: Bundle, directory: Path, name: str) -> Bundle:
    return Bundle(bundle.manifest.model_copy(update={"name": name}), bundle.directory).save(directory)


def decision(serving: Bundle, candidate: Bundle, promoted: bool = True, at: str = "2026-12-07T12:00:00+00:00"
             ) -> Promotion:
    gate = Gate(target=TARGET, delta=0.05, certificate="split", items=300, excluded=0, serving_share=0.5,
                candidate_share=0.6, shares={})
    return Promotion(at=at, promoted=promoted, serving=BundleVersion.of(serving),
                     candidate=BundleVersion.of(candidate), gate=gate, reason="promoted: a test's")


@pytest.fixture
def two(trained_bundle: Bundle, tmp_path: Path) -> tuple[Path, Bundle, Bundle]:
    """(serving link -> v1, v1, v2)."""
    v1, v2 = named(trained_bundle, tmp_path / "v1", "v1"), named(trained_bundle, tmp_path / "v2", "v2")
    (tmp_path / "support").symlink_to("v1", target_is_directory=True)
    return tmp_path / "support", v1, v2


@pytest.mark.parametrize("killed_in", ["_append", "_serve"])
def test_a_decision_cut_short_is_finished_by_the_next_promotion(
        two: tuple[Path, Bundle, Bundle], killed_in: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the swap came first and the line after: killed between them, the promotion was
    served but never logged, and could not be logged again."""
    link, v1, v2 = two
    record, log = decision(v1, v2), promotions_log(link)

    def kill(*args: object) -> None:
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(promotions, killed_in, kill)
        with pytest.raises(Killed), promoting(link):
            carry_out(link, log, record)
    assert link.resolve() == v1.directory.resolve()
    assert len(records(log)) == (1 if killed_in == "_serve" else 0)
    with promoting(link) as finished:
        assert finished == record
    assert link.resolve() == v2.directory.resolve()
    assert records(log) == [record] and latest_promotion(log) == record
    assert not list(link.parent.glob("*.pending.json"))
    with promoting(link) as finished:
        assert finished is None


def test_a_promotion_undone_by_hand_is_never_redone(two: tuple[Path, Bundle, Bundle], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither a finished promotion rolled back by hand, nor one cut short before its swap where
    PATH was changed by hand since (to v3): the next promotion finishes the log, not the swap."""
    link, v1, v2 = two
    with promoting(link):
        carry_out(link, promotions_log(link), decision(v1, v2))
    assert link.resolve() == v2.directory.resolve()
    link.unlink()
    link.symlink_to("v1", target_is_directory=True)  # a rollback by hand
    with promoting(link) as finished:
        assert finished is None
    assert link.resolve() == v1.directory.resolve()

    def kill(*args: object) -> None:
        raise Killed

    again = decision(v1, v2, at="2026-12-07T13:00:00+00:00")
    with monkeypatch.context() as patched:
        patched.setattr(promotions, "_serve", kill)
        with pytest.raises(Killed), promoting(link):
            carry_out(link, promotions_log(link), again)
    named(v1, tmp_path / "v3", "v3")
    link.unlink()
    link.symlink_to("v3", target_is_directory=True)
    with promoting(link) as finished:
        assert finished == again
    assert link.resolve() == (tmp_path / "v3").resolve()


def test_a_swap_onto_a_path_changed_under_the_gate_is_refused_unlogged(two: tuple[Path, Bundle, Bundle],
                                                                       tmp_path: Path) -> None:
    link, v1, v2 = two
    v3 = named(v1, tmp_path / "v3", "v3")
    link.unlink()
    link.symlink_to("v3", target_is_directory=True)
    with pytest.raises(PromotionBusyError, match="changed while the gate weighed"), promoting(link):
        carry_out(link, promotions_log(link), decision(v1, v2))
    assert link.resolve() == v3.directory.resolve() and not promotions_log(link).exists()


def test_a_torn_last_line_is_not_a_decision_and_is_cut_before_the_next(
        two: tuple[Path, Bundle, Bundle]) -> None:
    """A kill or a full disk mid-line left a line with no newline: `cascade promote` and every
    restart of `cascade loop` then died on a pydantic traceback."""
    link, v1, v2 = two
    log = promotions_log(link)
    kept = decision(v1, v2, promoted=False)
    torn = decision(v1, v2).model_dump_json()[:-200]
    log.write_text(kept.model_dump_json() + "\n" + torn, encoding="utf-8")
    assert records(log) == [kept] and latest_promotion(log) is None
    with promoting(link):
        carry_out(link, log, decision(v1, v2, at="2026-12-07T13:00:00+00:00"))
    lines = log.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and [r.promoted for r in records(log)] == [False, True]
    assert oct(log.stat().st_mode & 0o777) in ("0o600", "0o644")  # an existing log keeps its mode


def test_a_damaged_line_inside_the_log_is_refused_naming_it(two: tuple[Path, Bundle, Bundle], labelled:
                                                             tuple[Path, Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    link, v1, v2 = two
    log = promotions_log(link)
    log.write_text("{\"at\": 1}\n" + decision(v1, v2).model_dump_json() + "\n", encoding="utf-8")
    with pytest.raises(PromotionsLogError, match=f"line 1 of {log} is not a promotion record"):
        records(log)
    assert main(["promote", "--bundle", str(link), "--candidate", str(v2.directory), "--store",
                 str(labelled[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("PromotionsLogError: line 1 of ")


def test_a_promotion_beside_another_is_refused_in_one_line(two: tuple[Path, Bundle, Bundle],
                                                           labelled: tuple[Path, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-run `cascade promote` while the loop's gate ran was swapped in, then replaced by the
    loop's candidate, which was never weighed against it."""
    link, _, v2 = two
    with promoting(link):  # the loop's gate, running
        assert main(["promote", "--bundle", str(link), "--candidate", str(v2.directory), "--store",
                     str(labelled[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"PromotionBusyError: another promotion of {link} is running "
                                               f"(pid {os.getpid()}")
    assert link.resolve() == two[1].directory.resolve() and not promotions_log(link).exists()


def loop_once(link: Path, store: Path, *more: str) -> int:
    return main(["loop", "--bundle", str(link), "--store", str(store), "--every", str(EVERY), "--once",
                 "--target-agreement", str(TARGET), *more])


def test_a_folder_swap_killed_between_its_renames_is_put_back(trained_bundle: Bundle,
                                                              labelled: tuple[Path, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Serving from a folder, a kill between ``staged``'s two renames left no bundle at PATH (the old
    one moved aside), and every later attempt failed with "no bundle at"."""
    link, store = setup(trained_bundle, labelled, tmp_path)
    link.unlink()
    folder = copy_bundle(trained_bundle, tmp_path / "support").directory
    aside = tmp_path / ".support.training-k1ll-old"
    os.replace(folder, aside)
    shutil.copytree(aside, tmp_path / ".support.training-k1ll")  # the new one, staged, never renamed in
    assert loop_once(folder, store) == 0
    assert "40 new teacher labels since the last retrain" in capsys.readouterr().out
    assert Bundle.load(folder).manifest == trained_bundle.manifest and not aside.exists()


def test_a_mistyped_bundle_is_refused_before_anything_is_written(labelled: tuple[Path, Path], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert loop_once(tmp_path / "typo" / "support", labelled[1]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "takes the path `cascade serve --bundle` serves" in err[0]
    assert not (tmp_path / "typo").exists()


def test_now_tries_again_at_once_what_failed(trained_bundle: Bundle, labelled: tuple[Path, Path],
                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed attempt (no --corpus for a store of corpus labels) moved the mark, so the command
    fixed waited for N more labels, with nothing to say how to try at once."""
    link, store = setup(trained_bundle, labelled, tmp_path)
    LoopPaths(link).state.write_text(LoopState(mark=40, attempts=0).model_dump_json(), encoding="utf-8")
    assert loop_once(link, store) == 0
    assert "0 new teacher labels since the last retrain" in capsys.readouterr().out
    assert loop_once(link, store, "--now") == 1
    said = capsys.readouterr().out
    assert "attempt 1: 0 new teacher labels" in said and "failed: " in said
    assert f"tried again after {EVERY} more teacher labels, or at once by a loop run with --now" in said


def test_a_whole_last_record_without_its_newline_is_kept(two: tuple[Path, Bundle, Bundle]) -> None:
    """Counted as a decision when read, yet cut as torn by the next append: a hand edit that
    dropped the last newline lost a promotion and lowered the attempt count."""
    link, v1, v2 = two
    log = promotions_log(link)
    first = decision(v1, v2, promoted=False)
    log.write_text(first.model_dump_json(), encoding="utf-8")
    with promoting(link):
        carry_out(link, log, decision(v1, v2, at="2026-12-07T13:00:00+00:00"))
    assert [r.promoted for r in records(log)] == [False, True]


def test_a_log_that_cannot_be_written_is_refused_before_the_gate(
        two: tuple[Path, Bundle, Bundle], labelled: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A --log under a file failed after the pending file named it (relative), and every later
    promote and loop then failed finishing it, or finished it into another folder's file."""
    link, _, v2 = two
    (tmp_path / "afile").write_text("x")
    for log in (tmp_path / "afile" / "log.jsonl", tmp_path, Path("/dev/full")):
        assert main(["promote", "--bundle", str(link), "--candidate", str(v2.directory), "--store",
                     str(labelled[1]), "--log", str(log)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("PromotionsLogError: "), err
    assert not list(tmp_path.glob("*.pending.json")) and not list(tmp_path.glob("*.lock*"))[1:]
    assert main(["promote", "--bundle", str(tmp_path / "suport"), "--candidate", str(v2.directory),
                 "--store", str(labelled[1])]) == 2  # mistyped: refused, no lock file left beside it
    assert "no bundle at" in capsys.readouterr().err and not (tmp_path / "suport.promote.lock").exists()


def test_a_pending_decision_that_cannot_be_finished_says_so_in_one_line(
        two: tuple[Path, Bundle, Bundle], labelled: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    link, _, v2 = two
    pending = link.parent / "support.promote.pending.json"
    pending.write_text('{"log": "x"', encoding="utf-8")
    assert main(["promote", "--bundle", str(link), "--candidate", str(v2.directory), "--store",
                 str(labelled[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{pending} holds a decision an earlier promotion" in err[0], err



@pytest.mark.parametrize("state", [b"", b"\xff\xfe\x85", b'{"mark": -5}'])
def test_a_damaged_loop_state_is_one_line_not_a_traceback(
        trained_bundle: Bundle, labelled: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], state: bytes) -> None:
    """Empty, not text, or a mark below 0 (read as more new labels than the store holds)."""
    link, store = setup(trained_bundle, labelled, tmp_path)
    LoopPaths(link).state.write_bytes(state)
    assert loop_once(link, store) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("LoopStateError: ") and "delete it" in err[0], err


def test_a_file_that_is_not_text_given_as_the_log_or_the_bundle_is_one_line(
        two: tuple[Path, Bundle, Bundle], labelled: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The store given as --log, or as --bundle: a UnicodeDecodeError traceback, exit 1 (which
    promote means as "kept aside")."""
    link, _, v2 = two
    for flags in (["--bundle", str(link), "--log", str(labelled[1])], ["--bundle", str(labelled[1])]):
        assert main(["promote", *flags, "--candidate", str(v2.directory), "--store", str(labelled[1])]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("not UTF-8 text" in err[0] or "it is not text" in err[0]), err


def test_an_os_error_in_an_attempt_is_a_failed_decision_not_the_loops_end(
        trained_bundle: Bundle, labelled: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk or a path that is a file ended the loop process, and its restart logged the
    attempt as "discarded: the loop was stopped"."""
    link, store = setup(trained_bundle, labelled, tmp_path)
    LoopPaths(link).versions.write_text("x", encoding="utf-8")
    assert loop_once(link, store, "--now") == 1
    said = capsys.readouterr().out
    assert "attempt 1: " in said and "failed: " in said and "Error" in said, said
    assert LoopState.model_validate_json(LoopPaths(link).state.read_text()).pending is None
