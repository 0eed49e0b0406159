"""Helpers every subcommand shares: arguments spelled once, and the option objects built from them.

Each ``add_*`` adds flags that several commands take, with one spelling and one help text (a
command may word the help for its case); each builder (``corpus_input``, ``run_options``,
``budget_of``, ``placement_of``) turns the parsed flags into what the library takes. Library
modules are imported inside the builders, so that ``cascade --help`` imports none.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cascade.errors import RequestError
from cascade.readout.placement import EXTRA_BUFFER_SETTINGS, Placement
from distill.cli.renamed import renamed_values
from distill.cli.values import positive_number, share, whole_number

if TYPE_CHECKING:
    from cascade.questions import DecisionRequest
    from cascade.routing.budget import Budget
    from distill.options import CorpusInput, RunOptions
    from distill.store import StoreLocation
    from distill.training.finetune import FinetuneConfig

CORPUS_HELP = 'JSONL corpus, one {"id": ..., "text": ...} object per line'


def read_request(path: Path) -> DecisionRequest:
    """A request file, validated; every problem names the file, which ``parse_request`` (given
    the text alone) cannot: "req.json: request: invalid JSON at line 3, column 5: ..."."""
    from cascade.questions import parse_request

    if not path.is_file():
        raise RequestError(f"request file {path} is a folder" if path.is_dir() else
                           f"request file not found: {path}")
    try:
        return parse_request(path.read_bytes())
    except RequestError as exc:
        raise RequestError("\n".join(f"{path}: {line}" for line in str(exc).splitlines())) from None


def add_bundle_argument(p: argparse.ArgumentParser, help: str = "model bundle folder") -> None:
    p.add_argument("--bundle", type=Path, required=True, metavar="DIR", help=help)


STORE_METAVAR = "S.sqlite|URL"


def store_argument(text: str) -> StoreLocation:
    """A store's place as ``--store`` and ``--audit-store`` take it: a SQLite file's path, or a
    ``postgresql://`` URL (printed without its password from here on)."""
    from distill.store import StoreError, store_location

    try:
        return store_location(text)
    except StoreError as exc:  # argparse would otherwise print the raw text, password included
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_store_argument(p: argparse.ArgumentParser, help: str, required: bool = True) -> None:
    p.add_argument("--store", type=store_argument, required=required, metavar=STORE_METAVAR,
                   help=f"{help}; a path is a SQLite file, a postgresql://USER@HOST/DB URL a PostgreSQL "
                   "database (pip install -e '.[postgres]')")


def add_questions_argument(p: argparse.ArgumentParser, required: bool = True,
                           help: str = 'questions file: {"questions": {id: {type, instructions, criteria}}}'
                           ) -> None:
    p.add_argument("--questions", type=Path, required=required, metavar="Q.json", help=help)


def add_corpus_argument(p: argparse.ArgumentParser, help: str = CORPUS_HELP, required: bool = True) -> None:
    p.add_argument("--corpus", type=Path, required=required, metavar="C.jsonl", help=help)


def add_text_field_argument(p: argparse.ArgumentParser, bundle: bool = False) -> None:
    """``--text-field``; ``bundle``: it defaults to the field the bundle was trained on."""
    if bundle:
        p.add_argument("--text-field", metavar="NAME",
                       help="corpus field holding each state (default: the one the bundle was trained on)")
    else:
        p.add_argument("--text-field", default="text", metavar="NAME",
                       help="corpus field holding each state (default: text)")


def corpus_input(args: argparse.Namespace) -> CorpusInput:
    """The corpus --corpus, --text-field and --on-error name, skipped lines named on stderr."""
    from distill.options import CorpusInput

    return CorpusInput(args.corpus, text_field=args.text_field, on_error=args.on_error,
                       on_bad=report_skipped)


def optional_corpus_input(args: argparse.Namespace) -> CorpusInput | None:
    """``corpus_input`` where --corpus is given, else None (a command that can do without one)."""
    return None if args.corpus is None else corpus_input(args)


def finetune_config(args: argparse.Namespace) -> FinetuneConfig | None:
    """The fine-tuning --finetune, --epochs and --seed ask for (train, retrain, loop), or None;
    --epochs or --seed without --finetune is refused rather than ignored."""
    from distill.training.finetune import FinetuneConfig, FinetuneError

    defaults = FinetuneConfig()
    tuning = {"epochs": args.epochs, "seed": args.seed}
    if not args.finetune:
        given = [f"--{name}" for name, value in tuning.items() if value is not None]
        if given:
            raise FinetuneError(f"{', '.join(given)} set how the encoder is fine-tuned; add --finetune")
        return None
    return FinetuneConfig(epochs=args.epochs or defaults.epochs, seed=args.seed or defaults.seed,
                          threads=args.threads)


def add_device_argument(p: argparse.ArgumentParser, help: str = "where the encoder runs (default cpu)"
                        ) -> None:
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu", help=help)


def add_cache_dir_argument(p: argparse.ArgumentParser,
                           help: str = "embedding cache folder (default: ~/.cache/cascade)") -> None:
    p.add_argument("--cache-dir", type=Path, metavar="DIR", help=help)


def add_batch_size_argument(p: argparse.ArgumentParser, default: int, help: str) -> None:
    p.add_argument("--batch-size", type=whole_number(1), default=default, metavar="N", help=help)


def run_options(args: argparse.Namespace) -> RunOptions:
    """How the run goes, from the flags the command has: placement (--gpu-layers, --threads,
    --extra-buffers), --device and --cache-dir (default: ``default_cache_dir()``)."""
    from distill.options import RunOptions, default_cache_dir

    has = vars(args)
    return RunOptions(placement=placement_of(args) if "gpu_layers" in has else None,
                      device=has.get("device", "cpu"), threads=has.get("threads"),
                      cache_dir=(args.cache_dir or default_cache_dir()) if "cache_dir" in has else None)


def add_on_error_argument(p: argparse.ArgumentParser) -> None:
    """``--on-error`` for a command that reads a corpus, spelled as ``cascade label`` spells it, so
    that the advice a bad line's error gives works with every such command."""
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="at a bad corpus line: stop with its line number (default), or skip it, "
                   "name it on stderr, and go on")


def report_skipped(bad: object) -> None:
    """Name a skipped corpus line (file:line: why) on stderr as soon as it is met."""
    print(f"skipped {bad}", file=sys.stderr)


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """The two budget bounds, spelled the same wherever a cascade routes items."""
    p.add_argument("--budget-ms", type=positive_number, metavar="X",
                   help="predicted milliseconds per item, pooled over each batch (default: no bound)")
    p.add_argument("--max-escalation", type=share, metavar="F",
                   help="most of each batch's questions the top tier may answer, 0..1 (default: no bound)")


def budget_of(args: argparse.Namespace) -> Budget:
    """The budget ``add_budget_arguments``' flags set."""
    from cascade.routing.budget import Budget

    return Budget(ms_per_call=args.budget_ms, max_escalation_fraction=args.max_escalation)


THREADS_DEFAULT = ("(at most the machine's CPUs: more only wait for each other; default: the cores "
                   "free when a model loads, the cores less those other processes keep busy then: "
                   "all on an idle machine, fewer beside other work; on 2 cores, 2 threads read "
                   "1.67x faster idle and 1.24x slower beside one busy process)")
"""What --threads defaults to, said the same by every command (``cascade.readout.placement``)."""


def add_placement_arguments(p: argparse.ArgumentParser, threads: bool = True,
                            gpu_default: str = ": the bundle's per-tier setting, else 0") -> None:
    """Where GGUF models run, spelled the same by every command that opens one."""
    p.add_argument("--gpu-layers", type=whole_number(0), metavar="N",
                   help="layers of each GGUF model to offload to the GPU (99: all); needs a CUDA "
                   f"build of llama-cpp-python, and a CPU build refuses it (default{gpu_default})")
    if threads:
        p.add_argument("--threads", type=whole_number(1), metavar="N",
                       help=f"CPU threads of each model {THREADS_DEFAULT}")
    p.add_argument("--extra-buffers", choices=EXTRA_BUFFER_SETTINGS,
                   help="llama.cpp's extra weight buffer types (CPU repacking): auto turns them off "
                   "where llama.cpp reports Intel AMX, whose buffers segfault some Xeons (llama.cpp "
                   "issue 20824), and on AVX-512, where they measured slower; on is refused with "
                   "one line on an AMX CPU; force loads them even there, at your own risk "
                   "(default: auto, or $CASCADE_EXTRA_BUFTS)")


def placement_of(args: argparse.Namespace) -> Placement:
    """The placement the command line asked for; fields not given stay None (tier defaults)."""
    return Placement(gpu_layers=args.gpu_layers, threads=getattr(args, "threads", None),
                     extra_buffers=args.extra_buffers)


def add_audit_arguments(p: argparse.ArgumentParser) -> None:
    """The audit of routed items by the teacher, spelled the same by decide and serve."""
    p.add_argument("--audit-store", type=store_argument, metavar=STORE_METAVAR,
                   help="label store of the bundle's teacher to keep audits in: a seeded share of the "
                   "routed items (--audit-share) is answered by the teacher on every bundle question, "
                   "stored there (state, teacher labels, the system's answers) and watched by an "
                   "anytime-valid drift alarm per question, over every writer's audits in the store's "
                   "order; a postgresql:// URL lets replicas share one store and one watch (default: no "
                   "audit)")
    p.add_argument("--audit-share", type=share, default=0.02, metavar="F",
                   help="share of routed items audited, in [0, 1] (default 0.02; 0: none)")
    p.add_argument("--audit-seed", default="audit", metavar="TEXT",
                   help="seed of the audit sample (default 'audit')")
    p.add_argument("--on-drift", choices=("demote", "alarm"), default="demote",
                   help="when a question's drift alarm rises: demote it (its answers come from the "
                   "teacher, marked demoted, until a calibration certifies it again; default), or only "
                   "report it")


def add_accept_other_teacher_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept-other-teacher", action="store_true",
                   help="run --teacher even if it is not the model the bundle's labels came from "
                   "(another sha256 or prompt version); every answer is then marked certified=false")


def teacher_argument(text: str) -> str | Path:
    """A ``--teacher`` value: an http(s) URL of a System One endpoint stays text (a Path would fold
    its "//"; its scheme in lower case, as httpx takes it), anything else is a GGUF's path; a URL of
    another scheme is refused, redacted (taken as a path, it was echoed whole, password and all)."""
    from cascade.errors import CascadeError
    from cascade.teachers.settings import url_or_path

    if not text.strip():  # a Path("") is "."; ray-config wrote --teacher . and said "on CPU"
        raise argparse.ArgumentTypeError("is empty; give a GGUF's path or an http(s)://.../v1/systemone URL")
    try:
        return url_or_path(text)
    except CascadeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


EVIDENCE = ("corpus", "traffic", "all")
"""Where the labelled items that certify come from, named the same by ``calibrate`` and ``retrain``:
the corpus's held-out calibration part, uniform draws of live traffic answered by the teacher (the
audits, and with ``retrain`` the collected traffic too), or both pooled. Never escalations: the
cascade chose them."""
OLD_EVIDENCE = {"calibration": "corpus", "audit": "traffic", "both": "all"}
"""``calibrate --calibrate-on``'s values before they were named as ``retrain`` names them."""


def add_calibrate_on_argument(p: argparse.ArgumentParser, default: str, traffic: str) -> None:
    """``--calibrate-on`` in ``EVIDENCE``'s words (the old ones still taken, with a warning);
    ``traffic`` says which traffic records the command reads."""
    p.add_argument("--calibrate-on", type=renamed_values("--calibrate-on", OLD_EVIDENCE), choices=EVIDENCE,
                   default=default,
                   help="which held-out labelled items certify: corpus (the corpus items of the bundle's "
                   f"calibration part), traffic ({traffic}), or all of them pooled, which certifies the "
                   f"mixture: choose it where both come from one distribution (default {default})")
