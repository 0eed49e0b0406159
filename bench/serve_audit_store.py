"""``cascade serve`` auditing into PostgreSQL against auditing into SQLite: the latency of requests
the encoder answers locally (goal: no change to their p50), with a server that audits nothing as
the reference.

Three server processes at once (``cascade serve``, the command users run), the support bundle of
bench.common (``urgent`` kept by the encoder, gemma-3-270m the live teacher, one thread per
model): one without audits, one auditing --audit-share of its requests into a SQLite file, one
into a PostgreSQL database on loopback (``$CASCADE_TEST_POSTGRES_URL``'s server, or a throwaway
cluster started here), following its audit stream every second. One client sends the same easy
requests to the three in turn, the order rotating at every request, so that the load of the
audits (the teacher reading each audited state, on the same 2 cores) falls on all alike. The
audit's write is off the request path (the teacher's worker, after the answer): what is measured
is whether the store behind it shows in the answered requests.

    PYTHONPATH=. .venv/bin/python -m bench.serve_audit_store --requests 300
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.common import (
    EASY,
    SERVE_TIMEOUT,
    argument_parser,
    markdown,
    postgres_databases,
    server,
    support_bundle,
    support_messages,
)


def audited(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next((float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith('cascade_audits_total{outcome="audited"}')), 0.0)


def main() -> None:
    from distill.demo.synthetic import QUESTIONS_JSON

    parser = argument_parser(__doc__)
    parser.add_argument("--requests", type=int, default=300, help="easy requests to each server")
    parser.add_argument("--items", type=int, default=300, help="generated items to train on")
    parser.add_argument("--audit-share", type=float, default=0.1)
    parser.add_argument("--port", type=int, default=18461, help="first of three ports")
    args = parser.parse_args()
    from cascade.readout.llama import default_gguf_path

    teacher = default_gguf_path()
    audit = ["--audit-share", str(args.audit_share), "--audit-poll", "1"]
    with tempfile.TemporaryDirectory() as tmp, postgres_databases() as new_database, ExitStack() as stack:
        bundle = support_bundle(Path(tmp), teacher, args.items)
        urls = {
            "no audit": stack.enter_context(server(bundle, teacher, args.port, 1, "--audit-share", "0")),
            "audits into SQLite": stack.enter_context(server(bundle, teacher, args.port + 1, 1, *audit,
                                                             "--audit-store", str(Path(tmp) / "a.sqlite"))),
            "audits into PostgreSQL": stack.enter_context(server(bundle, teacher, args.port + 2, 1, *audit,
                                                                 "--audit-store", new_database())),
        }
        asked = {EASY: QUESTIONS_JSON[EASY]}
        bodies = [{"state": s, "questions": asked} for s in support_messages(args.requests)]
        names = list(urls)
        latencies: dict[str, list[float]] = {name: [] for name in names}
        with httpx.Client() as client:
            for body in bodies[:20]:  # warm
                for url in urls.values():
                    client.post(f"{url}/v1/systemone", json=body, timeout=SERVE_TIMEOUT)
            for turn, body in enumerate(bodies):
                shift = turn % len(names)
                for name in names[shift:] + names[:shift]:
                    started = time.perf_counter()
                    reply = client.post(f"{urls[name]}/v1/systemone", json=body, timeout=SERVE_TIMEOUT)
                    latencies[name].append(time.perf_counter() - started)
                    route = reply.json()["answers"][EASY]["x_routing"]
                    assert reply.status_code == 200 and route["tier"] == "encoder"
        counts = {name: audited(url) for name, url in urls.items()}
    rows = []
    for name in names:
        ordered = sorted(latencies[name])
        rows.append([name, str(len(ordered)), f"{1e3 * statistics.median(ordered):.2f}",
                     f"{1e3 * ordered[int(0.99 * (len(ordered) - 1))]:.2f}", f"{counts[name]:.0f}"])
    print(f"{args.requests} encoder-answered requests to each server, audit share {args.audit_share}")
    print(markdown(["server", "requests", "p50 ms", "p99 ms", "audited"], rows))
    sqlite, postgres = (statistics.median(latencies[f"audits into {n}"]) for n in ("SQLite", "PostgreSQL"))
    print(f"p50 PostgreSQL / SQLite: {postgres / sqlite:.3f}x (goal: no change)")


if __name__ == "__main__":
    main()
