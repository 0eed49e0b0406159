"""The mid-layer tier in a bundle: trained on the teacher's own layer states (gemma stands in for
the teacher), built from the manifest, routed to, and calibrated like any tier; ``auto`` keeps
the layer it measured cheapest; bad arguments get clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from corpora import QUESTIONS, copy_bundle, train, write_training_inputs

from cascade.bundle.manifest import SCHEMA_VERSION, Bundle, Manifest
from cascade.encoder.onnx_encoder import Encoder
from cascade.heads import SoftmaxHead, load_heads
from cascade.questions import DecisionRequest
from cascade.readout.layer_scorer import LetterLens, normalized
from cascade.readout.placement import Placement
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from cascade.tiers.mid_layer import MidLayerSpec, MidLayerTier
from distill.calibration.options import CalibrationOptions
from distill.calibration.run import calibrate_bundle
from distill.cli import main
from distill.labelling.gguf import teacher_of_file
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore
from distill.training.mid_layer import MidLayerConfig, candidate_layers, fit_head, kept_share, train_mid_layer
from distill.training.run import TrainError, train_bundle

LAYER, ITEMS = 9, 30
ONE_THREAD = Placement(threads=1)  # tests share two cores


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, gemma_path: Path) -> tuple[Path, Path]:
    """The generated corpus, its labels filed under gemma as their teacher."""
    return write_training_inputs(tmp_path_factory.mktemp("mid"), teacher=teacher_of_file(gemma_path))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, inputs: tuple[Path, Path], gemma_path: Path,
           encoder: Encoder, embedding_cache: Path) -> Bundle:
    config = MidLayerConfig(layer=LAYER, max_items=ITEMS, placement=ONE_THREAD)
    return train(*inputs, tmp_path_factory.mktemp("bundle") / "b", encoder, embedding_cache,
                 teacher_model=gemma_path, mid_layer=config)


def labels_of(store_path: Path) -> dict[str, dict[str, dict[str, float]]]:
    with LabelStore.open_existing(store_path) as store:
        return {qid: store.labels(qid) for qid in QUESTIONS}


def kept_at(bundle: Bundle, directory: Path, thresholds: dict[str, dict[str, float]]) -> Path:
    data = bundle.manifest.model_dump(mode="json")
    for qid, row in thresholds.items():
        data["thresholds"][qid].update(row)
    Bundle(Manifest.model_validate(data), bundle.directory).save(directory)
    return directory


def test_training_pins_the_teachers_blocks_and_fits_heads_on_them(bundle: Bundle, gemma_path: Path) -> None:
    names = [tier.name for tier in bundle.manifest.tiers]
    assert names == ["encoder", "mid-layer", "teacher"]
    spec = bundle.manifest.tiers[1]
    assert isinstance(spec, MidLayerSpec)
    assert (spec.layer, spec.n_layer, spec.reader) == (LAYER, 18, "head")
    assert spec.model.sha256 == bundle.manifest.tiers[2].model.sha256  # type: ignore[union-attr]
    assert spec.heads_file is not None
    heads = load_heads(bundle.directory / spec.heads_file.name)
    assert set(heads) == {"urgent", "department"}
    assert all(spec.heads[q].train_items <= ITEMS for q in heads)
    rule = (r"only \d+ train labels; a head needs at least 10",
            r"all \d+ train labels answer '\w+'; a head needs two answers")
    for qid in ("rare", "spam"):  # the encoder heads' rule (distill.training.head_rule), said the same way
        assert any(re.fullmatch(reason, spec.heads[qid].skipped or "") for reason in rule)
    assert bundle.manifest.schema_version == SCHEMA_VERSION  # the mid-layer kind needs 5 or newer


def test_a_routed_answer_is_the_tiers_own_reading_of_the_batch_calibration_reads(
        bundle: Bundle, inputs: tuple[Path, Path], tmp_path: Path, embedding_cache: Path) -> None:
    """Kept at the mid-layer tier, an answer is its head on the layer state of the fan-out over
    every question it answers (the batch calibration reads), to the last bit."""
    directory = kept_at(bundle, tmp_path / "v", {"urgent": {"encoder": None, "mid-layer": 0.0}})
    texts = {row["id"]: row["text"] for row in map(json.loads, inputs[0].open(encoding="utf-8"))}
    items = [Item(i, texts[i]) for i in bundle.split_ids()["evaluation"][:3]]
    with Cascade.load(directory, labels=labels_of(inputs[1]), cache_dir=embedding_cache,
                      placement=ONE_THREAD) as cascade:
        tier = cascade.tiers[1]
        assert isinstance(tier, MidLayerTier)
        for item, response in zip(items, cascade.decide_batch(items, None, ["urgent"]), strict=True):
            answer = response.answers["urgent"]
            assert answer.routing.tier == "mid-layer"
            asked = {q: cascade.questions[q] for q in ("urgent", "department")}
            read = tier.scorer.states(DecisionRequest(state=item.state, questions=asked))
            head = tier.reader.heads["urgent"]
            expected = head.predict_proba(normalized(read.vectors["urgent"][LAYER])[None, :])[0]
            assert list(answer.probabilities.values()) == pytest.approx(expected, abs=1e-9)
            assert sum(answer.probabilities.values()) == pytest.approx(1.0)


def test_an_item_gets_the_same_answer_alone_and_in_a_batch_of_items(
        bundle: Bundle, inputs: tuple[Path, Path], tmp_path: Path, embedding_cache: Path) -> None:
    """The tier reads each state on its own (its prompt head copied, never re-decoded), so the
    other items of a call move no number of an item's answer."""
    directory = kept_at(bundle, tmp_path / "v", {"urgent": {"encoder": None, "mid-layer": 0.0}})
    texts = {row["id"]: row["text"] for row in map(json.loads, inputs[0].open(encoding="utf-8"))}
    items = [Item(i, texts[i]) for i in bundle.split_ids()["evaluation"][3:6]]
    with Cascade.load(directory, labels=labels_of(inputs[1]), cache_dir=embedding_cache,
                      placement=ONE_THREAD) as cascade:
        together = cascade.decide_batch(items, None, ["urgent"])
        for item, response in zip(items, together, strict=True):
            alone = cascade.decide_batch([item], None, ["urgent"])[0]
            assert alone.answers["urgent"].probabilities == response.answers["urgent"].probabilities


def test_calibration_certifies_and_measures_the_tier(bundle: Bundle, inputs: tuple[Path, Path],
                                                     encoder: Encoder, tmp_path: Path) -> None:
    copy = copy_bundle(bundle, tmp_path / "c")
    with LabelStore.open_existing(inputs[1]) as store:
        calibrate_bundle(copy, CorpusInput(inputs[0]), store,
                         CalibrationOptions(target=0.8, teacher_items=0, keep_costly_tiers=True),
                         encoder=encoder,
                         run=RunOptions(progress=False, flops_per_second=1e11, placement=ONE_THREAD))
    manifest = Bundle.load(copy.directory).manifest
    cost = manifest.calibration.costs["mid-layer"]
    assert cost.seconds_per_state > 0 or cost.seconds_per_token > 0
    assert "mid-layer" in manifest.thresholds["urgent"]


def test_the_lens_reader_needs_no_training_and_reads_the_models_letters(
        inputs: tuple[Path, Path], gemma_path: Path, encoder: Encoder, embedding_cache: Path,
        tmp_path: Path) -> None:
    lensed = train(*inputs, tmp_path / "lens", encoder, embedding_cache, teacher_model=gemma_path,
                   mid_layer=MidLayerConfig(layer=LAYER, reader="lens"))
    spec = lensed.manifest.tiers[1]
    assert isinstance(spec, MidLayerSpec) and spec.reader == "lens" and spec.heads_file is None
    directory = kept_at(lensed, tmp_path / "v", {"urgent": {"encoder": None, "mid-layer": 0.0}})
    with Cascade.load(directory, labels=labels_of(inputs[1]), cache_dir=embedding_cache,
                      placement=ONE_THREAD) as cascade:
        tier = cascade.tiers[1]
        assert isinstance(tier, MidLayerTier)
        state = "Our payment system is down and customers cannot check out."
        answer = cascade.decide_batch([Item("x", state)], None, ["urgent"])[0].answers["urgent"]
        read = tier.scorer.states(DecisionRequest(state=state, questions=dict(cascade.questions)))
        lens = LetterLens(gemma_path, tier.scorer.letter_ids)
        expected = lens.probabilities(read.vectors["urgent"][LAYER], 2)
        assert list(answer.probabilities.values()) == pytest.approx(expected, abs=1e-9)


def test_auto_keeps_the_layer_it_measured_cheapest(inputs: tuple[Path, Path], gemma_path: Path,
                                                   tmp_path: Path) -> None:
    texts = {row["id"]: row["text"] for row in map(json.loads, inputs[0].open(encoding="utf-8"))}
    labels = labels_of(inputs[1])
    questions = {q: QUESTIONS[q] for q in ("urgent", "department")}
    train_ids = sorted(labels["department"])[:30]
    config = MidLayerConfig(max_items=20, placement=ONE_THREAD)
    spec, sweep = train_mid_layer(config, gemma_path, questions, labels, texts, train_ids, tmp_path,
                                  C=1.0, progress=False)
    assert [c.layer for c in sweep] == candidate_layers(18)
    best = min(sweep, key=lambda c: (c.cost, c.layer))
    assert spec.layer == best.layer
    for candidate in sweep:
        assert candidate.cost == pytest.approx(candidate.layer / 18 + 1 - candidate.kept)
        assert 0 <= candidate.agreement <= 1


def test_train_states_longer_than_the_tiers_context_are_left_out_and_said(
        inputs: tuple[Path, Path], gemma_path: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    texts = {row["id"]: row["text"] for row in map(json.loads, inputs[0].open(encoding="utf-8"))}
    labels = labels_of(inputs[1])
    train_ids = sorted(labels["urgent"])[:20]
    texts |= {i: " ".join([texts[i]] * 60) for i in train_ids[:3]}
    config = MidLayerConfig(layer=LAYER, placement=ONE_THREAD, n_ctx=256)
    with caplog.at_level("WARNING", logger="cascade"):
        spec, _ = train_mid_layer(config, gemma_path, {"urgent": QUESTIONS["urgent"]}, labels, texts,
                                  train_ids, tmp_path, C=1.0, progress=False)
    assert spec.heads["urgent"].train_items == 17
    assert f"3 of 20 train states do not fit its context (n_ctx 256; first: {train_ids[0]!r})" in caplog.text


def test_kept_share_is_the_largest_prefix_by_margin_at_the_target() -> None:
    """Margins 0.9 .. 0.4; agreements 1 1 1 0 1 0: the running agreement is 1 1 1 .75 .8 .67."""
    probs = np.array([[0.95, 0.05], [0.9, 0.1], [0.85, 0.15], [0.8, 0.2], [0.75, 0.25], [0.7, 0.3]])
    teacher = np.array([0, 0, 0, 1, 0, 1])
    assert kept_share(probs, teacher, 0.75) == pytest.approx(5 / 6)
    assert kept_share(probs, teacher, 0.9) == pytest.approx(3 / 6)
    assert kept_share(probs[3:4], teacher[3:4], 0.5) == 0.0


def test_bad_mid_layer_arguments_get_clear_errors(inputs: tuple[Path, Path], gemma_path: Path,
                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"questions": {"urgent": QUESTIONS["urgent"].model_dump(mode="json")}}))
    common = ["train", "--questions", str(questions), "--corpus", str(inputs[0]), "--store", str(inputs[1]),
              "--bundle", str(tmp_path / "b"), "--teacher-model", str(gemma_path)]
    assert main([*common, "--mid-layer-items", "20"]) == 2
    assert "add --mid-layer L or --mid-layer auto" in capsys.readouterr().err
    assert main([*common, "--mid-layer", "18"]) == 2
    assert "has 18 blocks; --mid-layer runs fewer than all, at most 17" in capsys.readouterr().err
    external = write_training_inputs(tmp_path / "ext")
    with LabelStore.open_existing(external[1]) as store, pytest.raises(TrainError, match="is external"):
        train_bundle(QUESTIONS, CorpusInput(external[0]), store, tmp_path / "e",
                     mid_layer=MidLayerConfig(layer=3))


def test_train_prints_the_sweep_auto_measured_and_the_tier_it_kept(
        inputs: tuple[Path, Path], gemma_path: Path, embedding_cache: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"questions": {q: QUESTIONS[q].model_dump(mode="json")
                                                   for q in ("urgent", "department")}}))
    assert main(["train", "--questions", str(questions), "--corpus", str(inputs[0]),
                 "--store", str(inputs[1]), "--bundle", str(tmp_path / "b"),
                 "--teacher-model", str(gemma_path), "--cache-dir", str(embedding_cache),
                 "--mid-layer", "auto", "--mid-layer-items", "20"]) == 0
    out = capsys.readouterr().out
    assert out.count("estimated cost") == len(candidate_layers(18))
    layer = Bundle.load(tmp_path / "b").manifest.tiers[1].layer  # type: ignore[union-attr]
    assert f"tiers: encoder -> mid-layer (first {layer} of 18 blocks, head) -> teacher" in out


def test_a_head_fitted_on_standardized_states_reads_the_normalized_state() -> None:
    """The fit's standardization is folded into the head's weights: reading ``normalized(state)``
    gives what the standardized fit gives on the standardized rows."""
    rng = np.random.default_rng(0)
    states = rng.normal(size=(60, 8)) * np.array([1, 1, 1, 1, 1, 1, 1, 40.0]) + 3.0
    Y = rng.dirichlet(np.ones(3), size=60)
    head = fit_head(states, Y, C=1.0)
    X = normalized(states)
    standardized = (X - X.mean(axis=0)) / X.std(axis=0)
    inner = SoftmaxHead(C=1.0, max_iter=2000).fit(standardized, Y)
    assert head.predict_proba(X) == pytest.approx(inner.predict_proba(standardized), abs=1e-9)
    assert head.predict_proba(X).sum(axis=1) == pytest.approx(np.ones(60))
