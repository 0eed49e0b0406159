"""The options-first layout against the state-first one: quality on real sets, and tokens.

Two scorers of the same GGUF in one process, one per layout (``cascade.readout.prompts``), read the same
items of each shared dataset in turn (AG News topics, Zomato stars, SMS spam: one question each,
bench/common.py's), with ``--permutations`` balanced option orders. Per dataset and layout:
accuracy against gold, argmax agreement with the state-first layout (1 - the flip rate), mean top
probability, mean probability mass on the option letters, prompt tokens prefilled per item
(after the first two items: the prompt head, a run's shared start, is then held) and seconds per
item.

    PYTHONPATH=. .venv/bin/python -m bench.layout_quality --items 400 --threads 2 \\
        --model "$(.venv/bin/cascade teacher-model qwen2.5-coder-1.5b-instruct)"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from bench.common import TASK_NAMES, TASKS, Task, argument_parser, read_rows
from cascade.questions import parse_request
from cascade.readout.prompts import LAYOUTS, Layout
from cascade.readout.scorer import Scorer


@dataclass
class Reading:
    answer: str
    top: float
    letter_mass: float
    tokens: int
    seconds: float


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True, help="GGUF path")
    parser.add_argument("--items", type=int, default=400, help="items per dataset (the first N)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--permutations", type=int, default=1)
    parser.add_argument("--tasks", nargs="+", default=list(TASK_NAMES))
    args = parser.parse_args()
    scorers = {layout: Scorer(args.model, n_ctx=2048, max_branches=max(4, args.permutations),
                              n_threads=args.threads, layout=layout) for layout in LAYOUTS}
    print(f"{scorers['state-first'].model.path.name}, {args.threads} threads, {args.permutations} option "
          f"order(s), the first {args.items} items of each set\n")
    print(f"{'set':<10} {'layout':<14} {'accuracy':>9} {'agrees w/ state-first':>22} {'mean top p':>11} "
          f"{'letter mass':>12} {'tokens/item':>12} {'s/item':>7}")
    for task in (t for t in TASKS if t.name in args.tasks):
        readings, gold = _read(task, scorers, args)
        base = [r.answer for r in readings["state-first"]]
        for layout in LAYOUTS:
            print(f"{task.name:<10} {layout:<14} {_row(readings[layout], gold, base)}")
    for scorer in scorers.values():
        scorer.close()


def _row(rows: list[Reading], gold: list[str], base: list[str]) -> str:
    """Accuracy, agreement with state-first, mean top p and letter mass over every item; tokens
    and seconds over the items after the first two (the head is then held)."""
    accuracy = np.mean([r.answer == g for r, g in zip(rows, gold, strict=True)])
    agreement = np.mean([r.answer == b for r, b in zip(rows, base, strict=True)])
    top, mass = statistics.mean(r.top for r in rows), statistics.mean(r.letter_mass for r in rows)
    steady = rows[2:]
    tokens, seconds = statistics.mean(r.tokens for r in steady), statistics.mean(r.seconds for r in steady)
    return f"{accuracy:>9.3f} {agreement:>22.3f} {top:>11.3f} {mass:>12.3f} {tokens:>12.1f} {seconds:>7.3f}"


def _read(task: Task, scorers: dict[Layout, Scorer], args: argparse.Namespace
          ) -> tuple[dict[Layout, list[Reading]], list[str]]:
    rows = read_rows(task.file, args.items)
    readings: dict[Layout, list[Reading]] = {layout: [] for layout in LAYOUTS}
    gold = []
    for i, row in enumerate(tqdm(rows, desc=task.name, file=sys.stderr)):
        request = parse_request({"state": row["text"], "questions": task.questions})
        gold.append(task.option_key(row["label"]))
        for layout in (LAYOUTS if i % 2 == 0 else LAYOUTS[::-1]):  # alternate who goes first
            began = time.perf_counter()
            response = scorers[layout].score(request, permutations=args.permutations)
            seconds = time.perf_counter() - began
            (answer,) = response.answers.values()
            probabilities = answer.probabilities
            readings[layout].append(Reading(
                answer=max(probabilities, key=lambda key: probabilities[key]),
                top=max(probabilities.values()),
                letter_mass=answer.readout.letter_mass if answer.readout else float("nan"),
                tokens=response.usage.input_tokens, seconds=seconds))
    return readings, gold


if __name__ == "__main__":
    main()
