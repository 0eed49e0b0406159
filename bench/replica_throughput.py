"""One replica against its encoder: does ``cascade serve`` turn the encoder's throughput into answers?

On AG News, with a URL teacher (the replay upstream of bench.serve_upstream: the committed
Qwen2.5-Coder-1.5B labels, stating that GGUF's identity), side by side in one run (this process
drives all of them, loopback only, a fixed count of items and a timeout per request):

1. the bundle's encoder tier on the whole list at once (``EncoderTier.reply``): the ceiling;
2. ``Cascade.decide_batch`` in batches of ``--batch`` (in-process, the escalations sent upstream);
3. ``cascade serve`` (a subprocess, the command users run), one item per request from
   ``--clients`` concurrent clients; then its p50 latency from one client.

Each path answers the same ``--items`` items (items 4,001 on of the exports, unseen in training),
``--rounds`` times in turn; the medians are reported with their ratios to the encoder's. Goals
(issue 43): the server at 0.8x the encoder, ``decide_batch`` at 0.9x. Two figures per path: items
a second (wall), and items per CPU-second of the process doing the work (this one's threads for
the encoder and ``decide_batch``, the server's for the server; not the clients', nor the replay
upstream's): on cores other work shares, wall time moves with that work and CPU time far less,
and on cores a replica has to itself the two agree.

The bundle: the encoder tier trained on the first ``--train`` labelled items, its threshold set so
that the encoder keeps ``--kept`` of the traffic (the route is fixed, so that the run measures
serving, not calibration); cached under ~/.cache/cascade-bench/replica_throughput.

    PYTHONPATH=. .venv/bin/python -m bench.replica_throughput --items 800 --clients 16 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    CACHE_DIR,
    FIRST,
    PROMPT,
    SECOND,
    SHA256,
    TEACHER,
    TOPIC,
    argument_parser,
    markdown,
    process,
    texts_by_id,
)

WORK = CACHE_DIR / "replica_throughput"
TIMEOUT = 60.0
QID = "topic"


def traffic(n: int) -> list[str]:
    """The first ``n`` items of the second export (never trained on)."""
    texts = texts_by_id()
    rows = [json.loads(line) for line in SECOND.open(encoding="utf-8")][:n]
    return [texts[row["id"]] for row in rows]


def trained(work: Path, train: int) -> Path:
    """The encoder tier trained on the first ``train`` items of the first export, the 1.5B GGUF
    pinned as its teacher afterwards (the replay upstream states its identity; the file itself
    is not needed). Cached in ``work``."""
    bundle = work / f"trained-{train}"
    if (bundle / "manifest.json").is_file():
        return bundle
    from cascade.bundle.manifest import Bundle, Manifest
    from cascade.questions import parse_request
    from distill.labelling.transfer import import_labels
    from distill.options import CorpusInput, RunOptions
    from distill.store import LabelStore, Teacher
    from distill.training.run import train_bundle

    work.mkdir(parents=True, exist_ok=True)
    texts = texts_by_id()
    rows = [json.loads(line) for line in FIRST.open(encoding="utf-8")][:train]
    corpus, labels = work / f"corpus-{train}.jsonl", work / f"labels-{train}.jsonl"
    corpus.write_text("".join(json.dumps({"id": r["id"], "text": texts[r["id"]]}) + "\n" for r in rows))
    labels.write_text("".join(json.dumps(r) + "\n" for r in rows))
    questions = parse_request({"state": "x", "questions": TOPIC}).questions
    with LabelStore(work / f"labels-{train}.sqlite", Teacher(kind="external", model=TEACHER)) as store:
        import_labels(store, labels, questions)
        made = train_bundle(questions, CorpusInput(corpus), store, work / f"external-{train}",
                            run=RunOptions(progress=False))
    data = made.manifest.model_dump(mode="json")
    data["teacher"] = {"kind": "gguf", "model": f"{TEACHER}.gguf", "model_sha256": SHA256,
                       "prompt_version": PROMPT}
    Bundle(Manifest.model_validate(data), made.directory).save(bundle)
    return bundle


def fixed_route(bundle: Path, states: list[str], kept: float, upstream: str) -> Path:
    """The bundle with its encoder threshold at the score that keeps ``kept`` of ``states``."""
    from cascade.bundle.manifest import Bundle, Manifest
    from cascade.routing.router import Cascade
    from cascade.thresholds import threshold_score
    from cascade.tiers.base import Item

    out = bundle.parent / f"{bundle.name}-kept-{kept:g}-{len(states)}"
    if (out / "manifest.json").is_file():
        return out
    with Cascade.load(bundle, teacher=upstream) as cascade:
        encoder = cascade.tiers[0]
        reply = encoder.reply([Item(str(i), s) for i, s in enumerate(states)], [[QID]] * len(states),
                              cascade.questions)
        scores = [float(threshold_score(np.asarray(a[QID]), cascade.manifest.threshold_on))
                  for a in reply.answers]
        name = encoder.name
    loaded = Bundle.load(bundle)
    data = loaded.manifest.model_dump(mode="json")
    data["thresholds"] = {QID: {name: float(np.quantile(scores, 1 - kept))}}
    Bundle(Manifest.model_validate(data), loaded.directory).save(out)
    return out


# -- the three paths --------------------------------------------------------------------------------

Rate = tuple[float, float]
"""Items a second of wall time, items per CPU-second."""


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of process ``pid``; of this one where None."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(n: int, work: Callable[[], None], pid: int | None = None) -> Rate:
    """``n`` items' ``work``, timed by the wall clock and by the CPU of process ``pid``."""
    wall, cpu = time.perf_counter(), cpu_seconds(pid)
    work()
    return n / (time.perf_counter() - wall), n / (cpu_seconds(pid) - cpu)


def encoder_alone(cascade: Any, states: list[str]) -> Rate:
    """The encoder tier on the whole list in one call."""
    from cascade.tiers.base import Item

    items = [Item(str(i), s) for i, s in enumerate(states)]
    return timed(len(items), lambda: cascade.tiers[0].reply(items, [[QID]] * len(items), cascade.questions))


def decide_batches(cascade: Any, states: list[str], batch: int) -> float:
    """``Cascade.decide_batch`` in batches of ``batch``; the share the encoder kept."""
    from cascade.tiers.base import Item

    kept = 0
    for first in range(0, len(states), batch):
        chunk = [Item(str(first + i), s) for i, s in enumerate(states[first:first + batch])]
        for response in cascade.decide_batch(chunk):
            kept += response.answers[QID].routing.tier == cascade.tiers[0].name
    return kept / len(states)


def over_http(url: str, states: list[str], clients: int) -> dict[str, float]:
    """One item per request from ``clients`` threads (each its own connection): items/s, p50 ms,
    lost requests and the share the encoder kept."""
    import httpx

    latencies: list[float] = []
    tiers: list[str] = []
    lost = 0

    def client(chunk: list[str]) -> None:
        nonlocal lost
        with httpx.Client(timeout=TIMEOUT) as http:
            for state in chunk:
                begun = time.perf_counter()
                reply = http.post(f"{url}/v1/systemone", json={"state": state, "questions": TOPIC})
                latencies.append(time.perf_counter() - begun)
                if reply.status_code != 200:
                    lost += 1
                    continue
                tiers.append(reply.json()["answers"][QID]["x_routing"]["tier"])

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, [states[k::clients] for k in range(clients)]))
    wall = time.perf_counter() - started
    return {"per_s": len(states) / wall, "p50_ms": 1e3 * statistics.median(latencies), "lost": lost,
            "kept": sum(t == "encoder" for t in tiers) / max(1, len(tiers))}


def serve_command(bundle: Path, teacher: str, port: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "distill.cli", "serve", "--bundle", str(bundle), "--teacher", teacher,
            "--port", str(port), "--threads", str(threads)]


def rounds(paths: dict[str, Callable[[], Rate]], n: int) -> dict[str, Rate]:
    """The median rates of each path over ``n`` rounds, the paths taking turns in each round."""
    seen: dict[str, list[Rate]] = {name: [] for name in paths}
    for _ in range(n):
        for name, path in paths.items():
            seen[name].append(path())
    return {name: (statistics.median(w for w, _ in rates), statistics.median(c for _, c in rates))
            for name, rates in seen.items()}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=800, help="traffic items (default 800)")
    parser.add_argument("--train", type=int, default=1000, help="labelled items to train on")
    parser.add_argument("--kept", type=float, default=0.9, help="share of the traffic the encoder keeps")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="decide_batch's batch size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-items", type=int, default=200, help="requests of the one-client run")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of the encoder (both sides)")
    parser.add_argument("--port", type=int, default=18461)
    args = parser.parse_args()
    from cascade.routing.router import Cascade

    states = traffic(args.items)
    upstream, server = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    teacher = f"{upstream}/v1/systemone"
    with process([sys.executable, "-m", "bench.serve_upstream", "upstream", "--port", str(args.port)],
                 upstream):
        bundle = fixed_route(trained(WORK, args.train), states, args.kept, teacher)
        with process(serve_command(bundle, teacher, args.port + 1, args.threads), server) as serving, \
                Cascade.load(bundle, teacher=teacher, threads=args.threads) as cascade:
            over_http(server, states[:32], 4)  # warm both
            decide_batches(cascade, states[:32], args.batch)
            kept: dict[str, float] = {}

            def batches() -> None:
                kept["decide_batch"] = decide_batches(cascade, states, args.batch)

            def served() -> None:
                row = over_http(server, states, args.clients)
                kept["server"] = row["kept"]
                if row["lost"]:
                    raise RuntimeError(f"{row['lost']} requests failed")

            n = len(states)
            figures = rounds({"encoder": lambda: encoder_alone(cascade, states),
                              "decide_batch": lambda: timed(n, batches),
                              "server": lambda: timed(n, served, serving.pid)}, args.rounds)
            one = over_http(server, states[:args.latency_items], 1)
    wall, cpu = figures["encoder"]
    names = {"encoder": "the encoder tier on the whole list",
             "decide_batch": f"`Cascade.decide_batch`, batches of {args.batch}",
             "server": f"`cascade serve`, one item per request, {args.clients} clients"}
    print(f"{args.items} AG News items, the encoder keeping {kept['server']:.1%} (server) and "
          f"{kept['decide_batch']:.1%} (decide_batch); median of {args.rounds} rounds")
    print(markdown(["path", "items/s", "/ the encoder", "items per CPU-second", "/ the encoder"],
                   [[names[k], f"{w:.1f}", f"{w / wall:.2f}", f"{c:.1f}", f"{c / cpu:.2f}"]
                    for k, (w, c) in figures.items()]))
    print(f"\n`cascade serve` at one client: p50 {one['p50_ms']:.1f} ms ({one['per_s']:.1f} items/s)")
    print(json.dumps({"items_per_s": figures, "kept": kept, "one_client": one}))


if __name__ == "__main__":
    main()
