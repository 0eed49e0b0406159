"""Old spellings the ``cascade`` command still takes for one release: a renamed flag (``demo
--target``, now ``--target-agreement``) or a renamed value of a flag (``calibrate --calibrate-on
audit``, now ``traffic``). Each works as its new spelling does, after one warning line on stderr
that names the new spelling, so that a script keeps running while it is being fixed.

To rename a flag: add the new one, then ``add_old_flag(parser, "--old", new_action)``. To rename
values: ``type=renamed_values("--flag", {old: new})`` beside ``choices=`` (the new values). Remove
the old spelling in the release after.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def warn_renamed(old: str, new: str) -> None:
    """The one deprecation line, said the same for a flag and for a value."""
    print(f"cascade: warning: {old} is deprecated and goes in the next release; use {new}",
          file=sys.stderr)


class _OldFlag(argparse.Action):
    """A flag's old spelling: its value goes where the new flag's goes, after the warning."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        warn_renamed(option_string or self.option_strings[0], self.new)
        setattr(namespace, self.dest, values)


def is_old_flag(action: argparse.Action) -> bool:
    """Whether ``action`` is an old spelling kept for one release (hidden from --help)."""
    return isinstance(action, _OldFlag)


def add_old_flag(p: argparse.ArgumentParser, old: str, new: argparse.Action) -> None:
    """Take ``old`` for one release as ``new``'s flag: the same destination, type (so the same
    range check) and choices, left out of --help so that only the new name is taught."""
    typed: dict[str, Any] = {} if new.type is None else {"type": new.type}
    p.add_argument(old, action=_OldFlag, new=new.option_strings[0], dest=new.dest, choices=new.choices,
                   metavar=new.metavar, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **typed)


def renamed_values(flag: str, old: Mapping[str, str]) -> Callable[[str], str]:
    """A ``type`` for ``flag`` whose values were renamed: an old value becomes its new one, with
    the warning; any other text goes on to argparse's ``choices`` check unchanged."""
    def parse(text: str) -> str:
        if text in old:
            warn_renamed(f"{flag} {text}", f"{flag} {old[text]}")
            return old[text]
        return text
    return parse
