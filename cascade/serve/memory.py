"""Handing a retired bundle's memory back to the system.

A promotion lets the old bundle go whole (its encoder's ONNX session, its heads, its model
buffers), but it lives on in reference cycles until Python's collector happens to run, and
glibc's allocator then keeps the freed pages of its heap arenas for reuse: a server promoted again
and again settles about 250 MB higher (MiniLM and the 1.5B teacher: 1,880-1,897 MB resident over
swaps 31-40, against 1,625-1,644 MB with each retirement collected and its pages returned;
bench/swap_memory.py). ``give_back`` collects the garbage a retirement left and asks the allocator
to return what is free (``malloc_trim``); elsewhere than glibc it only collects.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Protocol

TRIM = True
"""Whether ``give_back`` returns freed pages (the benchmark turns it off for its baseline)."""


def give_back() -> None:
    """Collect the cycles a retired bundle left, then return the allocator's free pages."""
    gc.collect()
    if not TRIM:
        return
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


class Retiring(Protocol):
    def retire(self) -> None: ...


def retire(holder: list[Retiring]) -> None:
    """Retire the one engine ``holder`` holds (``Engine.retire``: its requests finish first), let
    it go, then give its memory back. Held in a list that this empties, so that the thread running
    this keeps no reference to the engine once it has retired."""
    engine = holder.pop()
    engine.retire()
    del engine
    give_back()
