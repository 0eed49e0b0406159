"""Fast-tier training: one softmax head per question on encoder vectors, from the teacher's labels.

Each labelled state is embedded once (through the embedding cache, so retraining with another C
or another question re-embeds nothing) and every question's head reads that same vector, with
the state's hashed word n-grams beside it unless ``ngrams=False`` (cascade.encoder.ngrams). Heads
learn the teacher's full distributions, only from the "train" part of the split; the
"calibration" part gives an honest held-out agreement now and the thresholds later.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from cascade.bundle.manifest import (
    HEADS_NAME,
    MANIFEST_NAME,
    NGRAMS_NAME,
    SPLIT_NAME,
    Bundle,
    BundleFile,
    Manifest,
    ModelFile,
    SplitInfo,
    TeacherInfo,
)
from cascade.bundle.sections import FinetuneSection, LayerCandidate, TrainingSection
from cascade.checks import is_finite
from cascade.corpus import CorpusItem
from cascade.encoder.familiar import GATE_NAME, QUANTILE, FamiliarityGate
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder, EncoderFiles
from cascade.errors import CascadeError
from cascade.hashing import file_sha256
from cascade.heads import Matrix, SoftmaxHead, save_heads
from cascade.locks import exclusive
from cascade.pins import write_json_file
from cascade.questions import Question
from cascade.readout.placement import Placement
from cascade.readout.prompts import OPTIONS_FIRST_VERSION, PROMPT_VERSION, layout_of, render_state
from cascade.tiers.base import HeadInfo
from cascade.tiers.encoder import EncoderSpec, GateInfo, NgramInfo
from cascade.tiers.external import ExternalSpec
from cascade.tiers.gguf import GgufSpec
from cascade.tiers.kinds import AnyTierSpec
from distill.options import CorpusInput, RunOptions, default_cache_dir, option
from distill.store import InputPolicy, LabelStore, Teacher
from distill.store.first_reading import read_recorded
from distill.training.finetune import FinetuneConfig
from distill.training.finetune_base import check_installed
from distill.training.head_rule import MIN_TRAIN_LABELS, why_no_head
from distill.training.mid_layer import MidLayerConfig, layers_of, train_mid_layer
from distill.training.split import DEFAULT_FRACTIONS, DEFAULT_SALT, PARTS, check_fractions, split_ids

FINETUNED_NAME = "encoder.onnx"
PARITY_TEXTS = 200
ENCODER_TIER, TEACHER_TIER = "encoder", "teacher"

Labels = Mapping[str, Mapping[str, float]]
"""item id -> the teacher's probabilities for one question."""


class TrainError(CascadeError, ValueError):
    """Training cannot start: no labelled items, labels that do not fit a question, bad C."""


def train_bundle(
    questions: Mapping[str, Question],
    corpus: CorpusInput,
    store: LabelStore,
    bundle_dir: Path,
    encoder: Encoder | None = None,
    fractions: Mapping[str, float] = DEFAULT_FRACTIONS,
    C: float = 1.0,
    *,
    run: RunOptions | None = None,
    teacher_model: Path | None = None,
    teacher_placement: Placement | None = None,
    ngrams: bool = True,
    finetune: FinetuneConfig | None = None,
    middle: Sequence[GgufSpec] = (),
    mid_layer: MidLayerConfig | None = None,
    parts: Mapping[str, Sequence[str]] | None = None,
    pin_teacher: bool = True,
) -> Bundle:
    """Fit the encoder tier on ``store``'s labels of the ``corpus`` items and save a bundle.

    A question with fewer than MIN_TRAIN_LABELS train labels, or only one answer among them,
    gets no head; the manifest says why, and the router starts it at the next tier. A GGUF
    teacher must be given as ``teacher_model`` (the store knows only its name and sha256) so
    that the bundle can pin the file its top tier runs; ``teacher_placement`` is recorded as that
    tier's default placement (GPU layers, threads), which a router may override. A corpus line
    ``corpus`` skips leaves its item out. ``run``: progress bars, the device of the encoder opened
    when none is given, and the embedding cache (default ``default_cache_dir()``); it opens no GGUF
    tier to place. With ``finetune``, the encoder itself is first fine-tuned on the train part's
    labels (distill.training.finetune, needs the ``finetune`` extra) and served from the bundle as int8
    ONNX; the heads are then fitted on its vectors as on the frozen encoder's. ``middle``
    (``middle_tier``) are GGUF readout tiers to stand, in order, between the encoder and the
    teacher; like the heads they keep nothing until ``cascade calibrate`` certifies them.
    ``mid_layer`` adds the teacher's own first blocks as a tier just below it (distill.training.mid_layer):
    it needs the teacher's GGUF, and its states of the train items are collected here.
    ``parts``: the ids of each part, given (``distill.loop.retrain`` places what it must hold out);
    None: each labelled item by a hash of its id (``distill.training.split``). ``pin_teacher=False``
    (the demo, which ships a GGUF's labels but not the file) pins no file for a GGUF teacher: its top
    tier is then the GGUF given at load (``teacher=``, ``--teacher``), checked there against the
    labels' sha256 and prompt version, so the thresholds stay certified with that very model.
    """
    corpus = option("train_bundle", "corpus", corpus, CorpusInput)
    run = option("train_bundle", "run", run, RunOptions, RunOptions())
    run.unused("train_bundle", "placement", "flops_per_second")
    fractions = check_fractions(fractions)
    _check_arguments(questions, C)
    _check_middle(middle)
    if finetune is not None:
        finetune.check()
        check_installed()
    top = _top_tier(store.teacher, teacher_model, teacher_placement, store.policy, pin_teacher)
    if mid_layer is not None:
        if not isinstance(top, GgufSpec):
            raise TrainError("a mid-layer tier runs the teacher's own first blocks, and this store's "
                             f"teacher is {store.teacher.kind} ({store.teacher.model!r}); label with a "
                             "GGUF teacher")
        layers_of(mid_layer, Path(top.model.path))
    labels = {qid: store.labels(qid) for qid in questions}
    texts = _labelled_texts(read_recorded(store, corpus.read(), corpus.path), corpus.path, labels, store.path)
    parts = split_ids(texts, fractions, DEFAULT_SALT) if parts is None else _given(parts, texts)
    encoder = encoder if encoder is not None else Encoder(device=run.device, threads=run.threads)
    bundle_dir = Path(bundle_dir)
    with staged(bundle_dir) as stage:
        tuned = None
        if finetune is not None:
            encoder, tuned = _finetuned(encoder, finetune, questions, labels, texts, parts, stage,
                                        run.progress)
        cache = EmbeddingCache(run.cache_dir or default_cache_dir(), encoder)
        vectors = dict(zip(texts, cache.encode(list(texts.values()), progress=run.progress), strict=True))
        grams = NgramFeatures().fit([texts[i] for i in parts["train"]]) if ngrams and parts["train"] else None

        def features(items: list[str]) -> Matrix:
            return beside(np.stack([vectors[i] for i in items]), grams, [texts[i] for i in items])

        fitted = {qid: _fit_question(qid, q, labels[qid], features, parts, C) for qid, q in questions.items()}
        heads = {qid: head for qid, (head, _) in fitted.items() if head is not None}
        save_heads(stage / HEADS_NAME, heads)
        infos = {q: info for q, (_, info) in fitted.items()}
        first = _encoder_tier(encoder, stage, infos, _save_ngrams(grams, stage), tuned is not None)
        first.gate = _save_gate([vectors[i] for i in parts["train"]], stage)
        mids, sweep = _mid_layer(mid_layer, top, questions, labels, texts, parts, stage, C, run.progress)
        tiers = [first, *middle, *mids, top]
        split = SplitInfo(fractions=fractions, salt=DEFAULT_SALT,
                          file=write_json_file(stage, SPLIT_NAME, parts))
        training = TrainingSection(C=C, ngrams=ngrams, min_train_labels=MIN_TRAIN_LABELS,
                                   labelled_items=len(texts), new_embeddings=cache.misses,
                                   embedding_cache=str(cache.path), text_field=corpus.field(), finetune=tuned,
                                   **({"mid_layer": sweep} if sweep else {}))
        manifest = _manifest(questions, bundle_dir.resolve().name, tiers, store.teacher, split, training)
        Bundle(manifest, stage, heads).save()
    return Bundle(manifest, bundle_dir, heads)


@contextmanager
def staged(bundle_dir: Path) -> Iterator[Path]:
    """A hidden folder beside ``bundle_dir`` to build a bundle in, swapped in whole at the end.

    Training takes minutes (fine-tuning, hours): killed half-way, it leaves the previous bundle
    as it was, or none, never a mix of two. A folder that is not a bundle is never replaced, so
    a mistyped ``--bundle`` cannot delete someone's files. Leftovers of a killed run (hidden
    ``.NAME.training-*`` folders) are removed by the next run for the same bundle. Runs for one
    bundle hold a lock on ``.NAME.training.lock`` while they work (the kernel lets go of it when a
    run dies, however it dies), so a second one is refused rather than deleting the first one's
    folder or swapping a bundle in under it.
    """
    if bundle_dir.exists() and any(bundle_dir.iterdir()) and not (bundle_dir / MANIFEST_NAME).is_file():
        raise TrainError(f"{bundle_dir} exists and is not a bundle (no {MANIFEST_NAME}); give a new or "
                         "empty folder, or a bundle to replace")
    bundle_dir.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{bundle_dir.name}.training-"
    with bundle_lock(bundle_dir):
        restore_interrupted(bundle_dir)
        for stale in bundle_dir.parent.glob(f"{prefix}*"):
            shutil.rmtree(stale, ignore_errors=True)
        stage = Path(tempfile.mkdtemp(prefix=prefix, dir=bundle_dir.parent))
        try:
            yield stage
            old = stage.with_name(stage.name + "-old")
            if bundle_dir.exists():
                os.replace(bundle_dir, old)
            os.replace(stage, bundle_dir)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def restore_interrupted(bundle_dir: Path) -> bool:
    """Put back the bundle a run killed between ``staged``'s two renames moved aside: then
    ``bundle_dir`` is missing and the old bundle sits whole in ``.NAME.training-*-old``. True
    where one was put back. Called by the next ``staged`` for it, and by whatever serves from it
    before that (``distill.loop.promotions``), since a server cannot start on a missing bundle."""
    if bundle_dir.exists():
        return False
    moved = [old for old in bundle_dir.parent.glob(f".{bundle_dir.name}.training-*-old")
             if (old / MANIFEST_NAME).is_file()]
    if not moved:
        return False
    os.replace(max(moved, key=lambda old: old.stat().st_mtime), bundle_dir)
    return True


@contextmanager
def bundle_lock(bundle_dir: Path) -> Iterator[None]:
    """An exclusive lock for writing ``bundle_dir`` (a training, a calibration's save), or
    TrainError if another run holds it."""
    path = bundle_dir.parent / f".{bundle_dir.name}.training.lock"

    def busy(holder: str) -> TrainError:
        return TrainError(f"another `cascade train` (pid {holder}) is writing {bundle_dir} now (it holds "
                          f"{path}); wait for it to finish, or give another --bundle")

    with exclusive(path, busy):
        yield


def _given(parts: Mapping[str, Sequence[str]], texts: Mapping[str, str]) -> dict[str, list[str]]:
    """The parts given, as ``split_ids`` lists them (sorted, labelled items only); an item in two
    parts is refused, since the calibration part must never have trained a head."""
    out = {part: sorted({i for i in parts.get(part, ()) if i in texts}) for part in PARTS}
    placed = [i for ids in out.values() for i in ids]
    if len(placed) != len(set(placed)):
        twice = min(i for i in placed if placed.count(i) > 1)
        raise TrainError(f"the parts given hold item {twice!r} in two parts; give each item one part")
    return out


def _finetuned(
    encoder: Encoder,
    config: FinetuneConfig,
    questions: Mapping[str, Question],
    labels: Mapping[str, Labels],
    texts: Mapping[str, str],
    parts: Mapping[str, list[str]],
    stage: Path,
    progress: bool,
) -> tuple[Encoder, FinetuneSection]:
    """The encoder fine-tuned on the train part's labels, as int8 ONNX in the bundle folder.

    Only train items teach it (the calibration part must stay unseen for the certificate to
    hold); the parity check reads calibration texts, which needs no labels.
    """
    from distill.training.finetune import finetune_body
    from distill.training.finetune_base import Targets
    from distill.training.onnx_export import export_int8

    train = parts["train"]
    targets = {qid: Targets(_target_rows(qid, q.option_keys(), labels[qid], train))
               for qid, q in questions.items() if any(item in labels[qid] for item in train)}
    tokenizer = encoder.files.tokenizer
    body, record = finetune_body([texts[i] for i in train], targets, tokenizer, config, progress)
    parity_texts = [texts[i] for i in (parts["calibration"] or train)[:PARITY_TEXTS]]
    parity = export_int8(body, tokenizer, stage / FINETUNED_NAME, parity_texts, encoder.max_length)
    tuned = Encoder(EncoderFiles(model=stage / FINETUNED_NAME, tokenizer=tokenizer, name="finetuned"),
                    device=encoder.device, max_length=encoder.max_length, batch_size=encoder.batch_size)
    return tuned, record.model_copy(update={"parity": parity})


def _target_rows(qid: str, keys: list[str], labels: Labels, items: list[str]) -> np.ndarray:
    """Teacher probabilities of ``items`` (NaN rows where the question has no label of one)."""
    labelled = [item for item in items if item in labels]
    rows = np.full((len(items), len(keys)), np.nan)
    index = {item: row for row, item in enumerate(items)}
    rows[[index[item] for item in labelled]] = _label_rows(qid, keys, labels, labelled)
    return rows


def _manifest(
    questions: Mapping[str, Question],
    name: str,
    tiers: list[AnyTierSpec],
    teacher: Teacher,
    split: SplitInfo,
    training: TrainingSection,
) -> Manifest:
    """A new bundle's manifest: no threshold yet (every question escalates until calibrated)."""
    return Manifest(
        name=name,
        created_at=datetime.now(timezone.utc),
        questions={qid: question.model_dump(mode="json") for qid, question in questions.items()},
        tiers=tiers,
        thresholds={qid: {tier.name: None for tier in tiers[:-1]} for qid in questions},
        temperatures={qid: {tier.name: 1.0 for tier in tiers} for qid in questions},
        teacher=TeacherInfo.model_validate(teacher.model_dump()),
        split=split,
        training=training,
    )


def _mid_layer(config: MidLayerConfig | None, top: AnyTierSpec, questions: Mapping[str, Question],
               labels: Mapping[str, Labels], texts: Mapping[str, str], parts: Mapping[str, list[str]],
               stage: Path, C: float, progress: bool) -> tuple[list[AnyTierSpec], list[LayerCandidate]]:
    """The mid-layer tier asked for (none: no config), its heads saved into ``stage``, and the
    layers ``auto`` tried; the rendered texts are the states (``render_state`` of a text is the
    text)."""
    if config is None or not isinstance(top, GgufSpec):
        return [], []
    spec, sweep = train_mid_layer(config, Path(top.model.path), questions, labels, texts, parts["train"],
                                  stage, C, progress)
    return [spec], sweep


def middle_tier(model: Path, name: str | None = None, n_ctx: int = 4096) -> GgufSpec:
    """A GGUF logit-readout tier for ``train_bundle(middle=...)``, pinned by sha256.

    Named after its file unless ``name`` is given: the name is what answers report in
    ``answered_by``. ``n_ctx`` bounds the prompt it reads: a longer one goes past it
    unread, named in ``routing.too_long_for``.
    """
    model = Path(model)
    if not model.is_file():
        raise TrainError(f"middle tier model {model} not found; give the path of a GGUF file")
    if not (isinstance(n_ctx, int) and n_ctx > 0):
        raise TrainError(f"n_ctx of a middle tier must be a whole number > 0; got {n_ctx!r}")
    from cascade.readout.gguf_header import read_header  # imports gguf: only where a file is read

    read_header(model)  # not a GGUF: refused now, not after training, when calibration loads it
    return GgufSpec(name=name or model.stem, model=ModelFile.of(model), n_ctx=n_ctx)


def _check_middle(middle: Sequence[GgufSpec]) -> None:
    names = [tier.name for tier in middle]
    for name in names:
        if name in (ENCODER_TIER, TEACHER_TIER) or names.count(name) > 1:
            raise TrainError(f"middle tier name {name!r} is taken (by the {name} tier or another middle "
                             "tier); give each middle tier its own name (middle_tier(name=...))")


def _check_arguments(questions: Mapping[str, Question], C: float) -> None:
    if not questions:
        raise TrainError("questions is empty; give at least one question to train a head for")
    if not (is_finite(C) and C > 0):
        raise TrainError(f"C (inverse regularisation strength) must be a number > 0; got {C!r}")


def _top_tier(teacher: Teacher, model: Path | None, placement: Placement | None,
              policy: InputPolicy | None, pin: bool = True) -> AnyTierSpec:
    """The teacher as the top tier: its GGUF pinned by path and sha256 (unless not ``pin``), or
    labels only, answered by the model given at load; either reads states with the input policy
    the store's labels were read with (context, excerpt)."""
    excerpt = policy.excerpt if policy is not None else None
    if teacher.kind == "endpoint" and model is not None:
        raise TrainError(f"the store's labels came from the System One endpoint {teacher.model!r}, not a "
                         f"GGUF: leave out --teacher-model {model}; the bundle's top tier is answered by "
                         "--teacher URL when it runs, every answer checked against that endpoint's identity")
    labels_only = ExternalSpec(name=TEACHER_TIER, labels=teacher.model, excerpt=excerpt,
                               n_ctx=policy.n_ctx if policy is not None else None)
    if teacher.kind == "external" and model is not None:
        raise TrainError(f"the store's labels came from {teacher.model!r}, not from a GGUF this cascade "
                         f"reads: leave out --teacher-model {model} (a GGUF teacher's labels are imported "
                         "with --teacher-sha256 and --teacher-prompt-version, which the file is checked "
                         "against)")
    if teacher.kind in ("external", "endpoint"):  # an endpoint answers through --teacher URL, checked
        return labels_only
    if layout_of(teacher.prompt_version) is None:
        raise TrainError(f"the store's labels were made with prompt version "
                         f"{teacher.prompt_version!r}; this cascade prompts with {PROMPT_VERSION!r} "
                         f"or {OPTIONS_FIRST_VERSION!r}, so its top tier would answer differently. "
                         "Relabel with this version")
    if not pin and model is None:  # the labels' sha256 and prompt version check the GGUF at load
        return labels_only
    if model is None:
        raise TrainError(f"the store's teacher is the GGUF {teacher.model!r} (sha256 "
                         f"{teacher.model_sha256}); give its path (--teacher-model / teacher_model) "
                         "so the bundle can pin the file its top tier runs")
    if not Path(model).is_file():
        raise TrainError(f"teacher_model {model} not found; give the path of {teacher.model!r}")
    pinned = ModelFile.of(model)
    if pinned.sha256 != teacher.model_sha256:
        raise TrainError(f"teacher_model {model} has sha256 {pinned.sha256}, but the store's labels "
                         f"were made by {teacher.model!r} with sha256 {teacher.model_sha256}; "
                         "give that file")
    n_ctx = policy.n_ctx if policy is not None else GgufSpec.model_fields["n_ctx"].default
    return GgufSpec(name=TEACHER_TIER, model=pinned, placement=placement or Placement(), n_ctx=n_ctx,
                    excerpt=excerpt)


def _labelled_texts(
    lines: Iterable[CorpusItem], corpus: Path, labels: Mapping[str, Labels], store_path: object
) -> dict[str, str]:
    """item id -> state text, for the corpus items the store has a label of for any question."""
    wanted = set().union(*(set(by_item) for by_item in labels.values()))
    texts = {item.id: render_state(item.state) for item in lines if item.id in wanted}
    if not texts:
        raise TrainError(f"no item of {corpus} has a teacher label in {store_path} for the "
                         f"questions {sorted(labels)} ({len(wanted)} labelled ids, none in the "
                         "corpus); label this corpus first, or check --corpus and --store")
    return texts


def _save_gate(train_vectors: list[np.ndarray], bundle_dir: Path) -> GateInfo | None:
    """The gate for unfamiliar inputs, fitted on the train part's vectors only (so it spends
    nothing of the calibration part); None with fewer than 2 train items."""
    if len(train_vectors) < 2:
        return None
    gate = FamiliarityGate.fit(np.stack(train_vectors))
    gate.save(bundle_dir / GATE_NAME)
    return GateInfo(file=BundleFile.of(bundle_dir, GATE_NAME), reference=len(gate.reference),
                    quantile=QUANTILE, radius=gate.radius)


def _save_ngrams(grams: NgramFeatures | None, bundle_dir: Path) -> NgramInfo | None:
    if grams is None:
        return None
    grams.save(bundle_dir / NGRAMS_NAME)
    return NgramInfo(n_features=grams.n_features, ngram_range=grams.ngram_range,
                     file=BundleFile.of(bundle_dir, NGRAMS_NAME))


def _encoder_tier(
    encoder: Encoder, bundle_dir: Path, heads: dict[str, HeadInfo], ngrams: NgramInfo | None, inside: bool
) -> EncoderSpec:
    """``inside``: the encoder model is a file of the bundle (fine-tuned for it), else shared."""
    model = (BundleFile.of(bundle_dir, encoder.files.model.name) if inside else
             ModelFile(path=str(encoder.files.model.resolve()), sha256=encoder.sha256))
    return EncoderSpec(
        name=ENCODER_TIER,
        model=model,
        tokenizer=ModelFile(path=str(encoder.files.tokenizer.resolve()),
                            sha256=file_sha256(encoder.files.tokenizer)),
        max_length=encoder.max_length,
        heads_file=BundleFile.of(bundle_dir, HEADS_NAME),
        heads=heads,
        ngrams=ngrams,
    )


def _fit_question(
    qid: str,
    question: Question,
    labels: Labels,
    features: Callable[[list[str]], Matrix],
    parts: Mapping[str, list[str]],
    C: float,
) -> tuple[SoftmaxHead | None, HeadInfo]:
    """Fit on the train part; agreement with the teacher's argmax on the calibration part."""
    keys = question.option_keys()
    train = [item for item in parts["train"] if item in labels]
    held = [item for item in parts["calibration"] if item in labels]
    Y = _label_rows(qid, keys, labels, train)
    info = HeadInfo(option_keys=keys, train_items=len(train), held_out_items=len(held))
    reason = why_no_head(Y, keys)
    if reason is not None:
        return None, info.model_copy(update={"skipped": reason})
    head = SoftmaxHead(C=C).fit(features(train), Y)
    if held:
        teacher = _label_rows(qid, keys, labels, held).argmax(axis=1)
        agreement = float((head.predict(features(held)) == teacher).mean())
        info = info.model_copy(update={"held_out_agreement": agreement})
    return head, info


def _label_rows(qid: str, keys: list[str], labels: Labels, items: list[str]) -> np.ndarray:
    """(len(items), len(keys)) teacher probabilities, columns in the question's option order."""
    rows = np.zeros((len(items), len(keys)))
    for row, item in enumerate(items):
        probs = labels[item]
        if sorted(probs) != sorted(keys):
            raise TrainError(f"the stored label of item {item!r} for question {qid!r} has options "
                             f"{sorted(probs)}, but the question's are {keys}: the question "
                             "changed since labelling; relabel into a new store")
        rows[row] = [probs[key] for key in keys]
    return rows
