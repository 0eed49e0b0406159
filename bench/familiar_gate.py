"""The gate for unfamiliar inputs on real text: what it lets through, and what it sends up.

The gate (``cascade.encoder.familiar``) is fitted as ``cascade train`` fits it, on training items' encoder
vectors (here the shipped MiniLM's, of the first ``--train`` AG News items), and read on held-out
AG News items (in distribution: the share it sends up is cost, since those are items the heads
know) and on texts of other sources (SMS messages and restaurant reviews: a shift in source).

    PYTHONPATH=. .venv/bin/python -m bench.familiar_gate --train 2000 --held 1000
"""

from __future__ import annotations

import numpy as np

from bench.common import argument_parser, read_rows
from cascade.encoder.familiar import FamiliarityGate
from cascade.encoder.onnx_encoder import Encoder


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--held", type=int, default=1000)
    args = parser.parse_args()
    encoder = Encoder()
    news = [row["text"] for row in read_rows("ag_news_test.jsonl", args.train + args.held)]
    gate = FamiliarityGate.fit(encoder.encode(news[:args.train]))
    streams = {
        "AG News, held out (in distribution)": news[args.train:],
        "SMS messages (another source)": [r["text"] for r in read_rows("sms_spam.jsonl", args.held)],
        "restaurant reviews (another source)": [r["text"] for r in
                                               read_rows("zomato_restaurant_reviews.jsonl", args.held)],
    }
    print(f"gate fitted on {args.train} AG News items: {len(gate.reference)} reference vectors, radius "
          f"{gate.radius:.3f} (cosine distance, the 0.99 quantile)\n")
    print(f"{'stream':<38} {'items':>6} {'sent up':>8} {'median distance':>16}")
    for name, texts in streams.items():
        distances = gate.distances(encoder.encode(texts))
        print(f"{name:<38} {len(texts):>6} {np.mean(distances > gate.radius):>8.1%} "
              f"{float(np.median(distances)):>16.3f}")


if __name__ == "__main__":
    main()
