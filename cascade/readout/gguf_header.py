"""Read a GGUF file's header (metadata and tensor table) without building its tokenizer arrays.

Pricing a tier (``cascade.cost.roofline``) needs the hyperparameters and the tensor table only;
``gguf.GGUFReader`` also builds every element of the tokenizer's arrays (~10 s for gemma-3-270m's
262,144-token vocabulary on 2 cores). This reader steps over the values of ``tokenizer.*`` keys
and reads gemma's header in ~25 ms (bench/load_time.py). GGUF v2 and v3, little-endian; the
layout it reads is in docs/roofline.md.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)

from cascade.errors import ModelError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_SKIPPED = "tokenizer."
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
"""struct codes of the fixed-size value types."""


@dataclass(frozen=True)
class TensorInfo:
    """One row of the tensor table; ``shape`` as stored (ne[0] first), as GGUFReader gives it."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    n_elements: int
    n_bytes: int
    offset: int
    """Where its data starts, in bytes from the start of the tensor data."""


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (every key but ``tokenizer.*``, valued as GGUFReader's ``field.contents()``)
    and the tensor table in file order."""

    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


class _Malformed(Exception):
    """The reason a file is not a readable GGUF; ``read_header`` adds the path and the remedy."""


_TRUNCATED = "it ends before its header or tensor data does: a truncated copy?"


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF at ``path``; ModelError if it is missing, not GGUF or damaged."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist or is not a file; pass a .gguf path")
    try:
        with path.open("rb") as handle:
            if handle.read(len(_MAGIC)) != _MAGIC:
                raise _Malformed("no GGUF magic at its start")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _Cursor(buf, len(_MAGIC)).header()
    except struct.error as exc:
        raise _error(path, _TRUNCATED) from exc
    except UnicodeDecodeError as exc:
        raise _error(path, f"a key or string is not UTF-8: {exc}") from exc
    except (_Malformed, OSError) as exc:
        raise _error(path, str(exc)) from exc


def _error(path: Path, reason: str) -> ModelError:
    return ModelError(f"{path} is not a readable GGUF file ({reason}); pass a llama.cpp .gguf model")


class _Cursor:
    """A read position in the mapped file; reads past its end raise struct.error."""

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def take(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def take_many(self, code: str, count: int) -> tuple[Any, ...]:
        values = struct.unpack_from(f"<{count}{code}", self.buf, self.pos)
        self.pos += count * struct.calcsize(code)
        return values

    def skip_to(self, pos: int) -> None:
        if pos > len(self.buf):
            raise _Malformed(_TRUNCATED)
        self.pos = pos

    def string(self) -> str:
        start = self.pos + _U64.size
        self.skip_to(start + self.take(_U64))
        return self.buf[start:self.pos].decode("utf-8")

    def skip_strings(self, count: int) -> None:
        """Step over ``count`` strings reading only their lengths: no Python object per string."""
        buf, pos, unpack, size = self.buf, self.pos, _U64.unpack_from, _U64.size
        for _ in range(count):
            pos += size + unpack(buf, pos)[0]
        self.skip_to(pos)

    def value(self, key: str, kind: int, keep: bool) -> Any:
        """The value of ``kind`` here, or None (skipped) for an array that is not ``keep``."""
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take_many(_SCALARS[kind], 1)[0]
        if kind != GGUFValueType.ARRAY:
            raise _Malformed(f"key '{key}' has unknown value type {kind}")
        element, count = self.take(_U32), self.take(_U64)
        if element in _SCALARS:
            if keep:
                return list(self.take_many(_SCALARS[element], count))
            self.skip_to(self.pos + count * struct.calcsize(_SCALARS[element]))
        elif element == GGUFValueType.STRING:
            if keep:
                return [self.string() for _ in range(count)]
            self.skip_strings(count)
        else:  # nested arrays included: llama.cpp does not read them either
            raise _Malformed(f"key '{key}' is an array of unknown value type {element}")
        return None

    def header(self) -> GGUFHeader:
        version = self.take(_U32)
        if version not in _VERSIONS:
            raise _Malformed(f"GGUF version {version}; this reader knows versions 2 and 3")
        n_tensors, n_kv = self.take(_U64), self.take(_U64)
        metadata: dict[str, Any] = {}
        keys: set[str] = set()
        for _ in range(n_kv):
            key = self.string()
            if key in keys:
                raise _Malformed(f"key '{key}' appears twice")
            keys.add(key)
            keep = not key.startswith(_SKIPPED)
            value = self.value(key, self.take(_U32), keep)
            if keep:
                metadata[key] = value
        tensors = tuple(self.tensor() for _ in range(n_tensors))
        if len({t.name for t in tensors}) < len(tensors):
            raise _Malformed("two tensors share a name")
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise _Malformed(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        self.skip_to(data_start + max((t.offset + t.n_bytes for t in tensors), default=0))
        return GGUFHeader(metadata, tensors)

    def tensor(self) -> TensorInfo:
        name = self.string()
        shape = self.take_many("Q", self.take(_U32))
        raw_type, offset = self.take(_U32), self.take(_U64)
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise _Malformed(f"tensor '{name}' has ggml type {raw_type}, unknown to this gguf "
                             "package: upgrade gguf, or use a file of a known quantization") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = math.prod(shape)
        # GGUFReader's arithmetic, so that every figure priced from it stays the same
        return TensorInfo(name, shape, ggml_type, n_elements, n_elements * type_size // block_size,
                          offset)
