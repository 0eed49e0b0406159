"""Every seeded draw of the project comes from one hash (``cascade.hashing.seeded_unit``), and
none moved when the five copies became one: the draws below were computed by each caller's own
copy before the change (each keeps its own separator and seed), so an audit sample, a collected
share, a split, a temperature part or a held-out fifth is the same on either side of it."""

from __future__ import annotations

from cascade.audit.sample import AuditSampler
from cascade.collect.collector import Collector
from cascade.hashing import seeded_bits, seeded_unit
from distill.calibration import fits
from distill.training import mid_layer, split


class _Kept:
    """A sink that keeps what it is given, in order."""

    def __init__(self) -> None:
        self.items: list[int] = []

    def append(self, item: int) -> None:
        self.items.append(item)

    def count(self) -> int:
        return 0


def test_the_audit_sample_draws_what_it_drew() -> None:
    half = AuditSampler(0.5, "audit")
    assert "".join("1" if half.chosen(str(n)) else "0" for n in range(16)) == "1111011000111001"
    two_percent = AuditSampler(0.02, "audit")
    assert [n for n in range(300) if two_percent.chosen(str(n))] == [56, 191, 262]


def test_the_collectors_share_draws_what_it_drew() -> None:
    for seed, kept in (("collect", [1, 3, 6, 7, 8, 9, 10, 11, 13, 15]),
                       ("escalations", [0, 1, 2, 3, 6, 8, 10, 13, 14])):
        sink = _Kept()
        collector = Collector(sink, share=0.5, seed=seed)
        for n in range(16):
            collector.offer(lambda _, n=n: n)  # type: ignore[misc]
        collector.close()
        assert sink.items == kept, seed
        assert collector.counts["not_chosen"] == 16 - len(kept)


def test_the_split_draws_what_it_drew() -> None:
    ids = ["ag-news-00017", "item-1", "item-2", "ünïcode", "q/7"]
    assert [split._unit(i, split.DEFAULT_SALT) for i in ids] == [
        0.2825188504461118, 0.7635131821219885, 0.8335759730053433, 0.04723927649131922, 0.5726887481227482]
    assert [split._unit(i, "x") for i in ids] == [
        0.9747049552384045, 0.031671183926692, 0.3356156780203728, 0.41234367550282386, 0.5795252983399898]
    assert [split.part_of(i) for i in ids] == ["train", "evaluation", "evaluation", "train", "calibration"]


def test_the_temperature_part_draws_what_it_drew() -> None:
    assert [n for n in range(20) if fits.in_temperature_part(f"item-{n}")] == [4, 5, 9, 11, 16, 17]


def test_the_mid_layer_samples_and_held_out_fifth_draw_what_they_drew() -> None:
    ids = [f"item-{n}" for n in range(12)]
    assert mid_layer._sampled(ids, 4) == ["item-1", "item-11", "item-6", "item-8"]
    assert [n for n in range(20) if mid_layer._held_out(f"item-{n}")] == [1, 5, 7, 8, 12, 17]
    # held out by the hash's first byte (51 < 256 x 0.2), though its 64-bit draw is past 0.2
    assert mid_layer._held_out("k337") and seeded_unit("held", "k337", "\0") > mid_layer.HELD_OUT


def test_one_draw_is_the_first_64_bits_of_the_hash_over_2_to_the_64() -> None:
    assert seeded_bits("", "abc", "") == 0xBA7816BF8F01CFEA  # sha256("abc") begins ba7816bf 8f01cfea
    assert seeded_unit("", "abc", "") == 0xBA7816BF8F01CFEA / 2.0**64
    assert seeded_unit("cascade-split-v1", "item-1", "\0") == split._unit("item-1", "cascade-split-v1")
    assert seeded_unit("audit", "7") == seeded_unit("", "audit\x1e7", "")  # by default the separator is RS
