"""``cascade decide``: answer a bundle's questions about every item of a corpus through the cascade."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import IO, TYPE_CHECKING

from cascade.errors import CascadeError, RequestError
from distill.cli.common import (
    add_accept_other_teacher_argument,
    add_audit_arguments,
    add_budget_arguments,
    add_on_error_argument,
    add_placement_arguments,
    placement_of,
    report_skipped,
)

if TYPE_CHECKING:
    from cascade.audit.auditor import Auditor
    from cascade.routing.budget import Budget
    from cascade.routing.router import Cascade
    from cascade.tiers.base import Item

DESCRIPTION = """\
Route every item of a JSONL corpus through a model bundle's tiers, cheapest first: a question is
answered by the first tier confident enough for it (its calibrated threshold), and the top tier
answers the rest. Writes one System One response per item, {"id", "answers", "usage"}, each
answer with its routing (tier, predicted cost share, threshold, calibrated, budget_limited).
A budget bounds the predicted cost per item (--budget-ms, pooled over each batch) or the share
of questions the top tier answers (--max-escalation); when it cannot pay for every escalation,
the least confident questions escalate first. Items already in --out are skipped, so a stopped
run continues where it ended."""
EPILOG = """\
example:
  cascade decide --bundle models/support-v1 --corpus emails.jsonl --out decisions.jsonl \\
      --max-escalation 0.1 --teacher qwen3.5-4b-q4_k_m.gguf"""


def _cmd_decide(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cascade.corpus import count_items, read_corpus
    from cascade.routing.budget import Budget
    from cascade.routing.router import Cascade
    from cascade.tiers.base import Item
    from distill.auditing import auditor_for

    if args.batch_size < 1:
        raise RequestError(f"--batch-size must be at least 1; got {args.batch_size}")
    budget = Budget(ms_per_call=args.budget_ms, max_escalation_fraction=args.max_escalation)
    done = _done_ids(args.out)
    tiers: Counter[str] = Counter()
    written = 0
    with Cascade.load(args.bundle, teacher=args.teacher, device=args.device, threads=args.threads,
                      placement=placement_of(args),
                      accept_other_teacher=args.accept_other_teacher) as cascade, \
            args.out.open("a", encoding="utf-8") as out, \
            tqdm(total=count_items(args.corpus), initial=len(done), unit="item") as bar:
        auditor, sink = auditor_for(cascade, args.audit_store, args.audit_share, args.audit_seed,
                                    args.on_drift)
        field = args.text_field or cascade.manifest.training.text_field or "text"
        batch: list[Item] = []
        for row in read_corpus(args.corpus, field, args.on_error, report_skipped):
            if row.id in done:
                continue
            batch.append(Item(row.id, row.state))
            if len(batch) == args.batch_size:
                written += _write(cascade, batch, budget, out, tiers, auditor)
                bar.update(len(batch))
                batch = []
        if batch:
            written += _write(cascade, batch, budget, out, tiers, auditor)
            bar.update(len(batch))
        if sink is not None:
            sink.close()
    total = sum(tiers.values())
    shares = ", ".join(f"{name} {count / total:.1%}" for name, count in tiers.items()) or "-"
    audited = f"; audited {auditor.audited} by the teacher" if auditor is not None else ""
    print(f"decided {written} items ({len(done)} already in {args.out}); answers by tier: {shares}{audited}")
    return 0


def _write(cascade: Cascade, batch: list[Item], budget: Budget, out: IO[str], tiers: Counter[str],
           auditor: Auditor | None) -> int:
    """Decide one batch and append its lines, flushed, so a kill loses at most this batch; the
    items the audit sample chose are audited (and stored) first."""
    responses = cascade.decide_batch(batch, budget)
    if auditor is not None:
        every = {qid: qid for qid in cascade.questions}
        for item, response in zip(batch, responses, strict=True):
            if auditor.sampler.chosen(item.id):
                auditor.audit(item, response, every)
    for item, response in zip(batch, responses, strict=True):
        tiers.update(answer.routing.tier for answer in response.answers.values() if answer.routing)
        out.write(json.dumps({"id": item.id, **response.model_dump(mode="json")}, ensure_ascii=False)
                  + "\n")
    out.flush()
    return len(batch)


def _done_ids(path: Path) -> set[str]:
    """Ids already decided in ``path``; a last line cut short by a kill is removed."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        print(f"{path}: removing an incomplete last line (a run was stopped mid-write)", file=sys.stderr)
        path.write_bytes(data[:cut])
        data = data[:cut]
    done = set()
    for number, line in enumerate(data.splitlines(), 1):
        try:
            done.add(json.loads(line)["id"])
        except (ValueError, KeyError, TypeError):
            raise CascadeError(f"{path}:{number} is not a decision line with an 'id'; --out must be "
                               "a file this command wrote (to resume) or a new path") from None
    return done


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decide",
        help="answer a corpus's questions through a bundle's cascade of tiers",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bundle", type=Path, required=True, metavar="DIR", help="model bundle folder")
    p.add_argument("--corpus", type=Path, required=True, metavar="C.jsonl",
                   help='JSONL corpus, one {"id": ..., "text": ...} object per line')
    p.add_argument("--out", type=Path, required=True, metavar="D.jsonl",
                   help="decisions JSONL to write (appended; ids already there are skipped)")
    add_budget_arguments(p)
    p.add_argument("--teacher", type=Path, metavar="PATH.gguf",
                   help="GGUF to run as the top tier of a bundle whose teacher is external labels")
    p.add_argument("--text-field", metavar="NAME",
                   help="corpus field holding each state (default: the one the bundle was trained on)")
    add_on_error_argument(p)
    p.add_argument("--batch-size", type=int, default=32, metavar="N",
                   help="items routed together: one encoder batch and one budget (default 32)")
    add_accept_other_teacher_argument(p)
    add_placement_arguments(p)
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where the encoder runs (default cpu; auto takes CUDA when onnxruntime-gpu "
                   "has it, and each answer's usage.x_cascade.ran_on says which it got)")
    add_audit_arguments(p)
    p.set_defaults(run=_cmd_decide)
