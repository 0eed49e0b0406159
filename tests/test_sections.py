"""The manifest's calibration and training sections are typed: a malformed one is refused when the
bundle loads, naming the field, and a bundle loads and saves back without keys added."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bundles import MIDDLE, manifest_json, write_bundle

from cascade.bundle.manifest import Bundle, BundleError
from cascade.bundle.sections import CalibrationSection, TrainingSection

COSTS = {MIDDLE: {"seconds_per_state": 0.002, "seconds_per_token": 1e-5}}
TRAINING = {"C": 1.0, "ngrams": True, "min_train_labels": 10, "labelled_items": 40, "new_embeddings": 0,
            "embedding_cache": "/tmp/cache.sqlite", "text_field": "body"}


@pytest.mark.parametrize(("section", "value", "message"), [
    ("calibration", {"costs": {MIDDLE: {"seconds_per_state": "fast", "seconds_per_token": 0.0}}},
     r"calibration\.costs\.small\.seconds_per_state: Input should be a valid number"),
    ("calibration", {"costs": {MIDDLE: {"seconds_per_state": -1.0, "seconds_per_token": 0.0}}},
     r"calibration\.costs\.small\.seconds_per_state: Value error, must be a finite number >= 0"),
    ("calibration", {"costs": {MIDDLE: {"seconds_per_state": 0.001}}},
     r"calibration\.costs\.small\.seconds_per_token: Field required"),
    ("calibration", {"flops_per_second": 0}, r"calibration\.flops_per_second: Value error, must be a "
     r"finite number > 0"),
    ("calibration", {"flops_per_second": True}, r"calibration\.flops_per_second: Input should be a valid"),
    ("calibration", {"target": "0.98"}, r"calibration\.target: Input should be a valid number"),
    ("calibration", {"mode": "cheap"}, r"calibration\.mode: Input should be 'agreement' or 'budget'"),
    ("calibration", {"questions": {"urgent": {MIDDLE: {"temperature": 1.0}}}},
     r"calibration\.questions\.urgent\.small\.threshold: Field required"),
    ("calibration", {"cost": COSTS}, r"calibration\.cost: Extra inputs are not permitted"),
    ("training", {"C": "strong"}, r"training\.C: Input should be a valid number"),
    ("training", {"ngrams": 1}, r"training\.ngrams: Input should be a valid boolean"),
    ("training", {"text_feld": "body"}, r"training\.text_feld: Extra inputs are not permitted"),
])
def test_a_malformed_section_is_refused_naming_the_field(tmp_path: Path, section: str, value: dict,
                                                          message: str) -> None:
    directory = write_bundle(tmp_path / "bundle", **{section: value})
    with pytest.raises(BundleError, match=message):
        Bundle.load(directory)


def test_sections_are_read_typed(tmp_path: Path) -> None:
    facts = {"n": 100, "n_temperature": 30, "n_threshold": 100, "temperature": 0.8,
             "temperature_note": None, "ece_before": 0.1, "ece_after": 0.05, "threshold": 0.9,
             "kept_share": 0.6, "agreement": 0.99, "agreement_kept": 0.98, "lower_bound": 0.985,
             "reachable": True, "message": "keeps 60.0%", "method": "ltt", "target": 0.98, "delta": 0.05}
    calibration = {"target": 0.98, "costs": COSTS, "flops_per_second": 2e11,
                   "questions": {"urgent": {MIDDLE: facts}}}
    manifest = Bundle.load(write_bundle(tmp_path / "b", calibration=calibration,
                                        training=TRAINING)).manifest
    assert isinstance(manifest.calibration, CalibrationSection)
    assert isinstance(manifest.training, TrainingSection)
    assert manifest.calibration.costs[MIDDLE].seconds_per_token == 1e-5
    urgent = manifest.calibration.facts("urgent", MIDDLE)
    assert urgent is not None and urgent.threshold == 0.9
    assert manifest.calibration.facts("team", MIDDLE) is None
    assert manifest.training.text_field == "body"
    # what older bundles lack reads as what they did: one question's delta each, all items labelled
    assert (manifest.calibration.family_wise, manifest.calibration.family_size,
            manifest.calibration.unlabelled_items) == (False, 1, 0)


@pytest.mark.parametrize("calibration", [
    {},  # fresh from training
    {"mode": "agreement", "target": 0.9, "costs": COSTS},  # calibrated before family_wise existed
])
def test_saving_a_bundle_adds_no_keys_to_its_sections(tmp_path: Path, calibration: dict[str, Any]) -> None:
    directory = write_bundle(tmp_path / "b", calibration=calibration, training=TRAINING)
    Bundle.load(directory).save()
    written = manifest_json(directory)
    assert (written["calibration"], written["training"]) == (calibration, TRAINING)
    assert json.dumps(written["calibration"]) == json.dumps(calibration)
