"""Delete (rule 9), retention deletes (rule 11) and deleting a whole queue.

A delete removes the file first and the row after, both under the row's lock: a crash
between leaves a row without a file, which every transition treats as already deleted (and
``repair`` removes). The reverse order could bring a deleted item back from its file.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db import transaction

from ..conf import get_conf
from ..errors import InvalidInput
from ..models import Item, Queue, Thread
from ..status import Status
from ..store import write_queue_settings
from .common import announce_removed, leave_thread, lock_item, seconds, store
from .posting import get_live_queue
from .queues import queue_settings

DELETED = "deleted"


def delete_item(*, item_id: str, queue_name: str | None = None) -> bool:
    """Rule 9: the item and its file are gone; a processing thread head is detached at once."""
    with transaction.atomic():
        locked = lock_item(item_id)
        if locked is None or (queue_name is not None and locked.queue.name != queue_name):
            return False
        row = locked.row
        store().unlink(locked.queue.name, row.id)
        row.delete()
        if not Status(row.status).is_terminal:
            leave_thread(locked.thread, locked.queue.name, item_id)
        if row.status == Status.PROCESSING:
            announce_removed(locked.queue.name, item_id, DELETED)
        return True


def delete_items(*, item_ids: Iterable[str], queue_name: str | None = None) -> int:
    return sum(delete_item(item_id=i, queue_name=queue_name) for i in item_ids)


def delete_by_status(*, queue_name: str, status: Status) -> int:
    """Delete every item of the queue in ``status``, a chunk at a time."""
    queue = get_live_queue(queue_name)
    chunk = get_conf().sweep_chunk
    deleted = 0
    after = ""
    while True:
        ids = list(
            Item.objects.filter(queue=queue, status=status, id__gt=after)
            .order_by("id")
            .values_list("id", flat=True)[:chunk]
        )
        if not ids:
            return deleted
        deleted += delete_items(item_ids=ids, queue_name=queue_name)
        after = ids[-1]


def delete_if_retained(*, item_id: str, at: datetime) -> bool:
    """Rule 11: delete a done item whose retention has run out (re-checked under the lock)."""
    with transaction.atomic():
        locked = lock_item(item_id)
        if locked is None or not Status(locked.row.status).is_terminal:
            return False
        queue, row = locked.queue, locked.row
        start = row.finished_at if queue.retain_from == "finished" else row.fetched_at
        if start is None or start + seconds(queue.retain_seconds) > at:
            return False
        store().unlink(queue.name, row.id)
        row.delete()
        return True


def delete_queue(*, queue_name: str) -> None:
    """Delete a queue, all its items and files. Posts into it fail from the first step on."""
    updated = Queue.objects.filter(name=queue_name).update(deleting=True)
    if not updated:
        get_live_queue(queue_name)  # raises QueueNotFound
    queue = Queue.objects.get(name=queue_name)
    chunk = get_conf().sweep_chunk
    while _purge_chunk(queue, chunk):
        pass
    with transaction.atomic():
        Queue.objects.select_for_update().filter(id=queue.id).first()
        while _purge_chunk(queue, chunk):
            pass
        Thread.objects.filter(queue=queue).delete()
        queue.delete()
        # Queues that sent their dead letters here stop doing so, visibly.
        for other in Queue.objects.filter(dead_letter_queue=queue_name):
            other.dead_letter_queue = None
            other.save(update_fields=["dead_letter_queue"])
            write_queue_settings(store(), other.name, queue_settings(other, wire=False))
    store().remove_queue(queue_name)


def _purge_chunk(queue: Queue, chunk: int) -> int:
    with transaction.atomic():
        rows = list(Item.objects.filter(queue=queue).values_list("id", "status")[:chunk])
        st = store()
        for item_id, status in rows:
            st.unlink(queue.name, item_id)
            if status == Status.PROCESSING:
                announce_removed(queue.name, item_id, DELETED)
        Item.objects.filter(id__in=[r[0] for r in rows]).delete()
        return len(rows)


def validate_bulk_delete(ids: object, status: object) -> None:
    if (ids is None) == (status is None):
        raise InvalidInput("give either ids or status", code="invalid_body")
