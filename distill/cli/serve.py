"""``cascade serve``: a bundle's cascade behind a System One HTTP endpoint."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from cascade.errors import CascadeError
from distill.cli.common import (
    add_accept_other_teacher_argument,
    add_audit_arguments,
    add_placement_arguments,
    placement_of,
    whole_number,
)

API_KEY_VARIABLE = "CASCADE_API_KEY"
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
    try:
        import uvicorn

        from cascade.serve.app import ServeConfig, create_app
        from cascade.serve.engine import EngineSettings
    except ImportError as exc:
        raise CascadeError(f'cascade serve needs the serve extra ({exc}): pip install "cascade-router[serve]"'
                           ) from None
    from cascade.audit.auditor import Auditor
    from cascade.routing.router import Cascade
    from distill.auditing import StoreSink, auditor_for

    if not (args.bundle / "manifest.json").is_file():
        raise CascadeError(f"no bundle at {args.bundle} (no manifest.json); give a folder that "
                           "cascade train wrote")
    key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    settings = EngineSettings(batch=not args.no_batch, max_batch=args.max_batch,
                              teacher_queue=args.teacher_queue, overload=args.overload,
                              audit_queue=args.audit_queue)
    failures: list[BaseException] = []

    def load() -> Cascade:
        return Cascade.load(args.bundle, teacher=args.teacher, device=args.device, threads=args.threads,
                            placement=placement_of(args), accept_other_teacher=args.accept_other_teacher)

    sinks: list[StoreSink] = []

    def audit(cascade: Cascade) -> Auditor | None:
        auditor, sink = auditor_for(cascade, args.audit_store, args.audit_share, args.audit_seed,
                                    args.on_drift)
        sinks.extend([sink] if sink is not None else [])
        return auditor

    server: uvicorn.Server | None = None

    def failed(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    config = ServeConfig(api_key=key, max_body=args.max_body, engine=settings, audit=audit)
    app = create_app(load, config, failed)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=args.grace))
    print(f"serving {args.bundle} at http://{args.host}:{args.port}/v1/systemone "
          f"(auth {'on' if key else 'off'}; models loading, /health says when ready)", file=sys.stderr)
    # uvicorn stops gracefully on SIGTERM and then raises the signal again under the handler it
    # found: this one, so that a requested stop exits 0 instead of dying of the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    for sink in sinks:
        sink.close()
    if failures:
        failure = failures[0]
        if isinstance(failure, CascadeError):
            raise failure
        raise CascadeError(f"loading the bundle failed: {type(failure).__name__}: {failure}") from failure
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a bundle's cascade as a System One HTTP endpoint",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True, metavar="DIR", help="model bundle folder")
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
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where the encoder runs (default cpu; auto takes CUDA when onnxruntime-gpu "
                   "has it, and each answer's x_cascade.ran_on says which it got)")
    add_audit_arguments(p)
    p.add_argument("--audit-queue", type=whole_number(1), default=64, metavar="N",
                   help="most audits waiting for the teacher, which takes them only when no live request "
                   "waits (default 64); past it an audit is dropped and counted in /metrics")
    p.set_defaults(run=_cmd_serve)
