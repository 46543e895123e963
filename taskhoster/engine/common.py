"""What every transition shares: the store, records, locking order, threads and news.

Locking order, everywhere: the thread row first, then the item row. A claim, which finds its
item before its thread, takes the thread with SKIP LOCKED and passes over a busy thread, so
it never waits in the wrong order. On SQLite every write transaction is IMMEDIATE, which
serialises writers; ``select_for_update`` is then a no-op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from django.db import transaction

from .. import events, metrics
from ..conf import get_conf
from ..models import Item, Queue, Thread
from ..status import State, Status
from ..store import Record, StateStore
from ..timeutil import to_wire


@lru_cache(maxsize=8)
def _store_for(root: Path, fsync: bool) -> StateStore:
    return StateStore(root, fsync=fsync)


def store() -> StateStore:
    conf = get_conf()
    return _store_for(conf.root.resolve(), conf.fsync)


def seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


def backoff_delay(queue: Queue, attempts: int) -> float:
    exponent = max(0, attempts - 1)
    if exponent > 60:
        return float(queue.backoff_max_seconds)
    return float(min(queue.backoff_max_seconds, queue.backoff_seconds * math.pow(2, exponent)))


def attempts_exhausted(queue: Queue, attempts: int) -> bool:
    return queue.max_attempts is not None and attempts >= queue.max_attempts


# -- records: the file is everything needed to rebuild the item ---------------------------


def record_from_row(row: Item, queue_name: str, *, payload: Any, result: Any = None) -> Record:
    return {
        "id": row.id,
        "queue": queue_name,
        "status": row.status,
        "payload": payload,
        "threadId": row.thread_id,
        "key": row.key,
        "seq": row.seq,
        "scheduledAt": to_wire(row.scheduled_at),
        "postedAt": to_wire(row.posted_at),
        "attempts": row.attempts,
        "finishedAt": to_wire(row.finished_at),
        "fetchedAt": to_wire(row.fetched_at),
        "result": result,
        "error": row.error,
        "origin": row.origin,
        "deadLetter": row.dead_letter,
        "rev": row.rev,
    }


def read_record(queue_name: str, row: Item) -> tuple[State, Record]:
    """Read the row's file, looking first where the row says it is."""
    return store().read_any(queue_name, row.id, Status(row.status).state)


def rewrite(
    queue_name: str, row: Item, old_state: State, *, payload: Any, result: Any = None, durable: bool
) -> None:
    """Write the row's new record into its state's directory, then remove the old file.

    The new file is written before the old one goes: a crash between leaves two files, and
    ``repair`` keeps the one with the higher ``rev``.
    """
    row.rev += 1
    new_state = Status(row.status).state
    store().write(
        queue_name,
        new_state,
        [record_from_row(row, queue_name, payload=payload, result=result)],
        durable=durable,
    )
    if old_state is not new_state:
        store().unlink(queue_name, row.id, [old_state])


# -- locking ------------------------------------------------------------------------------


@dataclass
class Locked:
    row: Item
    queue: Queue
    thread: Thread | None


def lock_item(item_id: str) -> Locked | None:
    """Lock an item (its thread first) inside the caller's transaction; None if it is gone."""
    peek = Item.objects.filter(id=item_id).values_list("queue_id", "thread_id").first()
    if peek is None:
        return None
    queue_id, thread_id = peek
    thread = None
    if thread_id is not None:
        thread = (
            Thread.objects.select_for_update()
            .filter(queue_id=queue_id, thread_id=thread_id)
            .first()
        )
    # of=("self",): lock the item's row only. On PostgreSQL a plain FOR UPDATE over the join
    # would also lock the queue's row and make every change in a queue wait for the last.
    row = (
        Item.objects.select_for_update(of=("self",))
        .select_related("queue")
        .filter(id=item_id)
        .first()
    )
    if row is None:
        return None
    return Locked(row=row, queue=row.queue, thread=thread)


# -- threads ------------------------------------------------------------------------------


def lock_threads(queue: Queue, thread_ids: list[str]) -> dict[str, Thread]:
    """Create missing thread rows and lock all of them, in a fixed order.

    A row that its last member's verdict deleted while we waited for its lock is created
    again (the second round cannot lose it: no one else sees our uncommitted insert).
    """
    wanted = sorted(set(thread_ids))
    locked: dict[str, Thread] = {}
    while len(locked) < len(wanted):
        missing = [t for t in wanted if t not in locked]
        Thread.objects.bulk_create(
            [Thread(queue=queue, thread_id=t) for t in missing], ignore_conflicts=True
        )
        rows = Thread.objects.select_for_update().filter(queue=queue, thread_id__in=missing)
        locked.update({t.thread_id: t for t in rows.order_by("thread_id")})
    return {t: locked[t] for t in wanted}


def first_pending_member(queue_id: int, thread_id: str) -> str | None:
    return (
        Item.objects.filter(queue_id=queue_id, thread_id=thread_id, status=Status.PENDING)
        .order_by("scheduled_at", "seq")
        .values_list("id", flat=True)
        .first()
    )


def settle_thread(thread: Thread, queue_name: str, *, members_delta: int = 0) -> None:
    """Bring a locked thread back to its rule after a change to its members.

    At most one member is eligible: the head (earliest ``scheduled_at``, then arrival), and
    only while no member is processing. A thread with no live member is deleted.
    """
    thread.member_count = max(0, thread.member_count + members_delta)
    if thread.member_count == 0:
        if thread.head_item:
            Item.objects.filter(id=thread.head_item).update(eligible=False)
        thread.delete()
        return
    head = None
    if thread.processing_item is None:
        head = first_pending_member(thread.queue_id, thread.thread_id)
    if thread.head_item and thread.head_item != head:
        Item.objects.filter(id=thread.head_item).update(eligible=False)
    if head is not None:
        Item.objects.filter(id=head, status=Status.PENDING).update(eligible=True)
    thread.head_item = head
    thread.save(update_fields=["member_count", "processing_item", "head_item"])
    if head is not None:
        announce_claimable(queue_name)


def leave_thread(thread: Thread | None, queue_name: str, item_id: str) -> None:
    """A member leaves for good (verdict, delete, timeout): free the thread and advance it."""
    if thread is None:
        return
    if thread.processing_item == item_id:
        thread.processing_item = None
    if thread.head_item == item_id:
        thread.head_item = None
    settle_thread(thread, queue_name, members_delta=-1)


# -- news after commit --------------------------------------------------------------------


def announce_claimable(queue_name: str) -> None:
    transaction.on_commit(lambda: events.announce("claimable", queue_name))


def announce_verdict(queue_name: str, item_id: str, status: str) -> None:
    metric = "results" if status == Status.FINISHED else "failures"

    def after_commit() -> None:
        events.announce("verdict", queue_name, item_id)
        metrics.count(queue_name, metric)

    transaction.on_commit(after_commit)


def announce_removed(queue_name: str, item_id: str, reason: str) -> None:
    transaction.on_commit(lambda: events.announce("removed:" + reason, queue_name, item_id))


def lease_deadline(queue: Queue, at: datetime, seconds_: float | None = None) -> datetime:
    return at + seconds(seconds_ if seconds_ is not None else queue.lease_seconds)
