"""Choice questions of more options than one prompt letters: two rounds against one prompt.

One prompt letters 16 options (A-P); the System One API allows 255, so a bigger question is read in
two rounds sharing the state's prefill (``cascade.readout.prompts.option_groups``): each group of at most
16 in a prompt of its own, then the groups' winners. Where both can run (16 options), this reads
the same question both ways, the rounds forced by a smaller group size (8: 2 groups + finalists;
4: 4 groups + finalists), on AG News texts, and compares: argmax agreement with the one prompt,
the mean total variation distance between the distributions, accuracy against the gold section
(4 of the 16 options are AG News's classes), prompt tokens and seconds per item.

    PYTHONPATH=. .venv/bin/python -m bench.option_rounds --items 200 --threads 2
    PYTHONPATH=. .venv/bin/python -m bench.option_rounds --items 150 --threads 2 \
        --model "$(.venv/bin/cascade teacher-model qwen2.5-coder-0.5b-instruct)"
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.common import TOPIC, argument_parser, read_rows
from cascade.questions import parse_request
from cascade.readout.llama import default_gguf_path
from cascade.readout.scorer import Scorer

GOLD = {"World": "world", "Sports": "sports", "Business": "business", "Sci/Tech": "scitech"}
"""AG News's classes by the keys both questions give them."""
SECTIONS = {  # AG News's four classes spread over the groups of 4 and 8
    "world": "World news and international politics", "health": "Health and medicine",
    "travel": "Travel", "food": "Food and cooking",
    "sports": "Sports", "entertainment": "Film, music and celebrities",
    "education": "Schools and universities", "weather": "Weather",
    "business": "Business, companies and the economy", "crime": "Crime and courts",
    "religion": "Religion", "arts": "Books and the arts",
    "scitech": "Science and technology", "autos": "Cars", "property": "Housing and real estate",
    "opinion": "Opinion and letters",
}
QUESTIONS = {
    "sections16": ({"type": "choice", "criteria": SECTIONS,
                    "instructions": "Which section of a newspaper does this story belong to?"}, (16, 8, 4)),
    "topic4": ({**TOPIC["topic"]}, (4, 2)),  # AG News's own four classes, rounds of 2
}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, help="GGUF to read with (default: the embedded gemma-3-270m)")
    parser.add_argument("--permutations", type=int, default=1, help="option orders averaged per reading")
    parser.add_argument("--question", choices=sorted(QUESTIONS), default="sections16",
                        help="16 newspaper sections (4 of them AG News's classes), or the 4 classes")
    args = parser.parse_args()
    rows = read_rows("ag_news_test.jsonl", args.items)
    model = args.model or default_gguf_path()
    question, sizes = QUESTIONS[args.question]
    scorers = {size: Scorer(model, n_ctx=2048, n_threads=args.threads, letters_per_prompt=size)
               for size in sizes}
    keys = list(question["criteria"])
    probs: dict[int, list[np.ndarray]] = {size: [] for size in sizes}
    tokens = {size: 0 for size in sizes}
    seconds = {size: 0.0 for size in sizes}
    for row in rows:
        request = parse_request({"state": row["text"], "questions": {"section": question}})
        for size, scorer in scorers.items():  # interleaved, so that machine noise hits all alike
            started = time.perf_counter()
            response = scorer.score(request, permutations=args.permutations)
            seconds[size] += time.perf_counter() - started
            tokens[size] += response.usage.input_tokens
            probs[size].append(np.asarray(list(response.answers["section"].probabilities.values())))
    gold = np.asarray([keys.index(GOLD[row["label_name"]]) for row in rows])
    one = np.stack(probs[sizes[0]])
    print(f"{len(rows)} AG News items, {model.name}, a {len(keys)}-option question, "
          f"{args.permutations} option order(s)\n")
    print(f"{'reading':<28} {'agree':>6} {'mean TV':>8} {'top p':>6} {'gold acc':>8} {'tokens':>7} "
          f"{'s/item':>7}")
    for size in sizes:
        p = np.stack(probs[size])
        agree = float(np.mean(p.argmax(1) == one.argmax(1)))
        tv = float(np.mean(0.5 * np.abs(p - one).sum(1)))
        name = "one prompt" if size == sizes[0] else f"two rounds, groups of {size}"
        print(f"{name:<28} {agree:>6.3f} {tv:>8.3f} {float(p.max(1).mean()):>6.3f} "
              f"{float(np.mean(p.argmax(1) == gold)):>8.3f} {tokens[size] / len(rows):>7.1f} "
              f"{seconds[size] / len(rows):>7.3f}")
    answers = Counter(keys[i] for i in one.argmax(1))
    print(f"\none prompt's answers: {dict(answers.most_common())}")
    for scorer in scorers.values():
        scorer.close()


if __name__ == "__main__":
    main()
