"""Result (rule 3), fail (rule 4), re-queue (rule 6), death (rule 7) and queue timeout (rule 8).

Who wins a race: each of these locks the item row (its thread first) and re-checks the row's
status under the lock, so of a result, a second result, a timeout and a delete arriving
together exactly one changes the item and the others see the new status. The done file is
written (durably) before the row is committed: a crash between leaves a done file beside an
older row, and ``repair`` keeps the done file because its ``rev`` is higher.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

from .. import metrics
from ..errors import ItemNotFound
from ..faults import crash_point
from ..models import Item, Queue
from ..status import State, Status
from ..store import FileMissing, Staged
from ..timeutil import now as utcnow
from .common import (
    Locked,
    announce_claimable,
    announce_removed,
    announce_verdict,
    attempts_exhausted,
    backoff_delay,
    leave_thread,
    lock_item,
    read_record,
    record_from_row,
    rewrite,
    seconds,
    settle_thread,
    store,
)

LEASE_EXPIRED = "lease expired"
WORKER_DISCONNECTED = "worker disconnected"
TIMEOUT = "timeout"


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    status: str | None
    row: Item | None = None


def _lock_or_404(item_id: str) -> Locked:
    locked = lock_item(item_id)
    if locked is None:
        raise ItemNotFound(f"item {item_id!r} does not exist")
    return locked


def _read_or_forget(locked: Locked) -> tuple[Any, Any]:
    """Read the item's file; if it has vanished (a delete crashed half-way), finish the delete."""
    try:
        return read_record(locked.queue.name, locked.row)
    except FileMissing:
        Item.objects.filter(id=locked.row.id).delete()
        if not Status(locked.row.status).is_terminal:
            leave_thread(locked.thread, locked.queue.name, locked.row.id)
        raise ItemNotFound(f"item {locked.row.id!r} does not exist") from None


def submit_result(*, item_id: str, result: Any) -> Verdict:
    """Rule 3: the first result for a non-terminal item wins, lease or no lease.

    The done file is written and flushed before the row lock is taken; under the lock the
    item is re-checked (same status, same ``rev``) and the file only renamed into place, so
    the write lock is never held across a data flush. If the item changed meanwhile, the
    staged file is dropped and the result tried again against the item's new state.
    """
    st = store()
    for _attempt in range(5):
        seen = Item.objects.select_related("queue").filter(id=item_id).first()
        if seen is None:
            raise ItemNotFound(f"item {item_id!r} does not exist")
        if Status(seen.status).is_terminal:
            return Verdict(False, seen.status, seen)
        queue_name, seen_status, seen_rev = seen.queue.name, seen.status, seen.rev
        try:
            old_state, record = read_record(queue_name, seen)
        except FileMissing:
            break
        done = seen
        _finish_row(done, Status.FINISHED, error=None)
        done.rev += 1
        staged: Staged | None = st.stage(
            queue_name,
            State.DONE,
            record_from_row(done, queue_name, payload=record.get("payload"), result=result),
            durable=True,
        )
        try:
            with transaction.atomic():
                locked = _lock_or_404(item_id)
                row = locked.row
                if Status(row.status).is_terminal:
                    return Verdict(False, row.status, row)
                if row.status != seen_status or row.rev != seen_rev:
                    continue  # changed since we read it: stage again from its new state
                assert staged is not None
                st.install(staged, durable=True)
                staged = None
                st.unlink(queue_name, item_id, [old_state])
                crash_point("result.after_done_file")
                _finish_row(row, Status.FINISHED, error=None, at=done.finished_at)
                row.rev = done.rev
                row.save()
                leave_thread(locked.thread, queue_name, row.id)
                announce_verdict(queue_name, row.id, row.status)
        finally:
            if staged is not None:
                st.discard(staged)
        crash_point("result.after_commit")
        return Verdict(True, row.status, row)
    return _submit_result_locked(item_id, result)


def _submit_result_locked(item_id: str, result: Any) -> Verdict:
    """Everything under the lock: for an item that kept changing under us, or whose file
    is missing."""
    with transaction.atomic():
        locked = _lock_or_404(item_id)
        row = locked.row
        if Status(row.status).is_terminal:
            return Verdict(False, row.status, row)
        old_state, record = _read_or_forget(locked)
        _finish_row(row, Status.FINISHED, error=None)
        rewrite(
            locked.queue.name,
            row,
            old_state,
            payload=record.get("payload"),
            result=result,
            durable=True,
        )
        crash_point("result.after_done_file")
        row.save()
        leave_thread(locked.thread, locked.queue.name, row.id)
        announce_verdict(locked.queue.name, row.id, row.status)
    crash_point("result.after_commit")
    return Verdict(True, row.status, row)


def fail(*, item_id: str, lease: str | None, error: str | None, retry: bool = True) -> Verdict:
    """Rule 4: the lease holder reports a failure; retry with backoff, or die."""
    with transaction.atomic():
        locked = _lock_or_404(item_id)
        row = locked.row
        if row.status != Status.PROCESSING or not lease or row.lease != lease:
            return Verdict(False, row.status, row)
        at = utcnow()
        cause = error or "failed"
        if retry and not attempts_exhausted(locked.queue, row.attempts):
            delay = backoff_delay(locked.queue, row.attempts)
            _requeue(locked, at=at, scheduled_at=at + seconds(delay), error=cause)
        else:
            _die(locked, at=at, error=cause)
        return Verdict(True, row.status, row)


def requeue_held(*, item_id: str, lease: str, cause: str = WORKER_DISCONNECTED) -> Verdict:
    """Rule 6, socket drop: re-queue an item still held under ``lease`` (or let it die)."""
    with transaction.atomic():
        locked = lock_item(item_id)
        if locked is None:
            return Verdict(False, None)
        row = locked.row
        if row.status != Status.PROCESSING or row.lease != lease:
            return Verdict(False, row.status, row)
        at = utcnow()
        if attempts_exhausted(locked.queue, row.attempts):
            _die(locked, at=at, error=cause)
        else:
            _requeue(locked, at=at, scheduled_at=row.scheduled_at, error=cause)
        return Verdict(True, row.status, row)


def release_unsent(*, item_id: str, lease: str) -> Verdict:
    """Undo a claim whose item never reached its worker (the push to a socket that had gone).

    Back to ``pending`` as if it had never been claimed: the claim's attempt is taken back,
    ``scheduledAt`` and ``error`` stay, and it counts toward nothing. The claim only renamed
    the file, so renaming it back restores the record. Not flushed, like a claim: a power
    cut may leave it in ``processing/``, from where ``repair`` and the sweep re-queue it.
    """
    with transaction.atomic():
        locked = lock_item(item_id)
        if locked is None:
            return Verdict(False, None)
        row = locked.row
        if row.status != Status.PROCESSING or row.lease != lease:
            return Verdict(False, row.status, row)
        try:
            store().move(locked.queue.name, row.id, State.PROCESSING, State.PENDING)
        except FileMissing:
            try:
                _read_or_forget(locked)  # finishes a half-done delete
            except ItemNotFound:
                return Verdict(False, None)
        row.status = Status.PENDING
        row.eligible = locked.thread is None
        row.attempts = max(0, row.attempts - 1)
        row.lease = None
        row.lease_expires_at = None
        row.claimed_at = None
        row.updated_at = utcnow()
        row.save()
        if locked.thread is not None:
            if locked.thread.processing_item == row.id:
                locked.thread.processing_item = None
            settle_thread(locked.thread, locked.queue.name)
        else:
            announce_claimable(locked.queue.name)
        return Verdict(True, row.status, row)


def requeue_if_lapsed(*, item_id: str, at: datetime) -> bool:
    """Rule 6, lease lapse (the sweep): re-queue, or die if attempts are used up."""
    with transaction.atomic():
        locked = lock_item(item_id)
        if locked is None:
            return False
        row = locked.row
        if (
            row.status != Status.PROCESSING
            or row.lease_expires_at is None
            or row.lease_expires_at > at
        ):
            return False
        if attempts_exhausted(locked.queue, row.attempts):
            _die(locked, at=at, error=LEASE_EXPIRED)
        else:
            _requeue(locked, at=at, scheduled_at=row.scheduled_at, error=LEASE_EXPIRED)
        return True


def time_out_if_aged(*, item_id: str, at: datetime) -> bool:
    """Rule 8: a live item older than ``queueSeconds`` fails with ``timeout``; no dead-letter."""
    with transaction.atomic():
        locked = lock_item(item_id)
        if locked is None:
            return False
        row = locked.row
        if (
            Status(row.status).is_terminal
            or row.posted_at + seconds(locked.queue.queue_seconds) > at
        ):
            return False
        was_processing = row.status == Status.PROCESSING
        try:
            old_state, record = _read_or_forget(locked)
        except ItemNotFound:
            return False
        _finish_row(row, Status.FAILED, error=TIMEOUT, at=at)
        rewrite(locked.queue.name, row, old_state, payload=record.get("payload"), durable=True)
        row.save()
        leave_thread(locked.thread, locked.queue.name, row.id)
        announce_verdict(locked.queue.name, row.id, row.status)
        if was_processing:
            announce_removed(locked.queue.name, row.id, TIMEOUT)
        transaction.on_commit(lambda: metrics.count(locked.queue.name, "timeouts"))
        return True


def _finish_row(
    row: Item, status: Status, *, error: str | None, at: datetime | None = None
) -> None:
    at = at or utcnow()
    row.status = status
    row.eligible = False
    row.finished_at = at
    row.error = error
    row.lease = None
    row.lease_expires_at = None
    row.updated_at = at


def _requeue(locked: Locked, *, at: datetime, scheduled_at: datetime, error: str) -> None:
    """Back to pending; ``error`` keeps the cause, so a producer can see why it is retried."""
    row = locked.row
    try:
        old_state, record = _read_or_forget(locked)
    except ItemNotFound:
        return
    row.status = Status.PENDING
    row.eligible = locked.thread is None
    row.scheduled_at = scheduled_at
    row.error = error
    row.lease = None
    row.lease_expires_at = None
    row.updated_at = at
    # durable: the old file goes next, so the new one must survive a power cut first (I1)
    rewrite(locked.queue.name, row, old_state, payload=record.get("payload"), durable=True)
    crash_point("requeue.after_pending_file")
    row.save()
    if locked.thread is not None:
        if locked.thread.processing_item == row.id:
            locked.thread.processing_item = None
        settle_thread(locked.thread, locked.queue.name)
    else:
        announce_claimable(locked.queue.name)
    queue_name = locked.queue.name
    transaction.on_commit(lambda: metrics.count(queue_name, "requeues"))


def _die(locked: Locked, *, at: datetime, error: str) -> None:
    """Rule 7: failed, detached from its thread, copied to the dead-letter queue if any."""
    from .posting import NewItem, post_items

    row = locked.row
    try:
        old_state, record = _read_or_forget(locked)
    except ItemNotFound:
        return
    payload = record.get("payload")
    _finish_row(row, Status.FAILED, error=error, at=at)
    dlq_name = locked.queue.dead_letter_queue
    if (
        dlq_name
        and dlq_name != locked.queue.name
        and Queue.objects.filter(name=dlq_name, deleting=False).exists()
    ):
        origin = {
            "queue": locked.queue.name,
            "id": row.id,
            "error": error,
            "attempts": row.attempts,
        }
        # The key makes the copy once per death: a death repeated after a crash (whose
        # first copy was already written) finds that copy instead of making a second.
        key = f"dead-letter:{row.id}:{row.seq}"
        copy = post_items(
            queue_name=dlq_name, items=[NewItem(payload=payload, origin=origin, key=key)]
        )
        row.dead_letter = copy[0].row.id
    rewrite(locked.queue.name, row, old_state, payload=payload, durable=True)
    row.save()
    leave_thread(locked.thread, locked.queue.name, row.id)
    announce_verdict(locked.queue.name, row.id, row.status)
