"""The torch side of fine-tuning: the student network, its batches, loss and loops.

Imported only once torch is known to be there (by ``distill.training.finetune`` and the ONNX export), so
that nothing else in the package needs torch (an optional extra) to import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm
from transformers import BertConfig, BertModel

from cascade.encoder.onnx_encoder import load_tokenizer
from distill.training.finetune_base import Targets, float_minilm

Wanted = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""question id -> (which rows of the batch it labels, the teacher's probabilities of those rows)."""

LOGIT_SCALE = 20.0
"""Pooled vectors have unit length, so a head's logits would span little without a scale."""


class Batches:
    """Tokenised items, padded per batch to the longest one (as the served encoder pads)."""

    def __init__(self, texts: Sequence[str], targets: Mapping[str, Targets], tokenizer: Path,
                 max_length: int) -> None:
        tok, self.pad_id, _ = load_tokenizer(tokenizer, max_length)
        self.ids = [encoding.ids for encoding in tok.encode_batch(list(texts))]
        self.targets = targets

    def get(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, Wanted]:
        width = max(len(self.ids[row]) for row in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(self.ids[row])] = self.ids[row]
            mask[i, : len(self.ids[row])] = 1
        wanted = {}
        for qid, target in self.targets.items():
            labelled = target.labelled[rows]
            if labelled.any():
                wanted[qid] = (torch.from_numpy(labelled),
                               torch.from_numpy(target.probs[rows][labelled].astype(np.float32)))
        return torch.from_numpy(ids), torch.from_numpy(mask), wanted


def minilm_body() -> BertModel:
    """The float all-MiniLM-L6-v2, as sentence-transformers trained it (no pooler)."""
    config, weights = float_minilm()
    body = BertModel(BertConfig.from_dict(config), add_pooling_layer=False)
    body.load_state_dict(weights, strict=False)
    return body


class Student(nn.Module):
    """The MiniLM body, pooled and normalised as served, with a linear head per question."""

    def __init__(self, targets: Mapping[str, Targets]) -> None:
        super().__init__()
        self.body = minilm_body()
        hidden = self.body.config.hidden_size
        self.heads = nn.ModuleDict({qid: nn.Linear(hidden, t.probs.shape[1]) for qid, t in targets.items()})

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.body(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        vector = nn.functional.normalize(mean, dim=-1) * LOGIT_SCALE
        return {qid: head(vector) for qid, head in self.heads.items()}


class Served(nn.Module):
    """A body with the signature the ONNX encoder serves: three inputs, hidden states out."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.body(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids).last_hidden_state


def soft_loss(logits: Mapping[str, torch.Tensor], wanted: Wanted) -> torch.Tensor:
    """Cross-entropy to the teacher's probabilities, the mean over the questions labelled."""
    losses = [-(probs * torch.log_softmax(logits[qid][rows], dim=-1)).sum(-1).mean()
              for qid, (rows, probs) in wanted.items()]
    return torch.stack(losses).mean()


def train_epoch(model: Student, optimiser: Any, batches: Batches, order: np.ndarray, size: int,
                desc: str, progress: bool) -> float:
    """One pass over ``order`` in batches of ``size``; the mean batch loss."""
    model.train()
    total, count = 0.0, 0
    for start in tqdm(range(0, len(order), size), desc=desc, unit="batch", disable=not progress,
                      leave=False):
        ids, mask, wanted = batches.get(order[start : start + size])
        if not wanted:
            continue
        loss = soft_loss(model(ids, mask), wanted)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        total, count = total + loss.item(), count + 1
    return total / max(count, 1)


def evaluate(model: Student, batches: Batches, rows: np.ndarray, size: int) -> tuple[float, float]:
    """Held-out soft cross-entropy and argmax agreement with the teacher, over labelled pairs."""
    model.eval()
    loss, agree, pairs = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(rows), size):
            ids, mask, wanted = batches.get(rows[start : start + size])
            logits = model(ids, mask)
            for qid, (labelled, probs) in wanted.items():
                log_p = torch.log_softmax(logits[qid][labelled], dim=-1)
                loss += float(-(probs * log_p).sum())
                agree += int((log_p.argmax(-1) == probs.argmax(-1)).sum())
                pairs += len(probs)
    return loss / max(pairs, 1), agree / max(pairs, 1)
