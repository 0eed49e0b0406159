"""The gate for unfamiliar inputs: fitted on the train part only, it sends a state unlike every
training item to the teacher (marked ``unfamiliar``) and lets the items like them through."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from corpora import corpus_items
from servers import KEPT, serving_bundle

from cascade.bundle.manifest import Bundle
from cascade.encoder.familiar import QUANTILE, FamiliarityGate
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import BundleError
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from distill.calibration.scoring import score_tier

NONSENSE = ["zxq 0x7f3a ## ## ||| 9f8e7d6c5b4a3928 qwv", "SELECT * FROM users WHERE id = 42;",
            "Die Katze sitzt auf dem Dach und schläft in der Sonne."]


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def test_the_radius_is_the_quantile_of_the_leave_one_out_nearest_distances(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    vectors = unit(rng.normal(size=(300, 8)) + 3 * np.eye(8)[0])  # training items in one region
    gate = FamiliarityGate.fit(vectors)
    sims = vectors @ vectors.T
    np.fill_diagonal(sims, -np.inf)
    assert gate.radius == pytest.approx(np.quantile(1 - sims.max(axis=1), QUANTILE), abs=1e-6)
    assert gate.familiar(vectors).all()  # each is its own nearest reference
    assert not gate.familiar(unit(-np.eye(8)[:1])).any()  # the other side of the sphere
    gate.save(tmp_path / "gate.npz")
    again = FamiliarityGate.load(tmp_path / "gate.npz")
    assert again.radius == gate.radius
    np.testing.assert_allclose(again.distances(vectors[:20]), gate.distances(vectors[:20]), atol=2e-3)
    (tmp_path / "bad.npz").write_bytes(b"not a gate")
    with pytest.raises(BundleError, match="cannot read the familiarity gate"):
        FamiliarityGate.load(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="at least 2 training vectors"):
        FamiliarityGate.fit(vectors[:1])


def test_a_trained_bundle_gates_on_its_train_part_only(trained_bundle: Bundle, encoder: Encoder) -> None:
    tier = trained_bundle.manifest.encoder_tier
    assert tier is not None and tier.gate is not None
    texts = {item.id: item.text for item in corpus_items()}
    parts = trained_bundle.split_ids()
    refit = FamiliarityGate.fit(encoder.encode([texts[i] for i in parts["train"]]))
    assert tier.gate.radius == pytest.approx(refit.radius, abs=1e-6)
    gate = FamiliarityGate.load(trained_bundle.directory / tier.gate.file.name)
    held_out = gate.familiar(encoder.encode([texts[i] for i in parts["evaluation"]]))
    assert held_out.mean() >= 0.95  # items like the training ones go through
    assert not gate.familiar(encoder.encode(NONSENSE)).any()


def test_an_unfamiliar_state_goes_to_the_teacher_though_the_encoder_would_keep_it(
    trained_bundle: Bundle, gemma_path: Path, tmp_path: Path
) -> None:
    bundle = serving_bundle(trained_bundle, tmp_path / "support", gemma_path)  # "urgent" kept at 0.0
    with Cascade.load(bundle, teacher=gemma_path, threads=2) as cascade:
        familiar = cascade.decide(corpus_items()[0].text, questions=[KEPT]).answers[KEPT].routing
        strange = cascade.decide(NONSENSE[0], questions=[KEPT]).answers[KEPT].routing
    assert familiar is not None and (familiar.tier, familiar.unfamiliar) == ("encoder", False)
    assert strange is not None and (strange.tier, strange.unfamiliar) == ("teacher", True)
    assert strange.certified  # the teacher agrees with itself: the certificate holds


def test_calibration_leaves_the_states_the_gate_sends_up_out_of_the_encoders_answers(
    trained_bundle: Bundle
) -> None:
    """Routing never keeps the encoder's answer about an unfamiliar state, so calibration does
    not certify it either: the state counts as escalated in the thresholds and the replay."""
    items = [Item("familiar", corpus_items()[0].text), Item("strange", NONSENSE[0])]
    with Cascade.load(trained_bundle.directory, labels={KEPT: {}}) as cascade:
        encoder = cascade.tiers[0]
        reply = encoder.reply(items, [[KEPT]] * 2, cascade.questions)
        probs, cost = score_tier(encoder, "encoder", items, {KEPT: {"familiar": 0, "strange": 0}},
                                 {KEPT: cascade.questions[KEPT]}, progress=False)
    assert reply.unfamiliar == [False, True] and KEPT in reply.answers[1]  # the tier still answers
    assert set(probs[KEPT]) == {"familiar"} and cost.states == 2
