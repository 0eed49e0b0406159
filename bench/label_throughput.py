"""Teacher labelling throughput against the scorer alone on the same items (goal: labelling adds
at most 5%).

Labelling = read the JSONL corpus, skip what the store has, score (fan-out), write every item's
labels in one SQLite transaction (WAL, synchronous=FULL). The baseline scores the same requests in
a plain loop. Interleaved rounds in one process, each labelling round into a fresh store;
llama.cpp on one thread. Wall time, since the store's fsyncs are part of the cost.

    .venv/bin/python -m bench.label_throughput --items 20 --rounds 3
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import argument_parser, question_set, read_rows
from cascade.questions import parse_request
from cascade.readout.llama import default_gguf_path
from distill.labelling.gguf import label_corpus, open_teacher, teacher_of
from distill.store import LabelStore


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=4)
    args = parser.parse_args()
    questions_json = question_set(args.questions)
    rows = read_rows("ag_news_test.jsonl", args.items)
    questions = parse_request({"state": "x", "questions": questions_json}).questions
    requests = [parse_request({"state": r["text"], "questions": questions_json}) for r in rows]
    scorer = open_teacher(default_gguf_path(), questions, n_threads=1)
    work = Path(tempfile.mkdtemp())
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n" for r in rows))
    plain: list[float] = []
    labelled: list[float] = []
    for round_ in range(args.rounds):
        started = time.perf_counter()
        for request in requests:
            scorer.score(request)
        plain.append(time.perf_counter() - started)
        with LabelStore(work / f"store{round_}.sqlite", teacher_of(scorer)) as store:
            started = time.perf_counter()
            label_corpus(scorer, questions, corpus, store, progress=False)
            labelled.append(time.perf_counter() - started)
    p, lab = statistics.median(plain), statistics.median(labelled)
    print(f"{args.items} items x {args.questions} questions, {args.rounds} rounds (medians)")
    print(f"scorer alone   {p:8.2f} s  {args.items / p:6.2f} items/s")
    print(f"label_corpus   {lab:8.2f} s  {args.items / lab:6.2f} items/s  "
          f"overhead {100 * (lab / p - 1):+.1f}%")


if __name__ == "__main__":
    main()
