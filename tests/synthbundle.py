"""A small bundle trained on the demo's generated support messages, for calibration and budget tests.

The corpus generator (``distill.demo.synthetic``) stands in for the teacher: its soft labels are
imported into a label store as an external teacher, as ``cascade demo`` does, so these tests
need no data set and no 4B model. ``unlabelled`` items are written to the corpus without labels,
as a teacher that skipped them (over-long, ``--on-error skip``) would leave them.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from cascade.bundle.manifest import Bundle
from cascade.corpus import load_questions
from cascade.encoder.onnx_encoder import Encoder
from distill.demo.synthetic import generate, write_corpus, write_labels, write_questions
from distill.labelling.transfer import import_labels
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore, Teacher
from distill.training.run import train_bundle

TEACHER = Teacher(kind="external", model="synthetic support-v1 labels (tests)")


RARE = {"type": "noul", "instructions": "Does the sender write from the Moon?"}
"""A question the teacher always answers "no": one answer only, so training fits it no head."""


def write_inputs(root: Path, n: int, unlabelled: Collection[int] = (), rare: bool = False
                 ) -> tuple[Path, Path, Path]:
    """(corpus, questions, store) of ``n`` generated items; items at ``unlabelled`` get no label.
    With ``rare``, a fourth question (RARE) that has a label on every item and no head."""
    items = generate(n, seed=7)
    corpus = write_corpus(items, root / "corpus.jsonl")
    kept = [item for i, item in enumerate(items) if i not in unlabelled]
    labels = write_labels(kept, root / "labels.jsonl")
    questions = write_questions(root / "questions.json")
    if rare:
        data = json.loads(questions.read_text(encoding="utf-8"))
        questions.write_text(json.dumps({"questions": {**data["questions"], "rare": RARE}}), encoding="utf-8")
        with labels.open("a", encoding="utf-8") as out:
            out.writelines(json.dumps({"id": item.id, "question": "rare", "answer": False}) + "\n"
                           for item in kept)
    with LabelStore(root / "labels.sqlite", TEACHER) as store:
        import_labels(store, labels, load_questions(questions))
    return corpus, questions, root / "labels.sqlite"


def train(corpus: Path, questions: Path, store_path: Path, directory: Path, encoder: Encoder,
          cache: Path) -> Bundle:
    with LabelStore.open_existing(store_path) as store:
        return train_bundle(load_questions(questions), CorpusInput(corpus), store, directory, encoder=encoder,
                            run=RunOptions(progress=False, cache_dir=cache))


def copy_bundle(bundle: Bundle, directory: Path) -> Bundle:
    """A copy to calibrate or edit: calibration rewrites the bundle it is given."""
    return Bundle(bundle.manifest, bundle.directory, bundle.heads).save(directory)


def corpus_ids(corpus: Path) -> list[str]:
    return [json.loads(line)["id"] for line in corpus.read_text(encoding="utf-8").splitlines()]
