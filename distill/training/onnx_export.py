"""A fine-tuned encoder body to the int8 ONNX file the fast tier serves, checked against itself.

The served file must look to ``cascade.encoder.onnx_encoder.Encoder`` exactly like the shipped MiniLM: inputs
``input_ids``, ``attention_mask``, ``token_type_ids``; first output per-token hidden states
(batch, sequence, 384). Dynamic int8 quantization (weights int8, activations quantized per call)
is what made the shipped model fast on CPU; it moves vectors a little, so the int8 file is
compared with the float one on real texts and refused past ``PARITY_MIN_COSINE``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cascade.bundle.sections import EncoderParity
from cascade.encoder.onnx_encoder import Encoder, EncoderFiles
from distill.training.finetune_base import FinetuneError, import_torch

OPSET = 17
PARITY_MIN_COSINE = 0.97
"""Lowest cosine allowed between an int8 and a float vector of the same text. The shipped int8
MiniLM against its float original measures 0.985 at worst on AG News texts (BENCHMARKS.md); a
fine-tuned body quantizes about as well, and a much lower figure means a broken export."""


def export_int8(body: Any, tokenizer: Path, out: Path, parity_texts: Sequence[str],
                max_length: int) -> EncoderParity:
    """Write ``body`` as int8 ONNX to ``out`` (atomically) and return its parity with float.

    The float export lives in a temporary folder beside ``out``, so a killed export leaves only
    that folder's files, which the next run's temporary folder never reads.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out.parent) as work:
        float_path, int8_path = Path(work) / "float.onnx", Path(work) / "int8.onnx"
        _export_float(body, float_path)
        _quantize(float_path, int8_path)
        parity = measure_parity(float_path, int8_path, tokenizer, parity_texts, max_length)
        if parity.min_cosine < PARITY_MIN_COSINE:
            raise FinetuneError(f"the int8 export moves a vector to cosine {parity.min_cosine:.4f} of "
                                f"the float one (allowed: >= {PARITY_MIN_COSINE}); the export is "
                                "broken, refusing to write it")
        os.replace(int8_path, out)
    return parity


def measure_parity(float_path: Path, int8_path: Path, tokenizer: Path, texts: Sequence[str],
                   max_length: int) -> EncoderParity:
    """Cosine of each text's int8 vector with its float vector, through the serving encoder."""
    if not texts:
        raise FinetuneError("parity needs at least one text")
    vectors = [Encoder(EncoderFiles(model=path, tokenizer=tokenizer), max_length=max_length)
               .encode(list(texts)) for path in (float_path, int8_path)]
    cosine = np.sum(vectors[0] * vectors[1], axis=1)
    return EncoderParity(texts=len(texts), min_cosine=float(cosine.min()), mean_cosine=float(cosine.mean()))


def _export_float(body: Any, path: Path) -> None:
    torch = import_torch()
    from distill.training.student import Served

    body.eval()
    example = torch.ones((2, 8), dtype=torch.int64)
    axes = {0: "batch", 1: "sequence"}
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with torch.no_grad():
        torch.onnx.export(
            Served(body), (example, example, torch.zeros_like(example)), str(path),
            input_names=names, output_names=["last_hidden_state"], opset_version=OPSET,
            dynamic_axes={name: axes for name in [*names, "last_hidden_state"]}, dynamo=False,
        )


def _quantize(float_path: Path, int8_path: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(float_path), str(int8_path), weight_type=QuantType.QInt8, per_channel=True)
