"""Labelling through a System One URL: the teacher is an upstream endpoint, not a local GGUF.

The same promises as ``distill.labelling.gguf``: each item's labels committed in one transaction as they
arrive, a run resumed by running it again (done items are never called for), Ctrl-C or SIGTERM
ending it cleanly after the calls in flight. What differs is the cost: an endpoint is often paid
per call, so the run says before its first call how many calls it will make, makes ``concurrency``
at a time, at most ``rate`` a second where given, and stops at the first answer from another
teacher (``TeacherChangedError``) rather than mix two teachers' labels.

The store is bound to the endpoint's identity (``distill.store.Teacher.of_endpoint``: its model
and audit hashes); each label keeps the question's ``prompt_template_sha256`` as its prompt hash.
A store made by another teacher, a GGUF or another endpoint, is refused.

Failures have one retry policy, the upstream client's (``cascade.teachers.client``: its retries,
after the Retry-After where that fits the call's deadline), so an item is sent at most
``retries + 1`` times in a run. An item the client gave up on because the upstream asked to wait
(429, 503) is left for the next run (``LabelSummary.turned_away``) and pauses the run's later
calls until that Retry-After; the pause, like the rate limit, is waited out by the calls'
threads, never by the thread that commits, so answers that come meanwhile are committed at once.
Any other failure the client gave up on (502, 504, unreachable) stops the run, its labels so far
committed. A refusal of the item itself (another 4xx, an answer of the wrong shape) is a bad
item, stopping the run or skipped as ``on_error`` says.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from cascade.corpus import BadLine, CorpusItem, OnError, count_among, count_items, read_corpus
from cascade.errors import (
    UpstreamAnswerError,
    UpstreamFailed,
    UpstreamRateLimited,
    UpstreamRefused,
)
from cascade.questions import Question
from cascade.teachers.connect import open_client
from cascade.teachers.identity import EndpointIdentity
from cascade.teachers.settings import UpstreamSettings
from cascade.tiers.base import Item
from cascade.tiers.upstream import UpstreamAnswers, UpstreamTier
from distill.labelling.gguf import LabelSummary
from distill.labelling.texts import check_texts
from distill.stopping import StopRequest
from distill.store import LabelStore, StoreError, StoreMismatchError, Teacher
from distill.store.records import LabelConflictError
from distill.store.texts import state_sha256


@dataclass(frozen=True)
class EndpointRun:
    """How a run calls the endpoint: ``concurrency`` calls at a time, at most ``rate`` a second
    (None: no limit), one call an item (retried as the client's settings say). ``only``: the item
    ids to take (None: every one)."""

    concurrency: int = 4
    rate: float | None = None
    text_field: str = "text"
    on_error: OnError = "stop"
    only: Collection[str] | None = None


@dataclass
class _Progress:
    """What the run has done, and the store once the first answer named its teacher; when the
    next call may start (the rate limit), until when the upstream asked to wait, and whether the
    run is ending (calls not yet started are then not made)."""

    corpus: Path
    summary: LabelSummary = field(default_factory=LabelSummary)
    store: LabelStore | None = None
    next_call: float = 0.0
    resume_at: float = 0.0
    ending: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bad(self, line: BadLine) -> None:
        self.summary.bad_lines.append(line)
        self.summary.left -= 1

    def turn(self, rate: float | None) -> float:
        """When the next call may start: after the one before it (at most ``rate`` a second) and
        once the upstream's pause has passed; taken, so that the call after it waits its own."""
        with self.lock:
            start = max(time.monotonic(), self.next_call, self.resume_at)
            if rate:
                self.next_call = start + 1.0 / rate
            return start

    def pause(self, seconds: float) -> None:
        """No call starts for ``seconds`` (a later pause never shortens an earlier one)."""
        with self.lock:
            self.resume_at = max(self.resume_at, time.monotonic() + seconds)


def label_through_endpoint(settings: UpstreamSettings, questions: Mapping[str, Question], corpus: Path,
                           store_path: Path, run: EndpointRun | None = None, stop: StopRequest | None = None,
                           say: Callable[[str], None] | None = None) -> LabelSummary:
    """Label every item of ``corpus`` not yet in the store at ``store_path`` (a SQLite path or a
    store URL) through the endpoint.

    ``say`` hears, before the first call, how many calls the run will make. Returns what the run
    did; raises ``TeacherChangedError`` (the labels so far committed) at an answer from another
    teacher, ``StoreMismatchError`` for a store of another teacher.
    """
    run = run or EndpointRun()
    expected, done = _stored(store_path, questions, Path(corpus), run.text_field)
    progress = _Progress(Path(corpus))
    calls = _count_calls(corpus, done, questions, run.only, run.text_field)
    progress.summary.left = calls
    if say is not None:
        limit = f", at most {run.rate:g} a second" if run.rate else ""
        say(f"{calls} items to label: {calls} calls to {settings.shown} (each holding the questions its "
            f"item lacks, of {len(questions)}), {run.concurrency} at a time{limit}; stop any time with "
            "Ctrl-C, resume by running the same command")
    started = time.perf_counter()
    tier = UpstreamTier("teacher", open_client(settings), expected)
    try:
        _call_all(tier, questions, corpus, store_path, done, run, progress, stop)
    finally:
        tier.close()
        if progress.store is not None:
            progress.store.close()
        progress.summary.seconds = time.perf_counter() - started
    return progress.summary


def _stored(path: Path, questions: Mapping[str, Question], corpus: Path, text_field: str
            ) -> tuple[EndpointIdentity | None, dict[str, set[str]]]:
    """The identity a store already holds (None for a new one) and, per question, its done items;
    ``corpus``'s items checked against the texts its labels answered (``check_texts``)."""
    new: tuple[EndpointIdentity | None, dict[str, set[str]]] = (None, {qid: set() for qid in questions})
    if isinstance(path, str | Path) and not Path(path).exists():
        return new
    try:
        opened = LabelStore.open_existing(path)
    except StoreError as exc:
        if "no label store" in str(exc):  # a database without one yet
            return new
        raise
    with opened as store:
        store.check_questions(questions)
        teacher = store.teacher
        if teacher.kind != "endpoint" or teacher.identity is None:
            raise StoreMismatchError(f"label store {path} holds labels of the {teacher.kind} teacher "
                                     f"{teacher.model!r}, not of an endpoint; use a new --store path for "
                                     "the endpoint's labels")
        unrecorded = check_texts(store, corpus, text_field, record=False)
        done = {qid: store.done_items([qid]) for qid in questions}
    if unrecorded:
        with LabelStore(path, teacher) as writable:
            writable.record_texts(unrecorded)
    return EndpointIdentity.model_validate_json(teacher.identity), done


def _count_calls(corpus: Path, done: Mapping[str, set[str]], questions: Mapping[str, Question],
                 only: Collection[str] | None, text_field: str) -> int:
    """Items still lacking a label: one call each."""
    finished = set.intersection(*(done[qid] for qid in questions)) if questions else set()
    if only is not None:
        return len(set(only) - finished)
    return count_items(corpus) - count_among(corpus, text_field, finished)


def _call_all(tier: UpstreamTier, questions: Mapping[str, Question], corpus: Path, store_path: Path,
              done: Mapping[str, set[str]], run: EndpointRun, progress: _Progress,
              stop: StopRequest | None) -> None:
    """Keep ``concurrency`` calls in flight, commit each answer as it comes (this thread is the
    store's only writer), and after a stop or an error wait for the calls in flight."""
    todo = _todo(corpus, done, questions, run, progress)
    pending: dict[Future[UpstreamAnswers], tuple[CorpusItem, dict[str, Question]]] = {}
    failure: BaseException | None = None
    with ThreadPoolExecutor(run.concurrency, "cascade-label") as pool:
        try:
            while True:
                while len(pending) < run.concurrency and not (stop and stop.requested):
                    nxt = next(todo, None)
                    if nxt is None:
                        break
                    _submit(pool, tier, pending, nxt[0], nxt[1], run, progress)
                if not pending:
                    break
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    item, asked = pending.pop(future)
                    _settle(future, item, asked, store_path, run, progress)
        except KeyboardInterrupt:
            progress.summary.interrupted = True
        except BaseException as exc:
            failure = exc
        progress.ending.set()  # the calls still waiting for their turn are not made
        _drain(pending, store_path, progress)
    progress.summary.interrupted = progress.summary.interrupted or bool(stop and stop.requested)
    if failure is not None:
        raise failure


def _todo(corpus: Path, done: Mapping[str, set[str]], questions: Mapping[str, Question], run: EndpointRun,
          progress: _Progress) -> Iterator[tuple[CorpusItem, dict[str, Question]]]:
    """Each item to call for, with the questions it lacks; done ones counted as skipped."""
    wanted = set(run.only) if run.only is not None else None
    summary = progress.summary
    for item in read_corpus(corpus, run.text_field, run.on_error, progress.bad):
        if wanted is not None and item.id not in wanted:
            continue
        summary.items += 1
        lacking = {qid: q for qid, q in questions.items() if item.id not in done[qid]}
        if lacking:
            yield item, lacking
        else:
            summary.skipped_done += 1


class _NotCalled(Exception):
    """A call the run ended before its turn came: not made."""


def _submit(pool: ThreadPoolExecutor, tier: UpstreamTier,
            pending: dict[Future[UpstreamAnswers], tuple[CorpusItem, dict[str, Question]]],
            item: CorpusItem, asked: dict[str, Question], run: EndpointRun, progress: _Progress) -> None:
    """Hand one call to a worker, which waits for its turn: this thread never waits."""
    pending[pool.submit(_call, tier, item, asked, run.rate, progress)] = (item, asked)


def _call(tier: UpstreamTier, item: CorpusItem, asked: dict[str, Question], rate: float | None,
          progress: _Progress) -> UpstreamAnswers:
    """One item's call, on a worker, once its turn has come (the rate limit, the upstream's pause;
    a pause that began meanwhile is waited out too); ``_NotCalled`` when the run ends first."""
    while True:
        start = progress.turn(rate)
        if progress.ending.wait(max(0.0, start - time.monotonic())):
            raise _NotCalled
        if progress.resume_at <= time.monotonic():
            return tier.ask(Item(item.id, item.state), asked)


def _settle(future: Future[UpstreamAnswers], item: CorpusItem, asked: dict[str, Question],
            store_path: Path, run: EndpointRun, progress: _Progress) -> None:
    """Commit an answered item; leave one the upstream asked to wait for, pausing the calls to
    come; a bad item is raised (stop) or recorded (skip); any other failure is raised."""
    error = future.exception()
    if error is None:
        _commit(future.result(), item, asked, store_path, progress)
        return
    if isinstance(error, UpstreamRefused | UpstreamAnswerError):
        if run.on_error == "stop":
            raise error
        progress.bad(BadLine(path=str(progress.corpus), line=item.line, item_id=item.id,
                             message=f"item {item.id!r}: {error}"))
        return
    if isinstance(error, UpstreamRateLimited | UpstreamFailed) and error.status in (429, 503):
        progress.pause(float(error.retry_after or 1))
        progress.summary.turned_away += 1
        return
    raise error


def _commit(answers: UpstreamAnswers, item: CorpusItem, asked: Mapping[str, Question], store_path: Path,
            progress: _Progress) -> None:
    """One item's labels in one transaction; the store opened at the first answer, bound to the
    identity that answer stated."""
    if progress.store is None:  # bound before it is kept: a refused run commits none of its answers
        store = LabelStore(store_path, Teacher.of_endpoint(answers.identity))
        try:
            store.bind_questions(asked)
        except BaseException:
            store.close()
            raise
        progress.store = store
    labels = {qid: dict(zip(q.option_keys(), answers.distributions[qid].tolist(), strict=True))
              for qid, q in asked.items()}
    hashes = {qid: sha for qid, sha in answers.identity.templates.items() if qid in asked}
    try:
        progress.store.put_item(item.id, labels, hashes, text_sha256=state_sha256(item.state))
    except LabelConflictError:
        # done items were left out when the run began: another run sharing the store labelled it
        # since, with an answer of its own (a teacher that is not deterministic); the first stays
        progress.summary.skipped_done += 1
        progress.summary.left -= 1
        return
    progress.summary.labelled += 1
    progress.summary.left -= 1


def _drain(pending: dict[Future[UpstreamAnswers], tuple[CorpusItem, dict[str, Question]]],
           store_path: Path, progress: _Progress) -> None:
    """Wait for the calls in flight (each ends by its deadline) and commit those answered."""
    for future, (item, asked) in list(pending.items()):
        error = future.exception()
        if error is None:
            _commit(future.result(), item, asked, store_path, progress)
    pending.clear()
