"""The order a socket claim's slots are filled in (``dispatcher.deal_order``)."""

from __future__ import annotations

from taskhoster.work.dispatcher import deal_order


def test_slots_go_round_the_sockets_one_each_before_any_gets_two() -> None:
    free = {"a": 3, "b": 1, "c": 2}
    assert deal_order(["a", "b", "c"], free.__getitem__, 100) == ["a", "b", "c", "a", "c", "a"]


def test_a_claim_is_made_for_at_most_its_limit_of_slots_the_least_recently_served_first() -> None:
    free = {"a": 5, "b": 5, "c": 5}
    assert deal_order(["c", "a", "b"], free.__getitem__, 4) == ["c", "a", "b", "c"]


def test_sockets_without_a_free_slot_get_none() -> None:
    free = {"a": 0, "b": 2}
    assert deal_order(["a", "b"], free.__getitem__, 10) == ["b", "b"]
    assert deal_order([], free.__getitem__, 10) == []


def test_every_free_slot_is_counted_once_however_many_sockets() -> None:
    sockets = list(range(2000))
    slots = deal_order(sockets, lambda s: s % 7, 10**6)
    assert len(slots) == sum(s % 7 for s in sockets)
    assert slots[: len([s for s in sockets if s % 7])] == [s for s in sockets if s % 7]
