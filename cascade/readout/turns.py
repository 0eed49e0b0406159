"""One request at a time through a llama.cpp context.

A context is one KV cache: two requests decoding into it at once corrupt each other's sequences,
and crashed the process (SIGSEGV in ``llama_decode``) when one ``Cascade`` was called from
several threads. Every method of a scorer that touches its context holds the scorer's lock, so
a caller's threads take turns, and ``close`` waits for the reading in hand.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import wraps
from typing import Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class Locked(Protocol):
    lock: threading.Lock


S = TypeVar("S", bound=Locked)


def one_at_a_time(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """``method``, run while holding its object's ``lock``."""

    @wraps(method)
    def locked(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)

    return locked
