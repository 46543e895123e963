"""The clocks: lease lapse and socket drop (rule 6), queue timeout (rule 8), retention
(rule 11) and the sweep (rule 12), including sweeps and verdicts that race.

Time moves by passing ``at=`` to the sweep and its per-item steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import connection

from taskhoster import engine
from taskhoster.models import Item

from .lifecycle_helpers import (
    after,
    claim,
    claim_one,
    claimed_ids,
    exists,
    file_record,
    lease_expiry,
    post,
    row,
    states_on_disk,
)

# -- rule 6: lease lapse (sweep) ------------------------------------------------------------------


@pytest.mark.django_db
def test_lapsed_lease_is_requeued_with_scheduled_at_unchanged(make_queue, state_root: Path) -> None:
    make_queue("q", leaseSeconds=10)
    item = post(payload="p")
    scheduled = row(item.id).scheduled_at
    held = claim_one()
    report = engine.sweep(at=after(held.lease_expires_at, 1))
    assert report.requeued == 1
    got = row(item.id)
    assert (got.status, got.attempts, got.lease, got.lease_expires_at) == ("pending", 1, None, None)
    assert got.scheduled_at == scheduled
    assert states_on_disk(state_root, "q", item.id) == ["pending"]
    assert file_record(state_root, "q", item.id)["payload"] == "p"
    assert claimed_ids() == [item.id]


@pytest.mark.django_db
def test_lease_is_not_lapsed_before_lease_expires_at(make_queue) -> None:
    make_queue("q", leaseSeconds=10)
    item = post()
    held = claim_one()
    assert engine.sweep(at=after(held.lease_expires_at, -0.001)).requeued == 0
    assert engine.requeue_if_lapsed(item_id=item.id, at=after(held.lease_expires_at, -1)) is False
    assert row(item.id).status == "processing"
    assert engine.sweep(at=held.lease_expires_at).requeued == 1


@pytest.mark.django_db
def test_lapsed_lease_at_max_attempts_dies_with_lease_expired(make_queue, state_root: Path) -> None:
    make_queue("q", maxAttempts=2)
    item = post()
    engine.sweep(at=after(claim_one().lease_expires_at))
    assert row(item.id).status == "pending"
    held = claim_one()
    at = after(held.lease_expires_at, 1)
    engine.sweep(at=at)
    got = row(item.id)
    assert (got.status, got.error, got.attempts) == ("failed", "lease expired", 2)
    assert got.finished_at == at
    assert states_on_disk(state_root, "q", item.id) == ["done"]
    assert claim() == []


@pytest.mark.django_db
def test_lapsed_item_requeued_keeps_its_place_before_later_arrivals(make_queue) -> None:
    make_queue("q")
    first = post()
    held = claim_one()
    second = post()
    engine.sweep(at=after(held.lease_expires_at))
    assert claimed_ids(max_items=1) == [first.id]
    assert claimed_ids(max_items=1) == [second.id]


# -- rule 6: socket drop ----------------------------------------------------------------------


@pytest.mark.django_db
def test_requeue_held_puts_item_back_at_once_with_scheduled_at_unchanged(
    make_queue, state_root: Path
) -> None:
    make_queue("q")
    item = post()
    scheduled = row(item.id).scheduled_at
    held = claim_one()
    assert held.lease is not None
    verdict = engine.requeue_held(item_id=item.id, lease=held.lease)
    assert (verdict.accepted, verdict.status) == (True, "pending")
    got = row(item.id)
    assert (got.status, got.scheduled_at, got.lease) == ("pending", scheduled, None)
    assert states_on_disk(state_root, "q", item.id) == ["pending"]
    assert claim_one().attempts == 2


@pytest.mark.django_db
def test_requeue_held_at_max_attempts_dies_with_worker_disconnected(
    make_queue, state_root: Path
) -> None:
    make_queue("q", maxAttempts=1)
    item = post()
    held = claim_one()
    assert held.lease is not None
    verdict = engine.requeue_held(item_id=item.id, lease=held.lease)
    assert (verdict.accepted, verdict.status) == (True, "failed")
    assert (row(item.id).status, row(item.id).error) == ("failed", "worker disconnected")
    assert states_on_disk(state_root, "q", item.id) == ["done"]


@pytest.mark.django_db
def test_requeue_held_with_a_stale_lease_changes_nothing(make_queue) -> None:
    make_queue("q")
    item = post()
    first = claim_one()
    engine.sweep(at=after(first.lease_expires_at))
    second = claim_one()
    assert first.lease is not None
    assert engine.requeue_held(item_id=item.id, lease=first.lease).accepted is False
    got = row(item.id)
    assert (got.status, got.lease) == ("processing", second.lease)


@pytest.mark.django_db
def test_requeue_held_of_finished_or_deleted_item_is_refused(make_queue) -> None:
    make_queue("q")
    done = post()
    held = claim_one()
    assert held.lease is not None
    engine.submit_result(item_id=done.id, result=1)
    assert engine.requeue_held(item_id=done.id, lease=held.lease).accepted is False
    assert row(done.id).status == "finished"
    gone = post()
    held = claim_one()
    assert held.lease is not None
    engine.delete_item(item_id=gone.id)
    assert engine.requeue_held(item_id=gone.id, lease=held.lease).accepted is False
    assert not exists(gone.id)


# -- rule 8: queue timeout ----------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["pending", "processing"])
def test_queue_timeout_fails_item_with_timeout(make_queue, state_root: Path, state) -> None:
    make_queue("q", queueSeconds=100)
    item = post(payload="p")
    if state == "processing":
        claim_one()
    posted = row(item.id).posted_at
    assert engine.time_out_if_aged(item_id=item.id, at=after(posted, 99)) is False
    assert row(item.id).status == state
    at = after(posted, 100)
    assert engine.time_out_if_aged(item_id=item.id, at=at) is True
    got = row(item.id)
    assert (got.status, got.error, got.finished_at, got.lease) == ("failed", "timeout", at, None)
    assert states_on_disk(state_root, "q", item.id) == ["done"]
    assert file_record(state_root, "q", item.id)["error"] == "timeout"
    assert file_record(state_root, "q", item.id)["payload"] == "p"
    verdict = engine.submit_result(item_id=item.id, result="too late")
    assert (verdict.accepted, verdict.status) == (False, "failed")
    assert file_record(state_root, "q", item.id)["result"] is None


@pytest.mark.django_db
def test_sweep_times_out_aged_items_and_keeps_young_ones(make_queue) -> None:
    make_queue("q", queueSeconds=100)
    old = post()
    held_old = claim_one()
    young = post()
    at = after(row(old.id).posted_at, 100)
    young_limit = after(row(young.id).posted_at, 100)
    assert young_limit > at
    report = engine.sweep(at=at)
    assert report.timed_out == 1
    assert row(old.id).status == "failed"
    assert row(young.id).status == "pending"
    assert engine.fail(item_id=old.id, lease=held_old.lease, error="x").accepted is False


@pytest.mark.django_db
def test_queue_timeout_counts_from_posted_at_not_scheduled_at(make_queue) -> None:
    make_queue("q", queueSeconds=100)
    item = post(delay_seconds=90)
    engine.sweep(at=after(row(item.id).posted_at, 100))
    assert row(item.id).error == "timeout"


@pytest.mark.django_db
def test_queue_timeout_of_a_finished_item_does_nothing(make_queue) -> None:
    make_queue("q", queueSeconds=100)
    item = post()
    claim_one()
    engine.submit_result(item_id=item.id, result="ok")
    assert engine.time_out_if_aged(item_id=item.id, at=after(row(item.id).posted_at, 1000)) is False
    assert (row(item.id).status, row(item.id).error) == ("finished", None)


# -- rule 11: retention -------------------------------------------------------------------------


def _finish(item_id: str, how: str) -> None:
    held = claim_one()
    if how == "finished":
        engine.submit_result(item_id=item_id, result="r")
    else:
        engine.fail(item_id=item_id, lease=held.lease, error="e", retry=False)


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["finished", "failed"])
def test_retain_from_finished_deletes_done_item_retain_seconds_after_finishing(
    make_queue, state_root: Path, how
) -> None:
    make_queue("q", retainSeconds=100)
    item = post()
    _finish(item.id, how)
    finished = row(item.id).finished_at
    assert engine.sweep(at=after(finished, 99.9)).retained == 0
    assert exists(item.id)
    assert states_on_disk(state_root, "q", item.id) == ["done"]
    assert engine.sweep(at=after(finished, 100)).retained == 1
    assert not exists(item.id)
    assert states_on_disk(state_root, "q", item.id) == []


@pytest.mark.django_db
def test_retention_never_deletes_live_items(make_queue, state_root: Path) -> None:
    make_queue("q", retainSeconds=0, queueSeconds=10**6)
    pending = post()
    processing = post()
    claim_one()
    report = engine.sweep(at=after(row(pending.id).posted_at, 10))
    assert report.retained == 0
    assert report.timed_out == 0
    assert exists(pending.id)
    assert exists(processing.id)


@pytest.mark.django_db
def test_retain_from_fetched_keeps_unread_done_item_forever(make_queue, state_root: Path) -> None:
    make_queue("q", retainSeconds=10, retainFrom="fetched")
    item = post()
    _finish(item.id, "finished")
    assert engine.sweep(at=after(row(item.id).finished_at, 10**7)).retained == 0
    assert exists(item.id)
    assert states_on_disk(state_root, "q", item.id) == ["done"]


@pytest.mark.django_db
def test_retain_from_fetched_clock_starts_at_first_producer_read(
    make_queue, state_root: Path
) -> None:
    make_queue("q", retainSeconds=100, retainFrom="fetched")
    item = post()
    _finish(item.id, "finished")
    got, record = engine.get_item(item_id=item.id, producer_read=True)
    assert record["result"] == "r"
    fetched = row(item.id).fetched_at
    assert fetched is not None
    assert got.fetched_at == fetched
    engine.get_item(item_id=item.id, producer_read=True)  # a second read does not restart it
    assert row(item.id).fetched_at == fetched
    assert engine.sweep(at=after(fetched, 99.9)).retained == 0
    assert exists(item.id)
    assert engine.sweep(at=after(fetched, 100)).retained == 1
    assert not exists(item.id)
    assert states_on_disk(state_root, "q", item.id) == []


@pytest.mark.django_db
def test_retain_from_fetched_non_producer_read_does_not_start_clock(make_queue) -> None:
    make_queue("q", retainSeconds=10, retainFrom="fetched")
    item = post()
    _finish(item.id, "failed")
    engine.get_item(item_id=item.id)
    engine.get_item(item_id=item.id, producer_read=False)
    assert row(item.id).fetched_at is None
    assert engine.sweep(at=after(row(item.id).finished_at, 10**7)).retained == 0
    assert exists(item.id)


@pytest.mark.django_db
def test_retain_from_fetched_producer_read_of_live_item_does_not_start_clock(make_queue) -> None:
    make_queue("q", retainSeconds=10, retainFrom="fetched")
    item = post()
    engine.get_item(item_id=item.id, producer_read=True)
    claim_one()
    engine.get_item(item_id=item.id, producer_read=True)
    engine.submit_result(item_id=item.id, result=1)
    assert row(item.id).fetched_at is None
    assert engine.sweep(at=after(row(item.id).finished_at, 10**7)).retained == 0
    assert exists(item.id)


# -- rule 12: sweeps that race -------------------------------------------------------------------


@pytest.mark.django_db
def test_second_sweep_back_to_back_finds_nothing_to_do(make_queue) -> None:
    make_queue("q", queueSeconds=1000, retainSeconds=500)
    lapsing = post()
    held = claim_one()
    aging = post(delay_seconds=5)
    finished = post(payload="f")
    engine.submit_result(item_id=finished.id, result=1)
    at_lapse = after(held.lease_expires_at)
    first = engine.sweep(at=at_lapse)
    second = engine.sweep(at=at_lapse)
    assert (first.requeued, second.requeued) == (1, 0)
    assert row(lapsing.id).attempts == 1
    assert row(lapsing.id).status == "pending"
    at_age = after(row(aging.id).posted_at, 1000)
    first = engine.sweep(at=at_age)
    second = engine.sweep(at=at_age)
    assert (first.timed_out, second.timed_out) == (2, 0)  # lapsing and aging
    assert (first.retained, second.retained) == (1, 0)  # finished
    assert not exists(finished.id)


@pytest.mark.django_db
def test_result_then_lapse_check_leaves_the_result_standing(make_queue, state_root: Path) -> None:
    make_queue("q", maxAttempts=1)
    item = post()
    held = claim_one()
    at = after(held.lease_expires_at, 1)
    lapsed_ids = list(Item.objects.filter(status="processing").values_list("id", flat=True))
    assert engine.submit_result(item_id=item.id, result="won").accepted is True
    # the sweep had already listed the item; its per-item step re-checks and loses cleanly
    assert lapsed_ids == [item.id]
    assert engine.requeue_if_lapsed(item_id=item.id, at=at) is False
    got = row(item.id)
    assert (got.status, got.error) == ("finished", None)
    assert file_record(state_root, "q", item.id)["result"] == "won"


@pytest.mark.django_db
def test_lapse_then_result_is_one_verdict(make_queue, state_root: Path) -> None:
    make_queue("q")
    item = post()
    held = claim_one()
    at = after(held.lease_expires_at, 1)
    assert engine.requeue_if_lapsed(item_id=item.id, at=at) is True
    assert engine.requeue_if_lapsed(item_id=item.id, at=at) is False
    assert engine.submit_result(item_id=item.id, result="late").accepted is True
    assert engine.submit_result(item_id=item.id, result="later").accepted is False
    assert engine.sweep(at=at).requeued == 0
    assert row(item.id).status == "finished"
    assert file_record(state_root, "q", item.id)["result"] == "late"


@pytest.mark.django_db
def test_timeout_then_result_and_result_then_timeout_are_one_verdict(make_queue) -> None:
    make_queue("q", queueSeconds=50)
    a, b = post(), post()
    claim(max_items=2)
    at = after(row(b.id).posted_at, 50)
    assert engine.time_out_if_aged(item_id=a.id, at=at) is True
    assert engine.time_out_if_aged(item_id=a.id, at=at) is False
    assert engine.submit_result(item_id=a.id, result=1).accepted is False
    assert engine.submit_result(item_id=b.id, result=1).accepted is True
    assert engine.time_out_if_aged(item_id=b.id, at=at) is False
    assert (row(a.id).status, row(b.id).status) == ("failed", "finished")


@pytest.mark.django_db
def test_steps_on_a_deleted_item_do_nothing(make_queue) -> None:
    make_queue("q", queueSeconds=50)
    item = post()
    held = claim_one()
    engine.delete_item(item_id=item.id)
    at = after(held.lease_expires_at, 100)
    assert engine.requeue_if_lapsed(item_id=item.id, at=at) is False
    assert engine.time_out_if_aged(item_id=item.id, at=at) is False
    assert engine.sweep(at=at).requeued == 0


def _run_together(calls: list[Callable[[], object]]) -> list[BaseException]:
    barrier = threading.Barrier(len(calls))
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            barrier.wait()
            call()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.django_db(transaction=True)
def test_concurrent_sweeps_and_results_give_each_item_exactly_one_verdict(
    make_queue, state_root: Path
) -> None:
    make_queue("q", maxAttempts=1, leaseSeconds=30)
    items = [post(payload=n).id for n in range(12)]
    held = claim(max_items=12)
    assert len(held) == 12
    at = after(max(lease_expiry(c.row) for c in held), 1)
    accepted: list[str] = []

    def results() -> None:
        for item_id in items:
            if engine.submit_result(item_id=item_id, result="r").accepted:
                accepted.append(item_id)

    errors = _run_together([lambda: engine.sweep(at=at), lambda: engine.sweep(at=at), results])
    assert errors == []
    for item_id in items:
        got = row(item_id)
        assert got.status in ("finished", "failed")
        assert (got.status == "finished") == (item_id in accepted)
        if got.status == "failed":
            assert got.error == "lease expired"
        assert states_on_disk(state_root, "q", item_id) == ["done"]
    assert len(accepted) == len(set(accepted))


@pytest.mark.django_db
def test_sweep_walks_every_item_in_small_chunks_even_with_tied_clocks(make_queue, settings) -> None:
    settings.TASKHOSTER = {**settings.TASKHOSTER, "SWEEP_CHUNK": 2}
    make_queue("q", queueSeconds=1000, retainSeconds=10)
    batch = engine.post_items(queue_name="q", items=[engine.NewItem(payload=n) for n in range(7)])
    held = claim(max_items=7)  # one claim: all seven share one leaseExpiresAt
    assert len({c.row.lease_expires_at for c in held}) == 1
    assert engine.sweep(at=after(held[0].row.lease_expires_at)).requeued == 7
    posted = row(batch[0].row.id).posted_at  # one batch: all seven share one postedAt
    assert engine.sweep(at=after(posted, 1000)).timed_out == 7
    finished = row(batch[0].row.id).finished_at
    assert engine.sweep(at=after(finished, 10)).retained == 7
    assert Item.objects.count() == 0
