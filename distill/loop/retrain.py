"""Retraining a serving bundle on everything its label store holds, into a new bundle, calibrated
on held-out evidence (``cascade retrain``).

The store is the serving cascade's: corpus labels, audits, and as serving grows its escalations
and collected traffic (``distill.loop.evidence``). Every labelled state is counted once; the store's
teacher must be the bundle's (a certificate names one teacher); the new bundle's fast tier is
trained (frozen encoder, or fine-tuned) on its train part and certified on its calibration part,
which never trained it. The parts are placed as the serving bundle's were (a hash of the id with
its salt, so an item keeps its part as traffic grows), except that what can only train goes to
the train part: escalations the serving cascade chose (they may not certify; a census escalation,
which it did not choose, is placed like an audit: ``distill.loop.evidence``) and anything
the serving bundle itself trained on (so that ``distill.loop.promote`` can weigh both bundles on the
same held-out items). Of the calibration part, the origins ``calibrate_on`` names certify.

The new bundle holds ``evidence.jsonl`` (the states, which calibration and the promotion gate
read) and ``lineage.json`` (its parent, the evidence's counts, and the ids that certified).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cascade.bundle.manifest import Bundle
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import CascadeError
from cascade.hashing import file_sha256
from cascade.locks import exclusive
from cascade.tiers.gguf import GgufSpec
from cascade.tiers.mid_layer import MidLayerSpec
from distill.calibration.inputs import check_teacher
from distill.calibration.options import TEACHER_ITEMS, CalibrationOptions
from distill.calibration.results import CalibrationResult, Certificate
from distill.calibration.run import calibrate_bundle
from distill.loop.evidence import CERTIFYING, Evidence, EvidenceItem, gather
from distill.options import CorpusInput, RunOptions, option
from distill.store import LabelStore
from distill.training.finetune import FinetuneConfig
from distill.training.mid_layer import MidLayerConfig
from distill.training.run import train_bundle
from distill.training.split import PARTS, part_of

EVIDENCE_NAME = "evidence.jsonl"
LINEAGE_NAME = "lineage.json"


class RetrainError(CascadeError, ValueError):
    """A retrain cannot start: the store's teacher differs, the output is the serving bundle."""


@dataclass(frozen=True)
class RetrainResult:
    """The new bundle, calibrated; the evidence it was made from; its lineage as written."""

    bundle: Bundle
    evidence: Evidence
    calibration: CalibrationResult
    lineage: dict[str, Any]


def retrain_bundle(serving: Bundle, store: LabelStore, out: Path, corpus: CorpusInput | None = None, *,
                   finetune: FinetuneConfig | None = None, target: float | None = None,
                   delta: float | None = None, calibrate_on: str = "all", certificate: Certificate = "joint",
                   run: RunOptions | None = None, encoder: Encoder | None = None,
                   teacher_items: int = TEACHER_ITEMS) -> RetrainResult:
    """Train a new bundle at ``out`` on every labelled state ``store`` holds and calibrate it.

    ``corpus``: the corpus of the store's corpus labels (needed where it holds any); ``target`` and
    ``delta``: the serving bundle's by default (the delta its promotion gate was asked for, where a
    gate certified it at a share of it), so that ``distill.loop.promote`` compares like with like;
    ``calibrate_on``: which origins certify (``distill.loop.evidence.CERTIFYING``: all uniform
    draws, traffic only, or the corpus only). The rest as ``train_bundle`` and
    ``calibrate_bundle`` take them.
    """
    run = option("retrain_bundle", "run", run, RunOptions, RunOptions())
    if calibrate_on not in CERTIFYING:
        raise RetrainError(f"calibrate_on must be one of {', '.join(CERTIFYING)}; got {calibrate_on!r}")
    out = Path(out)
    if out.resolve() == serving.directory.resolve():
        raise RetrainError(f"--out {out} is the serving bundle; retrain into a new folder and let "
                           "`cascade promote` swap it in if it certifies more")
    try:
        check_teacher(serving.manifest, store)
    except CascadeError as exc:
        raise RetrainError(str(exc)) from None
    manifest = serving.manifest
    questions = manifest.parsed_questions()
    evidence = gather(store, questions, corpus, manifest.training.text_field)
    parts = place(evidence, serving)
    held = sorted(set(parts["calibration"]) & evidence.ids(CERTIFYING[calibrate_on]))
    if not held:
        raise RetrainError(f"none of the {len(parts['calibration'])} calibration-part items is of an origin "
                           f"that certifies under calibrate_on={calibrate_on!r} ({dict(evidence.origins)} "
                           "in all); audit more traffic, or certify on another origin")
    target = target if target is not None else manifest.calibration.target or 0.98
    section = manifest.calibration  # a promoted bundle's delta is the gate's share: ask its whole
    delta = delta if delta is not None else section.asked_delta or section.delta or 0.05
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out.parent / f".{out.name}.retrain.lock", _busy(out)):
        return _retrain_into(serving, store, out, evidence, parts, held, run, finetune, encoder,
                             CalibrationOptions(target=target, delta=delta, certificate=certificate,
                                                held_out=held, teacher_items=teacher_items,
                                                accept_degenerate_teacher=bool(section.degenerate_accepted)),
                             calibrate_on)


def _busy(out: Path) -> Callable[[str], RetrainError]:
    return lambda holder: RetrainError(f"another retrain (pid {holder}) is writing {out} now; wait for it, "
                                       "or give another --out")


def _retrain_into(serving: Bundle, store: LabelStore, out: Path, evidence: Evidence,
                  parts: dict[str, list[str]], held: list[str], run: RunOptions,
                  finetune: FinetuneConfig | None, encoder: Encoder | None, options: CalibrationOptions,
                  calibrate_on: str) -> RetrainResult:
    """Train, calibrate and record the lineage under the lock of ``out``: the whole of one run lands
    there, never one run's calibration on another's training."""
    manifest = serving.manifest
    questions = manifest.parsed_questions()
    written = evidence.write(evidence_beside(out))
    training = replace(run, placement=None, flops_per_second=None)  # what training takes of it
    try:
        bundle = train_bundle(questions, CorpusInput(written), store, out, encoder, manifest.split.fractions,
                              manifest.training.C or 1.0, run=training, finetune=finetune, parts=parts,
                              ngrams=manifest.training.ngrams is not False, **_tiers_of(serving))
        os.replace(written, out / EVIDENCE_NAME)
    except BaseException:  # refused or stopped: its customer text is not left beside --out
        written.unlink(missing_ok=True)
        raise
    states = CorpusInput(out / EVIDENCE_NAME)
    calibration = calibrate_bundle(bundle, states, store, options, run=run, encoder=encoder)
    evaluated = sorted(set(parts["evaluation"]) & evidence.ids(CERTIFYING[calibrate_on]))
    lineage = _lineage(serving, evidence, parts, held, evaluated, calibrate_on)
    (out / LINEAGE_NAME).write_text(json.dumps(lineage, indent=2) + "\n", encoding="utf-8")
    return RetrainResult(Bundle.load(out), evidence, calibration, lineage)


def evidence_beside(out: Path) -> Path:
    """Where the states are written while ``out`` trains (``.NAME.evidence.jsonl`` beside it, then
    moved in): not a temporary folder, which a killed run leaves with customer text in it where
    nothing looks; here the next retrain of ``out`` writes over it, and ``cascade loop`` removes it
    with a candidate it discards."""
    return out.parent / f".{out.name}.evidence.jsonl"


def place(evidence: Evidence, serving: Bundle) -> dict[str, list[str]]:
    """Each item's part: by a hash of its id with the serving bundle's fractions and salt, except
    the escalations the serving cascade chose and what the serving bundle trained on, which train."""
    split = serving.manifest.split
    trained = set(serving.split_ids().get("train", []))
    parts: dict[str, list[str]] = {part: [] for part in PARTS}
    for item in evidence.items:
        parts[_part(item, trained, split.fractions, split.salt)].append(item.id)
    return parts


def _part(item: EvidenceItem, trained: set[str], fractions: Mapping[str, float], salt: str) -> str:
    if item.origin == "escalation" or item.id in trained:
        return "train"
    return part_of(item.id, fractions, salt)


def _tiers_of(serving: Bundle) -> dict[str, Any]:
    """``train_bundle``'s arguments that rebuild the serving bundle's other tiers: its middle GGUF
    tiers as they are, its mid-layer tier trained again, its teacher pinned again where it was (a
    GGUF given at load, as the demo's bundle's, stays so)."""
    tiers = serving.manifest.tiers
    top = tiers[-1]
    middle: Sequence[GgufSpec] = [tier for tier in tiers[1:-1] if isinstance(tier, GgufSpec)]
    mids = [tier for tier in tiers[1:-1] if isinstance(tier, MidLayerSpec)]
    mid_layer = None if not mids else MidLayerConfig(layer=mids[0].layer, reader=mids[0].reader,
                                                     placement=mids[0].placement, n_ctx=mids[0].n_ctx,
                                                     name=mids[0].name)
    teacher = Path(top.model.path) if isinstance(top, GgufSpec) else None
    return {"middle": middle, "mid_layer": mid_layer, "teacher_model": teacher,
            "teacher_placement": top.placement if isinstance(top, GgufSpec) else None,
            "pin_teacher": isinstance(top, GgufSpec)}


def _lineage(serving: Bundle, evidence: Evidence, parts: Mapping[str, list[str]], held: list[str],
             evaluated: list[str], calibrate_on: str) -> dict[str, Any]:
    """What the new bundle came from: its parent's version, the evidence, the ids that certified,
    and the uniform draws of the evaluation part (which ``distill.loop.promote`` also weighs)."""
    manifest = serving.manifest
    return {
        "parent": {"name": manifest.name, "path": str(serving.directory.resolve()),
                   "manifest_sha256": file_sha256(serving.directory / "manifest.json"),
                   "calibration_version": manifest.calibration.version()},
        "evidence": {"items": len(evidence.items), "duplicates": evidence.duplicates,
                     "origins": dict(evidence.origins), "parts": {p: len(ids) for p, ids in parts.items()},
                     "certified_on_unequal": evidence.unequal(held)},
        "calibrate_on": calibrate_on, "certified_on": held, "evaluated_on": evaluated,
    }
