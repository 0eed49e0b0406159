"""``cascade roofline``: what one decision costs a model on a device, from the GGUF's own shape."""

from __future__ import annotations

import argparse
from pathlib import Path

from distill.cli.values import whole_number


def _cmd_roofline(args: argparse.Namespace) -> int:
    from cascade.cost.roofline import ROOFS, ModelShape, cpu_roof, format_roofline, roofline

    shape = ModelShape.from_gguf(args.model)
    device = cpu_roof() if args.device == "cpu" else ROOFS[args.device]
    print(format_roofline(shape, device, roofline(shape, device, args.tokens)))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from cascade.cost.roofline import ROOFS

    p = sub.add_parser(
        "roofline",
        help="FLOPs, bytes and the time floor of one decision for a GGUF model on a device",
        description=(
            "Read a GGUF's shape (parameters, attention vs recurrent blocks, KV bytes per token, "
            "recurrent state, quantisation bits) and print, for a decision of N prompt tokens: "
            "FLOPs, bytes read, arithmetic intensity against the device's ridge point, whether it "
            "is compute- or memory-bound, and the floor time. A decision is prefill only, so at "
            "realistic lengths it is compute-bound: its cost is tokens x parameters. Device peaks "
            "are datasheet figures (cascade.cost.roofline.ROOFS); 'cpu' measures this machine."
        ),
        epilog="example: cascade roofline --model Qwen3.5-4B-Q4_K_M.gguf --device t4 --tokens 1000",
    )
    p.add_argument("--model", type=Path, required=True, help="path of a GGUF model")
    p.add_argument(
        "--device", choices=[*ROOFS, "cpu"], default="cpu", help="device (default: this CPU)"
    )
    p.add_argument("--tokens", type=whole_number(1, 10**9), default=512, metavar="N",
                   help="prompt tokens per decision (default 512; at most 10**9, past any context)")
    p.set_defaults(run=_cmd_roofline)
