"""Which questions get a head: one rule for every tier trained on the teacher's labels.

The encoder's heads (``distill.training.run``) and the mid-layer tier's
(``distill.training.mid_layer``) apply it alike, so a question skipped by one for too few labels,
or for a single answer among them, is skipped by the other with the same reason in the manifest.
"""

from __future__ import annotations

import numpy as np

MIN_TRAIN_LABELS = 10


def why_no_head(Y: np.ndarray, keys: list[str]) -> str | None:
    """Why the teacher's probabilities ``Y`` (train items x options) cannot train a head for a
    question with options ``keys``; None when they can."""
    if len(Y) < MIN_TRAIN_LABELS:
        return f"only {len(Y)} train labels; a head needs at least {MIN_TRAIN_LABELS}"
    answers = np.unique(Y.argmax(axis=1))
    if len(answers) < 2:
        return f"all {len(Y)} train labels answer {keys[int(answers[0])]!r}; a head needs two answers"
    return None
