"""Bundles with no model to run, written in milliseconds: a pinned stand-in file as a GGUF middle
tier and an external teacher, for tests of the manifest and the tier registry that must not
load llama.cpp or ONNX Runtime."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cascade.bundle.manifest import Manifest, ModelFile, SplitInfo, TeacherInfo
from cascade.pins import write_json_file
from cascade.tiers.external import ExternalSpec
from cascade.tiers.gguf import GgufSpec

QUESTIONS = {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
             "team": {"type": "choice", "instructions": "Which team?",
                      "criteria": {"billing": "Payments", "technical": "Bugs"}}}
MIDDLE, TOP = "small", "teacher"


def write_bundle(directory: Path, **fields: Any) -> Path:
    """A bundle ``small`` (GGUF kind, pinning a file of a few bytes) -> ``teacher`` (external), with
    the manifest's ``fields`` replaced; returns its folder."""
    directory.mkdir(parents=True, exist_ok=True)
    stand_in = directory.parent / f"{directory.name}-stand-in.gguf"
    stand_in.write_bytes(b"not a model: the registry's stand-in kind never opens it")
    manifest = Manifest(
        name=directory.name, created_at=datetime.now(timezone.utc), questions=QUESTIONS,
        tiers=[GgufSpec(name=MIDDLE, model=ModelFile.of(stand_in)), ExternalSpec(name=TOP, labels="tests")],
        thresholds={qid: {MIDDLE: None} for qid in QUESTIONS},
        teacher=TeacherInfo(kind="external", model="tests"),
        split=SplitInfo(fractions={"train": 0.5, "calibration": 0.25, "evaluation": 0.25}, salt="s",
                        file=write_json_file(directory, "split.json", {"train": [], "calibration": [],
                                                                       "evaluation": []})),
    )
    data = manifest.model_dump(mode="json") | fields
    (directory / "manifest.json").write_text(json.dumps(data), encoding="utf-8")
    return directory


def manifest_json(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "manifest.json").read_text(encoding="utf-8")))
