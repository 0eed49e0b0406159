"""The router: each question goes up the tiers, cheapest first, until one is confident enough.

A tier's answer is kept when its raw score (the bundle's ``threshold_on``: the margin over the
runner-up, or the top probability in a schema-1 bundle) clears the (question, tier) threshold;
the top tier answers whatever reaches it. A budget bounds the predicted cost of a call or the
share of questions the top tier may answer; when it cannot pay for every escalation the most
doubtful answers go first and the others keep their lower answer, marked
``routing.budget_limited``. The rules in full: docs/budgets.md.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from cascade.answers import Answer, Audit, DecisionResponse, QuestionError, Routing, TierUsage, Usage
from cascade.bundle.manifest import MANIFEST_NAME, Manifest
from cascade.encoder.onnx_encoder import Device
from cascade.errors import CascadeError, RequestError, RouterError
from cascade.hashing import file_sha256
from cascade.questions import Question, State, state_problem
from cascade.readout.placement import Placements
from cascade.readout.prompts import letters_sha256, prompt_version, template_sha256
from cascade.routing.budget import Budget, Pick, Run, allowance
from cascade.routing.endpoint import Teacher
from cascade.routing.forecast import CostModel
from cascade.routing.preflight import prepared
from cascade.thresholds import apply_temperature, threshold_score
from cascade.tiers.base import Build, Item, Labels, Reply, Tier
from cascade.tiers.kinds import build_tiers, close_tiers


class Cascade:
    """Tiers of a bundle, with the manifest's thresholds and temperatures and a cost model."""

    def __init__(self, manifest: Manifest, tiers: Sequence[Tier], costs: CostModel,
                 certified: bool = True, manifest_sha256: str | None = None) -> None:
        """``certified``: False when the top tier is not the teacher the thresholds were certified
        against (``Cascade.load(accept_other_teacher=True)``); every answer then says so.
        ``manifest_sha256``: of the bundle's manifest file, which every answer's audit names
        (default: of the manifest as read)."""
        self.manifest = manifest
        self.tiers = list(tiers)
        self.closed = False
        self.costs = costs
        self.certified = certified
        self.questions: dict[str, Question] = manifest.parsed_questions()
        self.manifest_sha256 = manifest_sha256 or hashlib.sha256(
            manifest.model_dump_json().encode()).hexdigest()
        self.calibration_version = manifest.calibration.version()
        # what every answer's audit lists per question, hashed once here instead of per answer
        version = prompt_version(manifest.teacher_layout())
        self._audit_hashes = {qid: (template_sha256(q, version), letters_sha256(q))
                              for qid, q in self.questions.items()}
        self.demoted: set[str] = set()  # questions a drift alarm sent to the top tier (cascade.audit)

    @classmethod
    def load(
        cls,
        bundle_dir: Path,
        teacher: Teacher | None = None,
        labels: Labels | None = None,
        device: Device = "cpu",
        flops_per_second: float | None = None,
        cache_dir: Path | None = None,
        threads: int | None = None,
        placement: Placements = None,
        accept_other_teacher: bool = False,
    ) -> Cascade:
        """Load a bundle's tiers; ``teacher`` (a GGUF) or ``labels`` answer an external top tier.

        ``labels`` also replace a GGUF top tier, to replay a cascade on labelled items without
        running the teacher. ``flops_per_second`` prices tiers without measured costs.
        ``cache_dir`` holds an embedding cache (as training keeps one) that the encoder tier
        reads and fills, for replays on items embedded before. ``threads``: CPU threads of each
        model (default: all cores; fewer where other work shares the machine).

        ``placement`` says where GGUF tiers run (GPU layers, threads, n_ctx): one for every GGUF
        tier (the teacher included), or one per tier name; fields left None come from the tier's
        default in the bundle. A ``teacher`` must be the model the bundle's labels came from
        (same sha256 and prompt version): thresholds certify agreement with that model only.
        ``accept_other_teacher`` runs another one anyway, and every answer says it is not certified.
        A tier calibration took out of the cascade (it cost more than it saved) is not loaded.
        ``teacher`` may be a System One URL (or ``UpstreamSettings``): the top tier then calls it,
        and every answer must state the bundle's teacher (``cascade.routing.endpoint``).
        """
        bundle, build, certified = prepared(bundle_dir, teacher, labels, accept_other_teacher,
                                             Build(device=device, cache_dir=cache_dir, threads=threads,
                                                   placements=placement))
        dropped = bundle.manifest.calibration.dropped()
        tiers = build_tiers(bundle, build, [s for s in bundle.manifest.tiers if s.name not in dropped])
        try:
            costs = CostModel.for_tiers(bundle.manifest, tiers, flops_per_second)
        except BaseException:
            close_tiers(tiers)
            raise
        return cls(bundle.manifest, tiers, costs, certified,
                   file_sha256(bundle.directory / MANIFEST_NAME))

    @staticmethod
    def preflight(bundle_dir: Path, teacher: Teacher | None = None,
                  accept_other_teacher: bool = False) -> None:
        """Every check ``load`` makes before a model loads (the bundle's files, the teacher given
        against the one certified), loading nothing: a server runs it before it opens its port."""
        prepared(bundle_dir, teacher, None, accept_other_teacher, Build())

    def close(self) -> None:
        """Free the llama.cpp models the tiers opened; every later call is refused (``start``)."""
        self.closed = True
        close_tiers(self.tiers)

    def __enter__(self) -> Cascade:
        """``with Cascade.load(...) as cascade:``, so that the models are freed however the block
        ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the tiers (``close``) on leaving the ``with`` block, an exception included."""
        self.close()

    def decide(
        self, state: State, budget: Budget | None = None, questions: Sequence[str] | None = None
    ) -> DecisionResponse:
        """Answer the bundle's questions (or the ``questions`` named) about one state."""
        return self.decide_batch([Item("state", state)], budget, questions)[0]

    def decide_batch(
        self, items: Sequence[Item], budget: Budget | None = None, questions: Sequence[str] | None = None
    ) -> list[DecisionResponse]:
        """Answer the same questions about every item; the budget is shared by the batch."""
        qids = self._question_ids(questions)
        return self.route(items, [qids] * len(items), budget)

    def route(
        self, items: Sequence[Item], asked: Sequence[Sequence[str]], budget: Budget | None = None
    ) -> list[DecisionResponse]:
        """Answer ``asked[i]`` (bundle question ids) about ``items[i]``, one response per item."""
        return self.responses(self.routed(items, asked, budget))

    def routed(
        self, items: Sequence[Item], asked: Sequence[Sequence[str]], budget: Budget | None = None
    ) -> Run:
        """``route``'s finished run, for a caller that reads more than the responses (which tier
        answered what: the escalations a command keeps)."""
        run = self.start(items, asked, budget)
        for t in range(len(self.tiers)):
            self.ask([run], t)
        return run

    def start(
        self, items: Sequence[Item], asked: Sequence[Sequence[str]], budget: Budget | None = None,
        first_tier: int = 0,
    ) -> Run:
        """A routing call, its questions queued at the first tier from ``first_tier`` up that may
        keep their answers (a server sends a caller the upstream has not vouched for to the top).

        ``route`` is ``start``, ``ask`` at each tier in turn, then ``responses``; a server runs
        those steps itself, to ask a tier about the runs of several requests in one batch and to
        hand a run up to another worker while the next request's run starts.
        """
        if self.closed:  # else a call the encoder answered alone passed, and the next one failed
            raise RouterError(f"the cascade of bundle {self.manifest.name!r} was closed; load it again")
        if budget is not None and not isinstance(budget, Budget):  # an AttributeError deep inside before
            raise RequestError(f"budget must be a Budget (cascade.Budget(ms_per_call=..., "
                               f"max_escalation_fraction=...)); got {type(budget).__name__}")
        _check_items(items, asked, self.questions)
        run = Run(items, asked, budget if budget is not None else Budget(), self.costs.batch(items),
                  len(self.tiers))
        for i, qids in enumerate(asked):
            for qid in qids:
                self._place(run, i, qid, first_tier, run.budget, forced=True)
        return run

    def next_tier(self, run: Run) -> int | None:
        """The lowest tier not asked yet that has questions of ``run`` queued; None when done."""
        return next((t for t in range(run.at, len(self.tiers)) if any(run.queued[t])), None)

    def ask(self, runs: Sequence[Run], t: int, reply: Reply | None = None) -> None:
        """Ask tier ``t`` what each run queued for it, in ONE batch, then queue each run's
        unsure answers one tier up. Every run must be at ``t`` or below it (``next_tier``).
        ``reply``: the tier's answers already in hand (a server that sent them in one request
        with other questions), its usage holding the seconds they took.

        The batch changes no answer: a tier's answer about an item depends on that item and the
        questions it is asked, not on the other items of the batch (the encoder computes each
        vector alone or bit-identically in any batch; a GGUF tier reads each state on its own).
        """
        if any(run.at > t for run in runs):
            raise CascadeError(f"tier {t} was already asked about this run; ask each tier once, "
                               "lowest first")
        sent = [[sorted(qids, key=list(run.asked[i]).index) for i, qids in enumerate(run.queued[t])]
                for run in runs]
        if any(any(s) for s in sent):
            self._ask_batch(runs, t, sent, reply)
        for run in runs:
            run.at = t + 1
            if t + 1 < len(self.tiers):
                self._escalate(run, t, run.budget)

    def keep_below_top(self, run: Run) -> bool:
        """Give up the top tier for ``run`` (it is overloaded): every question queued there that
        a lower tier answered keeps that answer, marked budget-limited and uncertified; False,
        changing nothing, when some queued question has no lower answer to keep."""
        if not self.can_keep_below_top(run):
            return False
        top = len(self.tiers) - 1
        queued = [(i, qid) for i, qids in enumerate(run.queued[top]) for qid in qids]
        for i, qid in queued:
            pick = run.picks[i][qid]
            pick.budget_limited = pick.overloaded = True
        run.queued[top] = [[] for _ in run.items]
        return True

    def can_keep_below_top(self, run: Run) -> bool:
        """Whether every question of ``run`` queued at the top tier has a lower tier's answer to
        keep (``keep_below_top``); none has for a state routing sends up whatever the budget."""
        top = len(self.tiers) - 1
        return all(qid in run.picks[i] for i, qids in enumerate(run.queued[top]) for qid in qids)

    def sends_every_item_up(self, qid: str, budget: Budget) -> bool:
        """Whether routing sends question ``qid`` to the top tier whatever the item: no cheap tier
        may keep an answer to it (none holds a threshold for it or can answer it, or a drift alarm
        demoted it) and ``budget`` bounds nothing (a bound can keep an uncertified answer in its
        place, by the item's cost). The teacher's answers to such a question are then a census of
        the traffic routed while it held, not a choice of the cascade's doubt
        (``cascade.collect.escalation``)."""
        if budget.ms_per_call is not None or budget.max_escalation_fraction is not None:
            return False
        cheap = self.tiers[:-1]
        return qid in self.demoted or not any(
            tier.can_answer(qid) and self.manifest.threshold(qid, tier.name) is not None for tier in cheap)

    def _question_ids(self, questions: Sequence[str] | None) -> list[str]:
        if questions is None:
            return list(self.questions)
        if isinstance(questions, str | Mapping):  # a mapping's definitions were ignored, its keys read
            got = f"the string {questions!r}" if isinstance(questions, str) else "a mapping"
            raise RequestError(f"questions must be a list of question ids; got {got}")
        questions = list(questions)  # a generator, read once (it read as empty in the message)
        unknown = [q for q in questions if q not in self.questions]
        if unknown or not questions:
            raise RequestError(f"questions must name at least one of the bundle's questions "
                               f"{list(self.questions)}; got {list(questions)}")
        return list(dict.fromkeys(questions))

    def _may_keep(self, run: Run, i: int, qid: str, t: int, budget: Budget) -> bool:
        """Whether tier ``t``'s answer to ``qid`` about item ``i`` could be the one returned: the
        condition for asking the tier at all. The top tier's always can; a tier without a head
        for the question has none; an answer that may clear a threshold can.

        A question a drift alarm demoted (``demoted``) skips every cheap tier.

        Below a threshold of None an answer is kept only when a budget stops its escalation, so
        the tier is asked only if the budget can stop the escalation out of it (a time budget
        can stop any; the top-tier share only the one into the top tier) and no lower tier has
        an answer to keep instead: one uncertified answer in place of another buys nothing the
        budget can vouch for, and costs a pass.
        """
        top, tier = len(self.tiers) - 1, self.tiers[t]
        if t == top:
            return True
        if not tier.can_answer(qid) or qid in self.demoted:
            return False
        if self.manifest.threshold(qid, tier.name) is not None:
            return True
        stops = budget.ms_per_call is not None or (
            budget.max_escalation_fraction is not None and t + 1 == top)
        return stops and qid not in run.picks[i]

    def _place(self, run: Run, i: int, qid: str, start: int, budget: Budget, forced: bool) -> bool:
        """Queue question ``qid`` of item ``i`` for the first tier from ``start`` up that may keep
        its answer, charging that tier's predicted cost; False (nothing queued) when the budget
        cannot pay. A ``forced`` question has no answer below to keep in its place, so it goes
        regardless, marked over budget where the budget could not pay."""
        t = next(u for u in range(start, len(self.tiers)) if self._may_keep(run, i, qid, u, budget))
        name, queued = self.tiers[t].name, run.queued[t][i]
        extra = (run.costs.seconds(name, i, self._shape(t, [*queued, qid]))
                 - run.costs.seconds(name, i, self._shape(t, queued)))
        top = t == len(self.tiers) - 1
        seconds, share = allowance(budget, run, top)
        fits = run.spent + extra <= seconds and run.top_used + top <= share
        if not (fits or forced):
            return False
        queued.append(qid)
        run.spent += extra
        run.top_used += top
        if not fits:
            run.over_budget.add((i, qid))
        return True

    def _ask_batch(self, runs: Sequence[Run], t: int, sent: list[list[list[str]]],
                   given: Reply | None = None) -> None:
        """Ask tier ``t`` the questions sent to it about every run's items in one reply (or take
        ``given``); record each (temperature-scaled) answer in its run."""
        tier, top = self.tiers[t], t == len(self.tiers) - 1
        items = [item for run in runs for item in run.items]
        shapes = [self._shape(t, qids) for run_sent in sent for qids in run_sent]
        started = time.perf_counter()
        reply = given if given is not None else tier.reply(items, shapes, self.questions)
        took = sum(u.seconds for u in reply.usage) if given is not None else time.perf_counter() - started
        seconds = took / sum(1 for shape in shapes if shape)
        first = 0
        for run, run_sent in zip(runs, sent, strict=True):
            for i, qids in enumerate(run_sent):
                self._record(run, t, i, qids, reply, first + i, seconds, top)
            first += len(run.items)

    def _record(self, run: Run, t: int, i: int, qids: Sequence[str], reply: Reply, row: int,
                seconds: float, top: bool) -> None:
        """Keep tier ``t``'s answers to item ``i`` of ``run`` (row ``row`` of the tier's reply)."""
        if not qids:
            return
        tier = self.tiers[t]
        run.usage[i] = _add(run.usage[i], reply.usage[row], seconds, {tier.name: tier.ran_on})
        run.took[t][i] = seconds
        if reply.unfamiliar[row] and not top:  # unlike the training items: its questions go up
            run.unfamiliar.add(i)
            return
        why = reply.too_long[row]
        if why is not None:  # longer than this tier's context: they go up too
            run.too_long.add((t, i))
            if top:  # nothing above: a lower answer is kept (uncertified), or the question fails
                run.errors.update({(i, qid): why for qid in qids if qid not in run.picks[i]})
            return
        for qid in qids:
            if qid not in reply.answers[row]:
                if top:
                    raise CascadeError(f"the top tier {tier.name!r} did not answer question "
                                       f"{qid!r} about item {run.items[i].id!r}")
                continue
            raw = reply.answers[row][qid]
            probs = apply_temperature(raw, self.manifest.temperature(qid, tier.name))
            threshold = None if top else self.manifest.threshold(qid, tier.name)
            score = float(threshold_score(raw, self.manifest.threshold_on))
            readout = reply.readouts[row].get(qid)
            tokens = readout.tokens if readout is not None else reply.usage[row].input_tokens
            run.picks[i][qid] = Pick(t, raw, probs, score, threshold, self._fitted(qid, t),
                                      readout, reply.cuts[row], tokens=tokens)
            run.answered[t][i].append(qid)

    def _shape(self, t: int, qids: Sequence[str]) -> list[str]:
        """What tier ``t`` is asked about a state to answer ``qids``.

        A GGUF tier below the top is asked every question of the bundle, in its order, as
        calibration asked it: a fan-out's probabilities move with the batch of questions decoded
        together (up to 0.09 on gemma, 2.8% argmax flips: BENCHMARKS.md), so a threshold only
        certifies answers read in the batch it was certified on. The price is the suffix tokens
        of the questions not escalated (the state's prefill is shared), which the cost model
        charges. Other tiers are asked ``qids`` alone.
        """
        if qids and t < len(self.tiers) - 1 and self.tiers[t].batch_sensitive:
            return list(self.questions)
        return list(qids)

    def _fitted(self, qid: str, t: int) -> bool:
        """Whether calibration fitted a temperature for (question, tier).

        Calibration records its facts per (question, tier) in ``calibration.questions``, with a
        ``temperature_note`` saying why T was left at 1.0 when it could not be fitted; a bundle
        fresh from training holds placeholder temperatures of 1.0 and no facts. The top tier is
        the reference the others are calibrated against, so it never is.
        """
        facts = self.manifest.calibration.facts(qid, self.tiers[t].name)
        top = t == len(self.tiers) - 1
        return not top and facts is not None and facts.temperature_note is None

    def _escalate(self, run: Run, t: int, budget: Budget) -> None:
        """Send up what tier ``t`` left open. A question it was asked but did not answer goes
        regardless when nothing below answered it either. Unsure answers go most doubtful first,
        each one the budget can still pay for: one that does not fit is skipped and keeps its
        answer, marked budget-limited, and cheaper ones after it may still go."""
        for i, qids in enumerate(run.queued[t]):
            for qid in qids:
                if qid not in run.answered[t][i] and qid not in run.picks[i]:
                    self._place(run, i, qid, t + 1, budget, forced=True)
        for i, qid in self._unsure(run, t):
            if not self._place(run, i, qid, t + 1, budget, forced=False):
                run.picks[i][qid].budget_limited = True

    def _unsure(self, run: Run, t: int) -> list[tuple[int, str]]:
        """(item, question) of tier ``t``'s answers below their threshold and of the questions
        it was asked but left to a lower tier's answer, most doubtful first (``Pick.doubt``);
        ties go to the earlier item and question."""
        unsure = []
        for i, qids in enumerate(run.queued[t]):
            for qid in qids:
                pick = run.picks[i].get(qid)
                if pick is not None and not pick.accepted:
                    unsure.append((*pick.doubt, i, list(run.asked[i]).index(qid), qid))
        return [(i, qid) for *_, i, _, qid in sorted(unsure)]

    def responses(self, run: Run) -> list[DecisionResponse]:
        """One response per item of a run every tier it needed has answered."""
        if self.next_tier(run) is not None:
            raise CascadeError(f"tier {self.next_tier(run)} has questions of this run still to answer")
        return [self._response(run, i) for i in range(len(run.items))]

    def _response(self, run: Run, i: int) -> DecisionResponse:
        shares: dict[str, float] = dict.fromkeys(run.asked[i], 0.0)
        spend: dict[str, TierUsage] = {}
        for t, tier in enumerate(self.tiers):
            qids = run.queued[t][i]
            if not qids:
                continue
            unread = (t, i) in run.too_long  # past its context: it read nothing, and costs nothing
            predicted = 0.0 if unread else run.costs.seconds(tier.name, i, self._shape(t, qids))
            spend[tier.name] = TierUsage(predicted_seconds=predicted, seconds=run.took[t][i])
            for qid in qids:
                shares[qid] += 1e3 * predicted / len(qids)
        answers: dict[str, Answer] = {}
        errors: dict[str, QuestionError] = {}
        top = len(self.tiers) - 1
        for qid in run.asked[i]:
            if (i, qid) in run.errors:
                errors[qid] = QuestionError(code="input_too_long", message=run.errors[i, qid])
                continue
            pick = run.picks[i][qid]
            unread_above = (top, i) in run.too_long and qid in run.queued[top][i]
            routing = Routing(tier=self.tiers[pick.tier].name, cost_ms=shares[qid],
                              threshold=pick.threshold, raw_confidence=float(pick.raw.max()),
                              raw_score=pick.score, threshold_on=self.manifest.threshold_on,
                              calibrated=pick.calibrated,
                              budget_limited=pick.budget_limited, input_cut=pick.cut,
                              certified=self.certified and not pick.overloaded and not unread_above,
                              over_budget=(i, qid) in run.over_budget, overloaded=pick.overloaded,
                              demoted=qid in self.demoted and pick.tier == len(self.tiers) - 1,
                              upstream=self.tiers[pick.tier].remote,
                              unfamiliar=i in run.unfamiliar,
                              too_long_for=[self.tiers[t].name for t in range(len(self.tiers))
                                            if (t, i) in run.too_long and qid in run.queued[t][i]])
            answer = self.questions[qid].answer(pick.probs.tolist(), calibrated=pick.calibrated,
                                                readout=pick.readout)
            answers[qid] = answer.model_copy(update={"routing": routing})
        return DecisionResponse(model=self.manifest.name, answers=answers,
                                usage=run.usage[i].model_copy(update={"tiers": spend}),
                                audit=self._audit(run, i, list(answers)), errors=errors or None)

    def _audit(self, run: Run, i: int, qids: list[str]) -> Audit:
        """The facts of item ``i``'s answers to ``qids``: per question, its prompt template,
        allowed answers and the tokens its tier read; the backends and precisions of the tiers
        that answered."""
        picks = run.picks[i]
        answering = [self.tiers[t] for t in sorted({picks[q].tier for q in qids})]
        return Audit(model_hash=self.manifest_sha256, calibration_version=self.calibration_version,
                     prompt_template_sha256=[self._audit_hashes[q][0] for q in qids],
                     allowed_token_set_hash=[self._audit_hashes[q][1] for q in qids],
                     input_tokens=[picks[q].tokens for q in qids],
                     backend="+".join(dict.fromkeys(tier.backend for tier in answering)),
                     precision="+".join(dict.fromkeys(tier.precision for tier in answering)))


def _add(total: Usage, more: Usage, seconds: float, ran_on: Mapping[str, str]) -> Usage:
    return Usage(questions=total.questions, input_tokens=total.input_tokens + more.input_tokens,
                 forward_passes=total.forward_passes + more.forward_passes,
                 seconds=total.seconds + seconds, ran_on={**total.ran_on, **ran_on})


def _check_items(items: Sequence[Item], asked: Sequence[Sequence[str]],
                 questions: Mapping[str, Question]) -> None:
    """Refuse what would fail deep inside a tier, naming the item."""
    if len(items) != len(asked):
        raise RequestError(f"asked must list the question ids of each item: {len(items)} items, "
                           f"{len(asked)} lists")
    for n, (item, qids) in enumerate(zip(items, asked, strict=True)):
        if not isinstance(item, Item):
            raise RequestError(f"items[{n}] must be an Item(id, state) (cascade.Item); got "
                               f"{type(item).__name__}: for texts alone, call decide()")
        state = item.state
        if not isinstance(state, str | dict | list) or not (state.strip() if isinstance(state, str)
                                                            else state):
            raise RequestError(f"items[{n}] (id {item.id!r}): state must be non-empty text or a "
                               f"JSON object or array; got {state!r:.60}")
        if (problem := state_problem(state)) is not None:
            raise RequestError(f"items[{n}] (id {item.id!r}): state: {problem}")
        unknown = [q for q in qids if q not in questions]
        if not qids or unknown or len(set(qids)) < len(qids):
            raise RequestError(f"items[{n}] (id {item.id!r}): asked must list distinct question ids "
                               f"of the bundle {list(questions)}; got {list(qids)}")
