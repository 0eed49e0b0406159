"""Writing a file whole or not at all, and so that it stays written: one helper for every file
the runtime saves (a bundle's manifest and pinned JSON files, heads, n-gram weights).

The content goes to a temporary file in the target's folder (a rename across file systems would
not be atomic), which is flushed and fsynced, then renamed over the target (``os.replace``:
atomic), and the folder is fsynced so that the rename itself survives a power cut. A crash
leaves the old file or the new one, never half of one; an error while writing removes the
temporary file and leaves the old one as it was.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

Content = str | bytes | Callable[[BinaryIO], None]
"""What to write: text (written as UTF-8), bytes, or a function that writes into the open file."""


def write_atomically(path: Path, content: Content) -> None:
    """Replace ``path`` with ``content``, atomically and durably (see the module)."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            if isinstance(content, str):
                out.write(content.encode("utf-8"))
            elif isinstance(content, bytes):
                out.write(content)
            else:
                content(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """fsync a folder, which makes a rename in it durable (POSIX; Windows has no such call)."""
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
