"""One atomic write for every file the runtime saves (``cascade.atomic``): whole or not at all,
nothing left beside it, and fsynced (the file before its rename, the folder after it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest

from cascade.atomic import write_atomically
from cascade.heads import save_arrays
from cascade.pins import write_json_file


def test_text_bytes_or_a_writer_replace_the_file_and_leave_nothing_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    write_atomically(target, "première\n")
    assert target.read_bytes() == "première\n".encode()
    write_atomically(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    write_atomically(target, lambda out: out.write(b"written by a function"))
    assert target.read_bytes() == b"written by a function"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "heads.npz"
    save_arrays(target, {"coef": np.arange(3.0)})
    before = target.read_bytes()

    def half_then_fail(out: BinaryIO) -> None:
        out.write(b"half a file")
        raise OSError("the disk is full")

    with pytest.raises(OSError, match="the disk is full"):
        write_atomically(target, half_then_fail)
    with pytest.raises(ValueError, match="pickle"):  # np.savez refuses an object array without pickle
        save_arrays(target, {"coef": np.array([{"a": 1}], dtype=object)})
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.npz"]
    with np.load(target) as archive:
        assert archive["coef"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fsynced descriptor through /proc")
def test_the_file_is_fsynced_before_its_rename_and_the_folder_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A power cut cannot be caused here, so the calls that survive one are watched (the real
    ``fsync`` and ``replace`` still run)."""
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def watched_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def watched_replace(source: str, target: str) -> None:
        events.append(("replace", str(target)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", watched_fsync)
    monkeypatch.setattr(os, "replace", watched_replace)
    folder = tmp_path.resolve()
    write_json_file(folder, "split.json", {"train": ["a"]})
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"]
    (_, synced), (_, replaced), (_, folder_synced) = events
    assert Path(synced).parent == folder and Path(synced).name.startswith("split.json")  # the temporary
    assert synced.endswith(".tmp") and replaced == str(folder / "split.json")
    assert folder_synced == str(folder)
