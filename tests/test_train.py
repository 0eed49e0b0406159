"""Fast-tier training on the generated corpus of ``corpora``, whose labels stand in for the teacher.

The bundle tested is the session's (conftest ``trained_bundle``), which the router, calibration,
evaluation and bundle tests share; retraining reads the session's embedding cache, so the
corpus is embedded once per session.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from corpora import (
    HEADED,
    N_ITEMS,
    N_URGENT,
    QUESTIONS,
    QUESTIONS_JSON,
    TEACHER,
    corpus_items,
    read_jsonl,
    train,
    write_jsonl,
    write_training_inputs,
)
from tinymodels import tiny_llama_path

from cascade.bundle.manifest import NGRAMS_NAME, Bundle
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.errors import RouterError
from cascade.hashing import file_sha256
from cascade.readout.placement import Placement
from cascade.readout.prompts import PROMPT_VERSION
from cascade.routing.router import Cascade
from cascade.tiers.external import ExternalSpec
from cascade.tiers.gguf import GgufSpec
from distill.cli import build_parser, main
from distill.loop.retrain import _tiers_of
from distill.store import Teacher
from distill.training.run import MIN_TRAIN_LABELS, TrainError, staged
from distill.training.split import DEFAULT_FRACTIONS, PARTS, part_of, split_ids

# part_of("item-0") ... part_of("item-7"), pinned: a changed split would move calibrated items
GOLDEN_PARTS = ["evaluation", "evaluation", "evaluation", "train", "evaluation", "evaluation", "train",
                "evaluation"]


@pytest.fixture
def inputs(labelled: tuple[Path, Path]) -> tuple[Path, Path]:
    """The session's (corpus, store), under the name training reads them by."""
    return labelled


@pytest.fixture
def cache_dir(embedding_cache: Path) -> Path:
    """The session's embedding cache: a retrain here embeds nothing."""
    return embedding_cache


@pytest.fixture
def bundle(trained_bundle: Bundle) -> Bundle:
    """The session's bundle, trained on ``inputs``; tests only read it."""
    return trained_bundle


@pytest.fixture(scope="module")
def answers() -> dict[str, tuple[str, dict[str, str]]]:
    """item id -> (text, the teacher's most probable answer to each question)."""
    return {item.id: (item.text, item.teacher_answers()) for item in corpus_items()}


@pytest.mark.parametrize("qid", HEADED)
def test_heads_beat_the_majority_answer_on_evaluation_items(
    qid: str, bundle: Bundle, answers: dict, encoder: Encoder, cache_dir: Path
) -> None:
    items = bundle.split_ids()["evaluation"]
    keys = QUESTIONS[qid].option_keys()
    truth = np.array([keys.index(answers[i][1][qid]) for i in items])
    texts = [answers[i][0] for i in items]
    X = beside(EmbeddingCache(cache_dir, encoder).encode(texts), bundle.ngrams, texts)
    accuracy = (bundle.heads[qid].predict(X) == truth).mean()
    majority = np.bincount(truth).max() / len(truth)
    assert len(items) >= 50
    assert accuracy >= majority + 0.15
    info = bundle.manifest.tiers[0].heads[qid]  # type: ignore[union-attr]
    assert info.held_out_agreement is not None and info.held_out_agreement >= majority + 0.15


def test_questions_without_enough_labels_get_no_head(bundle: Bundle) -> None:
    heads = bundle.manifest.tiers[0].heads  # type: ignore[union-attr]
    assert set(bundle.heads) == set(HEADED)
    assert heads["rare"].train_items < MIN_TRAIN_LABELS
    assert heads["rare"].skipped == (
        f"only {heads['rare'].train_items} train labels; a head needs at least {MIN_TRAIN_LABELS}"
    )
    assert heads["spam"].skipped is not None
    n_spam = heads["spam"].train_items
    assert n_spam >= MIN_TRAIN_LABELS
    assert heads["spam"].skipped.startswith(f"all {n_spam} train labels answer 'false'")
    assert all(heads[q].has_head for q in HEADED)


def test_manifest_describes_the_training(bundle: Bundle, inputs: tuple[Path, Path]) -> None:
    manifest = bundle.manifest
    parts = bundle.split_ids()
    labelled = [r["id"] for r in read_jsonl(inputs[0])]
    assert parts == split_ids(labelled, DEFAULT_FRACTIONS, manifest.split.salt)
    assert manifest.split.fractions == DEFAULT_FRACTIONS
    heads = manifest.tiers[0].heads  # type: ignore[union-attr]
    urgent = set(labelled[:N_URGENT])  # the question labelled on part of the corpus
    assert heads["urgent"].train_items == len(urgent & set(parts["train"])) < len(parts["train"])
    assert heads["urgent"].held_out_items == len(urgent & set(parts["calibration"]))
    assert heads["department"].held_out_items == len(parts["calibration"])
    assert isinstance(manifest.tiers[-1], ExternalSpec) and manifest.tiers[-1].labels == TEACHER.model
    assert manifest.teacher.model_dump() == TEACHER.model_dump()
    assert manifest.prompt_version == PROMPT_VERSION
    assert all(manifest.threshold(q, "encoder") is None for q in QUESTIONS)
    assert manifest.temperature("department", "encoder") == 1.0
    assert manifest.training.labelled_items == N_ITEMS
    assert manifest.parsed_questions() == QUESTIONS


def test_retraining_embeds_nothing_new(
    bundle: Bundle, inputs: tuple[Path, Path], encoder: Encoder, cache_dir: Path, tmp_path: Path
) -> None:
    again = train(*inputs, tmp_path / "again", encoder, cache_dir, C=0.5)
    assert again.manifest.training.new_embeddings == 0
    assert again.manifest.training.C == 0.5
    assert len(EmbeddingCache(cache_dir, encoder)) >= N_ITEMS
    assert again.split_ids() == bundle.split_ids()


def test_ngrams_are_learnt_from_the_train_part_only(
    bundle: Bundle, inputs: tuple[Path, Path], encoder: Encoder
) -> None:
    texts = {r["id"]: r["text"].strip() for r in read_jsonl(inputs[0])}
    expected = NgramFeatures().fit([texts[i] for i in bundle.split_ids()["train"]])
    assert bundle.ngrams is not None and bundle.manifest.training.ngrams is True
    np.testing.assert_array_equal(bundle.ngrams.idf_, expected.idf_)
    widths = {head.n_features_in_ for head in bundle.heads.values()}
    assert widths == {encoder.dim + bundle.ngrams.n_features}


def test_without_ngrams_the_heads_read_the_embedding_alone(
    inputs: tuple[Path, Path], encoder: Encoder, cache_dir: Path, tmp_path: Path
) -> None:
    plain = train(*inputs, tmp_path / "plain", encoder, cache_dir, ngrams=False)
    assert plain.ngrams is None and not (plain.directory / NGRAMS_NAME).exists()
    assert {head.n_features_in_ for head in plain.heads.values()} == {encoder.dim}
    assert Bundle.load(plain.directory).ngrams is None


@pytest.fixture
def gguf_store(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """Inputs labelled by a 'GGUF teacher' whose file is pinned by its bytes (never run here)."""
    model = tmp_path / "teacher.gguf"
    model.write_bytes(b"GGUF stand-in bytes")
    teacher = Teacher(kind="gguf", model="teacher.gguf", model_sha256=file_sha256(model),
                      prompt_version=PROMPT_VERSION)
    yield (*write_training_inputs(tmp_path, teacher), model)


def test_gguf_teacher_becomes_a_pinned_top_tier(
    gguf_store: tuple[Path, Path, Path], encoder: Encoder, cache_dir: Path, tmp_path: Path
) -> None:
    corpus, store, model = gguf_store
    with pytest.raises(TrainError, match=r"teacher is the GGUF 'teacher.gguf'.*--teacher-model"):
        train(corpus, store, tmp_path / "b", encoder, cache_dir)
    with pytest.raises(TrainError, match=r"teacher_model .*missing.gguf not found"):
        train(corpus, store, tmp_path / "b", encoder, cache_dir, teacher_model=tmp_path / "missing.gguf")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    with pytest.raises(TrainError, match=r"other.gguf has sha256 .* give that file"):
        train(corpus, store, tmp_path / "b", encoder, cache_dir, teacher_model=other)
    bundle = train(corpus, store, tmp_path / "b", encoder, cache_dir, teacher_model=model,
                   teacher_placement=Placement(gpu_layers=99))
    top = Bundle.load(bundle.directory).manifest.tiers[-1]
    assert isinstance(top, GgufSpec)
    assert (top.model.path, top.model.sha256) == (str(model.resolve()), file_sha256(model))
    assert top.default_placement() == Placement(gpu_layers=99, n_ctx=top.n_ctx)  # the router's default


def test_a_gguf_teacher_left_unpinned_is_the_one_given_at_load(
    gguf_store: tuple[Path, Path, Path], encoder: Encoder, cache_dir: Path, tmp_path: Path
) -> None:
    """The demo's case: a GGUF's labels without its file. The top tier is the GGUF given at load,
    which must be that file; a retrain leaves it unpinned too."""
    corpus, store, model = gguf_store
    bundle = train(corpus, store, tmp_path / "b", encoder, cache_dir, pin_teacher=False)
    manifest = Bundle.load(bundle.directory).manifest
    assert isinstance(manifest.tiers[-1], ExternalSpec)
    assert (manifest.teacher.kind, manifest.teacher.model_sha256) == ("gguf", file_sha256(model))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    with pytest.raises(RouterError, match=r"other.gguf has sha256"):
        Cascade.preflight(bundle.directory, teacher=other)
    Cascade.preflight(bundle.directory, teacher=model)  # the labels' own file: no refusal
    assert _tiers_of(bundle)["pin_teacher"] is False


def test_a_gguf_given_for_labels_that_came_from_elsewhere_is_refused(
    tmp_path: Path, encoder: Encoder, cache_dir: Path
) -> None:
    """It was accepted and ignored: the bundle's top tier replays the labels, not that file."""
    model = tmp_path / "teacher.gguf"
    model.write_bytes(b"GGUF stand-in bytes")
    corpus, store = write_training_inputs(tmp_path, Teacher(kind="external", model="gold labels"))
    with pytest.raises(TrainError, match=r"came from 'gold labels', not from a GGUF.*leave out"):
        train(corpus, store, tmp_path / "b", encoder, cache_dir, teacher_model=model)
    assert not (tmp_path / "b").exists()


def test_labels_of_another_prompt_version_are_refused(
    tmp_path: Path, encoder: Encoder, cache_dir: Path
) -> None:
    model = tmp_path / "teacher.gguf"
    model.write_bytes(b"GGUF stand-in bytes")
    old = Teacher(kind="gguf", model="teacher.gguf", model_sha256=file_sha256(model),
                  prompt_version="readout-v0")
    corpus, store = write_training_inputs(tmp_path, old)
    with pytest.raises(TrainError, match=r"prompt version 'readout-v0'.*Relabel"):
        train(corpus, store, tmp_path / "b", encoder, cache_dir, teacher_model=model)


def test_a_corpus_without_labelled_items_is_refused(
    inputs: tuple[Path, Path], encoder: Encoder, cache_dir: Path, tmp_path: Path
) -> None:
    corpus = write_jsonl(tmp_path / "other.jsonl", [{"id": "x1", "text": "unrelated"}])
    with pytest.raises(TrainError, match=r"no item of .*other.jsonl has a teacher label"):
        train(corpus, inputs[1], tmp_path / "b", encoder, cache_dir)


@pytest.mark.parametrize("kwargs, message", [
    ({"C": 0.0}, r"C \(inverse regularisation strength\) must be a number > 0; got 0.0"),
    ({"fractions": {"train": 0.5, "calibration": 0.5}}, r"fractions must map exactly"),
    ({"fractions": {"train": 0.6, "calibration": 0.3, "evaluation": 0.3}}, r"must sum to 1"),
])
def test_bad_arguments_are_refused(
    kwargs: dict, message: str, inputs: tuple[Path, Path], encoder: Encoder, cache_dir: Path,
    tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=message):
        train(*inputs, tmp_path / "b", encoder, cache_dir, **kwargs)


def test_cli_prints_a_table_and_the_bundle(
    inputs: tuple[Path, Path], cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"questions": QUESTIONS_JSON}))
    corpus, store = inputs
    code = main(["train", "--questions", str(questions), "--corpus", str(corpus), "--store", str(store),
                 "--bundle", str(tmp_path / "cli"), "--cache-dir", str(cache_dir)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].split() == ["question", "train", "n", "held-out", "n", "agreement", "head"]
    assert out[1].split()[0] == "urgent" and out[1].split()[-1] == "yes"
    assert "none: only" in out[3] and "none: all" in out[4]
    assert out[-1] == f"bundle: {(tmp_path / 'cli').resolve()}"
    Bundle.load(tmp_path / "cli")


def test_cli_trains_a_gguf_middle_tier_that_keeps_nothing_until_calibrated(
    inputs: tuple[Path, Path], cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps({"questions": QUESTIONS_JSON}))
    middle = tiny_llama_path(tmp_path)
    corpus, store = inputs
    args = ["train", "--questions", str(questions), "--corpus", str(corpus), "--store", str(store),
            "--bundle", str(tmp_path / "cli"), "--cache-dir", str(cache_dir)]
    assert main([*args, "--middle", str(middle), "--middle-n-ctx", "512"]) == 0
    assert capsys.readouterr().out.splitlines()[-2] == f"tiers: encoder -> {middle.stem} -> teacher"
    manifest = Bundle.load(tmp_path / "cli").manifest
    tier = manifest.tiers[1]
    assert isinstance(tier, GgufSpec) and (tier.name, tier.n_ctx) == (middle.stem, 512)
    assert tier.model.sha256 == file_sha256(middle)
    assert all(manifest.threshold(qid, middle.stem) is None for qid in manifest.questions)
    assert main([*args, "--middle", str(middle), "--middle", str(middle)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"TrainError: middle tier name {middle.stem!r} is taken (by the {middle.stem} tier or another "
        "middle tier); give each middle tier its own name (middle_tier(name=...))")
    assert main([*args, "--middle", str(tmp_path / "absent.gguf")]) == 2
    assert f"middle tier model {tmp_path / 'absent.gguf'} not found" in capsys.readouterr().err
    (tmp_path / "notes.gguf").write_text("not a model")  # trained, then refused at calibration before
    assert main([*args, "--middle", str(tmp_path / "notes.gguf")]) == 2
    assert "notes.gguf is not a readable GGUF file (no GGUF magic" in capsys.readouterr().err
    assert Bundle.load(tmp_path / "cli").manifest.tiers[1].name == middle.stem  # refused runs wrote nothing


def test_cli_help_has_an_example(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "example:\n  cascade train --questions" in capsys.readouterr().out


def test_split_is_deterministic_and_follows_the_fractions() -> None:
    ids = [f"item-{n}" for n in range(20_000)]
    parts = split_ids(ids)
    assert parts == split_ids(reversed(ids))
    assert sorted(i for part in PARTS for i in parts[part]) == sorted(ids)
    for part in PARTS:
        assert abs(len(parts[part]) / len(ids) - DEFAULT_FRACTIONS[part]) < 0.02
        assert all(part_of(i) == part for i in parts[part][:100])
    # sha256 of the id, not Python's per-process hash: fixed across runs and machines
    assert [part_of(f"item-{n}") for n in range(len(GOLDEN_PARTS))] == GOLDEN_PARTS


def test_split_is_stable_when_items_are_added() -> None:
    old = [f"old-{n}" for n in range(1000)]
    before = split_ids(old)
    after = split_ids(old + [f"new-{n}" for n in range(1000)])
    assert {p: [i for i in after[p] if i.startswith("old-")] for p in PARTS} == before
    assert split_ids(old, salt="another") != before


@pytest.mark.parametrize("fractions, message", [
    ({"train": 0.0, "calibration": 0.5, "evaluation": 0.5}, r"fractions\['train'\] must be > 0"),
    ({"train": 1.2, "calibration": -0.1, "evaluation": -0.1}, r"must be a number in \[0, 1\]; got 1.2"),
    ({"train": "half", "calibration": 0.25, "evaluation": 0.25}, r"got 'half'"),
])
def test_bad_fractions_are_refused(fractions: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_ids(["a"], fractions)


def test_train_help_states_the_fine_tunes_default_epochs() -> None:
    from distill.cli import train as train_command
    from distill.training.finetune import FinetuneConfig

    assert FinetuneConfig().epochs == train_command.DEFAULT_EPOCHS


def test_a_second_training_of_one_bundle_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    import fcntl

    target = tmp_path / "bundle"
    target.mkdir()
    (target / "manifest.json").write_text("{}", encoding="utf-8")
    leftover = tmp_path / ".bundle.training-killed"
    leftover.mkdir()
    with (tmp_path / ".bundle.training.lock").open("a", encoding="utf-8") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first run, still at work
        refused = pytest.raises(TrainError, match=r"another `cascade train` \(pid unknown\) is writing "
                                r".*bundle now \(it holds .*\.bundle\.training\.lock\); wait for it to "
                                r"finish, or give another --bundle")
        with refused, staged(target):
            pass
        assert leftover.is_dir() and (target / "manifest.json").read_text(encoding="utf-8") == "{}"
    with staged(target) as stage:  # once it is done, the next run cleans up and swaps in
        (stage / "manifest.json").write_text('{"new": 1}', encoding="utf-8")
    assert not leftover.exists()
    assert (target / "manifest.json").read_text(encoding="utf-8") == '{"new": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == [".bundle.training.lock", "bundle"]
