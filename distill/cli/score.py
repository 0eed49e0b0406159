"""``cascade score``: answer one System One request with a GGUF model's option-letter logits."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distill.cli.common import add_placement_arguments, placement_of, read_request
from distill.cli.values import whole_number


def _cmd_score(args: argparse.Namespace) -> int:
    from cascade.readout.excerpt import HeadTailExcerpt
    from cascade.readout.scorer import Scorer

    request = read_request(args.request)
    if args.model is None:
        from cascade.readout.llama import default_gguf_path

        args.model = default_gguf_path()
        print(f"no --model given: using the embedded {args.model.name}", file=sys.stderr)
    excerpt = HeadTailExcerpt.parse(args.excerpt) if args.excerpt else None
    place = placement_of(args).model_copy(update={"n_ctx": args.n_ctx})
    scorer = Scorer.placed(args.model, place, max_branches=args.max_branches, template=args.template,
                           layout=args.layout)
    response = scorer.score(
        request,
        path="serial" if args.serial else "fanout",
        permutations=args.permutations,
        excerpt=excerpt,
    )
    print(json.dumps(response.model_dump(mode="json"), indent=2, ensure_ascii=False))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help="answer a System One request with a GGUF model's option-letter logits",
        description=(
            "Answer every question of a System One request ({state, questions}) with ONE forward "
            "pass per question and no generated token: the state is prefilled once and shared by "
            "all questions (fan-out). Prints the System One response JSON."
        ),
        epilog=(
            "example: cascade score --model qwen3.5-4b-q4_k_m.gguf --request req.json "
            "--permutations 4"
        ),
    )
    p.add_argument(
        "--model",
        type=Path,
        help="path of any GGUF model (default: the embedded gemma-3-270m, a small stand-in)",
    )
    p.add_argument("--request", type=Path, required=True, help="System One request JSON file")
    p.add_argument(
        "--serial",
        action="store_true",
        help="snapshot/restore the state per question instead of the fan-out (for comparison)",
    )
    p.add_argument(
        "--permutations",
        type=whole_number(1),
        default=1,
        metavar="K",
        help="average over K balanced option orders to cancel position bias (cost: K x branches)",
    )
    p.add_argument(
        "--excerpt",
        metavar="head_tail:N",
        help="when the prompt is too long, score the first and last N/2 tokens of the state "
        "(default: refuse over-long input)",
    )
    p.add_argument("--n-ctx", type=whole_number(1), default=4096, help="context tokens (default 4096)")
    p.add_argument(
        "--max-branches", type=whole_number(1), default=16, metavar="N",
        help="questions decoded per llama_decode (default 16)",
    )
    add_placement_arguments(p, gpu_default=" 0")
    p.add_argument(
        "--template",
        choices=("auto", "chat", "plain"),
        default="auto",
        help="prompt format: the model's chat template when it has one (auto), or plain",
    )
    p.add_argument(
        "--layout",
        choices=("state-first", "options-first"),
        default="state-first",
        help="the state before the questions (default: the fan-out's), or each question and its "
        "options before the state (a prompt version of its own)",
    )
    p.set_defaults(run=_cmd_score)
