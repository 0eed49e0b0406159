"""A tap on llama.cpp's graph: read a layer's output and cancel the layers above it.

``llama_context_params.cb_eval`` is asked about every node of the graph and called again once a
node's data is ready; returning false there stops the graph. Running a model's first ``L`` blocks
means reading ``l_out-{L-1}`` (llama.cpp's name for a block's output: a convention, not an API)
and returning false. A decode that ends without the tap seeing its layer is refused
(:meth:`LayerTap.check_seen`), and a tapped context refuses to read logits. What this relies on
and where it is checked: docs/mid-layer.md.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import llama_cpp
import numpy as np

from cascade.errors import ModelError


@cache
def _ggml() -> ctypes.CDLL:
    """libggml-base as bundled with llama-cpp-python (already loaded by libllama), typed."""
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    signatures: dict[str, tuple[type | None, list[type]]] = {
        "ggml_get_name": (ctypes.c_char_p, [ctypes.c_void_p]),
        "ggml_nelements": (ctypes.c_int64, [ctypes.c_void_p]),
        "ggml_nrows": (ctypes.c_int64, [ctypes.c_void_p]),
        "ggml_nbytes": (ctypes.c_size_t, [ctypes.c_void_p]),
        "ggml_backend_tensor_get": (None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                           ctypes.c_size_t]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def tensor_name(layer: int) -> bytes:
    """The graph's name for the output of the first ``layer`` blocks."""
    return f"l_out-{layer - 1}".encode()


class LayerTap:
    """Keeps the rows of the outputs of ``layers`` (blocks run, from 1) while armed, and stops
    every decode after the deepest of them.

    ``callback`` goes into ``llama_context_params.cb_eval``; the object must outlive the context.
    """

    def __init__(self, layers: Sequence[int]) -> None:
        if not layers or min(layers) < 1:
            raise ModelError(f"a layer tap needs layers of at least 1 block; got {list(layers)}")
        self.layers = tuple(sorted(set(layers)))
        self._names = {tensor_name(layer): layer for layer in self.layers}
        self._last = tensor_name(self.layers[-1])
        self.armed = False
        self.failure: ModelError | None = None
        self.seen = 0  # decodes (micro-batches) stopped at the deepest layer since the last check
        self._rows: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_node)

    def _on_node(self, tensor: int, ask: bool, user_data: int) -> bool:
        name = _ggml().ggml_get_name(tensor)
        if ask:
            return name == self._last or (self.armed and name in self._names)
        if self.armed and name in self._names:
            try:
                self._rows[self._names[name]].append(_read(tensor))
            except ModelError as error:  # raised in a C callback, it would be printed and lost
                self.failure = error
                return False
        if name == self._last:
            self.seen += 1
            return False
        return True

    def arm(self) -> None:
        """Keep the rows of the next decodes (until :meth:`take`)."""
        self.armed = True
        self._rows = {layer: [] for layer in self.layers}

    def take(self) -> dict[int, np.ndarray]:
        """Per layer, the rows kept since :meth:`arm` (micro-batches in order), and disarm."""
        rows = {layer: np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
                for layer, parts in self._rows.items()}
        self.armed = False
        self._rows = {layer: [] for layer in self.layers}
        return rows

    def check_seen(self, model: str) -> None:
        """Refuse a decode the tap did not stop (the graph has no tensor of that name) or could
        not read."""
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure
        if self.seen == 0:
            raise ModelError(f"{model}: llama.cpp's graph has no tensor {self._last.decode()!r}, so "
                             "this tier cannot stop at that layer; this architecture or "
                             "llama-cpp-python build names its layers otherwise")
        self.seen = 0


def _read(tensor: int) -> np.ndarray:
    """A float32 tensor's rows, copied to host memory (from any backend)."""
    lib = _ggml()
    n, rows = lib.ggml_nelements(tensor), lib.ggml_nrows(tensor)
    if lib.ggml_nbytes(tensor) != 4 * n:
        raise ModelError(f"internal: layer output {lib.ggml_get_name(tensor)!r} is not float32")
    out = np.empty((rows, n // rows), dtype=np.float32)
    lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, 4 * n)
    return out
