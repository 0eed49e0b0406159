"""Bad input tried as a new user would: one clear line saying what to do, a non-zero exit, no
traceback. Each case runs the real ``cascade`` console command in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tinymodels import tiny_llama_path

CASCADE = [sys.executable, "-m", "cascade.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CASCADE, *args], capture_output=True, text=True, timeout=300)


def assert_one_clear_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    first = result.stderr.strip().splitlines()[0]
    assert ": " in first, first
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


@pytest.fixture
def request_file(tmp_path: Path) -> Path:
    path = tmp_path / "req.json"
    path.write_text(json.dumps({"state": "hello", "questions": {
        "q": {"type": "noul", "instructions": "Is this a greeting?"}}}))
    return path


@pytest.fixture
def questions_file(tmp_path: Path) -> Path:
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"questions": {"q": {"type": "noul", "instructions": "Spam?"}}}))
    return path


def test_missing_model_file(tmp_path: Path, request_file: Path) -> None:
    result = run("score", "--model", str(tmp_path / "missing.gguf"), "--request", str(request_file))
    assert_one_clear_line(result, "ModelError", "missing.gguf", "path of a .gguf file")


def test_a_gguf_that_is_not_decision_capable(tmp_path: Path, request_file: Path) -> None:
    """A model whose answer cue makes the option letters re-tokenize cannot be read out."""
    model = tiny_llama_path(tmp_path)
    result = run("score", "--model", str(model), "--request", str(request_file),
                 "--template", "chat")
    assert_one_clear_line(result, "ModelError", "template='plain'")


def test_a_file_that_is_not_a_gguf(tmp_path: Path, request_file: Path) -> None:
    junk = tmp_path / "model.gguf"
    junk.write_text("this is not a model")
    result = run("score", "--model", str(junk), "--request", str(request_file))
    assert_one_clear_line(result, "ModelError", "could not load")


def test_a_corpus_that_is_not_jsonl(tmp_path: Path, questions_file: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("id,text\n1,hello\n")
    result = run("label", "--import", str(corpus), "--questions", str(questions_file),
                 "--store", str(tmp_path / "s.sqlite"), "--corpus", str(corpus))
    assert result.returncode != 0 and "Traceback" not in result.stderr


def test_an_empty_corpus(tmp_path: Path, questions_file: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("")
    store = tmp_path / "s.sqlite"
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"id": "a", "question": "q", "answer": True}) + "\n")
    assert run("label", "--import", str(labels), "--questions", str(questions_file),
               "--store", str(store)).returncode == 0
    result = run("train", "--questions", str(questions_file), "--corpus", str(corpus),
                 "--store", str(store), "--bundle", str(tmp_path / "bundle"))
    assert_one_clear_line(result, "corpus", "empty")


QUESTIONS_WITH_A_BAD_LINE_12 = """{
  "questions": {
    "urgent": {
      "type": "noul",
      "instructions": "Does this convey urgency?"
    },
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "dept": {
      "type": "choice",
      "instructions": "Which team should handle this?",
      "criteria":
        {"billing": "Payments, invoicing, refunds"}
    }
  }
}
"""


def test_a_questions_file_with_an_error_on_line_12(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(QUESTIONS_WITH_A_BAD_LINE_12)
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"id": "a", "question": "urgent", "answer": True}) + "\n")
    result = run("label", "--import", str(labels), "--questions", str(path),
                 "--store", str(tmp_path / "s.sqlite"))
    assert_one_clear_line(result, "q.json:12: questions.dept.criteria", "2 to 16 options")


def test_a_bundle_from_a_newer_schema(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"schema_version": 2, "name": "future"}))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    result = run("decide", "--bundle", str(bundle), "--corpus", str(corpus),
                 "--out", str(tmp_path / "out.jsonl"))
    assert_one_clear_line(result, "BundleError", "newer than this cascade", "upgrade cascade")
