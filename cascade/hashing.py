"""File hashes, computed once per file version in a process: a 2.5 GB GGUF takes seconds to hash.

Bundles pin every model file by sha256, label stores pin their teacher by it, and each readout
answer names the model's hash; all of them share this cache, so no answer pays for a hash.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

_HASHES: dict[tuple[str, int, int], str] = {}
_RACY_SECONDS = 2.0


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
