"""Growth measured as a server lives: AG News replayed through ``cascade serve`` with ``cascade loop``
retraining and promoting beside it (issue 41 Must 5).

Everything is a real process on loopback, as a user runs it:

- the replay upstream (``python -m bench.serve_upstream upstream``): every AG News state answered
  with the committed Qwen2.5-Coder-1.5B labels (bench/labels), stating that GGUF's identity;
- the seed bundle: trained and calibrated (``--target``, ``--delta``) on the first ``--seed-items``
  items with ``cascade label --import`` / ``train`` / ``calibrate``, its store naming the 1.5B GGUF
  as the teacher (cached under ~/.cache/cascade-bench/serve_growth); each run serves a copy of it
  through a pointer file (``RUN/serving``), with a copy of its store;
- ``cascade serve --bundle RUN/serving --teacher URL --audit-store RUN/labels.sqlite
  --audit-share S --escalation-share 1`` and ``cascade loop --bundle RUN/serving --store
  RUN/labels.sqlite --corpus SEED-CORPUS --every N --poll 5 --teacher-items 0`` (``--finetune``
  with ``--finetune``); the server sends the upstream uncompressed bodies (see COMPRESS);
- 8 clients (``--clients``) replay the items after the seed's in their order, one item per request,
  the AG News topic question, as fast as the server answers or at ``--rate`` requests a second
  (unpaced, 6,100 items take about 70 s, less than one retrain: pace them to see the loop decide
  as traffic flows).

The last ``--held-out`` items (1,000: items 6,601-7,600) are never replayed. At each decision the
loop logs, this records the items answered so far, the requests refused (any status but 200), the
teacher calls per answered item so far (the server's /metrics: upstream calls for escalations and
for audits, over requests), the gate's figures (PATH.promotions.jsonl) and each bundle's certified
share (its manifest). After the replay (and the loop's last due decision, at most ``--settle``
seconds), every bundle the loop made (its candidates, and a serving bundle a kept-aside gate
refreshed: ``distill.loop.promote``), the seed too, decides the held-out items through the library
(``Cascade.load`` with the replay upstream as its URL teacher, ``decide_batch``): the share the
encoder kept and its agreement with the committed labels (argmax), and the agreement of every answer.

Goals at 0.98 with a 5% audit share (issue 41): the held-out share never falls by more than 2
points at a promotion; at the end at least 75% kept (frozen) or 80% (fine-tuned); every promoted
bundle's held-out agreement (of the answers the encoder kept) at least 0.975; 0 requests refused.

    PYTHONPATH=. .venv/bin/python -m bench.serve_growth --items 1500 --every 300 --audit-share 0.2
    PYTHONPATH=. .venv/bin/python -m bench.serve_growth --audit-share 0.05 --every 1000 --rate 10 \
        --max-minutes 30 --settle 300
    PYTHONPATH=. .venv/bin/python -m bench.serve_growth --audit-share 0.2 --every 1000 --rate 10 \
        --max-minutes 30 --settle 300
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

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
from bench.serve_upstream import cli, metrics, serve_command
from cascade.private import private_file

WORK = CACHE_DIR / "serve_growth"
TIMEOUT = 60.0
QID = "topic"
COMPRESS = ("--upstream-compress", "identity")
"""The replay upstream reads bodies as sent, never inflated: a body the server compresses (1 KiB
and longer: 9 of the 6,100 replayed items) would get a 500 from it, and its client a 502."""


@dataclass(frozen=True)
class Item:
    """One AG News item in replay order: its state and the 1.5B's committed answer (argmax)."""

    id: str
    text: str
    label: str


def items_in_order() -> list[Item]:
    """All 7,600 items, the first export then the second, each with its committed answer."""
    texts = texts_by_id()
    rows = [json.loads(line) for path in (FIRST, SECOND) for line in path.open(encoding="utf-8")]
    return [Item(r["id"], texts[r["id"]], max(r["probabilities"], key=r["probabilities"].__getitem__))
            for r in rows]


# -- the seed ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seed:
    bundle: Path
    store: Path
    corpus: Path


def seed(work: Path, n: int, target: float, delta: float) -> Seed:
    """The seed bundle, trained and calibrated on the first ``n`` items with the commands a user
    runs, its store naming the 1.5B GGUF (as bench.serve_upstream.ag_news_bundle makes its own on
    4,000); cached in ``work``."""
    from distill.labelling.teachers import teacher_path

    home = work / f"seed-{n}-{target:g}-{delta:g}"
    made = Seed(home / "bundle", home / "labels.sqlite", home / "corpus.jsonl")
    if (made.bundle / "manifest.json").is_file():
        return made
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    rows = [json.loads(line) for line in FIRST.open(encoding="utf-8")][:n]
    texts = texts_by_id()
    (home / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    made.corpus.write_text("".join(json.dumps({"id": r["id"], "text": texts[r["id"]]}) + "\n" for r in rows))
    (home / "questions.json").write_text(json.dumps({"questions": TOPIC}))
    cli("label", "--import", str(home / "labels.jsonl"), "--questions", str(home / "questions.json"),
        "--store", str(made.store), "--teacher-name", f"{TEACHER}.gguf", "--teacher-sha256", SHA256,
        "--teacher-prompt-version", PROMPT)
    cli("train", "--questions", str(home / "questions.json"), "--corpus", str(made.corpus), "--store",
        str(made.store), "--bundle", str(made.bundle), "--teacher-model", str(teacher_path(TEACHER)),
        "--threads", "2")
    cli("calibrate", "--bundle", str(made.bundle), "--store", str(made.store), "--corpus", str(made.corpus),
        "--report", str(home / "report"), "--teacher-items", "0", "--target-agreement", f"{target}",
        "--delta", f"{delta}")
    return made


def fresh_run(work: Path, made: Seed) -> tuple[Path, Path]:
    """A run folder holding a copy of the seed bundle and of its store, and the pointer file
    ``serving`` naming the copy (a promotion rewrites it); returns (pointer, store)."""
    run = work / "runs" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    run.mkdir(parents=True)
    shutil.copytree(made.bundle, run / "seed")
    private_file(run / "labels.sqlite")  # it holds the replay's text, as a served store would
    with sqlite3.connect(made.store) as source, sqlite3.connect(run / "labels.sqlite") as copy:
        source.backup(copy)  # the write-ahead log's pages too, which a file copy would miss
    (run / "serving").write_text("seed\n")
    return run / "serving", run / "labels.sqlite"


# -- the replay ----------------------------------------------------------------------------------------

@dataclass
class Replay:
    """What the clients have done so far (read by the decision watcher while they run)."""

    answered: int = 0
    refused: int = 0
    codes: dict[int, int] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, code: int, body: str = "") -> None:
        """One answer; a refusal's body is kept (the first 20), to say why."""
        with self.lock:
            if code == 200:
                self.answered += 1
            else:
                self.refused += 1
                self.codes[code] = self.codes.get(code, 0) + 1
                if len(self.why) < 20:
                    self.why.append(f"{datetime.now(timezone.utc):%H:%M:%S} {code} {body[:300]}")


def replay(url: str, items: list[Item], clients: int, rate: float, until: float, seen: Replay) -> None:
    """``items`` in order from ``clients`` threads, one per request (the next item goes to the
    first free client), each at most ``rate`` a second overall (0: no pacing), stopping at ``until``
    (a monotonic time)."""
    import httpx

    next_item = iter(enumerate(items))
    take = threading.Lock()
    started = time.monotonic()

    def client(_: int) -> None:
        with httpx.Client(timeout=TIMEOUT) as http:
            while time.monotonic() < until:
                with take:
                    got = next(next_item, None)
                if got is None:
                    return
                i, item = got
                if rate > 0:
                    time.sleep(max(0.0, started + i / rate - time.monotonic()))
                try:
                    reply = http.post(url, json={"state": item.text, "questions": TOPIC})
                    seen.count(reply.status_code, reply.text if reply.status_code != 200 else "")
                except httpx.TransportError as exc:
                    seen.count(0, repr(exc))  # no answer at all: counted as refused

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))


def watch_decisions(log: Path, server: str, seen: Replay, stop: threading.Event,
                    snapshots: list[dict[str, Any]]) -> None:
    """At each new line of the loop log: the items answered and refused so far and the server's
    upstream counts, appended to ``snapshots`` with the line."""
    done = 0
    while not stop.wait(0.5):
        lines = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
        for line in lines[done:]:
            try:
                counted = metrics(server)
            except Exception:  # the server gone at the very end: figures unknown
                counted = {}
            snapshots.append({"decision": json.loads(line), "answered": seen.answered,
                              "refused": seen.refused, "metrics": counted})
        done = len(lines)


def settle(loop_out: Path, poll: float, seconds: float) -> None:
    """Wait (at most ``seconds``) until the loop, looking after the replay, found nothing due:
    its last due decision is then made and logged."""
    time.sleep(2 * poll)  # the last audits and escalations reach the store
    mark = loop_out.stat().st_size
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if "new teacher labels since the last retrain" in loop_out.read_text(encoding="utf-8")[mark:]:
            return
        time.sleep(1.0)


def teacher_calls(counted: dict[str, float]) -> float:
    """Upstream calls (escalations and audits) per answered request, from /metrics."""
    def get(name: str) -> float:
        return counted.get('cascade_upstream_total{count="' + name + '"}', float("nan"))

    return (get("calls") + get("audit_calls")) / get("requests") if get("requests") else float("nan")


# -- the held-out items ----------------------------------------------------------------------------------

def held_out(bundle: Path, items: list[Item], teacher: str, threads: int, cache: Path) -> dict[str, float]:
    """The bundle on ``items`` through the library, the replay upstream its teacher: the share the
    encoder kept, that share's agreement with the committed answers, every answer's agreement."""
    from cascade.routing.router import Cascade
    from cascade.tiers.base import Item as State

    kept = agreed_kept = agreed = 0
    with Cascade.load(bundle, teacher=teacher, threads=threads, cache_dir=cache) as cascade:
        cheap = cascade.tiers[0].name
        for first in range(0, len(items), 64):
            chunk = items[first:first + 64]
            answers = cascade.decide_batch([State(item.id, item.text) for item in chunk])
            for item, response in zip(chunk, answers, strict=True):
                answer = response.answers[QID]
                choice = getattr(answer, "choice", None)
                here = answer.routing is not None and answer.routing.tier == cheap
                kept += here
                agreed_kept += here and choice == item.label
                agreed += choice == item.label
    return {"kept": kept / len(items), "agreement_kept": agreed_kept / kept if kept else float("nan"),
            "agreement": agreed / len(items)}


def certified_share(bundle: Path) -> tuple[float, int]:
    """The share the encoder's certified threshold keeps on the items that certified it, and how
    many they were (the manifest's calibration facts)."""
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    facts = next(iter(manifest["calibration"]["questions"][QID].values()))
    return float(facts["kept_share"]), int(facts["n_threshold"])


# -- one run ---------------------------------------------------------------------------------------------

def run(args: Any, made: Seed, traffic: list[Item], held: list[Item]) -> dict[str, Any]:
    """One replay with the loop beside it; its decisions, snapshots and held-out figures."""
    pointer, store = fresh_run(WORK, made)
    upstream, server = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    teacher = f"{upstream}/v1/systemone"
    loop_out = pointer.parent / "loop.out"
    seen, stop = Replay(), threading.Event()
    snapshots: list[dict[str, Any]] = []
    loop_command = [sys.executable, "-m", "distill.cli", "loop", "--bundle", str(pointer), "--store",
                    str(store), "--corpus", str(made.corpus), "--every", str(args.every), "--poll",
                    f"{args.poll:g}", "--threads", str(args.loop_threads), "--teacher-items", "0",
                    *(["--finetune"] if args.finetune else [])]
    serve = serve_command(pointer, teacher, args.port + 1, "--audit-store", str(store), "--audit-share",
                          f"{args.audit_share:g}", "--escalation-share", "1", *COMPRESS)
    log, gate_log = pointer.parent / "serving.loop.jsonl", pointer.parent / "serving.promotions.jsonl"
    deadline = time.monotonic() + 60 * args.max_minutes
    began = time.monotonic()
    with process([sys.executable, "-m", "bench.serve_upstream", "upstream", "--port", str(args.port)],
                 upstream):
        with process(serve, server):
            with loop_out.open("w", encoding="utf-8") as out:
                loop = subprocess.Popen(loop_command, stdout=out, stderr=subprocess.STDOUT)
            watcher = threading.Thread(target=watch_decisions, args=(log, server, seen, stop, snapshots))
            watcher.start()
            try:
                replay(f"{server}/v1/systemone", traffic, args.clients, args.rate, deadline, seen)
                replayed_s = time.monotonic() - began
                settle(loop_out, args.poll, max(0.0, min(args.settle, deadline - time.monotonic())))
                at_end = metrics(server)
            finally:
                stop.set()
                watcher.join()
                loop.terminate()
                loop.wait(timeout=120)
        gates = [json.loads(line) for line in gate_log.read_text().splitlines() if line.strip()] \
            if gate_log.is_file() else []
        made_here = [Path(s["decision"]["candidate"]) for s in snapshots]
        made_here += [Path(g["refreshed"]) for g in gates if g.get("refreshed")]
        bundles = {"seed": pointer.parent / "seed",
                   **{path.name: path for path in made_here if (path / "manifest.json").is_file()}}
        figures = {name: held_out(path, held, teacher, args.eval_threads, WORK / "embeddings")
                   for name, path in bundles.items()}
    return {"folder": str(pointer.parent), "replayed": seen.answered + seen.refused,
            "answered": seen.answered, "refused": seen.refused, "codes": seen.codes, "why": seen.why,
            "replay_s": replayed_s,
            "metrics_at_end": at_end,
            "snapshots": snapshots, "gates": gates, "held_out": figures,
            "certified": {name: certified_share(path) for name, path in bundles.items()},
            "serving_at_end": (pointer.parent / (pointer.read_text().splitlines()[0])).resolve().name}


# -- the report ------------------------------------------------------------------------------------------

def report(r: dict[str, Any], seed_items: int, finetune: bool) -> tuple[str, str]:
    """The run's table (one row for the seed, one per decision, one at the end) and its line
    against the goals."""
    def held(name: str) -> str:
        h = r["held_out"].get(name)
        return f"{h['kept']:.1%} ({h['agreement_kept']:.4f}; all {h['agreement']:.4f})" if h else "-"

    def cert(name: str) -> str:
        share, n = r["certified"].get(name, (float("nan"), 0))
        return f"{share:.1%} on {n}"

    gates = {Path(g["candidate"]["path"]).name: g for g in r["gates"]}
    rows = [["seed", f"0 (+{seed_items} trained)", "-", "-", "-", "seed", cert("seed"), held("seed"), "-",
             "-", "0"]]
    serving, promoted_rows = "seed", []
    for s in r["snapshots"]:
        d, name = s["decision"], Path(s["decision"]["candidate"]).name
        g = gates.get(name)
        gate = gate_cell(g["gate"]) if g else d["reason"][:90]
        before = serving
        if d["outcome"] == "promoted":
            serving = name
            promoted_rows.append((before, name))
        elif g and g.get("refreshed"):  # kept aside, and the serving bundle took the gate's thresholds
            serving = Path(g["refreshed"]).name
            promoted_rows.append((before, serving))
        labels = d["seen"]
        rows.append([f"{d['attempt']}", str(s["answered"] + s["refused"]),
                     f"{labels.get('audits', 0)} / {labels.get('escalations', 0)} ({census(d['candidate'])})",
                     d["outcome"] + ("; serving refreshed" if g and g.get("refreshed") else ""), gate,
                     serving, cert(serving), held(serving), held(name), f"{teacher_calls(s['metrics']):.3f}",
                     str(s["refused"])])
    end = r["serving_at_end"]
    rows.append(["end", str(r["replayed"]), "-", "-", "-", end, cert(end), held(end), "-",
                 f"{teacher_calls(r['metrics_at_end']):.3f}", str(r["refused"])])
    table = markdown(["attempt", "items answered", "audits / escalations in the store (census escalations "
                      "in the retrain's evidence)", "outcome", "gate",
                      "serving after", "its certified share (on n)",
                      "its held-out kept (agreement of those; of all)", "the candidate's held-out kept",
                      "teacher calls per item so far", "refused so far"], rows)
    return table, goals(r, promoted_rows, finetune)


def census(candidate: str) -> str:
    """How many census escalations (sent up whatever the item, so certifying) the candidate's
    retrain read, from its lineage; "-" where the candidate left none."""
    lineage = Path(candidate) / "lineage.json"
    if not lineage.is_file():
        return "-"
    origins = json.loads(lineage.read_text(encoding="utf-8"))["evidence"]["origins"]
    return str(origins.get("census escalation", 0))


def gate_cell(g: dict[str, Any]) -> str:
    """The gate's figures: the items weighed, both plug-in shares and the bound on their
    difference, both certified shares."""
    nan = float("nan")
    return (f"{g.get('items')}+{g.get('evaluated', 0)} items; plug-in {g.get('serving_plugin', nan):.3f} -> "
            f"{g.get('candidate_plugin', nan):.3f}, bound {g.get('lower_bound', nan):+.3f}; certified "
            f"{g['serving_share']:.1%} -> {g['candidate_share']:.1%}")


def goals(r: dict[str, Any], promoted: list[tuple[str, str]], finetune: bool) -> str:
    """One line against issue 41's goals, each met or missed with its numbers; ``promoted``: every
    swap, a refresh (the serving bundle taking its gate's thresholds) counted as a promotion is."""
    h = r["held_out"]
    falls = [(h[a]["kept"] - h[b]["kept"]) * 100 for a, b in promoted]
    worst_fall = max(falls, default=0.0)
    end = h[r["serving_at_end"]]
    floor = 0.80 if finetune else 0.75
    agreements = [h[b]["agreement_kept"] for _, b in promoted if h[b]["kept"] > 0]
    parts = [
        f"promotions: {sum(not b.endswith('.serving') for _, b in promoted)}, "
        f"refreshes: {sum(b.endswith('.serving') for _, b in promoted)}",
        f"held-out share falls at most 2 points at a promotion: {'met' if worst_fall <= 2 else 'MISSED'} "
        f"({'largest fall' if worst_fall > 0 else 'none fell; smallest rise'} {abs(worst_fall):.1f} points)"
        if promoted else "no promotion to judge a fall on",
        f">= {floor:.0%} kept at the end: {'met' if end['kept'] >= floor else 'MISSED'} ({end['kept']:.1%})",
        (f"promoted agreement >= 0.975: {'met' if min(agreements) >= 0.975 else 'MISSED'} "
         f"(lowest {min(agreements):.4f})") if agreements else "no promoted bundle kept a held-out item",
        f"0 refused: {'met' if r['refused'] == 0 else 'MISSED'} ({r['refused']} of {r['replayed']}, "
        f"codes {r['codes']})",
    ]
    return "; ".join(parts)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=None,
                        help="items replayed (default: all between the seed's and the held-out ones, 6,100)")
    parser.add_argument("--seed-items", type=int, default=500, help="items the seed is trained on (500)")
    parser.add_argument("--held-out", type=int, default=1000, help="last items, never replayed (1,000)")
    parser.add_argument("--every", type=int, default=1000, help="cascade loop --every (default 1,000)")
    parser.add_argument("--poll", type=float, default=5.0, help="cascade loop --poll (default 5)")
    parser.add_argument("--audit-share", type=float, default=0.05, help="cascade serve --audit-share (0.05)")
    parser.add_argument("--finetune", action="store_true", help="cascade loop --finetune (default: frozen)")
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rate", type=float, default=0.0, help="requests a second at most (0: unpaced)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--max-minutes", type=float, default=120.0,
                        help="wall-time bound of a run's replay and settling (default 120)")
    parser.add_argument("--settle", type=float, default=600.0,
                        help="most seconds to wait after the replay for the loop's last due decision (600)")
    parser.add_argument("--loop-threads", type=int, default=1, help="cascade loop --threads (default 1)")
    parser.add_argument("--eval-threads", type=int, default=2, help="threads of the held-out decisions")
    parser.add_argument("--port", type=int, default=18741)
    args = parser.parse_args()
    every_item = items_in_order()
    held = every_item[-args.held_out:]
    traffic = every_item[args.seed_items:-args.held_out][:args.items]
    made = seed(WORK, args.seed_items, args.target, args.delta)
    for k in range(args.runs):
        r = run(args, made, traffic, held)
        table, line = report(r, args.seed_items, args.finetune)
        encoder = "fine-tuned" if args.finetune else "frozen"
        print(f"\nrun {k + 1}: {r['replayed']} items replayed in {r['replay_s']:.0f} s, audit share "
              f"{args.audit_share:g}, --every {args.every}, {encoder} ({r['folder']})")
        print(table)
        print(f"\ngoals: {line}")
        print("".join(f"\nrefused: {why}" for why in r["why"]))
        print(json.dumps(r, default=str))


if __name__ == "__main__":
    main()
