"""``cascade serve`` against hostile requests: how fast a bound refuses, and /health meanwhile.

1. In one process, side by side: what the server used to do with a JSON state before reading it
   (``render_state``: indented JSON, in the pure-Python encoder) against what it does now first
   (``state_size``: the rendered length and depth, computed without rendering), on the attack
   that stalled the server (copies of an array nested 900 deep) and on an ordinary nested record.
2. A ``cascade serve`` process (bench.common's support bundle, gemma-3-270m live as its teacher,
   default limits): /health's latency, polled from one client, while idle, while the 900-deep
   attack is refused, while a long teacher read is in flight (8 foreign choices of 16 options),
   and while the worst request the default limits allow in work is sent: 64 questions (the
   bundle's "urgent" and 63 foreign choices of 16 options: 1,010 options) about a support message
   the teacher reads whole. The teacher has answered a few ordinary requests first, so that its
   time per unit of work is measured and a request whose own work is past --max-wait is refused
   (413) rather than read for minutes.

Loopback only, bounded (a fixed number of polls and requests) and stops by itself.

    PYTHONPATH=. .venv/bin/python -m bench.serve_hostile
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    EASY,
    HARD,
    SERVE_TIMEOUT,
    argument_parser,
    markdown,
    server,
    support_bundle,
    support_messages,
)
from cascade.readout.llama import default_gguf_path
from cascade.readout.prompts import render_state, state_size
from distill.demo.synthetic import QUESTIONS_JSON


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def record(n: int) -> dict[str, Any]:
    """An ordinary nested JSON state: a ticket with its history."""
    events = [{"at": i, "kind": "reply", "text": "We are looking into it."} for i in range(n)]
    return {"ticket": {"id": 7, "customer": {"name": "Ada", "plan": "pro"}, "events": events}}


def render_against_size(states: dict[str, Any], repeats: int) -> list[list[str]]:
    rows = []
    for name, state in states.items():
        times: dict[str, list[float]] = {"render": [], "size": []}
        for _ in range(repeats):
            for what, call in (("render", render_state), ("size", state_size)):
                started = time.perf_counter()
                call(state)
                times[what].append(time.perf_counter() - started)
        render, size = (statistics.median(times[w]) for w in ("render", "size"))
        chars = state_size(state)
        rows.append([name, f"{chars.chars:,}", str(chars.depth), f"{1e3 * render:.2f}", f"{1e3 * size:.2f}",
                     f"{render / size:.1f}x"])
    return rows


def health_while(url: str, body: dict[str, Any] | None, polls: int) -> tuple[list[float], str]:
    """/health latencies (s) while ``body`` is in flight (None: idle, ``polls`` of them), and the
    request's status and seconds."""
    done: list[str] = []

    def send() -> None:
        started = time.perf_counter()
        reply = httpx.post(f"{url}/v1/systemone", json=body, timeout=SERVE_TIMEOUT)
        done.append(f"{reply.status_code} in {time.perf_counter() - started:.2f} s")

    worker = threading.Thread(target=send) if body is not None else None
    if worker is not None:
        worker.start()
    latencies: list[float] = []
    with httpx.Client(timeout=SERVE_TIMEOUT) as client:
        while (len(latencies) < polls) if worker is None else worker.is_alive():
            started = time.perf_counter()
            client.get(f"{url}/health")
            latencies.append(time.perf_counter() - started)
    if worker is not None:
        worker.join()
    return latencies, done[0] if done else "-"


def worst_request(state: str, foreign: int = 63) -> dict[str, Any]:
    choices = {f"f{i}": {"type": "choice", "instructions": f"Which label fits best? ({i})",
                         "criteria": {f"label{i}_{k}": None for k in range(16)}} for i in range(foreign)}
    return {"state": state, "questions": {EASY: QUESTIONS_JSON[EASY], **choices}}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--polls", type=int, default=200, help="health polls while idle (default 200)")
    args = parser.parse_args()
    states = {"900 deep x 4": [nested(900)] * 4, "900 deep x 40 (the attack)": [nested(900)] * 40,
              "a ticket of 200 events": record(200)}
    print(markdown(["state", "rendered chars", "depth", "render ms", "state_size ms", "ratio"],
                   render_against_size(states, 3)))
    teacher = default_gguf_path()
    message = " ".join(support_messages(6))
    with tempfile.TemporaryDirectory() as root, server(support_bundle(Path(root), teacher, 200), teacher,
                                                       args.port, 2) as url:
        for state in support_messages(3):  # the teacher's time per unit, measured
            hard = {"state": state, "questions": {HARD: QUESTIONS_JSON[HARD]}}
            httpx.post(f"{url}/v1/systemone", json=hard, timeout=SERVE_TIMEOUT).raise_for_status()
        runs = {"idle": None, "the 900-deep attack": {"state": states["900 deep x 40 (the attack)"],
                                                      "questions": {EASY: QUESTIONS_JSON[EASY]}},
                "8 questions read by the teacher": worst_request(message, 8),
                f"64 questions, 1,010 options, a {len(message):,}-char state": worst_request(message)}
        rows = []
        for name, body in runs.items():
            latencies, outcome = health_while(url, body, args.polls)
            rows.append([name, outcome, str(len(latencies)), f"{1e3 * statistics.median(latencies):.1f}",
                         f"{1e3 * max(latencies):.1f}"])
    print(markdown(["while", "request", "health polls", "health p50 ms", "health max ms"], rows))


if __name__ == "__main__":
    main()
