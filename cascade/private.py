"""What stays private: secrets kept out of text, and customer text kept in files only its owner reads.

Secrets: a URL may carry a password in its user part (``https://user:PASSWORD@host/...``,
``postgresql://user:PASSWORD@host/db``) and in its query (``?password=...``, ``?sslpassword=...``),
and a libpq conninfo in ``key=value`` pairs (``password=... sslpassword='...'``). Every message,
log line, response body, banner or schema that names an upstream or a store names it through
``redact_url``; text that may quote one (an exception of a driver or of httpx) goes through
``redact_text``; a server's log handlers go through ``RedactingFilter`` (``redact_logs``), so
that a traceback a library logs (uvicorn's, of a bug) is redacted too. All keep what a reader
needs to act (scheme, user, host, port, path) and put ``***`` where a secret was. A URL too
malformed to parse is redacted all the same: its user part is taken up to its last ``@``, so a
password holding ``/``, ``?`` or ``@`` unencoded is hidden too.

Files: stores of collected traffic, audits, escalations and labels hold customer text.
``private_file`` creates such a file readable and writable by its owner alone (0600) before a
library opens it; SQLite then makes its ``-wal``, ``-shm`` and ``-journal`` files with the same
mode as the database file.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TextIO
from urllib.parse import unquote

HIDDEN = "***"
PRIVATE_MODE = 0o600
_PAIR = re.compile(r"(?i)(?<!\w)(\w*(?:password|passwd|secret|token|key|signature|sig|code|auth\w*"
                   r"|credential\w*)\s*=\s*)"
                   r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s&#'\"]*)")
"""A secret's pair, in a URL's query or a conninfo (its value quoted or not): ``password=``,
``sslpassword=``, and the ``api_key=``, ``token=``, ``secret=``, ``sig=``, ``auth=``, ``code=`` (an
Azure Functions key) an upstream's URL may carry."""
_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s'\"<>]*)")
"""A URL in free text: its scheme, then everything up to a space or a quote."""


def redact_url(url: str) -> str:
    """``url`` without its secrets: the password of its user part and the values of its secret
    parameters (``_PAIR``: ``*password=``, ``api_key=``, ``token=``...) become ``***`` (a
    conninfo's pairs too). Never raises."""
    scheme, sep, rest = url.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        url = f"{scheme}://{_without_password(rest, scheme)}"
    return _PAIR.sub(lambda m: m[1] + HIDDEN, url)


def redact_text(text: str) -> str:
    """``text`` (a driver's or a library's message, say) with every URL in it redacted as
    ``redact_url`` does, and every ``*password=`` pair's value hidden."""
    text = _URL.sub(lambda m: m[1] + _without_password(m[2], m[1][:-3]), text)
    return _PAIR.sub(lambda m: m[1] + HIDDEN, text)


def url_secrets(url: str) -> set[str]:
    """The secrets ``url`` holds (its user part's password, its ``*password=`` values), as
    written and percent-decoded, and their pieces between ``@ / : ? #`` of 3 characters or more
    (a driver that cut a malformed URL elsewhere may quote one): what to look for in a message."""
    found: set[str] = set()
    _, sep, rest = url.partition("://")
    if sep and "@" in rest:
        user_part = rest[:rest.rfind("@")]
        if ":" in user_part:
            found.add(user_part.split(":", 1)[1])
        elif _token_user(url.partition("://")[0]):
            found.add(user_part)
    found.update(m[2].strip("'\"") for m in _PAIR.finditer(url))
    forms = {form for secret in found if secret for form in (secret, unquote(secret))}
    return forms | {piece for form in forms for piece in re.split(r"[@/:?#]", form) if len(piece) >= 3}


def _without_password(rest: str, scheme: str) -> str:
    """What follows a URL's ``://`` with the password of its user part hidden (the user is kept),
    and an http(s) user part with no password hidden whole: there it is a token
    (``https://TOKEN@host``), where a database URL's lone user is a name."""
    at = rest.rfind("@")
    if at < 0:
        return rest
    user, colon, _ = rest[:at].partition(":")
    if colon:
        return f"{user}:{HIDDEN}@{rest[at + 1:]}"
    return f"{HIDDEN}@{rest[at + 1:]}" if _token_user(scheme) else rest


def _token_user(scheme: str) -> bool:
    """Whether a lone user part of a ``scheme`` URL is a credential (http, https, ws, wss)."""
    return scheme.lower() in ("http", "https", "ws", "wss")


class RedactingFilter(logging.Filter):
    """A handler's filter that writes every record redacted (``redact_text``): its message, and
    its traceback where it has one."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.msg, record.args, record.exc_info = redact_text(message), None, None
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


def redact_logs(*names: str) -> None:
    """Put a ``RedactingFilter`` on every handler of the root logger and of the loggers ``names``
    (a library's that does not propagate to the root, as uvicorn's), once each."""
    for name in ("", *names):
        for handler in logging.getLogger(name or None).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())


def private_text(path: Path) -> TextIO:
    """``path`` opened to write text (truncated), readable and writable by its owner alone (0600,
    whatever the umask or the mode it had): for files that hold customer text. Never through a
    symbolic link: one planted at ``path`` sent the text to wherever it pointed."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                             PRIVATE_MODE)
    except OSError as exc:
        if not path.is_symlink():
            raise
        # an OSError (errors.py imports this module): the commands print it as one line
        raise PermissionError(f"{path} is a symbolic link; customer text is not written through one: "
                              "remove it, or give another path") from exc
    os.fchmod(descriptor, PRIVATE_MODE)
    return os.fdopen(descriptor, "w", encoding="utf-8")


def private_file(path: Path) -> None:
    """Create ``path`` (empty) readable and writable by its owner alone, where it does not exist
    yet; a file that exists keeps the mode its owner gave it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    except FileExistsError:
        return
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, PRIVATE_MODE)  # exactly 0600, whatever the umask
    finally:
        os.close(fd)
