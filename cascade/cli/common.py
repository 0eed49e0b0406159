"""Helpers every subcommand shares."""

from __future__ import annotations

from pathlib import Path

from cascade.errors import CascadeError


def read_text(path: Path, what: str) -> str:
    """A user-named file's text, or an error that names the file and what it should be."""
    if not path.is_file():
        raise CascadeError(f"{what} not found: {path}")
    return path.read_text(encoding="utf-8")
