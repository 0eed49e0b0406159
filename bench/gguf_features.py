"""Would a bigger feature model reach the router goal? gemma-3-270m's hidden states as features.

bench/cascade_goals.py finds the fast tier's ranking, not the calibration, to be the limit. This
asks how far the strongest model installed here moves it: gemma-3-270m (the GGUF package the
tests use) run by llama.cpp in embedding mode, its last hidden states mean-pooled and
L2-normalised, one vector per text. On the same items, parts and evaluation as
bench/cascade_goals.py (the library's own bundle and split), heads fitted on the train part,
the library's rule (raw top probability, LTT certified on every calibration item), and the
hindsight and oracle references. Rules: the library (MiniLM + n-grams); gemma alone; gemma
beside MiniLM and n-grams in one head; and that head with per-class thresholds along one fixed
sequence. Gemma vectors are cached in ~/.cache/cascade-bench (about 270 tokens/s on 2 cores:
~13 min for the 4000 ag_news items on a first run).

    .venv/bin/python -m bench.gguf_features --tasks ag_news zomato
"""

from __future__ import annotations

import hashlib
import sqlite3
import tempfile
import time
from contextlib import closing
from pathlib import Path

import llama_cpp
import numpy as np
import scipy.sparse as sp
from tqdm import tqdm

from bench.cascade_goals import (
    BASELINES,
    GOAL_FACTOR,
    VARIANTS,
    Outcome,
    Parts,
    Probs,
    fit_head,
    library_probs,
    load_parts,
    one_threshold,
    per_class_path,
    run_library,
    variant_rows,
)
from bench.common import (
    CACHE_DIR,
    TASK_NAMES,
    TASKS,
    argument_parser,
    markdown,
    placed_llama_defaults,
    sample,
)
from cascade.cost.roofline import measure_cpu_flops
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.hashing import file_sha256
from cascade.readout.llama import default_gguf_path

MAX_TOKENS = 256
TOP_SHARES = (10, 25, 50)
GEMMA_C = 10.0
"""C of the heads on gemma vectors: the best of 1 / 10 / 100 on ag_news's temperature part."""


class GemmaVectors:
    """Mean-pooled, L2-normalised last hidden states of a GGUF, cached by text in SQLite."""

    def __init__(self, model: Path, threads: int) -> None:
        with placed_llama_defaults():
            self.llm = llama_cpp.Llama(str(model), embedding=True, n_ctx=4096, n_batch=4096,
                                       pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                                       n_ubatch=4096, n_threads=threads, verbose=False)
        digest = file_sha256(model)[:12]
        self.path = CACHE_DIR / f"gguf-vectors-{digest}-{MAX_TOKENS}.sqlite"
        CACHE_DIR.mkdir(parents=True, exist_ok=True)

    def encode(self, texts: list[str]) -> np.ndarray:
        with closing(sqlite3.connect(self.path)) as db:
            db.execute("CREATE TABLE IF NOT EXISTS v (key TEXT PRIMARY KEY, vec BLOB)")
            keys = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
            wanted = set(keys)
            found = {key: vec for key, vec in db.execute("SELECT key, vec FROM v") if key in wanted}
            missing = [i for i, k in enumerate(keys) if k not in found]
            for start in tqdm(range(0, len(missing), 16), desc="gemma vectors", disable=not missing):
                rows = missing[start : start + 16]
                for i, vec in zip(rows, self._embed([texts[i] for i in rows]), strict=True):
                    found[keys[i]] = vec.astype(np.float32).tobytes()
                    db.execute("INSERT OR REPLACE INTO v VALUES (?, ?)", (keys[i], found[keys[i]]))
                db.commit()
        vectors = np.stack([np.frombuffer(found[k], dtype=np.float32) for k in keys]).astype(np.float64)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    def _embed(self, texts: list[str]) -> np.ndarray:
        """Texts cut to MAX_TOKENS tokens, as the encoder truncates."""
        cut = [self.llm.detokenize(self.llm.tokenize(t.encode(), add_bos=False)[:MAX_TOKENS]).decode(
            errors="ignore") for t in texts]
        return np.asarray(self.llm.embed(cut, normalize=False, truncate=True))


def rules(parts: Parts, gemma: dict[str, np.ndarray], library: Probs) -> list[Outcome]:
    grams = NgramFeatures().fit(parts.texts["train"])
    both = {part: sp.hstack([beside(parts.emb[part], grams, parts.texts[part]), sp.csr_matrix(vectors)],
                            format="csr") for part, vectors in gemma.items()}
    gemma_alone, combined = fit_head(gemma, parts, GEMMA_C), fit_head(both, parts, 1.0)
    return [
        one_threshold("library (MiniLM + n-grams), raw, all calibration", library, parts, False),
        one_threshold("gemma-3-270m vectors alone", gemma_alone, parts, False),
        one_threshold("gemma beside MiniLM + n-grams", combined, parts, False),
        per_class_path("gemma beside MiniLM + n-grams, per-class fixed sequence", combined, parts),
    ]


def top_error_rates(task: str, outcome: Outcome) -> list[str]:
    """How often the rule's most confident evaluation answers are wrong: a tier whose top tenth is
    already wrong more often than the target allows cannot keep much at that target."""
    order = np.argsort(-outcome.score, kind="stable")
    wrong = ~outcome.correct[order]
    return [task, outcome.name, *(f"{wrong[: max(1, len(order) * q // 100)].mean():.1%}" for q in TOP_SHARES)]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--tasks", nargs="+", default=["ag_news", "zomato"],
                        choices=TASK_NAMES)
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    args = parser.parse_args()
    encoder, flops = Encoder(), measure_cpu_flops()
    vectors = GemmaVectors(default_gguf_path(), args.threads)
    table, deciles = [], []
    for task in (t for t in TASKS if t.name in args.tasks):
        began = time.perf_counter()
        rows = sample(task, args.items, 0)
        with tempfile.TemporaryDirectory(prefix=f"gguf-features-{task.name}-") as workdir:
            run = run_library(task, rows, Path(workdir), encoder, flops)
            parts = load_parts(run.bundle, rows, task, EmbeddingCache(CACHE_DIR, encoder))
        parts_used = ("train", "calibration", "temperature", "threshold", "evaluation")
        gemma = {part: vectors.encode(parts.texts[part]) for part in parts_used}
        outcomes = rules(parts, gemma, library_probs(run, parts))
        table += variant_rows(task, outcomes, run, parts)
        deciles += [top_error_rates(task.name, outcome) for outcome in outcomes]
        goal = GOAL_FACTOR * BASELINES[task.name].kept
        print(f"{task.name}: {time.perf_counter() - began:.0f} s; the goal is {goal:.0%} kept")
    print(f"\n{markdown(VARIANTS, table)}\n")
    print(markdown(["dataset", "rule", *(f"wrong in top {q}%" for q in TOP_SHARES)], deciles))


if __name__ == "__main__":
    main()
