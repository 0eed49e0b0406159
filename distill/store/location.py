"""Where a store lives: a SQLite file (a path) or a PostgreSQL database (a ``postgresql://`` URL).

A URL may hold a password, which must never reach a log line, an error, ``/metrics`` or a command's
output: ``StoreURL`` keeps it, and prints (``str``, ``repr``, f-strings) without it, so that every
message that names the store can name it as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from distill.store.records import StoreError

SCHEMES = ("postgresql://", "postgres://")
HIDDEN = "***"


class StoreURL:
    """A PostgreSQL store's URL (libpq's form: ``postgresql://user:password@host:port/database``).
    ``conninfo()`` is the URL itself, for the driver only; everything else sees it redacted."""

    __slots__ = ("_secret", "_url")

    def __init__(self, url: str) -> None:
        if not url.startswith(SCHEMES):
            raise StoreError(f"a store URL must start with postgresql://; got {_redact(url)!r}")
        self._url = url
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        self._secret = parts.password or query.get("password")

    def conninfo(self) -> str:
        return self._url

    def scrub(self, text: str) -> str:
        """``text`` (a driver's message, say) with this URL's password replaced, as written in the
        URL or decoded."""
        for secret in {self._secret, unquote(self._secret)} if self._secret else ():
            text = text.replace(secret, HIDDEN)
        return text

    @property
    def database(self) -> str:
        return urlsplit(self._url).path.lstrip("/") or "(the user's default)"

    def __str__(self) -> str:
        return _redact(self._url)

    def __repr__(self) -> str:
        return f"StoreURL({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoreURL) and other._url == self._url

    def __hash__(self) -> int:
        return hash(self._url)

    def __reduce__(self) -> tuple[type[StoreURL], tuple[str]]:
        """Picklable (a Ray actor opens the store from it)."""
        return (StoreURL, (self._url,))


StoreLocation = Path | StoreURL
"""A store's place: a SQLite file's path, or a PostgreSQL URL."""


def store_location(value: str | os.PathLike[str] | StoreURL) -> StoreLocation:
    """The location ``value`` names: a ``postgresql://`` URL selects PostgreSQL, anything else is a
    SQLite file's path. Also argparse's ``type=`` for ``--store`` and ``--audit-store``."""
    if isinstance(value, StoreURL):
        return value
    text = os.fspath(value)
    if text.startswith(SCHEMES):
        return StoreURL(text)
    if isinstance(value, Path) and text.startswith(("postgresql:/", "postgres:/")):
        raise StoreError(f"{_redact(text.replace(':/', '://', 1))} was given as a Path, which drops "
                         "the // of a URL; pass the store URL as a string")
    return Path(text)


def is_url(location: StoreLocation) -> bool:
    return isinstance(location, StoreURL)


def _redact(url: str) -> str:
    """``url`` without a password in its user part or its query."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", f":{HIDDEN}@", 1)
    query = urlencode([(k, HIDDEN if k == "password" else v) for k, v in parse_qsl(parts.query)],
                      safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
