"""What reading a GGUF middle tier in the batch calibration certified costs, in prompt tokens.

The router asks a GGUF tier below the top every question of the bundle about a state that
reaches it (``cascade.routing.router.Cascade._shape``), because a fan-out's probabilities move with the
batch decoded together and calibration scored that batch. A state that escalates one question
then runs the template, the state and every question block instead of that question's block
alone. This counts both with gemma-3-270m's tokenizer on the demo's questions, for the demo's
generated messages and for states of a given token length.

    .venv/bin/python -m bench.middle_shape --states 200 --long 500
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.common import argument_parser
from cascade.readout.llama import default_gguf_path
from cascade.readout.prompts import question_block, render_state
from cascade.readout.scorer import Scorer
from distill.demo.synthetic import demo_questions, generate


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--states", type=int, default=200, help="demo messages to average over")
    parser.add_argument("--long", type=int, default=500, help="token length of a long state")
    args = parser.parse_args()
    scorer = Scorer(Path(default_gguf_path()), n_ctx=1024, max_branches=3, n_threads=1)
    try:
        def count(text: str) -> int:
            return len(scorer.model.tokenize(text))

        questions = demo_questions()
        blocks = {qid: count(question_block(q, list(range(len(q.option_keys())))))
                  for qid, q in questions.items()}
        template = count(scorer.template.render("", ""))
        state = statistics.mean(count(render_state(item.text)) for item in generate(args.states, 0))
    finally:
        scorer.close()
    print(f"gemma-3-270m tokens: template {template}, demo state mean {state:.1f} ({args.states} "
          f"messages), question blocks {blocks}")
    print(f"{'state':>10} {'question':<11} {'alone':>6} {'all':>6} {'ratio':>6}")
    for label, tokens in ((f"demo {state:.0f}", state), (f"long {args.long}", float(args.long))):
        full = template + tokens + sum(blocks.values())
        for qid, block in blocks.items():
            alone = template + tokens + block
            print(f"{label:>10} {qid:<11} {alone:>6.0f} {full:>6.0f} {full / alone:>5.2f}x")


if __name__ == "__main__":
    main()
