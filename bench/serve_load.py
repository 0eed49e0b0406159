"""``cascade serve`` under load, against in-process ``Cascade.route`` on the same items.

Loopback only, bounded (a fixed number of requests per run, a timeout per request) and stops by
itself. The bundle (bench.common's ``support_bundle``) is trained here on the demo's generated support
messages and their generator labels, with gemma-3-270m as its live teacher; thresholds fix each
question's route so that the runs measure the server, not the thresholds: "urgent" is kept by the
encoder (easy requests), "department" always escalates to the teacher (hard requests).

Runs, each its own server process (``cascade serve``, the command users run), the client here:
1. easy requests at 1, 4 and 16 concurrent clients, server and in-process side by side (the
   in-process baseline: the same number of threads calling ``Cascade.route`` on one cascade
   behind a lock, since a llama.cpp context is not shared between threads), and the server
   again with request batching off (``--no-batch``);
2. easy requests from one client while 8 clients keep the teacher saturated with hard ones,
   against the same easy requests without them (``--threads 1`` for every model, so that the
   teacher leaves a core to the encoder on a 2-core machine: the run measures queueing).

    PYTHONPATH=. .venv/bin/python -m bench.serve_load --requests 200
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.common import EASY, HARD, SERVE_TIMEOUT, argument_parser, server, support_bundle, support_messages
from cascade.readout.llama import default_gguf_path
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from distill.demo.synthetic import QUESTIONS_JSON


def body(state: str, question: str) -> dict[str, Any]:
    return {"state": state, "questions": {question: QUESTIONS_JSON[question]}}


def run_clients(clients: int, bodies: list[dict[str, Any]], call: Callable[[Any, dict[str, Any]], bool],
                make: Callable[[], Any]) -> dict[str, float]:
    """Send ``bodies`` from ``clients`` threads (each its own connection); latencies and losses."""
    latencies: list[float] = []
    lost = 0
    lock = threading.Lock()
    chunks = [bodies[k::clients] for k in range(clients)]

    def client(chunk: list[dict[str, Any]]) -> None:
        nonlocal lost
        handle = make()
        for one in chunk:
            started = time.perf_counter()
            ok = call(handle, one)
            with lock:
                latencies.append(time.perf_counter() - started)
                lost += not ok

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, chunks))
    wall = time.perf_counter() - started
    ordered = sorted(latencies)
    return {"requests": len(bodies), "lost": lost, "per_s": len(bodies) / wall,
            "p50_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def over_http(url: str) -> tuple[Callable[[Any, dict[str, Any]], bool], Callable[[], Any]]:
    def call(client: httpx.Client, one: dict[str, Any]) -> bool:
        try:
            return client.post(f"{url}/v1/systemone", json=one, timeout=SERVE_TIMEOUT).status_code == 200
        except httpx.HTTPError:
            return False
    return call, httpx.Client


def in_process(cascade: Cascade) -> tuple[Callable[[Any, dict[str, Any]], bool], Callable[[], Any]]:
    lock = threading.Lock()

    def call(_handle: None, one: dict[str, Any]) -> bool:
        with lock:
            cascade.route([Item("x", one["state"])], [list(one["questions"])])
        return True
    return call, lambda: None


def saturated(url: str, easy: list[dict[str, Any]], hard: list[dict[str, Any]]) -> dict[str, float]:
    """Easy requests from one client while 8 clients keep the teacher busy with hard ones."""
    stop = threading.Event()

    def keep_busy() -> None:
        with httpx.Client() as client:
            for one in hard:
                if stop.is_set():
                    return
                client.post(f"{url}/v1/systemone", json=one, timeout=SERVE_TIMEOUT)

    pressure = [threading.Thread(target=keep_busy) for _ in range(8)]
    for thread in pressure:
        thread.start()
    time.sleep(2.0)  # the teacher's queue fills
    call, make = over_http(url)
    result = run_clients(1, easy, call, make)
    stop.set()
    for thread in pressure:
        thread.join()
    return result


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--requests", type=int, default=200, help="requests per run (default 200)")
    parser.add_argument("--items", type=int, default=300, help="generated items to train on")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each model in run 1")
    args = parser.parse_args()
    teacher = default_gguf_path()
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bundle = support_bundle(Path(tmp), teacher, args.items)
        easy = [body(s, EASY) for s in support_messages(args.requests)]
        hard = [body(s, HARD) for s in support_messages(args.requests)]
        with Cascade.load(bundle, teacher=teacher, threads=args.threads) as cascade:
            call, make = in_process(cascade)
            run_clients(1, easy[:20], call, make)  # warm
            for clients in (1, 4, 16):
                rows[f"in-process, {clients} clients"] = run_clients(clients, easy, call, make)
        for batching, extra in (("batched", ()), ("one at a time", ("--no-batch",))):
            with server(bundle, teacher, args.port, args.threads, *extra) as url:
                call, make = over_http(url)
                run_clients(1, easy[:20], call, make)  # warm
                for clients in (1, 4, 16):
                    rows[f"server {batching}, {clients} clients"] = run_clients(clients, easy, call, make)
        with server(bundle, teacher, args.port, 1) as url:
            call, make = over_http(url)
            few = easy[: max(20, args.requests // 4)]
            run_clients(1, few, call, make)  # warm
            rows["easy alone (1 thread per model)"] = run_clients(1, few, call, make)
            rows["easy while 8 clients saturate the teacher"] = saturated(url, few, hard)
    print(f"{'run':<46} {'requests':>8} {'lost':>5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for name, row in rows.items():
        print(f"{name:<46} {row['requests']:>8.0f} {row['lost']:>5.0f} {row['per_s']:>8.1f} "
              f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}")
    one_server, one_local = rows["server batched, 1 clients"], rows["in-process, 1 clients"]
    ratio = one_server["p50_ms"] / one_local["p50_ms"]
    print(f"\nserver / in-process latency at 1 client (p50): {ratio:.2f}x")
    alone, busy = rows["easy alone (1 thread per model)"], rows["easy while 8 clients saturate the teacher"]
    print(f"easy p50 under teacher saturation / alone: {busy['p50_ms'] / alone['p50_ms']:.2f}x")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
