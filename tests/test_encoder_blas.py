"""The encoder tier's small products run on one BLAS thread, and the process's count comes back."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from cascade.encoder.blas import one_blas_thread
from cascade.encoder.familiar import FamiliarityGate
from cascade.encoder.onnx_encoder import Encoder
from cascade.heads import SoftmaxHead
from cascade.questions import parse_request
from cascade.tiers.base import Item
from cascade.tiers.encoder import EncoderTier


def blas_threads() -> set[int]:
    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


@pytest.fixture
def two_threads() -> Iterator[None]:
    """BLAS on two threads, so that lowering it to one shows (a one-core machine starts at one)."""
    with threadpool_limits(2, user_api="blas"):
        yield


@pytest.mark.usefixtures("two_threads")
def test_the_body_runs_on_one_blas_thread_and_the_count_comes_back() -> None:
    assert blas_threads() == {2}
    with one_blas_thread():
        assert blas_threads() == {1}
    assert blas_threads() == {2}


def test_a_worker_thread_gets_one_thread_and_leaves_the_limits_to_other_threads() -> None:
    """threadpoolctl lets one thread at a time set OpenBLAS's count: a server's worker that kept
    that right would leave every other thread's limits without effect."""
    seen: dict[str, set[int]] = {}
    left, looked = threading.Event(), threading.Event()

    def worker() -> None:
        with one_blas_thread():
            seen["inside"] = blas_threads()
        left.set()
        looked.wait()  # alive while the other thread sets its limit

    def other() -> None:
        left.wait()
        with threadpool_limits(3, user_api="blas"):
            seen["another thread's limit"] = blas_threads()
        looked.set()

    threads = [threading.Thread(target=worker), threading.Thread(target=other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"inside": {1}, "another thread's limit": {3}}


class WatchedGate(FamiliarityGate):
    """A fitted gate that notes the BLAS thread counts its products ran under."""

    seen: list[set[int]]

    def familiar(self, vectors: np.ndarray) -> np.ndarray:
        self.seen.append(blas_threads())
        return super().familiar(vectors)


@pytest.mark.usefixtures("two_threads")
def test_the_encoder_tier_runs_its_gate_on_one_blas_thread() -> None:
    encoder = Encoder(threads=1)
    texts = ["stocks fell on rate fears", "the striker scored twice", "a new phone chip", "rain all week"]
    vectors = encoder.encode(texts)
    fitted = FamiliarityGate.fit(vectors)
    gate = WatchedGate(fitted.reference, fitted.radius)
    gate.seen = []
    topic = {"type": "choice", "instructions": "What is it about?",
             "criteria": {"business": "money", "sport": "games", "tech": "devices", "weather": "skies"}}
    questions = parse_request({"state": "x", "questions": {"topic": topic}}).questions
    head = SoftmaxHead().fit(vectors, np.eye(4))
    tier = EncoderTier("encoder", encoder, {"topic": head}, gate=gate)
    reply = tier.reply([Item(str(i), text) for i, text in enumerate(texts)], [["topic"]] * 4, questions)
    assert gate.seen == [{1}]
    assert [int(np.argmax(answer["topic"])) for answer in reply.answers] == [0, 1, 2, 3]
    assert blas_threads() == {2}
