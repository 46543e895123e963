"""A claim hands each item out once (rule 2, I3): the rounds of one claim never take an item
twice, and a claim whose file has already left ``pending/`` has lost.

Two server processes on PostgreSQL once handed one item to two sockets in one group, with two
leases and the same expiry: a claim's later round (run when the first passed over a busy
thread or a vanished file) found again the rows its first round had taken, since those rows
are written only after the rounds, and "moved" their files from ``processing/`` to
``processing/``. Each test here forces such a second round on purpose.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from django.db import connection, connections

from taskhoster import engine
from taskhoster.engine import claims as grouping
from taskhoster.models import Item, QueueCount, Thread
from taskhoster.status import Status

from .lifecycle_helpers import ago, claim, post, row, states_on_disk

pytestmark = pytest.mark.django_db(transaction=True)


def counts(queue: str = "q") -> dict[str, int]:
    found: dict[str, int] = {}
    for status, n in QueueCount.objects.filter(queue__name=queue).values_list("status", "n"):
        found[status] = found.get(status, 0) + n
    return {s: n for s, n in found.items() if n}


def assert_claimed_once(claimed: list[engine.Claimed], root: Path) -> None:
    ids = [c.row.id for c in claimed]
    assert len(ids) == len(set(ids)), f"one item handed out twice: {ids}"
    assert len({c.row.lease for c in claimed}) == len(ids)
    for c in claimed:
        assert states_on_disk(root, "q", c.row.id) == ["processing"]
        stored = row(c.row.id)
        assert stored.status == Status.PROCESSING
        assert stored.lease == c.row.lease


def test_a_claims_second_round_never_takes_what_its_first_round_took(
    make_queue, state_root
) -> None:
    """A vanished file (a delete that crashed half-way) leaves the first round short, so a
    second round runs: it must not find the first round's rows again."""
    make_queue("q")
    first = post(scheduled_at=ago(30))
    second = post(scheduled_at=ago(20))
    gone = post(scheduled_at=ago(10))
    (state_root / "q" / "pending" / f"{gone.id}.json").unlink()

    claimed = claim(max_items=3)

    assert sorted(c.row.id for c in claimed) == sorted([first.id, second.id])
    assert_claimed_once(claimed, state_root)
    assert not Item.objects.filter(id=gone.id).exists(), "the half-done delete is finished"
    assert counts() == {"processing": 2}


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="row locks that SKIP LOCKED passes: PostgreSQL"
)
def test_a_thread_held_by_another_transaction_does_not_make_a_claim_take_twice(
    make_queue, state_root
) -> None:
    """PostgreSQL: the head of a thread whose row another transaction holds is passed over
    (SKIP LOCKED), which sends the claim into a second round; SKIP LOCKED does not skip the
    rows this claim itself locked."""
    make_queue("q")
    threaded = post(thread_id="t", scheduled_at=ago(30))
    a = post(scheduled_at=ago(20))
    b = post(scheduled_at=ago(10))
    thread_pk = Thread.objects.get(thread_id="t").pk

    holding, release = threading.Event(), threading.Event()

    def hold_the_thread_row() -> None:
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute("BEGIN")
                cursor.execute(
                    "SELECT id FROM taskhoster_thread WHERE id = %s FOR UPDATE", [thread_pk]
                )
                holding.set()
                release.wait(30)
                cursor.execute("ROLLBACK")
        finally:
            other.close()

    holder = threading.Thread(target=hold_the_thread_row)
    holder.start()
    try:
        assert holding.wait(10)
        claimed = claim(max_items=3)
    finally:
        release.set()
        holder.join(30)

    assert sorted(c.row.id for c in claimed) == sorted([a.id, b.id])
    assert_claimed_once(claimed, state_root)
    assert row(threaded.id).status == Status.PENDING
    assert counts() == {"pending": 1, "processing": 2}


def test_a_claim_whose_file_already_left_pending_has_lost(make_queue, state_root) -> None:
    """The rename out of ``pending/`` is the guard: a claimable row whose file is elsewhere
    (here in ``done/``, where an index that is behind its files cannot see it) is never
    taken, whatever the index says; repair judges it."""
    make_queue("q")
    item = post()
    pending = state_root / "q" / "pending" / f"{item.id}.json"
    pending.rename(state_root / "q" / "done" / f"{item.id}.json")

    assert claim(max_items=5) == []
    assert states_on_disk(state_root, "q", item.id) == ["done"]
    stored = row(item.id)
    assert stored.status == Status.PENDING, "a lost claim changes nothing"
    assert stored.lease is None
    assert stored.attempts == 0


def test_a_claim_that_died_after_its_rename_is_undone_by_the_next_claim(
    make_queue, state_root
) -> None:
    """A file in ``processing/`` whose row is still pending at the same ``rev`` is a claim
    that renamed and died before its commit: the next claim loses to it, puts the file
    back in ``pending/``, and the claim after that takes it (one attempt)."""
    make_queue("q")
    item = post()
    pending = state_root / "q" / "pending" / f"{item.id}.json"
    pending.rename(state_root / "q" / "processing" / f"{item.id}.json")

    assert claim(max_items=5) == []
    assert states_on_disk(state_root, "q", item.id) == ["pending"]
    (again,) = claim(max_items=5)
    assert again.row.id == item.id
    assert again.row.attempts == 1
    assert_claimed_once([again], state_root)


def test_a_group_that_meets_one_item_twice_fails_instead_of_answering(
    make_queue, state_root, monkeypatch
) -> None:
    """The group's own check: should a claim's query ever return a row this group already
    took, the group fails (nothing written, nothing answered as claimed)."""
    make_queue("q")
    a = post(scheduled_at=ago(20))
    gone = post(scheduled_at=ago(10))
    (state_root / "q" / "pending" / f"{gone.id}.json").unlink()
    real = grouping.sql.claim_candidates

    def forgets_what_to_skip(queue_id, at, limit, skip=()):  # the bug, put back
        return real(queue_id, at, limit, ())

    monkeypatch.setattr(grouping.sql, "claim_candidates", forgets_what_to_skip)
    with pytest.raises(grouping.ClaimedTwice):
        claim(max_items=2)
    assert row(a.id).status == Status.PENDING
    assert states_on_disk(state_root, "q", a.id) == ["pending"]
