"""Audits under load with a URL teacher: how many chosen audits are done, and how many dropped.

``cascade serve`` (a process of its own, the command users run) serves the support bundle of
bench.common (gemma-3-270m pinned as its teacher; the question asked, ``urgent``, is kept by the
encoder) in front of a replay upstream on loopback: a System One server stating gemma's identity
(its sha256 and the readout prompt hashes, so that the bundle's certificate holds and audits run)
and answering each question with a distribution fixed by the state's hash after ``--delay``
seconds (an asynchronous sleep: a network upstream's latency, with capacity to spare for calls
in parallel). ``--clients`` clients send ``--requests``
requests with ``--audit-share 1``; once every chosen audit has an outcome, ``/metrics`` gives
audited and dropped. ``--source DIR`` runs the server from another checkout (the code before
the change, exported with ``git archive``), whose flags are the old ones.

    PYTHONPATH=. .venv/bin/python -m bench.audits_under_load --requests 1000 --clients 8
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    EASY,
    SERVE_TIMEOUT,
    argument_parser,
    markdown,
    process,
    support_bundle,
    support_messages,
)

OUTCOMES = ("audited", "dropped", "failed", "unreadable")


def replay_app(model_sha256: str, delay: float) -> Any:
    """A System One app answering as the GGUF of ``model_sha256`` would state itself, each answer
    a distribution fixed by a hash of the state and question (no model runs), after ``delay`` s."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from cascade.questions import parse_request
    from cascade.readout.prompts import PROMPT_VERSION, template_sha256

    async def health(_request: Any) -> Any:
        return JSONResponse({"status": "ok", "models": [{"name": "replay"}]})

    async def decide(request: Any) -> Any:
        parsed = parse_request(await request.body())
        await asyncio.sleep(delay)
        answers = {qid: _answer(q, f"{parsed.state}|{qid}") for qid, q in parsed.questions.items()}
        return JSONResponse({"model": "replay", "answers": answers,
                             "usage": {"input_tokens": 0, "output_tokens": 0},
                             "audit": {"model_hash": model_sha256, "calibration_version": "uncalibrated",
                                       "prompt_template_sha256": [template_sha256(q, PROMPT_VERSION)
                                                                  for q in parsed.questions.values()]}})

    return Starlette(routes=[Route("/health", health), Route("/v1/models", health),
                             Route("/v1/systemone", decide, methods=["POST"])])


def _answer(question: Any, key: str) -> dict[str, Any]:
    """``question``'s answer: 0.9 on the option a hash of ``key`` picks, the rest spread evenly."""
    keys = question.option_keys()
    pick = int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(keys)
    probs = {k: 0.9 if i == pick else 0.1 / (len(keys) - 1) for i, k in enumerate(keys)}
    if question.type == "noul":
        return {"type": "noul", "noul": probs[keys[0]]}
    if question.type == "choice":
        return {"type": "choice", "choice": keys[pick], "probabilities": probs}
    return {"type": question.type, "score": sum(i * p for i, p in enumerate(probs.values())),
            "probabilities": probs}


def counts(base: str) -> dict[str, float]:
    """The audit lines of the server's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=SERVE_TIMEOUT).text
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
            if line.startswith("cascade_audit"))}


def outcome(seen: dict[str, float], name: str) -> float:
    return seen.get('cascade_audits_total{outcome="' + name + '"}', 0.0)


def run(bundle: Path, teacher: str, port: int, source: Path, requests: int, clients: int,
        extra: list[str], store: Path) -> dict[str, float]:
    """One server from ``source`` in front of the replay upstream at ``teacher``, the burst sent:
    its audit counts once every chosen audit has an outcome (bounded at 600 s)."""
    # ``python -m`` would put the working folder first on the path: the source is put before it
    start = f"import runpy, sys; sys.path.insert(0, {str(source)!r}); runpy.run_module('distill.cli', " \
            "run_name='__main__')"
    command = [sys.executable, "-c", start, "serve", "--bundle", str(bundle), "--teacher", teacher,
               "--port", str(port), "--threads", "1", "--audit-share", "1", "--audit-store", str(store),
               "--on-drift", "alarm", *extra]
    base = f"http://127.0.0.1:{port}"
    from distill.demo.synthetic import QUESTIONS_JSON

    bodies = [{"state": s, "questions": {EASY: QUESTIONS_JSON[EASY]}} for s in support_messages(requests)]
    with process(command, base, seconds=SERVE_TIMEOUT), httpx.Client(timeout=SERVE_TIMEOUT) as client, \
            ThreadPoolExecutor(clients) as pool:
        started = time.perf_counter()
        url = f"{base}/v1/systemone"
        codes = list(pool.map(lambda body: client.post(url, json=body).status_code, bodies))
        took = time.perf_counter() - started
        deadline = time.monotonic() + 600
        while True:
            seen = counts(base)
            done = sum(outcome(seen, o) for o in OUTCOMES)
            if done >= requests or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return {"answered": float(codes.count(200)), "seconds": took, **seen}


def main() -> None:
    from cascade.hashing import file_sha256
    from cascade.readout.llama import default_gguf_path
    parser = argument_parser(__doc__)
    parser.add_argument("mode", nargs="?", choices=("bench", "upstream"), default="bench",
                        help="bench (default), or run the replay upstream (with --port)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--items", type=int, default=300, help="generated items the bundle trains on")
    parser.add_argument("--source", type=Path, action="append", default=[],
                        help="a checkout to run the server from (repeat; default: this one)")
    parser.add_argument("--delay", type=float, default=0.1, help="the replay upstream's seconds a call")
    parser.add_argument("--port", type=int, default=18741)
    parser.add_argument("--audit-in-flight", type=int, default=4,
                        help="cascade serve --audit-in-flight, for the sources that have it (4)")
    args = parser.parse_args()
    teacher = default_gguf_path()
    if args.mode == "upstream":
        import uvicorn

        app = replay_app(file_sha256(teacher), args.delay)
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
        return
    here = Path(__file__).resolve().parent.parent
    sources = args.source or [here]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = support_bundle(Path(tmp), teacher, args.items)
        upstream = f"http://127.0.0.1:{args.port}"
        os.environ["PYTHONPATH"] = str(here)
        with process([sys.executable, "-m", "bench.audits_under_load", "upstream", "--port", str(args.port),
                      "--delay", str(args.delay)],
                     upstream):
            for n, source in enumerate(sources):
                store = Path(tmp) / f"audits-{n}.sqlite"
                new = (source / "cascade" / "audit" / "deferral.py").is_file()
                flags = ["--audit-in-flight", str(args.audit_in_flight)] if new else []
                seen = run(bundle, f"{upstream}/v1/systemone", args.port + 1 + n, source, args.requests,
                           args.clients, flags, store)
                rows.append([str(source), " ".join(flags) or "-", f"{seen['answered']:.0f}",
                             f"{seen['seconds']:.1f}",
                             *(f"{outcome(seen, o):.0f}" for o in OUTCOMES),
                             f"{outcome(seen, 'audited') / args.requests:.3f}"])
    print(f"{args.requests} requests from {args.clients} clients, --audit-share 1, replay upstream "
          f"answering in {args.delay:g} s")
    print(markdown(["server source", "flags", "answered", "burst s", *OUTCOMES, "audited share"], rows))


if __name__ == "__main__":
    main()
