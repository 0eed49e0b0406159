"""Write the corpus and questions file that a real teacher labels for the benchmarks.

The items are bench.common's seeded ``sample`` of a shared dataset, the one bench/cascade_goals.py
and bench/encoder_quality.py draw (``--items`` of them, in sample order, so a larger ``--items``
extends the same corpus and a resumed ``cascade label`` keeps every label it has; ``--skip``
leaves out the items another store labelled). Only ids and texts go into the corpus; the gold
labels stay behind, and benchmarks join them back by id.
The labels themselves come from the project's own command, run as a user would (see
bench/labels/README.md for the exact commands and the teacher's sha256):

    .venv/bin/python -m bench.teacher_corpus --task ag_news --items 4000 --out /work/teacher-runs/ag_news
    .venv/bin/cascade label --teacher "$(.venv/bin/cascade teacher-model qwen2.5-coder-1.5b-instruct)" \\
        --questions /work/teacher-runs/ag_news/questions.json \\
        --corpus /work/teacher-runs/ag_news/corpus.jsonl \\
        --store /work/teacher-runs/ag_news/labels.sqlite --threads 1
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import TASK_NAMES, argument_parser, sample, task_named


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--task", choices=TASK_NAMES, required=True)
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--skip", type=int, default=0, metavar="N",
                        help="leave out the sample's first N items (labelled already, in another store)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    args = parser.parse_args()
    task = task_named(args.task)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "corpus.jsonl").open("w", encoding="utf-8") as corpus:
        for row in sample(task, args.items, args.seed)[args.skip:]:
            corpus.write(json.dumps({"id": row["id"], "text": row["text"]}, ensure_ascii=False) + "\n")
    (args.out / "questions.json").write_text(json.dumps({"questions": task.questions}, indent=2) + "\n",
                                             encoding="utf-8")
    print(f"wrote {args.items - args.skip} {task.name} items and their questions to {args.out}")


if __name__ == "__main__":
    main()
