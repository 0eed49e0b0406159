"""``cascade serve``'s flags for what one request and one client may hold: the work a request
carries (``cascade.serve.limits``), the queues below the top tier, open connections, and how
long a client has to send its request."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TYPE_CHECKING

from cascade.questions import MAX_OPTIONS
from distill.cli.values import positive_seconds, whole_number

if TYPE_CHECKING:
    from cascade.serve.limits import RequestLimits

_LIMITS = {  # field of RequestLimits: (default, help)
    "state_chars": (100_000, "characters of the state as a prompt reads it: text, or JSON indented by 2 "
                    "(nested JSON grows, so it is measured as rendered) (default 100000): 413 above"),
    "state_depth": (32, "levels of nesting in a JSON state, or in a question's JSON instructions or "
                    "criteria (default 32): 422 above"),
    "questions": (64, "questions in one request (default 64): 413 above"),
    "options": (MAX_OPTIONS, "options or levels of one question, at most the wire's 255 (default 255): "
                "422 above"),
    "options_total": (1024, "options summed over a request's questions (default 1024): 413 above"),
    "question_chars": (100_000, "characters of a request's instructions, option texts and choice "
                       "keys, summed (default 100000): 413 above"),
}


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    limits = p.add_argument_group(
        "limits", "what one request may carry and one client may hold; each refusal names its limit. "
        "The defaults sit far above what the System One SDKs send and bound the work of the worst request")
    for name, (default, text) in _LIMITS.items():
        count = whole_number(1, MAX_OPTIONS if name == "options" else None)
        flag = f"--limit-{name.replace('_', '-')}"
        limits.add_argument(flag, dest=f"limit_{name}", metavar="N", type=count, default=default, help=text)
    limits.add_argument("--lower-queue", type=whole_number(1), default=1024, metavar="N",
                        help="most requests waiting at a tier below the top (default 1024); past it 503 with "
                        "Retry-After (the top tier's queue is bounded by its expected wait, --max-wait)")
    limits.add_argument("--max-connections", type=whole_number(1), default=512, metavar="N",
                        help="open connections (past it, a new one closes the one waiting longest for a "
                        "request's head) and requests in flight (past it, 503 server_busy with Retry-After; "
                        "/health is answered) (default 512)")
    limits.add_argument("--receive-timeout", type=positive_seconds, default=10.0, metavar="S",
                        help="seconds a client has to send a request's head, and again its body, and the "
                        "longest writing to it may stall unread (default 10): a slow head closes the "
                        "connection, a slow body gets 408, an answer left unread is dropped with the "
                        "connection")


def limits_of(args: argparse.Namespace) -> RequestLimits:
    """The request limits the flags give."""
    from cascade.serve.limits import RequestLimits

    return RequestLimits(**{f.name: getattr(args, f"limit_{f.name}") for f in fields(RequestLimits)})

