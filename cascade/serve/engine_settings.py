"""How a serving engine is set: its batching, its queues' bounds and what a refused job gets
(``cascade.serve.engine`` says what each does). A module of its own so that the command line,
the app and the tests set an engine without importing its machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Overload = Literal["refuse", "keep"]
DEFAULT_MAX_WAIT = 8.0
"""Seconds a request may expect to wait for the top tier: below the 10 s System One SDKs wait."""


@dataclass(frozen=True)
class EngineSettings:
    """``batch``: route the requests waiting at the encoder together (False: one at a time).
    ``max_batch``: most requests in one encoder batch. ``max_wait``: the expected wait past which
    the top tier's queue refuses a job. ``overload``: what a refused job gets (see the module).
    ``audit_queue``: most audits waiting for the top tier, and for the store (there at least
    ``max_batch``); past it one is dropped at random (and counted). ``audit_in_flight``: most
    audits at an upstream teacher at once.
    ``forward_auth``: callers' keys are the upstream's to check (see the module).
    ``lower_queue``: most requests waiting at a tier below the top; past it 503 with Retry-After
    (the top tier's queue is bounded by its expected wait instead)."""

    batch: bool = True
    max_batch: int = 64
    max_wait: float = DEFAULT_MAX_WAIT
    overload: Overload = "refuse"
    audit_queue: int = 64
    audit_in_flight: int = 4
    forward_auth: bool = False
    lower_queue: int = 1024
