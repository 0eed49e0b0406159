"""The labelled corpus that the training, calibration, routing, evaluation and report tests use,
made by the project itself so that a plain clone of the repository runs every test.

The texts are the demo's generated support messages (``distill.demo.synthetic``), and the generator's
soft labels stand in for the teacher, as in ``cascade demo``. Two questions get a head:
"urgent" (labelled on the first N_URGENT items only, so that a question labelled on part of the
corpus is covered) and "department" (every item). Two get none: "rare" has too few train labels,
and "spam" a single answer. "spam" is never labelled on a calibration item, so calibration skips
it for lack of labels and "rare" for lack of a head.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from cascade.bundle.manifest import Bundle, Manifest
from cascade.encoder.onnx_encoder import Encoder
from cascade.questions import parse_request
from distill.demo.synthetic import QUESTIONS_JSON as DEMO_QUESTIONS
from distill.demo.synthetic import SyntheticItem, generate, write_corpus
from distill.labelling.transfer import import_labels
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore, Teacher
from distill.training.run import middle_tier, train_bundle
from distill.training.split import part_of

N_ITEMS, N_URGENT, N_SPAM, N_RARE_PER_PART = 300, 240, 60, 4
SEED = 0
TEACHER = Teacher(kind="external", model="generator labels")
QUESTIONS_JSON: dict[str, Any] = {
    "urgent": DEMO_QUESTIONS["urgent"],
    "department": DEMO_QUESTIONS["department"],
    "rare": {"type": "noul", "instructions": "Does it mention a rare event?"},
    "spam": {"type": "noul", "instructions": "Is this message spam?"},
}
QUESTIONS = parse_request({"state": "x", "questions": QUESTIONS_JSON}).questions
HEADED = ("urgent", "department")


def corpus_items() -> list[SyntheticItem]:
    """The generated messages, the same on every call (the generator is seeded per item)."""
    return generate(N_ITEMS, SEED)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.open(encoding="utf-8")]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def label_rows(items: list[SyntheticItem], flip: Collection[str] = ()) -> list[dict[str, Any]]:
    """Import rows for the four questions; items in ``flip`` get a wrong teacher answer (their
    probabilities moved one option on), to show which labels a step reads."""
    rows = [_soft(item, "urgent", item.id in flip) for item in items[:N_URGENT]]
    rows += [_soft(item, "department", item.id in flip) for item in items]
    rows += [{"id": i, "question": "rare", "answer": True} for i in _rare_ids(items)]
    outside = [item.id for item in items if part_of(item.id) != "calibration"]
    rows += [{"id": i, "question": "spam", "answer": False} for i in outside[:N_SPAM]]
    return rows


def _soft(item: SyntheticItem, qid: str, flipped: bool) -> dict[str, Any]:
    keys, probs = list(item.labels[qid]), list(item.labels[qid].values())
    if flipped:
        probs = probs[-1:] + probs[:-1]
    return {"id": item.id, "question": qid, "probabilities": dict(zip(keys, probs, strict=True))}


def _rare_ids(items: list[SyntheticItem]) -> list[str]:
    """A few train items (too few for a head) and a few calibration items (so that a middle tier
    calibrates the question on almost nothing)."""
    return [i for part in ("train", "calibration")
            for i in [item.id for item in items if part_of(item.id) == part][:N_RARE_PER_PART]]


def write_training_inputs(root: Path, teacher: Teacher = TEACHER, flip: Collection[str] = ()
                          ) -> tuple[Path, Path]:
    """The corpus and a label store of its labels under ``root``: (corpus path, store path)."""
    items = corpus_items()
    corpus = write_corpus(items, root / "corpus.jsonl")
    with LabelStore(root / "labels.sqlite", teacher) as store:
        import_labels(store, write_jsonl(root / "labels.jsonl", label_rows(items, flip)), QUESTIONS)
    return corpus, root / "labels.sqlite"


def train(corpus: Path, store_path: Path, bundle_dir: Path, encoder: Encoder, cache: Path,
          **kwargs: object) -> Bundle:
    with LabelStore.open_existing(store_path) as store:
        return train_bundle(QUESTIONS, CorpusInput(corpus), store, bundle_dir, encoder=encoder,
                            run=RunOptions(progress=False, cache_dir=cache), **kwargs)  # type: ignore[arg-type]


def copy_bundle(bundle: Bundle, directory: Path) -> Bundle:
    """A copy a test may calibrate or damage, leaving the session's bundle as trained."""
    return Bundle(bundle.manifest, bundle.directory).save(directory)


def copy_with_middle(bundle: Bundle, directory: Path, gguf: Path, name: str, n_ctx: int) -> Bundle:
    """A copy with a GGUF readout tier just below the top (it keeps nothing until calibrated), as
    ``cascade train --middle`` builds one, without training again."""
    data = bundle.manifest.model_dump(mode="json")
    data["tiers"].insert(len(data["tiers"]) - 1, middle_tier(gguf, name, n_ctx).model_dump(mode="json"))
    for qid in data["questions"]:
        data["thresholds"].setdefault(qid, {})[name] = None
        data["temperatures"].setdefault(qid, {})[name] = 1.0
    return Bundle(Manifest.model_validate(data), bundle.directory).save(directory)
