"""What a flag's value may be: the argparse types every share, probability, rate, count and
duration of the ``cascade`` command goes through, and the files it writes and hashes it pins.

One type per kind of number, so that a flag of that kind is read the same way in every command,
and a value out of range ends in argparse's usage line naming the flag and the allowed range
(exit status 2), never in a traceback from deep inside a run. ``tests/test_cli_names.py`` walks
the parser and refuses a number flag whose type is not from here.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path


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


def local_threads(text: str) -> int:
    """CPU threads of models this process runs: 1 up to the machine's CPUs, refused now rather
    than when a model first loads (``cascade loop``'s first retrain, hours later)."""
    from cascade.checks import threads_beyond_cores

    value = whole_number(1)(text)
    if (beyond := threads_beyond_cores(value)) is not None:
        raise argparse.ArgumentTypeError(beyond)
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



def number_between(minimum: float, maximum: float) -> Callable[[str], float]:
    """A finite number in [minimum, maximum]: a target Ray turns into a whole count (0.1 wrote a
    count of 0, which Ray then refused; 1e308 overflowed)."""
    def parse(text: str) -> float:
        value = _number(text)
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be between {minimum:g} and {maximum:g}; got {text!r}")
        return value
    return parse


def output_file(text: str) -> Path:
    """A file a command writes: refused at once where it is a folder or its folder is missing,
    rather than when it is written, after the work (an evaluation's minutes, say)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file's path")
    if not path.absolute().parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text} does not exist; create it first")
    return path


def sha256_hex(text: str) -> str:
    """A GGUF's sha256: 64 hex digits (lower case), checked before a store is bound to it."""
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise argparse.ArgumentTypeError(f"must be a sha256 of 64 hex digits (sha256sum FILE); got {text!r}")
    return text.lower()
