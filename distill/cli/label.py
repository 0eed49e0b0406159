"""``cascade label``: teacher labels for a corpus in a resumable store; import and export them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.cli.common import (
    add_corpus_argument,
    add_placement_arguments,
    add_questions_argument,
    add_store_argument,
    add_text_field_argument,
    teacher_argument,
)
from distill.cli.endpoint import add_endpoint_arguments, add_timeout_argument, key_source, timeouts
from distill.cli.values import output_file, positive_number, sha256_hex, whole_number

if TYPE_CHECKING:
    from cascade.questions import Question
    from cascade.readout.excerpt import HeadTailExcerpt
    from distill.labelling.gguf import LabelSummary
    from distill.labelling.transfer import ImportSummary
    from distill.store import LabelStore

DEFAULT_TEACHER_NAME = "external labels"
DESCRIPTION = """\
Label every item of a JSONL corpus with a teacher GGUF model (the logit-readout scorer: one
prefill per item, all questions read in one decode) into a label store (SQLite or PostgreSQL),
the training and calibration data of the fast tiers. Each item's labels are committed as soon
as they exist: stop the run at any time (Ctrl-C, a kill) and run the same command again to
continue where it stopped.
A store belongs to one teacher (model sha256 and prompt version) and refuses any other.

One of three modes:
  --teacher MODEL.gguf   label the corpus with a GGUF model
  --teacher URL          label it through a System One endpoint (N calls at a time, said before
                         the first); the store is bound to the endpoint's model and hashes
  --import LABELS.jsonl  store labels made elsewhere (gold labels, another machine's export)
  --export OUT.jsonl     write a store's labels as JSONL rows {id, question, answer, probabilities}

The corpus has one JSON object per line, {"id": "e1", "text": "..."}; the text may also be a
JSON object or array (a structured state). The questions file is a System One request without
its state: {"questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}}."""
EPILOG = """\
examples:
  cascade label --questions q.json --corpus emails.jsonl --store labels.sqlite \\
      --teacher qwen3.5-4b-q4_k_m.gguf --gpu-layers 99 --excerpt head_tail:2048
  cascade label --questions q.json --corpus emails.jsonl --store labels.sqlite \\
      --teacher qwen3.5-4b-q4_k_m.gguf --sample 300 --seed 1 --gold-field label
  cascade label --questions q.json --corpus emails.jsonl --store labels.sqlite \\
      --teacher qwen3.5-4b-q4_k_m.gguf --gpu-layers 99 --ray auto --actors 8
  cascade label --questions q.json --corpus emails.jsonl --store labels.sqlite \\
      --teacher http://gpu-box:9000/v1/systemone --concurrency 8 --rate 20
  cascade label --questions q.json --store gold.sqlite --import gold.jsonl --teacher-name gold
  cascade label --store labels.sqlite --export labels.jsonl"""

DEFAULT_CONCURRENCY = 4
"""Calls in flight to a URL teacher where --concurrency is not given."""

_MODES = {
    # mode flag: (flags it needs, flags it refuses)
    "teacher": (("questions", "corpus"), ("teacher_name", "teacher_sha256", "teacher_identity")),
    "import_path": (("questions",), ("corpus", "ray", "limit", "sample")),
    "export_path": ((), ("questions", "corpus", "teacher_name", "teacher_sha256", "teacher_identity", "ray",
                         "limit", "sample")),
}
_FLAGS = {"teacher": "--teacher", "import_path": "--import", "export_path": "--export",
          "questions": "--questions", "corpus": "--corpus", "teacher_name": "--teacher-name",
          "ray": "--ray", "limit": "--limit", "sample": "--sample", "teacher_sha256": "--teacher-sha256",
          "teacher_identity": "--teacher-identity"}


def _check_mode(args: argparse.Namespace) -> str:
    """The mode named, once its companion flags are right; an argparse error otherwise."""
    mode = next(m for m in _MODES if getattr(args, m) is not None)
    needs, refuses = _MODES[mode]
    missing = [_FLAGS[f] for f in needs if getattr(args, f) is None]
    if missing:
        args.parser.error(f"{_FLAGS[mode]} needs {' and '.join(missing)}")
    extra = [_FLAGS[f] for f in refuses if getattr(args, f) is not None]
    if extra:
        args.parser.error(f"{', '.join(extra)} cannot be used with {_FLAGS[mode]}")
    return mode


def _cmd_label(args: argparse.Namespace) -> int:
    mode = _check_mode(args)
    if mode == "export_path":
        return _export(args)
    if mode == "import_path":
        return _import(args)
    return _label(args)


def _label(args: argparse.Namespace) -> int:
    from cascade.corpus import load_questions
    from cascade.readout.excerpt import HeadTailExcerpt

    ray_only = [flag for flag in ("actors", "batch_size") if getattr(args, flag) is not None]
    if ray_only and not args.ray:
        args.parser.error(f"--{ray_only[0].replace('_', '-')} needs --ray")
    url_only = [flag for flag in ("concurrency", "rate", "upstream_model") if getattr(args, flag) is not None]
    if url_only and not isinstance(args.teacher, str):
        args.parser.error(f"--{url_only[0].replace('_', '-')} applies to a URL teacher only; a GGUF is read "
                          "here, one item at a time (or on Ray actors: --ray, --actors)")
    questions = load_questions(args.questions)
    excerpt = HeadTailExcerpt.parse(args.excerpt) if args.excerpt else None
    if args.layout == "auto" and not isinstance(args.teacher, str):
        from cascade.readout.prompts import plan_layout

        args.layout, why = plan_layout(list(questions.values()), args.permutations)
        print(f"layout {why}", file=sys.stderr)
        if args.layout == "options-first":
            print("layout options-first is chosen by tokens alone: it moves answers (far worse against "
                  "gold on Qwen2.5-Coder-1.5B, BENCHMARKS.md); measure your teacher's", file=sys.stderr)
    only = _selected(args)
    driver = _label_endpoint if isinstance(args.teacher, str) else _label_on_ray if args.ray else _label_here
    summary = driver(args, questions, excerpt, only)
    for bad in summary.bad_lines:
        print(f"skipped {bad}", file=sys.stderr)
    held = f", {summary.held} left to another run labelling them" if summary.held else ""
    print(f"labelled {summary.labelled} items, {summary.skipped_done} already done, "
          f"{len(summary.bad_lines)} bad, {summary.left} left{held}, in {summary.seconds:.1f} s; "
          f"store: {args.store}")
    if summary.interrupted:
        print(f"interrupted: {summary.labelled} items labelled by this run are committed, {summary.left} "
              "left; run the same command again to resume (done items are skipped)", file=sys.stderr)
        return summary.exit_status
    if summary.turned_away:
        print(f"the upstream asked to wait (429 or 503) past the client's retries for {summary.turned_away} "
              "items, left unlabelled; run the same command again later to label them (done items are "
              "skipped)", file=sys.stderr)
        return 1
    _teacher_check(args, questions, only)
    return 0


def _selected(args: argparse.Namespace) -> list[str] | None:
    """The ids --limit or --sample take (None: every item), said before the run starts."""
    from distill.labelling.selection import Selection, select_ids

    selection = Selection(limit=args.limit, sample=args.sample, seed=args.seed, gold_field=args.gold_field)
    only = select_ids(args.corpus, args.text_field or "text", selection)
    if only is not None:
        print(f"taking {selection.describe()}: {len(only)} items", file=sys.stderr)
    return only


def _teacher_check(args: argparse.Namespace, questions: dict[str, Question] | None,
                   only: list[str] | None) -> None:
    """The teacher check on what the store holds, loudly where a question's labels are degenerate."""
    from distill.calibration.teacher_check import ACCEPT_FLAG, flagged, judge_store, read_gold
    from distill.store import LabelStore

    gold = read_gold(args.corpus, args.gold_field) if args.gold_field and args.corpus else None
    with LabelStore.open_existing(args.store) as store:
        if questions is None:
            questions = _stored_questions(store)
        checks = judge_store(store, questions, gold, only)
    for check in checks:
        print(check.line(), file=sys.stderr)
    if flagged(checks):
        print(f"cascade calibrate will refuse to certify {[c.question for c in flagged(checks)]} against "
              f"these labels unless given {ACCEPT_FLAG}", file=sys.stderr)


def _label_here(args: argparse.Namespace, questions: dict[str, Question],
                excerpt: HeadTailExcerpt | None, only: list[str] | None) -> LabelSummary:
    """Label in this process, with one teacher scorer; Ctrl-C or SIGTERM stop after an item."""
    from distill.labelling.gguf import label_corpus, open_teacher, teacher_of
    from distill.stopping import StopRequest
    from distill.store import InputPolicy, LabelStore, removed_on_failure

    scorer = open_teacher(args.teacher, questions, args.permutations, args.n_ctx, args.gpu_layers or 0,
                          args.threads, args.extra_buffers, args.layout)
    policy = InputPolicy(n_ctx=scorer.ctx.config.n_ctx, excerpt=args.excerpt)
    try:  # a first run that fails before any label (an empty corpus) leaves no store bound to this teacher
        with removed_on_failure(args.store, only_if_empty=True), \
                LabelStore(args.store, teacher_of(scorer), policy=policy) as store, StopRequest() as stop:
            summary = label_corpus(scorer, questions, args.corpus, store, args.text_field,
                                   args.on_error, args.permutations, excerpt=excerpt, only=only, stop=stop,
                                   say=lambda line: print(line, file=sys.stderr))
            summary.exit_status = stop.exit_status
            return summary
    finally:
        scorer.close()


def _label_endpoint(args: argparse.Namespace, questions: dict[str, Question],
                    excerpt: HeadTailExcerpt | None, only: list[str] | None) -> LabelSummary:
    """Label through a System One URL, ``--concurrency`` calls at a time (``distill.labelling.endpoint``)."""
    from cascade.teachers.settings import UpstreamSettings
    from distill.labelling.endpoint import EndpointRun, label_through_endpoint
    from distill.stopping import StopRequest

    local = [flag for flag, given in (("--ray", args.ray), ("--excerpt", excerpt),
                                      ("--permutations", args.permutations != 1)) if given]
    if local:
        args.parser.error(f"{local[0]} does not apply to a URL teacher, which reads states its own way")
    concurrency = args.concurrency or DEFAULT_CONCURRENCY
    settings = UpstreamSettings(args.teacher, model=args.upstream_model, max_in_flight=concurrency,
                                key=key_source(args), **timeouts(args))
    run = EndpointRun(concurrency=concurrency, rate=args.rate, text_field=args.text_field,
                      on_error=args.on_error, only=only)
    with StopRequest("the calls in flight") as stop:
        summary = label_through_endpoint(settings, questions, args.corpus, args.store, run, stop,
                                         say=lambda line: print(line, file=sys.stderr))
        summary.exit_status = stop.exit_status
        return summary


def _label_on_ray(args: argparse.Namespace, questions: dict[str, Question],
                  excerpt: HeadTailExcerpt | None, only: list[str] | None) -> LabelSummary:
    """Label on a Ray cluster's actors; this process reads the corpus and writes the store."""
    from distill.cli.common import placement_of
    from distill.labelling.gguf import teacher_of_file
    from distill.labelling.on_ray import (
        RayOptions,
        TeacherSpec,
        dropped_if_failed_empty,
        label_on_ray,
        require_ray,
    )
    from distill.store import InputPolicy, LabelStore

    require_ray()
    spec = TeacherSpec(model_path=args.teacher, questions=questions, permutations=args.permutations,
                       n_ctx=args.n_ctx, placement=placement_of(args), excerpt=excerpt, layout=args.layout)
    options = RayOptions(address=args.ray, actors=args.actors or 1, batch_size=args.batch_size or 8)
    teacher = teacher_of_file(args.teacher, args.layout)
    policy = InputPolicy(n_ctx=args.n_ctx, excerpt=args.excerpt)
    with dropped_if_failed_empty(args.store), LabelStore(args.store, teacher, policy=policy) as store:
        return label_on_ray(spec, args.corpus, store, options, args.text_field, args.on_error, only=only)


def _import(args: argparse.Namespace) -> int:
    from cascade.corpus import load_questions
    from distill.labelling.transfer import import_labels
    from distill.store import LabelStore, Teacher, removed_on_failure

    questions = load_questions(args.questions)
    teacher = _imported_teacher(args, Teacher)
    with removed_on_failure(args.store, only_if_empty=True):  # never labels another writer put there
        with LabelStore(args.store, teacher) as store:
            summary = import_labels(store, args.import_path, questions, args.on_error)
        for line, message in summary.errors:
            print(f"skipped {args.import_path}:{line}: {message}", file=sys.stderr)
        _check_imported(summary, args.import_path)
    print(f"imported {summary.imported} of {summary.rows} rows, {summary.skipped} skipped; "
          f"store: {args.store}")
    return 0


def _imported_teacher(args: argparse.Namespace, teacher: Any) -> Any:
    """Who made imported labels: a GGUF (--teacher-sha256 with --teacher-prompt-version), an
    endpoint (--teacher-identity), or external labels known by --teacher-name only."""
    from cascade.teachers.identity import EndpointIdentity

    name = args.teacher_name or DEFAULT_TEACHER_NAME
    if args.teacher_identity is not None:
        try:
            identity = EndpointIdentity.model_validate_json(args.teacher_identity)
        except ValueError as exc:
            lines = [line.strip() for line in str(exc).splitlines()[1:]  # the first: how many errors
                     if not line.strip().startswith("For further information")]
            args.parser.error('--teacher-identity must be JSON like {"model": ..., "model_hash": ...}: '
                              f"{' '.join(lines[:2])}")
        return teacher.of_endpoint(identity)
    if args.teacher_sha256 is not None:
        if args.teacher_prompt_version is None:
            args.parser.error("--teacher-sha256 needs --teacher-prompt-version (the prompt the labels were "
                              "read with, as the GGUF teacher's answers record it)")
        return teacher(kind="gguf", model=name, model_sha256=args.teacher_sha256,
                       prompt_version=args.teacher_prompt_version)
    return teacher(kind="external", model=name)


def _check_imported(summary: ImportSummary, path: Path) -> None:
    """An import that stores nothing is a mistake (the wrong file, or rows for other questions),
    not a success to exit 0 on."""
    from distill.store import StoreError

    if not summary.rows:
        raise StoreError(f"nothing imported: {path} is empty; give one JSON row per line, like "
                         '{"id": "e1", "question": "urgent", "answer": true}')
    if not summary.imported:
        raise StoreError(f"nothing imported: all {summary.rows} rows of {path} were skipped, for "
                         "the reasons listed above")


def _export(args: argparse.Namespace) -> int:
    from distill.labelling.transfer import export_labels
    from distill.store import LabelStore

    with LabelStore.open_existing(args.store) as store:
        count = export_labels(store, args.export_path)
        teacher = store.teacher.model
    print(f"exported {count} labels of teacher {teacher!r} from {args.store} to {args.export_path}")
    if count:  # a store with no label yet (audits only, say) has nothing to check
        _teacher_check(args, None, None)
    return 0


def _stored_questions(store: LabelStore) -> dict[str, Question]:
    """Questions rebuilt from a store's option keys (an export has no questions file): the teacher
    check needs only each question's options, in the order the store keeps them."""
    from cascade.questions import parse_request

    shapes: dict[str, Any] = {}
    for qid in store.question_ids():
        keys = list(next(iter(store.labels(qid).values())))
        shapes[qid] = ({"type": "noul", "instructions": qid} if keys == ["true", "false"] else
                       {"type": "choice", "instructions": qid, "criteria": dict.fromkeys(keys)})
    return dict(parse_request({"state": "-", "questions": shapes}).questions)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "label",
        help="label a corpus with a teacher model into a resumable store (or import / export)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--teacher", type=teacher_argument, metavar="MODEL.gguf|URL",
                      help="label the corpus with this GGUF model, or through this System One endpoint "
                      "(http://host:port/v1/systemone; see 'through a URL teacher' below)")
    mode.add_argument("--import", dest="import_path", type=Path, metavar="LABELS.jsonl",
                      help="store these labels ({id, question, answer | probabilities} rows)")
    mode.add_argument("--export", dest="export_path", type=output_file, metavar="OUT.jsonl",
                      help="write the store's labels to this JSONL file")
    add_store_argument(p, "label store; created on first use, resumed after")
    add_questions_argument(p, required=False)
    add_corpus_argument(p, required=False)
    add_text_field_argument(p)
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="at a bad line or over-long item: stop with its line number (default), or "
                   "skip it, go on, and list it at the end")
    p.add_argument("--teacher-name", metavar="NAME",
                   help=f"with --import: who made the labels (default: {DEFAULT_TEACHER_NAME!r}); the "
                   "GGUF's file name with --teacher-sha256")
    p.add_argument("--teacher-sha256", type=sha256_hex, metavar="HEX",
                   help="with --import: the labels came from the GGUF of this sha256, read with "
                   "--teacher-prompt-version: a bundle built on them is then served and audited with it")
    p.add_argument("--teacher-prompt-version", metavar="VERSION",
                   help="with --teacher-sha256: the prompt version its labels were read with")
    p.add_argument("--teacher-identity", metavar="JSON",
                   help='with --import: the labels came from an endpoint stating this identity, e.g. '
                   '\'{"model": "jev-1.13.0", "model_hash": "...", "calibration_version": "..."}\'')
    p.add_argument("--permutations", type=whole_number(1), default=1, metavar="K",
                   help="average over K balanced option orders to cancel position bias (cost: K x)")
    p.add_argument("--layout", choices=("state-first", "options-first", "auto"), default="state-first",
                   help="prompt layout, a teacher identity as its model is (a store holds one): the "
                   "state first, its questions fanned out from it (default), or the question and "
                   "options first, prefilled once per run, so that each item reads only its state and "
                   "the answer line; auto picks the one that prefills fewer tokens (options first for "
                   "one question in one option order) and says which. Options first moves answers: on "
                   "Qwen2.5-Coder-1.5B it was far worse against gold on all three shared sets "
                   "(BENCHMARKS.md), so measure your teacher before you choose it")
    p.add_argument("--excerpt", metavar="head_tail:N",
                   help="label over-long items from their first and last N/2 state tokens "
                   "(default: an over-long item is a bad item, see --on-error)")
    p.add_argument("--n-ctx", type=whole_number(1), default=4096, metavar="N",
                   help="context tokens (default 4096). The context and --excerpt are the input policy: "
                   "the store records it, refuses a resume under another, and the bundle follows it")
    chosen = p.add_argument_group("which items (default: every item of the corpus)")
    one_way = chosen.add_mutually_exclusive_group()
    one_way.add_argument("--limit", type=whole_number(1), metavar="N", help="the first N items")
    one_way.add_argument("--sample", type=whole_number(1), metavar="N",
                        help="N items drawn at random with --seed (the same N on every resume), "
                        "stratified by --gold-field where given: a corpus sorted by label gives one "
                        "class with --limit")
    chosen.add_argument("--seed", type=whole_number(0), default=0, metavar="S",
                        help="seed of --sample (default 0)")
    p.add_argument("--gold-field", metavar="NAME",
                   help="a corpus field holding gold answers (option keys; true/false or yes/no for "
                   "noul, level numbers for score): the teacher check reports the teacher's agreement "
                   "with it, and --sample keeps each gold answer's share")
    add_placement_arguments(p)
    url = p.add_argument_group("through a URL teacher (--teacher http://host:port/v1/systemone)")
    url.add_argument("--concurrency", type=whole_number(1), metavar="N",
                     help=f"calls in flight at once (default {DEFAULT_CONCURRENCY})")
    url.add_argument("--rate", type=positive_number, metavar="R",
                     help="at most R calls a second, > 0 (default: no limit)")
    add_endpoint_arguments(url, "endpoint")
    add_timeout_argument(url)
    ray = p.add_argument_group("labelling on a Ray cluster (pip install -e '.[ray]')")
    ray.add_argument("--ray", metavar="ADDRESS",
                     help="label on Ray actors: a cluster's address (HEAD_IP:6379, auto) or 'local' to "
                     "start one here; this process reads the corpus and is the store's only writer")
    ray.add_argument("--actors", type=whole_number(1), metavar="N",
                     help="teacher copies (default 1), one GPU each with --gpu-layers; each runs and "
                     "reserves --threads CPUs (default 1 with --ray)")
    ray.add_argument("--batch-size", type=whole_number(1), metavar="N",
                     help="items per actor call: what Ray retries after a failure (default 8)")
    p.set_defaults(run=_cmd_label, parser=p)
