"""One request's response, put together from the cascade's answers and the teacher's alone.

The cascade answers the bundle's questions under the bundle's ids; a request may name them
otherwise, ask one twice, or add questions the bundle does not hold, which the top tier answers
alone, marked ``covered=False`` (and not ``certified``): no threshold was calibrated for them.
The response lists every answer, and every audit entry, under the request's ids in its order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cascade.answers import Answer, Audit, DecisionResponse, QuestionError, Routing, Usage
from cascade.questions import Question
from cascade.readout.prompts import letters_sha256, template_sha256
from cascade.routing.router import Cascade
from cascade.serve.matching import Matched
from cascade.thresholds import threshold_score
from cascade.tiers.base import Item, Reply


@dataclass(frozen=True)
class Foreign:
    """The top tier's answers to questions the bundle does not hold, with what they took."""

    answers: dict[str, Answer]
    tokens: dict[str, int]
    usage: Usage
    errors: dict[str, QuestionError]


def answer_foreign(cascade: Cascade, item: Item, questions: Mapping[str, Question],
                   near: Mapping[str, str] | None = None) -> Foreign:
    """Ask the top tier alone; its raw distribution is the answer (nothing calibrated it). A
    state it cannot read leaves each of these questions an error of its own."""
    top = cascade.tiers[-1]
    reply = top.reply([item], [read_order(questions)], questions)
    usage = reply.usage[0].model_copy(update={"ran_on": {top.name: top.ran_on}})
    return foreign_answers(cascade, questions, reply, usage, near)


def read_order(questions: Mapping[str, Question]) -> list[str]:
    """The ids in the order the top tier is to read their questions: by content, whatever the
    request's order or ids. A GGUF tier reads one state's questions in one batch, and another
    layout of that batch moves its numbers (within the decode paths' tolerance): read in this
    order, a request's questions get the same answers in any order (jevcompat's
    ``semantics.question-order``)."""
    return sorted(questions, key=lambda qid: json.dumps(questions[qid].model_dump(mode="json"),
                                                        sort_keys=True, ensure_ascii=False))


def foreign_answers(cascade: Cascade, questions: Mapping[str, Question], reply: Reply, usage: Usage,
                    near: Mapping[str, str] | None = None) -> Foreign:
    """The top tier's answers to ``questions`` (its one-item ``reply``, keyed by their ids), each
    marked not covered and not certified; ``usage``: what they took."""
    top = cascade.tiers[-1]
    answers: dict[str, Answer] = {}
    tokens: dict[str, int] = {}
    why = reply.too_long[0]
    if why is not None:
        errors = {qid: QuestionError(code="input_too_long", message=why) for qid in questions}
        return Foreign(answers, tokens, usage, errors)
    for qid, question in questions.items():
        raw = reply.answers[0][qid]
        readout = reply.readouts[0].get(qid)
        routing = Routing(tier=top.name, cost_ms=0.0, threshold=None, raw_confidence=float(raw.max()),
                          raw_score=float(threshold_score(raw, cascade.manifest.threshold_on)),
                          threshold_on=cascade.manifest.threshold_on, calibrated=False,
                          input_cut=reply.cuts[0], certified=False, covered=False,
                          uncovered_why=(near or {}).get(qid), upstream=top.remote)
        answer = question.answer(raw.tolist(), readout=readout)
        answers[qid] = answer.model_copy(update={"routing": routing})
        tokens[qid] = readout.tokens if readout is not None else 0
    return Foreign(answers, tokens, usage, {})


def assemble(cascade: Cascade, order: Sequence[str], matched: Matched,
             routed: DecisionResponse | None, foreign: Foreign | None,
             demoted_why: Mapping[str, str] | None = None) -> DecisionResponse:
    """The response to a request whose question ids are ``order``; ``demoted_why``: per bundle
    question, why a demoted answer skipped the cheap tiers."""
    answers: dict[str, Answer] = {}
    errors: dict[str, QuestionError] = {}
    templates, letters, tokens = [], [], []
    backends, precisions = [], []
    rows = list(routed.answers) if routed is not None else []  # the routed audit's rows
    for qid in order:
        if qid in matched.bundle:
            assert routed is not None
            known = matched.bundle[qid]
            if known in (routed.errors or {}):
                errors[qid] = (routed.errors or {})[known]
                continue
            answers[qid] = _why(routed.answers[known], (demoted_why or {}).get(known))
            row = rows.index(known)
            templates.append(routed.audit.prompt_template_sha256[row])
            letters.append(routed.audit.allowed_token_set_hash[row])
            tokens.append(routed.audit.input_tokens[row])
        else:
            assert foreign is not None
            if qid in foreign.errors:
                errors[qid] = foreign.errors[qid]
                continue
            question = matched.foreign[qid]
            answers[qid] = foreign.answers[qid]
            templates.append(template_sha256(question))
            letters.append(letters_sha256(question))
            tokens.append(foreign.tokens[qid])
    if routed is not None:
        backends += routed.audit.backend.split("+")
        precisions += routed.audit.precision.split("+")
    if foreign is not None:
        backends.append(cascade.tiers[-1].backend)
        precisions.append(cascade.tiers[-1].precision)
    audit = Audit(model_hash=cascade.manifest_sha256, calibration_version=cascade.calibration_version,
                  prompt_template_sha256=templates, allowed_token_set_hash=letters, input_tokens=tokens,
                  backend="+".join(dict.fromkeys(backends)), precision="+".join(dict.fromkeys(precisions)))
    return DecisionResponse(model=cascade.manifest.name, answers=answers,
                            usage=_usage(len(order), routed, foreign), audit=audit, errors=errors or None)


def _why(answer: Answer, why: str | None) -> Answer:
    """``answer`` with ``demoted_why`` set where it was demoted and a reason is known."""
    routing = answer.routing
    if why is None or routing is None or not routing.demoted:
        return answer
    return answer.model_copy(update={"routing": routing.model_copy(update={"demoted_why": why})})


def _usage(questions: int, routed: DecisionResponse | None, foreign: Foreign | None) -> Usage:
    parts = [u for u in (routed.usage if routed else None, foreign.usage if foreign else None) if u]
    return Usage(questions=questions, input_tokens=sum(u.input_tokens for u in parts),
                 forward_passes=sum(u.forward_passes for u in parts),
                 seconds=sum(u.seconds for u in parts),
                 ran_on={k: v for u in parts for k, v in u.ran_on.items()},
                 tiers=routed.usage.tiers if routed else {})
