"""Thread groundwork in the engine: mutual exclusion (I3), head order (I4), and freeing a
thread at once when its processing member leaves."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from django.db import connection, transaction

from taskhoster import engine
from taskhoster.db.sqlite import base as sqlite_backend
from taskhoster.engine import NewItem
from taskhoster.engine.group import Group
from taskhoster.models import Item, Thread

from .lifecycle_helpers import (
    after,
    ago,
    claim,
    claim_one,
    claimed_ids,
    post,
    row,
    thread_row,
)

pytestmark = pytest.mark.django_db


def processing_members(thread_id: str) -> list[str]:
    return list(
        Item.objects.filter(thread_id=thread_id, status="processing").values_list("id", flat=True)
    )


def test_two_members_of_a_thread_are_never_both_processing(make_queue) -> None:
    make_queue("q")
    a = post(thread_id="t")
    post(thread_id="t")
    assert claimed_ids(max_items=10) == [a.id]
    assert claim() == []
    assert processing_members("t") == [a.id]
    thread = thread_row("q", "t")
    assert thread is not None
    assert thread.processing_item == a.id
    assert thread.member_count == 2


def test_thread_head_is_earliest_scheduled_at_not_earliest_arrival(make_queue) -> None:
    make_queue("q")
    later = post(thread_id="t", scheduled_at=ago(10))
    earlier = post(thread_id="t", scheduled_at=ago(20))
    assert claimed_ids() == [earlier.id]
    engine.submit_result(item_id=earlier.id, result=1)
    assert claimed_ids() == [later.id]


def test_thread_head_ties_are_broken_by_arrival(make_queue) -> None:
    make_queue("q")
    when = ago(5)
    answer = engine.post_items(
        queue_name="q",
        items=[NewItem(payload=n, thread_id="t", scheduled_at=when) for n in range(4)],
    )
    order = []
    for _ in range(4):
        got = claim()
        assert len(got) == 1
        order.append(got[0].payload)
        engine.submit_result(item_id=got[0].row.id, result=None)
    assert order == [0, 1, 2, 3]
    assert [p.row.id for p in answer] == sorted(p.row.id for p in answer)


def test_finishing_the_head_makes_the_next_member_claimable_at_once(make_queue) -> None:
    make_queue("q")
    a = post(thread_id="t")
    b = post(thread_id="t")
    claim_one()
    assert claim() == []
    engine.submit_result(item_id=a.id, result="ok")
    assert claimed_ids() == [b.id]


@pytest.mark.parametrize("how", ["death", "delete", "timeout"])
def test_processing_head_leaving_promotes_the_next_member_at_once(make_queue, how) -> None:
    make_queue("q", queueSeconds=100)
    a = post(thread_id="t")
    held = claim_one()
    b = post(thread_id="t")
    assert claim() == []
    if how == "death":
        engine.fail(item_id=a.id, lease=held.lease, error="x", retry=False)
    elif how == "delete":
        engine.delete_item(item_id=a.id)
    else:
        assert engine.time_out_if_aged(item_id=a.id, at=after(row(a.id).posted_at, 100))
    assert claimed_ids() == [b.id]


def test_deleting_a_pending_head_makes_the_next_member_head(make_queue) -> None:
    make_queue("q")
    a = post(thread_id="t")
    b = post(thread_id="t")
    engine.delete_item(item_id=a.id)
    thread = thread_row("q", "t")
    assert thread is not None
    assert (thread.heads, thread.member_count) == ([b.id], 1)
    assert claimed_ids() == [b.id]


def test_retrying_head_is_outranked_by_a_sibling_with_earlier_scheduled_at(make_queue) -> None:
    make_queue("q", backoffSeconds=60)
    a = post(thread_id="t")
    b = post(thread_id="t")
    engine.fail(item_id=a.id, lease=claim_one().lease, error="again")
    assert row(a.id).status == "pending"
    assert claimed_ids() == [b.id]


def test_lapsed_head_stays_head_with_scheduled_at_unchanged(make_queue) -> None:
    make_queue("q")
    a = post(thread_id="t")
    b = post(thread_id="t")
    held = claim_one()
    engine.sweep(at=after(held.lease_expires_at))
    assert claimed_ids() == [a.id]
    lease = row(a.id).lease
    assert lease is not None
    engine.requeue_held(item_id=a.id, lease=lease)
    assert claimed_ids() == [a.id]
    assert row(b.id).status == "pending"


def test_late_result_from_lapsed_worker_frees_thread_held_by_second_worker(make_queue) -> None:
    make_queue("q")
    a = post(thread_id="t")
    b = post(thread_id="t")
    first = claim_one()
    engine.sweep(at=after(first.lease_expires_at))
    claim_one()  # a second worker holds a
    assert engine.submit_result(item_id=a.id, result="from first").accepted is True
    assert claimed_ids() == [b.id]


def test_blocked_thread_does_not_hold_up_unthreaded_items(make_queue) -> None:
    make_queue("q")
    a = post(thread_id="t", scheduled_at=ago(30))
    post(thread_id="t", scheduled_at=ago(20))
    c = post(scheduled_at=ago(10))
    d = post()
    assert claimed_ids(max_items=10) == [a.id, c.id, d.id]


def test_blocked_thread_does_not_hold_up_other_threads(make_queue) -> None:
    make_queue("q")
    a1 = post(thread_id="a")
    post(thread_id="a")
    b1 = post(thread_id="b")
    assert claimed_ids(max_items=10) == [a1.id, b1.id]


def test_threads_are_scoped_to_their_queue(make_queue) -> None:
    make_queue("q1")
    make_queue("q2")
    one = post("q1", thread_id="t")
    two = post("q2", thread_id="t")
    assert claimed_ids("q1") == [one.id]
    assert claimed_ids("q2") == [two.id]


def test_thread_row_is_deleted_when_its_last_member_leaves(make_queue) -> None:
    make_queue("q")
    a = post(thread_id="t")
    b = post(thread_id="t")
    claim_one()
    engine.submit_result(item_id=a.id, result=1)
    assert thread_row("q", "t") is not None
    engine.delete_item(item_id=b.id)
    assert thread_row("q", "t") is None


def test_restarted_member_rejoins_its_thread(make_queue) -> None:
    make_queue("q")
    a = post(thread_id="t")
    engine.fail(item_id=a.id, lease=claim_one().lease, error="x", retry=False)
    assert thread_row("q", "t") is None
    b = post(thread_id="t")
    engine.restart(item_id=a.id)
    assert claimed_ids(max_items=10) == [b.id]
    engine.submit_result(item_id=b.id, result=1)
    assert claimed_ids(max_items=10) == [a.id]


def test_new_member_with_earlier_scheduled_at_displaces_an_unclaimed_head(make_queue) -> None:
    make_queue("q")
    old_head = post(thread_id="t", scheduled_at=ago(10))
    new_head = post(thread_id="t", scheduled_at=ago(60))
    assert claimed_ids(max_items=10) == [new_head.id]
    engine.submit_result(item_id=new_head.id, result=1)
    assert claimed_ids(max_items=10) == [old_head.id]


class WatchedWriter:
    """``taskhoster.db.sqlite``'s writer lock (taken at the start of every write transaction
    of this process), telling when a group commit has to wait for it."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.group_waits = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.lock.acquire(blocking=False):
            return True
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code is Group.run.__code__:  # a group, not (say) a flush of metrics
                self.group_waits.set()
                break
            frame = frame.f_back
        return bool(self.lock.acquire(blocking, timeout))

    def release(self) -> None:
        self.lock.release()


def held_up_by_this_transaction(monkeypatch: pytest.MonkeyPatch) -> Callable[[], bool]:
    """A test: is a group commit of another thread waiting for the transaction this thread is
    in, by the database's own account? On PostgreSQL, a session blocked by a lock of ours
    (``pg_locks`` is read live, also inside a transaction); on SQLite, which takes no row
    locks, a group waiting for the write lock (``BEGIN IMMEDIATE``) this transaction holds."""
    if connection.vendor == "postgresql":

        def blocked() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted "
                    "AND pg_backend_pid() = ANY(pg_blocking_pids(pid)))"
                )
                return bool(cursor.fetchone()[0])

        return blocked
    watched = WatchedWriter(sqlite_backend._writer)
    monkeypatch.setattr(sqlite_backend, "_writer", watched)
    return watched.group_waits.is_set


@pytest.mark.django_db(transaction=True)
def test_post_racing_the_last_member_leaving_still_joins_a_live_thread(
    make_queue, monkeypatch
) -> None:
    """The verdict on a thread's last member deletes the thread's row while the post of a new
    member waits for it: the post must make the row again, not write to the one it saw.

    The order is the database's, not a sleep's: the test holds the thread row (as a verdict
    does) and lets the verdict run only once the post's group is held up by this transaction
    (``held_up_by_this_transaction``): on PostgreSQL at the thread row's lock, on SQLite at
    the write lock this transaction took at its BEGIN. So on both the post's group is under way
    when the last member leaves, and on PostgreSQL it has met the row the verdict deletes."""
    make_queue("q")
    a = post(thread_id="t")
    claim_one()
    before = thread_row("q", "t")
    assert before is not None
    held_up = held_up_by_this_transaction(monkeypatch)
    posted: dict[str, str] = {}
    errors: list[BaseException] = []

    def poster() -> None:
        try:
            posted["b"] = post(thread_id="t").id
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    racer = threading.Thread(target=poster)
    with transaction.atomic():
        # hold the thread row as a verdict on its last member does, while a post arrives
        Thread.objects.select_for_update(of=("self",)).get(queue__name="q", thread_id="t")
        racer.start()
        deadline = time.monotonic() + 60
        while not held_up():
            assert not errors, errors
            assert not posted, "the post did not wait for this transaction"
            assert time.monotonic() < deadline, "the post never came to wait for this transaction"
            time.sleep(0.01)
        assert engine.submit_result(item_id=a.id, result=1).accepted is True
    racer.join(60)
    assert not racer.is_alive()
    assert errors == []
    thread = thread_row("q", "t")
    assert thread is not None, "the post joined a thread whose row the verdict deleted"
    assert thread.pk != before.pk, "the post wrote to the row the verdict deleted"
    assert (thread.member_count, thread.heads) == (1, [posted["b"]])
    assert claimed_ids() == [posted["b"]]


def test_an_unsent_claim_given_back_costs_no_attempt_and_keeps_the_head(make_queue, state_root):
    make_queue("q", maxAttempts=1)
    head = post(thread_id="t")
    second = post(thread_id="t")
    claimed = claim_one()
    assert claimed.id == head.id
    given_back = engine.release_unsent(item_id=head.id, lease=claimed.lease or "")
    assert given_back.accepted
    back = row(head.id)
    assert (back.status, back.attempts, back.error, back.lease) == ("pending", 0, None, None)
    assert (state_root / "q" / "pending" / f"{head.id}.json").exists()
    # still the thread's head, and claimable again (maxAttempts 1 was not used up)
    assert claimed_ids() == [head.id]
    assert row(second.id).eligible is False


def test_giving_back_needs_the_current_lease(make_queue):
    make_queue("q")
    item = post()
    claim_one()
    assert engine.release_unsent(item_id=item.id, lease="not-the-lease").accepted is False
    assert row(item.id).status == "processing"


def test_a_head_left_eligible_under_a_lowered_thread_limit_is_settled_away_by_the_claim(
    make_queue,
) -> None:
    """A group that settled a thread with the old ``threadLimit`` (it read the queue before the
    change) leaves more heads than the new limit allows: a claim takes what the limit allows
    and settles the thread again, so the extra head stops being offered (no claim loop on a
    row that can never be taken)."""
    make_queue("q", threadLimit=2)
    a = post(thread_id="t")
    b = post(thread_id="t")
    before = thread_row("q", "t")
    assert before is not None
    assert before.heads == [a.id, b.id]
    from taskhoster.models import Queue

    Queue.objects.filter(name="q").update(thread_limit=1)  # as if the resettle came first
    assert claimed_ids() == [a.id]
    thread = thread_row("q", "t")
    assert thread is not None
    assert (thread.processing, thread.heads) == (1, [])
    assert not Item.objects.get(id=b.id).eligible
    assert claimed_ids() == []
