"""The prompt head computed once: tokens prefilled and seconds per AG News decision, before and after.

Two scorers of the same GGUF in one process, read item by item in turn on the same AG News
items and questions: "before" forgets its prompt head ahead of every item (each prefills its whole
prompt, as every item did before the head), "after" keeps it (``cascade.readout.scorer``: the tokens
every prompt starts with are prefilled once and copied into each item's sequence). Printed:
prompt tokens prefilled per decision (the usage's ``input_tokens``), seconds per item, and how
far the answers moved (largest |dp| and argmax agreement: a cached head was decoded in another
batch than a fresh prefill decodes it), over the items after the first two (the first has no
head to learn from, the second learns it).

Both scorers split the head off (its numbers are the same decoded or copied), so their answers
agree exactly. With ``--labels`` (an export of bench/labels/ made by the same model before the
head existed, one whole prefill per item), the topic answers are also compared with those, on the
items both hold: how far splitting the prefill moved the numbers.

    PYTHONPATH=. .venv/bin/python -m bench.prompt_head --items 100 --threads 2 \\
        --model "$(.venv/bin/cascade teacher-model qwen2.5-coder-1.5b-instruct)" \\
        --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import TOPIC, argument_parser, question_set, read_rows
from cascade.questions import parse_request
from cascade.readout.scorer import Scorer


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True, help="GGUF path")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--questions", type=int, nargs="+", default=[1, 4],
                        help="question sets to run: 1 is AG News's topic question; n > 1 adds "
                        "bench.common's other questions about the same story")
    parser.add_argument("--labels", type=Path, help="an export of the topic question by this model")
    args = parser.parse_args()
    rows = read_rows("ag_news_test.jsonl", args.items)
    texts = [row["text"] for row in rows]
    before = Scorer(args.model, n_ctx=2048, max_branches=8, n_threads=args.threads)
    after = Scorer(args.model, n_ctx=2048, max_branches=8, n_threads=args.threads)
    print(f"{args.items} AG News items, {before.model.path.name}, {args.threads} threads, interleaved\n")
    print(f"{'questions':>9} {'tokens before':>14} {'tokens after':>13} {'fewer':>6} "
          f"{'s/item before':>14} {'s/item after':>13} {'faster':>7} {'max |dp|':>9} {'argmax same':>12}")
    for n in args.questions:
        questions = TOPIC if n == 1 else {**TOPIC, **_others(n - 1)}
        rows = _run(before, after, texts, questions)
        tokens = [statistics.mean(r[k] for r in rows) for k in ("tokens_before", "tokens_after")]
        seconds = [statistics.mean(r[k] for r in rows) for k in ("seconds_before", "seconds_after")]
        print(f"{n:>9} {tokens[0]:>14.1f} {tokens[1]:>13.1f} {tokens[0] / tokens[1]:>5.2f}x "
              f"{seconds[0]:>14.3f} {seconds[1]:>13.3f} {seconds[0] / seconds[1]:>6.2f}x "
              f"{max(r['dp'] for r in rows):>9.4f} {statistics.mean(r['same'] for r in rows):>12.1%}")
    print(f"\nhead held by 'after': {after.prompt_head} tokens")
    if args.labels:
        _against(after, rows, args.labels)
    before.close()
    after.close()


def _others(n: int) -> dict[str, Any]:
    """``n`` questions besides the topic, from the shared pool."""
    return dict(list((k, v) for k, v in question_set(8).items() if k != "topic")[:n])


def _run(before: Scorer, after: Scorer, texts: list[str], questions: dict[str, Any]
         ) -> list[dict[str, float]]:
    rows = []
    for i, text in enumerate(texts):
        request = parse_request({"state": text, "questions": questions})
        before.forget_head()
        seconds: dict[str, float] = {}
        responses = {}
        for name in (("before", "after") if i % 2 == 0 else ("after", "before")):  # alternate who goes first
            began = time.perf_counter()
            responses[name] = (before if name == "before" else after).score(request)
            seconds[name] = time.perf_counter() - began
        plain, cached = responses["before"], responses["after"]
        dp = [float(np.abs(np.subtract(list(plain.answers[q].probabilities.values()),
                                       list(cached.answers[q].probabilities.values()))).max())
              for q in questions]
        same = [_top(plain.answers[q].probabilities) == _top(cached.answers[q].probabilities)
                for q in questions]
        rows.append({"tokens_before": plain.usage.input_tokens, "tokens_after": cached.usage.input_tokens,
                     "seconds_before": seconds["before"], "seconds_after": seconds["after"],
                     "dp": max(dp), "same": float(np.mean(same))})
    return rows[2:]  # the first item has no head to learn from, the second learns it: steady state after


def _against(scorer: Scorer, rows: list[dict[str, Any]], labels: Path) -> None:
    """The topic answers with the head against an export made with one whole prefill."""
    stored = {}
    for line in labels.open(encoding="utf-8"):
        row = json.loads(line)
        if row["question"] == "topic":
            stored[row["id"]] = row["probabilities"]
    both = [row for row in rows if row["id"] in stored]
    dps, same = [], []
    for row in both:
        answer = scorer.score(parse_request({"state": row["text"], "questions": TOPIC})).answers["topic"]
        old = stored[row["id"]]
        dps.append(max(abs(p - old[key]) for key, p in answer.probabilities.items()))
        same.append(_top(answer.probabilities) == _top(old))
    print(f"against {labels.name} on the {len(both)} items it holds: max |dp| {max(dps):.4f}, mean "
          f"{statistics.mean(dps):.4f}, argmax same {statistics.mean(same):.1%}")


def _top(probabilities: dict[str, float]) -> str:
    return max(probabilities, key=lambda key: probabilities[key])


if __name__ == "__main__":
    main()
