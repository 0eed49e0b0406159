"""The upstream kind: a System One URL as the top tier (the teacher), called over HTTP.

Its tier sends ONE request per state holding only the questions it is asked about that state,
reads the answers as the teacher's distributions (``cascade.teachers.wire``: wrong shapes are
refused) and checks the identity every answer states against the teacher's
(``cascade.teachers.identity``): a model swapped behind the same URL is caught at its first
answer. A bundle gets one either from its manifest (kind "upstream": the URL it was certified
against) or from ``Cascade.load(teacher="http://host:port/v1/systemone")`` in place of a GGUF.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from cascade.answers import Usage
from cascade.cost.pricing import TEACHER_PARAMS, TierCost, TierPricing, estimate_tokens
from cascade.errors import RouterError
from cascade.private import redact_url
from cascade.questions import Question
from cascade.teachers.connect import open_client
from cascade.teachers.identity import EndpointIdentity, IdentityWatch
from cascade.teachers.settings import UpstreamSettings
from cascade.teachers.wire import distributions, read_response
from cascade.tiers.base import Answers, Asked, Build, BundleParts, Item, Reply, Tier, TierKind, TierSpec
from cascade.tiers.labels import LabelsTier

if TYPE_CHECKING:
    from cascade.teachers.client import UpstreamClient


class UpstreamSpec(TierSpec):
    """A top tier answered by a System One endpoint at ``url``; ``model`` is the model name its
    requests carry (None: none)."""

    top_only: ClassVar[bool] = True

    kind: Literal["upstream"] = "upstream"
    name: str = Field(default="teacher", min_length=1)
    url: str = Field(pattern=r"^https?://")
    model: str | None = None


@dataclass(frozen=True)
class UpstreamAnswers:
    """One state's answers from the upstream: per question its distribution (``option_keys()``
    order), the call's usage, and the identity the answer stated (its template hashes too)."""

    distributions: dict[str, np.ndarray]
    usage: Usage
    identity: EndpointIdentity


class UpstreamTier(Tier):
    """Answers by calling an upstream: one request per state, the states of a batch in parallel
    (up to the client's in-flight bound), every answer's identity checked."""

    reads_any_question = True
    remote = True

    def __init__(self, name: str, client: UpstreamClient, expected: EndpointIdentity | None = None) -> None:
        """``expected``: the teacher's identity the answers must state (None: pinned from the first)."""
        self.name = name
        self.client = client
        self.settings = client.settings
        self.watch = IdentityWatch(self.settings.shown, expected)
        self._last_seen: EndpointIdentity | None = None
        self._wires: dict[str, tuple[Question, dict[str, Any]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._caller = threading.local()

    @property
    def ran_on(self) -> str:
        return f"upstream {self.settings.shown}"

    @property
    def backend(self) -> str:
        pinned = self.watch.pinned
        return f"upstream {pinned.model}" if pinned is not None and pinned.model else "upstream"

    @property
    def batch_size(self) -> int:
        return self.settings.max_in_flight

    def answer(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Answers:
        return self.reply(items, asked, questions).answers

    def reply(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Reply:
        """Each state's request in parallel; the first failure is raised once all have ended (no
        call is left running behind an error)."""
        out = Reply.empty(len(items))
        jobs = [(i, item, list(qids))
                for i, (item, qids) in enumerate(zip(items, asked, strict=True)) if qids]
        if len(jobs) == 1:
            i, item, qids = jobs[0]
            caller = getattr(self._caller, "authorization", None)
            one = self.ask(item, {q: questions[q] for q in qids}, caller)
            out.answers[i], out.usage[i] = one.distributions, one.usage
            return out
        pool = self._pool or ThreadPoolExecutor(self.settings.max_in_flight, "cascade-upstream")
        self._pool = pool
        futures: list[tuple[int, Future[UpstreamAnswers]]] = [
            (i, pool.submit(self.ask, item, {q: questions[q] for q in qids})) for i, item, qids in jobs]
        errors = [f.exception() for _, f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        for i, future in futures:
            out.answers[i], out.usage[i] = future.result().distributions, future.result().usage
        return out

    def ask(self, item: Item, questions: Mapping[str, Question],
            authorization: str | None = None) -> UpstreamAnswers:
        """One state's distributions from ONE request holding only ``questions``, checked to come
        from the teacher; ``authorization``: the caller's, where the client forwards it."""
        reply = self.client.post(self.request(item, questions), authorization,
                                 headers={"X-Request-Id": item.id})
        response = read_response(reply.data, self.settings.shown)
        identity = response.identity()
        if identity != self._last_seen:  # the same identity as the last answer passed already
            self.watch.check(identity)
            self._last_seen = identity
        answers = distributions(response, questions, self.settings.shown)
        usage = Usage.model_construct(questions=len(questions), input_tokens=response.input_tokens,
                                      seconds=reply.seconds)
        return UpstreamAnswers(answers, usage, identity)

    @contextmanager
    def on_behalf_of(self, authorization: str | None) -> Iterator[None]:
        """Calls of one state made by this thread inside the block carry ``authorization`` (a
        server auditing a caller's item with forwarded auth)."""
        self._caller.authorization = authorization
        try:
            yield
        finally:
            self._caller.authorization = None

    def reset_identity(self) -> None:
        """Take the next answer's identity as the teacher's (``IdentityWatch.reset``)."""
        self._last_seen = None
        self.watch.reset()

    def request(self, item: Item, questions: Mapping[str, Question]) -> dict[str, Any]:
        """The System One body for ``questions`` about ``item``."""
        body: dict[str, Any] = {"state": item.state,
                                "questions": {qid: self._wire(qid, q) for qid, q in questions.items()}}
        if self.settings.model is not None:
            body["model"] = self.settings.model
        return body

    def _wire(self, qid: str, question: Question) -> dict[str, Any]:
        """A question's JSON, made once per question object (a bundle's live as long as the tier)."""
        known = self._wires.get(qid)
        if known is None or known[0] is not question:
            known = (question, question.model_dump(mode="json", exclude_none=True))
            self._wires[qid] = known
        return known[1]

    def flops_per_token(self) -> float:
        return 2.0 * TEACHER_PARAMS

    def pricing(self, cost: TierCost) -> TierPricing:
        """As a readout, with tokens estimated from the characters: the upstream's tokenizer is
        unknown here."""
        return TierPricing(cost, estimate_tokens, fanout=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.client.close()


def upstream_tier(name: str, build: Build) -> UpstreamTier:
    """The tier of ``build``'s upstream URL, expecting ``build.upstream_identity``."""
    if build.upstream is None:
        raise RouterError(f"tier {name!r} has no upstream URL to call")
    return UpstreamTier(name, open_client(build.upstream), build.upstream_identity)


class UpstreamKind(TierKind[UpstreamSpec]):
    """A teacher behind a System One URL, or its recorded labels in its place."""

    spec = UpstreamSpec

    def build(self, spec: UpstreamSpec, bundle: BundleParts, build: Build, top: bool) -> Tier:
        if build.labels is not None:
            return LabelsTier(spec.name, build.labels)
        if build.upstream is None:
            build = replace(build, upstream=UpstreamSettings(spec.url, model=spec.model))
        return upstream_tier(spec.name, build)

    def weights(self, spec: UpstreamSpec) -> tuple[float, str]:
        return TEACHER_PARAMS, (f"upstream {redact_url(spec.url)}: taken as a "
                                f"{TEACHER_PARAMS / 1e9:.0f}B model")
