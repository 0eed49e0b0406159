"""What recording the encoder's token-limit cuts costs: ``Encoder.cuts`` (a second tokenisation of
the same texts) against ``Encoder.encode`` (tokenisation and the ONNX forward pass), side by side
in one process, interleaved rounds, process CPU time, the encoder on one thread.

    .venv/bin/python -m bench.encoder_cuts --texts 500 --rounds 3
"""

from __future__ import annotations

import statistics
import time

from bench.common import argument_parser, read_rows
from cascade.encoder.onnx_encoder import Encoder


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    encoder = Encoder(threads=1)
    texts = [row["text"] for row in read_rows("ag_news_test.jsonl", args.texts)]
    ratios = []
    for _ in range(args.rounds):
        started = time.process_time()
        encoder.encode(texts)
        encode = time.process_time() - started
        started = time.process_time()
        cut = sum(c is not None for _, c in encoder.cuts(texts))
        ratios.append((time.process_time() - started) / encode)
    print(f"{args.texts} ag_news texts ({cut} cut at {encoder.max_length} tokens): cuts cost "
          f"{100 * statistics.median(ratios):.2f}% of encode's CPU time (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
