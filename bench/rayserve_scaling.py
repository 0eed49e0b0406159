"""The cascade on Ray Serve against ``cascade serve``: items/s with 1 and 2 cheap-tier replicas,
and what Ray's proxy adds to one client's p50.

Loopback only, bounded (``--requests`` per run, a timeout per request). The bundle is
bench.common's ``support_bundle`` (the demo's generated support messages; "urgent" kept by the
encoder), asked only the question the encoder keeps, so every run measures the cheap tiers and
the path to them, not the teacher; the teacher is a URL nothing answers (no request reaches it).

Runs, one after the other on the same machine (a local Ray cluster started here, head on
loopback, ``serve run`` of the config ``cascade ray-config`` writes, as a user starts it):
1. ``cascade serve`` alone (``--threads 2``): 1 client, then 16;
2. Ray Serve, 1 replica of 2 CPUs (``--threads 2``): 1 client, then 16;
3. Ray Serve, 2 replicas of 1 CPU each (``--threads 1``): 16 clients.

On 2 cores the replicas share the cores with each other, Ray's proxy and the clients, so 2
replicas cannot beat 1 of 2 threads here: the ratio says what Ray's placement costs or gives at
a fixed core count, not how it scales on more machines.

    .venv/bin/python -m bench.rayserve_scaling --requests 400
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import EASY, argument_parser, server, support_bundle, support_messages
from bench.serve_load import body, over_http, run_clients
from cascade.readout.llama import default_gguf_path
from distill.cli import main as cascade
from distill.rayserve.proxy import IMPORT_PATH, VARIABLE

NOWHERE = "http://127.0.0.1:9/v1/systemone"
"""The replicas' teacher: the discard port, never called (every request stays at the encoder)."""
READY_S = 300.0


def ready(url: str) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {READY_S:.0f} s")


def deploy(address: str, folder: Path, bundle: Path, port: int, replicas: int, threads: int) -> str:
    """``cascade ray-config`` then ``serve run`` on the cluster at ``address``; the app's URL once
    every replica answers."""
    config = folder / f"serve-{replicas}.yaml"
    assert cascade(["ray-config", "--bundle", str(bundle), "--teacher", NOWHERE, "--out", str(config),
                    "--port", str(port), "--min-replicas", str(replicas), "--max-replicas", str(replicas),
                    "--replica-cpus", str(2 / replicas), "--", "--threads", str(threads),
                    "--audit-share", "0"]) == 0
    command = [str(Path(sys.executable).with_name("serve")), "run", "--address", address,
               "--non-blocking", str(config)]
    subprocess.run(command, check=True, capture_output=True, timeout=300, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    ready(f"{url}/health")
    return url


def measure(url: str, easy: list[dict], one_client: bool) -> dict[str, dict[str, float]]:
    call, make = over_http(url)
    run_clients(4, easy[:40], call, make)  # warm every replica
    rows = {"16 clients": run_clients(16, easy, call, make)}
    if one_client:
        rows["1 client"] = run_clients(1, easy[:200], call, make)
    return rows


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--requests", type=int, default=400, help="requests per 16-client run (default 400)")
    parser.add_argument("--items", type=int, default=300, help="generated items to train on")
    parser.add_argument("--port", type=int, default=18531)
    args = parser.parse_args()
    import ray
    from ray import serve

    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bundle = support_bundle(Path(tmp), default_gguf_path(), args.items)
        easy = [body(s, EASY) for s in support_messages(args.requests)]
        with server(bundle, default_gguf_path(), args.port, 2) as url:
            rows |= {f"cascade serve, {k}": v for k, v in measure(url, easy, True).items()}
        os.environ[VARIABLE] = IMPORT_PATH
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            address = ray.get_runtime_context().gcs_address
            for replicas, threads in ((1, 2), (2, 1)):
                url = deploy(address, Path(tmp), bundle, args.port + 1, replicas, threads)  # one proxy
                found = measure(url, easy, replicas == 1)
                rows |= {f"Ray Serve, {replicas} replica(s), {k}": v for k, v in found.items()}
                serve.delete("cascade")
        finally:
            serve.shutdown()
            ray.shutdown()
    alone = rows["cascade serve, 16 clients"]["per_s"]
    for name, row in rows.items():
        print(f"{name:45s} {row['per_s']:7.1f}/s ({row['per_s'] / alone:4.2f}x)  "
              f"p50 {row['p50_ms']:6.1f} ms  lost {row['lost']:.0f}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
