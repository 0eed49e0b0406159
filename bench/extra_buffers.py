"""What llama.cpp's extra buffer types (CPU weight repacking) are worth where they work.

``extra_buffers="auto"`` turns them off only where llama.cpp reports AMX (whose buffers crash
some Intel Xeons); this measures what the default keeps on every other CPU. Two scorers on the
same GGUF, one with extra buffers and one without, answer the same requests in alternating
rounds in one process: llama.cpp on one thread, process CPU time, medians, so neighbours on a
shared machine do not count. Also prints how far the two readings differ (repacked kernels sum
in another order).

    .venv/bin/python -m bench.extra_buffers --rounds 5
    .venv/bin/python -m bench.extra_buffers --model qwen2.5-coder-1.5b-instruct --rounds 3
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from bench.common import argument_parser, question_set, read_rows
from cascade.questions import DecisionRequest, parse_request
from cascade.readout.llama import default_gguf_path
from cascade.readout.placement import reports_amx, system_info
from cascade.readout.scorer import Scorer
from distill.labelling.teachers import TEACHERS, teacher_path


def model_path(name: str | None) -> Path:
    return default_gguf_path() if name is None else teacher_path(name)


def timed(scorer: Scorer, request: DecisionRequest) -> tuple[float, np.ndarray]:
    started = time.process_time()
    response = scorer.score(request)
    seconds = time.process_time() - started
    probs = np.concatenate([list(a.probabilities.values()) for a in response.answers.values()])
    return seconds, probs


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", choices=sorted(TEACHERS),
                        help="a packaged teacher (default: the embedded gemma-3-270m)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--texts", type=int, default=6)
    parser.add_argument("--questions", type=int, default=4)
    args = parser.parse_args()
    path = model_path(args.model)
    print(f"model {path.name}; llama.cpp: {system_info().strip()}")
    if reports_amx(system_info()):
        raise SystemExit("bench.extra_buffers: llama.cpp reports AMX_INT8 here, where extra buffers "
                         "segfault the first decode (llama.cpp issue 20824): nothing to measure")
    scorers = {mode: Scorer(path, n_ctx=2048, max_branches=16, n_threads=1, extra_buffers=mode)
               for mode in ("on", "off")}
    requests = [parse_request({"state": row["text"], "questions": question_set(args.questions)})
                for row in read_rows("ag_news_test.jsonl", args.texts)]
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    spread: list[float] = []
    for _ in range(args.rounds):
        for request in requests:
            readings = {}
            for mode, scorer in scorers.items():
                seconds[mode].append(timed(scorer, request)[0])
                readings[mode] = timed(scorer, request)[1]
            spread.append(float(np.abs(readings["on"] - readings["off"]).max()))
    on, off = statistics.median(seconds["on"]), statistics.median(seconds["off"])
    print(f"{'extra buffers':>13} {'median s/request':>16}")
    print(f"{'on':>13} {on:>16.4f}\n{'off':>13} {off:>16.4f}")
    print(f"off / on = {off / on:.2f}x the CPU time; max |dp| between them {max(spread):.4f}")


if __name__ == "__main__":
    main()
