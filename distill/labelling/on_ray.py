"""Teacher labelling on a Ray cluster: the labels of ``distill.labelling.gguf``, from many model copies.

Ray Data spreads the items over a pool of actors, each holding one teacher Scorer and scoring an
item with ``distill.labelling.gguf.score_item`` as the single-process loop does. Into a PostgreSQL store
every actor writes straight, claiming each item before its teacher reads it (so a second run, or
a batch Ray retries, never labels it again); into a SQLite file, which lives on the driver's
machine, the driver writes what the actors return, having claimed the run's items first. The
store is the run's checkpoint: a rerun skips every id it holds, and Ray retries a killed actor's
batches. See docs/ray.md.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cascade.checks import is_int
from cascade.corpus import BadLine, CorpusItem, OnError, read_corpus
from cascade.errors import CascadeError
from cascade.questions import Question
from cascade.readout.excerpt import HeadTailExcerpt
from cascade.readout.placement import Placement
from cascade.readout.prompts import Layout
from distill.labelling.gguf import (
    LabelSummary,
    check_label_options,
    open_teacher,
    score_item,
    teacher_of,
    teacher_of_file,
    too_long_error,
)
from distill.labelling.texts import check_texts
from distill.store import LabelStore, StoreLocation, StoreMismatchError, Teacher, removed_on_failure
from distill.store.texts import state_sha256

INSTALL = "pip install -e '.[ray]'"
LOCAL = "local"
REACH_SECONDS = 10.0
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception): .+$", re.MULTILINE)


class RayLabelError(CascadeError, RuntimeError):
    """Ray is not installed or not reachable, or an actor failed; the message says what to do."""


@dataclass(frozen=True)
class RayOptions:
    """Which cluster and how wide.

    ``address``: a running cluster's ("auto", "HEAD_IP:6379", "ray://HEAD_IP:10001"), or
    "local" to start one in this process. ``actors``: teacher copies, each on one GPU when the
    placement offloads layers, else on ``threads`` CPUs. ``batch_size``: items per actor call,
    the unit Ray retries after a failure and the driver commits when it arrives.
    """

    address: str = LOCAL
    actors: int = 1
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("actors", "batch_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise RayLabelError(f"{name} must be a whole number >= 1; got {value!r}")


@dataclass(frozen=True)
class TeacherSpec:
    """What each actor opens: the arguments of ``open_teacher``, all of them picklable.

    ``placement.threads`` unset means one thread: each actor reserves as many Ray CPUs as it
    runs threads, so that Ray never packs more threads on a node than it has cores.
    """

    model_path: Path
    questions: dict[str, Question]
    permutations: int = 1
    n_ctx: int = 4096
    placement: Placement = field(default_factory=Placement)
    excerpt: HeadTailExcerpt | None = None
    layout: Layout = "state-first"

    def __post_init__(self) -> None:
        """The model path made absolute (symlinks kept, as they name the teacher): actors run in
        another working directory."""
        object.__setattr__(self, "model_path", Path(self.model_path).absolute())

    @property
    def threads(self) -> int:
        return self.placement.threads or 1

    @property
    def gpus(self) -> int:
        """GPUs per actor: one where layers are offloaded, so Ray gives each actor its own."""
        return 1 if self.placement.gpu_layers else 0


class TeacherActor:
    """One teacher Scorer per Ray actor, loaded once; each call labels one batch of items.

    The model file is hashed on the actor's own node and must be the store's teacher: a node
    holding another file at the same path would otherwise mix two models' labels in one store.
    ``store``: where the actor writes each item itself (a PostgreSQL store every node reaches);
    None: it returns the labels for the driver to write.
    """

    def __init__(self, spec: TeacherSpec, teacher: Teacher, corpus_path: str,
                 store: StoreLocation | None = None) -> None:
        self.spec, self.corpus_path = spec, Path(corpus_path)
        self.store = LabelStore(store, teacher) if store is not None else None
        place = spec.placement
        self.scorer = open_teacher(spec.model_path, spec.questions, spec.permutations, spec.n_ctx,
                                   place.gpu_layers or 0, spec.threads, place.extra_buffers, spec.layout)
        found = teacher_of(self.scorer)
        if found != teacher:
            self.scorer.close()
            raise StoreMismatchError(
                f"{spec.model_path} on this Ray node is teacher {found}, not the store's "
                f"{teacher}; put the same model file at the same path on every node"
            )

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list[str]]:
        """Rows (id, state JSON, line, question ids JSON) -> rows (id, result JSON)."""
        results = [self._label(str(i), str(s), int(n), json.loads(q)) for i, s, n, q in
                   zip(batch["id"], batch["state"], batch["line"], batch["questions"], strict=True)]
        return {"id": [str(i) for i in batch["id"]], "result": results}

    def _label(self, item_id: str, state: str, line: int, question_ids: list[str]) -> str:
        item = CorpusItem(id=item_id, state=json.loads(state), line=line)
        questions: dict[str, Question] | None = {qid: self.spec.questions[qid] for qid in question_ids}
        if self.store is not None:  # claimed first: another run, or a retried batch, may have it
            questions = self.store.claim(item_id, questions or {})
            if not questions:
                return json.dumps({"held": True} if questions is None else {"done": True})
        scored = score_item(self.scorer, item, questions or {}, self.spec.permutations,
                            self.spec.excerpt, self.corpus_path)
        if isinstance(scored, BadLine):
            if self.store is not None:
                self.store.release(item_id)
            return json.dumps({"bad": scored.model_dump()})
        text = state_sha256(item.state)
        if self.store is not None:
            self.store.put_item(item_id, scored.labels, scored.hashes, scored.masses, text)
            return json.dumps({"stored": True})
        return json.dumps({"labels": scored.labels, "hashes": scored.hashes, "masses": scored.masses,
                           "text": text})


def label_on_ray(
    spec: TeacherSpec,
    corpus_path: Path,
    store: LabelStore,
    ray_options: RayOptions,
    text_field: str = "text",
    on_error: OnError = "stop",
    progress: bool = True,
    only: Collection[str] | None = None,
) -> LabelSummary:
    """Label every item of the corpus not yet in ``store`` on Ray actors (only the ids in ``only``
    where given); resumable like ``distill.labelling.gguf.label_corpus``, whose summary it returns.

    The corpus is read and checked whole before any actor starts, so a bad line in stop mode
    stops the run before any teacher work. ``store`` must belong to
    ``teacher_of_file(spec.model_path, spec.layout)``. Ctrl-C ends the run with ``interrupted`` set.
    """
    ray = require_ray()
    check_label_options(spec.questions, on_error, spec.permutations)
    teacher = _check_store(store, spec.model_path, spec.layout)
    store.bind_questions(spec.questions)
    check_texts(store, Path(corpus_path), text_field)
    summary, started = LabelSummary(), time.perf_counter()
    rows = _todo_rows(store, spec.questions, Path(corpus_path), text_field, on_error, summary, only,
                      claim=not store.shared)
    summary.left = len(rows)
    bar = tqdm(total=len(rows), unit="item", desc="labelling", disable=not progress,
               dynamic_ncols=True)
    try:
        if rows:
            with _connected(ray, ray_options.address), _quiet_progress(ray), _actor_failures(ray):
                results = _dataset(ray, spec, teacher, str(corpus_path), rows, ray_options,
                                   store.path if store.shared else None)
                _commit_all(results, store, on_error, summary, bar)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        bar.close()
        summary.seconds = time.perf_counter() - started
    return summary


def dropped_if_failed_empty(path: StoreLocation | str) -> AbstractContextManager[None]:
    """Delete the store at ``path`` if the block created it and fails before storing a label.

    The driver creates the store before any actor has loaded the model; a first run whose actors
    cannot load it (a damaged file, say) would otherwise leave a store bound to that file, which
    a rerun with the repaired file would be refused. A store with labels is always kept.
    """
    return removed_on_failure(path, only_if_empty=True)


def _check_store(store: LabelStore, model_path: Path, layout: Layout) -> Teacher:
    """The teacher the model file is; the same check ``label_corpus`` makes on its scorer."""
    teacher = teacher_of_file(model_path, layout)
    if store.teacher != teacher:
        raise StoreMismatchError(
            f"label store {store.path} belongs to teacher {store.teacher}, not to {model_path}'s "
            f"{teacher}; open the store with LabelStore(path, teacher_of_file(model, layout)), or use a "
            "new store path for this teacher's labels"
        )
    return teacher


def _todo_rows(
    store: LabelStore,
    questions: Mapping[str, Question],
    corpus_path: Path,
    text_field: str,
    on_error: OnError,
    summary: LabelSummary,
    only: Collection[str] | None = None,
    claim: bool = False,
) -> list[dict[str, Any]]:
    """One row per item that lacks a question, with the questions it lacks (in the questions'
    order, as ``label_corpus`` asks them); items the store has are counted and left out, and
    items not in ``only`` (where given) are not taken. ``claim`` (the driver writes): each row's
    item claimed for this run first, an item another live run holds left to it."""
    done = {qid: store.done_items([qid]) for qid in questions}
    wanted = set(only) if only is not None else None
    rows = []
    for item in read_corpus(corpus_path, text_field, on_error, summary.bad_lines.append):
        if wanted is not None and item.id not in wanted:
            continue
        summary.items += 1
        todo = [qid for qid in questions if item.id not in done[qid]]
        if todo and claim:
            held = store.claim(item.id, dict.fromkeys(todo))
            if held is None:  # another live run is labelling it: left to it
                summary.held += 1
                continue
            todo = list(held)
        if not todo:
            summary.skipped_done += 1
            continue
        rows.append({"id": item.id, "state": json.dumps(item.state), "line": item.line,
                     "questions": json.dumps(todo)})
    return rows


def _commit_all(results: Any, store: LabelStore, on_error: OnError, summary: LabelSummary,
                bar: tqdm) -> None:
    """Stream the actors' results into the store as they arrive, one transaction per item.

    ``committed`` guards against a batch delivered twice after a failure (Ray's retries are
    at-least-once): a second copy is dropped, never compared with the first.
    """
    committed: set[str] = set()
    for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
        for item_id, result in zip(map(str, batch["id"]), batch["result"], strict=True):
            if item_id not in committed:
                _commit(store, item_id, json.loads(result), on_error, summary, bar)
                committed.add(item_id)


def _dataset(
    ray: Any,
    spec: TeacherSpec,
    teacher: Teacher,
    corpus_path: str,
    rows: list[dict[str, Any]],
    ray_options: RayOptions,
    store: StoreLocation | None = None,
) -> Any:
    """The items as a Ray Dataset of one block per batch, mapped through a pool of teacher actors
    (writing to ``store`` themselves where given).

    One block per batch, because a map task's output comes back when the task ends: a bigger
    block would leave some actors idle on a short corpus, and hold labels back from the store
    (and from a driver killed meanwhile) until its last item is scored. No more actors start
    than there are blocks: one more would load the model for nothing.
    """
    blocks = -(-len(rows) // ray_options.batch_size)
    return ray.data.from_items(rows, override_num_blocks=blocks).map_batches(
        TeacherActor,
        fn_constructor_kwargs={"spec": spec, "teacher": teacher, "corpus_path": corpus_path, "store": store},
        compute=ray.data.ActorPoolStrategy(size=min(ray_options.actors, blocks)),
        batch_size=ray_options.batch_size,
        batch_format="numpy",
        num_cpus=spec.threads,
        num_gpus=spec.gpus,
    )


def _commit(
    store: LabelStore,
    item_id: str,
    result: dict[str, Any],
    on_error: OnError,
    summary: LabelSummary,
    bar: tqdm,
) -> None:
    """Store one item's labels (or count those an actor stored), or handle its bad line as
    ``label_corpus`` does; an item another live run holds is counted ``held``, left to it."""
    if "bad" in result:
        failed = BadLine.model_validate(result["bad"])
        if on_error == "stop":
            raise too_long_error(failed)
        summary.bad_lines.append(failed)
    elif "held" in result:
        summary.held += 1
    elif "done" in result:
        summary.skipped_done += 1
    else:
        if "labels" in result:
            store.put_item(item_id, result["labels"], result["hashes"], result.get("masses"),
                           result.get("text"))
        summary.labelled += 1
    summary.left -= 1
    bar.update()


def require_ray() -> Any:
    """The ray module, or the error naming the extra to install: Ray is optional, and a user
    should learn that before the model file is hashed or a store is created."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise RayLabelError(f"labelling on Ray needs Ray Data, an optional extra: {INSTALL}") from None
    return ray


@contextmanager
def _connected(ray: Any, address: str) -> Iterator[None]:
    """Connect to the cluster (or start a local one) for the run, unless this process already is
    connected, as a caller that set Ray up itself is; disconnect only what was connected here."""
    if ray.is_initialized():
        yield
        return
    try:
        if address == LOCAL:
            ray.init(include_dashboard=False)
        else:
            _check_reachable(address)
            ray.init(address=address)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise RayLabelError(
            f"cannot connect to a Ray cluster at {address!r}: {exc}. Start one with `ray start "
            f"--head` (the same Ray and Python on every node) and pass the address it prints, or "
            f"--ray {LOCAL} for a cluster on this machine"
        ) from exc
    try:
        yield
    finally:
        ray.shutdown()


def _check_reachable(address: str) -> None:
    """Refuse a HOST:PORT that nothing answers on: Ray would retry it for many minutes (measured:
    still retrying after 8), where a TCP connection tells in seconds."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=REACH_SECONDS).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers there ({exc})") from exc


@contextmanager
def _quiet_progress(ray: Any) -> Iterator[None]:
    """Ray Data's own progress bars off while the run's bar counts committed items."""
    context = ray.data.DataContext.get_current()
    before = context.enable_progress_bars
    context.enable_progress_bars = False
    try:
        yield
    finally:
        context.enable_progress_bars = before


@contextmanager
def _actor_failures(ray: Any) -> Iterator[None]:
    """An actor's failure as one actionable line, not Ray's nested tracebacks."""
    try:
        yield
    except ray.exceptions.RayError as exc:
        raise RayLabelError(_failure(str(exc))) from exc


def _failure(text: str) -> str:
    """What failed on an actor: the last ``Type: message`` line of Ray's traceback."""
    lines = [m.group(0) for m in _ERROR_LINE.finditer(text)]
    cause = lines[-1] if lines else text.splitlines()[0]
    return (f"a Ray actor failed: {cause}. The labels committed so far are kept; fix the cause "
            "and run the same command again to resume (Ray's logs hold the full traceback)")
