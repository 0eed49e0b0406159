"""Keys for an upstream: where the cascade's own key comes from, which callers' keys the upstream
accepted lately and which it refused (forwarded auth), which keys a 429 has paused, and whether a
host is this machine's own (a key sent elsewhere over http:// travels in the clear).

Keys are never kept in the clear beyond the call that uses them: the tables are keyed by a sha256
of the ``Authorization`` value. Each table holds at most ``size`` keys: an entry past its time is
dropped at the next write, and a full table forgets its oldest entry (which costs that key one
upstream call, never an answer it should not get). The clock is ``time.monotonic`` unless a test
gives another.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from cascade.errors import CascadeError, UpstreamFailed

Clock = Callable[[], float]
V = TypeVar("V")
RECHECK = 60.0
"""Seconds a key the upstream accepted counts as accepted: its next request after that goes
upstream whole, so a key revoked there loses local answers within this time."""
REJECT_FOR = 10.0
"""Seconds a key the upstream refused (401, 403) is refused here without asking it again."""
MAX_KEYS = 10_000
"""Most keys each table holds."""
UPSTREAM_KEY_VARIABLE = "CASCADE_UPSTREAM_KEY"
"""Where a command's upstream key is read from unless ``--upstream-key-env`` names another."""


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
        """The key now, None where neither source holds one; refused where it holds a character
        a header cannot carry (httpx quoted such a header, key and all, in a message a client
        got; a non-ASCII letter was a 500 on every call), never quoting it."""
        if self.file is not None and self.file.exists():
            key, source = self._from_file(self.file), f"the file {self.file}"
            if key is None:  # emptied while serving: calls went out with no key, unsaid
                raise UpstreamFailed(f"the upstream key file {self.file} holds no key; write the key in it",
                                     status=502)
        else:
            key, source = (os.environ.get(self.env, "").strip() if self.env else "") or None, f"${self.env}"
            if key is None and self.file is not None:  # removed while serving: likewise
                also = f", and ${self.env} holds none" if self.env else ""
                raise UpstreamFailed(f"the upstream key file {self.file} is gone{also}; put the key back "
                                     "there (a rotation replaces the file, never removes it first)",
                                     status=502)
        if key is not None and not all("!" <= c <= "~" for c in key):
            raise UpstreamFailed(f"the upstream key in {source} holds a character an HTTP header cannot "
                                 "carry (a line break, a space, a non-ASCII letter); write the key alone, "
                                 "on one line", status=502)
        return key

    def check(self) -> None:
        """At start: a key file given must exist (a mistyped path fell back to the environment's
        key, or to none, unsaid), and hold a key a header carries (``read``)."""
        if self.file is not None and not self.file.exists():
            raise CascadeError(f"the upstream key file {self.file} does not exist; give the file holding "
                               "the key")
        self.read()

    def _from_file(self, path: Path) -> str | None:
        try:
            stat = path.stat()
            mark = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            with self._lock:
                if mark != self._seen:
                    self._key, self._seen = path.read_text(encoding="utf-8").strip() or None, mark
                return self._key
        except UnicodeDecodeError:
            raise UpstreamFailed(f"the upstream key file {path} is not UTF-8 text; write the key alone, on "
                                 "one line", status=502) from None
        except OSError as exc:  # a folder, or removed since ``exists``
            raise UpstreamFailed(f"cannot read the upstream key file {path}: {exc}; give a readable "
                                 "file holding the key", status=502) from None


def key_id(authorization: str | None) -> str:
    """What the tables below key a caller by: a hash of its Authorization value ("" for none)."""
    return hashlib.sha256(authorization.encode()).hexdigest()[:32] if authorization else ""


class _Table(Generic[V]):
    """Key ids to the clock time their entry ends and what it holds, in the order written
    (re-writing moves an entry last), at most ``size`` of them; thread-safe."""

    def __init__(self, size: int, clock: Clock) -> None:
        if size < 1:
            raise CascadeError(f"a key table holds at least 1 key; got size {size}")
        self.size, self.clock = size, clock
        self._entries: dict[str, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _put(self, authorization: str | None, until: float, value: V, later: bool = False) -> None:
        """Write an entry (``later``: never one that ends before the entry held): ended entries at
        the front go, and the oldest while the table is full."""
        ident = key_id(authorization)
        with self._lock:
            held = self._entries.pop(ident, None)
            if later and held is not None:
                until = max(until, held[0])
            now = self.clock()
            while self._entries:
                first = next(iter(self._entries))
                if self._entries[first][0] > now and len(self._entries) < self.size:
                    break
                del self._entries[first]
            self._entries[ident] = (until, value)

    def _get(self, authorization: str | None) -> tuple[float, V] | None:
        """The entry's end and value while it has not ended, else None."""
        with self._lock:
            entry = self._entries.get(key_id(authorization))
        return entry if entry is not None and self.clock() <= entry[0] else None

    def _drop(self, authorization: str | None) -> None:
        with self._lock:
            self._entries.pop(key_id(authorization), None)


class AcceptedKeys(_Table[None]):
    """Callers' keys the upstream accepted within ``remember`` seconds: with forwarded auth, a
    cascade answers locally only to these, so it never gives away answers the upstream would
    refuse that caller, and a key past ``remember`` sends its next request upstream whole, which
    checks it again. A 401 or 403 from the upstream revokes a key at once."""

    def __init__(self, remember: float = RECHECK, clock: Clock = time.monotonic,
                 size: int = MAX_KEYS) -> None:
        super().__init__(size, clock)
        self.remember = remember

    def accept(self, authorization: str | None) -> None:
        self._put(authorization, self.clock() + self.remember, None)

    def revoke(self, authorization: str | None) -> None:
        self._drop(authorization)

    def accepted(self, authorization: str | None) -> bool:
        """Whether the upstream accepted this key within ``remember`` seconds."""
        return self._get(authorization) is not None


@dataclass(frozen=True)
class Refusal:
    """What the upstream answered a key it refused: its status, body and content type, given
    back as they were to each caller with that key while the refusal is remembered."""

    status: int
    body: bytes | None
    content_type: str | None


class RejectedKeys(_Table[Refusal]):
    """Keys the upstream refused (401 or 403) within ``remember`` seconds, with its refusal: a
    junk key then costs no upstream call and no upstream slot per request. An acceptance clears
    a key at once."""

    MAX_BODY = 4096
    """Refusal bodies longer than this are not kept (the caller then gets this server's own)."""

    def __init__(self, remember: float = REJECT_FOR, clock: Clock = time.monotonic,
                 size: int = MAX_KEYS) -> None:
        super().__init__(size, clock)
        self.remember = remember

    def reject(self, authorization: str | None, refusal: Refusal) -> None:
        if refusal.body is not None and len(refusal.body) > self.MAX_BODY:
            refusal = Refusal(refusal.status, None, None)
        self._put(authorization, self.clock() + self.remember, refusal)

    def clear(self, authorization: str | None) -> None:
        self._drop(authorization)

    def refusal(self, authorization: str | None) -> Refusal | None:
        """The upstream's refusal of this key while it is remembered, else None."""
        entry = self._get(authorization)
        return entry[1] if entry is not None else None


class Pauses(_Table[None]):
    """Keys a 429 paused, each until its Retry-After: no call with that key goes upstream before."""

    def __init__(self, clock: Clock = time.monotonic, size: int = MAX_KEYS) -> None:
        super().__init__(size, clock)

    def pause(self, authorization: str | None, seconds: float) -> None:
        """Pause calls with this key for ``seconds`` (a later pause never shortens an earlier one)."""
        self._put(authorization, self.clock() + max(0.0, seconds), None, later=True)

    def left(self, authorization: str | None) -> float:
        """Seconds this key stays paused (0 when it is not)."""
        held = self._get(authorization)
        return max(0.0, held[0] - self.clock()) if held is not None else 0.0


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address or name, as ``--host`` or a URL gives it) is this machine
    alone: ``localhost`` or a loopback address. Any other name counts as reachable from outside."""
    if not host:
        return False
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
