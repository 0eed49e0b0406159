"""``cascade demo`` end to end: generated corpus, stand-in teacher, real encoder and real gemma.

The main run is small (200 items, 30 of them scored by gemma for calibration, 30 routed) so
that it takes seconds, with a low target so that its calibration has something to certify. The
own-data path and the reuse of a calibrated bundle run on a tiny random GGUF instead of gemma:
what they test is the plumbing, not the model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from dataclasses import fields
from pathlib import Path

import llama_cpp
import pytest
from tinymodels import silence_llama_logs, tiny_llama_path

from cascade.bundle.manifest import Bundle
from cascade.errors import CascadeError, ModelError, RouterError
from cascade.routing.router import Cascade
from cascade.tiers.gguf import GgufSpec
from distill.cli import build_parser, main
from distill.cli.demo import CONFIG_FIELDS
from distill.cli.renamed import is_old_flag
from distill.demo.run import GEMMA_N_CTX, GENERATOR_NOTE, DemoConfig, DemoError, run_demo
from distill.demo.synthetic import generate, write_corpus, write_labels, write_questions
from distill.demo.teacher import LABELS_FILE, shipped_facts

SMALL = ["--items", "200", "--gemma-items", "30", "--eval-items", "30", "--target-agreement", "0.5",
         "--labels-from", "generator"]
"""A target low enough for ~20 threshold items to certify: each of the two cheap tiers must
reach 0.75, which 20 items with at most one disagreement do (0.975, the default's, needs 146)."""


def _run_cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    workdir = tmp_path_factory.mktemp("demo")
    status, output = _run_cli(["demo", "--workdir", str(workdir), *SMALL])
    assert status == 0
    return workdir, output


def test_output_says_the_teacher_is_a_stand_in(demo_run: tuple[Path, str]) -> None:
    _, output = demo_run
    assert GENERATOR_NOTE in output
    assert "not a 4B's" in GENERATOR_NOTE


def test_summary_shares_sum_to_one_and_agreement_is_a_rate(demo_run: tuple[Path, str]) -> None:
    workdir, output = demo_run
    summary = output[output.index("\nsummary\n"):]
    shares = [float(share) for share in re.findall(r"answered by \S+\s+([\d.]+)%", summary)]
    assert len(shares) == 3
    assert sum(shares) == pytest.approx(100.0, abs=0.2)
    found = re.search(r"agreement with the teacher\s+([\d.]+)", summary)
    assert found is not None
    agreement = float(found.group(1))
    assert 0.0 <= agreement <= 1.0
    evaluation = json.loads((workdir / "evaluation.json").read_text())
    assert sum(tier["share"] for tier in evaluation["tiers"]) == pytest.approx(1.0)
    assert evaluation["agreement"] == pytest.approx(agreement, abs=1e-4)
    assert evaluation["items"] > 0 and evaluation["cost_ratio"] > 0


def test_output_ends_with_an_existing_report(demo_run: tuple[Path, str]) -> None:
    _, output = demo_run
    last = output.rstrip("\n").splitlines()[-1]
    assert last.startswith("report: ")
    report = Path(last.removeprefix("report: "))
    assert report.is_file() and report.suffix == ".html"
    assert "<html" in report.read_text(encoding="utf-8").lower()


def test_bundle_puts_gemma_between_encoder_and_teacher(demo_run: tuple[Path, str]) -> None:
    workdir, _ = demo_run
    manifest = Bundle.load(workdir / "bundle").manifest
    assert [tier.name for tier in manifest.tiers] == ["encoder", "gemma", "teacher"]
    gemma = manifest.tiers[1]
    assert isinstance(gemma, GgufSpec)
    assert (gemma.permutations, gemma.n_ctx) == (1, GEMMA_N_CTX)
    assert Path(gemma.model.path).name.startswith("gemma-3-270m")
    assert manifest.calibration.target == 0.5
    assert set(manifest.thresholds["department"]) == {"encoder", "gemma"}


@pytest.fixture(scope="module")
def own_data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A user's own corpus, questions and labels (generated here), and a tiny GGUF."""
    root = tmp_path_factory.mktemp("own")
    silence_llama_logs()
    items = generate(300, seed=5)
    return ["--corpus", str(write_corpus(items, root / "c.jsonl")),
            "--questions", str(write_questions(root / "q.json")),
            "--labels", str(write_labels(items, root / "l.jsonl")),
            "--gguf", str(tiny_llama_path(root)), "--gemma-items", "100", "--eval-items", "60",
            "--target-agreement", "0.8"]


def test_own_data_runs_and_a_rerun_reuses_the_calibrated_bundle(
    own_data: list[str], tmp_path: Path
) -> None:
    argv = ["demo", "--workdir", str(tmp_path), *own_data]
    status, first = _run_cli(argv)
    assert status == 0
    assert "your labels from" in first and GENERATOR_NOTE not in first
    assert [tier.name for tier in Bundle.load(tmp_path / "bundle").manifest.tiers] == [
        "encoder", "gguf", "teacher"]
    shares = {tier["name"]: tier["share"] for tier in
              json.loads((tmp_path / "evaluation.json").read_text())["tiers"]}
    assert shares["encoder"] > 0.1  # the encoder keeps answers: the routing is exercised
    manifest = (tmp_path / "bundle" / "manifest.json").read_bytes()
    status, second = _run_cli(argv)
    assert status == 0
    assert "reusing the calibrated bundle" in second and "reusing" not in first
    assert (tmp_path / "bundle" / "manifest.json").read_bytes() == manifest
    assert second.splitlines()[-1] == first.splitlines()[-1]
    status, forced = _run_cli([*argv, "--force"])
    assert status == 0 and "reusing" not in forced


def test_half_of_the_own_inputs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match="--corpus needs --questions and --labels"):
        run_demo(DemoConfig(workdir=tmp_path, corpus=tmp_path / "c.jsonl"))


def test_sizes_that_leave_too_little_to_train_are_refused(tmp_path: Path) -> None:
    config = DemoConfig(workdir=tmp_path, items=100, gemma_items=40, eval_items=40)
    with pytest.raises(DemoError, match=r"gemma_items \(40\) \+ eval_items \(40\)"):
        run_demo(config)


@pytest.mark.parametrize(("field", "value"), [("items", 0), ("target", 1.0), ("delta", 0), ("threads", 0)])
def test_bad_settings_name_the_setting(tmp_path: Path, field: str, value: float) -> None:
    with pytest.raises(DemoError, match=field):
        run_demo(DemoConfig(workdir=tmp_path, **{field: value}))  # type: ignore[arg-type]


def test_what_step_4_loads_is_checked_before_step_1(tmp_path: Path) -> None:
    """A --gguf that is not one, missing, or GPU layers on this CPU build failed after the
    teacher's labels and the training."""
    (tmp_path / "notes.gguf").write_text("not a model")
    for gguf, message in ((tmp_path / "notes.gguf", "is not a readable GGUF file"),
                          (tmp_path / "absent.gguf", "does not exist or is not a file")):
        with pytest.raises(ModelError, match=message):
            run_demo(DemoConfig(workdir=tmp_path / "w", gguf=gguf))
    if not llama_cpp.llama_supports_gpu_offload():
        with pytest.raises(ModelError, match="this llama-cpp-python build has no GPU offload"):
            run_demo(DemoConfig(workdir=tmp_path / "w", gpu_layers=5))
    assert not (tmp_path / "w").exists(), "refused before anything was written"


def test_the_default_teacher_is_a_real_llms_shipped_labels(tmp_path: Path, gemma_path: Path) -> None:
    """The shipped labels are the 1.5B's, checked by content against the facts shipped beside them."""
    facts = shipped_facts()
    small = [arg for arg in SMALL if arg not in ("--labels-from", "generator")]
    status, output = _run_cli(["demo", "--workdir", str(tmp_path), *small, "--live-items", "0"])
    assert status == 0
    assert f"teacher: {facts.model}, a real LLM" in output and facts.command in output
    assert GENERATOR_NOTE not in output
    manifest = Bundle.load(tmp_path / "bundle").manifest
    # the labels' GGUF by sha256 and prompt (loading checks the teacher given against them), no file pinned
    assert (manifest.teacher.kind, manifest.teacher.model_sha256, manifest.teacher.prompt_version) == (
        "gguf", facts.model_sha256, facts.prompt_version)
    assert manifest.tiers[-1].kind == "external"
    assert f"cascade serve --bundle {tmp_path / 'bundle'} --teacher" in output  # the README's next step
    with pytest.raises(RouterError, match="sha256"):  # another GGUF is not the 1.5B certified
        Cascade.preflight(tmp_path / "bundle", teacher=gemma_path)
    ids = {item.id for item in generate(200, 0)}
    rows = [json.loads(line) for line in LABELS_FILE.open(encoding="utf-8")]
    assert {row["id"] for row in rows} >= ids
    assert all(sum(row["probabilities"].values()) == pytest.approx(1.0, abs=1e-4) for row in rows)


def test_more_items_than_the_shipped_labels_cover_is_refused(tmp_path: Path) -> None:
    too_many = shipped_facts().items + 1
    with pytest.raises(CascadeError, match=f"cover the first {too_many - 1} generated items"):
        run_demo(DemoConfig(workdir=tmp_path, items=too_many, gemma_items=30, eval_items=30))
    with pytest.raises(CascadeError, match=r"seed 0; this run generates .* seed 1"):
        run_demo(DemoConfig(workdir=tmp_path, items=100, seed=1, gemma_items=30, eval_items=30))


def test_cli_errors_print_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--workdir", str(tmp_path), "--labels", str(tmp_path / "l.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("DemoError: --labels needs --corpus and --questions")


def test_cli_help_states_the_real_defaults() -> None:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    demo = commands.choices["demo"]
    helps = {action.dest: action.help or "" for action in demo._actions if not is_old_flag(action)}
    dests = {field: dest for dest, field in CONFIG_FIELDS.items()}
    defaults = DemoConfig()
    for item in fields(DemoConfig):
        value = getattr(defaults, item.name)
        if isinstance(value, int | float | Path) and not isinstance(value, bool):
            assert f"(default {value})" in helps[dests.get(item.name, item.name)], item.name


def test_a_bad_corpus_line_stops_the_demo_or_is_skipped_and_said_once(
    own_data: list[str], tmp_path: Path
) -> None:
    corpus = Path(own_data[own_data.index("--corpus") + 1])
    broken = tmp_path / "broken.jsonl"
    broken.write_text(corpus.read_text(encoding="utf-8") + "{not json\n", encoding="utf-8")
    argv = ["demo", "--workdir", str(tmp_path / "run"), *own_data]
    argv[argv.index(str(corpus))] = str(broken)
    status, _ = _run_cli(argv)
    assert status == 2
    status, out = _run_cli([*argv, "--on-error", "skip"])
    assert status == 0
    assert out.count(f"skipped {broken}:301:") == 1  # read by three steps, said once
