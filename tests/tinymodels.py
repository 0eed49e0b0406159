"""Tiny random-weight GGUF models for tests.

No package on PyPI ships a Qwen3.5-shaped (hybrid attention + Gated DeltaNet) model small enough
for a test suite, and the readout's behaviour on hybrids (a recurrent state that cannot be
rewound) differs from plain attention models. So the suite writes its own: a few hundred KiB,
random weights from a fixed seed, and a real byte-level BPE vocabulary so prompts, chat markers
and answer letters tokenize as they would with a Qwen vocabulary (" A".." P" are single tokens).

Import from test modules as ``from tinymodels import tiny_qwen35_path`` (pytest puts ``tests/``
on ``sys.path``) and wrap in a session-scoped fixture built on ``tmp_path_factory``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import re
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

LETTERS = "ABCDEFGHIJKLMNOP"
"""Option letters of the wire format; each is one token with and without a leading space."""

QWEN35_FILENAME = "tiny-qwen35.gguf"
LLAMA_FILENAME = "tiny-llama.gguf"

_N_MERGES = 760
"""Upper bound on trained merges; the corpus below runs out of pairs a little before this."""

_SPECIAL_TOKENS = (
    ("<|endoftext|>", gguf.TokenType.CONTROL),
    ("<|im_start|>", gguf.TokenType.CONTROL),
    ("<|im_end|>", gguf.TokenType.CONTROL),
    ("<think>", gguf.TokenType.USER_DEFINED),
    ("</think>", gguf.TokenType.USER_DEFINED),
)

# Text the merges are learned from: the kind of prompt the router builds (instructions, option
# lists, emails, JSON), so ordinary prompts tokenize into words rather than bytes.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. Read the message below and answer the question.
Help! My payouts have been failing for three days and nobody has replied to my emails.
Does this convey urgency? Which team should handle this? How severe is the problem?
Is the customer angry? Is this a question about billing? Does the message ask for a refund?
Options: billing, technical, sales, support, account, security, legal, shipping, other.
Payments, invoicing, refunds. Bugs, outages, errors, crashes. Minor, degraded, blocking.
Answer with the letter of the best option. Answer with yes or no. Answer: yes. Answer: no.
Question: Which department should handle this email? Choose one of the options below.
Hello team, I would like to know when my order will arrive. Thank you for your help.
The invoice I received this month is wrong, please send a new one as soon as possible.
Our website is down and customers cannot log in. This is very urgent for our business.
Can you please update the address on my account? It is not a problem if this takes a week.
I was charged twice for the same subscription and I want a refund for the second payment.
The app crashes every time I open the settings page on my phone. Please fix this bug.
We are happy with the service, but we have a few questions about the new pricing plan.
I think someone else has access to my account, because my password was changed yesterday.
Could you tell me how to export all of my data? I need it for a report by Friday.
Dear support, the package was delivered to the wrong house and I still have not got it.
Thanks again for the quick reply, everything works now and you can close the ticket.
The state is a JSON object with fields such as name, email, amount, status and date.
{"state": "Where is my money?", "type": "choice", "criteria": {"billing": "Payments"}}
{"name": "Alice", "email": "alice@example.com", "amount": 120, "status": "failed"}
Score the severity from 0 to 9, where 0 means no impact and 9 means everything is broken.
It was not clear what they wanted, so we asked them to send more details and a screenshot.
There is an error when I try to pay with my card, and the page says the request is invalid.
This is the third time I have written to you about this issue and I am still waiting.
The system should be able to answer most questions quickly and only ask the large model
about the hard ones, when it is not sure enough of its own answer to be trusted.
system
You are a careful assistant.
user
Help me with my account.
assistant
"""

# The Qwen2 pre-tokenizer's split rules, over ASCII (enough for the corpus above).
_PRETOKEN = re.compile(
    r"'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL])"
    r"|(?:[^\r\n\w]|_)?[^\W\d_]+"
    r"|\d"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


@dataclass(frozen=True)
class TinyVocab:
    """A byte-level BPE vocabulary as GGUF stores it (tokens, token types, merges)."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]

    def id_of(self, token: str) -> int:
        """Id of a token given in byte-to-unicode form (``"ĠA"`` for " A")."""
        return self.tokens.index(token)


@dataclass(frozen=True)
class TinyShape:
    """Hyperparameters of a tiny model, for tests that need them (cost model, layout)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_rot: int
    n_ctx_train: int = 4096
    rope_freq_base: float = 10_000.0
    rms_eps: float = 1e-6


@dataclass(frozen=True)
class TinyQwen35Shape(TinyShape):
    """Adds the Gated DeltaNet and M-RoPE hyperparameters of the ``qwen35`` architecture."""

    full_attention_interval: int = 4
    rope_sections: tuple[int, int, int, int] = (2, 1, 1, 0)
    ssm_conv_kernel: int = 4
    ssm_state_size: int = 16
    ssm_time_step_rank: int = 4
    ssm_group_count: int = 2

    @property
    def ssm_inner_size(self) -> int:
        """llama.cpp takes each value head to be ``ssm_state_size`` wide."""
        return self.ssm_state_size * self.ssm_time_step_rank


QWEN35_SHAPE = TinyQwen35Shape(
    n_embd=64,
    n_layer=4,
    n_head=4,
    n_head_kv=2,
    head_dim=32,
    n_ff=128,
    n_rot=8,
    rope_freq_base=10_000_000.0,
)
LLAMA_SHAPE = TinyShape(
    n_embd=64,
    n_layer=4,
    n_head=4,
    n_head_kv=2,
    head_dim=16,
    n_ff=128,
    n_rot=16,
)


def write_tiny_qwen35(path: Path, seed: int = 0, silent: Collection[int] = ()) -> Path:
    """Write a hybrid Qwen3.5-style model: blocks 0-2 Gated DeltaNet, block 3 full attention.

    The output head is tied to ``token_embd`` (no ``output.weight``), as in Qwen3.5-4B. Blocks in
    ``silent`` add nothing to the residual stream (their output projections are zero), so the
    state after the last loud block is the one the output head reads.
    """
    shape = QWEN35_SHAPE
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN35])
    _add_common_hparams(writer, "tiny-qwen35", shape)
    writer.add_rope_dimension_sections(list(shape.rope_sections))
    writer.add_full_attention_interval(shape.full_attention_interval)
    writer.add_ssm_conv_kernel(shape.ssm_conv_kernel)
    writer.add_ssm_inner_size(shape.ssm_inner_size)
    writer.add_ssm_state_size(shape.ssm_state_size)
    writer.add_ssm_time_step_rank(shape.ssm_time_step_rank)
    writer.add_ssm_group_count(shape.ssm_group_count)
    _add_vocab(writer, tiny_vocab(), pre="qwen35")
    weights = _Weights(writer, seed, silent)
    weights.normal("token_embd.weight", len(tiny_vocab().tokens), shape.n_embd)
    weights.ones("output_norm.weight", shape.n_embd)
    for block in range(shape.n_layer):
        if (block + 1) % shape.full_attention_interval == 0:
            _add_gated_attention(weights, f"blk.{block}", shape)
        else:
            _add_delta_net(weights, f"blk.{block}", shape)
        weights.ones(f"blk.{block}.post_attention_norm.weight", shape.n_embd)
        _add_swiglu(weights, f"blk.{block}", shape)
    return _finish(writer, path)


def write_tiny_llama(path: Path, seed: int = 0, silent: Collection[int] = ()) -> Path:
    """Write a plain attention-only llama-arch model with the same vocabulary (``silent``: as
    for ``write_tiny_qwen35``)."""
    shape = LLAMA_SHAPE
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    _add_common_hparams(writer, "tiny-llama", shape)
    _add_vocab(writer, tiny_vocab(), pre="qwen2")
    weights = _Weights(writer, seed, silent)
    weights.normal("token_embd.weight", len(tiny_vocab().tokens), shape.n_embd)
    weights.ones("output_norm.weight", shape.n_embd)
    weights.normal("output.weight", len(tiny_vocab().tokens), shape.n_embd)
    for block in range(shape.n_layer):
        prefix = f"blk.{block}"
        weights.ones(f"{prefix}.attn_norm.weight", shape.n_embd)
        weights.normal(f"{prefix}.attn_q.weight", shape.n_head * shape.head_dim, shape.n_embd)
        weights.normal(f"{prefix}.attn_k.weight", shape.n_head_kv * shape.head_dim, shape.n_embd)
        weights.normal(f"{prefix}.attn_v.weight", shape.n_head_kv * shape.head_dim, shape.n_embd)
        weights.normal(f"{prefix}.attn_output.weight", shape.n_embd, shape.n_head * shape.head_dim)
        weights.ones(f"{prefix}.ffn_norm.weight", shape.n_embd)
        _add_swiglu(weights, prefix, shape)
    return _finish(writer, path)


def tiny_qwen35_path(tmp_dir: Path) -> Path:
    """The tiny qwen35 model in ``tmp_dir``, written on first use (for session fixtures)."""
    path = tmp_dir / QWEN35_FILENAME
    return path if path.exists() else write_tiny_qwen35(path)


def tiny_llama_path(tmp_dir: Path) -> Path:
    """The tiny llama model in ``tmp_dir``, written on first use (for session fixtures)."""
    path = tmp_dir / LLAMA_FILENAME
    return path if path.exists() else write_tiny_llama(path)


_LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)


def silence_llama_logs() -> None:
    """Route llama.cpp's log lines (process-wide) to a no-op so test output stays readable."""
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())


@functools.cache
def tiny_vocab() -> TinyVocab:
    """The shared vocabulary: 256 byte tokens, learned merges, then the special tokens."""
    byte_tokens = list(_byte_to_unicode().values())
    merges = _train_merges(_pretoken_counts(_CORPUS), _pinned_merges(), _N_MERGES)
    tokens = list(dict.fromkeys(byte_tokens + [left + right for left, right in merges]))
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += [text for text, _ in _SPECIAL_TOKENS]
    types += [token_type for _, token_type in _SPECIAL_TOKENS]
    return TinyVocab(
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in types),
        merges=tuple(f"{left} {right}" for left, right in merges),
    )


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest above 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


def _to_symbols(text: str) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _pretoken_counts(corpus: str) -> Counter[str]:
    return Counter(_to_symbols(piece) for piece in _PRETOKEN.findall(corpus))


def _pinned_merges() -> list[tuple[str, str]]:
    """Merges that make " A".." P" and "(A".."(P" single tokens, as in Qwen vocabularies."""
    space, paren = _to_symbols(" "), _to_symbols("(")
    return [(space, letter) for letter in LETTERS] + [(paren, letter) for letter in LETTERS]


def _train_merges(
    counts: Counter[str], pinned: Iterable[tuple[str, str]], n_merges: int
) -> list[tuple[str, str]]:
    """Plain BPE training; ties go to the lexicographically smallest pair, so it is stable."""
    words = [(list(word), count) for word, count in sorted(counts.items())]
    merges = list(pinned)
    for pair in merges:
        _apply_merge(words, pair)
    while len(merges) < n_merges:
        pairs = _pair_counts(words)
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        _apply_merge(words, best)
        merges.append(best)
    return merges


def _pair_counts(words: list[tuple[list[str], int]]) -> Counter[tuple[str, str]]:
    pairs: Counter[tuple[str, str]] = Counter()
    for symbols, count in words:
        for pair in itertools.pairwise(symbols):
            pairs[pair] += count
    return pairs


def _apply_merge(words: list[tuple[list[str], int]], pair: tuple[str, str]) -> None:
    left, right = pair
    for symbols, _ in words:
        i = 0
        while i < len(symbols) - 1:
            if symbols[i] == left and symbols[i + 1] == right:
                symbols[i : i + 2] = [left + right]
            i += 1


def _add_vocab(writer: gguf.GGUFWriter, vocab: TinyVocab, pre: str) -> None:
    """Qwen conventions: bos = pad = <|endoftext|>, eos = <|im_end|>, no bos added."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(vocab.id_of("<|endoftext|>"))
    writer.add_pad_token_id(vocab.id_of("<|endoftext|>"))
    writer.add_eos_token_id(vocab.id_of("<|im_end|>"))
    writer.add_add_bos_token(False)


def _add_common_hparams(writer: gguf.GGUFWriter, name: str, shape: TinyShape) -> None:
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.n_rot)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)


def _add_gated_attention(weights: _Weights, prefix: str, shape: TinyQwen35Shape) -> None:
    """Full attention block: attn_q projects to query and output gate, hence twice the width."""
    q_width = shape.n_head * shape.head_dim
    kv_width = shape.n_head_kv * shape.head_dim
    weights.ones(f"{prefix}.attn_norm.weight", shape.n_embd)
    weights.normal(f"{prefix}.attn_q.weight", 2 * q_width, shape.n_embd)
    weights.normal(f"{prefix}.attn_k.weight", kv_width, shape.n_embd)
    weights.normal(f"{prefix}.attn_v.weight", kv_width, shape.n_embd)
    weights.normal(f"{prefix}.attn_output.weight", shape.n_embd, q_width)
    weights.ones(f"{prefix}.attn_q_norm.weight", shape.head_dim)
    weights.ones(f"{prefix}.attn_k_norm.weight", shape.head_dim)


def _add_delta_net(weights: _Weights, prefix: str, shape: TinyQwen35Shape) -> None:
    """Gated DeltaNet block; decay and step size follow the Qwen3-Next initialisation."""
    key_dim = shape.ssm_state_size * shape.ssm_group_count
    value_dim = shape.ssm_inner_size
    conv_dim = 2 * key_dim + value_dim
    heads = shape.ssm_time_step_rank
    weights.ones(f"{prefix}.attn_norm.weight", shape.n_embd)
    weights.normal(f"{prefix}.attn_qkv.weight", conv_dim, shape.n_embd)
    weights.normal(f"{prefix}.attn_gate.weight", value_dim, shape.n_embd)
    weights.normal(f"{prefix}.ssm_conv1d.weight", conv_dim, shape.ssm_conv_kernel, std=0.2)
    step = weights.uniform(0.001, 0.1, heads)
    weights.put(f"{prefix}.ssm_dt.bias", np.log(np.expm1(step)))
    weights.put(f"{prefix}.ssm_a", -weights.uniform(1.0, 16.0, heads))
    weights.normal(f"{prefix}.ssm_beta.weight", heads, shape.n_embd)
    weights.normal(f"{prefix}.ssm_alpha.weight", heads, shape.n_embd)
    weights.ones(f"{prefix}.ssm_norm.weight", shape.ssm_state_size)
    weights.normal(f"{prefix}.ssm_out.weight", shape.n_embd, value_dim)


def _add_swiglu(weights: _Weights, prefix: str, shape: TinyShape) -> None:
    weights.normal(f"{prefix}.ffn_gate.weight", shape.n_ff, shape.n_embd)
    weights.normal(f"{prefix}.ffn_up.weight", shape.n_ff, shape.n_embd)
    weights.normal(f"{prefix}.ffn_down.weight", shape.n_embd, shape.n_ff)


class _Weights:
    """Adds float32 tensors drawn from one seeded generator, in call order (so: reproducible).

    Shapes are numpy order (rows, columns), the reverse of ggml's ``ne``.
    """

    def __init__(self, writer: gguf.GGUFWriter, seed: int, silent: Collection[int] = ()) -> None:
        self._writer = writer
        self._rng = np.random.default_rng(seed)
        self._silent = {f"blk.{block}.{name}" for block in silent for name in _OUTPUT_PROJECTIONS}

    def normal(self, name: str, *shape: int, std: float = 0.02) -> None:
        self.put(name, self._rng.standard_normal(shape) * std)

    def uniform(self, low: float, high: float, size: int) -> np.ndarray:
        return self._rng.uniform(low, high, size)

    def ones(self, name: str, size: int) -> None:
        self.put(name, np.ones(size))

    def put(self, name: str, values: np.ndarray) -> None:
        """Add the tensor (zeros for a silent block's output projection: the draws stay the same)."""
        self._writer.add_tensor(name, (0 * values if name in self._silent else values).astype(np.float32))


_OUTPUT_PROJECTIONS = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")
"""A block's writes into the residual stream: zero them and the block passes its input on."""


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
