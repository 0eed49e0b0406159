"""Encoder-tier throughput against the raw ONNX Runtime pipeline it wraps, side by side.

The tier embeds a state once, hashes its word n-grams (cascade.encoder.ngrams; off with --no-ngrams)
and runs every question's head on both in one product (HeadStack, as EncoderTier does), so its
cost should be the encoder's plus almost nothing.
The baseline is the bare pipeline with no heads: the same tokenizer file and truncation, the same
length-sorted batches, ``session.run`` and mean pooling (the vector every question would then
read, so its decisions per second are states per second times questions). Both run in one
process on the same texts, taking turns a few texts at a time in a rotating order, so that load
from other processes on shared cores falls on both alike; a round covers all texts, and
overheads are medians of per-round time ratios. "batch" embeds 64 texts per call; "single" makes
one call per state, as a server answering one request at a time would. Heads are random (2-16
classes): a head's cost does not depend on its weights.

    .venv/bin/python -m bench.encoder_speed --texts 500 --rounds 3
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from functools import partial

import numpy as np
import onnxruntime as ort
from tokenizers import Encoding, Tokenizer

from bench.common import CLOCKS, argument_parser, chunked_rounds, median_ratio, peak_rss_mib, read_rows
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import Encoder, EncoderFiles
from cascade.heads import HeadStack, SoftmaxHead

QUESTIONS = (1, 4, 16)
MODES = ("batch", "single")
CHUNK = {"batch": 64, "single": 16}
"""Texts per turn: a batch-mode turn is one call on 64 texts, a single-mode turn 16 calls."""


class RawPipeline:
    """The baseline: tokenizer, ``session.run`` and mean pooling, with nothing around them."""

    def __init__(self, files: EncoderFiles, max_length: int, batch_size: int, threads: int | None) -> None:
        self.tokenizer = Tokenizer.from_file(str(files.tokenizer))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_length)
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(files.model), options, providers=["CPUExecutionProvider"])
        self.inputs = [node.name for node in self.session.get_inputs()]
        self.batch_size = batch_size

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Same batches as ``Encoder.encode``: sorted by token count, ``batch_size`` at a time."""
        encodings = self.tokenizer.encode_batch(list(texts))
        order = sorted(range(len(encodings)), key=lambda row: len(encodings[row].ids))
        out = np.empty((len(encodings), self.session.get_outputs()[0].shape[2]), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            out[rows] = self._run([encodings[row] for row in rows])
        return out

    def _run(self, encodings: list[Encoding]) -> np.ndarray:
        width = max(len(e.ids) for e in encodings)
        feeds = {name: np.zeros((len(encodings), width), dtype=np.int64) for name in self.inputs}
        for row, e in enumerate(encodings):
            feeds["input_ids"][row, : len(e.ids)] = e.ids
            feeds["attention_mask"][row, : len(e.ids)] = 1
        hidden = self.session.run(None, feeds)[0]
        mask = feeds["attention_mask"][..., None].astype(np.float32)
        pooled = (hidden * mask).sum(axis=1) / mask.sum(axis=1)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def random_heads(dim: int, count: int, seed: int) -> list[SoftmaxHead]:
    """Heads as a bundle would load them, with random weights and 2-16 classes each."""
    rng = np.random.default_rng(seed)
    heads = []
    for k in rng.integers(2, 17, size=count):
        arrays = {"coef": rng.normal(size=(k, dim)), "intercept": rng.normal(size=k),
                  "C": np.array(1.0), "max_iter": np.array(100)}
        heads.append(SoftmaxHead.from_arrays(arrays))
    return heads


def tier_pass(encoder: Encoder, ngrams: NgramFeatures | None, heads: HeadStack, mode: str,
              texts: list[str]) -> None:
    """Every head's distribution for every text, one embedding (and n-gram row) per text, as
    EncoderTier computes them."""
    for group in [texts] if mode == "batch" else [[text] for text in texts]:
        heads.predict_proba(beside(encoder.encode(group), ngrams, group))


def baseline_pass(raw: RawPipeline, mode: str, texts: list[str]) -> None:
    for group in [texts] if mode == "batch" else [[text] for text in texts]:
        raw.embed(group)


def report(mode: str, seconds: dict[str, dict[str, list[float]]], states: int) -> None:
    """Decisions per second from median wall time; overheads are medians of per-round ratios."""
    base = seconds["baseline"]
    print(f"\n{mode}: {states} states per round in turns of {CHUNK[mode]}, {len(base['wall'])} rounds")
    print(f"{'questions':>9} {'tier dec/s':>11} {'raw dec/s':>10} {'wall overhead':>14} {'cpu overhead':>13}")
    for q in QUESTIONS:
        tier = seconds[f"tier {q}"]
        over = {c: median_ratio(tier[c], base[c]) - 1 for c in CLOCKS}
        print(f"{q:>9} {states * q / statistics.median(tier['wall']):>11.1f} "
              f"{states * q / statistics.median(base['wall']):>10.1f} "
              f"{over['wall']:>14.1%} {over['cpu']:>13.1%}")


def check_same_vectors(encoder: Encoder, raw: RawPipeline, texts: list[str]) -> None:
    """The baseline must compute what the tier computes, or the ratio means nothing."""
    diff = float(np.abs(encoder.encode(texts) - raw.embed(texts)).max())
    print(f"max |tier vector - raw vector| on {len(texts)} texts: {diff:.2e}")
    if diff > 1e-4:
        raise SystemExit("the raw baseline does not reproduce the encoder's vectors; fix it first")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--texts", type=int, default=500, help="ag_news texts (states) per pass")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="texts per session.run (default 8, the Encoder's)")
    parser.add_argument("--no-ngrams", dest="ngrams", action="store_false",
                        help="heads read the embedding alone (as bundles trained with --no-ngrams)")
    args = parser.parse_args()
    texts = [row["text"] for row in read_rows("ag_news_test.jsonl", args.texts)]
    print(f"peak RSS after imports: {peak_rss_mib():.0f} MiB")
    encoder = Encoder(batch_size=args.batch_size, threads=args.threads)
    print(f"peak RSS after loading the encoder: {peak_rss_mib():.0f} MiB")
    raw = RawPipeline(encoder.files, encoder.max_length, encoder.batch_size, args.threads)
    print(f"peak RSS after loading the raw baseline too: {peak_rss_mib():.0f} MiB")
    ngrams = NgramFeatures().fit(texts) if args.ngrams else None
    width = encoder.dim + (ngrams.n_features if ngrams is not None else 0)
    heads = random_heads(width, max(QUESTIONS), seed=0)
    print(f"{encoder.name}, batch_size {encoder.batch_size}, threads {args.threads or 'default'}; "
          f"heads on {width} features with {[h.n_classes_ for h in heads]} classes")
    check_same_vectors(encoder, raw, texts[:128])
    for mode in MODES if args.mode == "both" else (args.mode,):
        contenders = {"baseline": partial(baseline_pass, raw, mode)}
        for q in QUESTIONS:
            stack = HeadStack({str(n): head for n, head in enumerate(heads[:q])})
            contenders[f"tier {q}"] = partial(tier_pass, encoder, ngrams, stack, mode)
        report(mode, chunked_rounds(contenders, texts, CHUNK[mode], args.rounds), len(texts))
    print(f"\npeak RSS after the run: {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
