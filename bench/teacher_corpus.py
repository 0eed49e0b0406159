"""Write the corpus and questions file that a real teacher labels for the benchmarks.

The items are bench/cascade_goals.py's seeded sample of a shared dataset (``--items`` of them, in
sample order, so a larger ``--items`` extends the same corpus and a resumed ``cascade label``
keeps every label it has; ``--skip`` leaves out the items another store labelled). Only ids
and texts go into the corpus; the gold labels stay behind, and benchmarks join them back by id.
The labels themselves come from the project's own command, run as a user would (see
bench/labels/README.md for the exact commands and the teacher's sha256):

    .venv/bin/python -m bench.teacher_corpus --task ag_news --items 4000 --out /work/teacher-runs/ag_news
    .venv/bin/cascade label --teacher "$(.venv/bin/cascade teacher-model qwen2.5-coder-1.5b-instruct)" \\
        --questions /work/teacher-runs/ag_news/questions.json \\
        --corpus /work/teacher-runs/ag_news/corpus.jsonl \\
        --store /work/teacher-runs/ag_news/labels.sqlite --threads 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.cascade_goals import sample
from bench.encoder_quality import TASKS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=[task.name for task in TASKS], required=True)
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--skip", type=int, default=0, metavar="N",
                        help="leave out the sample's first N items (labelled already, in another store)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    args = parser.parse_args()
    task = next(task for task in TASKS if task.name == args.task)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "corpus.jsonl").open("w", encoding="utf-8") as corpus:
        for row in sample(task, args.items, args.seed)[args.skip:]:
            corpus.write(json.dumps({"id": row["id"], "text": row["text"]}, ensure_ascii=False) + "\n")
    (args.out / "questions.json").write_text(json.dumps({"questions": task.questions}, indent=2) + "\n",
                                             encoding="utf-8")
    print(f"wrote {args.items - args.skip} {task.name} items and their questions to {args.out}")


if __name__ == "__main__":
    main()
