"""How the fine-tuned encoder should compute: serve cost, parity with float, and batch invariance.

The fine-tune's ONNX export (``distill.training.onnx_export``) is dynamic int8: weights int8, activations
quantized per call with one scale over the whole batch, so a text's vector depends on the texts
batched with it. Each way below serves the same float MiniLM body (exported as the fine-tune
exports it), on the same AG News texts, in one process, in interleaved rounds:

- ``float``: no quantization;
- ``dynamic int8, batches of 8``: what the export served until now;
- ``dynamic int8, one text a call``: the same file, each text alone, single-threaded calls side
  by side, one per thread (what ``Encoder`` now does for a model that quantizes per call);
- ``int8 weights (MatMulNBits), int8 activations per row``: ONNX Runtime's weight-only 8-bit
  MatMul, accuracy level 4, whose activations are quantized per row block (needs ``onnx_ir``);
- ``static int8 (QDQ)``: activation scales fixed at export from 128 calibration texts.

For each: milliseconds per text (serving as ``Encoder.encode`` batches it, threads as given),
the largest coordinate difference between a text's vector alone and in batches of 8 and 32, and
the cosine of each vector with the float model's. Ratios are against today's batched dynamic int8.

    PYTHONPATH=. .venv/bin/python -m bench.encoder_quant --texts 200 --rounds 5 --threads 2
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from bench.common import WALL, argument_parser, in_rounds, read_rows
from cascade.encoder.onnx_encoder import CPU, Encoder, EncoderFiles, _load_session, default_encoder_files

Make = Callable[[Path, Path, list[str]], None]


def _dynamic(float_path: Path, out: Path, _: list[str]) -> None:
    from distill.training.onnx_export import _quantize

    _quantize(float_path, out)


def _nbits(float_path: Path, out: Path, _: list[str]) -> None:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(float_path)), bits=8, block_size=32,
                                     is_symmetric=True, accuracy_level=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=False)


def _static(float_path: Path, out: Path, texts: list[str]) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    encoder = Encoder(EncoderFiles(float_path, default_encoder_files().tokenizer))
    feeds = iter([{"input_ids": np.array([e.ids]), "attention_mask": np.array([e.attention_mask]),
                   "token_type_ids": np.array([e.type_ids])} for e in encoder._tokenize(texts)])

    class Reader(CalibrationDataReader):
        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(feeds, None)

    quantize_static(str(float_path), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    weight_type=QuantType.QInt8, activation_type=QuantType.QInt8,
                    op_types_to_quantize=["MatMul"])


def _all_threads(encoder: Encoder, threads: int | None) -> Encoder:
    """``encoder`` as it ran a per-call quantized model until now: one session on all threads
    (a ``texts_alone`` encoder runs single-threaded calls side by side instead)."""
    encoder._session = _load_session(encoder.files.model, [CPU], threads)
    return encoder


def _batched(encoder: Encoder, texts: list[str], size: int) -> np.ndarray:
    """The model run on batches of ``size`` length-sorted texts, whatever ``texts_alone`` says."""
    encodings = encoder._tokenize(texts)
    order = sorted(range(len(texts)), key=lambda row: len(encodings[row].ids))
    out = np.empty((len(texts), encoder.dim), dtype=np.float32)
    for start in range(0, len(order), size):
        rows = order[start : start + size]
        out[rows] = encoder._encode_batch([encodings[row] for row in rows])
    return out


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    from distill.training.onnx_export import _export_float
    from distill.training.student import minilm_body

    rows = [row["text"] for row in read_rows("ag_news_test.jsonl", args.texts + 128)]
    texts, calibration = rows[: args.texts], rows[args.texts :]
    tokenizer = default_encoder_files().tokenizer
    with tempfile.TemporaryDirectory() as work:
        float_path = Path(work) / "float.onnx"
        _export_float(minilm_body(), float_path)
        makers: dict[str, Make] = {"dynamic": _dynamic, "static": _static, "nbits": _nbits}
        if importlib.util.find_spec("onnx_ir") is None:
            print("int8 weights (MatMulNBits): not measured, its quantizer needs `pip install onnx_ir`")
            makers.pop("nbits")
        paths = {"float": float_path}
        for name, make in makers.items():
            paths[name] = Path(work) / f"{name}.onnx"
            make(float_path, paths[name], calibration)
        encoders = {name: Encoder(EncoderFiles(path, tokenizer), threads=args.threads)
                    for name, path in paths.items()}
        batched = _all_threads(Encoder(EncoderFiles(paths["dynamic"], tokenizer)), args.threads)
        ways = {
            "float": Way(encoders["float"], served=True),
            BASELINE: Way(batched, served=False),
            "dynamic int8, one text a call (now)": Way(encoders["dynamic"], served=True),
            "static int8 (QDQ)": Way(encoders["static"], served=True),
        }
        if "nbits" in encoders:
            ways["int8 weights (MatMulNBits), int8 per row"] = Way(encoders["nbits"], served=True)
        _report(ways, texts, args.rounds)


BASELINE = "dynamic int8, batches of 8 (until now)"


@dataclass(frozen=True)
class Way:
    """An encoder, and whether it runs as ``Encoder.encode`` serves it (else batched by hand)."""

    encoder: Encoder
    served: bool

    def run(self, texts: list[str], size: int = 8) -> np.ndarray:
        """The vectors of ``texts`` in batches of ``size``."""
        return _served(self.encoder, texts, size) if self.served else _batched(self.encoder, texts, size)


def _report(ways: dict[str, Way], texts: list[str], rounds: int) -> None:
    vectors = {name: way.run(texts) for name, way in ways.items()}  # also the warm-up
    timed = in_rounds({name: partial(way.run, texts) for name, way in ways.items()}, rounds, WALL)
    seconds = {name: values["wall"] for name, values in timed.items()}
    reference = vectors["float"]
    baseline = statistics.median(seconds[BASELINE])
    print(f"{len(texts)} AG News texts, median of {rounds} interleaved rounds; batch diff: largest "
          "|coordinate| between a text alone and in batches of 8 and 32")
    print(f"{'way':44} {'ms/text':>8} {'x today':>8} {'batch diff':>11} {'cos min':>8} {'cos mean':>9}")
    for name, times in seconds.items():
        way = ways[name]
        alone = np.stack([_batched(way.encoder, [text], 1)[0] for text in texts])
        diff = max(float(np.abs(way.run(texts, size) - alone).max()) for size in (8, 32))
        cosine = np.sum(vectors[name] * reference, axis=1)
        median = statistics.median(times)
        print(f"{name:44} {1e3 * median / len(texts):8.2f} {median / baseline:8.2f} {diff:11.2e} "
              f"{cosine.min():8.4f} {cosine.mean():9.5f}")


def _served(model: Encoder, texts: list[str], size: int) -> np.ndarray:
    """What ``Encoder.encode`` serves with ``batch_size`` = ``size``."""
    model.batch_size = size
    try:
        return model.encode(texts)
    finally:
        model.batch_size = 8


if __name__ == "__main__":
    main()
