"""The encoder's batch size: throughput side by side in one process, peak memory one per process.

ONNX Runtime pads each batch to its longest text and allocates activations for the whole batch;
``Encoder`` sorts texts by length so a batch's texts are alike. Larger batches amortise the call
but grow the activation arena, which ONNX Runtime keeps. Throughput: one ``Encoder`` per batch
size in this process, taking turns on chunks of 64 texts in a rotating order (load from other
processes falls on all alike), CPU and wall time per round, ratios against the current default.
Peak RSS cannot be told apart within one process, so each batch size embeds the same texts again
in a fresh subprocess that reports its own ``ru_maxrss``.

    .venv/bin/python -m bench.encoder_batch --texts 500 --rounds 3
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from functools import partial

from bench.common import CLOCKS, argument_parser, chunked_rounds, median_ratio, peak_rss_mib, read_rows
from cascade.encoder.onnx_encoder import Encoder

SIZES = (4, 8, 16, 32, 64)
DEFAULT = 32
CHUNK = 64


def peak_rss_of(batch_size: int, texts: int) -> float:
    """MiB of peak RSS of a fresh process that loads the encoder and embeds ``texts`` texts."""
    code = ("from bench.common import read_rows, peak_rss_mib\n"
            "from cascade.encoder.onnx_encoder import Encoder\n"
            f"texts = [r['text'] for r in read_rows('ag_news_test.jsonl', {texts})]\n"
            f"Encoder(batch_size={batch_size}).encode(texts)\nprint(peak_rss_mib())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def embed(encoder: Encoder, texts: list[str]) -> None:
    encoder.encode(texts)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--texts", type=int, default=500, help="ag_news texts per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    texts = [row["text"] for row in read_rows("ag_news_test.jsonl", args.texts)]
    # first, while this process is small: a child's ru_maxrss starts from its parent's at fork
    print(f"this process before measuring: {peak_rss_mib():.0f} MiB peak RSS")
    peaks = {size: peak_rss_of(size, args.texts) for size in SIZES}
    encoders = {size: Encoder(batch_size=size) for size in SIZES}
    contenders = {f"batch {size}": partial(embed, encoder) for size, encoder in encoders.items()}
    seconds = chunked_rounds(contenders, texts, CHUNK, args.rounds)
    base = seconds[f"batch {DEFAULT}"]
    print(f"\n{args.texts} ag_news texts per round in turns of {CHUNK}, {args.rounds} rounds")
    print(f"{'batch':>5} {'texts/s':>8} {'wall vs 32':>11} {'cpu vs 32':>10} {'peak RSS (own process)':>23}")
    for size in SIZES:
        mine = seconds[f"batch {size}"]
        ratio = {c: median_ratio(mine[c], base[c]) for c in CLOCKS}
        print(f"{size:>5} {args.texts / statistics.median(mine['wall']):>8.1f} {ratio['wall']:>11.2f} "
              f"{ratio['cpu']:>10.2f} {peaks[size]:>19.0f} MiB")


if __name__ == "__main__":
    main()
