"""What the benchmarks share: datasets and question sets, the real teacher's labelled items, the
library's head and certificates on them, markdown tables and side-by-side timing.

The datasets are read from ../shared/data beside the repository (never copied into it).

Only numpy and the standard modules that llama-cpp-python loads anyway are imported at the top;
every other import (argparse and statistics too) sits in the function that needs it:
bench.scorer_memory and bench.encoder_batch measure the peak memory of processes that import this
module, and every script's ``--help`` must work without the data, the teacher models or the
optional extras (torch, ray).
"""

from __future__ import annotations

import hashlib
import json
import resource
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import argparse
    import subprocess

    from cascade.audit.alarms import Stake
    from cascade.encoder.onnx_encoder import EmbeddingCache
    from cascade.thresholds import ThresholdScore
    from distill.training.finetune import FinetuneConfig

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CACHE_DIR = Path.home() / ".cache" / "cascade-bench"
"""Embeddings, fine-tuned vectors and mid-layer states, cached between runs."""
FINETUNED_DIR = CACHE_DIR / "finetuned"

# -- question sets --------------------------------------------------------------------------------

SPAM: dict[str, Any] = {
    "spam": {"type": "noul", "instructions": "Is this message spam?",
             "criteria": {"true": "unsolicited advertising, scams or prize offers",
                          "false": "a personal or ordinary message"}},
}
TOPIC: dict[str, Any] = {
    "topic": {"type": "choice", "instructions": "Which section of a newspaper does this story belong to?",
              "criteria": {"world": "World news and politics", "sports": "Sports",
                           "business": "Business and economy", "scitech": "Science and technology"}},
}
STARS: dict[str, Any] = {
    "stars": {"type": "score", "instructions": "How many stars did the reviewer give the restaurant?",
              "criteria": ["1 star: terrible", "2 stars: poor", "3 stars: average",
                           "4 stars: good", "5 stars: excellent"]},
}
EXTRA: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does the text convey urgency?"},
    "tone": {"type": "choice", "instructions": "What is the overall tone?",
             "criteria": {"positive": None, "neutral": None, "negative": None}},
    "formality": {"type": "score", "instructions": "How formal is the writing?",
                  "criteria": ["casual", "neutral", "formal"]},
    "audience": {"type": "choice", "instructions": "Who is the text mainly written for?",
                 "criteria": {"friend": "a friend or family member", "customer": "a customer",
                              "public": "the general public", "expert": "a specialist"}},
    "numbers": {"type": "noul", "instructions": "Does the text mention a number or a price?"},
}


def question_set(n: int) -> dict[str, Any]:
    """``n`` questions (1..8) mixing all three types, for fan-out benchmarks."""
    pool = {**TOPIC, **SPAM, **STARS, **EXTRA}
    if not 1 <= n <= len(pool):
        raise ValueError(f"n must be 1..{len(pool)}")
    return dict(list(pool.items())[:n])


def many_questions(n: int) -> dict[str, Any]:
    """``n`` questions for N beyond the pool: the pool repeated with distinct ids and wording."""
    pool = list(question_set(8).items())
    out = {}
    for i in range(n):
        qid, q = pool[i % len(pool)]
        q = dict(q, instructions=f"{q['instructions']} (variant {i // len(pool)})")
        out[f"{qid}_{i}"] = q
    return out


# -- datasets and the tasks on them ---------------------------------------------------------------

def read_rows(name: str, limit: int | None = None) -> list[dict[str, Any]]:
    path = SHARED_DATA / name
    if not path.is_file():
        raise SystemExit(f"dataset not found: {path} (../shared/data beside the repository)")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def texts_by_id() -> dict[str, str]:
    """AG News texts by item id, as the committed labels name them."""
    return {row["id"]: row["text"].strip() for row in read_rows("ag_news_test.jsonl")}


AG_TOPICS = {1: "world", 2: "sports", 3: "business", 4: "scitech"}


@dataclass(frozen=True)
class Task:
    """A dataset and the question its gold label answers, with the label's option key."""

    name: str
    file: str
    questions: dict[str, Any]
    option_key: Callable[[Any], str]


TASKS = (
    Task("sms_spam", "sms_spam.jsonl", SPAM, lambda label: "true" if label == "spam" else "false"),
    Task("ag_news", "ag_news_test.jsonl", TOPIC, lambda label: AG_TOPICS[label]),
    Task("zomato", "zomato_restaurant_reviews.jsonl", STARS, lambda label: str(label - 1)),
)
TASK_NAMES = tuple(task.name for task in TASKS)


def task_named(name: str) -> Task:
    return next(task for task in TASKS if task.name == name)


def sample(task: Task, items: int, seed: int) -> list[dict[str, Any]]:
    """``items`` rows of the task's dataset, a seeded sample: the one bench.encoder_quality embeds
    (so its embeddings are cached) and a real teacher labels (bench.teacher_corpus)."""
    rows = read_rows(task.file)
    if items > len(rows):
        raise SystemExit(f"--items {items} exceeds the {len(rows)} rows of {task.file}")
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))[:items]]


# -- the real teacher's labelled items (bench/labels/) --------------------------------------------

TEACHER = "qwen2.5-coder-1.5b-instruct"
LABELS = Path(__file__).resolve().parent / "labels"
FIRST = LABELS / "ag_news.qwen2.5-coder-1.5b.jsonl"
SECOND = LABELS / "ag_news.qwen2.5-coder-1.5b.items-4001-7600.jsonl"
"""The 1.5B's answers to AG News, items 1-4,000 and 4,001-7,600."""
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
PROMPT = "readout-v1"
"""The GGUF those answers came from, and its prompts' version: a URL teacher replaying them
states this identity (bench.serve_upstream)."""
TARGET, DELTA = 0.98, 0.05
GOAL_KEPT, GOAL_COST = 0.80, 0.25
SOURCES = {"teacher": "teacher, soft", "gold": "gold"}
"""Label sources by their command-line name: the teacher's probabilities, or gold labels standing
in for the teacher on the same items."""


@dataclass(frozen=True)
class Items:
    """The labelled items in export order, with their features and each source's targets."""

    ids: list[str]
    texts: list[str]
    emb: np.ndarray
    targets: dict[str, np.ndarray]  # source -> (n, k) rows a head learns from
    truth: dict[str, np.ndarray]  # source -> (n,) the answer agreement is measured against


def read_export(paths: Path | Iterable[Path], task: Task) -> tuple[list[str], np.ndarray]:
    """Ids and teacher probabilities (columns in the question's option order) of one export, or
    of several read one after another (a labelling run continued into another file)."""
    from cascade.questions import parse_request

    (qid, question), = parse_request({"state": "-", "questions": task.questions}).questions.items()
    keys = question.option_keys()
    ids, rows = [], []
    for path in [paths] if isinstance(paths, Path) else paths:
        for line in path.open(encoding="utf-8"):
            row = json.loads(line)
            if row["question"] == qid:
                ids.append(row["id"])
                rows.append([row["probabilities"][key] for key in keys])
    if len(set(ids)) != len(ids):
        raise SystemExit(f"the exports {paths} label some item twice; give each item's label once")
    return ids, np.asarray(rows)


def load_items(path: Path | Iterable[Path], task: Task, cache: EmbeddingCache) -> Items:
    """An export's items, their texts and gold labels joined back from ../shared/data by id."""
    from cascade.questions import parse_request

    ids, probs = read_export(path, task)
    (question,) = parse_request({"state": "-", "questions": task.questions}).questions.values()
    keys = question.option_keys()
    shared = {row["id"]: row for row in read_rows(task.file)}
    texts = [shared[i]["text"].strip() for i in ids]
    gold = np.array([keys.index(task.option_key(shared[i]["label"])) for i in ids])
    eye = np.eye(len(keys))
    argmax = probs.argmax(axis=1)
    return Items(ids, texts, cache.encode(texts), {"teacher, soft": probs, "teacher, argmax": eye[argmax],
                                                   "gold": eye[gold]},
                 {"teacher, soft": argmax, "teacher, argmax": argmax, "gold": gold})


@dataclass(frozen=True)
class Parts:
    """Item indices of one 50/25/25 split."""

    train: np.ndarray
    calibration: np.ndarray
    evaluation: np.ndarray


def parts_of(order: np.ndarray) -> Parts:
    n = len(order)
    return Parts(order[: n // 2], order[n // 2: 3 * n // 4], order[3 * n // 4:])


PART_CODES = {"train": 0, "calibration": 1, "evaluation": 2}


def placed(ids: list[str], salt: str) -> np.ndarray:
    """Each item's part (0 train, 1 calibration, 2 evaluation, 50/25/25) by a hash of its id and
    ``salt``, as ``distill.training.split`` places items: an item's part never moves as traffic grows."""
    from distill.training.split import DEFAULT_FRACTIONS, part_of

    return np.asarray([PART_CODES[part_of(i, DEFAULT_FRACTIONS, salt)] for i in ids])


def head_probabilities(items: Items, emb: np.ndarray, source: str, parts: Parts
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The library's head on ``emb`` (+ n-grams), fitted on the train part: calibration and
    evaluation probabilities."""
    from cascade.encoder.ngrams import NgramFeatures, beside
    from cascade.heads import SoftmaxHead

    grams = NgramFeatures().fit([items.texts[i] for i in parts.train])

    def features(rows: np.ndarray) -> Any:
        return beside(emb[rows], grams, [items.texts[i] for i in rows])

    head = SoftmaxHead(C=1.0, max_iter=5000).fit(features(parts.train), items.targets[source][parts.train])
    return head.predict_proba(features(parts.calibration)), head.predict_proba(features(parts.evaluation))


def certified(cal: np.ndarray, truth: np.ndarray, target: float, delta: float, score: ThresholdScore
              ) -> float:
    """The lowest raw-``score`` threshold certified on the calibration items (inf: none)."""
    from cascade.thresholds import threshold_score
    from distill.calibration.maths import threshold_for_agreement

    chosen = threshold_for_agreement(threshold_score(cal, score), cal.argmax(axis=1) == truth, target, delta)
    return chosen.threshold if chosen.threshold is not None else np.inf


def hindsight(score: np.ndarray, correct: np.ndarray, target: float = TARGET) -> float:
    """The most one threshold keeps of these items with agreement >= ``target``, chosen on them."""
    order = np.argsort(-score, kind="stable")
    wrong = np.cumsum(~correct[order])
    fine = np.flatnonzero(wrong <= (1 - target) * len(score) + 1e-9)
    return float(fine[-1] + 1) / len(score) if fine.size else 0.0


@dataclass(frozen=True)
class CascadeOutcome:
    """One cascade on one split's evaluation part."""

    encoder: float  # share the encoder keeps
    middle: float  # share the middle tier keeps (0 without one)
    agreement: float  # realised agreement with the source
    reach_middle: float  # share the middle tier reads
    hindsight: float  # the most one encoder threshold keeps at the target, chosen on these items

    @property
    def cheap(self) -> float:
        return self.encoder + self.middle


def cascade_outcome(encoder: tuple[np.ndarray, np.ndarray], middle: tuple[np.ndarray, np.ndarray] | None,
                    truth: np.ndarray, parts: Parts, score: ThresholdScore, target: float = TARGET
                    ) -> CascadeOutcome:
    """Thresholds certified as ``cascade calibrate`` sets them, then the cascade on the evaluation
    part: each cheap tier keeps what clears its threshold among what reaches it. With m cheap
    tiers each is certified to disagree on at most (1 - target) / m at level delta / m."""
    from cascade.thresholds import threshold_score

    tiers = [encoder] if middle is None else [encoder, middle]
    tier_target, tier_delta = 1 - (1 - target) / len(tiers), DELTA / len(tiers)
    cal_truth, ev_truth = truth[parts.calibration], truth[parts.evaluation]
    reaching = np.ones(len(parts.evaluation), dtype=bool)
    kept, wrong = [], 0
    for cal, ev in tiers:
        threshold = certified(cal, cal_truth, tier_target, tier_delta, score)
        keep = reaching & (threshold_score(ev, score) >= threshold)
        kept.append(float(keep.mean()))
        wrong += int((keep & (ev.argmax(axis=1) != ev_truth)).sum())
        reaching &= ~keep
    reach_middle = 1 - kept[0] if middle is not None else 0.0
    best = hindsight(threshold_score(encoder[1], score), encoder[1].argmax(axis=1) == ev_truth, target)
    return CascadeOutcome(kept[0], kept[1] if middle is not None else 0.0, 1 - wrong / len(ev_truth),
                          reach_middle, best)


# -- measured costs -------------------------------------------------------------------------------

MIDDLE = "qwen2.5-coder-0.5b-instruct"


def measured_seconds(items: Items, task: Task, count: int, middle: bool, finetuned_file: Path | None
                     ) -> dict[str, float]:
    """CPU seconds per item of the teacher (and the 0.5B with ``middle``) and each encoder (the
    fine-tuned int8 ``finetuned_file`` too), one thread each, interleaved item by item."""
    import statistics
    from functools import partial

    from cascade.encoder.onnx_encoder import Encoder, EncoderFiles, default_encoder_files
    from cascade.readout.scorer import Scorer
    from distill.labelling.teachers import teacher_path

    request = {"state": "-", "questions": task.questions}
    encoders = {"encoder (frozen, shipped)": Encoder(threads=1)}
    if finetuned_file is not None:
        files = EncoderFiles(model=finetuned_file, tokenizer=default_encoder_files().tokenizer)
        encoders["encoder (fine-tuned int8)"] = Encoder(files, threads=1)
    models = {"teacher": TEACHER, **({"middle": MIDDLE} if middle else {})}
    scorers = {name: Scorer(teacher_path(model), n_ctx=2048, max_branches=1, n_threads=1)
               for name, model in models.items()}
    contenders: dict[str, Callable[[str], object]] = {
        **{name: partial(_score, scorer, request) for name, scorer in scorers.items()},
        **{name: partial(_encode, encoder) for name, encoder in encoders.items()}}
    try:
        spent = interleaved(contenders, items.texts[:count])
    finally:
        for scorer in scorers.values():
            scorer.close()
    return {name: statistics.mean(values["cpu"]) for name, values in spent.items()}


def _score(scorer: Any, request: dict[str, Any], text: str) -> object:
    from cascade.questions import parse_request

    return scorer.score(parse_request(request | {"state": text}))


def _encode(encoder: Any, text: str) -> object:
    return encoder.encode([text])


# -- fine-tuned encoders (the finetune extra: torch) ----------------------------------------------

def labels_digest(paths: list[Path]) -> str:
    """The label exports' digest (one file: its sha256, as the cache of fine-tuned vectors keys it)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def finetuned_vectors(items: Items, source: str, train: np.ndarray, work: Path,
                      config: FinetuneConfig) -> tuple[np.ndarray, float, Path]:
    """All items' vectors from a MiniLM fine-tuned on ``train`` (``cascade train --finetune``),
    exported as int8 ONNX into ``work``; seconds to train and export; the exported file."""
    from cascade.encoder.onnx_encoder import Encoder, EncoderFiles, default_encoder_files
    from distill.training.finetune import finetune_body
    from distill.training.finetune_base import Targets
    from distill.training.onnx_export import export_int8

    tokenizer = default_encoder_files().tokenizer
    started = time.perf_counter()
    body, record = finetune_body([items.texts[i] for i in train],
                                 {"q": Targets(items.targets[source][train])}, tokenizer, config)
    path = work / f"{source.split(',')[0]}-{len(list(work.iterdir()))}.onnx"
    parity = export_int8(body, tokenizer, path, [items.texts[i] for i in train[:200]], 256)
    seconds = time.perf_counter() - started
    epochs = ", ".join(f"{e.epoch}: {e.held_out_loss:.3f}/{e.held_out_agreement:.3f}" for e in record.epochs)
    print(f"  fine-tuned on {source}: best epoch {record.best_epoch} (held-out loss/agreement {epochs}); "
          f"{seconds:.0f} s; int8 parity min cosine {parity.min_cosine:.4f}", flush=True)
    return Encoder(EncoderFiles(model=path, tokenizer=tokenizer)).encode(items.texts), seconds, path


def finetuned(items: Items, digest: str, source: str, seed: int, number: int, parts: Parts,
              config: FinetuneConfig) -> np.ndarray:
    """All items' vectors from MiniLM fine-tuned on this split's train part (``finetuned_vectors``),
    cached per split by the labels file's ``digest`` and the settings; the last fine-tuned model
    is kept as FINETUNED_DIR/last.onnx, to time it."""
    key = hashlib.sha256(f"{digest} {source} {seed} {number} {config!r}".encode()).hexdigest()[:20]
    cached = FINETUNED_DIR / f"{key}.npy"
    if cached.exists():
        return np.load(cached)
    FINETUNED_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        emb, _, onnx = finetuned_vectors(items, source, parts.train, Path(work), config)
        shutil.copyfile(onnx, FINETUNED_DIR / "last.onnx")
    np.save(cached.with_suffix(".tmp.npy"), emb)
    cached.with_suffix(".tmp.npy").replace(cached)
    return emb


# -- drift alarms on a stream of audited outcomes -------------------------------------------------

Alarm = Callable[[np.ndarray], int | None]
"""An alarm run over one stream: the audited item at which it fired, or None."""


def betting(target: float, alpha: float, stake: Stake = "ons") -> Alarm:
    """The library's alarm (``AgreementMonitor``), anytime-valid."""
    from cascade.audit.alarms import AgreementMonitor

    def run(outcomes: np.ndarray) -> int | None:
        monitor = AgreementMonitor(target, alpha, grid=2, stake=stake)
        monitor.update([bool(x) for x in outcomes])
        return monitor.alarm_at

    return run


def clopper_pearson(target: float, alpha: float, every: int, window: int | None) -> Alarm:
    """The peers' test: the one-sided exact upper bound on the last ``window`` items (all so far
    if None), re-tested every ``every`` items, alarming once it falls below the target."""
    from scipy.stats import beta

    def run(outcomes: np.ndarray) -> int | None:
        for end in range(every, len(outcomes) + 1, every):
            seen = outcomes[max(0, end - window):end] if window else outcomes[:end]
            agreed, n = int(seen.sum()), len(seen)
            upper = 1.0 if agreed == n else float(beta.ppf(1 - alpha, agreed + 1, n - agreed))
            if upper < target:
                return end
        return None

    return run


# -- a support bundle whose routes are fixed ------------------------------------------------------

EASY, HARD = "urgent", "department"


def support_bundle(root: Path, teacher: Path, items: int) -> Path:
    """The encoder tier trained on ``items`` of the demo's generated support messages, ``teacher``
    pinned as its live top tier, and routes fixed: EASY is kept by the encoder, HARD always
    escalates (so that a run measures what serves them, not the thresholds)."""
    from cascade.bundle.manifest import Bundle, Manifest
    from cascade.hashing import file_sha256
    from cascade.questions import parse_request
    from cascade.readout.prompts import PROMPT_VERSION
    from distill.demo.synthetic import QUESTIONS_JSON, generate, write_corpus, write_labels
    from distill.labelling.transfer import import_labels
    from distill.options import CorpusInput, RunOptions
    from distill.store import LabelStore, Teacher
    from distill.training.run import train_bundle

    messages = generate(items, seed=7)
    asked = {q: QUESTIONS_JSON[q] for q in (EASY, HARD)}
    questions = parse_request({"state": "x", "questions": asked}).questions
    corpus = write_corpus(messages, root / "corpus.jsonl")
    with LabelStore(root / "labels.sqlite", Teacher(kind="external", model="generator")) as store:
        import_labels(store, write_labels(messages, root / "labels.jsonl"), questions, on_error="skip")
        bundle = train_bundle(questions, CorpusInput(corpus), store, root / "trained",
                              run=RunOptions(progress=False))
    data = bundle.manifest.model_dump(mode="json")
    data["name"] = "support"
    data["teacher"] = {"kind": "gguf", "model": teacher.name, "model_sha256": file_sha256(teacher),
                       "prompt_version": PROMPT_VERSION}
    data["thresholds"] = {EASY: {"encoder": 0.0}, HARD: {"encoder": 1.0}}
    Bundle(Manifest.model_validate(data), bundle.directory).save(root / "support")
    return root / "support"


def support_messages(n: int) -> list[str]:
    """``n`` generated support messages the bundle was not trained on."""
    from distill.demo.synthetic import generate

    return [message.text for message in generate(n, seed=11)]


# -- command lines and tables ---------------------------------------------------------------------

def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: its module docstring (what it measures, how to run it) is the help."""
    import argparse

    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def cell(values: Iterable[float], fmt: str, worst: float | None = None, word: str = "worst") -> str:
    """``mean (worst W)``: the mean of ``values`` and the worst of them (by default the least;
    pass the most for a cost), each in ``fmt``; ``word=""`` leaves the word out."""
    import statistics

    values = list(values)
    worst = min(values) if worst is None else worst
    return f"{statistics.mean(values):{fmt}} ({word + ' ' if word else ''}{worst:{fmt}})"


# -- timing, side by side in one process ----------------------------------------------------------

Clock = Callable[[], float]
CPU: dict[str, Clock] = {"cpu": time.process_time}
WALL: dict[str, Clock] = {"wall": time.perf_counter}
CLOCKS: dict[str, Clock] = {**WALL, **CPU}
"""Wall time is what a caller waits; this process's CPU time (all its threads) is what the work
costs, and moves far less when other processes load the shared cores."""
T = TypeVar("T")


def interleaved(contenders: Mapping[str, Callable[[T], object]], inputs: Iterable[T],
                clocks: Mapping[str, Clock] = CPU, rotate: bool = False) -> dict[str, dict[str, list[float]]]:
    """Seconds (per clock) each contender spends on each input, measured side by side: for every
    input all contenders take their turn, so that load from other processes on shared cores falls
    on all of them alike; with ``rotate`` the order rotates by one at every input."""
    names = list(contenders)
    seconds: dict[str, dict[str, list[float]]] = {name: {c: [] for c in clocks} for name in names}
    for turn, one in enumerate(inputs):
        shift = turn % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            begin = {c: clock() for c, clock in clocks.items()}
            contenders[name](one)
            for c, clock in clocks.items():
                seconds[name][c].append(clock() - begin[c])
    return seconds


def in_rounds(contenders: Mapping[str, Callable[[], object]], rounds: int, clocks: Mapping[str, Clock] = CPU,
              rotate: bool = False) -> dict[str, dict[str, list[float]]]:
    """``interleaved`` for contenders that take no input: seconds (per clock) of each, per round."""
    return interleaved({name: lambda _, call=call: call() for name, call in contenders.items()},
                       range(rounds), clocks, rotate)


def chunked_rounds(contenders: Mapping[str, Callable[[list[str]], object]], texts: list[str], chunk: int,
                   rounds: int, clocks: Mapping[str, Clock] = CLOCKS) -> dict[str, dict[str, list[float]]]:
    """Seconds (per clock) each contender spends on all ``texts``, per round: after one warm-up
    call each, ``interleaved`` chunk by chunk, the order rotating at every chunk."""
    for contender in contenders.values():
        contender(texts[:chunk])
    chunks = [texts[start : start + chunk] for start in range(0, len(texts), chunk)]
    turns = interleaved(contenders, chunks * rounds, clocks, rotate=True)
    k = len(chunks)
    return {name: {c: [sum(values[r * k : (r + 1) * k]) for r in range(rounds)] for c, values in per.items()}
            for name, per in turns.items()}


def median_ratio(mine: list[float], base: list[float]) -> float:
    """The median of per-round ratios against the baseline measured in the same rounds."""
    import statistics

    return statistics.median(m / b for m, b in zip(mine, base, strict=True))


# -- the process ----------------------------------------------------------------------------------

def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextmanager
def placed_llama_defaults() -> Iterator[None]:
    """llama-cpp-python's high-level ``Llama`` built under cascade's extra-buffer policy.

    Its default model params turn llama.cpp's extra buffers on, which segfaults the first decode
    on Intel AMX Xeons (llama.cpp issue 20824); inside this block they follow
    ``cascade.readout.placement`` (off there, and wherever it turns them off).
    """
    import llama_cpp.llama_cpp as low

    from cascade.readout.placement import system_info, use_extra_buffers

    real = low.llama_model_default_params

    def placed() -> Any:
        params = real()
        params.use_extra_bufts = use_extra_buffers(None, system_info())[0]
        return params

    low.llama_model_default_params = placed
    try:
        yield
    finally:
        low.llama_model_default_params = real


# -- a PostgreSQL server for the store's benchmarks -----------------------------------------------

@contextmanager
def postgres_databases() -> Iterator[Callable[[], str]]:
    """``new()`` makes a fresh database and returns its URL: on the server ``$CASCADE_TEST_POSTGRES_URL``
    names, else on a throwaway cluster started here (tests/pgserver.py: Debian's postgresql, run as a
    non-root user on loopback). Every database made is dropped, and the cluster stopped, at the end."""
    import os
    import sys
    import uuid

    import psycopg

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import pgserver

    server = None
    url = os.environ.get(pgserver.URL_VARIABLE)
    if not url:
        server = pgserver.start(Path(tempfile.mkdtemp(prefix="cascade-pg-")))
        url = server.url
    made: list[str] = []

    def new() -> str:
        name = f"bench_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        made.append(name)
        return url.rsplit("/", 1)[0] + f"/{name}"

    try:
        yield new
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            for name in made:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        if server is not None:
            server.stop()


SERVE_TIMEOUT = 120.0
"""Seconds a benchmark waits for a server to get ready, and for one of its answers."""


@contextmanager
def process(command: list[str], base: str, ready: str = "/health", seconds: float = 600
            ) -> Iterator[subprocess.Popen[bytes]]:
    """A server process, ready when ``base + ready`` answers 200 (at most ``seconds``; one that
    exits first is an error), yielded (its pid, for the CPU it spends); ended when the block ends."""
    import subprocess

    import httpx

    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + ready, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"{command[:5]} exited {server.returncode}")
            time.sleep(0.1)
        else:
            raise TimeoutError(f"{command[:5]} did not get ready in {seconds} s")
        yield server
    finally:
        server.terminate()
        server.wait(timeout=120)


@contextmanager
def server(bundle: Path, teacher: Path, port: int, threads: int, *extra: str) -> Iterator[str]:
    """``cascade serve --bundle --teacher`` in a process of its own on loopback, until it is
    healthy (at most SERVE_TIMEOUT seconds); yields its base URL, and ends it after the block."""
    import sys

    command = [sys.executable, "-m", "distill.cli", "serve", "--bundle", str(bundle), "--teacher",
               str(teacher), "--port", str(port), "--threads", str(threads), *extra]
    url = f"http://127.0.0.1:{port}"
    with process(command, url, seconds=SERVE_TIMEOUT):
        yield url
