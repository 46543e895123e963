"""Delete (rule 9), restart (rule 10), idempotency keys and all-or-none batch posts."""

from __future__ import annotations

from pathlib import Path

import pytest

from taskhoster import engine
from taskhoster.engine import NewItem
from taskhoster.errors import Conflict, ItemNotFound
from taskhoster.models import Item
from taskhoster.status import Status

from .lifecycle_helpers import (
    after,
    claim,
    claim_one,
    claimed_ids,
    exists,
    file_record,
    post,
    row,
    states_on_disk,
    utcnow,
)

pytestmark = pytest.mark.django_db


def _bring_to(item_id: str, status: str) -> None:
    if status == "pending":
        return
    held = claim_one()
    if status == "finished":
        engine.submit_result(item_id=item_id, result="r")
    elif status == "failed":
        engine.fail(item_id=item_id, lease=held.lease, error="bad", retry=False)
    assert row(item_id).status == status


# -- rule 9: delete -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["pending", "processing", "finished", "failed"])
def test_delete_in_any_state_removes_row_and_file(make_queue, state_root: Path, status) -> None:
    make_queue("q")
    item = post()
    keep = post(delay_seconds=100)
    _bring_to(item.id, status)
    assert states_on_disk(state_root, "q", item.id) == [
        "done" if status in ("finished", "failed") else status
    ]
    assert engine.delete_item(item_id=item.id) is True
    assert not exists(item.id)
    assert states_on_disk(state_root, "q", item.id) == []
    assert exists(keep.id)
    assert states_on_disk(state_root, "q", keep.id) == ["pending"]
    with pytest.raises(ItemNotFound):
        engine.get_item(item_id=item.id)
    assert engine.delete_item(item_id=item.id) is False


def test_result_after_delete_of_processing_item_changes_nothing(
    make_queue, state_root: Path
) -> None:
    make_queue("q")
    item = post()
    held = claim_one()
    engine.delete_item(item_id=item.id)
    with pytest.raises(ItemNotFound):
        engine.submit_result(item_id=item.id, result="late")
    with pytest.raises(ItemNotFound):
        engine.fail(item_id=item.id, lease=held.lease, error="x")
    assert not exists(item.id)
    assert states_on_disk(state_root, "q", item.id) == []


def test_delete_with_wrong_queue_name_keeps_the_item(make_queue, state_root: Path) -> None:
    make_queue("q")
    make_queue("other")
    item = post()
    assert engine.delete_item(item_id=item.id, queue_name="other") is False
    assert exists(item.id)
    assert states_on_disk(state_root, "q", item.id) == ["pending"]


def test_delete_many_and_by_status(make_queue, state_root: Path) -> None:
    make_queue("q")
    items = [post(payload=n).id for n in range(5)]
    assert engine.delete_items(item_ids=[items[0], items[1], "nope"]) == 2
    claim_one()  # items[2] is processing
    assert engine.delete_by_status(queue_name="q", status=Status.PENDING) == 2
    assert [i.id for i in Item.objects.all()] == [items[2]]
    for item_id in items[:2] + items[3:]:
        assert states_on_disk(state_root, "q", item_id) == []


def test_deleted_item_is_never_claimed(make_queue) -> None:
    make_queue("q")
    item = post()
    engine.delete_item(item_id=item.id)
    assert claim() == []


# -- rule 10: restart -----------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["pending", "processing", "finished"])
def test_restart_of_a_non_failed_item_is_a_conflict(make_queue, status) -> None:
    make_queue("q")
    item = post()
    _bring_to(item.id, status)
    before = row(item.id)
    with pytest.raises(Conflict):
        engine.restart(item_id=item.id)
    after_ = row(item.id)
    assert (after_.status, after_.attempts, after_.rev) == (
        before.status,
        before.attempts,
        before.rev,
    )


def test_restart_of_unknown_item_is_item_not_found(make_queue) -> None:
    make_queue("q")
    with pytest.raises(ItemNotFound):
        engine.restart(item_id="nope")


@pytest.mark.parametrize("how", ["fail", "timeout", "lapse"])
def test_restart_of_failed_item_makes_a_brand_new_pending_arrival(
    make_queue, state_root: Path, how
) -> None:
    make_queue("dlq")
    make_queue("q", maxAttempts=1, queueSeconds=100, deadLetterQueue="dlq")
    item = post(payload={"p": 1}, key="k")
    held = claim_one()
    if how == "fail":
        engine.fail(item_id=item.id, lease=held.lease, error="bad", retry=False)
    elif how == "timeout":
        engine.time_out_if_aged(item_id=item.id, at=after(row(item.id).posted_at, 100))
    else:
        engine.sweep(at=after(held.lease_expires_at))
    old = row(item.id)
    assert old.status == "failed"
    before = utcnow()
    restarted = engine.restart(item_id=item.id)
    got = row(item.id)
    assert restarted.id == got.id == item.id
    assert (got.status, got.attempts, got.error, got.finished_at) == ("pending", 0, None, None)
    assert (got.lease, got.lease_expires_at, got.dead_letter) == (None, None, None)
    assert got.posted_at >= before
    assert got.posted_at > old.posted_at
    assert got.scheduled_at == got.posted_at
    assert got.key == "k"
    assert states_on_disk(state_root, "q", item.id) == ["pending"]
    record = file_record(state_root, "q", item.id)
    assert (record["result"], record["error"], record["status"]) == (None, None, "pending")
    assert record["payload"] == {"p": 1}
    again = claim_one()
    assert (again.id, again.attempts) == (item.id, 1)


def test_restart_clears_a_previous_result_field(make_queue, state_root: Path) -> None:
    make_queue("q", queueSeconds=100)
    item = post()
    claim_one()
    engine.time_out_if_aged(item_id=item.id, at=after(row(item.id).posted_at, 100))
    engine.restart(item_id=item.id)
    assert file_record(state_root, "q", item.id)["result"] is None
    assert row(item.id).fetched_at is None


def test_restarted_item_queues_behind_items_posted_before_the_restart(make_queue) -> None:
    make_queue("q")
    item = post()
    engine.fail(item_id=item.id, lease=claim_one().lease, error="x", retry=False)
    waiting = post()
    engine.restart(item_id=item.id)
    assert claimed_ids() == [waiting.id, item.id]


def test_restart_of_retained_failed_item_restarts_the_retention_clock(make_queue) -> None:
    make_queue("q", retainSeconds=10)
    item = post()
    engine.fail(item_id=item.id, lease=claim_one().lease, error="x", retry=False)
    finished = row(item.id).finished_at
    engine.restart(item_id=item.id)
    assert engine.sweep(at=after(finished, 1000)).retained == 0
    assert row(item.id).status == "pending"


# -- idempotency keys -----------------------------------------------------------------------------


def test_same_key_returns_the_same_item_not_a_duplicate(make_queue) -> None:
    make_queue("q")
    first = engine.post_items(queue_name="q", items=[NewItem(payload=1, key="k")])[0]
    second = engine.post_items(queue_name="q", items=[NewItem(payload=2, key="k")])[0]
    assert first.created is True
    assert second.created is False
    assert second.row.id == first.row.id
    assert second.payload == 1
    assert Item.objects.count() == 1


@pytest.mark.parametrize("status", ["processing", "finished", "failed"])
def test_key_returns_existing_item_in_any_state(make_queue, status) -> None:
    make_queue("q")
    item = post(key="k")
    _bring_to(item.id, status)
    again = engine.post_items(queue_name="q", items=[NewItem(payload=9, key="k")])[0]
    assert (again.created, again.row.id, again.row.status) == (False, item.id, status)
    assert Item.objects.count() == 1


def test_key_is_free_again_after_the_item_is_deleted(make_queue) -> None:
    make_queue("q")
    item = post(key="k")
    engine.delete_item(item_id=item.id)
    again = engine.post_items(queue_name="q", items=[NewItem(payload=2, key="k")])[0]
    assert again.created is True
    assert again.row.id != item.id


def test_key_is_free_again_after_retention_removes_the_item(make_queue) -> None:
    make_queue("q", retainSeconds=10)
    item = post(key="k")
    claim_one()
    engine.submit_result(item_id=item.id, result=1)
    engine.sweep(at=after(row(item.id).finished_at, 10))
    assert not exists(item.id)
    again = engine.post_items(queue_name="q", items=[NewItem(payload=2, key="k")])[0]
    assert again.created is True
    assert again.row.id != item.id


def test_keys_are_scoped_to_their_queue(make_queue) -> None:
    make_queue("a")
    make_queue("b")
    one = engine.post_items(queue_name="a", items=[NewItem(payload=1, key="k")])[0]
    two = engine.post_items(queue_name="b", items=[NewItem(payload=1, key="k")])[0]
    assert two.created is True
    assert two.row.id != one.row.id


def test_batch_with_existing_and_repeated_keys_creates_each_key_once(make_queue) -> None:
    make_queue("q")
    old = post(key="old")
    answer = engine.post_items(
        queue_name="q",
        items=[
            NewItem(payload=1, key="old"),
            NewItem(payload=2, key="new"),
            NewItem(payload=3, key="new"),
            NewItem(payload=4),
        ],
    )
    assert answer[0].row.id == old.id
    assert answer[0].created is False
    assert answer[1].row.id == answer[2].row.id
    assert Item.objects.count() == 3


# -- batch post: all or none ---------------------------------------------------------------------


def test_batch_post_gives_every_member_an_id_in_list_order(make_queue, state_root: Path) -> None:
    make_queue("q")
    answer = engine.post_items(queue_name="q", items=[NewItem(payload=n) for n in range(20)])
    ids = [p.row.id for p in answer]
    assert ids == sorted(ids)
    assert len(set(ids)) == 20
    assert [p.payload for p in answer] == list(range(20))
    for n, item_id in enumerate(ids):
        assert file_record(state_root, "q", item_id)["payload"] == n
    assert [c.payload for c in claim(max_items=20)] == list(range(20))


def test_batch_post_with_one_invalid_member_posts_nothing(make_queue, state_root: Path) -> None:
    make_queue("q", queueSeconds=60)
    items = [NewItem(payload=n) for n in range(9)] + [NewItem(payload="x", delay_seconds=120)]
    with pytest.raises(Conflict):
        engine.post_items(queue_name="q", items=items)
    assert Item.objects.count() == 0
    assert sorted(p.name for p in (state_root / "q").rglob("*") if p.is_file()) == ["queue.json"]


def test_batch_post_with_unstorable_member_posts_nothing(make_queue, state_root: Path) -> None:
    make_queue("q")
    items = [NewItem(payload=n) for n in range(9)] + [NewItem(payload={1, 2})]
    with pytest.raises(TypeError):
        engine.post_items(queue_name="q", items=items)
    assert Item.objects.count() == 0
    assert sorted(p.name for p in (state_root / "q").rglob("*") if p.is_file()) == ["queue.json"]


@pytest.mark.django_db
def test_deleting_a_dead_letter_queue_clears_it_from_queues_that_used_it(make_queue):
    from taskhoster import engine
    from taskhoster.models import Queue

    make_queue("dlq")
    make_queue("main", deadLetterQueue="dlq")
    engine.delete_queue(queue_name="dlq")
    assert Queue.objects.get(name="main").dead_letter_queue is None
