"""Promotion with a gate (``cascade promote``): a retrained bundle replaces the serving one only if,
on the same held-out evidence, it certifies at least the serving bundle's share at the same
target and delta.

The evidence is the candidate's: the items that certified it (``lineage.json``, written by
``distill.loop.retrain``), less any the serving bundle trained on, so that neither bundle is judged on
an item it learnt from. Both are certified afresh on those items, as ``cascade calibrate`` does
(same target, delta, certificate), and the share of answers their cheap tiers keep, averaged
over the questions, is compared: the candidate passes when its share is at least the serving
one's. Refused, it stays where it is with the reason in ``promotion.json``. Passed, it is swapped
in as ``cascade serve --bundle PATH`` follows one (``cascade.serve.swap``): where PATH is a link or
a pointer file, PATH is replaced in one rename to name the candidate's folder (each version stays
in its own folder); where PATH is the bundle folder itself, the candidate is copied over it (the
replaced bundle kept beside it as ``NAME.previous``). Either way one line goes to the promotions
log beside PATH (``NAME.promotions.jsonl``): both bundles' versions, when, and the figures
(``latest_promotion`` reads the last one).
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cascade.bundle.manifest import MANIFEST_NAME, Bundle
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import CascadeError
from cascade.hashing import file_sha256
from cascade.serve.swap import resolve
from distill.calibration.results import CalibrationResult
from distill.calibration.run import calibrate_bundle
from distill.loop.retrain import EVIDENCE_NAME, LINEAGE_NAME
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore
from distill.training.run import staged

LOG_SUFFIX = ".promotions.jsonl"
PREVIOUS_SUFFIX = ".previous"
KEPT_ASIDE_NAME = "promotion.json"


class PromoteError(CascadeError, ValueError):
    """Two bundles cannot be compared: another teacher, other questions, no held-out evidence."""


class BundleVersion(BaseModel):
    """Which bundle: its name, folder, manifest hash and calibration version."""

    name: str
    path: str
    manifest_sha256: str
    calibration_version: str

    @classmethod
    def of(cls, bundle: Bundle) -> BundleVersion:
        return cls(name=bundle.manifest.name, path=str(bundle.directory.resolve()),
                   manifest_sha256=file_sha256(bundle.directory / MANIFEST_NAME),
                   calibration_version=bundle.manifest.calibration.version())


class Gate(BaseModel):
    """The figures a promotion is decided on: both bundles certified on the same ``items`` at one
    target and delta; ``excluded``: held-out items of the candidate the serving bundle trained on;
    shares are of answers the cheap tiers keep, per question and averaged."""

    target: float
    delta: float
    certificate: str
    items: int
    excluded: int
    serving_share: float
    candidate_share: float
    shares: dict[str, dict[str, float]]


class Promotion(BaseModel):
    """One decision, as the promotions log keeps it."""

    at: str
    promoted: bool
    serving: BundleVersion
    candidate: BundleVersion
    gate: Gate
    reason: str
    previous: str | None = None


def promotions_log(serving: Path) -> Path:
    """The log beside what ``--bundle`` names: ``models/support`` -> ``models/support.promotions.jsonl``."""
    serving = Path(os.path.abspath(serving))
    return serving.parent / f"{serving.name}{LOG_SUFFIX}"


def latest_promotion(log: Path) -> Promotion | None:
    """The last promotion the log records (refusals skipped), or None: what a server serves."""
    if not Path(log).is_file():
        return None
    lines = [line for line in Path(log).read_text(encoding="utf-8").splitlines() if line.strip()]
    records = [Promotion.model_validate_json(line) for line in lines]
    return next((record for record in reversed(records) if record.promoted), None)


def promote(serving_path: Path, candidate_dir: Path, store: LabelStore, *, run: RunOptions | None = None,
            encoder: Encoder | None = None, log: Path | None = None) -> Promotion:
    """Weigh the candidate against the bundle ``serving_path`` names (a folder, a link to one, or a
    pointer file: ``cascade.serve.swap``) on the candidate's held-out evidence, and swap it in
    where it certifies at least as much; record the decision either way."""
    try:
        serving_dir = resolve(Path(serving_path))
    except CascadeError as exc:
        raise PromoteError(str(exc)) from None
    if serving_dir == Path(candidate_dir).resolve():
        raise PromoteError(f"the candidate {candidate_dir} is the bundle serving already")
    serving, candidate = Bundle.load(serving_dir), Bundle.load(candidate_dir)
    held, excluded = _evidence(serving, candidate)
    target, delta = _level(candidate)
    section = candidate.manifest.calibration
    certificate = section.certificate or "split"
    states = CorpusInput(Path(candidate_dir) / EVIDENCE_NAME)
    results = {name: calibrate_bundle(bundle, states, store, target, delta, run=run, encoder=encoder,
                                      family_wise=section.family_wise, certificate=certificate,
                                      held_out=held, teacher_items=0, save=False)
               for name, bundle in (("serving", serving), ("candidate", candidate))}
    gate = _gate(results, target, delta, certificate, len(held), excluded)
    promoted = gate.candidate_share >= gate.serving_share
    record = Promotion(at=datetime.now(timezone.utc).isoformat(timespec="seconds"), promoted=promoted,
                       serving=BundleVersion.of(serving), candidate=BundleVersion.of(candidate), gate=gate,
                       reason=_reason(gate, promoted))
    if promoted:
        record.previous = str(_swap(Path(serving_path), serving_dir, Path(candidate_dir)))
    else:
        (Path(candidate_dir) / KEPT_ASIDE_NAME).write_text(record.model_dump_json(indent=2) + "\n",
                                                           encoding="utf-8")
    with (log or promotions_log(serving_path)).open("a", encoding="utf-8") as handle:
        handle.write(record.model_dump_json() + "\n")
    return record


def _evidence(serving: Bundle, candidate: Bundle) -> tuple[list[str], int]:
    """The candidate's held-out ids the serving bundle never trained on, and how many it did."""
    lineage_path = candidate.directory / LINEAGE_NAME
    if not lineage_path.is_file() or not (candidate.directory / EVIDENCE_NAME).is_file():
        raise PromoteError(f"{candidate.directory} has no {LINEAGE_NAME} and {EVIDENCE_NAME}: promote a "
                           "bundle made by `cascade retrain`, which holds the evidence it is weighed on")
    ours, theirs = serving.manifest, candidate.manifest
    if ours.teacher != theirs.teacher or ours.questions != theirs.questions:
        raise PromoteError(f"bundles {ours.name!r} and {theirs.name!r} differ in their teacher or their "
                           "questions: a promotion compares certificates about one teacher's answers to "
                           "the same questions; retrain from the serving bundle")
    lineage: dict[str, Any] = json.loads(lineage_path.read_text(encoding="utf-8"))
    trained = set(serving.split_ids().get("train", []))
    certified_on = list(lineage.get("certified_on", []))
    held = [i for i in certified_on if i not in trained]
    if not held:
        raise PromoteError(f"every one of the {len(certified_on)} items that certified {theirs.name!r} "
                           f"trained {ours.name!r}: there is no held-out evidence to weigh them on")
    return held, len(certified_on) - len(held)


def _level(candidate: Bundle) -> tuple[float, float]:
    """The target and delta the candidate was certified at: both bundles are weighed at them."""
    section = candidate.manifest.calibration
    if section.mode != "agreement" or section.target is None or section.delta is None:
        raise PromoteError(f"candidate {candidate.manifest.name!r} is not calibrated for a target "
                           "agreement; calibrate it (cascade retrain does) before promoting it")
    return section.target, section.delta


def _gate(results: dict[str, CalibrationResult], target: float, delta: float, certificate: str, items: int,
          excluded: int) -> Gate:
    shares = {qid: {name: 1.0 - result.cascades[qid].answered_by.get(result.teacher_tier, 1.0)
                    if qid in result.cascades else 0.0 for name, result in results.items()}
              for qid in sorted(set().union(*(result.cascades for result in results.values())))}
    mean = {name: sum(row[name] for row in shares.values()) / max(len(shares), 1) for name in results}
    return Gate(target=target, delta=delta, certificate=certificate, items=items, excluded=excluded,
                serving_share=mean["serving"], candidate_share=mean["candidate"], shares=shares)


def _reason(gate: Gate, promoted: bool) -> str:
    figures = (f"on the same {gate.items} held-out items at target {gate.target} / delta {gate.delta}, the "
               f"candidate's cheap tiers keep {gate.candidate_share:.1%} of answers and the serving "
               f"bundle's {gate.serving_share:.1%}")
    return (f"promoted: {figures}" if promoted else
            f"kept aside: {figures}; a candidate replaces the serving bundle only where it certifies at "
            "least as much")


def _swap(path: Path, serving_dir: Path, candidate_dir: Path) -> Path:
    """Serve the candidate from ``path``; returns where the replaced bundle is. A link or pointer
    file is replaced in one rename; a folder gets the candidate copied over it (its old contents
    kept as NAME.previous beside it)."""
    if path.is_symlink() or path.is_file():
        target = os.path.relpath(candidate_dir.resolve(), path.absolute().parent)
        fresh = path.with_name(f".{path.name}.promoting")
        fresh.unlink(missing_ok=True)
        if path.is_symlink():
            fresh.symlink_to(target, target_is_directory=True)
        else:
            fresh.write_text(target + "\n", encoding="utf-8")
        os.replace(fresh, path)
        return serving_dir
    previous = serving_dir.parent / f"{serving_dir.name}{PREVIOUS_SUFFIX}"
    shutil.rmtree(previous, ignore_errors=True)
    shutil.copytree(serving_dir, previous)
    with staged(serving_dir) as stage:
        shutil.copytree(candidate_dir, stage, dirs_exist_ok=True)
    return previous
