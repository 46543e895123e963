"""Claim (rule 2) and extend (rule 5).

A claim finds the earliest due eligible item through the partial index ``item_claimable``
(``queue, scheduled_at, seq WHERE eligible``): blocked thread members are never eligible, so
they are never scanned, and the cost stays O(log n) in the number of waiting items.

Who wins a race: on PostgreSQL, ``SELECT ... FOR UPDATE SKIP LOCKED`` hands each candidate
row to one transaction; on SQLite the IMMEDIATE write transaction serialises claimers. Inside
it the file is renamed from pending/ to processing/ (atomic); only then is the transaction
committed. A crash between the rename and the commit leaves the row pending and the file in
processing/: the next claim of that row finds the file already moved and goes on, and
``repair`` makes the row match the file.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F

from .. import metrics
from ..errors import ItemNotFound
from ..faults import crash_point
from ..models import Item, Thread
from ..status import State, Status
from ..store import FileMissing
from ..timeutil import now as utcnow
from .common import lease_deadline, leave_thread, store
from .posting import get_live_queue

MAX_ROUNDS = 4


@dataclass(frozen=True)
class Claimed:
    row: Item
    payload: Any


def claim(*, queue_name: str, max_items: int = 1) -> list[Claimed]:
    """Move up to ``max_items`` claimable items of the queue to processing under new leases."""
    queue = get_live_queue(queue_name)
    metrics.count(queue.name, "claim_attempts")
    st = store()
    at = utcnow()
    expires = lease_deadline(queue, at)
    taken: list[Item] = []
    with transaction.atomic():
        for _round in range(MAX_ROUNDS):
            want = max_items - len(taken)
            if want <= 0:
                break
            candidates = list(
                Item.objects.select_for_update(skip_locked=True)
                .filter(queue=queue, eligible=True, scheduled_at__lte=at)
                .order_by("scheduled_at", "seq")[:want]
            )
            for row in candidates:
                thread = None
                if row.thread_id is not None:
                    thread = (
                        Thread.objects.select_for_update(skip_locked=True)
                        .filter(queue=queue, thread_id=row.thread_id)
                        .first()
                    )
                    if (
                        thread is None
                        or thread.processing_item is not None
                        or thread.head_item != row.id
                    ):
                        continue  # the thread is busy changing; another round or claim gets it
                lease = secrets.token_urlsafe(16)
                won = Item.objects.filter(id=row.id, status=Status.PENDING, eligible=True).update(
                    status=Status.PROCESSING,
                    eligible=False,
                    attempts=F("attempts") + 1,
                    lease=lease,
                    lease_expires_at=expires,
                    claimed_at=at,
                    updated_at=at,
                )
                if not won:
                    continue
                try:
                    st.move(queue.name, row.id, State.PENDING, State.PROCESSING)
                except FileMissing:
                    # The file is gone (a delete crashed half-way): so is the item.
                    Item.objects.filter(id=row.id).delete()
                    if thread is not None:
                        thread.head_item = None
                        leave_thread(thread, queue.name, row.id)
                    continue
                crash_point("claim.after_rename")
                if thread is not None:
                    thread.processing_item = row.id
                    thread.head_item = None
                    thread.save(update_fields=["processing_item", "head_item"])
                row.queue = queue
                row.status = Status.PROCESSING
                row.eligible = False
                row.attempts += 1
                row.lease = lease
                row.lease_expires_at = expires
                row.claimed_at = at
                row.updated_at = at
                taken.append(row)
            if len(candidates) < want:
                break
    crash_point("claim.after_commit")
    answer = []
    for row in taken:
        try:
            _state, record = st.read_any(queue.name, row.id, State.PROCESSING)
            payload = record.get("payload")
        except FileMissing:
            continue  # deleted between our commit and this read
        answer.append(Claimed(row=row, payload=payload))
        if row.attempts == 1:
            metrics.observe_latency(queue.name, _latency(row, at))
    if answer:
        metrics.count(queue.name, "claims", len(answer))
    return answer


def _latency(row: Item, at: datetime) -> float:
    due = max(row.posted_at, row.scheduled_at)
    return max(0.0, (at - due).total_seconds())


def extend(*, item_id: str, lease: str | None, seconds: float | None = None) -> tuple[bool, Item]:
    """Push the lease out to now + ``seconds`` (at most ``leaseSeconds``) for its holder."""
    row = Item.objects.select_related("queue").filter(id=item_id).first()
    if row is None:
        raise ItemNotFound(f"item {item_id!r} does not exist")
    limit = row.queue.lease_seconds
    wanted = limit if seconds is None else min(float(seconds), limit)
    at = utcnow()
    expires = lease_deadline(row.queue, at, wanted)
    accepted = bool(lease) and bool(
        Item.objects.filter(id=item_id, status=Status.PROCESSING, lease=lease).update(
            lease_expires_at=expires, updated_at=at
        )
    )
    if accepted:
        row.lease_expires_at = expires
    else:
        row.refresh_from_db()
    return accepted, row
