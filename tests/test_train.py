"""Fast-tier training on real texts; gold labels of SMS spam and AG News stand in for the teacher.

Other test modules build their bundle with ``write_training_inputs`` and the session-wide
embedding cache of ``shared_cache_dir``, so the ~600 texts are embedded once per session.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cascade.bundle import NGRAMS_NAME, Bundle, ExternalTier, GgufTier, file_sha256
from cascade.cli import build_parser, main
from cascade.encoder import EmbeddingCache, Encoder
from cascade.ngrams import NgramFeatures, beside
from cascade.prompts import PROMPT_VERSION
from cascade.questions import parse_request
from distill.split import DEFAULT_FRACTIONS, PARTS, part_of, split_ids
from distill.store import LabelStore, Teacher, import_labels
from distill.train import MIN_TRAIN_LABELS, TrainError, train_bundle

N_SPAM, N_HAM, N_NEWS, N_RARE, N_URGENT = 100, 200, 300, 8, 60
GOLD = Teacher(kind="external", model="gold labels")
QUESTIONS_JSON = {
    "spam": {"type": "noul", "instructions": "Is this message spam?"},
    "topic": {"type": "choice", "instructions": "What is this news item about?",
              "criteria": {"World": "world news", "Sports": "sport", "Business": "business",
                           "Sci/Tech": "science and technology"}},
    "rare": {"type": "noul", "instructions": "Does it mention a rare event?"},
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
}
# part_of("item-0") ... part_of("item-7"), pinned: a changed split would move calibrated items
GOLDEN_PARTS = ["evaluation", "evaluation", "evaluation", "train", "evaluation", "evaluation", "train",
                "evaluation"]
QUESTIONS = parse_request({"state": "x", "questions": QUESTIONS_JSON}).questions


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open(encoding="utf-8")]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def gold_rows(data: Path) -> tuple[list[dict], list[dict]]:
    """100 spam + 200 ham SMS rows and the first 300 AG News rows, as in the shared data."""
    sms = _rows(data / "sms_spam.jsonl")
    spam, ham = ([r for r in sms if r["label"] == label] for label in ("spam", "ham"))
    return spam[:N_SPAM] + ham[:N_HAM], _rows(data / "ag_news_test.jsonl")[:N_NEWS]


def write_training_inputs(root: Path, data: Path, teacher: Teacher = GOLD) -> tuple[Path, Path]:
    """A 600-item corpus and a label store of its gold labels: (corpus path, store path).

    "rare" has too few labels for a head and "urgent" a single answer, so both get none.
    """
    sms, news = gold_rows(data)
    corpus = _write_jsonl(root / "corpus.jsonl", [{"id": r["id"], "text": r["text"]} for r in sms + news])
    labels = [{"id": r["id"], "question": "spam", "answer": r["label"] == "spam"} for r in sms]
    labels += [{"id": r["id"], "question": "topic", "answer": r["label_name"]} for r in news]
    labels += [{"id": r["id"], "question": "rare", "answer": True} for r in news[:N_RARE]]
    labels += [{"id": r["id"], "question": "urgent", "answer": False} for r in sms[:N_URGENT]]
    with LabelStore(root / "labels.sqlite", teacher) as store:
        import_labels(store, _write_jsonl(root / "gold.jsonl", labels), QUESTIONS)
    return corpus, root / "labels.sqlite"


def shared_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "embedding-cache"


def train(corpus: Path, store_path: Path, bundle_dir: Path, encoder: Encoder, cache: Path,
          **kwargs: object) -> Bundle:
    with LabelStore.open_existing(store_path) as store:
        return train_bundle(QUESTIONS, corpus, store, bundle_dir, encoder=encoder, cache_dir=cache,
                            progress=False, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> tuple[Path, Path]:
    return write_training_inputs(tmp_path_factory.mktemp("inputs"), shared_data)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_cache_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, inputs: tuple[Path, Path], encoder: Encoder,
           cache_dir: Path) -> Bundle:
    return train(*inputs, tmp_path_factory.mktemp("bundle"), encoder, cache_dir)


@pytest.fixture(scope="module")
def gold(shared_data: Path) -> dict[str, dict[str, tuple[str, str]]]:
    """question -> item id -> (text, gold option key)."""
    sms, news = gold_rows(shared_data)
    return {
        "spam": {r["id"]: (r["text"], "true" if r["label"] == "spam" else "false") for r in sms},
        "topic": {r["id"]: (r["text"], r["label_name"]) for r in news},
    }


@pytest.mark.parametrize("qid", ["spam", "topic"])
def test_heads_beat_the_majority_answer_on_evaluation_items(
    qid: str, bundle: Bundle, gold: dict, encoder: Encoder, cache_dir: Path
) -> None:
    items = [i for i in bundle.split_ids()["evaluation"] if i in gold[qid]]
    keys = QUESTIONS[qid].option_keys()
    truth = np.array([keys.index(gold[qid][i][1]) for i in items])
    texts = [gold[qid][i][0] for i in items]
    X = beside(EmbeddingCache(cache_dir, encoder).encode(texts), bundle.ngrams, texts)
    accuracy = (bundle.heads[qid].predict(X) == truth).mean()
    majority = np.bincount(truth).max() / len(truth)
    assert len(items) >= 50
    assert accuracy >= majority + 0.15
    info = bundle.manifest.tiers[0].heads[qid]  # type: ignore[union-attr]
    assert info.held_out_agreement is not None and info.held_out_agreement >= majority + 0.15


def test_questions_without_enough_labels_get_no_head(bundle: Bundle) -> None:
    heads = bundle.manifest.tiers[0].heads  # type: ignore[union-attr]
    assert set(bundle.heads) == {"spam", "topic"}
    assert heads["rare"].train_items < MIN_TRAIN_LABELS
    assert heads["rare"].skipped == (
        f"only {heads['rare'].train_items} train labels; a head needs at least {MIN_TRAIN_LABELS}"
    )
    assert heads["urgent"].skipped is not None
    n_urgent = heads["urgent"].train_items
    assert heads["urgent"].skipped.startswith(f"all {n_urgent} train labels answer 'false'")
    assert all(heads[q].has_head for q in ("spam", "topic"))


def test_manifest_describes_the_training(bundle: Bundle, inputs: tuple[Path, Path]) -> None:
    manifest = bundle.manifest
    parts = bundle.split_ids()
    labelled = [r["id"] for r in _rows(inputs[0])]
    assert parts == split_ids(labelled, DEFAULT_FRACTIONS, manifest.split.salt)
    assert manifest.split.fractions == DEFAULT_FRACTIONS
    heads = manifest.tiers[0].heads  # type: ignore[union-attr]
    assert heads["spam"].train_items == sum(i.startswith("sms-") for i in parts["train"])
    assert heads["topic"].held_out_items == sum(i.startswith("agnews-") for i in parts["calibration"])
    assert isinstance(manifest.tiers[-1], ExternalTier) and manifest.tiers[-1].labels == "gold labels"
    assert manifest.teacher.model_dump() == GOLD.model_dump()
    assert manifest.prompt_version == PROMPT_VERSION
    assert all(manifest.threshold(q, "encoder") is None for q in QUESTIONS)
    assert manifest.temperature("topic", "encoder") == 1.0
    assert manifest.training["labelled_items"] == N_SPAM + N_HAM + N_NEWS
    assert manifest.parsed_questions() == QUESTIONS


def test_retraining_embeds_nothing_new(
    bundle: Bundle, inputs: tuple[Path, Path], encoder: Encoder, cache_dir: Path, tmp_path: Path
) -> None:
    again = train(*inputs, tmp_path / "again", encoder, cache_dir, C=0.5)
    assert again.manifest.training["new_embeddings"] == 0
    assert again.manifest.training["C"] == 0.5
    assert len(EmbeddingCache(cache_dir, encoder)) >= N_SPAM + N_HAM + N_NEWS
    assert again.split_ids() == bundle.split_ids()


def test_ngrams_are_learnt_from_the_train_part_only(
    bundle: Bundle, inputs: tuple[Path, Path], encoder: Encoder
) -> None:
    texts = {r["id"]: r["text"].strip() for r in _rows(inputs[0])}
    expected = NgramFeatures().fit([texts[i] for i in bundle.split_ids()["train"]])
    assert bundle.ngrams is not None and bundle.manifest.training["ngrams"] is True
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
def gguf_store(tmp_path: Path, shared_data: Path) -> Iterator[tuple[Path, Path, Path]]:
    """Inputs labelled by a 'GGUF teacher' whose file is pinned by its bytes (never run here)."""
    model = tmp_path / "teacher.gguf"
    model.write_bytes(b"GGUF stand-in bytes")
    teacher = Teacher(kind="gguf", model="teacher.gguf", model_sha256=file_sha256(model),
                      prompt_version=PROMPT_VERSION)
    yield (*write_training_inputs(tmp_path, shared_data, teacher), model)


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
    bundle = train(corpus, store, tmp_path / "b", encoder, cache_dir, teacher_model=model)
    top = Bundle.load(bundle.directory).manifest.tiers[-1]
    assert isinstance(top, GgufTier)
    assert (top.model.path, top.model.sha256) == (str(model.resolve()), file_sha256(model))


def test_labels_of_another_prompt_version_are_refused(
    tmp_path: Path, shared_data: Path, encoder: Encoder, cache_dir: Path
) -> None:
    model = tmp_path / "teacher.gguf"
    model.write_bytes(b"GGUF stand-in bytes")
    old = Teacher(kind="gguf", model="teacher.gguf", model_sha256=file_sha256(model),
                  prompt_version="readout-v0")
    corpus, store = write_training_inputs(tmp_path, shared_data, old)
    with pytest.raises(TrainError, match=r"prompt version 'readout-v0'.*Relabel"):
        train(corpus, store, tmp_path / "b", encoder, cache_dir, teacher_model=model)


def test_a_corpus_without_labelled_items_is_refused(
    inputs: tuple[Path, Path], encoder: Encoder, cache_dir: Path, tmp_path: Path
) -> None:
    corpus = _write_jsonl(tmp_path / "other.jsonl", [{"id": "x1", "text": "unrelated"}])
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
    assert out[1].split()[0] == "spam" and out[1].split()[-1] == "yes"
    assert "none: only" in out[3] and "none: all" in out[4]
    assert out[-1] == f"bundle: {(tmp_path / 'cli').resolve()}"
    Bundle.load(tmp_path / "cli")


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
