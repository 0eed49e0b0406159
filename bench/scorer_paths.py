"""Fan-out vs serial restore vs one fresh prompt per question, with a roofline reading.

For N = 1, 4, 8, 16 questions about states of about 100 and 500 tokens, the three decode paths run
side by side in one process (interleaved, several rounds; medians), on the same requests. Time is
the process's CPU time with llama.cpp on ONE thread (and numpy's BLAS on one thread for the peak):
on a shared machine, wall time measures the neighbours, CPU time measures the work. The roofline
columns divide the FLOPs each path computes (2 x matmul parameters x tokens, plus attention, from
cascade.cost.roofline) by its CPU time, as a share of one core's measured float32 matmul throughput;
"useful" counts only the fan-out's tokens, the least any path must compute.

    .venv/bin/python -m bench.scorer_paths --rounds 2
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from bench.common import argument_parser, many_questions, peak_rss_mib, read_rows
from cascade.cost.roofline import ModelShape, decision_flops
from cascade.questions import DecisionRequest, parse_request
from cascade.readout.llama import default_gguf_path
from cascade.readout.scorer import PATHS, Scorer


def state_of(scorer: Scorer, tokens: int) -> str:
    """Real review text, concatenated until it is about ``tokens`` long."""
    parts: list[str] = []
    for row in read_rows("zomato_restaurant_reviews.jsonl", 400):
        parts.append(row["text"])
        if len(scorer.model.tokenize(" ".join(parts))) >= tokens:
            break
    text = " ".join(parts)
    return scorer.model.detokenize(scorer.model.tokenize(text)[:tokens])


def time_path(scorer: Scorer, request: DecisionRequest, path: str) -> tuple[float, int]:
    started = time.process_time()
    response = scorer.score(request, path=path)  # type: ignore[arg-type]
    return time.process_time() - started, response.usage.input_tokens


def path_flops(shape: ModelShape, path: str, tokens: int, n: int) -> float:
    """FLOPs a path computes: ``fresh`` runs n separate prompts (attention within each only)."""
    if path == "fresh":
        return n * decision_flops(shape, tokens // n, output_rows=1)
    return decision_flops(shape, tokens, output_rows=n)


def one_core_flops() -> float:
    """float32 matmul FLOP/s of one core, in CPU time (best of several)."""
    a = np.ones((512, 512), dtype=np.float32)
    best = 0.0
    with threadpool_limits(1):
        for _ in range(20):
            started = time.process_time()
            for _ in range(5):
                a @ a
            best = max(best, 5 * 2 * 512**3 / max(time.process_time() - started, 1e-9))
    return best


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--state-tokens", type=int, nargs="+", default=[100, 500])
    args = parser.parse_args()
    model = default_gguf_path()
    shape = ModelShape.from_gguf(model)
    cpu_flops = one_core_flops()
    scorer = Scorer(model, n_ctx=4096, max_branches=16, n_threads=1)
    print(f"{model.name}: {shape.n_params_matmul / 1e6:.0f}M matmul parameters; one core's measured "
          f"float32 matmul peak {cpu_flops / 1e9:.1f} GFLOP/s; llama.cpp on 1 thread; CPU seconds")
    print(f"{'state':>5} {'N':>3} {'path':<7} {'tokens':>6} {'median s':>9} {'vs fanout':>9} "
          f"{'% of peak':>9} {'useful %':>8}")
    for state_tokens in args.state_tokens:
        state = state_of(scorer, state_tokens)
        for n in args.sizes:
            request = parse_request({"state": state, "questions": many_questions(n)})
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            tokens: dict[str, int] = {}
            for _ in range(args.rounds):
                for path in PATHS:
                    seconds, tokens[path] = time_path(scorer, request, path)
                    times[path].append(seconds)
            base = statistics.median(times["fanout"])
            useful = path_flops(shape, "fanout", tokens["fanout"], n)
            for path in PATHS:
                med = statistics.median(times[path])
                flops = path_flops(shape, path, tokens[path], n)
                print(f"{state_tokens:>5} {n:>3} {path:<7} {tokens[path]:>6} {med:>9.3f} "
                      f"{med / base:>8.2f}x {100 * flops / med / cpu_flops:>8.0f}% "
                      f"{100 * useful / med / cpu_flops:>7.0f}%")
    print(f"peak RSS {peak_rss_mib():.0f} MiB (model file {model.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
