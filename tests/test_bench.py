"""The benchmark scripts: each imports without its data, models or optional extras, and its --help
says what it measures; the helpers they share come from bench.common, which stays light to import.

The scripts run in ONE subprocess (importing them all costs seconds, not a process each), where
torch and ray cannot be imported even where they are installed, as on a machine without the
extras.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("*.py") if path.stem not in {"__init__", "common"})
OPTIONAL = ("torch", "ray")
"""Extras a script may use, but only inside the function that needs them."""
SCRIPT_IMPORTS = {"gguf_features": {"cascade_goals"}, "joint_chain": {"mid_layer"},
                  "rayserve_scaling": {"serve_load"}, "serve_growth": {"serve_upstream"},
                  "regate_growth": {"serve_growth"}, "swap_memory": {"serve_growth"},
                  "gate_after_alarm": {"gate_replay"}, "gate_level": {"promotion_gate"}}
"""Scripts that import another script: gguf_features reruns cascade_goals' library run with other
features, joint_chain reads mid_layer's cached layer states and head, rayserve_scaling drives its
servers with serve_load's clients, serve_growth starts serve_upstream's server command and reads
its metrics, regate_growth decides serve_growth's held-out items as it does, swap_memory serves
serve_growth's seed bundle, gate_after_alarm gates gate_replay's bundles as it does, gate_level
draws promotion_gate's scenarios as it does. Everything else
shared sits in bench.common (the committed labels and the teacher they came from among it)."""

DRIVER = r"""
import contextlib, importlib, io, json, sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            raise ModuleNotFoundError(f"No module named {name!r} (an optional extra)", name=name)
        return None

sys.meta_path.insert(0, Absent())
results = {}
for name in SCRIPTS:
    out, result = io.StringIO(), {"code": None, "error": None, "on_import": ""}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            module = importlib.import_module(f"bench.{name}")
            result["on_import"] = out.getvalue()
            result["doc"] = module.__doc__
            sys.argv = [f"{name}.py", "--help"]
            module.main()
        except SystemExit as done:
            result["code"] = done.code
        except BaseException as error:
            result["error"] = f"{type(error).__name__}: {error}"
    result["output"] = out.getvalue()[len(result["on_import"]):]
    results[name] = result
sys.__stdout__.write(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, dict[str, Any]]:
    """Per script: what importing it printed, and the exit code and output of its ``main()`` under
    ``--help``."""
    code = f"OPTIONAL = {OPTIONAL!r}\nSCRIPTS = {SCRIPTS!r}\n{DRIVER}"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_every_script_is_seen() -> None:
    assert len(SCRIPTS) > 30 and "cascade_goals" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_says_what_the_script_measures(helps: dict[str, dict[str, Any]], name: str) -> None:
    result = helps[name]
    assert result["error"] is None, result["error"]
    assert result["on_import"] == "", "importing a benchmark must not run or print anything"
    assert result["code"] in (0, None), f"--help exited {result['code']}: {result['output']}"
    assert result["output"].startswith(f"usage: {name}.py"), result["output"]
    doc = result["doc"]
    assert doc and doc.strip().splitlines()[0] in result["output"], "the module docstring is the help"


def _bench_imports(path: Path) -> set[str]:
    """The bench modules ``path`` imports, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench."):
            names.add(node.module.removeprefix("bench."))
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("bench.") for a in node.names if a.name.startswith("bench."))
    return names


def test_scripts_share_helpers_through_bench_common() -> None:
    imported = {name: _bench_imports(BENCH / f"{name}.py") - {"common"} for name in SCRIPTS}
    assert {name: names for name, names in imported.items() if names} == SCRIPT_IMPORTS
    assert _bench_imports(BENCH / "common.py") == set()


def test_bench_common_stays_light_to_import() -> None:
    """bench.scorer_memory measures the memory of processes that import it beside llama_cpp alone."""
    heavy = ["cascade", "distill", "sklearn", "scipy", "pydantic", "onnxruntime", "llama_cpp", *OPTIONAL]
    code = ("import sys, bench.common\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
