"""``cascade serve``: a bundle's cascade behind a System One HTTP endpoint."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cascade.errors import CascadeError
from cascade.serve.lifecycle import API_KEY_VARIABLE, METRICS_KEY_VARIABLE, BundleParts
from distill.cli.common import (
    add_accept_other_teacher_argument,
    add_audit_arguments,
    add_device_argument,
    add_placement_arguments,
    placement_of,
    teacher_argument,
)
from distill.cli.escalations import add_escalation_arguments, check_escalations, escalation_store
from distill.cli.serve.limits import add_limit_arguments, limits_of
from distill.cli.serve.upstream import add_upstream_arguments, upstream_settings
from distill.cli.values import positive_seconds, seconds_or_zero, whole_number

if TYPE_CHECKING:
    from cascade.collect.collector import Collector
    from cascade.collect.escalation import EscalationRecord
    from cascade.serve.lifecycle import ServeOptions
    from distill.loop.escalations import StoreEscalations

DESCRIPTION = f"""\
Serve a bundle's cascade at POST /v1/systemone, the System One API that existing SDKs call
(avrik-sdk, jev-style, typesafe-sdk): point the client's base URL here instead of the teacher's
server and change nothing else. Each question is answered by the first tier confident enough for
it; answers carry the System One fields clients type, and the cascade's own under x_ keys
(x_routing: tier, threshold, certified, ...). Questions the bundle does not hold (matched by
content, not id) are answered by the teacher alone, marked covered=false.

Also: GET /v1/models, GET /health and /healthz (503 while the models load), GET /metrics
(Prometheus; serving a bundle or a pass-through: the teacher served alone has none yet); /docs,
/redoc and /openapi.json only with --docs. With an API key (--api-key or
${API_KEY_VARIABLE}) /v1/models, /v1/systemone and /metrics need "Authorization: Bearer KEY"
(/metrics takes --metrics-key or ${METRICS_KEY_VARIABLE} instead, where given); /health is open.
A --host other than loopback (127.0.0.1, ::1, localhost) is refused unless a key is checked
(--api-key, or --forward-auth with --teacher URL), or --insecure-no-auth serves it open on
purpose, with one warning. A key sent over plain http:// to an upstream on another machine gets
one warning: give it https://, or a tunnel to 127.0.0.1. A request may carry a budget: the body
key x_budget {{"ms_per_call": X, "max_escalation_fraction": F}} or the headers
X-Cascade-Budget-Ms and X-Cascade-Max-Escalation. SIGTERM stops taking requests, finishes those
in flight, and exits 0. Needs the serve extra: pip install -e '.[serve]'.

Without --bundle, --teacher PATH.gguf serves the teacher's raw logit readout alone (every
question any client asks; audits carry the GGUF's sha256 and each prompt's hash), so that a GPU
box and the CPU cascade run the same program and the cascade takes the box's URL as --teacher;
--teacher URL is a transparent pass-through to that URL (its answers unchanged), which with
--collect records the traffic it forwards, to train a cascade from.

With a bundle and --teacher URL, the questions no local tier is sure of and those the bundle does
not hold go upstream in ONE request holding only them (x_routing.upstream says which answers came
from there); an upstream answer that names another teacher than the bundle's voids the
certificate at once: every question then goes upstream, marked x_routing.demoted with the reason.
The top tier's queue admits a request only while the expected wait fits --max-wait.
With --escalation-share, the teacher's answers to the questions the cascade escalated are kept in
--audit-store (the bundle's label store), apart from the audits: `cascade retrain` trains on them.
--bundle may be a link or a pointer file that `cascade promote` replaces: the server then serves
the promoted bundle (at once on SIGHUP), finishing the requests in flight on the old one."""
EPILOG = """\
examples:
  cascade serve --bundle models/support-v1 --teacher qwen3.5-4b-q4_k_m.gguf --port 8080 \\
      --gpu-layers 99 --device cuda
  CASCADE_API_KEY=$(cat teacher.key) cascade serve --teacher qwen3.5-4b-q4_k_m.gguf --port 9000 \\
      --gpu-layers 99   # on a GPU box: on loopback, behind TLS (or reached by an ssh tunnel)
  CASCADE_UPSTREAM_KEY=$(cat teacher.key) cascade serve --bundle models/support-v1 \\
      --teacher https://gpu-box.example.com/v1/systemone
  CASCADE_API_KEY=$(cat serve.key) cascade serve --bundle models/support-v1 --host 0.0.0.0 \\
      --teacher https://decide.example.com/v1/systemone   # an open port checks a key
  cascade serve --bundle models/support-v1 --teacher qwen3.5-4b-q4_k_m.gguf --audit-store labels.sqlite \\
      --escalation-share 1   # audits 2% and keeps every escalation, to retrain on
  cascade serve --teacher https://decide.example.com/v1/systemone --collect traffic.sqlite   # pass-through
  curl -s localhost:8080/v1/systemone -d '{"state": "Charged twice!", "questions": {...}}'"""


def _cmd_serve(args: argparse.Namespace) -> int:
    from cascade.serve.lifecycle import check_auth, serve, serve_proxy, serve_teacher

    url = isinstance(args.teacher, str)
    options = options_of(args)
    _check_combination(args, url)
    check_auth(options, args.forward_auth, forwardable=url)  # refused before any store opens or model loads
    if args.bundle is None and url:
        _serve_proxy(args, options, serve_proxy)
        return 0
    if args.bundle is None:
        serve_teacher(args.teacher, options, placement=placement_of(args), layout=args.layout)
        return 0
    with bundle_parts(args) as parts:
        serve(args.bundle, options, parts)
    return 0


def options_of(args: argparse.Namespace) -> ServeOptions:
    """The server's options from its flags (a Ray Serve replica takes the same flags)."""
    from cascade.serve.lifecycle import ServeOptions

    return ServeOptions(host=args.host, port=args.port, api_key=args.api_key, max_body=args.max_body,
                        metrics_key=args.metrics_key, docs=args.docs, insecure_no_auth=args.insecure_no_auth,
                        grace=args.grace, batch=not args.no_batch, max_batch=args.max_batch,
                        overload=args.overload, audit_queue=args.audit_queue, max_wait=args.max_wait,
                        audit_in_flight=args.audit_in_flight,
                        forward_auth=args.forward_auth, watch=args.watch_bundle,
                        upstream_price=args.upstream_price, limits=limits_of(args),
                        lower_queue=args.lower_queue, max_connections=args.max_connections,
                        receive_timeout=args.receive_timeout)


@contextmanager
def bundle_parts(args: argparse.Namespace) -> Iterator[BundleParts]:
    """What ``serve`` (and ``bundle_app``) take besides the bundle and options: the teacher and
    placement, and the audits and escalations kept in --audit-store, open until the block ends (a
    Ray Serve replica holds them for its life)."""
    from cascade.serve.swap import resolve
    from distill.loop.auditing import StoreAudits

    teacher = upstream_settings(args) if isinstance(args.teacher, str) else args.teacher
    bundle = resolve(args.bundle)
    kept = escalation_store(args, bundle)
    try:
        escalations = _escalations(args, kept) if kept is not None else None
        with StoreAudits(args.audit_store, args.audit_share, args.audit_seed, args.on_drift,
                         poll=args.audit_poll, bundle=bundle) as audit:
            yield BundleParts(teacher=teacher, device=args.device, threads=args.threads,
                              placement=placement_of(args), accept_other_teacher=args.accept_other_teacher,
                              audit=audit, escalations=escalations)
    finally:
        if kept is not None:
            kept.close()


def _escalations(args: argparse.Namespace, sink: StoreEscalations) -> Collector[EscalationRecord]:
    """The collector of escalations; it opens the store now where it exists, so that another
    teacher's store is refused before a model loads."""
    from cascade.collect.collector import Collector

    collector = Collector(sink, args.escalation_share, args.escalation_max, seed=args.escalation_seed,
                          what="escalations")
    limit = f", up to {args.escalation_max}" if args.escalation_max is not None else ""
    print(f"escalations: {args.escalation_share:.0%} of escalated requests kept in {args.audit_store}{limit} "
          f"({collector.held} there already)", file=sys.stderr)
    return collector


def _check_combination(args: argparse.Namespace, url: bool) -> None:
    if args.bundle is None and args.teacher is None:
        raise CascadeError("give --bundle DIR to serve a cascade, --teacher PATH.gguf alone to serve the "
                           "teacher's readout, or --teacher URL alone for a pass-through to that URL")
    if args.forward_auth and not url:
        raise CascadeError("--forward-auth passes callers' keys to an upstream teacher: give --teacher URL")
    if args.collect is not None and (args.bundle is not None or not url):
        raise CascadeError("--collect records a pass-through's traffic: give --teacher URL without --bundle "
                           "(with a bundle, --audit-store keeps the teacher's answers to audited items, and "
                           "--escalation-share its answers to escalated ones)")
    check_escalations(args, bundle=args.bundle is not None)


def _serve_proxy(args: argparse.Namespace, options: Any, serve_proxy: Any) -> None:
    from distill.loop.collected import StoreTraffic

    sink = StoreTraffic(args.collect) if args.collect is not None else None
    try:
        serve_proxy(upstream_settings(args), options, sink, args.collect_share, args.collect_max)
    finally:
        if sink is not None:
            sink.close()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a bundle's cascade as a System One HTTP endpoint",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, metavar="DIR",
                   help="model bundle folder; without one, --teacher PATH.gguf is served alone: its raw "
                   "readout as a System One server, which a cascade elsewhere can take as its teacher URL")
    p.add_argument("--teacher", type=teacher_argument, metavar="PATH.gguf|URL",
                   help="GGUF to run as the top tier (escalations, and questions the bundle does not "
                   "hold), or a System One URL (http://host:port/v1/systemone) to call instead; "
                   "without one, a bundle whose teacher is external labels answers only its own")
    p.add_argument("--layout", choices=("state-first", "options-first"), default="state-first",
                   help="prompt layout of a teacher served alone (default state-first): the one its "
                   "labels were read with, so that answers match them")
    p.add_argument("--max-wait", type=positive_seconds, metavar="S",
                   help="the top tier's queue (a GGUF here, an upstream URL, or a teacher served alone) "
                   "admits a request only while its expected wait (measured seconds per request x "
                   "requests ahead) is at most S (default 8, below the SDKs' 10 s timeout; 5 for a "
                   "teacher served alone, so that its wait and one read end within a cascade's 8 s "
                   "read of it); past it, 503 with Retry-After at once (or see --overload)")
    p.add_argument("--watch-bundle", type=seconds_or_zero, default=2.0, metavar="S",
                   help="look at --bundle every S seconds (default 2; 0: only on SIGHUP) and serve a "
                   "promoted bundle when it changes: --bundle may be a bundle folder, a link to one, or a "
                   "file naming one; requests in flight finish on the old bundle, none is refused")
    add_accept_other_teacher_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; "
                   "0.0.0.0 for every interface: refused unless --api-key or --forward-auth checks a "
                   "key, or --insecure-no-auth)")
    p.add_argument("--port", type=whole_number(0, 65535), default=8080, help="port (default 8080)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require Authorization: Bearer KEY on /v1/models, /v1/systemone and /metrics "
                   f"(default: ${API_KEY_VARIABLE}, which keeps the key out of the process list; neither: "
                   "no auth, and a Bearer header is ignored; refused with --forward-auth)")
    p.add_argument("--metrics-key", metavar="KEY",
                   help=f"the key /metrics requires instead, for a scraper that needs no other route "
                   f"(default: ${METRICS_KEY_VARIABLE}; neither: /metrics takes what the /v1 routes take)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a --host other than loopback with no key checked, on purpose (one warning "
                   "line says so); without it such a host is refused")
    p.add_argument("--docs", action="store_true",
                   help="serve the API's documentation: /docs, /redoc and /openapi.json (default: off, "
                   "404)")
    p.add_argument("--max-body", type=whole_number(1), default=2 * 1024 * 1024, metavar="BYTES",
                   help="largest request body, after inflating gzip or zstd (default 2 MiB): 413 above")
    p.add_argument("--overload", choices=("refuse", "keep"), default="refuse",
                   help="past --max-wait: refuse with 503 and Retry-After (default), or keep the best "
                   "cheaper answer, marked budget_limited, overloaded and uncertified")
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
                   help="most audits waiting for the teacher (default 64), and as many waiting for the "
                   "store (at least --max-batch, a batch's worth): a local teacher takes them only when "
                   "no live request waits, an upstream one at its own pace (--audit-in-flight), and one "
                   "thread of their own writes them, so no request waits for the store; past N one "
                   "drawn at random is dropped, counted in /metrics, and each audited item is written "
                   "with its inclusion probability")
    p.add_argument("--audit-in-flight", type=whole_number(1), default=4, metavar="N",
                   help="most audits at an upstream teacher at once (default 4), on the upstream's capacity "
                   "and never behind local requests; they pause only while it answers 429 or 503, for "
                   "its Retry-After")
    p.add_argument("--audit-poll", type=positive_seconds, default=1.0, metavar="S",
                   help="seconds between reads of the audit store for other replicas' audits (default 1): "
                   "a demotion raised on any replica sharing --audit-store holds here within S plus one read")
    kept = add_escalation_arguments(p, "escalated requests")
    kept.add_argument("--escalation-max", type=whole_number(0), default=None, metavar="N",
                      help="stop keeping escalations once the store holds N (default: no limit)")
    add_upstream_arguments(p)
    add_limit_arguments(p)
    p.set_defaults(run=_cmd_serve)

