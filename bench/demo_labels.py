"""Ship a label store of the demo corpus as the demo's real-teacher labels (distill/data/).

The store comes from ``cascade label`` run on the demo's generated corpus (seed 0) with the
packaged Qwen2.5-Coder-1.5B-Instruct; this keeps the longest prefix of the corpus whose items
have every question labelled (the demo takes its first N items), writes them in the export
format, and writes beside them how they were made. The labelling, resumable, was:

    .venv/bin/python -c "from pathlib import Path; from distill.demo.synthetic import *; \\
        write_corpus(generate(1000, 0), Path('corpus.jsonl')); write_questions(Path('questions.json'))"
    cascade label --teacher "$(cascade teacher-model qwen2.5-coder-1.5b-instruct)" \\
        --questions questions.json --corpus corpus.jsonl --store labels.sqlite --threads 1

and then:

    PYTHONPATH=. .venv/bin/python -m bench.demo_labels --store labels.sqlite --seconds-per-item 3.5
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import argument_parser
from cascade.readout.prompts import PROMPT_VERSION
from distill.demo.synthetic import GENERATOR_VERSION, QUESTIONS_JSON, generate
from distill.demo.teacher import FACTS_FILE, LABELS_FILE, MODEL_NAME, ShippedLabels
from distill.store import LabelStore

SEED = 0
COMMAND = ("cascade label --teacher qwen2.5-coder-1.5b-instruct.gguf --questions questions.json "
           "--corpus corpus.jsonl --store labels.sqlite --threads 1")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--seconds-per-item", type=float, required=True,
                        help="the labelling's measured pace, recorded for the demo's estimates")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with LabelStore.open_existing(args.store) as store:
        teacher = store.teacher
        labels = {qid: store.labels(qid) for qid in QUESTIONS_JSON}
    count = 0
    for item in generate(2000, SEED):
        if not all(item.id in labels[qid] for qid in QUESTIONS_JSON):
            break
        count += 1
    LABELS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with LABELS_FILE.open("w", encoding="utf-8") as out:
        for item in generate(count, SEED):
            for qid in QUESTIONS_JSON:
                probs = {key: round(value, 6) for key, value in labels[qid][item.id].items()}
                out.write(json.dumps({"id": item.id, "question": qid, "probabilities": probs}) + "\n")
    facts = ShippedLabels(model=MODEL_NAME, model_sha256=teacher.model_sha256 or "",
                          prompt_version=teacher.prompt_version or PROMPT_VERSION,
                          generator_version=GENERATOR_VERSION, seed=SEED, items=count, command=COMMAND,
                          seconds_per_item=args.seconds_per_item, threads=args.threads)
    FACTS_FILE.write_text(facts.model_dump_json(indent=2) + "\n", encoding="utf-8")
    print(f"{count} items x {len(QUESTIONS_JSON)} questions -> {LABELS_FILE}; facts -> {FACTS_FILE}")


if __name__ == "__main__":
    main()
