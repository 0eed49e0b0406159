"""How to call an upstream teacher: its URL and the client's limits (no httpx needed to hold them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from cascade.errors import CascadeError
from cascade.private import redact_url
from cascade.teachers.keys import RECHECK, REJECT_FOR, KeySource

Compression = Literal["identity", "gzip", "zstd", "auto"]
UPSTREAM_EXTRA = "pip install -e '.[upstream]'"


@dataclass(frozen=True)
class UpstreamSettings:
    """How to call an upstream at ``url`` (its ``/v1/systemone``).

    ``model``: the model name each request carries (some servers require one: jevcompat's mock
    takes ``mock`` or ``jev-latest``; None sends none). ``key``: where the cascade's own key comes
    from; ``forward_auth``: send each caller's Authorization instead. Timeouts in seconds:
    ``connect_timeout`` and ``read_timeout`` per try (each cut to what is left of the deadline),
    ``deadline`` for a call with every retry and wait (below the SDKs' 10 s). ``retries``: most
    resends of one call. ``max_in_flight``: most calls upstream at once. ``compress``: request
    bodies gzip or zstd ("auto": what the upstream takes). ``remember``: seconds a key the upstream
    accepted counts as accepted (forwarded auth; default 60: past it, the key's next request goes
    upstream whole, so a key revoked there loses local answers within this time);
    ``reject_for``: seconds a key it refused (401, 403) is refused without asking it again.
    ``shown``: the URL as every message, log line, answer and schema names it, without a password.
    """

    url: str
    model: str | None = None
    key: KeySource | None = None
    forward_auth: bool = False
    connect_timeout: float = 2.0
    read_timeout: float = 8.0
    deadline: float = 9.0
    max_in_flight: int = 32
    retries: int = 2
    compress: Compression = "identity"
    remember: float = RECHECK
    reject_for: float = REJECT_FOR

    @property
    def shown(self) -> str:
        return redact_url(self.url)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise CascadeError(f"an upstream teacher is an http(s):// URL of a /v1/systemone endpoint; "
                               f"got {self.shown!r}")
        try:
            _ = urlsplit(self.url).port
        except ValueError:  # its words may quote a password that holds an unencoded "/" or "@"
            raise CascadeError(f"the upstream URL {self.shown} cannot be read (its host or port); write "
                               "it as http(s)://HOST:PORT/v1/systemone, with any @, / or : of a user "
                               "or password percent-encoded") from None
        if min(self.connect_timeout, self.read_timeout, self.deadline) <= 0:
            raise CascadeError(f"upstream timeouts and deadline must be > 0 seconds; got connect "
                               f"{self.connect_timeout}, read {self.read_timeout}, deadline {self.deadline}")
        if self.max_in_flight < 1 or self.retries < 0:
            raise CascadeError(f"max_in_flight must be >= 1 and retries >= 0; got {self.max_in_flight}, "
                               f"{self.retries}")


    def credentials_clash(self) -> bool:
        """Whether the URL carries a user or password beside a key (or forwarded auth): httpx sends
        the URL's as Basic auth in place of the Authorization header, so the key never goes."""
        parts, key = urlsplit(self.url), self.key
        keyed = self.forward_auth or (key is not None and (key.file is not None or bool(key.read())))
        return bool(parts.username or parts.password) and keyed


def url_or_path(text: str) -> str | Path:
    """A teacher a user wrote: an http(s) URL of a System One endpoint stays text (a Path would
    fold its "//"; its scheme in lower case, as httpx takes it), anything else is a GGUF's path. A
    URL of another scheme is refused, redacted: taken as a path, it was echoed whole, password and
    all."""
    scheme, sep, rest = text.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return Path(text)
    if scheme.lower() not in ("http", "https"):
        raise CascadeError(f"{redact_url(text)!r}: a teacher is a GGUF's path or an http(s):// URL of a "
                           "/v1/systemone endpoint")
    return f"{scheme.lower()}://{rest}"


def is_url(teacher: object) -> bool:
    """Whether a teacher given by a user is an upstream URL rather than a GGUF path."""
    return isinstance(teacher, str) and teacher.startswith(("http://", "https://"))

