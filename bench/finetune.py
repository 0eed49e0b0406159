"""Fine-tuned encoder against the frozen one, on the same items, splits and labels.

Reads a label export of bench/labels/ (the real teacher's probabilities; texts and gold labels
are joined back from ../shared/data by id). Each of ``--resplits`` random 50/25/25 splits (the
same permutations as bench/teacher_goals.py for the same seed) is run for each label source:

- the frozen MiniLM (the shipped int8 file) with the library's head on its vectors and n-grams;
- MiniLM fine-tuned on the split's train part (``distill.finetune``, the ``cascade train
  --finetune`` defaults), exported as int8 ONNX (``distill.onnx_export``), with the same head
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

import argparse
import dataclasses
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.encoder_quality import CACHE_DIR, TASKS
from bench.teacher_goals import DELTA, TARGET, Items, load_items, markdown
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder, EncoderFiles, default_encoder_files
from cascade.heads import Matrix, SoftmaxHead
from distill.calibration.maths import threshold_for_agreement
from distill.finetune import FinetuneConfig, finetune_body
from distill.finetune_base import Targets, import_torch
from distill.onnx_export import export_int8

SOURCES = {"teacher": "teacher, soft", "gold": "gold"}


@dataclasses.dataclass(frozen=True)
class Outcome:
    accuracy: float
    kept: float
    agreement: float


def measure(items: Items, emb: np.ndarray, source: str, order: np.ndarray) -> Outcome:
    """Head on ``emb`` (+ n-grams) fitted on the train part; certified threshold; evaluation."""
    n = len(order)
    train, calibration, evaluation = order[: n // 2], order[n // 2: 3 * n // 4], order[3 * n // 4:]
    grams = NgramFeatures().fit([items.texts[i] for i in train])

    def features(rows: np.ndarray) -> Matrix:
        return beside(emb[rows], grams, [items.texts[i] for i in rows])

    head = SoftmaxHead(C=1.0, max_iter=5000).fit(features(train), items.targets[source][train])
    cal, ev = head.predict_proba(features(calibration)), head.predict_proba(features(evaluation))
    truth = items.truth[source]
    chosen = threshold_for_agreement(cal.max(axis=1), cal.argmax(axis=1) == truth[calibration], TARGET, DELTA)
    keep = ev.max(axis=1) >= (chosen.threshold if chosen.threshold is not None else math.inf)
    correct = ev.argmax(axis=1) == truth[evaluation]
    return Outcome(float(correct.mean()), float(keep.mean()), 1.0 - float((keep & ~correct).mean()))


def finetuned_vectors(items: Items, source: str, train: np.ndarray, work: Path,
                      config: FinetuneConfig) -> tuple[np.ndarray, float, Path]:
    """All items' vectors from a MiniLM fine-tuned on ``train``; seconds to train and export."""
    tokenizer = default_encoder_files().tokenizer
    started = time.perf_counter()
    body, record = finetune_body([items.texts[i] for i in train],
                                 {"q": Targets(items.targets[source][train])}, tokenizer, config)
    path = work / f"{source.split(',')[0]}-{len(list(work.iterdir()))}.onnx"
    parity = export_int8(body, tokenizer, path, [items.texts[i] for i in train[:200]], 256)
    seconds = time.perf_counter() - started
    epochs = ", ".join(f"{e.epoch}: {e.held_out_loss:.3f}/{e.held_out_agreement:.3f}" for e in record.epochs)
    print(f"  fine-tuned on {source}: best epoch {record.best_epoch} (held-out loss/agreement {epochs}); "
          f"{seconds:.0f} s; int8 parity min cosine {parity.min_cosine:.4f}", flush=True)
    return Encoder(EncoderFiles(model=path, tokenizer=tokenizer)).encode(items.texts), seconds, path


def serve_cost(texts: list[str], files: dict[str, Path], rounds: int = 3) -> dict[str, float]:
    """CPU ms per item with one thread, the encoders interleaved round by round."""
    tokenizer = default_encoder_files().tokenizer
    encoders = {name: Encoder(EncoderFiles(model=path, tokenizer=tokenizer), threads=1)
                for name, path in files.items()}
    spent = {name: 0.0 for name in files}
    for _ in range(rounds):
        for name, encoder in encoders.items():
            started = time.process_time()
            encoder.encode(texts)
            spent[name] += time.process_time() - started
    return {name: 1000 * seconds / rounds / len(texts) for name, seconds in spent.items()}


def requantized_shipped(work: Path) -> Path:
    """The shipped MiniLM's float weights quantized as fine-tuned bodies are (no training)."""
    import_torch()
    from distill.student import minilm_body

    path = work / "frozen-requantized.onnx"
    export_int8(minilm_body(), default_encoder_files().tokenizer, path, ["a short text", "another one"], 256)
    return path


def row(name: str, outcomes: list[Outcome]) -> list[str]:
    def cell(values: list[float], fmt: str) -> str:
        return f"{statistics.mean(values):{fmt}} (worst {min(values):{fmt}})"

    return [name, cell([o.accuracy for o in outcomes], ".1%"), cell([o.kept for o in outcomes], ".1%"),
            cell([o.agreement for o in outcomes], ".4f")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=Path, required=True, metavar="EXPORT.jsonl")
    parser.add_argument("--task", choices=[task.name for task in TASKS], required=True)
    parser.add_argument("--resplits", type=int, default=3)
    parser.add_argument("--sources", nargs="+", choices=sorted(SOURCES), default=sorted(SOURCES))
    parser.add_argument("--epochs", type=int, default=FinetuneConfig().epochs)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads while fine-tuning (default 1)")
    parser.add_argument("--cost-items", type=int, default=300)
    args = parser.parse_args()
    task = next(task for task in TASKS if task.name == args.task)
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
