"""The README's command blocks run as written, in order, each on what the earlier ones left.

One user's terminal is replayed in a fresh folder: every ``bash`` and ``python`` block of the
README in its order, with the variables a block exports kept for the next, and nothing changed but
the venv's folder (``.venv/bin/``: the one running this test) and the port (8080: a free one). So
the library call loads the bundle the demo block left, with the teacher the block before it
assembled, and the SDK calls the server the block before it started.

Two kinds of command are checked rather than run, each for a reason asserted here:

- set-up (``python3 -m venv .venv``, ``pip install -e ".[extras]"``): this test runs inside the
  environment they make, and checks that it is a venv holding every package of each extra as
  pinned; installing from here would change the environment the suite runs in;
- the test command (``python -m pytest``): it is the line ``.ci/run`` runs, which this test checks;
  run from here it would run this test inside itself.

The ``teachers`` extra (1.6 GB of GGUF parts) is not in ``dev``: without it this module skips, and
``.ci/run`` installs it and runs this file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from servers import free_port

from cascade.bundle.manifest import Bundle
from cascade.hashing import file_sha256
from distill.demo.synthetic import QUESTIONS_JSON

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DISTRIBUTION = "cascade-router"
SETUP = re.compile(r'python3 -m venv \.venv'
                   r'|(?:CMAKE_ARGS="[^"]*" )?\.venv/bin/pip install -e "\.\[([\w,]+)\]"')
STEP_SECONDS = 1800  # a bound on one block (the demo beside busy cores), never an assertion


def missing(extra: str) -> list[str]:
    """The packages ``extra`` pins (its own extras' too) that are not installed as pinned."""
    absent = []
    for line in metadata.requires(DISTRIBUTION) or []:
        wanted = Requirement(line)
        if wanted.marker is None or not wanted.marker.evaluate({"extra": extra}):
            continue
        if wanted.name == DISTRIBUTION:
            absent += [name for inner in sorted(wanted.extras) for name in missing(inner)]
            continue
        try:
            version = metadata.version(wanted.name)
        except metadata.PackageNotFoundError:
            absent.append(str(wanted))
            continue
        if not wanted.specifier.contains(version, prereleases=True):
            absent.append(f"{wanted} ({version} installed)")
    return absent


pytestmark = pytest.mark.skipif(
    bool(missing("teachers")),
    reason="the teachers extra (1.6 GB of GGUF parts) is not installed; .ci/run installs it and runs "
           "this file")


@dataclass(frozen=True)
class Block:
    """One fenced block of the README: its language and text."""

    language: str
    text: str


def blocks() -> list[Block]:
    """The README's command blocks in order; unlabelled fences are figures, not commands."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    fenced = re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)
    assert {language for language, _ in fenced} <= {"bash", "python", ""}
    return [Block(language, body) for language, body in fenced if language]


@dataclass
class Terminal:
    """A user's shell in ``folder``: what its blocks exported, and the servers they left running."""

    folder: Path
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    groups: list[int] = field(default_factory=list)

    def here(self, text: str) -> str:
        """``text`` with this test's venv and port for the README's."""
        return text.replace(".venv/bin/", f"{BIN}/").replace("8080", str(self.port))

    def bash(self, script: str, step: int) -> str:
        """Run ``script`` as the shell would (stopping at a failed command); its output. Its
        exported variables carry on, and what it started in the background runs on until close."""
        log, env_file = self.folder / f"step-{step}.log", self.folder / f"step-{step}.env"
        with log.open("w") as out:
            shell = subprocess.Popen(["bash", "-c", f"set -e\n{script}\nenv -0 > '{env_file}'"],
                                     cwd=self.folder, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            self.groups.append(shell.pid)
            status = shell.wait(timeout=STEP_SECONDS)
        output = log.read_text(encoding="utf-8", errors="replace")
        assert status == 0, f"README step {step} failed ({status}):\n{script}\n{output[-4000:]}"
        self.env = dict(item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
        return output

    def python(self, code: str, step: int) -> str:
        """Run ``code`` with the venv's python in this shell's folder and environment; its stdout."""
        done = subprocess.run([sys.executable, "-c", code], cwd=self.folder, env=self.env,
                              capture_output=True, text=True, timeout=STEP_SECONDS)
        assert done.returncode == 0, f"README step {step} failed:\n{code}\n{done.stderr[-4000:]}"
        return done.stdout

    def close(self) -> None:
        """Stop what the blocks left running (a served bundle), then wait until its port is free."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _answers(self.port) and time.monotonic() < deadline:
            time.sleep(0.5)
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)


def _answers(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.TransportError:
        return False
    return True


def set_up(command: str, extras: str | None) -> str:
    """A set-up command, checked against the environment running this test instead of run."""
    assert sys.prefix != sys.base_prefix, f"`{command}`: this test should run inside the venv it makes"
    for extra in (extras or "").split(","):
        if extra:
            assert not missing(extra), f"`{command}`: not installed: {missing(extra)}"
    return "true"


def is_what_ci_runs(block: Block) -> None:
    """The test command is checked, not run: .ci/run runs that line, and it would run this test."""
    assert block.text.strip() in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


# --- what each step must have left: every block has a check, found by what it runs ---


def left_a_demo_bundle(shell: Terminal, output: str) -> None:
    assert "agreement with the teacher" in output
    assert Bundle.load(shell.folder / "runs" / "demo" / "bundle").manifest.teacher.kind == "gguf"


def left_the_bundles_teacher(shell: Terminal, output: str) -> None:
    """The teachers extra's 1.5B is the GGUF the demo's labels came from, to the byte."""
    teacher = Bundle.load(shell.folder / "runs" / "demo" / "bundle").manifest.teacher
    assert file_sha256(Path(shell.env["TEACHER"])) == teacher.model_sha256


def answered_certified(shell: Terminal, output: str) -> None:
    lines = [line.split() for line in output.splitlines()]
    assert sorted(line[0] for line in lines) == sorted(QUESTIONS_JSON)
    assert all(line[-2] in ("encoder", "teacher") and line[-1] == "True" for line in lines), output


def served_and_curled(shell: Terminal, output: str) -> None:
    """curl's body, among the lines the server it started in the background logs to the same output."""
    response, _ = json.JSONDecoder().raw_decode(output, output.index('{"model"'))
    answer = response["answers"]["urgent"]
    assert 0 <= answer["noul"] <= 1 and answer["x_routing"]["certified"] is True


def the_sdk_parsed_it(shell: Terminal, output: str) -> None:
    assert 0 <= float(output.strip()) <= 1


CHECKS: list[tuple[str, Callable[[Terminal, str], None]]] = [
    ("cascade demo", left_a_demo_bundle),
    ("cascade teacher-model", left_the_bundles_teacher),
    ("Cascade.load", answered_certified),
    ("cascade serve", served_and_curled),
    ("avrik_sdk", the_sdk_parsed_it),
]


@pytest.fixture()
def shell(tmp_path: Path) -> Iterator[Terminal]:
    terminal = Terminal(tmp_path)
    try:
        yield terminal
    finally:
        terminal.close()


def test_the_readme_runs_top_to_bottom(shell: Terminal) -> None:
    ran = []
    for step, block in enumerate(blocks(), 1):
        if block.language == "bash" and "-m pytest" in block.text:
            is_what_ci_runs(block)
            continue
        checks = [check for marker, check in CHECKS if marker in block.text]
        assert len(checks) == 1, f"README step {step} needs one check here:\n{block.text}"
        check = checks[0]
        if block.language == "bash":
            script = SETUP.sub(lambda found: set_up(found.group(0), found.group(1)), block.text)
            output = shell.bash(shell.here(script), step)
        else:
            output = shell.python(shell.here(block.text), step)
        check(shell, output)
        ran.append(check.__name__)
    assert ran == [check.__name__ for _, check in CHECKS]  # every step shown, in this order
