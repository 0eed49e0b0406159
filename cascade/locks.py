"""Exclusive locks on a file beside what they guard, for work that must never run twice at once:
a training run writing one bundle, a loop watching one serving path, a promotion swapping it.

``fcntl.flock``, exclusive and non-blocking: a second taker is refused at once, told the pid of the
holder (written in the file), rather than queued behind work that takes minutes; the kernel lets go
of the lock however its holder dies, so a killed run leaves nothing to clean by hand (the file stays,
unlocked, mode 0600).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(path: Path, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold the lock on ``path`` (made where missing; its folder must exist), or raise
    ``busy(holder)``, ``holder`` the pid the taker wrote there ("unknown" where none)."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(descriptor, "r+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy(handle.read().strip() or "unknown") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
