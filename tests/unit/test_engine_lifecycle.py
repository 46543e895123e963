"""The engine's lifecycle for unthreaded items: post, claim, result, fail, death.

SPEC section 3, rules 1-4 and 7, against the real database and real state directories.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from taskhoster import engine
from taskhoster.errors import Conflict, ItemNotFound, QueueNotFound
from taskhoster.models import Item

from .lifecycle_helpers import (
    after,
    ago,
    claim,
    claim_one,
    claimed_ids,
    file_record,
    post,
    row,
    states_on_disk,
    utcnow,
)

pytestmark = pytest.mark.django_db


# -- rule 1: post -------------------------------------------------------------------------------


def test_post_is_pending_with_zero_attempts_scheduled_now(make_queue, state_root: Path) -> None:
    make_queue("q")
    before = utcnow()
    item = post(payload={"n": 1})
    after_post = utcnow()
    got = row(item.id)
    assert got.status == "pending"
    assert got.attempts == 0
    assert before <= got.posted_at <= after_post
    assert got.scheduled_at == got.posted_at
    assert got.lease is None
    assert got.lease_expires_at is None
    assert states_on_disk(state_root, "q", item.id) == ["pending"]
    assert file_record(state_root, "q", item.id)["payload"] == {"n": 1}


def test_post_keeps_a_given_scheduled_at(make_queue, state_root: Path) -> None:
    make_queue("q")
    when = utcnow() + timedelta(hours=2)
    item = post(scheduled_at=when)
    assert row(item.id).scheduled_at == when
    assert file_record(state_root, "q", item.id)["scheduledAt"] == (
        when.isoformat(timespec="microseconds").replace("+00:00", "Z")
    )


def test_post_with_delay_seconds_schedules_from_post_time(make_queue) -> None:
    make_queue("q")
    item = row(post(delay_seconds=90).id)
    assert item.scheduled_at == item.posted_at + timedelta(seconds=90)


def test_post_scheduled_beyond_queue_timeout_is_refused_and_leaves_nothing(
    make_queue, state_root: Path
) -> None:
    make_queue("q", queueSeconds=60)
    with pytest.raises(Conflict):
        post(delay_seconds=61)
    assert Item.objects.count() == 0
    assert list((state_root / "q" / "pending").iterdir()) == []


def test_post_to_unknown_queue_is_queue_not_found(make_queue) -> None:
    with pytest.raises(QueueNotFound):
        post("nope")


def test_item_is_not_claimable_before_its_scheduled_at(make_queue) -> None:
    make_queue("q")
    item = post(delay_seconds=0.4)
    assert claim() == []
    assert row(item.id).status == "pending"
    wait = (row(item.id).scheduled_at - utcnow()).total_seconds()
    if wait > 0:
        time.sleep(wait + 0.02)
    assert claimed_ids() == [item.id]


def test_item_scheduled_in_the_past_is_claimable_at_once(make_queue) -> None:
    make_queue("q")
    item = post(scheduled_at=ago(3600))
    assert claimed_ids() == [item.id]


# -- rule 2: claim ------------------------------------------------------------------------------


def test_claim_hands_out_earliest_scheduled_at_first(make_queue) -> None:
    make_queue("q")
    late = post(scheduled_at=ago(10))
    earliest = post(scheduled_at=ago(30))
    middle = post(scheduled_at=ago(20))
    assert claimed_ids(max_items=1) == [earliest.id]
    assert claimed_ids(max_items=10) == [middle.id, late.id]


def test_claim_breaks_scheduled_at_ties_by_arrival(make_queue) -> None:
    make_queue("q")
    when = ago(5)
    first = post(scheduled_at=when, payload=1)
    batch = engine.post_items(
        queue_name="q", items=[engine.NewItem(payload=n, scheduled_at=when) for n in range(2, 6)]
    )
    last = post(scheduled_at=when, payload=6)
    expected = [first.id, *[p.row.id for p in batch], last.id]
    assert expected == sorted(expected)  # ids sort in arrival order
    got = [c.payload for c in claim(max_items=1)] + [c.payload for c in claim(max_items=10)]
    assert got == [1, 2, 3, 4, 5, 6]


def test_claim_moves_file_pending_to_processing_with_attempt_and_lease(
    make_queue, state_root: Path
) -> None:
    make_queue("q", leaseSeconds=30)
    item = post(payload="work")
    before = utcnow()
    claimed = claim(max_items=1)
    assert [c.payload for c in claimed] == ["work"]
    got = row(item.id)
    assert got.status == "processing"
    assert got.attempts == 1
    assert got.lease
    assert got.lease == claimed[0].row.lease
    assert got.lease_expires_at is not None
    assert (
        before + timedelta(seconds=30) <= got.lease_expires_at <= utcnow() + timedelta(seconds=30)
    )
    assert states_on_disk(state_root, "q", item.id) == ["processing"]
    assert file_record(state_root, "q", item.id)["payload"] == "work"


def test_claimed_item_is_not_claimed_again(make_queue) -> None:
    make_queue("q")
    post()
    claim_one()
    assert claim() == []


def test_each_claim_adds_one_attempt_and_a_new_lease(make_queue) -> None:
    make_queue("q")
    item = post()
    leases = []
    for attempt in (1, 2, 3):
        got = claim_one()
        assert got.attempts == attempt
        assert row(item.id).attempts == attempt
        leases.append(got.lease)
        assert engine.sweep(at=after(got.lease_expires_at)).requeued == 1
        assert row(item.id).attempts == attempt  # a re-queue does not count an attempt
    assert len(set(leases)) == 3


def test_claim_respects_max_items(make_queue) -> None:
    make_queue("q")
    for n in range(5):
        post(payload=n)
    assert len(claim(max_items=2)) == 2
    assert len(claim(max_items=10)) == 3


def test_claim_only_takes_from_its_own_queue(make_queue) -> None:
    make_queue("a")
    make_queue("b")
    item = post("b")
    assert claim("a") == []
    assert claimed_ids("b") == [item.id]


# -- rule 3: result -----------------------------------------------------------------------------


def test_result_from_processing_finishes_and_moves_file_to_done(
    make_queue, state_root: Path
) -> None:
    make_queue("q")
    item = post(payload="p")
    claim_one()
    verdict = engine.submit_result(item_id=item.id, result={"ok": True})
    assert (verdict.accepted, verdict.status) == (True, "finished")
    got = row(item.id)
    assert got.status == "finished"
    assert got.finished_at is not None
    assert got.error is None
    assert got.lease is None
    assert states_on_disk(state_root, "q", item.id) == ["done"]
    record = file_record(state_root, "q", item.id)
    assert record["result"] == {"ok": True}
    assert record["payload"] == "p"
    assert record["status"] == "finished"


def test_late_result_after_lease_lapse_is_accepted_from_pending(
    make_queue, state_root: Path
) -> None:
    make_queue("q")
    item = post()
    held = claim_one()
    engine.sweep(at=after(held.lease_expires_at, 1))
    assert row(item.id).status == "pending"
    verdict = engine.submit_result(item_id=item.id, result="late but good")
    assert (verdict.accepted, verdict.status) == (True, "finished")
    assert states_on_disk(state_root, "q", item.id) == ["done"]
    assert file_record(state_root, "q", item.id)["result"] == "late but good"
    assert claim() == []


def test_result_from_lapsed_worker_wins_while_another_worker_holds_the_item(
    make_queue, state_root: Path
) -> None:
    make_queue("q")
    item = post()
    first = claim_one()
    engine.sweep(at=after(first.lease_expires_at, 1))
    second = claim_one()
    assert second.lease != first.lease
    assert row(item.id).status == "processing"
    assert engine.submit_result(item_id=item.id, result="from first").accepted is True
    assert states_on_disk(state_root, "q", item.id) == ["done"]
    # the current holder's verdicts are all refused now
    assert engine.submit_result(item_id=item.id, result="from second").accepted is False
    assert engine.fail(item_id=item.id, lease=second.lease, error="x").accepted is False
    assert engine.extend(item_id=item.id, lease=second.lease)[0] is False
    assert file_record(state_root, "q", item.id)["result"] == "from first"


def test_result_needs_no_lease_and_pending_item_can_be_finished(make_queue) -> None:
    make_queue("q")
    item = post(delay_seconds=600)
    assert engine.submit_result(item_id=item.id, result=1).accepted is True
    assert row(item.id).status == "finished"


@pytest.mark.parametrize("result", [None, 0, "", [], {"deep": [1, {"x": None}]}])
def test_any_json_result_is_stored_as_given(make_queue, state_root: Path, result) -> None:
    make_queue("q")
    item = post()
    claim_one()
    assert engine.submit_result(item_id=item.id, result=result).accepted is True
    assert file_record(state_root, "q", item.id)["result"] == result


def test_second_result_is_refused_and_discarded(make_queue, state_root: Path) -> None:
    make_queue("q")
    item = post()
    claim_one()
    engine.submit_result(item_id=item.id, result="first")
    finished_at = row(item.id).finished_at
    verdict = engine.submit_result(item_id=item.id, result="second")
    assert (verdict.accepted, verdict.status) == (False, "finished")
    assert file_record(state_root, "q", item.id)["result"] == "first"
    assert row(item.id).finished_at == finished_at


def test_result_for_a_failed_item_is_refused(make_queue) -> None:
    make_queue("q")
    item = post()
    held = claim_one()
    engine.fail(item_id=item.id, lease=held.lease, error="bad", retry=False)
    verdict = engine.submit_result(item_id=item.id, result="late")
    assert (verdict.accepted, verdict.status) == (False, "failed")


def test_result_for_unknown_item_is_item_not_found(make_queue) -> None:
    make_queue("q")
    with pytest.raises(ItemNotFound):
        engine.submit_result(item_id="doesnotexist", result=1)


# -- rule 4: fail -------------------------------------------------------------------------------


def test_fail_with_stale_lease_is_refused_and_changes_nothing(make_queue) -> None:
    make_queue("q")
    item = post()
    first = claim_one()
    engine.sweep(at=after(first.lease_expires_at, 1))
    second = claim_one()
    verdict = engine.fail(item_id=item.id, lease=first.lease, error="stale")
    assert verdict.accepted is False
    got = row(item.id)
    assert (got.status, got.lease, got.attempts) == ("processing", second.lease, 2)


@pytest.mark.parametrize("lease", [None, "", "not-the-lease"])
def test_fail_without_the_current_lease_is_refused(make_queue, lease) -> None:
    make_queue("q")
    item = post()
    claim_one()
    assert engine.fail(item_id=item.id, lease=lease, error="x").accepted is False
    assert row(item.id).status == "processing"


def test_fail_of_a_pending_item_is_refused(make_queue) -> None:
    make_queue("q")
    item = post()
    held = claim_one()
    engine.sweep(at=after(held.lease_expires_at))
    assert engine.fail(item_id=item.id, lease=held.lease, error="x").accepted is False
    assert row(item.id).status == "pending"


def test_retryable_fail_requeues_with_first_backoff_and_moves_file(
    make_queue, state_root: Path
) -> None:
    make_queue("q", backoffSeconds=7, backoffMaxSeconds=100)
    item = post()
    held = claim_one()
    before = utcnow()
    verdict = engine.fail(item_id=item.id, lease=held.lease, error="try again")
    after_fail = utcnow()
    assert (verdict.accepted, verdict.status) == (True, "pending")
    got = row(item.id)
    assert got.status == "pending"
    assert got.lease is None
    assert got.lease_expires_at is None
    assert before + timedelta(seconds=7) <= got.scheduled_at <= after_fail + timedelta(seconds=7)
    assert states_on_disk(state_root, "q", item.id) == ["pending"]
    assert claim() == []  # not due until the backoff has passed


@pytest.mark.parametrize(
    ("attempts", "delay"), [(1, 10), (2, 20), (3, 40), (4, 80), (5, 100), (9, 100)]
)
def test_retry_backoff_doubles_per_attempt_up_to_backoff_max(make_queue, attempts, delay) -> None:
    make_queue("q", backoffSeconds=10, backoffMaxSeconds=100)
    item = post()
    for _ in range(attempts - 1):  # lapsed leases add attempts without moving scheduledAt
        engine.sweep(at=after(claim_one().lease_expires_at))
    held = claim_one()
    assert held.attempts == attempts
    before = utcnow()
    engine.fail(item_id=item.id, lease=held.lease, error="again")
    scheduled = row(item.id).scheduled_at
    assert before + timedelta(seconds=delay) <= scheduled <= utcnow() + timedelta(seconds=delay)


def test_zero_backoff_retry_is_claimable_again_at_once(make_queue) -> None:
    make_queue("q", backoffSeconds=0, backoffMaxSeconds=0)
    item = post()
    engine.fail(item_id=item.id, lease=claim_one().lease, error="again")
    assert claim_one().attempts == 2


def test_fail_at_max_attempts_dies_with_the_workers_message(make_queue, state_root: Path) -> None:
    make_queue("q", maxAttempts=2, backoffSeconds=0, backoffMaxSeconds=0)
    item = post(payload="p")
    assert engine.fail(item_id=item.id, lease=claim_one().lease, error="one").status == "pending"
    verdict = engine.fail(item_id=item.id, lease=claim_one().lease, error="disk on fire")
    assert (verdict.accepted, verdict.status) == (True, "failed")
    got = row(item.id)
    assert (got.status, got.error, got.attempts) == ("failed", "disk on fire", 2)
    assert got.finished_at is not None
    assert got.lease is None
    assert states_on_disk(state_root, "q", item.id) == ["done"]
    record = file_record(state_root, "q", item.id)
    assert (record["status"], record["error"], record["payload"]) == ("failed", "disk on fire", "p")
    assert engine.submit_result(item_id=item.id, result="late").accepted is False


def test_fail_with_retry_false_dies_at_once_even_with_attempts_left(
    make_queue, state_root: Path
) -> None:
    make_queue("q", maxAttempts=10)
    item = post()
    verdict = engine.fail(item_id=item.id, lease=claim_one().lease, error="poison", retry=False)
    assert (verdict.accepted, verdict.status) == (True, "failed")
    assert (row(item.id).error, row(item.id).attempts) == ("poison", 1)
    assert states_on_disk(state_root, "q", item.id) == ["done"]


def test_fail_without_message_still_records_an_error(make_queue) -> None:
    make_queue("q")
    item = post()
    engine.fail(item_id=item.id, lease=claim_one().lease, error=None, retry=False)
    assert row(item.id).error


# -- rule 7: death and the dead-letter queue ----------------------------------------------------


def _die(item_id: str, how: str) -> str:
    """Kill a claimed-once item (maxAttempts=1) the given way; return the expected error."""
    held = claim_one()
    if how == "fail":
        engine.fail(item_id=item_id, lease=held.lease, error="worker says no", retry=False)
        return "worker says no"
    if how == "exhausted":
        engine.fail(item_id=item_id, lease=held.lease, error="worker says no again")
        return "worker says no again"
    if how == "lapse":
        engine.sweep(at=after(held.lease_expires_at))
        return engine.LEASE_EXPIRED
    assert how == "disconnect"
    assert held.lease is not None
    engine.requeue_held(item_id=item_id, lease=held.lease)
    return engine.WORKER_DISCONNECTED


@pytest.mark.parametrize("how", ["fail", "exhausted", "lapse", "disconnect"])
def test_death_copies_item_into_dead_letter_queue_with_origin(
    make_queue, state_root: Path, how
) -> None:
    make_queue("dlq")
    make_queue("q", maxAttempts=1, deadLetterQueue="dlq")
    item = post(payload={"job": 42}, key="k1")
    error = _die(item.id, how)
    dead = row(item.id)
    assert (dead.status, dead.error) == ("failed", error)
    copies = list(Item.objects.filter(queue__name="dlq"))
    assert len(copies) == 1
    copy = copies[0]
    assert dead.dead_letter == copy.id
    assert copy.status == "pending"
    assert copy.attempts == 0
    # a server-made key makes the copy once per death, even if a crash repeats the death
    assert copy.key == f"dead-letter:{item.id}:{item.seq}"
    assert copy.origin == {"queue": "q", "id": item.id, "error": error, "attempts": 1}
    assert states_on_disk(state_root, "dlq", copy.id) == ["pending"]
    copy_record = file_record(state_root, "dlq", copy.id)
    assert copy_record["payload"] == {"job": 42}
    assert copy_record["origin"] == copy.origin
    assert file_record(state_root, "q", item.id)["deadLetter"] == copy.id
    assert [c.payload for c in claim("dlq")] == [{"job": 42}]


def test_death_without_dead_letter_queue_copies_nothing(make_queue) -> None:
    make_queue("other")
    make_queue("q", maxAttempts=1)
    item = post()
    _die(item.id, "fail")
    assert row(item.id).dead_letter is None
    assert Item.objects.count() == 1


def test_queue_timeout_is_not_copied_to_dead_letter_queue(make_queue, state_root: Path) -> None:
    make_queue("dlq")
    make_queue("q", queueSeconds=60, deadLetterQueue="dlq")
    pending = post()
    processing = post()
    claim_one()
    engine.sweep(at=after(row(processing.id).posted_at, 61))
    for item in (pending, processing):
        got = row(item.id)
        assert (got.status, got.error, got.dead_letter) == ("failed", "timeout", None)
        assert file_record(state_root, "q", item.id).get("deadLetter") is None
    assert not Item.objects.filter(queue__name="dlq").exists()


def test_retryable_fail_with_attempts_left_is_not_copied(make_queue) -> None:
    make_queue("dlq")
    make_queue("q", maxAttempts=3, deadLetterQueue="dlq")
    item = post()
    engine.fail(item_id=item.id, lease=claim_one().lease, error="retry me")
    assert row(item.id).status == "pending"
    assert not Item.objects.filter(queue__name="dlq").exists()


@pytest.mark.django_db
def test_a_death_repeated_after_a_crash_makes_no_second_dead_letter_copy(make_queue):
    from taskhoster import engine
    from taskhoster.models import Item

    make_queue("dlq")
    make_queue("main", maxAttempts=1, deadLetterQueue="dlq")
    item = engine.post_items(queue_name="main", items=[engine.NewItem(payload=1)])[0].row
    # The first death's copy was written (and indexed by repair) before the crash...
    engine.post_items(
        queue_name="dlq",
        items=[
            engine.NewItem(
                payload=1,
                key=f"dead-letter:{item.id}:{item.seq}",
                origin={"queue": "main", "id": item.id, "error": "lease expired", "attempts": 1},
            )
        ],
    )
    # ...then the item dies again after recovery.
    engine.claim(queue_name="main")
    engine.requeue_held(item_id=item.id, lease=Item.objects.get(id=item.id).lease or "")
    assert Item.objects.filter(queue__name="dlq").count() == 1
    assert Item.objects.get(id=item.id).dead_letter == Item.objects.get(queue__name="dlq").id


@pytest.mark.django_db
def test_a_retried_item_shows_its_last_failure_until_it_finishes(make_queue):
    make_queue("q", backoffSeconds=0)
    item = post(payload="p")
    (claimed,) = engine.claim(queue_name="q")
    engine.fail(item_id=item.id, lease=claimed.row.lease, error="disk full", retry=True)
    assert (row(item.id).status, row(item.id).error) == ("pending", "disk full")
    engine.claim(queue_name="q")
    engine.submit_result(item_id=item.id, result=1)
    assert (row(item.id).status, row(item.id).error) == ("finished", None)
