"""Where a store lives: a SQLite file (a path) or a PostgreSQL database (a ``postgresql://`` URL).

A URL may hold a password (in its user part, or as ``password=`` or ``sslpassword=`` in its query),
which must never reach a log line, an error, ``/metrics`` or a command's output: ``StoreURL`` keeps
it, and prints (``str``, ``repr``, f-strings) without it (``cascade.private.redact_url``), so that
every message that names the store can name it as it is.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from cascade.private import HIDDEN, redact_text, redact_url, url_secrets
from distill.store.records import StoreError

SCHEMES = ("postgresql://", "postgres://")
CONNINFO = re.compile(r"\s*(host|hostaddr|port|dbname|user|password|passfile|service|sslmode)\s*=")
"""A libpq key=value conninfo (``host=db dbname=labels``): not a path, and its password must not be
echoed as one."""


class StoreURL:
    """A PostgreSQL store's URL (libpq's form: ``postgresql://user:password@host:port/database``).
    ``conninfo()`` is the URL itself, for the driver only; everything else sees it redacted."""

    __slots__ = ("_secrets", "_url")

    def __init__(self, url: str) -> None:
        if not url.startswith(SCHEMES):
            raise StoreError(f"a store URL must start with postgresql://; got {redact_url(url)!r}")
        rest = url.partition("://")[2]
        if "@" in rest[:rest.rfind("@")]:  # libpq cut it at the first @ and quoted the password's end
            raise StoreError(f"{redact_url(url)} has an @ in its user or password: percent-encode it "
                             "as %40")
        try:
            urlsplit(url)
        except ValueError as exc:  # "Invalid IPv6 URL", say: never echoed with the URL's password
            raise StoreError(f"{redact_url(url)} is not a valid URL ({exc}); write it as "
                             "postgresql://USER:PASSWORD@HOST:PORT/DATABASE, with any @, / or : in "
                             "the password percent-encoded") from None
        self._url = url
        self._secrets = sorted(url_secrets(url), key=len, reverse=True)

    def conninfo(self) -> str:
        return self._url

    def scrub(self, text: str) -> str:
        """``text`` (a driver's message, say) with this URL's secrets replaced, as written in the
        URL or decoded, and any URL or password pair it quotes redacted."""
        for secret in self._secrets:
            text = text.replace(secret, HIDDEN)
        return redact_text(text)

    @property
    def database(self) -> str:
        return urlsplit(self._url).path.lstrip("/") or "(the user's default)"

    def __str__(self) -> str:
        return redact_url(self._url)

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
    scheme, sep, rest = text.strip().partition("://")
    if sep and scheme.lower() in ("postgresql", "postgres"):
        return StoreURL(f"{scheme.lower()}://{rest}")  # libpq reads the scheme in lower case only
    if isinstance(value, Path) and text.startswith(("postgresql:/", "postgres:/")):
        raise StoreError(f"{redact_url(text.replace(':/', '://', 1))} was given as a Path, which drops "
                         "the // of a URL; pass the store URL as a string")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise StoreError(f"{redact_url(text.strip())} is not a store: give a SQLite file's path, or a "
                         "PostgreSQL URL in libpq's form, postgresql://USER:PASSWORD@HOST:PORT/DATABASE "
                         "(no +driver)")
    if CONNINFO.match(text):
        raise StoreError(f"{redact_text(text)} looks like a key=value conninfo: give the PostgreSQL store "
                         "as a URL, postgresql://USER:PASSWORD@HOST:PORT/DATABASE")
    if (shown := _cut_short(text.strip())) is not None:  # made a SQLite file named after it
        raise StoreError(f"{shown} looks like a PostgreSQL URL cut short: give it whole, "
                         "postgresql://USER:PASSWORD@HOST:PORT/DATABASE (a SQLite file's path holds no "
                         "user@host or host:port)")
    return Path(text)


_PREFIX = re.compile(r"(?i)^postgres(ql)?:?/*")
_HOST_ONLY = re.compile(r"^([\w.-]+@)?[\w.-]+:\d+(/[\w.-]*)?$|^[\w.-]+@[\w.-]+(/[\w.-]*)?$")
"""``user@host``, ``host:port`` (``/database`` after either): a URL without its scheme."""
_FILES = (".sqlite", ".sqlite3", ".db")


def _cut_short(text: str) -> str | None:
    """``text`` shown without its password if it is a PostgreSQL URL cut short (``postgresql:`` with
    no ``//``, or no scheme: a ``user:password@`` before its host, ``user@host``, ``host:port``),
    which was taken for a SQLite file's name, password and all; None for a path."""
    prefix = _PREFIX.match(text)
    body = text[prefix.end():] if prefix else text
    at = body.rfind("@")
    colon = body.find(":", 0, at) if at > 0 else -1
    if colon >= 0:
        return f"{text[:len(text) - len(body)]}{body[:colon]}:{HIDDEN}{body[at:]}"
    if (prefix and ":" in prefix.group(0)) or (_HOST_ONLY.match(text) and not text.endswith(_FILES)):
        return text
    return None


def is_url(location: StoreLocation) -> bool:
    return isinstance(location, StoreURL)

