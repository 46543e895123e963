"""Reads of threads (the seed ``000``): each live thread's head, member count and processing
member, and its members in head order.

Thread rows are maintained by every group commit (``rules.settle``, ``group.Group``); this
module only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    return thread.head_item or first_pending_member(thread.queue_id, thread.thread_id)


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


def check_thread_cursor(*, queue: Queue, thread_id: str, after: str) -> None:
    """``InvalidInput`` (``invalid_cursor``) unless ``after`` is one of the thread's items: a
    page's position for ``thread_members``, judged before the page's other parameters."""
    if not Item.objects.filter(queue=queue, thread_id=thread_id, id=after).exists():
        raise InvalidInput("invalid cursor", code="invalid_cursor")


def thread_members(
    *, queue: Queue, thread_id: str, after: str | None, limit: int
) -> tuple[list[Item], str | None]:
    """Live members in head order: the processing member first, then pending ones by
    ``scheduled_at`` and arrival. ``after`` (an item id: the position a page ended at)
    continues from that member, which must be one of the thread's items (``InvalidInput``,
    ``invalid_cursor``, if not); it may have moved on since (claimed, finished)."""
    rows = Item.objects.filter(queue=queue, thread_id=thread_id)
    page: list[Item] = []
    if after is None:
        page.extend(rows.filter(status=Status.PROCESSING).order_by("id"))
        pending = rows.filter(status=Status.PENDING)
    else:
        position = rows.filter(id=after).only("scheduled_at", "seq").first()
        if position is None:
            raise InvalidInput("invalid cursor", code="invalid_cursor")
        pending = rows.filter(status=Status.PENDING).filter(
            Q(scheduled_at__gt=position.scheduled_at)
            | Q(scheduled_at=position.scheduled_at, seq__gt=position.seq)
        )
    page.extend(pending.order_by("scheduled_at", "seq")[: max(0, limit + 1 - len(page))])
    more = len(page) > limit
    page = page[:limit]
    return page, (page[-1].id if more and page else None)
