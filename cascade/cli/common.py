"""Helpers every subcommand shares."""

from __future__ import annotations

import argparse
from pathlib import Path

from cascade.errors import CascadeError


def read_text(path: Path, what: str) -> str:
    """A user-named file's text, or an error that names the file and what it should be."""
    if not path.is_file():
        raise CascadeError(f"{what} not found: {path}")
    return path.read_text(encoding="utf-8")


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """The two budget bounds, spelled the same wherever a cascade routes items."""
    p.add_argument("--budget-ms", type=float, metavar="X",
                   help="predicted milliseconds per item, pooled over each batch (default: no bound)")
    p.add_argument("--max-escalation", type=float, metavar="F",
                   help="most of each batch's questions the top tier may answer, 0..1 (default: no bound)")
