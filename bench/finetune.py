"""Fine-tuned encoder against the frozen one, on the same items, splits and labels.

Reads a label export of bench/labels/ (the real teacher's probabilities; texts and gold labels
are joined back from ../shared/data by id). Each of ``--resplits`` random 50/25/25 splits (the
same permutations as bench/teacher_goals.py for the same seed) is run for each label source:

- the frozen MiniLM (the shipped int8 file) with the library's head on its vectors and n-grams;
- MiniLM fine-tuned on the split's train part (``distill.training.finetune``, the ``cascade train
  --finetune`` defaults), exported as int8 ONNX (``distill.training.onnx_export``), with the same head
  refitted on its vectors.

Each gets one threshold certified at target 0.98 / delta 0.05 on the calibration part and is
measured on the evaluation part: head accuracy against the source, share kept, realised
agreement. Serve cost is CPU time per item with one thread, interleaved in this process: the
fine-tuned int8 file, the shipped int8 file, and the shipped model re-quantized the same way as
the fine-tuned one (so the quantization's share of any difference is visible).

    PYTHONPATH=. .venv/bin/python -m bench.finetune \\
        --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl --task ag_news --resplits 3
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from functools import partial
from pathlib import Path

import numpy as np

from bench.common import (
    CACHE_DIR,
    DELTA,
    SOURCES,
    TARGET,
    TASK_NAMES,
    Items,
    argument_parser,
    cell,
    certified,
    finetuned_vectors,
    head_probabilities,
    in_rounds,
    load_items,
    markdown,
    parts_of,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder, EncoderFiles, default_encoder_files
from distill.training.finetune import FinetuneConfig
from distill.training.finetune_base import import_torch
from distill.training.onnx_export import export_int8


@dataclasses.dataclass(frozen=True)
class Outcome:
    accuracy: float
    kept: float
    agreement: float


def measure(items: Items, emb: np.ndarray, source: str, order: np.ndarray) -> Outcome:
    """Head on ``emb`` (+ n-grams) fitted on the train part; certified threshold; evaluation."""
    parts = parts_of(order)
    cal, ev = head_probabilities(items, emb, source, parts)
    truth = items.truth[source]
    keep = ev.max(axis=1) >= certified(cal, truth[parts.calibration], TARGET, DELTA, "top")
    correct = ev.argmax(axis=1) == truth[parts.evaluation]
    return Outcome(float(correct.mean()), float(keep.mean()), 1.0 - float((keep & ~correct).mean()))


def serve_cost(texts: list[str], files: dict[str, Path], rounds: int = 3) -> dict[str, float]:
    """CPU ms per item with one thread, the encoders interleaved round by round."""
    tokenizer = default_encoder_files().tokenizer
    encoders = {name: Encoder(EncoderFiles(model=path, tokenizer=tokenizer), threads=1)
                for name, path in files.items()}
    spent = in_rounds({name: partial(encoder.encode, texts) for name, encoder in encoders.items()}, rounds)
    return {name: 1000 * sum(seconds["cpu"]) / rounds / len(texts) for name, seconds in spent.items()}


def requantized_shipped(work: Path) -> Path:
    """The shipped MiniLM's float weights quantized as fine-tuned bodies are (no training)."""
    import_torch()
    from distill.training.student import minilm_body

    path = work / "frozen-requantized.onnx"
    export_int8(minilm_body(), default_encoder_files().tokenizer, path, ["a short text", "another one"], 256)
    return path


def row(name: str, outcomes: list[Outcome]) -> list[str]:
    return [name, cell([o.accuracy for o in outcomes], ".1%"), cell([o.kept for o in outcomes], ".1%"),
            cell([o.agreement for o in outcomes], ".4f")]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--labels", type=Path, required=True, metavar="EXPORT.jsonl")
    parser.add_argument("--task", choices=TASK_NAMES, required=True)
    parser.add_argument("--resplits", type=int, default=3)
    parser.add_argument("--sources", nargs="+", choices=sorted(SOURCES), default=sorted(SOURCES))
    parser.add_argument("--epochs", type=int, default=FinetuneConfig().epochs)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads while fine-tuning (default 1)")
    parser.add_argument("--cost-items", type=int, default=300)
    args = parser.parse_args()
    task = task_named(args.task)
    items = load_items(args.labels, task, EmbeddingCache(CACHE_DIR, Encoder()))
    config = FinetuneConfig(epochs=args.epochs, seed=args.seed, threads=args.threads)
    rng = np.random.default_rng(args.seed)
    orders = [rng.permutation(len(items.ids)) for _ in range(args.resplits)]
    results: dict[str, list[Outcome]] = {}
    train_seconds: list[float] = []
    with tempfile.TemporaryDirectory() as work:
        last = None
        for number, order in enumerate(orders, 1):
            print(f"split {number}/{len(orders)}", flush=True)
            for name in args.sources:
                source = SOURCES[name]
                results.setdefault(f"{name}: frozen", []).append(measure(items, items.emb, source, order))
                train = order[: len(order) // 2]
                emb, seconds, last = finetuned_vectors(items, source, train, Path(work), config)
                train_seconds.append(seconds)
                results.setdefault(f"{name}: fine-tuned", []).append(measure(items, emb, source, order))
        assert last is not None
        cost = serve_cost(items.texts[: args.cost_items], {
            "fine-tuned int8": last, "frozen int8 (shipped)": default_encoder_files().model,
            "frozen, re-quantized like the fine-tuned": requantized_shipped(Path(work))})
    print(f"\n{len(items.ids)} {task.name} items; target {TARGET}, delta {DELTA}; {args.resplits} re-splits "
          f"(seed {args.seed}); fine-tune: {config}")
    header = ["labels: encoder", "head accuracy: mean (worst)", "encoder keeps: mean (worst)",
              "realised agreement: mean (worst)"]
    print(markdown(header, [row(name, outcomes) for name, outcomes in results.items()]))
    print(f"\nfine-tune + export: {statistics.mean(train_seconds):.0f} s per run on "
          f"{len(items.ids) // 2} train items ({args.threads} torch thread(s))")
    shipped = cost["frozen int8 (shipped)"]
    print(markdown(["encoder file", "CPU ms / item (1 thread)", "vs shipped"],
                   [[name, f"{ms:.2f}", f"{ms / shipped:.2f}x"] for name, ms in cost.items()]))


if __name__ == "__main__":
    main()
