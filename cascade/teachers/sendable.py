"""What an upstream call may send and pass on: an item's id as a header value HTTP allows, and an
upstream's reply (a body, a header) with the key the call carried masked, so that an upstream that
echoes a request's headers hands no client the server's key."""

from __future__ import annotations

import hashlib
import json
from urllib.parse import quote

from cascade.private import HIDDEN

HEADER_LIMIT = 200
"""The longest header value sent as given; a longer one goes as its sha256."""


def header_value(value: str) -> str:
    """``value`` as HTTP allows it in a header: anything outside visible ASCII (a space at an end,
    a non-ASCII letter, a newline) percent-encoded, and a value longer than ``HEADER_LIMIT`` as
    its sha256. Why: a request id is an item's id, which a corpus may spell any way; sent raw, a
    trailing space failed every try as "upstream unreachable" and a letter like 'é' raised
    UnicodeEncodeError out of the client."""
    quoted = quote(value, safe="".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%"))
    if len(quoted) > HEADER_LIMIT:
        return "sha256-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return quoted


def scrubbed(body: bytes, authorization: str | None) -> bytes:
    """``body`` (or a header's value) with the ``Authorization`` value it answered, and its
    credential alone, as ***: as sent, and as a JSON encoder may have escaped it (``\\/``)."""
    if not authorization:
        return body
    secrets = {authorization, authorization.split(" ", 1)[-1]}
    secrets |= {json.dumps(s)[1:-1] for s in secrets} | {s.replace("/", "\\/") for s in secrets}
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:
            body = body.replace(secret.encode("utf-8", "replace"), HIDDEN.encode())
    return body
