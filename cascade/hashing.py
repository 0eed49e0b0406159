"""File hashes, computed once per file version in a process, and seeded draws from a hash.

A 2.5 GB GGUF takes seconds to hash. Bundles pin every model file by sha256, label stores pin
their teacher by it, and each readout answer names the model's hash; all of them share this
cache, so no answer pays for a hash.

Every seeded choice of the project (the audit sample, the collected share, the train /
calibration / evaluation split, the temperature part, the mid-layer's samples) draws from
``seeded_unit``: a number in [0, 1) from sha256(seed, separator, key) alone, the same on every
machine and run, never from Python's per-process ``hash``. Each caller keeps its own seed and
separator, so that no draw moved when their copies became this one.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

_HASHES: dict[tuple[str, int, int], str] = {}
_RACY_SECONDS = 2.0
_SCALE = 2.0**64
RS = "\x1e"
"""The record separator between seed and key (the audit sample's and the collector's)."""


def seeded_bits(seed: str, key: str, separator: str = RS) -> int:
    """The first 64 bits (big-endian) of sha256 of ``seed``, ``separator``, ``key`` in UTF-8."""
    digest = hashlib.sha256(f"{seed}{separator}{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def seeded_unit(seed: str, key: str, separator: str = RS) -> float:
    """A uniform number in [0, 1) drawn by ``key`` alone, given ``seed``: ``seeded_bits`` over
    2**64 (a draw within 2**-54 of 1 rounds to 1.0, as it always did)."""
    return seeded_bits(seed, key, separator) / _SCALE


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, cached in-process by (path, size, mtime).

    A file modified within the last ``_RACY_SECONDS`` is not cached: a second write in the same
    mtime tick (coarse on many file systems) would otherwise keep its old hash, as in racy git.
    """
    resolved = Path(path).resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    if key in _HASHES:
        return _HASHES[key]
    digest = hashlib.sha256()
    with resolved.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if time.time() - stat.st_mtime > _RACY_SECONDS:
        _HASHES[key] = digest.hexdigest()
    return digest.hexdigest()
