"""Cost model: what one decision asks of a device, read from the GGUF itself.

A decision is prefill only (no token is generated), so its cost is compute: FLOPs ~= 2 x matmul
parameters x prompt tokens. The roofline says whether that holds on a device and gives the fastest
a decision could run there. Shapes come from the file's metadata and tensor table, not memory:
Qwen3.5-4B's vocabulary is 248,320 rows, and only 8 of its 32 blocks keep a KV cache.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cascade.checks import is_int
from cascade.errors import ModelError, RequestError

_F32_BYTES = 4
_F16_BYTES = 2
_ATTENTION_TENSORS = {"attn_k", "attn_k_b", "attn_kv_a_mqa"}
_RECURRENT_PREFIXES = ("ssm_", "time_mix_", "shortconv")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a GGUF model that its decision cost depends on.

    ``n_params_matmul`` counts the weights every prompt token multiplies (MoE experts scaled by
    the fraction routed per token; lookup tables and multi-token-prediction blocks excluded), and
    ``n_params_output`` the output head, which a readout runs only for the rows it reads.
    """

    name: str
    architecture: str
    n_params: int
    n_params_matmul: int
    n_params_output: int
    n_vocab: int
    n_layers: int
    n_attention_layers: int
    n_recurrent_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    recurrent_state_bytes: int
    file_bytes: int
    bits_per_weight: float
    output_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """f16 K and V of every attention layer; derived, so it cannot disagree with the heads."""
        per_layer = self.n_head_kv * (self.head_dim_k + self.head_dim_v) * _F16_BYTES
        return self.n_attention_layers * per_layer

    @property
    def weight_bytes(self) -> float:
        """Bytes a decision reads at least once: the per-token weights and the output head."""
        return self.n_params_matmul * self.bits_per_weight / 8 + self.output_bytes

    @classmethod
    def from_gguf(cls, path: Path) -> ModelShape:
        """Read the shape from metadata and tensor infos (cascade.readout.gguf_header: the tokenizer's
        arrays are skipped unread, and tensor data stays in the file)."""
        from cascade.readout.gguf_header import read_header  # imports gguf: only where a file is read

        path = Path(path)
        header = read_header(path)
        return cls.from_tables(path, header.metadata, header.tensors)

    @classmethod
    def from_tables(cls, path: Path, meta: dict[str, Any], tensors: Sequence[Any]) -> ModelShape:
        """The shape from a GGUF's metadata and its tensor table (objects with ``name``,
        ``shape`` as stored, ``n_elements`` and ``n_bytes``), however they were read: the tests
        and bench/load_time.py feed it GGUFReader's too, to check both readers agree. Values of
        the wrong type, a tensor named ``blk`` alone, or weights of no size are a ``ModelError``
        (they were a ValueError, IndexError or ZeroDivisionError traceback)."""
        try:
            shape = cls._read_tables(path, meta, tensors)
        except ModelError:
            raise
        except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, OverflowError) as exc:
            raise ModelError(f"{path}: its GGUF metadata or tensor table does not describe a model "
                             f"({type(exc).__name__}: {exc}); the file is damaged, or not one llama.cpp "
                             "loads") from None
        if shape.n_params_matmul <= 0 or shape.weight_bytes <= 0:
            raise ModelError(f"{path}: its tensor table holds no weights of any size; the file is damaged, "
                             "or not one llama.cpp loads")
        return shape

    @classmethod
    def _read_tables(cls, path: Path, meta: dict[str, Any], tensors: Sequence[Any]) -> ModelShape:
        arch = str(_required(meta, "general.architecture", path))
        n_layers = int(_required(meta, f"{arch}.block_count", path))
        n_layers -= int(meta.get(f"{arch}.nextn_predict_layers", 0))
        n_embd = int(_required(meta, f"{arch}.embedding_length", path))
        by_name = {t.name: t for t in tensors}
        head = by_name.get("output.weight", by_name.get("token_embd.weight"))
        if head is None:
            raise ModelError(f"{path}: has neither 'output.weight' nor 'token_embd.weight'; "
                             "a readout needs an output head")
        n_attention, n_recurrent = _layer_counts(by_name, n_layers)
        elements, nbytes = _matmul_totals(tensors, meta, arch, n_layers)
        return cls(
            name=str(meta.get("general.name", path.stem)), architecture=arch,
            n_params=sum(int(t.n_elements) for t in tensors),
            n_params_matmul=round(elements), n_params_output=int(head.n_elements),
            n_vocab=int(head.shape[-1]), n_layers=n_layers, n_attention_layers=n_attention,
            n_recurrent_layers=n_recurrent, n_embd=n_embd, **_heads(meta, arch, n_embd),
            recurrent_state_bytes=n_recurrent * _recurrent_floats(meta, arch, n_embd) * _F32_BYTES,
            file_bytes=path.stat().st_size,
            bits_per_weight=8 * nbytes / elements if elements else 0.0,
            output_bytes=int(head.n_bytes),
        )


def _required(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ModelError(f"{path}: GGUF metadata lacks '{key}'; the file is incomplete or was "
                         "written for another architecture")
    return meta[key]


def _heads(meta: dict[str, Any], arch: str, n_embd: int) -> dict[str, int]:
    """Head counts, with llama.cpp's defaults; a per-layer array (hybrids give recurrent layers
    0 KV heads) reduces to its largest value."""
    def largest(value: int | list[int]) -> int:
        return int(max(value, default=0)) if isinstance(value, list) else int(value)

    n_head = largest(meta.get(f"{arch}.attention.head_count", 0))
    head_dim_k = int(meta.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
    return {"n_head": n_head,
            "n_head_kv": largest(meta.get(f"{arch}.attention.head_count_kv", n_head)),
            "head_dim_k": head_dim_k,
            "head_dim_v": int(meta.get(f"{arch}.attention.value_length", head_dim_k))}


def _layer_counts(tensors: dict[str, Any], n_layers: int) -> tuple[int, int]:
    """Attention and recurrent blocks, told apart by the tensors they hold.

    Qwen3.5's recurrent blocks also carry an ``attn_qkv`` (the DeltaNet input projection), so a
    fused ``attn_qkv`` counts as attention only in a block with no recurrent tensor. A block may
    count as both (Falcon-H1 runs attention and Mamba side by side).
    """
    parts: dict[int, set[str]] = defaultdict(set)
    for name in tensors:
        fields = name.split(".")
        if fields[0] == "blk" and int(fields[1]) < n_layers:
            parts[int(fields[1])].add(fields[2])
    n_attention = n_recurrent = 0
    for names in parts.values():
        recurrent = any(n.startswith(_RECURRENT_PREFIXES) for n in names)
        n_recurrent += recurrent
        n_attention += bool(names & _ATTENTION_TENSORS) or ("attn_qkv" in names and not recurrent)
    return n_attention, n_recurrent


def _matmul_totals(tensors: Sequence[Any], meta: dict[str, Any], arch: str,
                   n_layers: int) -> tuple[float, float]:
    """Elements and bytes of the weights each prompt token multiplies (MoE: the routed share)."""
    routed = meta.get(f"{arch}.expert_used_count", 0) / max(meta.get(f"{arch}.expert_count", 1), 1)
    elements = nbytes = 0.0
    for tensor in tensors:
        fields = tensor.name.split(".")
        in_block = fields[0] == "blk"
        lookup = not in_block and ("_embd" in fields[0] or fields[0] == "output")
        unused = in_block and int(fields[1]) >= n_layers
        if lookup or unused or sum(int(d) > 1 for d in tensor.shape) < 2:
            continue
        share = routed if in_block and fields[2].endswith("_exps") else 1.0
        elements += share * int(tensor.n_elements)
        nbytes += share * int(tensor.n_bytes)
    return elements, nbytes


def _recurrent_floats(meta: dict[str, Any], arch: str, n_embd: int) -> int:
    """f32 state per recurrent layer and sequence: llama.cpp's n_embd_r + n_embd_s."""
    def key(name: str) -> int:
        return int(meta.get(f"{arch}.{name}", 0))

    if key("wkv.head_size"):
        return (int(meta.get(f"{arch}.token_shift_count", 2)) + key("wkv.head_size")) * n_embd
    if key("shortconv.l_cache"):
        return n_embd * (key("shortconv.l_cache") - 1)
    d_inner, d_state = key("ssm.inner_size"), key("ssm.state_size")
    conv = max(key("ssm.conv_kernel") - 1, 0) * (d_inner + 2 * key("ssm.group_count") * d_state)
    return conv + d_state * d_inner


def _check_count(name: str, value: int, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise RequestError(f"{name} must be an integer >= {minimum}; got {value!r}")


def decision_flops(shape: ModelShape, prompt_tokens: int, output_rows: int = 1) -> float:
    """FLOPs of one prefill that reads ``output_rows`` logit rows.

    ``2 * n_params_matmul * T + 2 * n_params_output * output_rows
    + 2 * n_attention_layers * n_head * (head_dim_k + head_dim_v) * T * (T + 1) / 2``:
    a multiply-add per weight per token; the head only for the rows read; and for each causal
    attention layer, Q.K and P.V against every earlier position. Left out, each well under 2%
    for the models here: norms, activations, the recurrent state update, sliding windows (which
    make the attention term an upper bound for gemma-3 past 512 tokens).
    """
    _check_count("prompt_tokens", prompt_tokens, 1)
    _check_count("output_rows", output_rows, 0)
    attention = shape.n_attention_layers * shape.n_head * (shape.head_dim_k + shape.head_dim_v)
    positions = prompt_tokens * (prompt_tokens + 1) / 2
    return (2.0 * shape.n_params_matmul * prompt_tokens + 2.0 * shape.n_params_output * output_rows
            + 2.0 * attention * positions)


def decision_bytes(shape: ModelShape, prompt_tokens: int) -> float:
    """Least memory traffic of one prefill: every weight read once, KV and recurrent state
    written once and read once. MoE: only the routed share of experts is counted, which is
    exact for one token and low for long prompts (which touch most experts)."""
    _check_count("prompt_tokens", prompt_tokens, 1)
    state = prompt_tokens * shape.kv_bytes_per_token + shape.recurrent_state_bytes
    return shape.weight_bytes + 2.0 * state


@dataclass(frozen=True)
class Roof:
    """A roof: dense fp16 tensor peak (FLOP/s) and memory bandwidth (bytes/s), with the source."""

    name: str
    peak_flops: float
    bandwidth: float
    note: str

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a workload waits on math rather than on memory."""
        return self.peak_flops / self.bandwidth


# Dense fp16 tensor-core peaks (datasheet "with sparsity" figures halved) and memory bandwidth.
# llama.cpp's quantized matmuls may take int8 paths instead: the roof bounds the fp16 path.
ROOFS: dict[str, Roof] = {d.name: d for d in (
    Roof("t4", 65e12, 320e9, "NVIDIA T4 datasheet: 65 TFLOPS FP16 tensor, 320 GB/s"),
    Roof("a10", 125e12, 600e9, "NVIDIA A10 datasheet: 125 TFLOPS FP16 tensor, 600 GB/s"),
    Roof("l4", 121e12, 300e9, "NVIDIA L4 datasheet: 242 TFLOPS FP16 sparse / 2, 300 GB/s"),
    Roof("h100", 989e12, 3.35e12, "NVIDIA H100 SXM datasheet: 1,979 TFLOPS FP16 sparse / 2, "
           "3.35 TB/s"),
    Roof("h200", 989e12, 4.8e12, "NVIDIA H200 datasheet: 1,979 TFLOPS FP16 sparse / 2, 4.8 TB/s"),
)}


def _best_seconds(work: Any, seconds: float) -> float:
    """Fastest of repeated runs within ``seconds`` (at least three, after one warm-up)."""
    if not seconds > 0:
        raise RequestError(f"seconds must be > 0; got {seconds!r}")
    work()
    best, deadline, runs = float("inf"), time.perf_counter() + seconds, 0
    while runs < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        work()
        best, runs = min(best, time.perf_counter() - start), runs + 1
    return best


def measure_cpu_flops(seconds: float = 1.0) -> float:
    """Sustained float32 matmul FLOP/s of this machine: numpy 1024^3 products, best of repeats."""
    n = 1024
    a, b = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
    return 2.0 * n**3 / _best_seconds(lambda: a @ b, seconds)


def measure_cpu_bandwidth(seconds: float = 0.5) -> float:
    """Memory bandwidth of this machine: numpy copies of 64 MiB (bytes read + written), best of."""
    src = np.ones(16 * 2**20, dtype=np.float32)
    dst = np.empty_like(src)
    return 2.0 * src.nbytes / _best_seconds(lambda: np.copyto(dst, src), seconds)


def cpu_roof(measured_flops: float | None = None,
               measured_bandwidth: float | None = None) -> Roof:
    """This machine as a roof, measured now (pass earlier measurements to skip that)."""
    flops = measure_cpu_flops() if measured_flops is None else measured_flops
    bandwidth = measure_cpu_bandwidth() if measured_bandwidth is None else measured_bandwidth
    return Roof("cpu", flops, bandwidth, "measured here: numpy float32 1024^3 matmul, 64 MiB "
                  "copy; llama.cpp's int8 dot-product kernels can run above this roof")


@dataclass(frozen=True)
class Roofline:
    """Where one decision sits against a device's roof."""

    prompt_tokens: int
    flops: float
    bytes: float
    intensity: float
    ridge: float
    bound: Literal["compute", "memory"]
    floor_seconds: float


def roofline(shape: ModelShape, device: Roof, prompt_tokens: int) -> Roofline:
    """Classify one decision of ``prompt_tokens`` tokens (one logit row read) on ``device``."""
    flops = decision_flops(shape, prompt_tokens)
    nbytes = decision_bytes(shape, prompt_tokens)
    intensity = flops / nbytes
    return Roofline(prompt_tokens=prompt_tokens, flops=flops, bytes=nbytes, intensity=intensity,
                    ridge=device.ridge, bound="compute" if intensity >= device.ridge else "memory",
                    floor_seconds=max(flops / device.peak_flops, nbytes / device.bandwidth))


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def format_roofline(shape: ModelShape, device: Roof, roofline: Roofline) -> str:
    """The table ``cascade roofline`` prints: every figure with its unit and where it came from."""
    rows = [
        ("model", f"{shape.name} ({shape.architecture}), {_si(shape.n_params, ' params')}, "
                  f"{shape.bits_per_weight:.2f} bits/weight"),
        ("layers", f"{shape.n_layers} ({shape.n_attention_layers} attention, "
                   f"{shape.n_recurrent_layers} recurrent)"),
        ("per token", f"{_si(shape.n_params_matmul, ' params')} in matmuls, KV "
                      f"{_si(shape.kv_bytes_per_token, 'B')}"),
        ("device", f"{device.name}: {_si(device.peak_flops, 'FLOP/s')}, "
                   f"{_si(device.bandwidth, 'B/s')} ({device.note})"),
        ("prompt", f"{roofline.prompt_tokens} tokens, one logit row read"),
        ("work", f"{_si(roofline.flops, 'FLOP')}, {_si(roofline.bytes, 'B')} moved"),
        ("intensity", f"{roofline.intensity:,.1f} FLOP/B vs ridge {roofline.ridge:,.1f} "
                      f"-> {roofline.bound}-bound"),
        ("floor", f"{roofline.floor_seconds * 1e3:.3f} ms (compute "
                  f"{roofline.flops / device.peak_flops * 1e3:.3f} ms, memory "
                  f"{roofline.bytes / device.bandwidth * 1e3:.3f} ms)"),
    ]
    return "\n".join(f"{label:<10} {text}" for label, text in rows)
