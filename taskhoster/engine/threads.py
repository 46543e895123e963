"""Reads of threads (the seed ``000``): each live thread's head, member count and processing
member, and its members in head order.

Thread rows are maintained by every group commit (``rules.settle``, ``group.Group``); this
module only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q

from ..errors import InvalidInput, NotFound
from ..models import Item, Queue, Thread
from ..status import Status
from .rows import first_pending_member


@dataclass(frozen=True)
class ThreadView:
    thread_id: str
    member_count: int
    head: str | None
    processing: str | None


def thread_head(thread: Thread) -> str | None:
    """The id of the thread's head: the member that goes next (or is processing)."""
    heads = thread.heads or []
    return heads[0] if heads else first_pending_member(thread.queue_id, thread.thread_id)


def _view(thread: Thread) -> ThreadView:
    return ThreadView(
        thread.thread_id, thread.member_count, thread_head(thread), thread.processing_item
    )


def list_threads(
    *, queue: Queue, after: str | None, limit: int
) -> tuple[list[ThreadView], str | None]:
    rows = Thread.objects.filter(queue=queue)
    if after is not None:
        rows = rows.filter(thread_id__gt=after)
    page = list(rows.order_by("thread_id")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return [_view(t) for t in page], (page[-1].thread_id if more and page else None)


def get_thread(*, queue: Queue, thread_id: str) -> ThreadView:
    thread = Thread.objects.filter(queue=queue, thread_id=thread_id).first()
    if thread is None:
        raise NotFound(
            f"thread {thread_id!r} has no live member in queue {queue.name!r}",
            code="thread_not_found",
        )
    return _view(thread)


@dataclass(frozen=True)
class ThreadPosition:
    """Where a page of a thread's members ended: the member's place in line."""

    scheduled_at: datetime
    seq: str


def thread_position(*, queue: Queue, thread_id: str, after: str) -> ThreadPosition:
    """The place in line of ``after``, a page's cursor (an item id), for ``thread_members``:
    ``InvalidInput`` (``invalid_cursor``) unless it is one of the thread's items. It may have
    moved on since (claimed, finished)."""
    found = (
        Item.objects.filter(queue=queue, thread_id=thread_id, id=after)
        .values_list("scheduled_at", "seq")
        .first()
    )
    if found is None:
        raise InvalidInput("invalid cursor", code="invalid_cursor")
    return ThreadPosition(*found)


def thread_members(
    *, queue: Queue, thread_id: str, after: ThreadPosition | None, limit: int
) -> tuple[list[Item], str | None]:
    """Live members in head order: the processing member first, then pending ones by
    ``scheduled_at`` and arrival; ``after`` (``thread_position``) continues a page."""
    rows = Item.objects.filter(queue=queue, thread_id=thread_id)
    page: list[Item] = []
    if after is None:
        page.extend(rows.filter(status=Status.PROCESSING).order_by("id"))
        pending = rows.filter(status=Status.PENDING)
    else:
        pending = rows.filter(status=Status.PENDING).filter(
            Q(scheduled_at__gt=after.scheduled_at)
            | Q(scheduled_at=after.scheduled_at, seq__gt=after.seq)
        )
    page.extend(pending.order_by("scheduled_at", "seq")[: max(0, limit + 1 - len(page))])
    more = len(page) > limit
    page = page[:limit]
    return page, (page[-1].id if more and page else None)
