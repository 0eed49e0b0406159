"""The router on a real bundle: the session's encoder heads, trained on the generated corpus's
labels (``corpora``), with those labels as its teacher.

Thresholds, temperatures and tier costs are set by writing manifest copies, so each test says
exactly what the cascade was told. Measured costs are written too (1 ms per state for the
encoder, 100 ms per state for the teacher, nothing per token): a budget then buys a countable
number of escalations and no test depends on this machine's speed.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from corpora import HEADED
from tinymodels import tiny_llama_path

from cascade.answers import DecisionResponse
from cascade.bundle.manifest import Bundle, Manifest, ModelFile
from cascade.cost.pricing import CHARS_PER_TOKEN, TEACHER_PARAMS, TierCost
from cascade.cost.roofline import ModelShape, decision_flops
from cascade.errors import ModelError, RequestError, RouterError, TemperatureError
from cascade.hashing import file_sha256
from cascade.questions import DecisionRequest
from cascade.readout.excerpt import HeadTailExcerpt
from cascade.readout.placement import Placement
from cascade.readout.prompts import OPTIONS_FIRST_VERSION, PROMPT_VERSION, PromptTemplate
from cascade.routing.budget import Budget
from cascade.routing.router import Cascade
from cascade.thresholds import apply_temperature, threshold_score
from cascade.tiers.base import Item
from distill.cli import main
from distill.store import LabelStore

ENCODER_MS, TEACHER_MS = 1.0, 100.0
COSTS = {"encoder": {"seconds_per_state": ENCODER_MS / 1e3, "seconds_per_token": 0.0},
         "teacher": {"seconds_per_state": TEACHER_MS / 1e3, "seconds_per_token": 0.0}}


@pytest.fixture(scope="module")
def trained(labelled: tuple[Path, Path], trained_bundle: Bundle) -> tuple[Path, Path, Bundle]:
    """(corpus, store, bundle): the session's labelled corpus and the bundle trained on it."""
    return *labelled, trained_bundle


@pytest.fixture(scope="module")
def labels(trained: tuple[Path, Path, Bundle]) -> dict[str, dict[str, dict[str, float]]]:
    with LabelStore.open_existing(trained[1]) as store:
        return {qid: store.labels(qid) for qid in trained[2].manifest.questions}


@pytest.fixture(scope="module")
def texts(trained: tuple[Path, Path, Bundle]) -> dict[str, str]:
    return {row["id"]: row["text"] for row in map(json.loads, trained[0].open(encoding="utf-8"))}


def facts(**fields: Any) -> dict[str, Any]:
    """One (question, tier)'s calibration facts, as calibration writes them: a fitted temperature
    (no ``temperature_note``) and no threshold, with ``fields`` replaced."""
    return {"n": 100, "n_temperature": 30, "n_threshold": 100, "temperature": 1.0,
            "temperature_note": None, "ece_before": 0.0, "ece_after": 0.0, "threshold": None,
            "kept_share": 0.0, "agreement": 1.0, "agreement_kept": None, "lower_bound": 1.0,
            "reachable": True, "message": "keeps nothing", "method": "ltt", "target": 0.98,
            "delta": 0.05} | fields


def variant(bundle: Bundle, directory: Path, **fields: Any) -> Path:
    """A copy of the bundle whose manifest has ``fields`` replaced; by default, calibration facts
    saying the encoder temperatures of the headed questions were fitted, and measured COSTS."""
    data = bundle.manifest.model_dump(mode="json")
    fitted = {qid: {"encoder": facts()} for qid in HEADED}
    data["calibration"] = {"costs": COSTS, "questions": fitted}
    data.update(fields)
    Bundle(Manifest.model_validate(data), bundle.directory).save(directory)
    return directory


def thresholds(value: float | None, questions: tuple[str, ...] = HEADED) -> dict[str, dict[str, Any]]:
    return {qid: {"encoder": value} for qid in questions}


@pytest.fixture(scope="module")
def replay(trained: tuple[Path, Path, Bundle], labels: Mapping,
           tmp_path_factory: pytest.TempPathFactory, embedding_cache: Path) -> Iterator[Any]:
    """Load a variant of the bundle with the store's labels answering its top tier (once each),
    reading the embeddings training cached."""
    opened: dict[str, Cascade] = {}

    def load(**fields: Any) -> Cascade:
        key = json.dumps(fields, sort_keys=True)
        if key not in opened:
            directory = variant(trained[2], tmp_path_factory.mktemp("variant"), **fields)
            opened[key] = Cascade.load(directory, labels=labels, cache_dir=embedding_cache)
        return opened[key]

    yield load
    for cascade in opened.values():
        cascade.close()


def evaluation_items(bundle: Bundle, texts: Mapping[str, str], n: int,
                     labelled: Mapping[str, Any] | None = None) -> list[Item]:
    """The first n items of the evaluation part (of those in ``labelled``, when given)."""
    ids = [i for i in bundle.split_ids()["evaluation"] if labelled is None or i in labelled][:n]
    return [Item(i, texts[i]) for i in ids]


def asked_labelled(items: list[Item], labels: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    return [[qid for qid in labels if item.id in labels[qid]] for item in items]


def probabilities(response: DecisionResponse, qid: str) -> list[float]:
    return list(response.answers[qid].probabilities.values())


def test_threshold_zero_keeps_every_headed_answer_at_the_encoder(
    replay: Any, trained: tuple, labels: Mapping, texts: Mapping
) -> None:
    cascade = replay(thresholds=thresholds(0.0))
    items = evaluation_items(trained[2], texts, 60)
    asked = asked_labelled(items, labels)
    assert {"spam", "rare"} & {q for qids in asked for q in qids}  # questions without a head too
    for item, qids, response in zip(items, asked, cascade.route(items, asked), strict=True):
        assert list(response.answers) == qids
        for qid, answer in response.answers.items():
            routing = answer.routing
            if qid in HEADED:
                assert (routing.tier, routing.threshold, routing.budget_limited) == ("encoder", 0.0, False)
                assert routing.calibrated and answer.calibrated
            else:  # no head: starts at the next tier, which answers as the teacher did
                assert (routing.tier, routing.threshold, routing.calibrated) == ("teacher", None, False)
                assert answer.probabilities == pytest.approx(labels[qid][item.id])
        assert response.usage.questions == len(qids)


def test_threshold_none_escalates_everything_to_the_teacher(
    replay: Any, trained: tuple, labels: Mapping, texts: Mapping
) -> None:
    cascade = replay()  # a freshly trained bundle: every threshold None
    items = evaluation_items(trained[2], texts, 40)
    asked = asked_labelled(items, labels)
    for item, response in zip(items, cascade.route(items, asked), strict=True):
        for qid, answer in response.answers.items():
            assert answer.routing.tier == "teacher" and answer.routing.threshold is None
            assert answer.probabilities == pytest.approx(labels[qid][item.id])
        # without a budget an answer below a None threshold could never be kept: the encoder
        # is not asked, so the only cost is the teacher's state
        total = sum(answer.routing.cost_ms for answer in response.answers.values())
        assert total == pytest.approx(TEACHER_MS)
    bounded = cascade.route(items, asked, Budget(max_escalation_fraction=1.0))
    for qids, response in zip(asked, bounded, strict=True):
        total = sum(answer.routing.cost_ms for answer in response.answers.values())
        assert total == pytest.approx(TEACHER_MS + (ENCODER_MS if set(qids) & set(HEADED) else 0.0))


def test_a_question_without_a_head_never_runs_the_encoder(
    replay: Any, trained: tuple, labels: Mapping, texts: Mapping
) -> None:
    cascade = replay(thresholds=thresholds(0.0))
    items = evaluation_items(trained[2], texts, 5, labels["spam"])
    assert items
    for response in cascade.decide_batch(items, questions=["spam"]):
        routing = response.answers["spam"].routing
        assert routing.tier == "teacher"
        assert routing.cost_ms == pytest.approx(TEACHER_MS)


@pytest.mark.parametrize("calibration", [
    {"costs": COSTS},  # fresh from training: placeholder temperatures, no calibration facts
    {"costs": COSTS, "questions": {"urgent": {"encoder": facts(temperature_note="only 3 items; T left")}}},
])
def test_answers_are_calibrated_only_where_a_temperature_was_fitted(
    calibration: dict, replay: Any, urgent_items: list[Item]
) -> None:
    cascade = replay(thresholds=thresholds(0.0), calibration=calibration)
    for response in cascade.decide_batch(urgent_items[:5], questions=["urgent"]):
        answer = response.answers["urgent"]
        assert answer.routing.tier == "encoder"
        assert not answer.calibrated and not answer.routing.calibrated


def test_cached_embeddings_give_the_answers_fresh_ones_do(
    replay: Any, trained: tuple, labels: Mapping, texts: Mapping, tmp_path: Path
) -> None:
    items = evaluation_items(trained[2], texts, 10)
    cached = replay(thresholds=thresholds(0.0)).decide_batch(items, questions=list(HEADED))
    directory = variant(trained[2], tmp_path / "b", thresholds=thresholds(0.0))
    with Cascade.load(directory, labels=labels) as fresh:
        for a, b in zip(cached, fresh.decide_batch(items, questions=list(HEADED)), strict=True):
            assert a.answers["urgent"].routing == b.answers["urgent"].routing
            for qid in HEADED:
                assert probabilities(a, qid) == pytest.approx(probabilities(b, qid), abs=1e-6)


def test_temperature_scales_confidence_but_never_the_answer(
    replay: Any, trained: tuple, texts: Mapping
) -> None:
    items = evaluation_items(trained[2], texts, 20)
    plain = replay(thresholds=thresholds(0.0)).decide_batch(items, questions=["department"])
    temperatures = {"department": {"encoder": 2.5}}
    hot = replay(thresholds=thresholds(0.0), temperatures=temperatures).decide_batch(
        items, questions=["department"])
    for cold, warm in zip(plain, hot, strict=True):
        assert warm.answers["department"].choice == cold.answers["department"].choice
        expected = apply_temperature(probabilities(cold, "department"), 2.5)
        assert probabilities(warm, "department") == pytest.approx(expected.tolist())
        assert warm.answers["department"].confidence < cold.answers["department"].confidence
        assert warm.answers["department"].routing.raw_confidence == pytest.approx(
            max(probabilities(cold, "department")))


@pytest.mark.parametrize("schema", [{}, {"schema_version": 1, "threshold_on": "top"}],
                         ids=["margin", "schema-1 top probability"])
def test_thresholds_are_compared_with_the_raw_score_the_bundle_names(
    replay: Any, trained: tuple, texts: Mapping, schema: dict[str, Any]
) -> None:
    """Calibration certifies thresholds on a raw score; a temperature must not move what is kept,
    and a schema-1 bundle's thresholds stay on the top probability it was certified on."""
    items = evaluation_items(trained[2], texts, 40)
    plain = replay(thresholds=thresholds(0.0)).decide_batch(items, questions=["department"])
    kind = schema.get("threshold_on", "margin")
    routings = [r.answers["department"].routing for r in plain]  # exactly what is compared:
    raw = [r.raw_score if kind == "margin" else r.raw_confidence for r in routings]
    assert raw == pytest.approx([float(threshold_score(probabilities(r, "department"), kind)) for r in plain])
    threshold = sorted(raw)[len(raw) // 2]
    other = "top" if kind == "margin" else "margin"
    others = [float(threshold_score(probabilities(r, "department"), other)) for r in plain]
    # the two scores keep different items at this threshold, so the test tells them apart
    assert [s >= threshold for s in raw] != [s >= sorted(others)[len(others) // 2] for s in others]
    hot = replay(thresholds={"department": {"encoder": threshold}},
                 temperatures={"department": {"encoder": 3.0}}, **schema)
    kept = []
    for score, response in zip(raw, hot.decide_batch(items, questions=["department"]), strict=True):
        answer = response.answers["department"]
        assert answer.routing.tier == ("encoder" if score >= threshold else "teacher")
        if answer.routing.tier == "encoder":
            assert answer.routing.raw_score == pytest.approx(score)
            assert answer.routing.threshold_on == kind
            kept.append(answer)
    # kept although the reported (flattened) confidence is below the threshold
    assert len(kept) >= 10 and any(answer.confidence < threshold for answer in kept)


def test_temperature_keeps_exact_zeros_and_refuses_bad_values() -> None:
    assert apply_temperature([1.0, 0.0], 0.5).tolist() == [1.0, 0.0]
    assert apply_temperature([[0.2, 0.8]], 2.0)[0] == pytest.approx([1 / 3, 2 / 3])
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(TemperatureError, match=r"temperature must be a finite number > 0"):
            apply_temperature([0.5, 0.5], bad)


@pytest.fixture(scope="module")
def urgent_items(trained: tuple, texts: Mapping, labels: Mapping) -> list[Item]:
    return evaluation_items(trained[2], texts, 40, labels["urgent"])


@pytest.fixture(scope="module")
def confidences(replay: Any, urgent_items: list[Item]) -> list[float]:
    """The encoder tier's confidence about each item's urgency (every answer kept there)."""
    kept = replay(thresholds=thresholds(0.0)).decide_batch(urgent_items, questions=["urgent"])
    return [response.answers["urgent"].confidence for response in kept]


def least_confident(confidences: list[float], k: int) -> set[int]:
    return set(sorted(range(len(confidences)), key=lambda i: (confidences[i], i))[:k])


@pytest.mark.parametrize("k", [0, 3, 11])
def test_a_budget_for_k_escalations_escalates_the_k_least_confident(
    k: int, replay: Any, urgent_items: list[Item], confidences: list[float]
) -> None:
    n = len(urgent_items)
    budget = Budget(ms_per_call=(n * ENCODER_MS + k * TEACHER_MS + TEACHER_MS / 2) / n)
    responses = replay().decide_batch(urgent_items, budget, questions=["urgent"])
    routing = [r.answers["urgent"].routing for r in responses]
    escalated = {i for i, r in enumerate(routing) if r.tier == "teacher"}
    assert escalated == least_confident(confidences, k)
    for i, r in enumerate(routing):
        assert r.budget_limited == (i not in escalated)
        if i not in escalated:  # kept below its (None) threshold: the encoder's own answer
            assert r.tier == "encoder" and r.threshold is None
            assert responses[i].answers["urgent"].confidence == pytest.approx(confidences[i])
    assert sum(r.cost_ms for r in routing) <= budget.ms_per_call * n  # type: ignore[operator]


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 1.0])
def test_max_escalation_fraction_escalates_the_least_confident_share(
    fraction: float, replay: Any, urgent_items: list[Item], confidences: list[float]
) -> None:
    budget = Budget(max_escalation_fraction=fraction)
    responses = replay().decide_batch(urgent_items, budget, questions=["urgent"])
    escalated = {i for i, r in enumerate(responses) if r.answers["urgent"].routing.tier == "teacher"}
    assert escalated == least_confident(confidences, math.floor(fraction * len(urgent_items)))
    limited = sum(r.answers["urgent"].routing.budget_limited for r in responses)
    assert limited == len(urgent_items) - len(escalated)


def test_questions_without_a_lower_tier_use_up_the_escalation_share(
    replay: Any, trained: tuple, labels: Mapping, texts: Mapping
) -> None:
    items = evaluation_items(trained[2], texts, 8, labels["spam"])
    responses = replay().decide_batch(items, Budget(max_escalation_fraction=0.5),
                                      questions=["urgent", "spam"])
    tiers = [(r.answers["urgent"].routing.tier, r.answers["spam"].routing.tier) for r in responses]
    assert all(spam == "teacher" for _, spam in tiers)  # half the questions: the whole share
    assert all(urgent == "encoder" for urgent, _ in tiers)
    assert all(r.answers["urgent"].routing.budget_limited for r in responses)


def test_accepted_answers_are_never_budget_limited(replay: Any, urgent_items: list[Item]) -> None:
    responses = replay(thresholds=thresholds(0.0)).decide_batch(
        urgent_items, Budget(max_escalation_fraction=0.0), questions=["urgent"])
    assert not any(r.answers["urgent"].routing.budget_limited for r in responses)


@pytest.mark.parametrize("fields, message", [
    ({"ms_per_call": 0}, r"budget.ms_per_call: must be a finite number of milliseconds > 0.*got 0"),
    ({"ms_per_call": -5.0}, r"budget.ms_per_call: .*got -5.0"),
    ({"ms_per_call": math.inf}, r"budget.ms_per_call: .*got inf"),
    ({"ms_per_call": True}, r"budget.ms_per_call: .*got True"),
    ({"ms_per_call": "10"}, r"budget.ms_per_call: .*got '10'"),
    ({"max_escalation_fraction": 1.5}, r"budget.max_escalation_fraction: must be a number in \[0, 1\]"),
    ({"max_escalation_fraction": -0.1}, r"budget.max_escalation_fraction: .*got -0.1"),
    ({"max_escalation_fraction": math.nan}, r"budget.max_escalation_fraction: .*got nan"),
    ({"per_call": 3}, r"budget.per_call: Extra inputs are not permitted"),
])
def test_bad_budgets_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        Budget(**fields)


def test_bad_questions_and_states_are_refused(replay: Any) -> None:
    cascade = replay()
    with pytest.raises(RequestError, match=r"questions must name at least one of the bundle's"):
        cascade.decide("hello", questions=["nope"])
    with pytest.raises(RequestError, match=r"list of question ids; got the string 'urgent'"):
        cascade.decide("hello", questions="urgent")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=r"list of question ids; got a mapping"):  # its keys were read
        cascade.decide("hello", questions={"urgent": {"type": "noul", "instructions": "x"}})  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=r"items\[0\] \(id 'state'\): state must be non-empty"):
        cascade.decide("   ")


def pinned(model: Path, prompt_version: str = PROMPT_VERSION) -> dict[str, Any]:
    """The manifest's teacher entry for labels that ``model`` made."""
    return {"kind": "gguf", "model": model.name, "model_sha256": file_sha256(model),
            "prompt_version": prompt_version}


def test_the_teacher_must_be_the_one_the_labels_came_from(
    trained: tuple, texts: Mapping, tmp_path: Path, gemma_path: Path
) -> None:
    tiny = tiny_llama_path(tmp_path)
    cases = {"external": variant(trained[2], tmp_path / "ext"),
             "sha256": variant(trained[2], tmp_path / "other", teacher=pinned(tiny)),
             "prompt": variant(trained[2], tmp_path / "old", teacher=pinned(gemma_path, "readout-v0"))}
    reasons = {"external": "its labels are external labels", "sha256": "has sha256",
               "prompt": "prompt 'readout-v0'"}
    for case, directory in cases.items():
        with pytest.raises(RouterError, match=f"cannot escalate to .*{reasons[case]}.*accept"):
            Cascade.load(directory, teacher=gemma_path)
    with Cascade.load(cases["sha256"], teacher=gemma_path, threads=1, accept_other_teacher=True) as other:
        response = other.decide(texts[next(iter(texts))], questions=["urgent", "rare"])
    assert [a.routing.certified for a in response.answers.values()] == [False, False]


def test_an_external_top_tier_needs_a_teacher(trained: tuple, labels: Mapping, tmp_path: Path,
                                              gemma_path: Path) -> None:
    directory = variant(trained[2], tmp_path / "b")
    with pytest.raises(RouterError, match=r"external tier 'teacher'.*give --teacher PATH.gguf"):
        Cascade.load(directory)
    with pytest.raises(RouterError, match=r"teacher .* or labels .*not both"):
        Cascade.load(directory, teacher=gemma_path, labels=labels)
    with pytest.raises(RouterError, match=r"teacher model .*missing.gguf not found"):
        Cascade.load(directory, teacher=tmp_path / "missing.gguf")
    with pytest.raises(RouterError, match=r"teacher model .* is a folder"):
        Cascade.load(directory, teacher=str(tmp_path))
    with pytest.raises(RouterError, match=r"'ftp://x:\*\*\*@h/': a teacher is a GGUF's path") as caught:
        Cascade.load(directory, teacher="ftp://x:pw@h/")  # read as a path, and echoed with its password
    assert "pw" not in str(caught.value)
    with pytest.raises(RouterError, match=r"teacher must be a GGUF's path, an http\(s\):// URL .*; got int"):
        Cascade.load(directory, teacher=3)  # type: ignore[arg-type]
    # a mistyped tier name, or a dict for a Placement, was read as nothing: the tier ran as it would have
    with pytest.raises(RouterError, match=r"placement names 'teachr', not a tier of bundle .*: its tiers"):
        Cascade.load(directory, labels=labels, placement={"teachr": Placement(n_ctx=64)})
    with pytest.raises(RouterError, match=r"the bundle must be a folder's path; got NoneType"):
        Cascade.load(None)  # type: ignore[arg-type]
    (tmp_path / "cache-file").write_text("")
    with pytest.raises(RouterError, match=r"cache_dir .*cache-file is a file"):
        Cascade.load(directory, labels=labels, cache_dir=tmp_path / "cache-file")
    with pytest.raises(RouterError, match=r"placement must be one Placement, .*; got dict"):
        Cascade.load(directory, labels=labels, placement={"teacher": {"n_ctx": 64}})  # type: ignore[dict-item]


def test_cost_model_prices_a_state_once_and_its_questions_each(replay: Any, texts: Mapping) -> None:
    cascade = replay(calibration={"costs": {"encoder": {"seconds_per_state": 0.002,
                                                        "seconds_per_token": 1e-5},
                                            "teacher": {"seconds_per_state": 0.05,
                                                        "seconds_per_token": 1e-3}}})
    text = next(iter(texts.values()))
    costs = cascade.costs.batch([Item("x", text)])
    encoder_tokens = cascade.tiers[0].encoder.token_counts([text])[0]
    assert costs.seconds("encoder", 0, ["urgent"]) == pytest.approx(0.002 + encoder_tokens * 1e-5)
    assert costs.seconds("encoder", 0, ["urgent", "department"]) == costs.seconds("encoder", 0, ["urgent"])
    # fan-out: the shared prompt (template + state, len / 4 tokens without a tokenizer) once
    template = PromptTemplate("plain")  # the head before the state is prefilled once per run
    prompt = math.ceil(len(template.render("", "")) / CHARS_PER_TOKEN)
    prompt += math.ceil(len(text) / CHARS_PER_TOKEN) - math.ceil(len(template.head()) / CHARS_PER_TOKEN)
    one = costs.seconds("teacher", 0, ["urgent"]) + costs.seconds("teacher", 0, ["department"])
    both = costs.seconds("teacher", 0, ["urgent", "department"])
    assert one - both == pytest.approx(0.05 + prompt * 1e-3)
    assert costs.seconds("teacher", 0, []) == 0.0


def test_roofline_prices_tiers_without_measured_costs(
    trained: tuple, labels: Mapping, tmp_path: Path
) -> None:
    tiny = tiny_llama_path(tmp_path)
    variant(trained[2], tmp_path / "b", calibration={})
    with Cascade.load(tmp_path / "b", labels=labels, flops_per_second=1e12) as replayed:
        assert replayed.costs.cost("teacher") == TierCost(0.0, 2 * TEACHER_PARAMS / 1e12, "roofline")
        encoder_bytes = replayed.tiers[0].encoder.files.model.stat().st_size
        assert replayed.costs.cost("encoder") == TierCost(0.0, 2 * encoder_bytes / 1e12, "roofline")
    with Cascade.load(tmp_path / "b", teacher=tiny, flops_per_second=1e12, accept_other_teacher=True) as live:
        per_token = decision_flops(ModelShape.from_gguf(tiny), 1, output_rows=0) / 1e12
        assert live.costs.cost("teacher") == TierCost(0.0, per_token, "roofline")
        scorer = live.tiers[-1].scorer
        costs = live.costs.batch([Item("x", "Hello there")])
        overhead = len(scorer.model.tokenize(scorer.template.render("", "")))
        overhead -= len(scorer.model.tokenize(scorer.template.head()))
        state = len(scorer.model.tokenize("Hello there"))
        assert costs.seconds("teacher", 0, ["urgent"]) > (overhead + state) * per_token


def test_a_teacher_whose_labels_were_read_options_first_answers_options_first(
    trained: tuple, texts: Mapping, tmp_path: Path, gemma_path: Path
) -> None:
    directory = variant(trained[2], tmp_path / "b", teacher=pinned(gemma_path, OPTIONS_FIRST_VERSION))
    plain = variant(trained[2], tmp_path / "p", teacher=pinned(gemma_path))
    item = Item("x", next(iter(texts.values())))
    with Cascade.load(directory, teacher=gemma_path, threads=1) as cascade, \
            Cascade.load(plain, teacher=gemma_path, threads=1) as state_first:
        assert (cascade.tiers[-1].scorer.layout, state_first.tiers[-1].scorer.layout) == (
            "options-first", "state-first")
        ours, theirs = (c.decide_batch([item], questions=["rare"])[0] for c in (cascade, state_first))
    answer = ours.answers["rare"]
    assert answer.routing.tier == "teacher" and answer.routing.certified
    assert answer.readout.prompt_version == OPTIONS_FIRST_VERSION
    assert theirs.answers["rare"].readout.prompt_version == PROMPT_VERSION
    assert ours.audit.prompt_template_sha256 != theirs.audit.prompt_template_sha256


def test_a_gguf_teacher_answers_escalations_end_to_end(
    trained: tuple, texts: Mapping, tmp_path: Path, gemma_path: Path
) -> None:
    directory = variant(trained[2], tmp_path / "b", teacher=pinned(gemma_path))
    items = [Item(i, texts[i]) for i in list(texts)[:3]]
    asked = ("urgent", "rare")
    with Cascade.load(directory, teacher=gemma_path, threads=1) as cascade:
        responses = cascade.decide_batch(items, questions=list(asked))
        scorer = cascade.tiers[-1].scorer
        scorer.forget_head()  # the first reference decodes the head again, as the first item did
        references = [scorer.score(DecisionRequest(
            state=item.state, questions={q: cascade.questions[q] for q in asked})) for item in items]
    for response, reference in zip(responses, references, strict=True):
        assert {a.routing.tier for a in response.answers.values()} == {"teacher"}
        assert all(a.routing.certified for a in response.answers.values())
        assert response.usage.ran_on == {"teacher": scorer.ran_on}
        assert response.usage.input_tokens == reference.usage.input_tokens > 0
        assert response.usage.forward_passes == reference.usage.forward_passes >= 1
        for qid in asked:  # the scorer's own answer, through the tier and a temperature of 1
            assert probabilities(response, qid) == pytest.approx(probabilities(reference, qid), abs=1e-9)
            # with how it was read: the prompt that reproduces it and the mass on the letters
            assert response.answers[qid].readout == reference.answers[qid].readout is not None


SMALL_MS = 10.0


def three_tiers(bundle: Bundle, directory: Path, gemma_path: Path, small_threshold: float | None,
                n_ctx: int = 2048, **fields: Any) -> Path:
    """The bundle with gemma as a middle GGUF tier "small" between the encoder and the teacher."""
    encoder, teacher = bundle.manifest.model_dump(mode="json")["tiers"]
    small = {"kind": "gguf", "name": "small", "model": ModelFile.of(gemma_path).model_dump(), "n_ctx": n_ctx}
    costs = {**COSTS, "small": {"seconds_per_state": SMALL_MS / 1e3, "seconds_per_token": 0.0}}
    return variant(bundle, directory, tiers=[encoder, small, teacher], calibration={"costs": costs},
                   thresholds={"urgent": {"encoder": None, "small": small_threshold}}, **fields)


def test_a_middle_tier_answers_what_it_is_confident_about_or_what_the_budget_leaves_it(
    trained: tuple, labels: Mapping, urgent_items: list[Item], tmp_path: Path, gemma_path: Path
) -> None:
    items = urgent_items[:3]

    def routing(cascade: Cascade, budget: Budget | None = None) -> list[tuple[str, bool, float]]:
        responses = cascade.decide_batch(items, budget, questions=["urgent"])
        return [(r.answers["urgent"].routing.tier, r.answers["urgent"].routing.budget_limited,
                 round(r.answers["urgent"].routing.cost_ms, 6)) for r in responses]

    with Cascade.load(three_tiers(trained[2], tmp_path / "keep", gemma_path, 0.0),
                      labels=labels, threads=1) as keeping:
        # the encoder's threshold is None: without a budget it is not even asked
        assert routing(keeping) == [("small", False, SMALL_MS)] * 3
    with Cascade.load(three_tiers(trained[2], tmp_path / "unsure", gemma_path, None),
                      labels=labels, threads=1) as unsure:
        assert routing(unsure) == [("teacher", False, TEACHER_MS)] * 3
        # no teacher escalation allowed: the encoder is not asked (nothing could stop it going up
        # to the small tier), and the small tier's answers are kept, marked budget-limited
        assert routing(unsure, Budget(max_escalation_fraction=0.0)) == [("small", True, SMALL_MS)] * 3
        # a time budget could stop the encoder's escalation: it answers, and the small tier, which
        # could keep nothing the encoder's answer does not already give, is skipped; pooled over
        # the batch, 3 x 36 ms pays the encoder for all and the teacher once
        for ms in (ENCODER_MS + SMALL_MS + TEACHER_MS / 4, ENCODER_MS + SMALL_MS + TEACHER_MS / 2):
            pooled = sorted(routing(unsure, Budget(ms_per_call=ms)))
            teacher = ("teacher", False, ENCODER_MS + TEACHER_MS)
            assert pooled == [("encoder", True, ENCODER_MS)] * 2 + [teacher]


def test_a_state_too_long_for_a_tier_goes_past_it_and_past_the_teacher_fails_only_itself(
    trained: tuple, urgent_items: list[Item], tmp_path: Path, gemma_path: Path
) -> None:
    short, base = urgent_items[:2]
    assert isinstance(base.state, str)
    longer, longest = Item(base.id, " ".join([base.state] * 12)), Item("x", " ".join([base.state] * 80))
    directory = three_tiers(trained[2], tmp_path / "b", gemma_path, 0.0, n_ctx=256,
                            teacher=pinned(gemma_path))
    with Cascade.load(directory, teacher=gemma_path, threads=1, accept_other_teacher=True,
                      placement={"teacher": Placement(n_ctx=1024, threads=1)}) as cascade:
        tokens = cascade.tiers[1].count_tokens([longer.state, longest.state])
        assert 256 < tokens[0] < 700 and tokens[1] > 1024
        responses = cascade.decide_batch([short, longer], questions=["urgent"])
        routes = [r.answers["urgent"].routing for r in responses]
        assert [(r.tier, r.too_long_for) for r in routes] == [("small", []), ("teacher", ["small"])]
        cascade.tiers[-1].scorer.forget_head()  # as the teacher's first state decoded it
        reference = cascade.tiers[-1].scorer.score(DecisionRequest(
            state=longer.state, questions={"urgent": cascade.questions["urgent"]}))
        # past the teacher's context too: the other item of the batch is answered, and this one's
        # question, which no tier could read, is an error of its own instead of an answer
        fine, past = cascade.decide_batch([short, longest], questions=["urgent"])
    assert fine.answers["urgent"].routing is not None and fine.errors is None
    assert past.answers == {} and past.errors is not None and past.errors["urgent"].code == "input_too_long"
    assert re.search(r"teacher: the prompt needs (more than )?\d+ tokens .* holds 1024",
                     past.errors["urgent"].message)
    wire = json.loads(past.model_dump_json())
    assert wire["x_errors"]["urgent"]["code"] == "input_too_long" and "errors" not in wire
    assert "x_errors" not in json.loads(fine.model_dump_json())
    # the teacher's own reading of the state the small tier could not hold
    assert routes[1].raw_confidence == pytest.approx(max(reference.answers["urgent"].probabilities.values()),
                                                     abs=1e-9)


def test_a_state_past_the_teachers_context_keeps_a_lower_answer_marked_not_certified(
    trained: tuple, urgent_items: list[Item], tmp_path: Path, gemma_path: Path
) -> None:
    """The encoder answered but below its threshold; the teacher cannot read the state: the
    encoder's answer stays, uncertified, naming the teacher it went past."""
    short, base = urgent_items[:2]
    long = Item("long", " ".join([str(base.state)] * 40))
    directory = variant(trained[2], tmp_path / "b", thresholds=thresholds(1.0, ("urgent",)),
                        teacher=pinned(gemma_path))
    with Cascade.load(directory, teacher=gemma_path, threads=1, accept_other_teacher=True,
                      placement={"teacher": Placement(n_ctx=512, threads=1)}) as cascade:
        fine, kept = cascade.decide_batch([short, long], questions=["urgent"])
    assert kept.errors is None and fine.errors is None
    routing = kept.answers["urgent"].routing
    assert routing is not None and (routing.tier, routing.too_long_for) == ("encoder", ["teacher"])
    assert routing.certified is False
    assert fine.answers["urgent"].routing is not None and fine.answers["urgent"].routing.tier == "teacher"
    # the teacher never read it: none of its cost is charged (its predicted 40-fold prompt was, before)
    assert kept.usage.tiers is not None and kept.usage.tiers["teacher"].predicted_seconds == 0.0
    assert routing.cost_ms == pytest.approx(1e3 * kept.usage.tiers["encoder"].predicted_seconds)


def test_the_teacher_reads_an_over_long_state_by_the_bundles_input_policy(
    trained: tuple, urgent_items: list[Item], tmp_path: Path, gemma_path: Path
) -> None:
    """The labels were read with an excerpt: the teacher answers a long state from the same excerpt
    (its reading equals the scorer's own with that excerpt), and says so in readout.excerpt."""
    base = urgent_items[1]
    long = Item("long", " ".join([str(base.state)] * 40))
    encoder, _ = trained[2].manifest.model_dump(mode="json")["tiers"]
    teacher = {"kind": "gguf", "name": "teacher", "model": ModelFile.of(gemma_path).model_dump(),
               "n_ctx": 512, "excerpt": "head_tail:128"}
    directory = variant(trained[2], tmp_path / "b", tiers=[encoder, teacher], teacher=pinned(gemma_path),
                        thresholds=thresholds(None))
    with Cascade.load(directory, threads=1) as cascade:
        (response,) = cascade.decide_batch([long], questions=["urgent"])
        scorer = cascade.tiers[-1].scorer
        scorer.forget_head()
        request = DecisionRequest(state=long.state, questions={"urgent": cascade.questions["urgent"]})
        alone = scorer.score(request, excerpt=HeadTailExcerpt.parse("head_tail:128"))
    answer = response.answers["urgent"]
    assert response.errors is None and answer.routing is not None and answer.routing.tier == "teacher"
    assert answer.readout is not None and answer.readout.excerpt == "head_tail:128"
    assert answer.probabilities == pytest.approx(alone.answers["urgent"].probabilities, abs=1e-9)


def test_cli_decide_needs_a_teacher_and_resumes(
    trained: tuple, tmp_path: Path, gemma_path: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = variant(trained[2], tmp_path / "b", thresholds=thresholds(0.0))
    corpus = tmp_path / "few.jsonl"
    corpus.write_text("".join(trained[0].open(encoding="utf-8").readlines()[:3]), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = ["decide", "--bundle", str(directory), "--corpus", str(corpus), "--out", str(out)]
    assert main(args) == 2
    assert "RouterError" in capsys.readouterr().err and not out.exists()
    args += ["--teacher", str(gemma_path)]
    assert main(args) == 2  # the bundle's labels did not come from gemma
    assert "cannot escalate to" in capsys.readouterr().err and not out.exists()
    args.append("--accept-other-teacher")
    assert main([*args, "--batch-size", "2", "--threads", "1"]) == 0
    rows = [json.loads(line) for line in out.open(encoding="utf-8")]
    assert {row["answers"]["spam"]["x_routing"]["certified"] for row in rows} == {False}
    assert [row["id"] for row in rows] == [json.loads(line)["id"] for line in corpus.open()]
    assert rows[0]["answers"]["urgent"]["x_routing"]["tier"] == "encoder"
    assert rows[0]["answers"]["spam"]["x_routing"]["tier"] == "teacher"
    assert {row["model"] for row in rows} == {trained[2].manifest.name}
    with out.open("a", encoding="utf-8") as handle:
        handle.write('{"id": "cut sh')
    assert main([*args, "--threads", "1"]) == 0
    assert "decided 0 items (3 already in" in capsys.readouterr().out
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3


def test_cli_decide_answers_a_corpus_with_a_state_too_long_for_the_teacher_and_lists_it(
    trained: tuple, tmp_path: Path, gemma_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A bundle whose teacher reads 256 tokens and cuts nothing: the long item's escalated
    question gets x_errors, the other items are decided, and the run ends naming it."""
    encoder, _ = trained[2].manifest.model_dump(mode="json")["tiers"]
    teacher = {"kind": "gguf", "name": "teacher", "model": ModelFile.of(gemma_path).model_dump(),
               "n_ctx": 256}
    directory = variant(trained[2], tmp_path / "b", tiers=[encoder, teacher], teacher=pinned(gemma_path),
                        thresholds=thresholds(None))
    lines = trained[0].open(encoding="utf-8").readlines()[:2]
    long = json.dumps({"id": "long", "text": " ".join([json.loads(lines[0])["text"]] * 30)}) + "\n"
    corpus = tmp_path / "few.jsonl"
    corpus.write_text("".join([lines[0], long, lines[1]]), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(["decide", "--bundle", str(directory), "--corpus", str(corpus), "--out", str(out),
                 "--threads", "1"]) == 0
    rows = {row["id"]: row for row in map(json.loads, out.open(encoding="utf-8"))}
    assert len(rows) == 3 and rows["long"]["x_errors"]["spam"]["code"] == "input_too_long"
    assert all("x_errors" not in row for key, row in rows.items() if key != "long")
    err = capsys.readouterr().err
    assert re.search(r"\d+ questions of 1 items have no answer .* the first: item 'long'", err)


def test_gguf_tiers_run_where_the_bundle_or_the_caller_places_them(
    trained: tuple, labels: Mapping, urgent_items: list[Item], tmp_path: Path, gemma_path: Path
) -> None:
    directory = three_tiers(trained[2], tmp_path / "b", gemma_path, 0.0)
    data = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    data["tiers"][1]["placement"] = {"gpu_layers": 1, "threads": 1}
    (directory / "manifest.json").write_text(json.dumps(data), encoding="utf-8")
    if not llama_cpp.llama_supports_gpu_offload():  # the bundle's default is used, and refused
        with pytest.raises(ModelError, match=r"1 GPU layers asked.*no GPU offload"):
            Cascade.load(directory, labels=labels)
    per_tier = {"small": Placement(gpu_layers=0, extra_buffers="off")}
    with Cascade.load(directory, labels=labels, placement=per_tier) as cascade:
        response = cascade.decide_batch(urgent_items[:1], questions=["urgent"])[0]
    assert response.answers["urgent"].routing.tier == "small"
    assert response.usage.ran_on == {"small": "cpu, 1 thread, extra buffers off (asked)"}


def test_answers_say_when_the_encoder_cut_the_state_and_where_it_ran(
    trained: tuple, labels: Mapping, texts: Mapping, tmp_path: Path
) -> None:
    directory = variant(trained[2], tmp_path / "b", thresholds=thresholds(0.0))
    short = texts[next(iter(texts))]
    with Cascade.load(directory, labels=labels) as cascade:
        long = " ".join([short] * 40)
        whole, cut = cascade.decide_batch([Item("s", short), Item("l", long)], questions=["urgent"])
        encoder = cascade.tiers[0].encoder
    assert whole.answers["urgent"].routing.input_cut is None
    assert cut.answers["urgent"].routing.input_cut == (
        f"encoder read the first {encoder.max_length} tokens (max_length); the rest was cut")
    assert whole.usage.ran_on == {"encoder": "onnxruntime CPUExecutionProvider (device 'cpu' asked)"}


def test_one_cascade_called_from_several_threads_answers_as_called_alone(
    trained: tuple, texts: Mapping, labels: Mapping, tmp_path: Path, gemma_path: Path
) -> None:
    """llama.cpp's context is one KV cache: threads sharing a Cascade decoded into it at once
    and the process died (SIGSEGV). The scorer now takes one request at a time; each answer is
    the one the same call gets alone, and a closed cascade refuses every call, not only those
    that reach a model."""
    directory = variant(trained[2], tmp_path / "b", teacher=pinned(gemma_path))  # every question escalates
    states = list(texts.values())[:4]
    with Cascade.load(directory, teacher=gemma_path, threads=1) as cascade:
        alone = [cascade.decide(state) for state in states]
        got: dict[int, DecisionResponse] = {}

        def decide(i: int) -> None:
            got[i] = cascade.decide(states[i % len(states)])

        workers = [threading.Thread(target=decide, args=(i,)) for i in range(2 * len(states))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        assert sorted(got) == list(range(2 * len(states)))
        for i, response in got.items():
            want = alone[i % len(states)]
            for qid, answer in want.answers.items():
                assert answer.routing is not None and answer.routing.tier == "teacher"
                assert response.answers[qid].routing == answer.routing
                assert response.answers[qid].probabilities == pytest.approx(answer.probabilities, abs=1e-6)
    encoder_only = variant(trained[2], tmp_path / "e", thresholds=thresholds(0.0))
    cascade = Cascade.load(encoder_only, labels=labels)
    with pytest.raises(RequestError, match=r"items\[0\] \(id 'state'\): state: a key or text holds a lone"):
        cascade.decide("refund \ud800 please", questions=list(HEADED))  # the tokenizer's TypeError before
    # each an AttributeError from deep inside before, or a message that read a generator twice
    with pytest.raises(RequestError, match=r"budget must be a Budget .*; got dict"):
        cascade.decide("hi", budget={"ms_per_call": 5})  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=r"items\[0\] must be an Item\(id, state\) .*; got str"):
        cascade.decide_batch(["a", "b"])  # type: ignore[list-item]
    with pytest.raises(RequestError, match=r"at least one of the bundle's questions .*; got \['nope'\]"):
        cascade.decide("hi", questions=(q for q in ["nope"]))  # type: ignore[arg-type]
    cascade.close()
    with pytest.raises(RouterError, match="was closed; load it again"):
        cascade.decide(states[0], questions=list(HEADED))
