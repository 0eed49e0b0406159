"""``cascade decide``: answer a bundle's questions about every item of a corpus through the cascade."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from distill.cli.common import (
    add_accept_other_teacher_argument,
    add_audit_arguments,
    add_batch_size_argument,
    add_budget_arguments,
    add_bundle_argument,
    add_corpus_argument,
    add_device_argument,
    add_on_error_argument,
    add_placement_arguments,
    add_text_field_argument,
    budget_of,
    corpus_input,
    placement_of,
    teacher_argument,
)
from distill.cli.endpoint import add_endpoint_arguments, add_timeout_argument, key_source, timeouts
from distill.cli.escalations import add_escalation_arguments, check_escalations, escalation_store
from distill.cli.values import output_file

if TYPE_CHECKING:
    from cascade.routing.endpoint import Teacher
    from distill.loop.escalations import KeptEscalations

DESCRIPTION = """\
Route every item of a JSONL corpus through a model bundle's tiers, cheapest first: a question is
answered by the first tier confident enough for it (its calibrated threshold), and the top tier
answers the rest. Writes one System One response per item, {"id", "answers", "usage"}, each
answer with its routing (tier, predicted cost share, threshold, calibrated, budget_limited).
A budget bounds the predicted cost per item (--budget-ms, pooled over each batch) or the share
of questions the top tier answers (--max-escalation); when it cannot pay for every escalation,
the least confident questions escalate first. Items already in --out are skipped, so a stopped
run continues where it ended. With --audit-store, a share of the items is audited by the teacher
(--audit-share), and the teacher's answers to what escalated can be kept to retrain on
(--escalation-share)."""
EPILOG = """\
example:
  cascade decide --bundle models/support-v1 --corpus emails.jsonl --out decisions.jsonl \\
      --max-escalation 0.1 --teacher qwen3.5-4b-q4_k_m.gguf
  cascade decide --bundle models/support-v1 --corpus emails.jsonl --out decisions.jsonl \\
      --teacher https://decide.example.com/v1/systemone     # the teacher behind a URL"""


def _cmd_decide(args: argparse.Namespace) -> int:
    from cascade.routing.router import Cascade
    from distill.loop.auditing import StoreAudits
    from distill.loop.decide import decide_corpus

    check_escalations(args)
    kept = _kept(args)
    try:
        with StoreAudits(args.audit_store, args.audit_share, args.audit_seed, args.on_drift,
                         bundle=args.bundle) as audits, \
                Cascade.load(args.bundle, teacher=_teacher(args), device=args.device,
                             threads=args.threads, placement=placement_of(args),
                             accept_other_teacher=args.accept_other_teacher) as cascade:
            auditor = audits(cascade)
            decided = decide_corpus(cascade, corpus_input(args), args.out, budget_of(args), args.batch_size,
                                    auditor, escalations=kept)
    finally:
        if kept is not None:
            kept.sink.close()
    total = sum(decided.tiers.values())
    shares = ", ".join(f"{name} {count / total:.1%}" for name, count in decided.tiers.items()) or "-"
    audited = f"; audited {auditor.audited} by the teacher" if auditor is not None else ""
    escalations = f"; {kept.kept} escalations kept in {args.audit_store}" if kept is not None else ""
    print(f"decided {decided.written} items ({decided.already} already in {args.out}); answers by tier: "
          f"{shares}{audited}{escalations}")
    if decided.errors:
        items = len({item for item, _, _ in decided.errors})
        print(f"{len(decided.errors)} questions of {items} items have no answer (x_errors in {args.out}); "
              f"the first: item {decided.errors[0][0]!r}, question {decided.errors[0][1]!r}: "
              f"{decided.errors[0][2]}", file=sys.stderr)
    return 0


def _kept(args: argparse.Namespace) -> KeptEscalations | None:
    """The escalations to keep; the store is opened now where it exists, so that another
    teacher's store is refused before a model loads."""
    sink = escalation_store(args, args.bundle)
    if sink is None:
        return None
    from distill.loop.escalations import KeptEscalations

    sink.count()
    return KeptEscalations(sink, args.escalation_share, args.escalation_seed)


def _teacher(args: argparse.Namespace) -> Teacher | None:
    """A URL teacher's settings (its model name and key from the --upstream flags); a path or None
    as given."""
    if not isinstance(args.teacher, str):
        return args.teacher
    from cascade.teachers.settings import UpstreamSettings

    return UpstreamSettings(args.teacher, model=args.upstream_model, key=key_source(args), **timeouts(args))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decide",
        help="answer a corpus's questions through a bundle's cascade of tiers",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bundle_argument(p)
    add_corpus_argument(p)
    p.add_argument("--out", type=output_file, required=True, metavar="D.jsonl",
                   help="decisions JSONL to write (appended; ids already there are skipped)")
    add_budget_arguments(p)
    p.add_argument("--teacher", type=teacher_argument, metavar="PATH.gguf|URL",
                   help="the top tier: a GGUF to run here, or an http(s)://.../v1/systemone URL to call "
                   "(its key from --upstream-key-env or -file; default: the bundle's pinned GGUF); it must "
                   "be the teacher the bundle was certified against, or --accept-other-teacher")
    add_text_field_argument(p, bundle=True)
    add_on_error_argument(p)
    add_batch_size_argument(p, 32, "items routed together: one encoder batch and one budget (default 32)")
    add_accept_other_teacher_argument(p)
    add_placement_arguments(p)
    add_device_argument(p, "where the encoder runs (default cpu; auto takes CUDA when onnxruntime-gpu "
                        "has it, and each answer's usage.x_cascade.ran_on says which it got)")
    add_audit_arguments(p)
    add_escalation_arguments(p, "the decided items (by id: a rerun keeps the same ones)")
    url = p.add_argument_group("a URL teacher (--teacher http://host:port/v1/systemone)")
    add_endpoint_arguments(url)
    add_timeout_argument(url)
    p.set_defaults(run=_cmd_decide)
