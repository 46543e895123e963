"""Post (rule 1, with idempotency keys) and restart (rule 10).

A post writes the item files durably first and inserts the index rows after: a crash between
leaves a file without a row, which ``repair`` indexes; never a row without its file. The post
answers only after both.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction

from .. import metrics
from ..errors import Conflict, InvalidInput, ItemNotFound, QueueNotFound
from ..faults import crash_point
from ..ids import new_id, new_ids
from ..models import Item, Queue
from ..status import State, Status
from ..timeutil import now as utcnow
from .common import (
    announce_claimable,
    lock_item,
    lock_threads,
    read_record,
    record_from_row,
    rewrite,
    seconds,
    settle_thread,
    store,
)


@dataclass(frozen=True)
class NewItem:
    """What a producer asks to post, already validated for shape."""

    payload: Any
    thread_id: str | None = None
    scheduled_at: datetime | None = None
    delay_seconds: float | None = None
    key: str | None = None
    origin: dict[str, Any] | None = None


@dataclass(frozen=True)
class Posted:
    row: Item
    payload: Any
    created: bool


def get_live_queue(name: str) -> Queue:
    queue = Queue.objects.filter(name=name, deleting=False).first()
    if queue is None:
        raise QueueNotFound(f"queue {name!r} does not exist")
    return queue


def post_items(*, queue_name: str, items: list[NewItem]) -> list[Posted]:
    """Post items to a queue, all or none; an item whose key exists returns the existing one."""
    queue = get_live_queue(queue_name)
    for _attempt in range(3):
        try:
            return _post_once(queue, items)
        except IntegrityError:
            # A concurrent post took one of our keys first: the next round finds it.
            continue
    raise Conflict("could not post: keys kept colliding with concurrent posts")


def _post_once(queue: Queue, items: list[NewItem]) -> list[Posted]:
    at = utcnow()
    keys = [i.key for i in items if i.key is not None]
    existing: dict[str, Item] = {}
    if keys:
        existing = {
            row.key: row
            for row in Item.objects.filter(queue=queue, key__in=keys)
            if row.key is not None
        }
    fresh = [i for i in items if i.key is None or i.key not in existing]
    # Two members of one batch with the same key are one item.
    seen: set[str] = set()
    unique_fresh: list[NewItem] = []
    for spec in fresh:
        if spec.key is not None:
            if spec.key in seen:
                continue
            seen.add(spec.key)
        unique_fresh.append(spec)
    ids = new_ids(len(unique_fresh))
    rows: list[Item] = []
    payloads: dict[str, Any] = {}
    by_key: dict[str, Item] = {}
    horizon = at + seconds(queue.queue_seconds)
    for item_id, spec in zip(ids, unique_fresh, strict=True):
        scheduled = spec.scheduled_at or at
        if spec.delay_seconds is not None:
            scheduled = at + seconds(spec.delay_seconds)
        if scheduled > horizon:
            raise InvalidInput(
                "scheduledAt is beyond the queue timeout: the item would time out before it "
                "could be claimed",
                code="scheduled_beyond_timeout",
            )
        row = Item(
            id=item_id,
            queue=queue,
            status=Status.PENDING,
            eligible=spec.thread_id is None,
            thread_id=spec.thread_id,
            key=spec.key,
            seq=item_id,
            scheduled_at=scheduled,
            posted_at=at,
            attempts=0,
            origin=spec.origin,
            rev=1,
            updated_at=at,
        )
        rows.append(row)
        payloads[item_id] = spec.payload
        if spec.key is not None:
            by_key[spec.key] = row
    records = [record_from_row(r, queue.name, payload=payloads[r.id]) for r in rows]
    st = store()
    st.write(queue.name, State.PENDING, records, durable=True)
    crash_point("post.after_files")
    try:
        with transaction.atomic():
            Item.objects.bulk_create(rows)
            threaded = [r.thread_id for r in rows if r.thread_id is not None]
            if threaded:
                threads = lock_threads(queue, threaded)
                for thread_id, thread in threads.items():
                    settle_thread(
                        thread, queue.name, members_delta=sum(1 for t in threaded if t == thread_id)
                    )
            if len(threaded) < len(rows):
                announce_claimable(queue.name)
    except BaseException:
        for row in rows:
            st.unlink(queue.name, row.id, [State.PENDING])
        raise
    crash_point("post.after_index")
    if rows:
        metrics.count(queue.name, "posts", len(rows))
    created_for = {id(spec): row for spec, row in zip(unique_fresh, rows, strict=True)}
    answer: list[Posted] = []
    for spec in items:
        if spec.key is not None and spec.key in existing:
            row = existing[spec.key]
            answer.append(Posted(row=row, payload=_payload_of(queue.name, row), created=False))
        else:
            row = created_for.get(id(spec)) or by_key[spec.key or ""]
            answer.append(Posted(row=row, payload=payloads[row.id], created=True))
    return answer


def _payload_of(queue_name: str, row: Item) -> Any:
    try:
        return read_record(queue_name, row)[1].get("payload")
    except Exception:
        return None


def restart(*, item_id: str) -> Item:
    """Rule 10: a failed item becomes a brand-new arrival in its queue (and thread)."""
    with transaction.atomic():
        peek = (
            Item.objects.filter(id=item_id).values_list("queue_id", "thread_id", "status").first()
        )
        if peek is None:
            raise ItemNotFound(f"item {item_id!r} does not exist")
        queue_id, thread_id, status = peek
        if status != Status.FAILED:
            raise Conflict(
                f"only a failed item can be restarted; this one is {status}", code="not_failed"
            )
        queue = Queue.objects.get(id=queue_id)
        threads = lock_threads(queue, [thread_id]) if thread_id is not None else {}
        locked = lock_item(item_id)
        if locked is None:
            raise ItemNotFound(f"item {item_id!r} does not exist")
        row = locked.row
        if row.status != Status.FAILED:
            raise Conflict(
                f"only a failed item can be restarted; this one is {row.status}", code="not_failed"
            )
        old_state, record = read_record(queue.name, row)
        at = utcnow()
        row.status = Status.PENDING
        row.eligible = thread_id is None
        row.attempts = 0
        row.posted_at = at
        row.scheduled_at = at
        row.seq = new_id()
        row.finished_at = None
        row.fetched_at = None
        row.error = None
        row.dead_letter = None
        row.lease = None
        row.lease_expires_at = None
        row.claimed_at = None
        row.updated_at = at
        rewrite(queue.name, row, old_state, payload=record.get("payload"), durable=True)
        row.save()
        if thread_id is not None:
            settle_thread(threads[thread_id], queue.name, members_delta=1)
        else:
            announce_claimable(queue.name)
        return row
