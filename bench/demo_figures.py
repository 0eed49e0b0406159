"""The default demo's figures: measured once, shown on every page from one file.

``--run`` runs ``cascade demo`` as a newcomer does right after the README's install (a new
working folder, no flags), times the whole command, and writes what it printed into
``docs/figures/demo.json``; then, as plain ``--write`` does, it rewrites the marked blocks of the
pages that show them (README.md, docs/getting-started.md, docs/benchmarks/loading-and-demo.md,
BENCHMARKS.md) from that file. ``tests/test_demo_figures.py`` checks every block against the
file, so the pages cannot drift apart, and a new run changes them all at once.

    .venv/bin/python -m bench.demo_figures --run        # about 2.5 minutes on 2 cores
    .venv/bin/python -m bench.demo_figures --write      # the pages again, from the file
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from pydantic import BaseModel

from bench.common import argument_parser

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures" / "demo.json"
COMMAND = ".venv/bin/cascade demo"
PAGES = {"README.md": "table", "docs/getting-started.md": "table",
         "docs/benchmarks/loading-and-demo.md": "run", "BENCHMARKS.md": "row"}
"""Each page with demo figures, and the block it shows."""
BLOCK = re.compile(r"(<!-- demo-figures: (?P<kind>\w+) -->\n)(?P<body>.*?)(<!-- /demo-figures -->)", re.S)
"""A marked block: between its two comments, which show on no page."""
ROW = re.compile(r"^\| \[The default demo\]\(.*\n", re.M)
"""BENCHMARKS.md's row, found by its link (a comment line would end the table)."""


class DemoFigures(BaseModel):
    """What one default ``cascade demo`` printed, and where and how long it ran."""

    measured_on: str
    machine: str
    wall_seconds: float
    steps: dict[str, float]
    answers: int
    evaluation_items: int
    encoder_share: float
    teacher_share: float
    agreement: float
    target: float
    cost_ratio: float
    middle_tier: str


def run_demo() -> DemoFigures:
    """Run the default demo in a new folder, timed as a whole command."""
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "distill.cli", "demo", "--workdir", workdir],
                              check=True, capture_output=True, text=True)
        wall = time.perf_counter() - start
        evaluation = json.loads((Path(workdir) / "evaluation.json").read_text(encoding="utf-8"))
        manifest = json.loads((Path(workdir) / "bundle" / "manifest.json").read_text(encoding="utf-8"))
    shares = {tier["name"]: tier["share"] for tier in evaluation["tiers"]}
    payoffs = manifest["calibration"]["payoffs"]
    return DemoFigures(
        measured_on=date.today().isoformat(), machine=_machine(), wall_seconds=wall,
        steps=_steps(done.stdout), answers=evaluation["answers"], evaluation_items=evaluation["items"],
        encoder_share=shares["encoder"], teacher_share=shares["teacher"], agreement=evaluation["agreement"],
        target=manifest["calibration"]["target"], cost_ratio=evaluation["cost_ratio"],
        middle_tier=next(iter(payoffs.values()))["reason"] if payoffs else "none")


def render(kind: str, figures: DemoFigures) -> str:
    """The markdown a page shows for block ``kind``: table, run or row."""
    wall = _minutes(figures.wall_seconds)
    if kind == "table":
        return ("| | default run |\n|---|---|\n"
                f"| time | {wall} on {figures.machine}, the first run after the install |\n"
                f"| gemma-3-270m (middle tier) | {figures.middle_tier} |\n"
                f"| encoder answers | {figures.encoder_share:.1%} of the {figures.answers} evaluation "
                "answers |\n"
                f"| teacher answers | {figures.teacher_share:.1%} |\n"
                f"| agreement with the teacher | {figures.agreement:.4f} (target {figures.target:g}) |\n"
                f"| cost against the teacher alone | {figures.cost_ratio:.3f} |\n")
    if kind == "run":
        steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in figures.steps.items())
        return (f"Measured on {figures.measured_on} on {figures.machine}, the first run after the install "
                f"(`{COMMAND}`): {wall} in all ({steps}). The encoder answered "
                f"**{figures.encoder_share:.1%}** of the {figures.answers} evaluation answers, the teacher "
                f"{figures.teacher_share:.1%}, at agreement {figures.agreement:.4f} (target "
                f"{figures.target:g}) and **{figures.cost_ratio:.3f}** of the teacher's cost. Gemma: "
                f"{figures.middle_tier}.\n")
    if kind == "row":
        return ("| [The default demo](docs/benchmarks/loading-and-demo.md#the-default-demo-the-gguf-middle-"
                "tier-measured-and-taken-out-cascade-demo) | - | encoder "
                f"{figures.encoder_share:.1%}, teacher {figures.teacher_share:.1%}, agreement "
                f"{figures.agreement:.4f}, cost {figures.cost_ratio:.3f}; gemma taken out on a sample; "
                f"{wall} | `cascade demo` |\n")
    raise ValueError(f"no demo-figures block {kind!r}: one of table, run, row")


def blocks(text: str) -> list[tuple[str, str]]:
    """The (kind, body) of every marked block of a page, and of the BENCHMARKS row."""
    return ([(match["kind"], match["body"]) for match in BLOCK.finditer(text)]
            + [("row", match[0]) for match in ROW.finditer(text)])


def rewrite(text: str, figures: DemoFigures) -> str:
    """``text`` with every marked block, and the BENCHMARKS row, rendered anew from ``figures``."""
    marked = BLOCK.sub(lambda match: match[1] + render(match["kind"], figures) + match[4], text)
    return ROW.sub(lambda _: render("row", figures), marked)


def load() -> DemoFigures:
    return DemoFigures.model_validate_json(FIGURES.read_text(encoding="utf-8"))


def _steps(stdout: str) -> dict[str, float]:
    """The demo's "time per step: teacher 0.3 s, train 51.8 s, ..." line, as a mapping."""
    line = next(line for line in stdout.splitlines() if line.startswith("time per step: "))
    return {name: float(seconds) for name, seconds in re.findall(r"(\w+) ([\d.]+) s", line)}


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{os.cpu_count()} cores ({model})"


def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--run", action="store_true", help="run the demo and record its figures first")
    parser.add_argument("--write", action="store_true", help="rewrite the pages' blocks from the file")
    args = parser.parse_args()
    if not (args.run or args.write):
        parser.error("give --run (measure, then write the pages) or --write (the pages from the file)")
    if args.run:
        FIGURES.parent.mkdir(parents=True, exist_ok=True)
        FIGURES.write_text(run_demo().model_dump_json(indent=2) + "\n", encoding="utf-8")
    figures = load()
    for page in PAGES:
        path = ROOT / page
        path.write_text(rewrite(path.read_text(encoding="utf-8"), figures), encoding="utf-8")
    print(render("run", figures))


if __name__ == "__main__":
    main()
