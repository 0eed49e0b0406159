"""The gate for unfamiliar inputs: a state unlike anything the heads were trained on goes up.

The gate keeps up to ``MAX_REFERENCE`` of the training items' encoder vectors and a radius, the
``quantile`` (0.99) of their nearest-neighbour cosine distances; a state farther than the radius
from every reference goes to the next tier (``x_routing.unfamiliar``). Fitted before calibration
and only ever moving answers up to the teacher, it spends none of delta. Why, and what it costs:
docs/auditing.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cascade.atomic import write_atomically
from cascade.errors import BundleError

MAX_REFERENCE = 4096
QUANTILE = 0.99
GATE_NAME = "familiar.npz"
_CHUNK = 1024


@dataclass(frozen=True)
class FamiliarityGate:
    """``reference``: unit vectors of training items (float32, (m, d)); ``radius``: the largest
    cosine distance to the nearest reference that is still familiar."""

    reference: np.ndarray
    radius: float

    @classmethod
    def fit(cls, vectors: np.ndarray, quantile: float = QUANTILE, seed: int = 0) -> FamiliarityGate:
        """From training vectors: a seeded sample of at most MAX_REFERENCE as the reference, and
        the ``quantile`` of their leave-one-out nearest-neighbour distances as the radius."""
        vectors = np.asarray(vectors, dtype=np.float32)
        if len(vectors) < 2:
            raise ValueError(f"a familiarity gate needs at least 2 training vectors; got {len(vectors)}")
        if len(vectors) > MAX_REFERENCE:
            keep = np.random.default_rng(seed).choice(len(vectors), MAX_REFERENCE, replace=False)
            vectors = vectors[np.sort(keep)]
        nearest = _nearest(vectors, vectors, leave_one_out=True)
        return cls(vectors, float(np.quantile(nearest, quantile)))

    def distances(self, vectors: np.ndarray) -> np.ndarray:
        """Each vector's cosine distance to its nearest reference vector."""
        return _nearest(np.asarray(vectors, dtype=np.float32), self.reference, leave_one_out=False)

    def familiar(self, vectors: np.ndarray) -> np.ndarray:
        return self.distances(vectors) <= self.radius

    def save(self, path: Path) -> None:
        """Written whole (``cascade.atomic``) and readable by its owner alone, as every bundle
        file is: the reference vectors are the training items' embeddings."""
        write_atomically(Path(path), lambda out: np.savez(out, reference=self.reference.astype(np.float16),
                                                          radius=np.float64(self.radius)))

    @classmethod
    def load(cls, path: Path) -> FamiliarityGate:
        try:
            with np.load(Path(path)) as data:
                return cls(data["reference"].astype(np.float32), float(data["radius"]))
        except (OSError, KeyError, ValueError) as exc:
            raise BundleError(f"cannot read the familiarity gate {path}: {exc}; re-train the bundle") from exc


def _nearest(vectors: np.ndarray, reference: np.ndarray, leave_one_out: bool) -> np.ndarray:
    """Cosine distance from each row of ``vectors`` to its nearest row of ``reference`` (itself
    left out when the two are the same rows), in chunks so memory stays bounded."""
    out = np.empty(len(vectors), dtype=np.float64)
    for start in range(0, len(vectors), _CHUNK):
        sims = vectors[start:start + _CHUNK] @ reference.T
        if leave_one_out:
            rows = np.arange(len(sims))
            sims[rows, rows + start] = -np.inf
        out[start:start + _CHUNK] = 1.0 - sims.max(axis=1)
    return out
