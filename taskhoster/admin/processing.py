"""Items in flight: the processing items, live (``live``), each with who holds it, since when,
its lease's time left and the progress its worker last reported (a bar when it says how far),
and a cancel link. The ones whose lease ends soonest come first (the lease clock's index,
``item_lease_clock``): those are the ones about to lapse. ``?queue=NAME`` keeps one queue.

This is the item list of processing items that moves by itself. Django's item list stays as
it is (its selection boxes belong to Django's action script, and rows moving under the
pointer would make a selection unsafe); it links here.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import BadRequest, PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from .. import engine
from ..models import Item, Queue
from ..status import Status
from ..timeutil import now as utcnow
from . import live
from .common import duration, item_link, lease_left, progress_bar, when
from .inflight import progress_cell

# The items shown (the rest counted).
SHOWN = 200
COLUMNS = (
    "id",
    "queue__name",
    "claimed_by",
    "claimed_at",
    "lease_expires_at",
    "attempts",
    "progress",
)


def processing_counts() -> dict[str, int]:
    """Processing items per queue with any, from the counts the commits keep (the engine's
    ``counts_by_queue``: no item row read)."""
    queues = dict(Queue.objects.filter(deleting=False).values_list("id", "name"))
    counts = engine.counts_by_queue(list(queues))
    processing = {queues[q]: c.get(Status.PROCESSING.value, 0) for q, c in counts.items()}
    return {name: n for name, n in processing.items() if n}


def in_flight(queue: str | None, limit: int = SHOWN) -> list[dict[str, Any]]:
    """The processing items (of ``queue``, or all), soonest lease end first."""
    rows = (
        Item.objects.extra(where=["status = 'processing'"])  # the partial index's own words
        .order_by("lease_expires_at", "id")
        .values(*COLUMNS)
    )
    if queue is not None:
        rows = rows.filter(queue__name=queue)
    return list(rows[:limit])


def row_cells(row: dict[str, Any], at: Any) -> dict[str, Any]:
    claimed = row["claimed_at"]
    progress = row["progress"]
    return {
        "id": row["id"],
        "link": item_link(row["id"]),
        "queue": row["queue__name"],
        "holder": row["claimed_by"] or "-",
        "claimed": when(claimed),
        "held_for": duration((at - claimed).total_seconds()) if claimed else "-",
        "lease": lease_left(row["lease_expires_at"], at),
        "attempts": row["attempts"],
        "bar": progress_bar(progress),
        "progress": "-" if progress is None else progress_cell(progress),
    }


def processing_view(request: HttpRequest) -> HttpResponse:
    if not (
        request.user.has_perm("taskhoster.view_item")
        or request.user.has_perm("taskhoster.change_item")
    ):
        raise PermissionDenied("items in flight need the permission to view items")
    counts = processing_counts()
    chosen = request.GET.get("queue") or None
    if chosen is not None and "\x00" in chosen:
        raise BadRequest("a queue name never holds a NUL character")
    at = utcnow()
    rows = [row_cells(row, at) for row in in_flight(chosen)]
    total = counts.get(chosen, 0) if chosen else sum(counts.values())
    context = {
        **admin.site.each_context(request),
        "title": "Items in flight",
        "subtitle": chosen,
        "rows": rows,
        "total": total,
        "shown": len(rows),
        "counts": sorted(counts.items()),
        "chosen": chosen,
        "can_cancel": request.user.has_perm("taskhoster.change_item"),
    }
    response = TemplateResponse(request, "admin/taskhoster/processing.html", context)
    return live.answer(request, response)
