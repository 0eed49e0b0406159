"""Keys for an upstream: where the cascade's own key comes from, which callers' keys the upstream
accepted lately (forwarded auth), and which keys a 429 has paused.

Keys are never kept in the clear beyond the call that uses them: the two tables are keyed by a
sha256 of the ``Authorization`` value. The clock is ``time.monotonic`` unless a test gives another.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cascade.errors import CascadeError

Clock = Callable[[], float]


@dataclass
class KeySource:
    """The upstream key: the environment variable ``env`` (read at each call, so a restart is not
    needed to change it), or the file ``file``, re-read whenever it changes (a rotated secret
    mounted as a file). The file wins where both are set and it exists."""

    env: str | None = None
    file: Path | None = None
    _seen: tuple[int, int, int] | None = field(default=None, repr=False)
    _key: str | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read(self) -> str | None:
        """The key now, None where neither source holds one."""
        if self.file is not None and self.file.exists():
            return self._from_file(self.file)
        value = os.environ.get(self.env, "").strip() if self.env else ""
        return value or None

    def _from_file(self, path: Path) -> str | None:
        try:
            stat = path.stat()
            mark = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            with self._lock:
                if mark != self._seen:
                    self._key, self._seen = path.read_text(encoding="utf-8").strip() or None, mark
                return self._key
        except OSError as exc:
            raise CascadeError(f"cannot read the upstream key file {path}: {exc}; give a readable "
                               "file holding the key") from exc


def key_id(authorization: str | None) -> str:
    """What the tables below key a caller by: a hash of its Authorization value ("" for none)."""
    return hashlib.sha256(authorization.encode()).hexdigest()[:32] if authorization else ""


class AcceptedKeys:
    """Callers' keys the upstream accepted within ``remember`` seconds: with forwarded auth, a
    cascade answers locally only to these, so it never gives away answers the upstream would
    refuse that caller. A 401 or 403 from the upstream revokes a key at once."""

    def __init__(self, remember: float = 300.0, clock: Clock = time.monotonic) -> None:
        self.remember, self.clock = remember, clock
        self._at: dict[str, float] = {}
        self._lock = threading.Lock()

    def accept(self, authorization: str | None) -> None:
        with self._lock:
            self._at[key_id(authorization)] = self.clock()

    def revoke(self, authorization: str | None) -> None:
        with self._lock:
            self._at.pop(key_id(authorization), None)

    def accepted(self, authorization: str | None) -> bool:
        """Whether the upstream accepted this key within ``remember`` seconds."""
        with self._lock:
            at = self._at.get(key_id(authorization))
        return at is not None and self.clock() - at <= self.remember


class Pauses:
    """Keys a 429 paused, each until its Retry-After: no call with that key goes upstream before."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def pause(self, authorization: str | None, seconds: float) -> None:
        """Pause calls with this key for ``seconds`` (a later pause never shortens an earlier one)."""
        until = self.clock() + max(0.0, seconds)
        with self._lock:
            ident = key_id(authorization)
            self._until[ident] = max(until, self._until.get(ident, 0.0))

    def left(self, authorization: str | None) -> float:
        """Seconds this key stays paused (0 when it is not)."""
        with self._lock:
            until = self._until.get(key_id(authorization), 0.0)
        return max(0.0, until - self.clock())
