"""The calibration report (HTML + JSON) and ``cascade calibrate``, on a real calibrated bundle."""

from __future__ import annotations

import base64
import fnmatch
import html
import importlib.resources
import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from corpora import HEADED, TEACHER, copy_bundle, corpus_items, write_jsonl
from test_calibration import FLOPS, calibrate

from cascade.bundle.manifest import Bundle
from cascade.encoder.onnx_encoder import Encoder
from cascade.questions import parse_request
from distill.calibration.results import CalibrationResult
from distill.cli import build_parser, main
from distill.demo.synthetic import QUESTIONS_JSON as DEMO_QUESTIONS
from distill.demo.synthetic import write_corpus
from distill.labelling.transfer import import_labels
from distill.options import CorpusInput, RunOptions
from distill.reports.calibration_report import TEMPLATE_NAME, write_report
from distill.store import LabelStore
from distill.training.run import train_bundle

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest needs tomli below 3.11
    import tomli as tomllib

PNG = b"\x89PNG\r\n\x1a\n"
IMG = '<img src="data:image/png;base64,'
TIER_FIGURES = {"reliability", "coverage", "confusion"}


@pytest.fixture(scope="module")
def inputs(labelled: tuple[Path, Path]) -> tuple[Path, Path]:
    return labelled


@pytest.fixture(scope="module")
def trained(trained_bundle: Bundle) -> Bundle:
    """The session's trained bundle: calibrated only as a copy, or refused before any change."""
    return trained_bundle


@pytest.fixture(scope="module")
def budget(tmp_path_factory: pytest.TempPathFactory, trained: Bundle, inputs: tuple[Path, Path],
           encoder: Encoder) -> tuple[CalibrationResult, Path]:
    """A budget-mode calibration and its report: (result, report folder)."""
    bundle = copy_bundle(trained, tmp_path_factory.mktemp("budget"))
    result = calibrate(bundle, *inputs, encoder, escalation_fraction=0.25)
    report = tmp_path_factory.mktemp("report")
    assert write_report(result, Bundle.load(bundle.directory), report) == report / "report.html"
    return result, report


def read(report: Path) -> tuple[str, dict[str, Any]]:
    return ((report / "report.html").read_text(encoding="utf-8"),
            json.loads((report / "report.json").read_text(encoding="utf-8")))


def test_the_page_is_self_contained_with_one_image_per_figure(budget: tuple[CalibrationResult, Path]
                                                              ) -> None:
    page, data = read(budget[1])
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert page.count(IMG) == len(data["figures"]) > 0
    for figure in data["figures"]:
        found = re.search(rf'{re.escape(IMG)}([A-Za-z0-9+/=]+)" id="{re.escape(figure["id"])}"', page)
        assert found and base64.b64decode(found[1]).startswith(PNG)


def test_the_json_has_every_figure_of_every_question(budget: tuple[CalibrationResult, Path]) -> None:
    result, report = budget
    _, data = read(report)
    figures = {(f["question"], f["tier"], f["kind"]): f["data"] for f in data["figures"]}
    for fit in result.calibrations:
        assert {kind for q, tier, kind in figures if (q, tier) == (fit.question, fit.tier)} == TIER_FIGURES
        reliability = figures[fit.question, fit.tier, "reliability"]
        assert (reliability["ece_before"], reliability["ece_after"]) == (fit.ece_before, fit.ece_after)
        assert sum(reliability["after"]["count"]) == fit.n - fit.n_temperature
        coverage = figures[fit.question, fit.tier, "coverage"]
        assert coverage["kept_share"] == fit.kept_share
        assert coverage["escalation_rate"] == pytest.approx(0.25, abs=1 / fit.n_threshold)
        assert len(coverage["curve"]["kept_share"]) == len(coverage["curve"]["lower_bound"]) > 1
        confusion = figures[fit.question, fit.tier, "confusion"]
        assert sum(map(sum, confusion["matrix"])) == fit.n and len(confusion["options"]) == len(fit.confusion)
        cost = figures[fit.question, None, "cost"]
        assert cost["escalation_rate"] == pytest.approx(1 - fit.kept_share)
        assert cost["cascade_seconds"] < cost["teacher_seconds"]
    assert {row["question"] for row in data["summary"]} == {*HEADED, "rare", "spam"}
    assert data["mode"] == "budget" and "No target is certified" in data["guarantee"]
    teacher = next(row for row in data["costs"] if row["kind"] == "teacher")
    assert teacher["source"] == "roofline estimate"
    assert f"{FLOPS:.3g} FLOP/s" in data["cost_assumption"]


def test_cli_calibrates_prints_a_table_and_writes_the_report(
    trained: Bundle, inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bundle = copy_bundle(trained, tmp_path / "bundle")
    corpus, store = inputs
    code = main(["calibrate", "--bundle", str(bundle.directory), "--corpus", str(corpus), "--store",
                 str(store), "--target-agreement", "0.85", "--delta", "0.1", "--report",
                 str(tmp_path / "report")])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].split() == ["question", "tier", "n", "T", "ECE", "threshold", "kept", "agreement",
                              "bound", "guarantee"]
    rows = {line.split()[0]: line.split() for line in out[1:5]}
    assert rows["urgent"][-1] == rows["department"][-1] == "yes" and rows["rare"][-1] == "skipped"
    assert out[-1] == f"report: {(tmp_path / 'report' / 'report.html').resolve()}"
    manifest = Bundle.load(bundle.directory).manifest
    assert manifest.threshold("urgent", "encoder") is not None
    assert (manifest.calibration.target, manifest.calibration.delta) == (0.85, 0.1)
    page, data = read(tmp_path / "report")
    assert ("For each question on its own: with probability at least 90.0% (1 - delta) over the draw "
            "of the calibration items") in page
    assert "answers agree with the teacher on at least 0.85 (the target) of new items" in page
    for limit in ("Not a promise about any one item", "Not under distribution shift",
                  "Not agreement with the truth"):
        assert limit in page
    assert page.count(IMG) == len(data["figures"])


def test_cli_reports_a_bad_target(trained: Bundle, inputs: tuple[Path, Path], tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:  # refused by the flag's type, before any work
        main(["calibrate", "--bundle", str(trained.directory), "--corpus", str(inputs[0]), "--store",
              str(inputs[1]), "--target-agreement", "98", "--report", str(tmp_path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "cascade calibrate: error: argument --target-agreement: must be a probability in (0, 1); got '98'")


def test_cli_help_has_an_example(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--help"])
    assert "example:\n  cascade calibrate --bundle" in capsys.readouterr().out


def test_without_matplotlib_the_command_writes_the_report_without_figures_and_says_how_to_get_them(
    trained: Bundle, inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    """matplotlib is the report extra's: with it unimportable, ``cascade calibrate`` still writes
    both files, without figures, and the page, the JSON and the command (once) say what to install."""
    bundle = copy_bundle(trained, tmp_path / "bundle")
    argv = ["calibrate", "--bundle", str(bundle.directory), "--corpus", str(inputs[0]), "--store",
            str(inputs[1]), "--target-agreement", "0.85", "--delta", "0.1", "--report", str(tmp_path / "r")]
    code = ("import sys\nsys.modules['matplotlib'] = None  # any import of it now fails\n"
            f"from distill.cli import main\nsys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    install = "figures need matplotlib: pip install -e '.[report]'"
    assert done.stdout.splitlines().count(install) == 1, done.stdout
    page, data = read(tmp_path / "r")
    assert install in html.unescape(page) and IMG not in page
    assert data["figures"] == [] and data["figures_note"] == install
    assert all(f'id="q-{qid}"' in page for qid in HEADED)  # each question's outcome is still there


def test_a_report_that_cannot_be_written_is_refused_before_the_bundle_changes(
    trained: Bundle, inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A report folder holding a report.html folder, or "" (the current folder), failed after the
    new thresholds were saved, or wrote the report where it was not asked to."""
    bundle = copy_bundle(trained, tmp_path / "bundle")
    manifest = (bundle.directory / "manifest.json").read_bytes()
    (tmp_path / "taken" / "report.html").mkdir(parents=True)
    base = ["calibrate", "--bundle", str(bundle.directory), "--corpus", str(inputs[0]), "--store",
            str(inputs[1]), "--target-agreement", "0.85", "--delta", "0.1", "--report"]
    for report, said in ((str(tmp_path / "taken"), "report.html is a folder"), ("", "must name a folder")):
        assert main([*base, report]) == 2
        assert said in capsys.readouterr().err
        assert (bundle.directory / "manifest.json").read_bytes() == manifest


HOSTILE = """<script>alert(1)</script>"onmouseover=alert(2) x='"""
"""Markup a question id, an option, instructions and a bundle's name may hold: shown as text."""


class _Tags(HTMLParser):
    """Every element, attribute and piece of text of a page, as a browser's parser reads them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, encoder: Encoder, embedding_cache: Path
            ) -> tuple[str, list[str], Path]:
    """A bundle trained and calibrated on a question whose id, options and instructions carry
    HOSTILE, in a folder whose name carries an attribute and a tag: (question id, option keys,
    report folder)."""
    root = tmp_path_factory.mktemp("hostile")
    qid = "department" + HOSTILE.replace("/", "")  # a question id has no "/" (a heads file key)
    department = DEMO_QUESTIONS["department"]
    keys = {key: key + HOSTILE for key in department["criteria"]}
    question = {"type": "choice", "instructions": department["instructions"] + HOSTILE,
                "criteria": {keys[key]: text for key, text in department["criteria"].items()}}
    questions = parse_request({"state": "x", "questions": {qid: question}}).questions
    items = corpus_items()
    rows = [{"id": item.id, "question": qid,
             "probabilities": {keys[key]: p for key, p in item.labels["department"].items()}}
            for item in items]
    corpus = write_corpus(items, root / "corpus.jsonl")
    with LabelStore(root / "labels.sqlite", TEACHER) as store:
        import_labels(store, write_jsonl(root / "labels.jsonl", rows), questions)
        bundle = train_bundle(questions, CorpusInput(corpus), store, root / ('b"onmouseover=alert(3) <i>'),
                              encoder=encoder, run=RunOptions(progress=False, cache_dir=embedding_cache))
    result = calibrate(bundle, corpus, root / "labels.sqlite", encoder, target=0.85, delta=0.1)
    write_report(result, Bundle.load(bundle.directory), root / "report")
    return qid, list(keys.values()), root / "report"


def test_markup_in_names_is_shown_as_text_never_run(hostile: tuple[str, list[str], Path]) -> None:
    """The template escapes every value: a question id, option or bundle name holding a script
    or an attribute stays text, and no element or event handler comes of it."""
    qid, options, report = hostile
    page, data = read(report)
    parsed = _Tags()
    parsed.feed(page)
    assert [tag for tag, _ in parsed.tags if tag == "script"] == []
    assert [name for _, attrs in parsed.tags for name in attrs if name.startswith("on")] == []
    assert "<script>" not in page and '"onmouseover=' not in page
    text = "".join(parsed.text)
    assert f"Calibration report: {data['name']}" in text and "onmouseover=alert(3) <i>" in data["name"]
    assert f"{qid} choice" in text and DEMO_QUESTIONS["department"]["instructions"] + HOSTILE in text
    assert any(repr(option) in text for option in options)  # the teacher check names the top answer
    assert ("section", {"id": f"q-{qid}"}) in parsed.tags
    figures = {attrs["id"]: attrs["alt"] for tag, attrs in parsed.tags if tag == "img"}
    assert figures == {f["id"]: f["title"] for f in data["figures"]} and len(figures) == 4


def test_the_template_ships_as_package_data() -> None:
    """The page's template is found through importlib.resources, and pyproject's package-data
    takes every file of the templates folder into a wheel."""
    templates = importlib.resources.files("distill.reports").joinpath("templates")
    assert templates.joinpath(TEMPLATE_NAME).is_file()
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    globs = pyproject["tool"]["setuptools"]["package-data"]["distill.reports"]
    shipped = [entry.name for entry in templates.iterdir()]
    assert TEMPLATE_NAME in shipped
    assert all(any(fnmatch.fnmatch(f"templates/{name}", glob) for glob in globs) for name in shipped)
