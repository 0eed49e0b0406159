"""A forwarded request's latency through ``UpstreamTier`` against the same upstream called directly.

Goal: through the tier at most 1.10x the direct call's latency at p50. The tier builds the
request from typed questions, sends it on its pooled client (deadline, in-flight bound, retry and
pause bookkeeping), reads the answers as distributions (shapes checked) and checks the identity
they state; the baseline is a plain ``httpx.Client`` POST of the same body and ``response.json()``.

Upstreams, each its own process on loopback (so that its CPU is not this process's GIL):
- jevcompat 0.1.1's mock (``jevcompat mock``): answers in about a millisecond, so the tier's own
  work shows as much as it ever can (the harsh case);
- the project's own teacher server (``cascade serve --teacher gemma-3-270m``, one thread): a
  real readout, hundreds of milliseconds a request (the usual case), at 1 client only: at 16 the
  latency would be the queue of one worker.

Side by side: each round sends the same requests through both, in turns that alternate which
goes first; latencies are pooled over the rounds. Loopback only, bounded (``--requests`` per
contender per round, ``--rounds`` rounds, a timeout on every call) and stops by itself.

    PYTHONPATH=. .venv/bin/python -m bench.upstream_overhead --requests 200 --rounds 5
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import argument_parser, markdown, process

QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does this convey urgency?"},
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "Payments, invoicing, refunds", "technical": "Bugs, outages"}},
    "severity": {"type": "score", "instructions": "How severe is the problem?",
                 "criteria": ["Minor", "Degraded", "Blocking"]},
}
TIMEOUT = 60.0
RESETS = {"direct": 0}
"""Connections the upstream reset under the direct calls (jevcompat's mock listens with a backlog
of 5: at 16 clients some connects are reset), each sent again as the tier's client does."""


def bodies(n: int, model: str | None) -> list[dict[str, Any]]:
    states = [f"Message {i}: my payouts have failed for {i % 7 + 1} days; please look into it."
              for i in range(n)]
    return [{"state": s, "questions": QUESTIONS, **({"model": model} if model else {})} for s in states]


def timed(clients: int, work: list[dict[str, Any]], call: Callable[[dict[str, Any]], object]) -> list[float]:
    """Seconds of each call, ``clients`` threads sharing ``work``."""
    def one(body: dict[str, Any]) -> float:
        started = time.perf_counter()
        call(body)
        return time.perf_counter() - started

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, work))


Call = Callable[[dict[str, Any]], object]


def contenders(url: str, model: str | None, clients: int) -> tuple[dict[str, Call], Callable[[], None]]:
    """The direct call and the tier's, each on its own pooled client of ``clients`` connections."""
    import httpx

    from cascade.questions import parse_request
    from cascade.teachers.client import UpstreamClient
    from cascade.teachers.settings import UpstreamSettings
    from cascade.tiers.base import Item
    from cascade.tiers.upstream import UpstreamTier

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    direct = httpx.Client(limits=limits, timeout=TIMEOUT)
    tier = UpstreamTier("teacher", UpstreamClient(UpstreamSettings(
        url, model=model, max_in_flight=clients, read_timeout=TIMEOUT, deadline=TIMEOUT)))
    questions = dict(parse_request({"state": "-", "questions": QUESTIONS}).questions)

    def call_direct(body: dict[str, Any]) -> object:
        for attempt in range(3):  # as the tier's client: a reset connection is sent again
            try:
                response = direct.post(url, json=body)
                break
            except httpx.TransportError:
                if attempt == 2:
                    raise
                RESETS["direct"] += 1
        response.raise_for_status()
        return response.json()

    def call_tier(body: dict[str, Any]) -> object:
        return tier.ask(Item("bench", body["state"]), questions)

    def close() -> None:
        direct.close()
        tier.close()

    return {"direct": call_direct, "tier": call_tier}, close


def compare(url: str, model: str | None, clients: int, requests: int,
            rounds: int) -> dict[str, dict[str, float]]:
    """p50 and p99 of each contender over ``rounds`` interleaved rounds."""
    calls, close = contenders(url, model, clients)
    work = bodies(requests, model)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    try:
        for call in calls.values():  # warm: connections open, first-call costs paid
            timed(clients, work[: 2 * clients], call)
        for r in range(rounds):
            order = list(calls) if r % 2 == 0 else list(reversed(calls))
            for name in order:
                seconds[name] += timed(clients, work, calls[name])
    finally:
        close()
    return {name: {"p50_ms": 1e3 * float(np.percentile(s, 50)), "p99_ms": 1e3 * float(np.percentile(s, 99)),
                   "calls": float(len(s))} for name, s in seconds.items()}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--requests", type=int, default=200, help="requests per contender per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--teacher-requests", type=int, default=20,
                        help="requests per contender per round against the gemma teacher server")
    parser.add_argument("--port", type=int, default=18531)
    args = parser.parse_args()
    from cascade.readout.llama import default_gguf_path

    rows: dict[str, dict[str, dict[str, float]]] = {}
    mock = f"http://127.0.0.1:{args.port}"
    with process([str(Path(sys.executable).parent / "jevcompat"), "mock", "--port", str(args.port)],
                 mock, "/v1/models"):
        for clients in (1, 16):
            rows[f"jevcompat mock, {clients} client(s)"] = compare(
                f"{mock}/v1/systemone", "mock", clients, args.requests, args.rounds)
    teacher = f"http://127.0.0.1:{args.port + 1}"
    command = [sys.executable, "-m", "distill.cli", "serve", "--teacher", str(default_gguf_path()),
               "--port", str(args.port + 1), "--threads", "1", "--max-wait", "60"]
    with process(command, teacher, "/health"):
        rows["own teacher server (gemma-3-270m), 1 client"] = compare(
            f"{teacher}/v1/systemone", None, 1, args.teacher_requests, args.rounds)
    table = [[name, f"{r['direct']['p50_ms']:.2f}", f"{r['tier']['p50_ms']:.2f}",
              f"{r['tier']['p50_ms'] / r['direct']['p50_ms']:.3f}x", f"{r['direct']['p99_ms']:.2f}",
              f"{r['tier']['p99_ms']:.2f}", f"{r['tier']['p99_ms'] / r['direct']['p99_ms']:.3f}x",
              f"{r['tier']['calls']:.0f}"] for name, r in rows.items()]
    print(markdown(["upstream, clients", "direct p50 ms", "tier p50 ms", "p50 ratio", "direct p99 ms",
                    "tier p99 ms", "p99 ratio", "calls each"], table))
    print(f"connections reset and sent again by the direct client: {RESETS['direct']}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
