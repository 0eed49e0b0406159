"""What auditing costs: teacher seconds per routed item at a 2% audit share.

An audited item is answered by the teacher on every bundle question, on top of its route. This
times, on the same items and interleaved (so that machine noise hits all alike): the cascade's
route of an item, the audit of it (``Auditor.audit``: one teacher readout of every question, and
the store write), and the teacher alone on the same questions (``Cascade`` routing with every
question escalated). The bundle is bench.common's ``support_bundle``, which bench/serve_load runs
too (generated messages, gemma-3-270m live as the teacher, "urgent" kept by the encoder,
"department" escalated).

    PYTHONPATH=. .venv/bin/python -m bench.audit_cost --items 60
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import argument_parser, support_bundle, support_messages
from cascade.audit.auditor import Auditor
from cascade.audit.sample import AuditSampler
from cascade.readout.llama import default_gguf_path
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from distill.loop.auditing import StoreSink, bundle_teacher


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--share", type=float, default=0.02)
    args = parser.parse_args()
    teacher = default_gguf_path()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = support_bundle(Path(tmp), teacher, 300)
        with Cascade.load(bundle, teacher=teacher, threads=args.threads) as cascade:
            sink = StoreSink(Path(tmp) / "audits.sqlite", bundle_teacher(cascade.manifest))
            auditor = Auditor(cascade, AuditSampler(1.0), sink, on_drift="alarm")
            every = {qid: qid for qid in cascade.questions}
            route = audit = alone = 0.0
            for n, state in enumerate(support_messages(args.items)):
                item = Item(f"i{n}", state)
                started = time.perf_counter()
                response = cascade.decide(state)
                route += time.perf_counter() - started
                started = time.perf_counter()
                auditor.audit(item, response, every)
                audit += time.perf_counter() - started
                started = time.perf_counter()
                cascade.tiers[-1].reply([item], [list(every)], cascade.questions)
                alone += time.perf_counter() - started
            sink.close()
    n = args.items
    print(f"{n} generated messages, {len(every)} bundle questions, gemma-3-270m as the teacher, "
          f"{args.threads} threads\n")
    print(f"cascade route per item:           {1e3 * route / n:8.1f} ms")
    print(f"audit per audited item:           {1e3 * audit / n:8.1f} ms (teacher on every question + store)")
    print(f"teacher alone per item:           {1e3 * alone / n:8.1f} ms")
    per_routed = args.share * audit / n
    print(f"audit per routed item at {args.share:.0%}:    {1e3 * per_routed:8.2f} ms = "
          f"{per_routed / (route / n):.3f} of the route, {per_routed / (alone / n):.3f} of the teacher alone")


if __name__ == "__main__":
    main()
