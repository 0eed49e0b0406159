"""Resident memory of a server through repeated promotions, with and without handing each retired
bundle's freed pages back to the system (``cascade.serve.memory``).

The server (``create_app`` with a bundle link, as ``cascade serve --bundle`` runs it, driven in
process) loads the AG News seed bundle of bench.serve_growth with the 1.5B GGUF as its local
teacher, then takes ``--swaps`` promotions in a row, cycling through ``--versions`` calibrations
of it (copies whose calibration differs, as promotions leave them), one request answered by each.
After each swap, once the retired bundle's engine has stopped, it records the process's resident
memory (VmRSS). Each arm runs in a process of its own (memory, unlike time, is not shared fairly
between arms of one process); the baseline sets ``cascade.serve.memory.TRIM`` off.

    PYTHONPATH=. .venv/bin/python -m bench.swap_memory --swaps 40
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import TEACHER, TOPIC, argument_parser, markdown, texts_by_id
from bench.serve_growth import WORK, seed


def resident_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this benchmark needs Linux")


def recalibrated(source: Path, to: Path, day: int) -> Path:
    """A copy of ``source`` whose calibration is another version (made on December ``day``), as
    promotions leave them; tests/test_serve_swap.py makes its versions with it too."""
    from cascade.bundle.manifest import Bundle

    bundle = Bundle.load(source)
    data = bundle.manifest.model_dump(mode="json")
    data["calibration"]["calibrated_at"] = f"2026-12-{day:02d}T00:00:00Z"
    Bundle(type(bundle.manifest).model_validate(data), source).save(to)
    return to


def point(link: Path, target: Path) -> None:
    fresh = link.with_name(link.name + ".tmp")
    fresh.unlink(missing_ok=True)
    fresh.symlink_to(target)
    fresh.replace(link)


def wait(check: Callable[[], bool], what: str, seconds: float = 600.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {seconds} s")
        time.sleep(0.05)


def child(bundle: Path, swaps: int, versions: int, trim: bool) -> list[float]:
    """One arm: the resident MB after each swap."""
    from fastapi.testclient import TestClient

    from cascade.routing.router import Cascade
    from cascade.serve import memory
    from cascade.serve.app import BundleSource, ServeConfig, create_app
    from cascade.serve.engine_settings import EngineSettings
    from distill.labelling.teachers import teacher_path

    memory.TRIM = trim
    teacher = teacher_path(TEACHER)
    root = Path(tempfile.mkdtemp(prefix="swap-memory-"))
    every = [recalibrated(bundle, root / f"v{day}", day) for day in range(1, versions + 1)]
    link = root / "current"
    point(link, every[0])
    load = lambda directory: Cascade.load(directory, teacher=teacher, threads=2)  # noqa: E731
    app = create_app(None, ServeConfig(bundle=BundleSource(link, load, interval=0.05),
                                       engine=EngineSettings(max_wait=600.0)))
    state = next(iter(texts_by_id().values()))
    seen = []
    with TestClient(app) as client:
        wait(lambda: app.state.loaded.serving is not None, "the first bundle loaded")
        for swap in range(swaps):
            target = every[(swap + 1) % len(every)]
            point(link, target)
            wait(lambda t=target: app.state.loaded.serving.version.directory == t.resolve(), "the swap")
            assert client.post("/v1/systemone", json={"state": state, "questions": TOPIC}).status_code == 200
            wait(lambda: not any(t.name.startswith("cascade-retire") for t in threading.enumerate()),
                 "the retired engine stopped")
            seen.append(resident_mb())
    return seen


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--swaps", type=int, default=40, help="promotions in a row (default 40)")
    parser.add_argument("--versions", type=int, default=6, help="calibrations cycled through (default 6)")
    parser.add_argument("--child", choices=("off", "on"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    made = seed(WORK, 500, 0.98, 0.05)
    if args.child:
        print(json.dumps(child(made.bundle, args.swaps, args.versions, args.child == "on")))
        return
    arms = {}
    for trim in ("off", "on"):
        done = subprocess.run([sys.executable, "-m", "bench.swap_memory", "--swaps", str(args.swaps),
                               "--versions", str(args.versions), "--child", trim],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the {trim} arm failed ({done.returncode}):\n{done.stderr[-3000:]}")
        arms[trim] = json.loads(done.stdout.strip().splitlines()[-1])
    marks = sorted(k for k in {0, 4, 9, args.swaps // 2 - 1, args.swaps - 1} if 0 <= k < args.swaps)
    rows = [[str(k + 1), f"{arms['off'][k]:.0f}", f"{arms['on'][k]:.0f}"] for k in marks]
    last = max(1, args.swaps // 4)
    rows.append([f"largest of the last {last}", f"{max(arms['off'][-last:]):.0f}",
                 f"{max(arms['on'][-last:]):.0f}"])
    print(markdown(["after swap", "resident MB, pages kept (baseline)", "resident MB, given back"], rows))
    print(json.dumps(arms))


if __name__ == "__main__":
    main()
