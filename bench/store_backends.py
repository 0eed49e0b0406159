"""The label store on PostgreSQL against SQLite, side by side in one process (goal: labelling into
PostgreSQL within 1.1x of SQLite for one writer), how many writers scale, and the bound on how
long a demotion raised on one replica takes to hold on another.

1. labelling: ``label_corpus`` with the real teacher (gemma-3-270m, one thread, 4 questions) into a
   fresh store of each backend, the backends taking turns within each round: items/s, and the
   median per-round ratio;
2. the store's own cost per item in that loop, without the teacher: claim the item, then put its
   4 labels (two transactions, as ``label_corpus`` does), items/s of each backend;
3. writers: 1, 2 and 4 writer processes claiming and labelling one corpus together, each item's
   teacher a sleep of --teacher-ms (a teacher on a device of its own, so that the store is what
   is shared), and with no teacher (the store's ceiling); items/s, the speedup over one writer,
   and a check that no item was labelled twice;
4. the demotion bound: two replicas following one audit stream (``StreamFollower``) polled every
   --poll seconds; one appends audits that disagree with the teacher until its alarm rises; the
   seconds from that record's commit until the other replica has demoted the question, against
   the stated bound (the poll interval plus one read).

PostgreSQL runs on loopback (``$CASCADE_TEST_POSTGRES_URL``'s server, or a throwaway cluster
started here); SQLite on the local disk. Wall time throughout: commits and their fsyncs are the cost.

    PYTHONPATH=. .venv/bin/python -m bench.store_backends --items 20 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import argument_parser, markdown, postgres_databases, question_set, read_rows

TEACHER_NAME = "bench"
WRITER = """
import sys, time
from distill.store import LabelStore, Teacher
location, items, teacher_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
questions = {f"q{j}": None for j in range(4)}
with LabelStore(location, Teacher(kind="external", model="bench")) as store:
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(items):
        item = f"item{i:05d}"
        todo = store.claim(item, questions)
        if todo:
            time.sleep(teacher_s)
            store.put_item(item, {q: {"a": 0.25, "b": 0.75} for q in todo})
            print(item, flush=True)
"""


def labelling(places: dict[str, Callable[[str], str]], items: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per round of ``label_corpus`` into a fresh store of each backend."""
    from cascade.questions import parse_request
    from cascade.readout.llama import default_gguf_path
    from distill.labelling.gguf import label_corpus, open_teacher, teacher_of
    from distill.store import LabelStore

    questions_json = question_set(4)
    questions = parse_request({"state": "x", "questions": questions_json}).questions
    rows = read_rows("ag_news_test.jsonl", items)
    corpus = Path(tempfile.mkdtemp()) / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n" for r in rows))
    scorer = open_teacher(default_gguf_path(), questions, n_threads=1)
    label_corpus(scorer, questions, corpus, LabelStore(places["sqlite"]("warm"), teacher_of(scorer)),
                 progress=False)  # the model's first calls
    seconds: dict[str, list[float]] = {name: [] for name in places}
    for round_ in range(rounds):
        order = list(places) if round_ % 2 == 0 else list(reversed(places))
        for name in order:
            with LabelStore(places[name](f"labels{round_}"), teacher_of(scorer)) as store:
                started = time.perf_counter()
                summary = label_corpus(scorer, questions, corpus, store, progress=False)
                seconds[name].append(time.perf_counter() - started)
                assert summary.labelled == items
    scorer.close()
    return seconds


def store_alone(places: dict[str, Callable[[str], str]], items: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per round of claim + put_item for ``items`` items, no teacher."""
    from distill.store import LabelStore, Teacher

    labels = {f"q{j}": {"a": 0.25, "b": 0.75} for j in range(4)}
    seconds: dict[str, list[float]] = {name: [] for name in places}
    for round_ in range(rounds):
        order = list(places) if round_ % 2 == 0 else list(reversed(places))
        for name in order:
            teacher = Teacher(kind="external", model=TEACHER_NAME)
            with LabelStore(places[name](f"alone{round_}"), teacher) as store:
                started = time.perf_counter()
                for i in range(items):
                    todo = store.claim(f"item{i:05d}", labels)
                    store.put_item(f"item{i:05d}", todo or {})
                seconds[name].append(time.perf_counter() - started)
    return seconds


def writers(location: str, count: int, items: int, teacher_s: float) -> tuple[float, int]:
    """Items/s of ``count`` writer processes labelling one corpus; the items labelled twice."""
    from distill.store import LabelStore, Teacher

    LabelStore(location, Teacher(kind="external", model=TEACHER_NAME)).close()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = [subprocess.Popen([sys.executable, "-c", WRITER, location, str(items), str(teacher_s)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(count)]
    for run in runs:
        assert run.stdout is not None and run.stdout.readline() == "ready\n"
    started = time.perf_counter()
    for run in runs:
        assert run.stdin is not None
        run.stdin.write("go\n")
        run.stdin.flush()
    outputs = [run.communicate()[0].split() for run in runs]
    wall = time.perf_counter() - started
    labelled = [item for out in outputs for item in out]
    assert set(labelled) == {f"item{i:05d}" for i in range(items)}, "every item labelled"
    return items / wall, len(labelled) - len(set(labelled))


def demotion_lags(location: str, trials: int, poll: float) -> list[float]:
    """Seconds from the commit of the audit that raised the alarm on replica A until replica B,
    following the stream every ``poll`` seconds, has the question demoted."""
    from cascade.audit.record import AuditRecord, SystemAnswer
    from cascade.audit.stream import StreamFollower
    from cascade.audit.watch import DriftWatch
    from distill.loop.auditing import StoreSink
    from distill.store import Teacher

    teacher = Teacher(kind="external", model=TEACHER_NAME)
    a, b = StoreSink(location, teacher), StoreSink(location, teacher)
    lags: list[float] = []
    n = 0
    for trial in range(trials):
        version = f"trial{trial}"
        raised_on_b: list[float] = []
        done = threading.Event()

        def on_b(_: str, raised: list[float] = raised_on_b, done: threading.Event = done) -> None:
            raised.append(time.perf_counter())
            done.set()

        watch_a = DriftWatch(["q"], 0.95, 0.05, version)
        follow_a = StreamFollower(watch_a, a, lambda _: None)
        follow_b = StreamFollower(DriftWatch(["q"], 0.95, 0.05, version), b, on_b)
        end = 0
        while page := a.read_after(end):  # the earlier trials' audits: read past them
            end = page[-1][0]
        follow_a.position = follow_b.position = end
        follow_b.follow(poll)
        committed = 0.0
        while not watch_a.demoted:
            n += 1
            a(AuditRecord(item_id=f"audit:{n}", state=f"state {n}", calibration_version=version,
                          at=time.time(), teacher={"q": {"true": 0.9, "false": 0.1}},
                          system={"q": SystemAnswer(answer="false", tier="encoder")}))
            committed = time.perf_counter()
            follow_a.catch_up()
        done.wait(timeout=60)
        lags.append(raised_on_b[0] - committed)
        follow_b.close()
    a.close()
    b.close()
    return lags


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=20, help="items labelled by the teacher per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store-items", type=int, default=500, help="items per round without the teacher")
    parser.add_argument("--writer-items", type=int, default=400, help="items the writers share per run")
    parser.add_argument("--teacher-ms", type=float, default=20.0, help="each item's teacher, as a sleep")
    parser.add_argument("--trials", type=int, default=20, help="demotions measured per backend")
    parser.add_argument("--poll", type=float, default=1.0, help="the followers' poll interval (s)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    with postgres_databases() as new_database:
        places: dict[str, Callable[[str], str]] = {"sqlite": lambda name: str(work / f"{name}.sqlite"),
                                                   "postgresql": lambda _: new_database()}
        teach = labelling(places, args.items, args.rounds)
        alone = store_alone(places, args.store_items, args.rounds)
        ratio = statistics.median(p / s for p, s in zip(teach["postgresql"], teach["sqlite"], strict=True))
        print(f"1-2. labelling {args.items} items x 4 questions with gemma-3-270m (1 thread), "
              f"{args.rounds} rounds")
        print(markdown(["store", "labelling items/s", "store alone items/s (claim + put)"],
                       [[name, f"{args.items / statistics.median(teach[name]):.2f}",
                         f"{args.store_items / statistics.median(alone[name]):.0f}"] for name in places]))
        print(f"labelling time PostgreSQL / SQLite (median of per-round ratios): {ratio:.3f}x (goal <= 1.1x)")
        rows = []
        for teacher_ms in (args.teacher_ms, 0.0):
            for name in places:
                base = None
                for count in (1, 2, 4):
                    where = places[name](f"writers{count}_{teacher_ms}")
                    rate, twice = writers(where, count, args.writer_items, teacher_ms / 1e3)
                    base = base or rate
                    rows.append([name, f"{teacher_ms:g} ms", str(count), f"{rate:.0f}",
                                 f"{rate / base:.2f}x", str(twice)])
        print(f"\n3. writers sharing one corpus of {args.writer_items} items")
        print(markdown(["store", "teacher per item", "writers", "items/s", "vs 1 writer", "labelled twice"],
                       rows))
        print(f"\n4. demotion on a second replica, poll {args.poll:g} s, {args.trials} trials")
        lag_rows = []
        for name in places:
            lags = sorted(demotion_lags(places[name]("lags"), args.trials, args.poll))
            lag_rows.append([name, f"{statistics.median(lags):.3f}", f"{lags[-1]:.3f}",
                             f"{args.poll:g} + one read"])
        print(markdown(["store", "median s", "max s", "bound s"], lag_rows))


if __name__ == "__main__":
    main()
