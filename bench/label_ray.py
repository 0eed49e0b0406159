"""Teacher labelling on Ray against single-process labelling, on a local cluster of 2 CPUs.

What Ray costs on top of the same work: its start-up (actors start and load the model, on top of
the single process' own model load) and its cost per batch (a round trip through Ray Data), with
1 and 2 actors. On 2 shared cores the point is correctness at a known overhead; the speed-up of
more actors is for machines with a GPU per actor.

Each configuration labels the corpus' first item alone, then all N items, into fresh stores; the
one-item run is the start-up, and (run(N) - run(1)) / (N - 1) the marginal wall time per item.
Every run includes opening the model (the single process' own load, or the actors' start).
gemma-3-270m, one llama.cpp thread per process, interleaved rounds, medians; the load average
printed says how busy the shared cores were.

    .venv/bin/python -m bench.label_ray --items 32 --rounds 2
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import argument_parser, question_set, read_rows
from cascade.questions import Question, parse_request
from cascade.readout.llama import default_gguf_path
from cascade.readout.placement import Placement
from distill.labelling.gguf import label_corpus, open_teacher, teacher_of, teacher_of_file
from distill.labelling.on_ray import RayOptions, TeacherSpec, label_on_ray
from distill.store import LabelStore

Run = Callable[[Path, Path], int]


def single_process(questions: dict[str, Question]) -> Run:
    def run(corpus: Path, store_path: Path) -> int:
        scorer = open_teacher(default_gguf_path(), questions, n_threads=1)
        try:
            with LabelStore(store_path, teacher_of(scorer)) as store:
                return label_corpus(scorer, questions, corpus, store, progress=False).labelled
        finally:
            scorer.close()
    return run


def on_ray(questions: dict[str, Question], actors: int, batch_size: int) -> Run:
    spec = TeacherSpec(model_path=Path(default_gguf_path()), questions=questions,
                       placement=Placement(threads=1))
    options = RayOptions(actors=actors, batch_size=batch_size)

    def run(corpus: Path, store_path: Path) -> int:
        with LabelStore(store_path, teacher_of_file(spec.model_path)) as store:
            return label_on_ray(spec, corpus, store, options, progress=False).labelled
    return run


def timed(run: Run, corpus: Path, store_path: Path, items: int) -> float:
    """Wall seconds of one run (the store's fsyncs and Ray's round trips are part of the cost)."""
    started = time.perf_counter()
    labelled = run(corpus, store_path)
    seconds = time.perf_counter() - started
    if labelled != items:
        raise RuntimeError(f"labelled {labelled} of {items} items")
    return seconds


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    try:
        import ray
    except ImportError as error:
        raise SystemExit(f"bench.label_ray needs the ray extra: pip install -e '.[ray]' "
                         f"({error})") from error
    questions_json = question_set(args.questions)
    questions = dict(parse_request({"state": "x", "questions": questions_json}).questions)
    rows = read_rows("ag_news_test.jsonl", args.items)
    work = Path(tempfile.mkdtemp())
    corpora = {n: work / f"corpus{n}.jsonl" for n in (1, args.items)}
    for n, path in corpora.items():
        path.write_text("".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n" for r in rows[:n]))
    b = args.batch_size
    configs = {
        "single process": single_process(questions),
        f"ray, 1 actor, batch {b}": on_ray(questions, 1, b),
        "ray, 1 actor, batch 1": on_ray(questions, 1, 1),
        f"ray, 2 actors, batch {b}": on_ray(questions, 2, b),
    }
    load, started = os.getloadavg()[0], time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"local cluster start {time.perf_counter() - started:.1f} s (not in the figures below)")
    first = timed(configs[f"ray, 1 actor, batch {b}"], corpora[1], work / "warm-up.sqlite", 1)
    print(f"first run on the fresh cluster (Ray's workers start): wall(1) {first:.2f} s (not below)")
    runs: dict[tuple[str, int], list[float]] = {(c, n): [] for c in configs for n in corpora}
    for round_ in range(args.rounds):
        for name, run in configs.items():
            for n, corpus in corpora.items():
                runs[name, n].append(timed(run, corpus, store_path(work, round_, n, name), n))
    ray.shutdown()
    print(f"{args.items} items x {args.questions} questions, {args.rounds} rounds (medians); one "
          f"llama.cpp thread per process; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} "
          f"at the end, on {os.cpu_count()} cores")
    report(runs, args.items, list(configs))
    same_labels(work, args.items, list(configs))


def store_path(work: Path, round_: int, n: int, name: str) -> Path:
    return work / f"{round_}-{n}-{name}.sqlite".replace(" ", "_").replace(",", "")


def same_labels(work: Path, n: int, names: list[str]) -> None:
    """The first round's labels of each Ray configuration against the single process' ones."""
    def read(name: str) -> dict[tuple[str, str], dict[str, float]]:
        with LabelStore.open_existing(store_path(work, 0, n, name)) as store:
            return {(r.item_id, r.question_id): r.probabilities for r in store.iter_labels()}

    base = read(names[0])
    for name in names[1:]:
        other = read(name)
        diffs = [abs(other[key][k] - p) for key, probs in base.items() for k, p in probs.items()]
        flips = sum(max(other[key], key=other[key].__getitem__) != max(probs, key=probs.__getitem__)
                    for key, probs in base.items())
        print(f"labels, {name} vs single process: max |dp| {max(diffs):.2e}, "
              f"argmax flips {flips}/{len(base)}")


def report(seconds: dict[tuple[str, int], list[float]], n: int, names: list[str]) -> None:
    """Start-up, marginal seconds per item and their ratio to the single process, per config."""
    median = {key: statistics.median(values) for key, values in seconds.items()}
    per_item = {c: (median[c, n] - median[c, 1]) / (n - 1) for c in names}
    base = names[0]
    print(f"{'wall seconds':26} {'run(1)':>7} {'run(N)':>7} {'per item':>8} {'vs single':>9}")
    for c in names:
        print(f"{c:26} {median[c, 1]:7.2f} {median[c, n]:7.2f} {per_item[c]:8.3f} "
              f"{100 * (per_item[c] / per_item[base] - 1):+8.1f}%")
    batch1 = next(c for c in names if c.endswith("batch 1"))
    print(f"Ray's cost per batch (batch of 1 item vs single process): "
          f"{1000 * (per_item[batch1] - per_item[base]):+.0f} ms")


if __name__ == "__main__":
    main()
