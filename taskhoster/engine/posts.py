"""A post's new items, made in the caller's thread before its group (rule 1): ids, times,
rows and the first line of each file, so the group only writes them."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from ..ids import new_ids
from ..status import Status
from ..store import Record, encode_line
from ..timeutil import now as utcnow
from ..timeutil import to_wire
from .ops import NewItem, Post
from .rules import ItemRow


def record_of(row: ItemRow, queue_name: str, payload: Any) -> Record:
    """The first line of a new item's file: everything needed to rebuild it."""
    return {
        "id": row.id,
        "queue": queue_name,
        "status": row.status.value,
        "payload": payload,
        "threadId": row.thread_id,
        "priority": row.priority,
        "key": row.key,
        "seq": row.seq,
        "scheduledAt": to_wire(row.scheduled_at),
        "postedAt": to_wire(row.posted_at),
        "attempts": row.attempts,
        "finishedAt": None,
        "fetchedAt": None,
        "result": None,
        "error": None,
        "origin": row.origin,
        "deadLetter": None,
        "rev": row.rev,
    }


def new_row(
    item_id: str,
    *,
    at: datetime,
    scheduled_at: datetime,
    thread_id: str | None,
    key: str | None,
    origin: Any,
    priority: int = 0,
) -> ItemRow:
    return ItemRow(
        id=item_id,
        queue_id=0,
        status=Status.PENDING,
        eligible=False,
        thread_id=thread_id,
        key=key,
        seq=item_id,
        scheduled_at=scheduled_at,
        posted_at=at,
        attempts=0,
        lease=None,
        lease_expires_at=None,
        claimed_at=None,
        finished_at=None,
        fetched_at=None,
        error=None,
        origin=origin,
        dead_letter=None,
        rev=1,
        updated_at=at,
        priority=priority,
    )


def prepare_post(queue_name: str, items: list[NewItem], key_hash: str | None = None) -> Post:
    """Build a post in the caller's thread: ids, times, rows and each file's first line
    (``key_hash``: see ``ops.Post``)."""
    at = utcnow()
    ids = new_ids(len(items))
    rows: list[ItemRow] = []
    lines: list[bytes] = []
    for item_id, item in zip(ids, items, strict=True):
        scheduled = item.scheduled_at or at
        if item.delay_seconds is not None:
            scheduled = at + timedelta(seconds=item.delay_seconds)
        row = new_row(
            item_id,
            at=at,
            scheduled_at=scheduled,
            thread_id=item.thread_id,
            key=item.key,
            origin=item.origin,
            priority=item.priority,
        )
        rows.append(row)
        lines.append(encode_line(record_of(row, queue_name, item.payload)))
    return Post(queue_name=queue_name, items=items, rows=rows, lines=lines, key_hash=key_hash)
