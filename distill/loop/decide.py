"""Deciding every item of a corpus through a cascade into a JSONL file that a rerun resumes.

What ``cascade decide`` runs: items are routed in batches (one encoder batch and one budget
each), each batch's System One responses appended and flushed, so a kill loses at most one
batch, and items already in the file are skipped. An auditor (``cascade.audit``) audits the
items its sample chooses, and the escalations kept (``distill.loop.escalations``) are stored, before
the batch's lines are written.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tqdm import tqdm

from cascade.audit.auditor import Auditor
from cascade.corpus import count_items
from cascade.errors import CascadeError
from cascade.routing.budget import Budget
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from distill.loop.escalations import KeptEscalations
from distill.options import CorpusInput, RunOptions, option, refuse


@dataclass
class Decided:
    """What a run wrote: items decided now, items found already decided, answers per tier, and
    the questions left without an answer (item id, question id, why: ``x_errors``)."""

    written: int = 0
    already: int = 0
    tiers: Counter[str] = field(default_factory=Counter)
    errors: list[tuple[str, str, str]] = field(default_factory=list)


def decide_corpus(cascade: Cascade, corpus: CorpusInput, out: Path, budget: Budget | None = None,
                  batch_size: int = 32, auditor: Auditor | None = None,
                  run: RunOptions | None = None, escalations: KeptEscalations | None = None) -> Decided:
    """Append one ``{"id", "answers", "usage"}`` line per item of ``corpus`` not yet in ``out``.

    The corpus is read by the text field the bundle was trained on unless it names one; each
    batch of ``batch_size`` items has its own ``budget``. ``run``: progress bars only.
    ``escalations``: where the teacher's answers to escalated questions are kept.
    """
    corpus = option("decide_corpus", "corpus", corpus, CorpusInput)
    run = option("decide_corpus", "run", run, RunOptions, RunOptions())
    run.unused("decide_corpus", "placement", "device", "cache_dir", "flops_per_second")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        refuse("decide_corpus", "batch_size", batch_size, "a whole number >= 1")
    budget = budget if budget is not None else Budget()
    out = Path(out)
    done = _done_ids(out)
    decided = Decided(already=len(done))
    total = count_items(corpus.path)
    created = not os.path.lexists(out)  # a link given as --out, even one to nothing, is the user's
    try:
        with out.open("a", encoding="utf-8") as sink, \
                tqdm(total=total, initial=len(done), unit="item", disable=not run.progress) as bar:
            batch: list[Item] = []
            for row in corpus.read(cascade.manifest.training.text_field):
                if row.id in done:
                    continue
                batch.append(Item(row.id, row.state))
                if len(batch) == batch_size:
                    _write(cascade, batch, budget, sink, decided, auditor, escalations)
                    bar.update(len(batch))
                    batch = []
            if batch:
                _write(cascade, batch, budget, sink, decided, auditor, escalations)
                bar.update(len(batch))
    except BaseException:  # a corpus refused (empty, not JSONL) or a run stopped before any line
        if created and out.is_file() and out.stat().st_size == 0:
            out.unlink()  # no empty --out left behind, which a rerun would take for a started one
        raise
    return decided


def _write(cascade: Cascade, batch: list[Item], budget: Budget, out: IO[str], decided: Decided,
           auditor: Auditor | None, escalations: KeptEscalations | None) -> None:
    """Decide one batch and append its lines, flushed, so a kill loses at most this batch; the
    items the audit sample chose are audited (and stored) first, and the escalations kept."""
    run = cascade.routed(batch, [list(cascade.questions)] * len(batch), budget)
    responses = cascade.responses(run)
    if escalations is not None:
        escalations.keep(cascade, run)
    if auditor is not None:
        every = {qid: qid for qid in cascade.questions}
        for item, response in zip(batch, responses, strict=True):
            routed = auditor.route(response, every)  # the population the audits are drawn from
            if auditor.sampler.chosen(item.id):
                auditor.audit(item, response, every, routed=routed)
    for item, response in zip(batch, responses, strict=True):
        decided.tiers.update(answer.routing.tier for answer in response.answers.values() if answer.routing)
        decided.errors += [(item.id, qid, error.message) for qid, error in (response.errors or {}).items()]
        out.write(json.dumps({"id": item.id, **response.model_dump(mode="json")}, ensure_ascii=False)
                  + "\n")
    out.flush()
    decided.written += len(batch)


def _done_ids(path: Path) -> set[str]:
    """Ids already decided in ``path``; a last line cut short by a kill is removed."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        print(f"{path}: removing an incomplete last line (a run was stopped mid-write)", file=sys.stderr)
        path.write_bytes(data[:cut])
        data = data[:cut]
    done = set()
    for number, line in enumerate(data.splitlines(), 1):
        try:
            done.add(json.loads(line)["id"])
        except (ValueError, KeyError, TypeError, RecursionError):
            raise CascadeError(f"{path}:{number} is not a decision line with an 'id'; --out must be "
                               "a file this command wrote (to resume) or a new path") from None
    return done
