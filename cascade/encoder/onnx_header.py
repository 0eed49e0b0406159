"""What an ONNX file's weights are stored as, read from its protobuf without the ``onnx`` package.

The runtime does not install ``onnx`` (a fine-tune's extra does), and an answer's audit must still
say its encoder's precision. The file is a ``ModelProto``: field 7 is the graph, whose field 5
repeats the initializers (the weights), each a ``TensorProto`` whose field 2 is its element type.
Only those varints and the lengths of the fields stepped over are read, so a 90 MB model costs a
walk over a few hundred field headers, not a parse of its weights.
"""

from __future__ import annotations

import mmap
from collections import Counter
from pathlib import Path

from cascade.errors import ModelError

_GRAPH, _INITIALIZER, _DATA_TYPE = 7, 5, 2
_TYPES = {1: "fp32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool", 10: "fp16", 11: "fp64",
          16: "bf16", 21: "uint4", 22: "int4"}  # TensorProto.DataType
_QUANTIZED = ("int8", "uint8", "int4", "uint4")


def weight_types(path: Path) -> Counter[str]:
    """How many initializers of each element type the model at ``path`` stores."""
    try:
        with Path(path).open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            counts: Counter[str] = Counter()
            for field, start, end in _fields(data, 0, len(data)):
                if field == _GRAPH and end > start:
                    for inner, a, b in _fields(data, start, end):
                        if inner == _INITIALIZER and b > a:
                            counts[_element_type(data, a, b)] += 1
            return counts
    except (OSError, ValueError, IndexError) as exc:
        raise ModelError(f"cannot read {path} as an ONNX model: {exc}") from exc


def weight_precision(path: Path) -> str:
    """"int8" (or the quantized type) when any weight matrix is stored quantized, else the float
    type most weights have: what the audit of an encoder's answers reports."""
    counts = weight_types(path)
    quantized = [t for t in _QUANTIZED if counts[t]]
    if quantized:
        return quantized[0]
    floats = [(n, t) for t, n in counts.items() if t.startswith(("fp", "bf"))]
    return max(floats)[1] if floats else "unknown"


def _element_type(data: mmap.mmap, start: int, end: int) -> str:
    for field, value, _ in _fields(data, start, end):
        if field == _DATA_TYPE:
            return _TYPES.get(value, f"type {value}")
    return "unknown"


def _fields(data: mmap.mmap, start: int, end: int) -> list[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field in data[start:end]; for a varint
    field, (field number, value, -1). Fixed-width fields are stepped over."""
    out = []
    at = start
    while at < end:
        key, at = _varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            out.append((field, value, -1))
        elif wire == 2:
            size, at = _varint(data, at)
            out.append((field, at, at + size))
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire} at byte {at}")
    if at != end:
        raise ValueError(f"a field runs past its message's end (byte {at} of {end})")
    return out


def _varint(data: mmap.mmap, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
