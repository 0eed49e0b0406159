"""The fine-tuned encoder tier (``cascade train --finetune``) on the real float MiniLM.

Needs the ``finetune`` extra (torch 2.13.0 CPU, the float MiniLM); without it the module skips,
and ``.ci/run`` installs the extra and runs this file on its own, failing if it skips. Training
is kept tiny (the generated corpus's train part, one or two short epochs) so that the file runs
in about a minute on two cores; what is tested is the plumbing and its guarantees, not quality,
which bench/finetune.py measures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from corpora import HEADED, QUESTIONS, copy_bundle, corpus_items, train

from cascade.bundle.manifest import SCHEMA_VERSION, Bundle, BundleError, BundleFile
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder, default_encoder_files
from cascade.encoder.onnx_header import weight_precision, weight_types
from cascade.errors import RouterError
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from distill.calibration.options import CalibrationOptions
from distill.calibration.run import calibrate_bundle
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore
from distill.training.finetune import FinetuneConfig, finetune_body
from distill.training.finetune_base import FinetuneError, Targets
from distill.training.onnx_export import PARITY_MIN_COSINE, export_int8

TINY = FinetuneConfig(epochs=2, batch_size=16, max_length=64, seed=3, threads=1)
REPRODUCIBLE_ATOL = 1e-5
"""Two runs with one seed and one thread give the same weights to float32 rounding (measured:
identical); a larger drift means something unseeded crept into training."""


@pytest.fixture(scope="module")
def tuned_bundle(tmp_path_factory: pytest.TempPathFactory, labelled: tuple[Path, Path],
                 encoder: Encoder, embedding_cache: Path) -> Bundle:
    directory = tmp_path_factory.mktemp("tuned") / "bundle"
    return train(*labelled, directory, encoder, embedding_cache, finetune=TINY)


def department_targets(n: int) -> tuple[list[str], dict[str, Targets]]:
    items = corpus_items()[:n]
    keys = QUESTIONS["department"].option_keys()
    probs = np.array([[item.labels["department"][key] for key in keys] for item in items])
    return [item.text for item in items], {"department": Targets(probs)}


def test_a_fine_tuned_bundle_pins_its_encoder_and_routes_from_anywhere(
    tuned_bundle: Bundle, labelled: tuple[Path, Path], tmp_path: Path
) -> None:
    tier = tuned_bundle.manifest.encoder_tier
    assert tier is not None and isinstance(tier.model, BundleFile)
    facts = tuned_bundle.manifest.training.finetune
    assert facts is not None and facts.parity is not None
    assert facts.parity.min_cosine >= PARITY_MIN_COSINE
    assert 1 <= facts.best_epoch <= len(facts.epochs) <= TINY.epochs
    moved = copy_bundle(tuned_bundle, tmp_path / "moved")
    with LabelStore.open_existing(labelled[1]) as store:
        calibrate_bundle(moved, CorpusInput(labelled[0]), store, CalibrationOptions(target=0.9, delta=0.1),
                         run=RunOptions(progress=False))
        labels = {qid: store.labels(qid) for qid in HEADED}
    items = [Item(item.id, item.text) for item in corpus_items()[:30]]
    with Cascade.load(moved.directory, labels=labels) as cascade:
        responses = cascade.decide_batch(items, questions=list(HEADED))
        assert cascade.tiers[0].encoder.files.model.parent == moved.directory  # type: ignore[attr-defined]
    tiers = [answer.routing.tier for response in responses for answer in response.answers.values()
             if answer.routing is not None]
    assert "encoder" in tiers
    for response in responses:
        for answer in response.answers.values():
            assert sum(answer.probabilities.values()) == pytest.approx(1.0, abs=1e-6)


@pytest.fixture(scope="module")
def calibrated_tuned(tuned_bundle: Bundle, labelled: tuple[Path, Path],
                     tmp_path_factory: pytest.TempPathFactory) -> tuple[Bundle, dict[str, Any]]:
    """A calibrated copy of the fine-tuned bundle, and the labels that replay its teacher."""
    copy = copy_bundle(tuned_bundle, tmp_path_factory.mktemp("calibrated") / "bundle")
    with LabelStore.open_existing(labelled[1]) as store:
        calibrate_bundle(copy, CorpusInput(labelled[0]), store, CalibrationOptions(target=0.9, delta=0.1),
                         run=RunOptions(progress=False))
        labels = {qid: store.labels(qid) for qid in HEADED}
    return Bundle.load(copy.directory), labels


def test_a_fine_tuned_export_gives_a_text_the_same_vector_alone_and_in_any_batch(
    tuned_bundle: Bundle,
) -> None:
    """Tolerance 0, as for the shipped encoder (test_encoder.py). The export's dynamic int8
    scales activations over a whole call, so the same model run in batches moves vectors: the
    second half shows that this test would catch an encoder that batched it."""
    tier = tuned_bundle.manifest.encoder_tier
    assert tier is not None
    texts = [item.text for item in corpus_items()[:24]]
    tuned = Encoder(tier.files(tuned_bundle.directory), batch_size=8, threads=1)
    side_by_side = Encoder(tier.files(tuned_bundle.directory), batch_size=8, threads=2)
    assert tuned.texts_alone and side_by_side.texts_alone
    alone = np.stack([tuned.encode([text])[0] for text in texts])
    np.testing.assert_array_equal(tuned.encode(texts), alone)
    np.testing.assert_array_equal(side_by_side.encode([*reversed(texts), *texts])[len(texts):], alone)
    batched = tuned._encode_batch(tuned._tokenize(texts))  # the same model, one call for all
    assert float(np.abs(batched - alone).max()) > 1e-3


def test_the_exports_weight_types_are_read_as_the_onnx_package_reads_them(tuned_bundle: Bundle) -> None:
    """``cascade.encoder.onnx_header`` walks the protobuf itself (the runtime has no ``onnx``): checked
    here, where the fine-tune's extra brings ``onnx``, on a file the project wrote."""
    import onnx

    tier = tuned_bundle.manifest.encoder_tier
    assert tier is not None
    path = tier.files(tuned_bundle.directory).model
    names = {"FLOAT": "fp32", "INT8": "int8", "UINT8": "uint8", "INT64": "int64", "INT32": "int32",
             "FLOAT16": "fp16", "BOOL": "bool"}
    expected = Counter(names[onnx.TensorProto.DataType.Name(t.data_type)]
                       for t in onnx.load(path).graph.initializer)
    assert weight_types(path) == expected
    assert weight_precision(path) == ("int8" if expected["int8"] or expected["uint8"] else "fp32")


def test_vectors_of_a_model_run_texts_alone_are_cached_apart(tuned_bundle: Bundle, tmp_path: Path) -> None:
    """Caches written before held vectors computed in batches: they are never read back."""
    tier = tuned_bundle.manifest.encoder_tier
    assert tier is not None
    tuned = Encoder(tier.files(tuned_bundle.directory), threads=1)
    assert EmbeddingCache(tmp_path, tuned).path.name.endswith("-alone.sqlite")
    assert not EmbeddingCache(tmp_path, Encoder(threads=1)).path.name.endswith("-alone.sqlite")


def test_a_fine_tuned_bundle_routes_a_state_alike_alone_and_in_a_batch(
    calibrated_tuned: tuple[Bundle, dict[str, Any]],
) -> None:
    bundle, labels = calibrated_tuned
    items = [Item(item.id, item.text) for item in corpus_items()[:24]]
    with Cascade.load(bundle.directory, labels=labels) as cascade:
        batched = cascade.decide_batch(items, questions=list(HEADED))
        alone = [cascade.decide_batch([item], questions=list(HEADED))[0] for item in items]
    routes = [[(qid, a.routing.tier, a.routing.raw_score) for qid, a in r.answers.items() if a.routing]
              for r in (*batched, *alone)]
    assert routes[: len(items)] == routes[len(items):]
    assert any(tier == "encoder" for route in routes for _, tier, _ in route)


def test_a_bundle_calibrated_on_batch_dependent_vectors_is_refused_until_calibrated_again(
    calibrated_tuned: tuple[Bundle, dict[str, Any]], labelled: tuple[Path, Path], tmp_path: Path
) -> None:
    """A schema-2 bundle with a fine-tuned int8 encoder was calibrated on batched vectors."""
    bundle, labels = calibrated_tuned
    old = copy_bundle(bundle, tmp_path / "old")
    manifest = json.loads((old.directory / "manifest.json").read_text())
    (old.directory / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 2}))
    with pytest.raises(RouterError, match=r"schema 2\) was calibrated on vectors of encoder.onnx that "
                       r"depended on their batch .* run `cascade calibrate` on the bundle again"):
        Cascade.load(old.directory, labels=labels)
    with LabelStore.open_existing(labelled[1]) as store:
        calibrate_bundle(Bundle.load(old.directory), CorpusInput(labelled[0]), store,
                         CalibrationOptions(target=0.9, delta=0.1), run=RunOptions(progress=False))
    with Cascade.load(old.directory, labels=labels) as cascade:
        assert cascade.manifest.schema_version == SCHEMA_VERSION


def test_the_fine_tuned_encoder_is_not_the_frozen_one(tuned_bundle: Bundle, encoder: Encoder) -> None:
    tier = tuned_bundle.manifest.encoder_tier
    assert tier is not None
    tuned = Encoder(tier.files(tuned_bundle.directory), threads=1)
    texts = [item.text for item in corpus_items()[:20]]
    cosine = np.sum(tuned.encode(texts) * encoder.encode(texts), axis=1)
    assert cosine.min() < 0.99


def test_a_changed_fine_tuned_encoder_file_is_refused(tuned_bundle: Bundle, tmp_path: Path) -> None:
    copy = copy_bundle(tuned_bundle, tmp_path / "copy")
    tier = copy.manifest.encoder_tier
    assert tier is not None and isinstance(tier.model, BundleFile)
    with (copy.directory / tier.model.name).open("ab") as handle:
        handle.write(b"\0")
    with pytest.raises(BundleError, match="sha256"):
        Bundle.load(copy.directory)


def test_one_seed_gives_the_same_encoder_and_another_seed_does_not() -> None:
    texts, targets = department_targets(60)
    tokenizer = default_encoder_files().tokenizer
    small = FinetuneConfig(epochs=1, batch_size=16, max_length=48, threads=1, seed=5)
    first, _ = finetune_body(texts, targets, tokenizer, small, progress=False)
    again, _ = finetune_body(texts, targets, tokenizer, small, progress=False)
    other, _ = finetune_body(texts, targets, tokenizer,
                             FinetuneConfig(**{**small.__dict__, "seed": 6}), progress=False)
    weights = [dict(body.state_dict()) for body in (first, again, other)]
    drift = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    moved = max(float((weights[0][k] - weights[2][k]).abs().max()) for k in weights[0])
    assert drift <= REPRODUCIBLE_ATOL
    assert moved > 1e-4


def test_a_broken_export_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    texts, targets = department_targets(40)
    tokenizer = default_encoder_files().tokenizer
    body, _ = finetune_body(texts, targets, tokenizer,
                            FinetuneConfig(epochs=1, max_length=32, threads=1), progress=False)
    import torch

    with torch.no_grad():  # weights far outside what int8 with one scale per channel can hold
        for layer in body.encoder.layer:
            layer.intermediate.dense.weight[:, 0] = 1e4
    out = tmp_path / "encoder.onnx"
    with pytest.raises(FinetuneError, match="int8 export moves a vector"):
        export_int8(body, tokenizer, out, texts[:10], 64)
    assert list(tmp_path.iterdir()) == []


def test_settings_that_would_train_nothing_are_refused() -> None:
    for bad in ({"epochs": 0}, {"batch_size": 0}, {"body_learning_rate": -1.0}, {"held_out": 0.6}):
        with pytest.raises(FinetuneError):
            FinetuneConfig(**bad).check()  # type: ignore[arg-type]
    texts, targets = department_targets(10)
    with pytest.raises(FinetuneError, match="at least 20"):
        finetune_body(texts, targets, default_encoder_files().tokenizer, progress=False)


def cli_train(labelled: tuple[Path, Path], questions: Path, bundle: Path, *extra: str) -> list[str]:
    corpus, store = labelled
    return [sys.executable, "-m", "distill.cli", "train", "--questions", str(questions), "--corpus",
            str(corpus), "--store", str(store), "--bundle", str(bundle), *extra]


def write_questions(path: Path) -> Path:
    path.write_text(json.dumps({"questions": {q: v.model_dump(mode="json") for q, v in QUESTIONS.items()}}))
    return path


def test_a_killed_fine_tune_leaves_the_old_bundle_whole(labelled: tuple[Path, Path], tmp_path: Path) -> None:
    questions, bundle = write_questions(tmp_path / "q.json"), tmp_path / "bundle"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    subprocess.run(cli_train(labelled, questions, bundle, *cache), check=True, capture_output=True)
    before, files = (bundle / "manifest.json").read_bytes(), sorted(p.name for p in bundle.iterdir())
    log = (tmp_path / "stderr").open("w")
    process = subprocess.Popen(cli_train(labelled, questions, bundle, *cache, "--finetune"),
                               stderr=log, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while "fine-tune epoch" not in (tmp_path / "stderr").read_text() and time.monotonic() < deadline:
        assert process.poll() is None, (tmp_path / "stderr").read_text()
        time.sleep(0.2)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert (bundle / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in bundle.iterdir()) == files
    Bundle.load(bundle)


BLOCK_TORCH = """\
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("No module named 'torch'")
sys.meta_path.insert(0, NoTorch())
"""
"""Makes ``import torch`` fail as it does where the extra is not installed."""


def test_without_torch_the_command_says_how_to_install_it(labelled: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    questions = write_questions(tmp_path / "q.json")
    argv = cli_train(labelled, questions, tmp_path / "bundle", "--finetune")[3:]
    code = (BLOCK_TORCH + "from distill.cli import main\n"
            f"sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "-e '.[finetune]'" in done.stderr
    assert not (tmp_path / "bundle").exists()
