"""Acting on many items, and what happened to a failed one (issue 24, parts 3 and 4).

The item list's "Cancel all matching the filter" and "Restart all matching the filter"
(each behind the confirmation page of the other item actions, then the matching ids walked
in chunks, one engine call per item), a filter by error (the most common errors among the
latest failed items, so "every failed item of a queue with this error" can be chosen), and
on a failed item's page a "Restart item" button and where its dead-letter copy is now.

``BulkAdmin`` is a base class of ``items.ItemAdmin``: the pages, their URLs and the flags
of their buttons; the functions below it do the work.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import engine
from ..errors import TaskhosterError
from ..models import Item, Queue
from ..status import LIVE_STATUSES, Status
from .common import confirm_page, item_link, item_url, status_counts
from .inflight import CANCEL_NOTE, REASON_MAX_CHARS, CancelReport, cancel_items, clean_reason

# The matching ids are read and acted on this many at a time, in id order.
BULK_CHUNK = 500
# The error filter's choices: the most common errors among this many latest failed items.
ERROR_SAMPLE = 10_000
ERROR_CHOICES = 10
ERROR_LABEL_CHARS = 80
# The list's queue filter (Django's filter of the ``queue`` foreign key).
QUEUE_PARAM = "queue__id__exact"
# The list's parameters that are not filters: search, order, page, and the error flag.
LIST_PARAMS = frozenset({"q", "o", "p", "e"})

RESTART_NOTE = (
    "Only failed items are restarted: each becomes a new pending arrival, its attempts and "
    "error cleared. Pending, processing and finished items are left as they are."
)
MATCHING_NOTE = " Items that arrive while this runs and match the filter are included."


class BulkAdmin(admin.ModelAdmin):
    """The item admin's pages for acting on many items and restarting one (a base class of
    ``ItemAdmin``). Each changes items through the engine only, and needs Django's change
    permission for items."""

    def may_change_items(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.change_item"))

    def has_restart_permission(self, request: HttpRequest) -> bool:
        return self.may_change_items(request)

    def get_urls(self) -> list[URLPattern]:
        def view(name: str, route: str, func: Any) -> URLPattern:
            return path(route, self.admin_site.admin_view(func), name=f"taskhoster_item_{name}")

        extra = [
            view("cancel_matching", "cancel-matching/", self.cancel_matching_view),
            view("restart_matching", "restart-matching/", self.restart_matching_view),
            view("restart", "<str:object_id>/restart/", self.restart_view),
        ]
        return extra + super().get_urls()

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        extra = {**(extra_context or {}), "can_change_items": self.may_change_items(request)}
        return super().changelist_view(request, extra_context=extra)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if "\x00" in unquote(object_id):  # no id holds one (PostgreSQL refuses to look)
            self.message_user(request, "No item has that id.", messages.WARNING)
            return HttpResponseRedirect(reverse("admin:taskhoster_item_changelist"))
        failed = Item.objects.filter(pk=unquote(object_id), status=Status.FAILED).exists()
        extra = {
            **(extra_context or {}),
            "can_restart": failed and self.may_change_items(request),
        }
        return super().change_view(request, object_id, form_url, extra_context=extra)

    def _filtered(self, request: HttpRequest) -> QuerySet[Item]:
        """What the item list shows with the request's query string (its filters, search),
        for an action on all of it: ``IncorrectLookupParameters`` unless every filter the
        query string names is applied. Django drops a filter that has nothing to offer (the
        queue filter while one queue exists) and ignores its parameter: a bad or stale
        ``queue__id__exact`` would then make "all matching" mean every item."""
        changelist = self.get_changelist_instance(request)
        applied = {p for spec in changelist.filter_specs for p in spec.expected_parameters()}
        unknown = set(request.GET) - applied - LIST_PARAMS - {QUEUE_PARAM}
        if unknown:
            raise IncorrectLookupParameters(f"not a filter of the list: {sorted(unknown)}")
        queryset = changelist.get_queryset(request).order_by()
        if QUEUE_PARAM in request.GET:
            queue_id = chosen_queue(request)
            if queue_id is None or not Queue.objects.filter(pk=queue_id).exists():
                raise IncorrectLookupParameters("no such queue")
            queryset = queryset.filter(queue_id=queue_id)
        return queryset

    def _to_list(self, request: HttpRequest) -> HttpResponseRedirect:
        """Back to the item list, filtered as the request's query string says."""
        back = reverse("admin:taskhoster_item_changelist")
        query = request.META.get("QUERY_STRING", "")
        return HttpResponseRedirect(f"{back}?{query}" if query else back)

    def _matching_page(
        self,
        request: HttpRequest,
        *,
        title: str,
        note: str,
        reason: bool,
        touched: tuple[Status, ...],
    ) -> HttpResponse | QuerySet[Item]:
        """The checks and the confirmation page of a "... all matching the filter" view: the
        filtered queryset once the POST confirms, else the response to give."""
        if not self.may_change_items(request):
            raise PermissionDenied("changing items needs the permission to change items")
        try:
            queryset = self._filtered(request)
        except IncorrectLookupParameters:
            self.message_user(request, "The filter is not valid: nothing done.", messages.ERROR)
            return HttpResponseRedirect(reverse("admin:taskhoster_item_changelist"))
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            return queryset
        return confirm_page(
            self,
            request,
            action="",
            title=title,
            # What it will act on: the matching items in the states it touches.
            counts=status_counts(queryset.filter(status__in=touched)),
            ids=None,
            note=note + MATCHING_NOTE,
            reason_max=REASON_MAX_CHARS if reason else 0,
        )

    def cancel_matching_view(self, request: HttpRequest) -> HttpResponse:
        """The "Cancel all matching the filter" page: its pending and processing items,
        through ``engine.cancel``, with the optional reason typed on the confirmation page."""
        found = self._matching_page(
            request,
            title="Cancel every item matching the filter?",
            note=CANCEL_NOTE,
            reason=True,
            touched=LIVE_STATUSES,
        )
        if isinstance(found, HttpResponse):
            return found
        try:
            reason = clean_reason(request.POST.get("reason"))
        except TaskhosterError as exc:
            self.message_user(request, f"Nothing cancelled: {exc.message}", messages.ERROR)
            return self._to_list(request)
        for level, text in cancel_matching(found, reason=reason).notes():
            self.message_user(request, text, level)
        return self._to_list(request)

    def restart_matching_view(self, request: HttpRequest) -> HttpResponse:
        """The "Restart all matching the filter" page: its failed items, through
        ``engine.restart``."""
        found = self._matching_page(
            request,
            title="Restart every item matching the filter?",
            note=RESTART_NOTE,
            reason=False,
            touched=(Status.FAILED,),
        )
        if isinstance(found, HttpResponse):
            return found
        restarted, skipped = restart_matching(found)
        self.message_user(request, *restart_note(restarted, skipped))
        return self._to_list(request)

    def restart_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The "Restart item" button of a failed item's page: the confirmation page, then
        (its POST) ``engine.restart``, back to the item's page."""
        if not self.may_change_items(request):
            raise PermissionDenied("restarting items needs the permission to change items")
        item_id = unquote(object_id)
        found = Item.objects.filter(pk=item_id)
        if "\x00" in item_id or not found.exists():
            self.message_user(request, f"Item {item_id} does not exist.", messages.WARNING)
            return HttpResponseRedirect(reverse("admin:taskhoster_item_changelist"))
        back = item_url(item_id)
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            try:
                engine.restart(item_id=item_id)
            except TaskhosterError as exc:
                self.message_user(request, f"Not restarted: {exc.message}", messages.ERROR)
            else:
                self.message_user(
                    request, "Restarted: the item is pending again.", messages.SUCCESS
                )
            return HttpResponseRedirect(back)
        return confirm_page(
            self,
            request,
            action="",
            title="Restart this item?",
            counts=status_counts(found),
            ids=None,
            note=RESTART_NOTE,
            back=back,
        )


# -- acting on the matching items -----------------------------------------------------------


def id_chunks(queryset: QuerySet[Item]) -> Iterator[list[str]]:
    """The ids ``queryset`` matches, ``BULK_CHUNK`` at a time in id order, each chunk read
    after the previous one was acted on (an item leaving the filter meanwhile is no gap)."""
    after = ""
    while True:
        ids = list(
            queryset.filter(id__gt=after).order_by("id").values_list("id", flat=True)[:BULK_CHUNK]
        )
        if not ids:
            return
        yield ids
        after = ids[-1]


def cancel_matching(queryset: QuerySet[Item], *, reason: str | None) -> CancelReport:
    """Cancel the pending and processing items of ``queryset`` (only those are read)."""
    report = CancelReport()
    for ids in id_chunks(queryset.filter(status__in=LIVE_STATUSES)):
        chunk = cancel_items(ids, reason=reason)
        report.cancelled += chunk.cancelled
        report.terminal += chunk.terminal
        report.gone += chunk.gone
        report.refused += chunk.refused
    return report


def restart_items(item_ids: list[str]) -> tuple[int, int]:
    """Restart each item through the engine: (restarted, skipped as not failed or gone)."""
    restarted = 0
    for item_id in item_ids:
        try:
            engine.restart(item_id=item_id)
        except TaskhosterError:
            continue
        restarted += 1
    return restarted, len(item_ids) - restarted


def restart_matching(queryset: QuerySet[Item]) -> tuple[int, int]:
    """Restart the failed items of ``queryset`` (only those are read)."""
    restarted = skipped = 0
    for ids in id_chunks(queryset.filter(status=Status.FAILED)):
        done, passed = restart_items(ids)
        restarted += done
        skipped += passed
    return restarted, skipped


def restart_note(restarted: int, skipped: int) -> tuple[str, int]:
    """The message (text, level) saying what a restart of many items did."""
    level = messages.SUCCESS if restarted else messages.WARNING
    return f"Restarted {restarted} item(s); skipped {skipped} (not failed, or gone).", level


# -- the filter by error --------------------------------------------------------------------


class ErrorFilter(admin.SimpleListFilter):
    """The most common errors among the latest failed items of the queue the list's queue
    filter chose (none before a queue is chosen), each matched exactly. An error chosen but
    no longer among them stays offered, so the filter is never silently dropped."""

    title = "error (latest failed of the queue chosen)"
    parameter_name = "error"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # Only once a queue is chosen: over every queue at once, the latest failed items
        # are no index range (SQLite took 2.4 s with 1,000,000 items), and every list page
        # would pay for it.
        queue = chosen_queue(request)
        errors = [] if queue is None else common_errors(queue)
        chosen = self.value()
        if chosen is not None and chosen not in errors:
            errors.append(chosen)
        return [(error, cut(error)) for error in errors]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Item]) -> QuerySet[Item]:
        value = self.value()
        if value is not None and "\x00" in value:
            raise IncorrectLookupParameters("an error never holds a NUL character")
        return queryset if value is None else queryset.filter(error=value)


def cut(text: str) -> str:
    return text if len(text) <= ERROR_LABEL_CHARS else text[: ERROR_LABEL_CHARS - 1] + "…"


def chosen_queue(request: HttpRequest) -> int | None:
    """The queue id the list's queue filter chose, when it is one a row could have."""
    try:
        queue_id = int(request.GET.get(QUEUE_PARAM, ""))
    except ValueError:
        return None
    return queue_id if 0 < queue_id < 2**63 else None


def common_errors(queue_id: int | None) -> list[str]:
    """The ``ERROR_CHOICES`` most common errors (most common first) among the latest
    ``ERROR_SAMPLE`` failed items of the queue (of every queue: None), in one query whose
    grouping reads only those items."""
    sql = COMMON_ERRORS.format(
        queue=Queue._meta.db_table,
        item=Item._meta.db_table,
        offset=ERROR_SAMPLE - 1,
        sample=ERROR_SAMPLE,
        choices=ERROR_CHOICES,
        where="" if queue_id is None else "WHERE q.id = %s ",
    )
    params: list[Any] = [Status.FAILED.value, Status.FAILED.value]
    with connection.cursor() as cursor:
        cursor.execute(sql, params if queue_id is None else [*params, queue_id])
        return [error for error, _ in cursor.fetchall()]


# Per queue, its latest failed items down to a floor, its ERROR_SAMPLE-th latest (or all of
# them), both read on the index ``item_by_status`` (queue, status, id): no queue costs more
# than twice ERROR_SAMPLE index entries, whatever the table holds. The error is read with
# the row the index found (an ``id IN (...)`` would let PostgreSQL's planner prefer a scan
# of the whole table to ERROR_SAMPLE lookups).
COMMON_ERRORS = (
    "SELECT error, COUNT(*) AS n FROM ("
    "SELECT i.id, i.error FROM {queue} q JOIN {item} i ON i.queue_id = q.id "
    "AND i.status = %s AND i.id >= COALESCE((SELECT f.id FROM {item} f "
    "WHERE f.queue_id = q.id AND f.status = %s ORDER BY f.id DESC LIMIT 1 OFFSET {offset}), '') "
    "{where}ORDER BY i.id DESC LIMIT {sample}"
    ") AS latest WHERE error IS NOT NULL GROUP BY error ORDER BY n DESC, error LIMIT {choices}"
)


# -- the dead-letter copy -------------------------------------------------------------------


def dead_letter_copy(item_id: str | None) -> SafeString | str:
    """An item's dead-letter copy: its link, queue and current status (one query); "-" when
    there is none, "(deleted)" when its row is gone."""
    if not item_id:
        return "-"
    found = Item.objects.filter(id=item_id).values_list("queue__name", "status").first()
    if found is None:
        return format_html("{} (deleted)", item_id)
    return format_html("{} in queue “{}” ({})", item_link(item_id), *found)
