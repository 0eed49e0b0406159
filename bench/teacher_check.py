"""The teacher check's thresholds, measured on the shipped teachers' labels of the shared sets.

``distill.calibration.teacher_check`` flags a question whose labels collapse onto one answer (top share at
least COLLAPSE_SHARE) or barely move with the input (spread, the mean total variation distance
of each item's distribution from the mean one, under MIN_SPREAD). This prints those figures for:

- the committed exports in bench/labels (Qwen2.5-Coder-1.5B on AG News and Zomato, a teacher that
  reads; the 0.5B on AG News, whose probabilities fall A > B > C > D on most items);
- with ``--live N``, N items of AG News (topic) and SMS (spam) labelled now by a GGUF (default
  the embedded gemma-3-270m), with its letter mass and agreement with the sets' gold labels.

    .venv/bin/python -m bench.teacher_check
    .venv/bin/python -m bench.teacher_check --live 150
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import SPAM, STARS, TOPIC, argument_parser, markdown, read_rows

LABELS = Path(__file__).resolve().parent / "labels"
EXPORTS = {"ag_news.qwen2.5-coder-1.5b.jsonl": TOPIC,
           "ag_news.qwen2.5-coder-1.5b.items-4001-7600.jsonl": TOPIC,
           "ag_news.qwen2.5-coder-0.5b.jsonl": TOPIC, "zomato.qwen2.5-coder-1.5b.jsonl": STARS}
GOLD_KEYS = {"ag_news_test.jsonl": {1: "world", 2: "sports", 3: "business", 4: "scitech"},
             "sms_spam.jsonl": {"spam": "true", "ham": "false"}}


def _questions(spec: dict[str, Any]) -> Any:
    from cascade.questions import parse_request

    return parse_request({"state": "-", "questions": spec}).questions


def exported(name: str, spec: dict[str, Any]) -> Any:
    """The check of one committed export (no letter masses: the exports do not keep them)."""
    from distill.calibration.teacher_check import judge

    labels: dict[str, dict[str, dict[str, float]]] = {}
    with (LABELS / name).open(encoding="utf-8") as rows:
        for line in rows:
            row = json.loads(line)
            labels.setdefault(row["question"], {})[row["id"]] = row["probabilities"]
    return judge(labels, _questions(spec))[0]


def live(dataset: str, spec: dict[str, Any], items: int, model: str | None, work: Path) -> Any:
    """Label ``items`` rows of ``dataset`` now with the GGUF and check them against the gold."""
    from cascade.readout.llama import default_gguf_path
    from distill.calibration.teacher_check import judge_store
    from distill.labelling.gguf import label_corpus, open_teacher, teacher_of
    from distill.labelling.teachers import teacher_path
    from distill.store import LabelStore

    rows = read_rows(dataset, items)
    corpus = work / f"{dataset}.corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n" for r in rows))
    questions = _questions(spec)
    path = default_gguf_path() if model is None else teacher_path(model)
    scorer = open_teacher(path, questions, n_ctx=2048, n_threads=1)
    try:
        with LabelStore(work / f"{dataset}.{path.stem}.sqlite", teacher_of(scorer)) as store:
            label_corpus(scorer, questions, corpus, store, progress=False)
            gold = {r["id"]: GOLD_KEYS[dataset].get(r["label"], r["label"]) for r in rows}
            return judge_store(store, questions, gold)[0]
    finally:
        scorer.close()


def row(source: str, check: Any) -> list[str]:
    mass = "-" if check.letter_mass is None else f"{check.letter_mass:.2f}"
    gold = "-" if check.gold_agreement is None else f"{check.gold_agreement:.3f}"
    verdict = "; ".join(f.split(":")[0].split("(")[0].strip() for f in check.findings) or "reads"
    return [source, check.question, str(check.items), f"{check.top_share:.3f}", f"{check.first_share:.3f}",
            f"{check.spread:.3f}", mass, gold, verdict]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--live", type=int, metavar="N", help="also label N items of AG News and SMS now")
    parser.add_argument("--model", help="the live GGUF: a packaged teacher (default: gemma-3-270m)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-teacher-check"),
                        help="where live label stores go (resumed on a rerun)")
    args = parser.parse_args()
    rows = [row(name, exported(name, spec)) for name, spec in EXPORTS.items()]
    if args.live:
        args.work.mkdir(parents=True, exist_ok=True)
        who = args.model or "gemma-3-270m"
        for dataset, spec in (("ag_news_test.jsonl", TOPIC), ("sms_spam.jsonl", SPAM)):
            check = live(dataset, spec, args.live, args.model, args.work)
            rows.append(row(f"{dataset} by {who} (live)", check))
    print(markdown(["labels", "question", "items", "top share", "first-listed share", "spread",
                    "letter mass", "gold agreement", "check"], rows))


if __name__ == "__main__":
    main()
