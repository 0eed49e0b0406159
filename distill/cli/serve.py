"""``cascade serve``: a bundle's cascade behind a System One HTTP endpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from cascade.serve.lifecycle import API_KEY_VARIABLE
from distill.cli.common import (
    add_accept_other_teacher_argument,
    add_audit_arguments,
    add_bundle_argument,
    add_device_argument,
    add_placement_arguments,
    placement_of,
    whole_number,
)

DESCRIPTION = f"""\
Serve a bundle's cascade at POST /v1/systemone, the System One API that existing SDKs call
(avrik-sdk, jev-style, typesafe-sdk): point the client's base URL here instead of the teacher's
server and change nothing else. Each question is answered by the first tier confident enough for
it; answers carry the System One fields clients type, and the cascade's own under x_ keys
(x_routing: tier, threshold, certified, ...). Questions the bundle does not hold (matched by
content, not id) are answered by the teacher alone, marked covered=false.

Also: GET /v1/models, GET /health and /healthz (503 while the models load), GET /metrics
(Prometheus). With an API key (--api-key or ${API_KEY_VARIABLE}) the /v1 routes need
"Authorization: Bearer KEY". A request may carry a budget: the body key x_budget
{{"ms_per_call": X, "max_escalation_fraction": F}} or the headers X-Cascade-Budget-Ms and
X-Cascade-Max-Escalation. SIGTERM stops taking requests, finishes those in flight, and exits 0.
Needs the serve extra: pip install "cascade-router[serve]"."""
EPILOG = """\
example:
  cascade serve --bundle models/support-v1 --teacher qwen3.5-4b-q4_k_m.gguf --port 8080 \\
      --gpu-layers 99 --device cuda
  curl -s localhost:8080/v1/systemone -d '{"state": "Charged twice!", "questions": {...}}'"""


def _cmd_serve(args: argparse.Namespace) -> int:
    from cascade.serve.lifecycle import ServeOptions, serve
    from distill.auditing import StoreAudits

    options = ServeOptions(host=args.host, port=args.port, api_key=args.api_key, max_body=args.max_body,
                           grace=args.grace, batch=not args.no_batch, max_batch=args.max_batch,
                           teacher_queue=args.teacher_queue, overload=args.overload,
                           audit_queue=args.audit_queue)
    with StoreAudits(args.audit_store, args.audit_share, args.audit_seed, args.on_drift) as audit:
        serve(args.bundle, options, teacher=args.teacher, device=args.device, threads=args.threads,
              placement=placement_of(args), accept_other_teacher=args.accept_other_teacher, audit=audit)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a bundle's cascade as a System One HTTP endpoint",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bundle_argument(p)
    p.add_argument("--teacher", type=Path, metavar="PATH.gguf",
                   help="GGUF to run as the top tier (escalations, and questions the bundle does not "
                   "hold); without one, a bundle whose teacher is external labels answers only its own")
    add_accept_other_teacher_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; "
                   "0.0.0.0 for every interface)")
    p.add_argument("--port", type=whole_number(0), default=8080, help="port (default 8080)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require Authorization: Bearer KEY on /v1 routes (default: ${API_KEY_VARIABLE}; "
                   "neither: no auth, and a Bearer header is ignored)")
    p.add_argument("--max-body", type=whole_number(1), default=32 * 1024 * 1024, metavar="BYTES",
                   help="largest request body, after inflating gzip or zstd (default 32 MiB): 413 above")
    p.add_argument("--teacher-queue", type=whole_number(1), default=32, metavar="N",
                   help="most requests waiting for the top tier (default 32); past it see --overload")
    p.add_argument("--overload", choices=("refuse", "keep"), default="refuse",
                   help="when the top tier's queue is full: refuse with 503 and Retry-After (default), "
                   "or keep the best cheaper answer, marked budget_limited, overloaded and uncertified")
    p.add_argument("--no-batch", action="store_true",
                   help="route each request alone instead of batching those waiting at the encoder")
    p.add_argument("--max-batch", type=whole_number(1), default=64, metavar="N",
                   help="most requests in one encoder batch (default 64)")
    p.add_argument("--grace", type=whole_number(0), default=30, metavar="S",
                   help="seconds SIGTERM waits for requests in flight (default 30)")
    add_placement_arguments(p)
    add_device_argument(p, "where the encoder runs (default cpu; auto takes CUDA when onnxruntime-gpu "
                        "has it, and each answer's x_cascade.ran_on says which it got)")
    add_audit_arguments(p)
    p.add_argument("--audit-queue", type=whole_number(1), default=64, metavar="N",
                   help="most audits waiting for the teacher, which takes them only when no live request "
                   "waits (default 64); past it an audit is dropped and counted in /metrics")
    p.set_defaults(run=_cmd_serve)
