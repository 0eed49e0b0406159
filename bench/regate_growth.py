"""A growth run's gates decided again by the library's rule as it stands (``distill.loop.promote``).

``bench.serve_growth`` leaves each run's folder behind (``CACHE/serve_growth/runs/STAMP``): the
store, every bundle it made, and the promotions log. This copies a run folder and weighs every
logged gate again on the copy: the same candidate against the same serving bundle, on the same
store, attempt 1 (``--log`` is fresh per gate). Where the gate now promotes a candidate that was
kept aside, the candidate, served with the thresholds this gate certified, decides the 1,000
held-out items as ``bench.serve_growth`` does (the replay upstream as teacher).

A run's decisions are a chain: once one gate decides otherwise, the store that later gates read
would have filled differently, so only the gates up to and including the first that differs are
a valid counterfactual (the table marks it). A promoted candidate's manifest was rewritten by its
gate; it is weighed again at the delta that gate was asked for (its ``asked_delta``), so its row
is the same decision made again: a consistency check.

    PYTHONPATH=. .venv/bin/python -m bench.regate_growth CACHE/serve_growth/runs/STAMP ...
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import markdown, process
from bench.serve_growth import WORK, held_out, items_in_order
from distill.loop.promote import promote
from distill.options import RunOptions
from distill.store import LabelStore


def regate(run: Path, copy: Path, teacher: str, held: list[Any]) -> list[list[str]]:
    """One run's rows: every logged gate weighed again on ``copy``."""
    shutil.copytree(run, copy, symlinks=True)
    gates = [json.loads(line) for line in (run / "serving.promotions.jsonl").read_text().splitlines()
             if line.strip()]
    rows, differed = [], False
    for k, logged in enumerate(gates, start=1):
        link = copy / f"gate{k}.link"
        link.symlink_to(copy / Path(logged["serving"]["path"]).relative_to(run))
        candidate = copy / Path(logged["candidate"]["path"]).relative_to(run)
        with LabelStore.open_existing(copy / "labels.sqlite") as store:
            now = promote(link, candidate, store, run=RunOptions(progress=False), log=copy / f"gate{k}.jsonl")
        then, gate = logged["gate"], now.gate
        kept = ""
        if now.promoted and not logged["promoted"]:
            figures = held_out(candidate, held, teacher, 2, WORK / "embeddings")
            kept = f"{figures['kept']:.1%} ({figures['agreement_kept']:.4f})"
        valid = "" if not differed else " (after a differing gate)"
        differed = differed or now.promoted != logged["promoted"]
        rows.append([run.name, f"{k}{valid}", f"{gate.items} + {gate.evaluated}",
                     f"{then['serving_plugin']:.3f} -> {then['candidate_plugin']:.3f}, "
                     f"{then['lower_bound']:+.3f}: " + ("promoted" if logged["promoted"] else "kept aside"),
                     f"{gate.serving_plugin:.3f} -> {gate.candidate_plugin:.3f}, {gate.lower_bound:+.3f}",
                     "promoted" if now.promoted else "kept aside", kept])
        print(f"{run.name} gate {k}: done", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="growth run folders (serve_growth/runs/STAMP)")
    parser.add_argument("--port", type=int, default=18791, help="the replay upstream's port")
    args = parser.parse_args()
    held = items_in_order()[-1000:]
    upstream = f"http://127.0.0.1:{args.port}"
    rows: list[list[str]] = []
    replay = [sys.executable, "-m", "bench.serve_upstream", "upstream", "--port", str(args.port)]
    with tempfile.TemporaryDirectory() as scratch, process(replay, upstream):
        for run in args.runs:
            rows += regate(run, Path(scratch) / run.name, f"{upstream}/v1/systemone", held)
    print(markdown(["run", "gate", "items (certifying + evaluation)",
                    "logged: plug-in serving -> candidate, bound", "now: band serving -> candidate, bound",
                    "decision now",
                    "held out, newly promoted, with this gate's thresholds (agreement)"], rows))


if __name__ == "__main__":
    main()
