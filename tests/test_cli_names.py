"""One name per idea on the command line, and every number read the same way (issue 42 Must 4).

The tests walk the whole ``cascade`` parser, every subcommand's every flag, so that a flag added
later with a second spelling for a known idea, another value vocabulary, or a bare ``type=float``
fails here rather than in a user's hands. Bad values run the real parser (``main``) and the real
console command, as ``test_cli_errors.py`` does."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from distill.calibration.inputs import SOURCES
from distill.cli import build_parser, main
from distill.cli.calibrate import SOURCE
from distill.cli.common import EVIDENCE
from distill.cli.renamed import is_old_flag
from distill.loop.evidence import CERTIFYING

SYNONYMS = {
    "--target-agreement": ("--target", "--agreement", "--target-share", "--agreement-target"),
    "--delta": ("--confidence-delta", "--failure-probability"),
    "--labels-from": ("--teacher-source", "--label-source", "--labels-source"),
    "--calibrate-on": ("--certify-on", "--evidence", "--calibrate-from"),
    "--audit-share": ("--audit-fraction", "--audit-rate"),
    "--collect-share": ("--collect-fraction", "--collect-rate"),
}
"""Each idea's one spelling -> spellings it must not also have (an old one only as a hidden,
warning alias for one release)."""

OWN_VOCABULARY = {("roofline", "--device")}
"""Flags whose values are another idea than the same flag elsewhere: roofline's --device names a
device to price a model on (t4, h100, ...), not where the encoder runs."""


def flags() -> Iterator[tuple[str, argparse.Action]]:
    """(command, action) for every optional flag of every subcommand, --help aside."""
    def walk(prefix: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(f"{prefix} {name}".strip(), sub)
            elif action.option_strings and not isinstance(action, argparse._HelpAction):
                yield prefix, action
    yield from walk("", build_parser())


def current() -> Iterator[tuple[str, argparse.Action]]:
    """The flags as --help teaches them: old spellings left out."""
    return ((command, action) for command, action in flags() if not is_old_flag(action))


def takes_a_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def test_the_walk_sees_every_command() -> None:
    commands = {command for command, _ in flags()}
    assert {"serve", "calibrate", "retrain", "demo", "label", "decide", "train", "promote"} <= commands


def test_no_idea_is_spelled_two_ways() -> None:
    spelled = {(command, option) for command, action in current() for option in action.option_strings}
    wrong = [(command, option, one) for one, others in SYNONYMS.items() for command, option in spelled
             if option in others]
    assert not wrong, f"spell these as the one name of their idea (command, flag, name): {wrong}"


def test_an_old_spelling_is_only_a_hidden_alias_of_the_new_flag() -> None:
    actions = list(flags())
    for command, old in actions:
        if not is_old_flag(old):
            continue
        new = [action for where, action in actions if where == command and action.dest == old.dest
               and not is_old_flag(action)]
        assert len(new) == 1, (command, old.option_strings)
        assert old.help == argparse.SUPPRESS
        assert (old.type, old.choices) == (new[0].type, new[0].choices), (command, old.option_strings)


def test_a_flag_has_one_vocabulary_in_every_command() -> None:
    """Choices of one flag across commands nest (a command may take one more, as label's --layout
    auto): two commands naming one idea with two word sets fail."""
    vocabularies: dict[str, list[tuple[str, frozenset[str]]]] = {}
    for command, action in current():
        if action.choices is not None and (command, action.option_strings[0]) not in OWN_VOCABULARY:
            vocabularies.setdefault(action.option_strings[0], []).append((command, frozenset(action.choices)))
    for flag, seen in vocabularies.items():
        for command, words in seen:
            for other, theirs in seen:
                assert words <= theirs or theirs <= words, (flag, command, sorted(words), other,
                                                            sorted(theirs))


def test_calibrate_on_means_the_same_in_calibrate_retrain_and_loop() -> None:
    choices = {command: tuple(action.choices or ()) for command, action in current()
               if "--calibrate-on" in action.option_strings}
    assert choices == {"calibrate": EVIDENCE, "retrain": EVIDENCE, "loop": EVIDENCE}
    assert set(CERTIFYING) == set(EVIDENCE)  # retrain's origins, by these words
    assert set(SOURCE) == set(EVIDENCE) and sorted(SOURCE.values()) == sorted(SOURCES)  # calibrate's
    assert CERTIFYING["corpus"] == {"corpus"} and "corpus" not in CERTIFYING["traffic"]
    assert (SOURCE["corpus"], SOURCE["traffic"], SOURCE["all"]) == ("calibration", "audit", "both")


def test_teacher_is_always_a_model_or_a_url() -> None:
    teachers = [(command, action) for command, action in current() if "--teacher" in action.option_strings]
    assert {command for command, _ in teachers} >= {"serve", "decide", "label", "calibrate"}
    for command, action in teachers:
        assert action.choices is None, command
        assert getattr(action.type, "__name__", "") in ("teacher_argument", "url_argument"), command


def test_every_number_flag_uses_the_shared_types() -> None:
    """No bare int or float anywhere; a share, probability or rate by its name gets its type."""
    by_name = {"share": lambda dest: dest.endswith(("_share", "_fraction")) or dest == "max_escalation",
               "probability": lambda dest: dest in ("delta", "target_agreement"),
               "positive_number": lambda dest: dest == "rate" or dest.endswith("_rate")}
    for command, action in flags():
        if not takes_a_value(action):
            continue
        where = (command, action.option_strings[0])
        assert action.type not in (int, float), f"{where}: type it with distill.cli.values"
        for kind, named in by_name.items():
            if named(action.dest):
                assert getattr(action.type, "__name__", None) == kind, where
        if action.type is not None and getattr(action.type, "__module__", "") == "distill.cli.values":
            default = action.default
            if default is not None and default != argparse.SUPPRESS:  # a default its own check refuses
                assert action.type(str(default)) == default, where


BAD = [
    (["serve", "--audit-share", "1.5"], "--audit-share", "in [0, 1]"),
    (["decide", "--max-escalation", "-0.1"], "--max-escalation", "in [0, 1]"),
    (["serve", "--collect-share", "nan"], "--collect-share", "in [0, 1]"),
    (["calibrate", "--target-agreement", "1"], "--target-agreement", "in (0, 1)"),
    (["retrain", "--delta", "0"], "--delta", "in (0, 1)"),
    (["demo", "--delta", "1.2"], "--delta", "in (0, 1)"),
    (["label", "--rate", "0"], "--rate", "> 0"),
    (["train", "--C", "inf"], "--C", "> 0"),
    (["serve", "--upstream-timeout", "-1"], "--upstream-timeout", "seconds > 0"),
    (["serve", "--watch-bundle", "-1"], "--watch-bundle", "seconds >= 0"),
    (["serve", "--audit-poll", "0"], "--audit-poll", "seconds > 0"),
    (["score", "--n-ctx", "0"], "--n-ctx", "1 or more"),
    (["demo", "--gemma-items", "2.5"], "--gemma-items", "whole number"),
    (["serve", "--limit-options", "256"], "--limit-options", "at most 255"),
]


@pytest.mark.parametrize(("argv", "flag", "allowed"), BAD, ids=[" ".join(argv) for argv, _, _ in BAD])
def test_a_bad_number_is_one_usage_line_naming_flag_and_range(
    argv: list[str], flag: str, allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"argument {flag}: " in errors[0] and allowed in errors[0], errors[0]


def test_the_console_command_refuses_a_share_above_one_in_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "distill.cli", "serve", "--audit-share", "1.5"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == ("cascade serve: error: argument --audit-share: must be a share "
                                              "in [0, 1]; got '1.5'")


def parsed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[argparse.Namespace, list[str]]:
    """``argv`` parsed by the real parser, and the lines it wrote to stderr."""
    args = build_parser().parse_args(argv)
    return args, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(("argv", "dest", "value", "new"), [
    (["demo", "--target", "0.9"], "target_agreement", 0.9, "--target-agreement"),
    (["demo", "--teacher", "generator"], "labels_from", "generator", "--labels-from"),
    (["calibrate", "--bundle", "b", "--store", "s.sqlite", "--report", "r", "--calibrate-on", "audit"],
     "calibrate_on", "traffic", "--calibrate-on traffic"),
    (["calibrate", "--bundle", "b", "--store", "s.sqlite", "--report", "r", "--calibrate-on", "both"],
     "calibrate_on", "all", "--calibrate-on all"),
    (["calibrate", "--bundle", "b", "--store", "s.sqlite", "--report", "r", "--calibrate-on", "calibration"],
     "calibrate_on", "corpus", "--calibrate-on corpus"),
])
def test_an_old_spelling_works_for_one_release_with_one_warning_line(
    argv: list[str], dest: str, value: object, new: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args, err = parsed(argv, capsys)
    assert getattr(args, dest) == value
    assert len(err) == 1 and "deprecated" in err[0] and err[0].endswith(f"use {new}"), err


def test_the_new_spellings_warn_nothing_and_the_demo_passes_them_on(
    capsys: pytest.CaptureFixture[str]
) -> None:
    from distill.cli.demo import CONFIG_FIELDS
    from distill.demo.run import DemoConfig

    args, err = parsed(["demo", "--target-agreement", "0.9", "--labels-from", "live", "--threads", "2"],
                       capsys)
    assert err == []
    given = {field: getattr(args, dest) for dest, field in CONFIG_FIELDS.items() if hasattr(args, dest)}
    config = DemoConfig(**given)
    assert (config.target, config.teacher, config.threads) == (0.9, "live", 2)
    retrain, err = parsed(["retrain", "--bundle", "b", "--store", "s.sqlite", "--out", "o"], capsys)
    assert retrain.calibrate_on == "all" and err == []


def test_an_old_spelling_keeps_the_range_check(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--target", "1.5"])
    assert "argument --target: must be a probability in (0, 1); got '1.5'" in capsys.readouterr().err


def test_help_teaches_the_new_names_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "--target-agreement P" in text and "--labels-from {shipped,generator,live}" in text
    assert "--target P" not in text and "--teacher {" not in text
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    assert "--calibrate-on {corpus,traffic,all}" in capsys.readouterr().out
