"""The scorer's overhead over raw ``llama_decode`` of exactly the same tokens (goal: at most 5%).

The baseline gets the scorer's own token rows precomputed, so it times only llama.cpp's work: clear
the memory, decode the shared prefix, copy it to the branches, decode all suffixes in one batch,
drop the branches. The scorer times everything a caller pays: prompt rendering, tokenisation,
letter readout over the vocabulary, answer building. Interleaved rounds, medians, one process;
llama.cpp on one thread and process CPU time, so that neighbours on a shared machine do not count.

    .venv/bin/python -m bench.scorer_overhead --rounds 5
"""

from __future__ import annotations

import statistics
import time

import llama_cpp

from bench.common import argument_parser, many_questions, read_rows
from cascade.questions import DecisionRequest, parse_request
from cascade.readout.llama import default_gguf_path
from cascade.readout.scorer import Scorer, _shared_prefix


def raw_rows(scorer: Scorer, request: DecisionRequest) -> tuple[list[int], list[list[int]]]:
    branches, _ = scorer._branches(request, 1, None)
    shared = _shared_prefix(branches)
    return branches[0].tokens[:shared], [b.tokens[shared:] for b in branches]


def fill(batch: llama_cpp.llama_batch, rows: list[tuple[int, int, list[int]]], outputs: bool) -> None:
    n = 0
    for seq, pos, tokens in rows:
        for j, token in enumerate(tokens):
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos + j, 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = outputs and j == len(tokens) - 1
            n += 1
    batch.n_tokens = n


def raw_decode(scorer: Scorer, prefix: list[int], suffixes: list[list[int]]) -> float:
    ctx = scorer.ctx._ctx
    mem = llama_cpp.llama_get_memory(ctx)
    pre = llama_cpp.llama_batch_init(len(prefix), 0, 1)
    branch = llama_cpp.llama_batch_init(sum(map(len, suffixes)), 0, 1)
    fill(pre, [(0, 0, prefix)], outputs=False)
    fill(branch, [(i + 1, len(prefix), s) for i, s in enumerate(suffixes)], outputs=True)
    started = time.process_time()
    llama_cpp.llama_memory_clear(mem, True)
    assert llama_cpp.llama_decode(ctx, pre) == 0
    for seq in range(1, len(suffixes) + 1):
        llama_cpp.llama_memory_seq_cp(mem, 0, seq, -1, -1)
    assert llama_cpp.llama_decode(ctx, branch) == 0
    for seq in range(1, len(suffixes) + 1):
        llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
    seconds = time.process_time() - started
    llama_cpp.llama_batch_free(pre)
    llama_cpp.llama_batch_free(branch)
    return seconds


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--questions", type=int, nargs="+", default=[1, 8, 16])
    args = parser.parse_args()
    scorer = Scorer(default_gguf_path(), n_ctx=4096, max_branches=16, n_threads=1)
    texts = [row["text"] for row in read_rows("ag_news_test.jsonl", 6)]
    print(f"{'N':>3} {'raw decode s':>12} {'scorer s':>9} {'overhead':>9}")
    for n in args.questions:
        requests = [parse_request({"state": t, "questions": many_questions(n)}) for t in texts]
        raw: list[float] = []
        full: list[float] = []
        for _ in range(args.rounds):
            for request in requests:
                prefix, suffixes = raw_rows(scorer, request)
                raw.append(raw_decode(scorer, prefix, suffixes))
                started = time.process_time()
                scorer.score(request)
                full.append(time.process_time() - started)
        r, f = statistics.median(raw), statistics.median(full)
        print(f"{n:>3} {r:>12.4f} {f:>9.4f} {100 * (f / r - 1):>8.1f}%")


if __name__ == "__main__":
    main()
