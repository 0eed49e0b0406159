"""The number checks every public boundary shares, written once.

``True`` is an ``int`` to Python, and a flag passed where a number belongs is always a mistake,
so no check accepts a bool. ``is_real``, ``is_integer`` and ``is_finite`` accept any registered
number type (``numpy.float32``, ``numpy.int64``, ``fractions.Fraction``), as scikit-learn's
parameter checks do; ``is_int`` only Python's own, for counts handed to code that takes
nothing else (a tokenizer's lengths, a random seed).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, TypeGuard


def is_real(value: Any) -> TypeGuard[float]:
    """A real number (int, float, numpy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: Any) -> TypeGuard[int]:
    """An integral number (int, numpy integer), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_int(value: Any) -> TypeGuard[int]:
    """A Python int, not a bool (nor a numpy integer)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value: Any) -> TypeGuard[float]:
    """A real number that is neither infinite nor NaN, and fits a float (an int of 400 digits
    does not: math.isfinite would raise on it, so a check of untrusted input would fail as a bug)."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def threads_beyond_cores(threads: int) -> str | None:
    """Why ``threads`` CPU threads are refused here, or None. More threads than the machine's
    CPUs never speed a compute-bound pass: llama.cpp's threads wait for each other at every step,
    and ONNX Runtime made 100,000 intra-op threads for minutes before its first answer."""
    cores = os.cpu_count() or 1
    if threads <= cores:
        return None
    return (f"threads {threads} is more than this machine's {cores} CPUs, which only makes the threads "
            f"wait for each other; give at most {cores}, or leave threads out for the free cores")
