"""The whole offline flow on embedded defaults, end to end and for real: ``cascade demo``.

A generated corpus (``distill.demo.synthetic``) with a teacher's labels, the encoder tier trained on
them, gemma-3-270m as a readout tier between the encoder and the teacher, thresholds calibrated,
a report, and the evaluation items routed through the cascade: every figure printed is measured,
and what is a stand-in is said so. A re-run reuses what did not change. See
docs/getting-started.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from pydantic import ValidationError
from tqdm import tqdm

from cascade.bundle.manifest import Bundle, BundleError
from cascade.checks import is_int
from cascade.corpus import BadLine, OnError, count_items, load_questions
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import CascadeError
from cascade.hashing import file_sha256
from cascade.readout.llama import default_gguf_path
from cascade.readout.placement import ExtraBuffers, Placement
from cascade.readout.scorer import Scorer
from cascade.tiers.gguf import GgufSpec
from distill.calibration.evaluate import Evaluation, evaluate_bundle, format_evaluation
from distill.calibration.options import CalibrationOptions
from distill.calibration.results import CalibrationResult
from distill.calibration.run import calibrate_bundle
from distill.demo.synthetic import GENERATOR_VERSION, generate, write_corpus, write_labels, write_questions
from distill.demo.teacher import (
    LIVE_ITEMS,
    agreement_with_generator,
    check_shipped,
    label_live,
    next_step,
    shipped_facts,
    shipped_labels,
    shipped_teacher,
    show_live,
    teacher_note,
)
from distill.labelling.transfer import import_labels
from distill.options import CorpusInput, RunOptions
from distill.reports.calibration_report import figures_note, write_report
from distill.store import LabelStore, Teacher
from distill.training.run import middle_tier, train_bundle
from distill.training.split import check_fractions

DEMO_VERSION = "demo-v4"
"""Part of the reuse fingerprint: a change to how the demo builds its bundle invalidates reuse."""
DEFAULT_WORKDIR = Path("runs/demo")
DEFAULT_ITEMS = 2000
DEFAULT_GEMMA_ITEMS = 300
DEFAULT_EVAL_ITEMS = 200
DEFAULT_TARGET = 0.95
"""With two cheap tiers each is certified at 1 - (1 - target) / 2 and delta / 2 on the 300
calibration items gemma has time to score. Measured on the default corpus (2 cores): at 0.95 the
encoder keeps ~75% of answers, the realised agreement is ~0.986 and the cascade costs ~0.34 of
the teacher alone; at 0.9 it keeps ~90% at ~0.97 and ~0.14. 0.98 is unreachable with 300 items:
0.99 per tier at level 0.025 needs more than the 0.9878 that zero disagreements certify."""
DEFAULT_DELTA = 0.05
GEMMA_TIER, OTHER_GGUF_TIER = "gemma", "gguf"
GEMMA_N_CTX = 1024
MIN_TRAIN_FRACTION = 0.3
GENERATOR_TEACHER = f"corpus generator {GENERATOR_VERSION}"
GENERATOR_NOTE = ("teacher: labels from the corpus generator, standing in for a 4B teacher; these "
                  "figures are not a 4B's")
STATE_NAME, EVALUATION_NAME = "calibration.json", "evaluation.json"

Say = Callable[[str], None]
DemoTeacher = Literal["shipped", "generator", "live"]
TEACHERS: tuple[str, ...] = get_args(DemoTeacher)


class DemoError(CascadeError, ValueError):
    """The demo was asked for something it cannot run: inconsistent sizes or half the user inputs."""


@dataclass(frozen=True)
class DemoConfig:
    """What to run. ``corpus``, ``questions`` and ``labels`` go together: the user's own data in
    place of the generated corpus (``items`` and ``seed`` then do nothing)."""

    workdir: Path = DEFAULT_WORKDIR
    items: int | None = None  # None: what the shipped labels cover, or DEFAULT_ITEMS with the generator's
    seed: int = 0
    teacher: DemoTeacher = "shipped"
    live_items: int = LIVE_ITEMS
    gemma_items: int | None = None  # None: DEFAULT_GEMMA_ITEMS, or 30% of fewer than 1000 items
    eval_items: int | None = None  # None: DEFAULT_EVAL_ITEMS, or 20% of fewer than 1000 items
    target: float = DEFAULT_TARGET
    delta: float = DEFAULT_DELTA
    family_wise: bool = False
    threads: int | None = None
    gpu_layers: int = 0
    on_error: OnError = "stop"
    extra_buffers: ExtraBuffers | None = None
    gguf: Path | None = None
    corpus: Path | None = None
    questions: Path | None = None
    labels: Path | None = None
    force: bool = False
    progress: bool = True


@dataclass(frozen=True)
class DemoInputs:
    """The files a run works from and the teacher their labels are attributed to."""

    corpus: Path
    questions: Path
    labels: Path
    store: Path
    teacher: Teacher
    note: str
    items: int


@dataclass
class DemoResult:
    """Where everything went and what the cascade did on the evaluation items."""

    workdir: Path
    inputs: DemoInputs
    bundle: Path
    report: Path
    calibration: CalibrationResult
    evaluation: Evaluation
    reused_calibration: bool
    seconds: dict[str, float] = field(default_factory=dict)


def run_demo(config: DemoConfig, say: Say = print) -> DemoResult:
    """Run every step, printing what each did through ``say``; returns the results and paths."""
    _check_config(config)
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    inputs = _inputs(config, workdir, say)
    fractions = _fractions(config, inputs.items)
    with LabelStore(inputs.store, inputs.teacher) as store:
        run = _Run(config, inputs, store, fractions, workdir / "bundle", say)
        with run.timed("teacher"):
            _import(run)
            _show_teacher(run)
        result, reused = _calibrated(run)
        _say_thresholds(result, run.say)
        with run.timed("report"):
            report = _report(result, run.bundle_dir, workdir / "report", config.progress)
        say(f"[6/7] calibration report: {report.resolve()}")
        if note := figures_note():
            say(f"      {note}")
        with run.timed("evaluate"):
            evaluation = _evaluate(run)
    (workdir / EVALUATION_NAME).write_text(evaluation.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return DemoResult(workdir, inputs, run.bundle_dir, report, result, evaluation, reused, run.seconds)


@dataclass
class _Run:
    """What every step of one run shares, and the seconds each step took."""

    config: DemoConfig
    inputs: DemoInputs
    store: LabelStore
    fractions: Mapping[str, float]
    bundle_dir: Path
    say: Say
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)

    def corpus(self) -> CorpusInput:
        """The corpus every step reads, its skipped lines said once (``skip``)."""
        return CorpusInput(self.inputs.corpus, on_error=self.config.on_error, on_bad=self.skip)

    def skip(self, bad: BadLine) -> None:
        """Say each skipped corpus line once, though training, calibration and evaluation all read it."""
        if str(bad) not in self.skipped:
            self.skipped.add(str(bad))
            self.say(f"      skipped {bad}")

    @contextmanager
    def timed(self, step: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - started


def _calibrated(run: _Run) -> tuple[CalibrationResult, bool]:
    """The calibrated bundle: the previous run's when nothing it depends on changed, else new."""
    config = run.config
    encoder = Encoder(threads=config.threads)
    gguf = Path(config.gguf) if config.gguf is not None else default_gguf_path()
    fingerprint = _fingerprint(run, encoder, gguf)
    previous = None if config.force else _reusable(Path(config.workdir), run.bundle_dir, fingerprint)
    if previous is not None:
        run.say(f"[3-5/7] reusing the calibrated bundle {run.bundle_dir} (same corpus, labels, models "
                "and settings; --force rebuilds it)")
        return previous, True
    tier = GEMMA_TIER if "gemma" in gguf.name.lower() else OTHER_GGUF_TIER
    bundle = _train(run, encoder, middle_tier(gguf, tier, GEMMA_N_CTX))
    run.say(f"[4/7] bundle {run.bundle_dir}: encoder -> {tier} ({gguf.name}, logit readout) -> teacher")
    result = _calibrate(run, bundle, encoder, tier, gguf)
    _remember(Path(config.workdir), run.bundle_dir, fingerprint, result)
    return result, False


def _train(run: _Run, encoder: Encoder, middle: GgufSpec) -> Bundle:
    run.say("[3/7] training the encoder tier on the teacher's labels of the train part")
    questions = load_questions(run.inputs.questions)
    with run.timed("train"):
        bundle = train_bundle(questions, run.corpus(), run.store, run.bundle_dir, encoder=encoder,
                              fractions=run.fractions, middle=[middle], pin_teacher=False,
                              run=RunOptions(progress=run.config.progress,
                                             cache_dir=Path(run.config.workdir) / "cache"))
    tier = bundle.manifest.encoder_tier
    for qid, info in (tier.heads if tier is not None else {}).items():
        agreement = "no head: " + str(info.skipped) if info.held_out_agreement is None else (
            f"held-out agreement {info.held_out_agreement:.3f}")
        run.say(f"      {qid}: {info.train_items} train items, {agreement}")
    return bundle


def _calibrate(run: _Run, bundle: Bundle, encoder: Encoder, tier: str, gguf: Path) -> CalibrationResult:
    config = run.config
    items = len(bundle.split_ids()["calibration"])
    run.say(f"[5/7] calibrating thresholds for {config.target:.0%} agreement with the teacher at "
            f"{1 - config.delta:.0%} confidence on {items} calibration items (each scored by {tier})")
    scorer = Scorer(gguf, n_ctx=GEMMA_N_CTX, max_branches=len(bundle.manifest.questions),
                    n_threads=config.threads, n_gpu_layers=config.gpu_layers,
                    extra_buffers=config.extra_buffers)
    try:
        with run.timed("calibrate"):
            options = CalibrationOptions(target=config.target, delta=config.delta,
                                         family_wise=config.family_wise, accept_degenerate_teacher=True)
            result = calibrate_bundle(bundle, run.corpus(), run.store, options,
                                      run=RunOptions(progress=config.progress), encoder=encoder,
                                      scorers={tier: scorer})
    finally:
        scorer.close()
    for check in result.teacher_checks:
        if check.flagged:  # a demonstration goes on, saying what `cascade calibrate` would refuse
            run.say(f"      {check.line()}\n      the demo certifies it anyway to show the rest of the "
                    "pipeline; `cascade calibrate` refuses it without --accept-degenerate-teacher, "
                    "and the report leads with this finding")
    return result


def _say_thresholds(result: CalibrationResult, say: Say) -> None:
    """Per question, the share of calibration answers each cheap tier may keep, and from what
    raw margin (the score thresholds are certified on)."""
    for fit in result.calibrations:
        keeps = ("keeps nothing (target not reachable)" if fit.threshold is None else
                 f"keeps {fit.kept_share:.1%} (raw margin >= {fit.threshold:.3f})")
        say(f"      {fit.question} on {fit.tier}: {keeps}")
    for tier, payoff in result.payoffs.items():
        say(f"      tier {tier}: {payoff.reason}")


def _report(result: CalibrationResult, bundle_dir: Path, report_dir: Path, progress: bool) -> Path:
    """The HTML report; drawing its plots takes seconds, hence the one-step bar."""
    with tqdm(total=1, desc="report", unit="report", disable=not progress) as bar:
        path = write_report(result, Bundle.load(bundle_dir), report_dir)
        bar.update()
    return path


def _evaluate(run: _Run) -> Evaluation:
    bundle = Bundle.load(run.bundle_dir, verify=False)
    items = len(bundle.split_ids()["evaluation"])
    dropped = bundle.manifest.calibration.dropped()
    middle = (f" ({', '.join(sorted(dropped))} taken out at calibration)," if dropped else
              ", the GGUF tier what it escalates,")
    run.say(f"[7/7] routing the {items} evaluation items through the cascade: the encoder answers "
            f"what it is sure of{middle} the teacher's recorded labels the rest")
    config = run.config
    place = Placement(gpu_layers=config.gpu_layers, threads=config.threads,
                      extra_buffers=config.extra_buffers)
    return evaluate_bundle(run.bundle_dir, run.corpus(), run.store,
                           run=RunOptions(progress=config.progress, placement=place))


def _check_config(config: DemoConfig) -> None:
    own = {"--corpus": config.corpus, "--questions": config.questions, "--labels": config.labels}
    given = [flag for flag, value in own.items() if value is not None]
    if given and len(given) < len(own):
        missing = [flag for flag in own if flag not in given]
        raise DemoError(f"{', '.join(given)} needs {' and '.join(missing)} too: your own corpus, its "
                        "questions and their labels go together (or give none for the generated demo)")
    for name, least in (("items", 1), ("gemma_items", 1), ("eval_items", 1), ("live_items", 0)):
        value = getattr(config, name)
        if (value is not None or name == "live_items") and not (is_int(value) and value >= least):
            raise DemoError(f"{name} must be a whole number >= {least}; got {value!r}")
    if config.teacher not in TEACHERS:
        raise DemoError(f"teacher must be one of {', '.join(TEACHERS)}; got {config.teacher!r}")
    for name in ("target", "delta"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
            raise DemoError(f"{name} must be a number in (0, 1); got {value!r}")
    threads = config.threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise DemoError(f"threads must be a whole number >= 1 or None (all cores); got {config.threads!r}")
    _check_middle(config)


def _check_middle(config: DemoConfig) -> None:
    """What step 4 loads, checked before step 1: a file that is not a GGUF, or GPU layers on a CPU
    build, failed only after the teacher's labels and the training (about 30 s in)."""
    from cascade.readout.gguf_header import read_header  # imports gguf: only where a file is read
    from cascade.readout.placement import check_gpu_layers

    check_gpu_layers(config.gpu_layers)
    if config.gguf is not None:
        read_header(Path(config.gguf))


def _fractions(config: DemoConfig, items: int) -> dict[str, float]:
    """The split that gives gemma ``gemma_items`` calibration items and routes ``eval_items``."""
    gemma = config.gemma_items or min(DEFAULT_GEMMA_ITEMS, int(0.3 * items))
    routed = config.eval_items or min(DEFAULT_EVAL_ITEMS, int(0.2 * items))
    calibration, evaluation = gemma / items, routed / items
    train = 1.0 - calibration - evaluation
    if train < MIN_TRAIN_FRACTION:
        raise DemoError(f"gemma_items ({gemma}) + eval_items ({routed}) leave "
                        f"{max(train, 0):.0%} of the {items} items for training; at least "
                        f"{MIN_TRAIN_FRACTION:.0%} must be left: lower them or give more items")
    return check_fractions({"train": train, "calibration": calibration, "evaluation": evaluation})


def _inputs(config: DemoConfig, workdir: Path, say: Say) -> DemoInputs:
    if config.corpus is None or config.questions is None or config.labels is None:
        return _generated(config, workdir, say)
    labels = Path(config.labels)
    digest = file_sha256(labels)[:12]
    teacher = Teacher(kind="external", model=f"labels {labels.name} {digest}")
    items = count_items(Path(config.corpus))
    say(f"[1/7] corpus: your {items} items in {config.corpus}")
    note = (f"teacher: your labels from {labels} (external); cost is compared with a 4B teacher "
            "answering everything")
    return DemoInputs(Path(config.corpus), Path(config.questions), labels,
                      workdir / f"labels-{digest}.sqlite", teacher, note, items)


def _generated(config: DemoConfig, workdir: Path, say: Say) -> DemoInputs:
    data = workdir / "data"
    facts = None if config.teacher == "generator" else shipped_facts()
    count = config.items or (DEFAULT_ITEMS if facts is None else facts.items)
    if facts is not None and config.teacher == "shipped":
        check_shipped(facts, config.seed, count)
    items = generate(count, config.seed)
    name = f"s{config.seed}-n{count}"
    corpus = write_corpus(items, data / f"corpus-{name}.jsonl")
    questions = write_questions(data / "questions.json")
    say(f"[1/7] corpus: {len(items)} generated support messages (seed {config.seed}) in {corpus}")
    if facts is None:
        return DemoInputs(corpus, questions, write_labels(items, data / f"labels-{name}.jsonl"),
                          workdir / f"labels-{GENERATOR_VERSION}.sqlite",
                          Teacher(kind="external", model=GENERATOR_TEACHER), GENERATOR_NOTE, len(items))
    if config.teacher == "shipped":
        labels = shipped_labels([item.id for item in items], data / f"teacher-labels-{name}.jsonl")
        teacher, note = shipped_teacher(facts), teacher_note(facts, live=False)
    else:
        labels, teacher = label_live(corpus, load_questions(questions), data / f"live-labels-{name}.jsonl",
                                     config.threads, say)
        note = teacher_note(facts, live=True)
    store = workdir / f"labels-{config.teacher}-{file_sha256(labels)[:12]}.sqlite"
    return DemoInputs(corpus, questions, labels, store, teacher, note, len(items))


def _import(run: _Run) -> None:
    """Import the labels; rows already in the store are no-ops, so a re-run costs a file read."""
    questions = load_questions(run.inputs.questions)
    summary = import_labels(run.store, run.inputs.labels, questions)
    run.say(f"[2/7] {run.inputs.note}")
    run.say(f"      {summary.imported} labels ({len(questions)} questions) in the store {run.inputs.store}")


def _show_teacher(run: _Run) -> None:
    """With a real teacher: how it relates to the generator's intent, and (shipped) the model live."""
    config = run.config
    if config.teacher == "generator" or config.corpus is not None:
        return
    items = generate(run.inputs.items, config.seed)
    run.say(f"      the teacher's top answer is the one the generator wrote the message for: "
            f"{agreement_with_generator(items, run.store)}")
    if config.teacher == "shipped" and config.live_items:
        show_live(run.inputs.corpus, load_questions(run.inputs.questions), run.store, config.live_items,
                  config.threads, run.say)


def _fingerprint(run: _Run, encoder: Encoder, gguf: Path) -> str:
    """Everything the calibrated bundle depends on; equal fingerprints mean it can be reused."""
    config, inputs = run.config, run.inputs
    facts = {
        "demo": DEMO_VERSION, "corpus": file_sha256(inputs.corpus), "labels": file_sha256(inputs.labels),
        "questions": file_sha256(inputs.questions), "teacher": inputs.teacher.model_dump(),
        "encoder": encoder.sha256, "max_length": encoder.max_length, "gguf": file_sha256(gguf),
        "n_ctx": GEMMA_N_CTX, "fractions": dict(run.fractions), "target": config.target,
        "delta": config.delta, "family_wise": config.family_wise,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _reusable(workdir: Path, bundle_dir: Path, fingerprint: str) -> CalibrationResult | None:
    """The previous run's calibration, if it was made from the same inputs and the bundle is intact."""
    path = workdir / STATE_NAME
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if state.get("fingerprint") != fingerprint:
            return None
        Bundle.load(bundle_dir)
        if file_sha256(bundle_dir / "manifest.json") != state.get("manifest_sha256"):
            return None
        return CalibrationResult.model_validate(state["result"])
    except (OSError, ValueError, KeyError, ValidationError, BundleError):
        return None


def _remember(workdir: Path, bundle_dir: Path, fingerprint: str, result: CalibrationResult) -> None:
    state = {"fingerprint": fingerprint, "manifest_sha256": file_sha256(bundle_dir / "manifest.json"),
             "result": result.model_dump(mode="json")}
    (workdir / STATE_NAME).write_text(json.dumps(state) + "\n", encoding="utf-8")


def format_summary(result: DemoResult) -> str:
    """The closing table: who answered, agreement with the teacher, cost, and the report's path."""
    evaluation = result.evaluation
    lines = [format_evaluation(evaluation), "", "summary"]
    rows = [(f"answered by {tier.name}", f"{tier.share:.1%}") for tier in evaluation.tiers]
    rows += [
        ("agreement with the teacher", f"{evaluation.agreement:.4f} (target {result.calibration.target})"),
        ("cost vs the teacher alone", f"{evaluation.cost_ratio:.3f} (predicted "
         f"{evaluation.cascade_seconds:.3g} s vs {evaluation.teacher_seconds:.3g} s)"),
        ("evaluation items", str(evaluation.items)),
    ]
    width = max(len(label) for label, _ in rows)
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    lines += [result.inputs.note, *next_step(result.bundle, result.inputs.teacher),
              f"report: {result.report.resolve()}"]
    return "\n".join(lines)
