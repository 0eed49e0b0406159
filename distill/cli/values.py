"""What a flag's value may be: the argparse types every share, probability, rate, count and
duration of the ``cascade`` command goes through.

One type per kind of number, so that a flag of that kind is read the same way in every command,
and a value out of range ends in argparse's usage line naming the flag and the allowed range
(exit status 2), never in a traceback from deep inside a run. ``tests/test_cli_names.py`` walks
the parser and refuses a number flag whose type is not from here.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _number(text: str) -> float:
    """``text`` as a finite float, NaN where it is not one (so every range check refuses it)."""
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def share(text: str) -> float:
    """A share of items in [0, 1] (0: none, 1: all): --audit-share, --max-escalation, ..."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1]; got {text!r}")
    return value


def probability(text: str) -> float:
    """A probability strictly inside (0, 1): a target agreement or a delta, for which 0 and 1 ask
    for a certificate no finite sample gives."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a probability in (0, 1); got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0: a rate (calls a second), a millisecond budget, a regularisation."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A duration in seconds > 0: a timeout, a wait, a poll."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0; got {text!r}")
    return value


def seconds_or_zero(text: str) -> float:
    """A duration in seconds >= 0, where 0 turns the timed thing off (its help says what then)."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0; got {text!r}")
    return value


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A count: a whole number in [minimum, maximum] (no upper bound where None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number; got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more; got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}; got {value}")
        return value
    return parse

