"""Resumable teacher labelling: every corpus item through the logit-readout scorer into a store.

The teacher costs most of a second per item, so a run over a corpus takes hours and will be
stopped: by Ctrl-C, a reboot, a killed job. Each item's labels are committed in one store
transaction as soon as they exist, and a run starts by asking the store what is done, so
running the same command again continues where the last one stopped, and no item is labelled
twice. Only the questions an item lacks are scored, so adding a question to a finished run
labels just that question, and never meets a stored label it would contradict.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from tqdm import tqdm

from cascade.checks import is_int
from cascade.corpus import BadLine, CorpusItem, OnError, check_on_error, count_among, count_items, read_corpus
from cascade.errors import InputTooLongError, ModelError, RequestError
from cascade.hashing import file_sha256
from cascade.questions import DecisionRequest, Question
from cascade.readout.excerpt import HeadTailExcerpt
from cascade.readout.placement import ExtraBuffers
from cascade.readout.prompts import Layout, prompt_version
from cascade.readout.scorer import Scorer, branch_slots
from distill.labelling.texts import check_texts
from distill.stopping import StopRequest
from distill.store import LabelStore, StoreMismatchError, Teacher
from distill.store.texts import state_sha256


@dataclass(frozen=True)
class ItemLabels:
    """One item's teacher labels, the sha256 of each question's prompt and the letter mass of each
    readout, not yet stored."""

    labels: dict[str, dict[str, float]]
    hashes: dict[str, str]
    masses: dict[str, float]


class LabelSummary(BaseModel):
    """What a run did. ``items`` counts the valid corpus items it took; bad lines and over-long
    items (skip mode) are in ``bad_lines``; ``left`` the items it took that are still to label;
    ``interrupted`` is True when Ctrl-C or SIGTERM stopped the run, and ``exit_status`` the status
    the command then exits with (128 plus the signal's number); ``held`` counts the items another
    live run sharing the store was labelling, left to it (not in ``left``); ``turned_away`` counts the
    items a URL teacher asked to wait for past the client's retries (429, 503), left for the next
    run."""

    items: int = 0
    labelled: int = 0
    skipped_done: int = 0
    bad_lines: list[BadLine] = []
    seconds: float = 0.0
    interrupted: bool = False
    exit_status: int = 130
    held: int = 0
    left: int = 0
    turned_away: int = 0


def open_teacher(
    model_path: str | Path,
    questions: Mapping[str, Question],
    permutations: int = 1,
    n_ctx: int = 4096,
    n_gpu_layers: int = 0,
    n_threads: int | None = None,
    extra_buffers: ExtraBuffers | None = None,
    layout: Layout = "state-first",
) -> Scorer:
    """A scorer with one branch slot per (question, option order): one decode reads them all.
    ``layout`` is the prompt layout, and with it the prompt version of its labels."""
    branches = branch_slots(len(questions), permutations)
    return Scorer(model_path, n_ctx=n_ctx, max_branches=branches, n_threads=n_threads,
                  n_gpu_layers=n_gpu_layers, extra_buffers=extra_buffers, layout=layout)


def teacher_of(scorer: Scorer) -> Teacher:
    """The store identity of a scorer's labels: its model file, pinned by sha256, and prompt
    version (which names its layout)."""
    return Teacher(kind="gguf", model=scorer.model.path.name, model_sha256=scorer.model_sha256,
                   prompt_version=scorer.prompt_version)


def teacher_of_file(model_path: str | Path, layout: Layout = "state-first") -> Teacher:
    """``teacher_of`` a scorer of this file in ``layout``, without loading it: for a driver that
    only writes the store while the model runs elsewhere (on Ray actors)."""
    path = Path(model_path)
    if not path.is_file():
        raise ModelError(f"model file not found: {path}; pass the path of a .gguf file")
    return Teacher(kind="gguf", model=path.name, model_sha256=file_sha256(path),
                   prompt_version=prompt_version(layout))


def label_corpus(
    scorer: Scorer,
    questions: Mapping[str, Question],
    corpus_path: Path,
    store: LabelStore,
    text_field: str = "text",
    on_error: OnError = "stop",
    permutations: int = 1,
    progress: bool = True,
    excerpt: HeadTailExcerpt | None = None,
    only: Collection[str] | None = None,
    stop: StopRequest | None = None,
    say: Callable[[str], None] | None = None,
) -> LabelSummary:
    """Label every item of the corpus not yet in ``store``, all its questions in one transaction.

    ``store`` must belong to ``teacher_of(scorer)``. Over-long items are scored as an excerpt when
    ``excerpt`` is given, else they are bad items (raised in stop mode, reported in skip mode).
    ``only``: the ids to take (``distill.labelling.selection``), every item when None. Ctrl-C or a
    ``stop`` request ends the run cleanly: what was labelled is committed and the summary says
    ``interrupted``; the same call again resumes. ``say`` hears, once the first item is labelled,
    what the run will take.
    """
    _check_arguments(scorer, questions, store, on_error, permutations)
    store.bind_questions(questions)
    check_texts(store, corpus_path, text_field)
    summary, started = LabelSummary(), time.perf_counter()
    done = {qid: store.done_items([qid]) for qid in questions}
    wanted = set(only) if only is not None else None
    total = len(wanted) if wanted is not None else count_items(corpus_path)
    finished = store.done_items(list(questions))
    already = len(finished & wanted) if wanted is not None else count_among(corpus_path, text_field, finished)
    summary.left = total - already
    bar = tqdm(total=total, initial=already, unit="item", desc="labelling", disable=not progress,
               dynamic_ncols=True)

    def bad(line: BadLine) -> None:
        summary.bad_lines.append(line)
        summary.left -= 1
        bar.update()

    items = read_corpus(corpus_path, text_field, on_error, bad)
    try:
        for item in items:
            if wanted is not None and item.id not in wanted:
                continue
            summary.items += 1
            todo = {qid: q for qid, q in questions.items() if item.id not in done[qid]}
            if todo:  # claimed before the teacher reads it: another run sharing the store may have it
                claimed = store.claim(item.id, todo)
                if claimed is None:  # that run is alive and labelling it: left to it
                    summary.held += 1
                    summary.left -= 1
                    bar.update()
                    continue
                if not claimed:  # labelled by it meanwhile
                    summary.left -= 1
                    bar.update()
                todo = claimed
            if not todo:
                summary.skipped_done += 1
                continue
            item_started = time.perf_counter()
            failed = _label_item(scorer, store, item, todo, permutations, excerpt, corpus_path)
            if failed is None:
                summary.labelled += 1
                summary.left -= 1
                bar.update()
                if summary.labelled == 1 and say is not None:
                    say(estimate(summary.left, len(questions), time.perf_counter() - item_started))
            elif on_error == "stop":
                raise too_long_error(failed)
            else:
                bad(failed)
            if stop is not None and stop.requested:
                summary.interrupted = True
                break
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        items.close()
        bar.close()
        summary.seconds = time.perf_counter() - started
    return summary


def estimate(left: int, questions: int, seconds: float) -> str:
    """What the rest of a run will take, from the first item's time: items, teacher calls, time."""
    rest = left * seconds
    hours, minutes = divmod(round(rest / 60), 60)
    took = f"{hours} h {minutes} min" if hours else f"{minutes} min" if minutes else f"{rest:.0f} s"
    return (f"{left} items left, {left} teacher calls ({left * questions} readouts); the first took "
            f"{seconds:.1f} s: about {took} more at that pace (stop any time with Ctrl-C, resume by "
            "running the same command)")


def _check_arguments(
    scorer: Scorer,
    questions: Mapping[str, Question],
    store: LabelStore,
    on_error: str,
    permutations: int,
) -> None:
    check_label_options(questions, on_error, permutations)
    teacher = teacher_of(scorer)
    if store.teacher != teacher:
        raise StoreMismatchError(
            f"label store {store.path} belongs to teacher {store.teacher}, not to this scorer's "
            f"{teacher}; open the store with LabelStore(path, teacher_of(scorer)), or use a new "
            "store path for this teacher's labels"
        )


def check_label_options(questions: Mapping[str, Question], on_error: str, permutations: int) -> None:
    """The options every labelling driver takes, checked before any model is opened."""
    check_on_error(on_error)
    if not questions:
        raise RequestError("questions: is empty; ask at least one question")
    if not is_int(permutations) or permutations < 1:
        raise RequestError(f"permutations must be a whole number >= 1; got {permutations!r}")


def _label_item(
    scorer: Scorer,
    store: LabelStore,
    item: CorpusItem,
    questions: dict[str, Question],
    permutations: int,
    excerpt: HeadTailExcerpt | None,
    corpus_path: Path,
) -> BadLine | None:
    """Score one item and commit its labels in one transaction; an over-long one is returned."""
    scored = score_item(scorer, item, questions, permutations, excerpt, corpus_path)
    if isinstance(scored, BadLine):
        return scored
    store.put_item(item.id, scored.labels, scored.hashes, scored.masses, state_sha256(item.state))
    return None


def score_item(
    scorer: Scorer,
    item: CorpusItem,
    questions: Mapping[str, Question],
    permutations: int,
    excerpt: HeadTailExcerpt | None,
    corpus_path: Path,
) -> ItemLabels | BadLine:
    """One item's labels (fan-out: one prefill, all questions in one decode), or why it has none.

    Apart from writing, so that every labelling driver (this module's loop, distill.labelling.on_ray's
    Ray actors) scores an item the same way and only the store's single writer commits it.
    """
    request = DecisionRequest(state=item.state, questions=dict(questions))
    try:
        response = scorer.score(request, path="fanout", permutations=permutations, excerpt=excerpt)
    except InputTooLongError as exc:
        return BadLine(path=str(corpus_path), line=item.line, item_id=item.id,
                       message=f"item {item.id!r} is too long: {exc}")
    labels = {qid: answer.probabilities for qid, answer in response.answers.items()}
    hashes = {qid: a.readout.prompt_hash for qid, a in response.answers.items() if a.readout}
    masses = {qid: a.readout.letter_mass for qid, a in response.answers.items() if a.readout}
    return ItemLabels(labels=labels, hashes=hashes, masses=masses)


def too_long_error(failed: BadLine) -> InputTooLongError:
    """The stop-mode error for an over-long item, with the way to go on past it."""
    return InputTooLongError(f"{failed} (--on-error skip / on_error='skip' reports over-long items "
                             "and goes on)")
