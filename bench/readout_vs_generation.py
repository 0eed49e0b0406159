"""Logit readout vs generating the same answers as JSON, with the same model (goal: at least 5x).

The generation baseline is what a chat-style integration does: one prompt holding the state and
every question with its lettered options, asking for a JSON object of letters, decoded greedily
token by token until the object closes. The readout answers the same questions with the fan-out
(one prefill, one decode for all branches). Both run on the same context, interleaved, with
llama.cpp on one thread, timed in process CPU seconds (robust to neighbours on a shared machine).

    .venv/bin/python -m bench.readout_vs_generation --states 6
"""

from __future__ import annotations

import statistics
import time

from bench.common import argument_parser, many_questions, read_rows
from cascade.questions import DecisionRequest, parse_request
from cascade.readout.llama import default_gguf_path
from cascade.readout.prompts import SYSTEM_TEXT, question_block, render_state
from cascade.readout.scorer import Scorer


def generation_prompt(request: DecisionRequest) -> str:
    blocks = [
        f"[{qid}]\n{question_block(q, range(len(q.option_keys())))}"
        for qid, q in request.questions.items()
    ]
    ids = ", ".join(f'"{qid}": "<letter>"' for qid in request.questions)
    return (
        f"{SYSTEM_TEXT}\n\nEvidence:\n{render_state(request.state)}\n\n" + "\n\n".join(blocks)
        + f"\n\nReply with one JSON object {{{ids}}} and nothing else.\n\nJSON: {{"
    )


def generate(scorer: Scorer, prompt: str, max_tokens: int) -> tuple[float, int]:
    """Greedy decoding until the JSON object closes; returns seconds and generated tokens."""
    ctx = scorer.ctx
    started = time.process_time()
    tokens = scorer._tokens(prompt)
    ctx.clear()
    ctx.decode([(0, 0, tokens)])
    pos, text, generated = len(tokens), "", 0
    while generated < max_tokens and "}" not in text:
        token = int(ctx.logits(0).argmax())
        text += scorer.model.detokenize([token])
        ctx.decode([(0, pos, [token])])
        pos += 1
        generated += 1
    return time.process_time() - started, generated


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--states", type=int, default=6)
    parser.add_argument("--questions", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    scorer = Scorer(default_gguf_path(), n_ctx=4096, max_branches=16, n_threads=1)
    texts = [row["text"] for row in read_rows("sms_spam.jsonl", args.states)]
    print(f"{'N':>3} {'readout s':>9} {'generate s':>10} {'tokens out':>10} {'speed-up':>8}")
    for n in args.questions:
        readout: list[float] = []
        generation: list[float] = []
        produced: list[int] = []
        for text in texts:
            request = parse_request({"state": text, "questions": many_questions(n)})
            started = time.process_time()
            scorer.score(request)
            readout.append(time.process_time() - started)
            seconds, count = generate(scorer, generation_prompt(request), max_tokens=12 * n)
            generation.append(seconds)
            produced.append(count)
        r, g = statistics.median(readout), statistics.median(generation)
        print(f"{n:>3} {r:>9.3f} {g:>10.3f} {statistics.median(produced):>10.0f} {g / r:>7.1f}x")


if __name__ == "__main__":
    main()
