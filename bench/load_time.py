"""What ``Cascade.load`` costs beyond loading its models (goal: at most 1.5x their loads).

On the embedded gemma-3-270m GGUF, in one process, each round times once, in a rotating order:
pricing the model (``ModelShape``) through gguf.GGUFReader, as cascade.cost.roofline read it before
cascade.readout.gguf_header, and through ``ModelShape.from_gguf``; llama.cpp opening and closing the
model (``Scorer``, as the bundle's top tier opens it); the ONNX encoder session (``Encoder``);
and ``Cascade.load`` of a bundle whose encoder tier is trained on generated messages and whose
top tier is that GGUF (priced on the roofline, as a bundle without measured costs is), with
from_gguf and with the GGUFReader baseline patched in. Wall time, since loading is file reads
and parsing; min and median over rounds. ``Cascade.load`` checks the sha256 of every pinned file,
which cascade.hashing caches per process (building the bundle here hashed them): the first load
of a fresh process also pays the hashing, timed apart ("sha256 of pinned files", uncached).

    .venv/bin/python -m bench.load_time --rounds 3
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from gguf import GGUFReader

from bench.common import WALL, argument_parser, in_rounds
from cascade.bundle.manifest import Bundle, Manifest, ModelFile
from cascade.corpus import load_questions
from cascade.cost.roofline import ModelShape
from cascade.encoder.onnx_encoder import Encoder
from cascade.readout.llama import default_gguf_path
from cascade.readout.scorer import Scorer, branch_slots
from cascade.routing.router import Cascade
from cascade.tiers.gguf import GgufSpec
from distill.demo.synthetic import generate, write_corpus, write_labels, write_questions
from distill.labelling.transfer import import_labels
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore, Teacher
from distill.training.run import train_bundle

FLOPS = 1e12
"""Any throughput: it only scales the roofline prices, which cost nothing to compute."""


def reader_shape(path: Path) -> ModelShape:
    """The baseline: every field built by GGUFReader, the tokenizer's vocabulary included."""
    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith(("tokenizer.", "GGUF."))}
    return ModelShape.from_tables(path, meta, reader.tensors)


def sha256(paths: list[Path]) -> list[str]:
    """The pinned files' hashes as cascade.hashing computes them, without its cache."""
    digests = []
    for path in paths:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digests.append(digest.hexdigest())
    return digests


def gguf_topped_bundle(root: Path, model: Path, items: int, n_ctx: int, threads: int) -> Bundle:
    """An encoder tier trained on ``items`` generated messages, then ``model`` as the top tier."""
    generated = generate(items, seed=0)
    corpus = write_corpus(generated, root / "corpus.jsonl")
    questions = load_questions(write_questions(root / "questions.json"))
    with LabelStore(root / "labels.sqlite", Teacher(kind="external", model="generator")) as store:
        import_labels(store, write_labels(generated, root / "labels.jsonl"), questions)
        trained = train_bundle(questions, CorpusInput(corpus), store, root / "trained",
                               encoder=Encoder(threads=threads), run=RunOptions(progress=False))
    data = trained.manifest.model_dump()
    top = GgufSpec(name=data["tiers"][-1]["name"], model=ModelFile.of(model), n_ctx=n_ctx)
    data["tiers"] = [*data["tiers"][:-1], top.model_dump()]
    return Bundle(Manifest.model_validate(data), trained.directory).save(root / "bundle")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=60, help="generated messages to train on")
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    model = default_gguf_path()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = gguf_topped_bundle(Path(tmp), model, args.items, args.n_ctx, args.threads)
        branches = branch_slots(len(bundle.manifest.questions))
        pinned = [Path(pin.path) for _, pin in bundle.manifest.model_files()]
        assert reader_shape(model) == ModelShape.from_gguf(model), "the two readers disagree"

        def load() -> None:
            Cascade.load(bundle.directory, flops_per_second=FLOPS, threads=args.threads).close()

        def load_with_reader() -> None:
            with mock.patch.object(ModelShape, "from_gguf", reader_shape):
                load()

        work: dict[str, Callable[[], object]] = {
            "shape, GGUFReader": lambda: reader_shape(model),
            "shape, gguf_header": lambda: ModelShape.from_gguf(model),
            "llama.cpp load": lambda: Scorer(model, n_ctx=args.n_ctx, max_branches=branches,
                                             n_threads=args.threads).close(),
            "encoder load": lambda: Encoder(threads=args.threads),
            "Cascade.load": load,
            "Cascade.load, GGUFReader": load_with_reader,
            "sha256 of pinned files": lambda: sha256(pinned),
        }
        timed = in_rounds(work, args.rounds, WALL, rotate=True)
        seconds = {name: values["wall"] for name, values in timed.items()}
    print(f"{model.name}, {args.threads} threads, n_ctx {args.n_ctx}, {branches} branches; "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<25} {'min s':>8} {'median s':>9}")
    for name, values in seconds.items():
        print(f"{name:<25} {min(values):>8.3f} {statistics.median(values):>9.3f}")
    median = {name: statistics.median(values) for name, values in seconds.items()}
    models = median["llama.cpp load"] + median["encoder load"]
    print(f"pricing: GGUFReader / gguf_header = "
          f"{median['shape, GGUFReader'] / median['shape, gguf_header']:.0f}x the time")
    for name in ("Cascade.load", "Cascade.load, GGUFReader"):
        print(f"{name} / (llama.cpp + encoder loads) = {median[name] / models:.2f}x (goal <= 1.5x)")
    print(f"a fresh process's first Cascade.load adds the hashing: "
          f"{(median['Cascade.load'] + median['sha256 of pinned files']) / models:.2f}x")


if __name__ == "__main__":
    main()
