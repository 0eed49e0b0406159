"""Files a bundle pins by content: the two kinds of pin, checking a pinned file, writing one.

A model file (encoder, GGUF) lives outside the bundle and is pinned by absolute path and sha256;
a file the bundle writes (heads, n-grams, split) lives inside its folder and is pinned by name and
sha256. A pinned file whose bytes changed is refused: thresholds calibrated for one model say
nothing about another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cascade.atomic import write_atomically
from cascade.errors import BundleError
from cascade.hashing import file_sha256


class _Pin(BaseModel):
    model_config = ConfigDict(extra="forbid")


Sha256 = Annotated[str, Field(pattern="^[0-9a-f]{64}$")]


class ModelFile(_Pin):
    """A model file outside the bundle, pinned by content."""

    path: str
    sha256: Sha256

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not Path(value).is_absolute():
            raise ValueError(f"must be an absolute path, so the bundle loads from any directory; "
                             f"got {value!r}")
        return value

    @classmethod
    def of(cls, path: Path) -> ModelFile:
        resolved = Path(path).resolve()
        return cls(path=str(resolved), sha256=file_sha256(resolved))


class BundleFile(_Pin):
    """A file inside the bundle folder, named relative to it."""

    name: str
    sha256: Sha256

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not value or Path(value).name != value or value.startswith("."):
            raise ValueError(f"must be a file name inside the bundle folder, without a folder or "
                             f"leading dot; got {value!r}")
        return value

    @classmethod
    def of(cls, directory: Path, name: str) -> BundleFile:
        """Pin a file already written into the bundle folder ``directory``."""
        return cls(name=name, sha256=file_sha256(Path(directory) / name))


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BundleError(f"cannot read {what} {path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{what} {path} is not valid JSON ({exc}); re-train the bundle") from None


def check_model_file(what: str, model: ModelFile, manifest: Path) -> None:
    path = Path(model.path)
    repoint = (f"re-point its 'path' in {manifest} to the file the bundle was "
               "trained with, or re-train the bundle")
    if not path.is_file():
        raise BundleError(f"{what} {path} not found; {repoint}")
    actual = file_sha256(path)
    if actual != model.sha256:
        raise BundleError(f"{what} {path} has sha256 {actual}, but the bundle expects "
                          f"{model.sha256}: it is not the file the bundle was trained with; {repoint}")


def check_bundle_file(what: str, inside: BundleFile, directory: Path) -> None:
    path = directory / inside.name
    if not path.is_file():
        raise BundleError(f"{what} {path} is missing from the bundle; re-train the bundle")
    actual = file_sha256(path)
    if actual != inside.sha256:
        raise BundleError(f"{what} {path} has sha256 {actual}, but the manifest expects "
                          f"{inside.sha256}: it changed after the bundle was saved; re-train the bundle")


def write_json_file(directory: Path, name: str, data: Any) -> BundleFile:
    """Write a JSON file into a bundle folder atomically and pin it."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_atomically(Path(directory) / name, json.dumps(data, ensure_ascii=False) + "\n")
    return BundleFile.of(directory, name)

