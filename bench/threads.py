"""Threads that fit the machine: one thread against all cores, idle and beside a busy neighbour.

Every command that runs a model takes ``--threads``; this measures what the default should be.
Three workloads, each the compute a command spends its time in:

- the teacher's readout of a state (``cascade label``, and every escalation of ``decide``,
  ``serve`` and the library call): ``Scorer.score``, one prefill and one decode of the questions;
- the mid-layer tier's states (``cascade train --mid-layer``): ``LayerScorer.states``;
- the encoder (every routed item): ``Encoder.encode`` of one text at a time.

Each runs with 1 thread and with all cores, side by side in one process (the two settings take
turns on every item), first on an idle machine, then with a neighbour: a child process that keeps
one core busy, as another job or a second replica would. Wall seconds per item, medians, and the
ratio all-cores / 1 thread (above 1: one thread is faster).

Then the default a model loaded without ``--threads`` takes (``default_threads``: the cores less
what other processes keep busy now) against the 1-minute load average's rule it replaced, in four
conditions: idle; beside the busy neighbour; just after a neighbour that kept a core busy for
``--settle`` seconds ended; and just after this process's own ``--settle`` seconds of work (an
earlier step of the same command, as the demo's training is before its middle tier loads). The
right choice is the faster fixed count of the timing rows: all cores where nothing else runs now.

    .venv/bin/python -m bench.threads --model qwen2.5-coder-1.5b-instruct --items 6
    .venv/bin/python -m bench.threads --items 10          # the embedded gemma-3-270m
    .venv/bin/python -m bench.threads --only choice       # the default's choices alone
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from bench.common import WALL, argument_parser, interleaved, markdown, read_rows

SPIN = "while True:\n    pass\n"


@contextmanager
def neighbour(busy: bool) -> Any:
    """A child process that keeps one core busy for the block (none when not ``busy``)."""
    child = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        yield
    finally:
        if child is not None:
            child.kill()
            child.wait()


def workloads(model: str | None, layer: int | None) -> dict[str, Callable[[int], Callable[[str], object]]]:
    """Per workload, a factory: threads -> a call on one state's text."""
    from bench.common import TOPIC
    from cascade.encoder.onnx_encoder import Encoder
    from cascade.questions import parse_request
    from cascade.readout.layer_scorer import LayerScorer
    from cascade.readout.llama import default_gguf_path
    from cascade.readout.scorer import Scorer
    from distill.labelling.teachers import teacher_path

    path = default_gguf_path() if model is None else teacher_path(model)

    def request(text: str) -> Any:
        return parse_request({"state": text, "questions": TOPIC})

    def readout(threads: int) -> Callable[[str], object]:
        scorer = Scorer(path, n_ctx=2048, max_branches=4, n_threads=threads)
        return lambda text: scorer.score(request(text))

    def mid_layer(threads: int) -> Callable[[str], object]:
        scorer = Scorer(path, n_ctx=512, max_branches=1, n_threads=1)
        blocks = layer or max(1, scorer.model.n_layer * 2 // 3)
        scorer.close()
        layers = LayerScorer(path, [blocks], n_ctx=2048, max_branches=4, n_threads=threads)
        return lambda text: layers.states(request(text))

    def encoder(threads: int) -> Callable[[str], object]:
        model_ = Encoder(threads=threads)
        return lambda text: model_.encode([text])

    return {"teacher readout (label, decide, serve, library)": readout,
            "mid-layer states (train --mid-layer)": mid_layer, "encoder (every routed item)": encoder}


def measure(factory: Callable[[int], Callable[[str], object]], texts: list[str], cores: int,
            busy: bool) -> tuple[float, float]:
    """Median wall seconds per item with 1 thread and with ``cores``, taking turns per item."""
    contenders = {"1": factory(1), "all": factory(cores)}
    for call in contenders.values():
        call(texts[0])  # warm-up
    with neighbour(busy):
        seconds = interleaved(contenders, texts, WALL, rotate=True)
    return statistics.median(seconds["1"]["wall"]), statistics.median(seconds["all"]["wall"])


def choices(cores: int, settle: float) -> list[list[str]]:
    """What the default and the load average's rule choose, in each condition (see the module)."""
    import time

    import numpy as np

    from cascade.readout.placement import default_threads

    def chosen(condition: str) -> list[str]:
        threads, why = default_threads()
        by_load = max(1, min(cores, round(cores - os.getloadavg()[0])))
        return [condition, str(threads), str(by_load), why]

    rows = [chosen("idle")]
    with neighbour(True):
        time.sleep(1.0)
        rows.append(chosen("beside a busy neighbour"))
    with neighbour(True):
        time.sleep(settle)
    rows.append(chosen(f"a neighbour busy for {settle:g} s just ended"))
    square = np.ones((256, 256), dtype=np.float32)
    ends = time.monotonic() + settle
    while time.monotonic() < ends:  # this process's own earlier step
        square = square @ square / 256
    rows.append(chosen(f"after this process's own {settle:g} s of work"))
    return rows


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", help="a packaged teacher (cascade teacher-model --list; default: "
                        "the embedded gemma-3-270m)")
    parser.add_argument("--items", type=int, default=6, help="AG News items per setting (default 6)")
    parser.add_argument("--layer", type=int, help="blocks of the mid-layer workload (default 2/3)")
    parser.add_argument("--only", help="run the workloads whose name starts with this ('choice': the "
                        "default's choices alone)")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds of earlier work before a "
                        "choice is measured (default 30)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    texts = [row["text"] for row in read_rows("ag_news_test.jsonl", args.items + 1)]
    rows = []
    for name, factory in workloads(args.model, args.layer).items():
        if args.only and not name.startswith(args.only):
            continue
        for busy in (False, True):
            one, every = measure(factory, texts, cores, busy)
            rows.append([name, "busy neighbour" if busy else "idle", f"{one:.3f}", f"{every:.3f}",
                         f"{every / one:.2f}"])
            print(" | ".join(rows[-1]), flush=True)
    if rows:
        print(f"\nmodel {args.model or 'gemma-3-270m (embedded)'}; {cores} cores; {args.items} items each")
        print(markdown(["workload", "machine", "1 thread s/item", f"{cores} threads s/item",
                        "all / 1"], rows))
    if args.only and not "choice".startswith(args.only):
        return
    print(markdown(["condition", "default threads", "load-average rule", "why (the default's record)"],
                   choices(cores, args.settle)))


if __name__ == "__main__":
    main()
