"""The README's examples run as written, on a bundle built the way the manual builds one.

The bundle: teacher labels in a store (the generated support corpus's labels, stored as the
labels of gemma-3-270m, the real GGUF the tests run), then ``cascade train --teacher-model`` and
``cascade calibrate`` as docs/distilling.md writes them. Then the README's library call, its
``cascade serve`` line and its curl, with the bundle's and the teacher's paths and the port put in
for the names the README uses, and nothing else changed.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from corpora import QUESTIONS_JSON, write_training_inputs
from servers import free_port

from cascade.hashing import file_sha256
from cascade.readout.prompts import PROMPT_VERSION
from distill.cli import main
from distill.store import Teacher

ROOT = Path(__file__).resolve().parents[1]
BUNDLE, TEACHER = "models/support-v1", "Qwen3.5-4B-Q4_K_M.gguf"


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in ``language``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, gemma_path: Path) -> Path:
    """A bundle built as docs/distilling.md builds one, its top tier gemma pinned by --teacher-model."""
    root = tmp_path_factory.mktemp("readme")
    teacher = Teacher(kind="gguf", model=gemma_path.name, model_sha256=file_sha256(gemma_path),
                      prompt_version=PROMPT_VERSION)
    corpus, store = write_training_inputs(root, teacher)
    questions = root / "q.json"
    questions.write_text(json.dumps({"questions": QUESTIONS_JSON}))
    bundle = root / "models" / "support-v1"
    assert main(["train", "--questions", str(questions), "--corpus", str(corpus), "--store", str(store),
                 "--bundle", str(bundle), "--teacher-model", str(gemma_path), "--threads", "1"]) == 0
    assert main(["calibrate", "--bundle", str(bundle), "--corpus", str(corpus), "--store", str(store),
                 "--target-agreement", "0.9", "--delta", "0.1", "--report", str(root / "report"),
                 "--teacher-items", "2", "--threads", "1"]) == 0
    return bundle


def test_the_readme_shows_the_blocks_this_test_runs() -> None:
    assert any("Cascade.load" in block for block in blocks("python"))
    assert any(line.startswith("cascade serve ") for block in blocks("bash") for line in block.splitlines())


def test_the_readme_library_call_runs_as_written(built: Path, gemma_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (code,) = [block for block in blocks("python") if "Cascade.load" in block]
    assert "from cascade import" in code  # the public surface only
    exec(code.replace(BUNDLE, str(built)).replace(TEACHER, str(gemma_path)), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(len(line.split()) >= 4 for line in lines)


def test_the_readme_serve_and_curl_lines_run_as_written(
    built: Path, gemma_path: Path, tmp_path: Path
) -> None:
    (block,) = [block for block in blocks("bash") if "cascade serve " in block]
    serve_line, *curl_lines = block.replace("\\\n", " ").strip().splitlines()
    port = free_port()
    serve = shlex.split(serve_line.replace(BUNDLE, str(built)).replace(TEACHER, str(gemma_path))
                        .replace("--port 8080", f"--port {port}"))
    assert serve[:2] == ["cascade", "serve"]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "distill.cli", *serve[1:], "--threads", "1"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", server)
        curl = shlex.split(" ".join(curl_lines).replace("8080", str(port)))
        done = subprocess.run(curl, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)["answers"]["urgent"]
        assert 0.0 <= answer["noul"] <= 1.0 and answer["x_routing"]["tier"] in ("encoder", "teacher")
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def _wait_ready(url: str, server: subprocess.Popen[bytes], seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, "cascade serve exited before it was ready"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"cascade serve was not ready within {seconds:.0f} s")
