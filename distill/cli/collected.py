"""``cascade collected``: what a pass-through collected, as a trainer reads it; and the training set."""

from __future__ import annotations

import argparse
from pathlib import Path

from distill.cli.common import STORE_METAVAR, store_argument
from distill.cli.values import whole_number

DESCRIPTION = """\
Read the traffic a pass-through collected (cascade serve --teacher URL --collect S) and count each
distinct question by content (whatever ids clients gave it), once per distinct state that asked
it. Questions asked at least --min-count times would get a head; the rest are listed with their
counts. With --out, write the training set: DIR/questions.json (those questions), DIR/corpus.jsonl
(each distinct state once) and the upstream's answers as labels in the same store, so that
`cascade train --questions DIR/questions.json --corpus DIR/corpus.jsonl --store S` trains on them."""


def _cmd_collected(args: argparse.Namespace) -> int:
    from distill.loop.collected import census, collected, training_set

    found = training_set(args.store, args.out, args.min_count) if args.out is not None else \
        census(collected(args.store), args.min_count)
    print(f"{found.items} collected request(s), {found.states} distinct state(s)")
    for title, questions in ((f"asked >= {args.min_count} times (a head each)", found.heads),
                             (f"asked < {args.min_count} times (no head)", found.rest)):
        print(f"{title}: {len(questions)}")
        for q in questions:
            print(f"  {q.id:<24} {q.question.type:<7} {q.count:>7}  {q.question.instructions_text()[:60]}"
                  f"{_also(q.id, list(q.ids))}")
    if args.out is not None:
        print(f"wrote {args.out}/questions.json and {args.out}/corpus.jsonl, and the labels into "
              f"{args.store}; next: cascade train --questions {args.out}/questions.json --corpus "
              f"{args.out}/corpus.jsonl --store {args.store} --bundle DIR")
    return 0


def _also(name: str, ids: list[str]) -> str:
    others = sorted(set(ids) - {name})
    return f" (also asked as {', '.join(others[:3])}{'...' if len(others) > 3 else ''})" if others else ""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collected", help="the questions a pass-through collected, and a training set of them",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=store_argument, required=True, metavar=STORE_METAVAR,
                   help="the store given to cascade serve --collect")
    p.add_argument("--min-count", type=whole_number(1), default=50, metavar="N",
                   help="distinct states a question must have been asked about to get a head (default 50)")
    p.add_argument("--out", type=Path, metavar="DIR", help="write the training set here")
    p.set_defaults(run=_cmd_collected)
