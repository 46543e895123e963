"""Items: a list over the index (never the files), a read-only detail page that reads the
file, and actions that go through the engine (delete, delete everything matching, restart,
and, from ``inflight``, cancel; the attempts and progress of SPEC section 8.2 are there too;
from ``bulk``, cancel or restart everything matching, the filter by error, restarting one
item from its page and its dead-letter copy)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import engine
from ..errors import TaskhosterError
from ..models import Item, Queue
from ..timeutil import now as utcnow
from . import live
from .bulk import BulkAdmin, ErrorFilter, dead_letter_copy, restart_items, restart_note
from .common import (
    CappedPaginator,
    confirm_page,
    item_link,
    paginator_for,
    status_counts,
    time_column,
)
from .inflight import WorkInFlightAdmin
from .processing import processing_view

DELETE_CHUNK = 500
# The item page's box drawn once (never redrawn live): the file's payload and result.
PAYLOAD_FIELDSET = "Payload and result"


class AttemptsFilter(admin.SimpleListFilter):
    title = "attempts"
    parameter_name = "attempts"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("0", "0"), ("1", "1"), ("2", "2"), ("3+", "3 or more")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Item]) -> QuerySet[Item]:
        value = self.value()
        if value == "3+":
            return queryset.filter(attempts__gte=3)
        if value in {"0", "1", "2"}:
            return queryset.filter(attempts=int(value))
        return queryset


class PriorityFilter(admin.SimpleListFilter):
    """Priority (SPEC section 8.1, 0-9): one level, or any above the default. The choices are
    fixed, never read from the table (Django's filter for a field would ask for the distinct
    values of a million rows). Like the attempts filter it has no index of its own: the list
    reads rows in its order until a page matches (and the capped count stops at its cap)."""

    title = "priority"
    parameter_name = "priority"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("1+", "above 0"), *((str(n), str(n)) for n in range(9, -1, -1))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Item]) -> QuerySet[Item]:
        value = self.value()
        if value == "1+":
            return queryset.filter(priority__gte=1)
        if value in {str(n) for n in range(10)}:
            return queryset.filter(priority=int(value))
        return queryset


AGES = {"5m": timedelta(minutes=5), "1h": timedelta(hours=1), "1d": timedelta(days=1)}


class AgeFilter(admin.SimpleListFilter):
    """Age from postedAt: younger than 5 minutes / an hour / a day, or older than a day."""

    title = "age (from postedAt)"
    parameter_name = "age"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("5m", "under 5 minutes"),
            ("1h", "under an hour"),
            ("1d", "under a day"),
            ("old", "a day or more"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Item]) -> QuerySet[Item]:
        value = self.value()
        if value in AGES:
            return queryset.filter(posted_at__gte=utcnow() - AGES[value])
        if value == "old":
            return queryset.filter(posted_at__lt=utcnow() - AGES["1d"])
        return queryset


class ThreadFilter(admin.SimpleListFilter):
    """Threaded or not; ``?thread_id=<id>`` (the thread pages link to it) picks one thread."""

    title = "thread"
    parameter_name = "threaded"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "in a thread"), ("no", "not threaded")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Item]) -> QuerySet[Item]:
        if self.value() == "yes":
            return queryset.filter(thread_id__isnull=False)
        if self.value() == "no":
            return queryset.filter(thread_id__isnull=True)
        return queryset


def pretty(value: Any) -> SafeString:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return format_html('<pre class="th-json">{}</pre>', text)


# The index columns a list reads (no join, no error/origin text).
LIST_COLUMNS = (
    "id",
    "status",
    "priority",
    "thread_id",
    "attempts",
    "progress",
    "scheduled_at",
    "posted_at",
    "finished_at",
)


# The detail page's first box: the index row (``claimed_by``, ``progress`` and
# ``cancel_reason`` are SPEC section 8.2's).
ROW_FIELDS = (
    "id",
    "queue",
    "status",
    "priority",
    "thread_id",
    "key",
    "scheduled",
    "posted",
    "attempts",
    "lease_expires",
    "lease_remaining",
    "claimed",
    "claimed_by",
    "progress_shown",
    "finished",
    "fetched",
    "error",
    "cancel_reason",
    "origin_link",
    "dead_letter_link",
)


class IndexedOrderChangeList(ChangeList):
    """Sorts only by the columns of ``sortable_by`` (those an index serves), whatever ``?o=``
    asks: Django honours any column's number there, and sorting a million rows by one
    without an index (attempts: 440 ms) is a page an operator should never wait for."""

    def get_ordering_field(self, field_name: Any) -> Any:
        if field_name not in (self.sortable_by or ()):
            return None
        return super().get_ordering_field(field_name)


@admin.register(Item)
class ItemAdmin(BulkAdmin, WorkInFlightAdmin):
    list_display = (
        "id",
        "queue_name",
        "status_column",
        "priority",
        "thread",
        "attempts",
        "scheduled",
        "posted",
        "finished",
    )
    list_filter = (
        "queue",
        "status",
        ErrorFilter,
        PriorityFilter,
        ThreadFilter,
        AttemptsFilter,
        AgeFilter,
    )
    sortable_by = ("scheduled", "posted")
    ordering = ("-id",)
    search_fields = ("=id", "=key", "=thread_id")
    search_help_text = "An exact item id, key or threadId."
    paginator = CappedPaginator

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return IndexedOrderChangeList

    def get_paginator(
        self, request: HttpRequest, queryset: Any, per_page: int, *args: Any, **kw: Any
    ) -> CappedPaginator:
        return paginator_for(request, queryset, per_page)

    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 100
    actions = ["delete_selected_items", "restart_selected_items", "cancel_selected_items"]
    change_list_template = "admin/taskhoster/item/change_list.html"
    fieldsets = (
        (None, {"fields": ROW_FIELDS}),
        ("History: the attempts", {"fields": ("attempt_history",)}),
        (PAYLOAD_FIELDSET, {"fields": ("payload", "result")}),
    )
    readonly_fields = (*ROW_FIELDS, "attempt_history", "payload", "result")

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        """The page's boxes; a live redraw leaves out the payload and result, which it does
        not redraw (the file is not read every second, nor sent)."""
        fieldsets = super().get_fieldsets(request, obj)
        if live.wanted(request):
            return [f for f in fieldsets if f[0] != PAYLOAD_FIELDSET]
        return fieldsets

    # Read-only: every change goes through the actions below, which call the engine.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # Times to the second (Django's own format has none); long names cut to the column's
    # width, whole in their tooltips, so every column fits (see the change list's template).
    scheduled = time_column("scheduled_at")
    posted = time_column("posted_at")
    finished = time_column("finished_at")
    lease_expires = time_column("lease_expires_at")
    claimed = time_column("claimed_at")
    fetched = time_column("fetched_at")

    @admin.display(description="queue", ordering="queue__name")
    def queue_name(self, obj: Item) -> SafeString:
        return format_html('<span class="th-cut" title="{0}">{0}</span>', obj.queue.name)

    @admin.display(description="thread id")
    def thread(self, obj: Item) -> SafeString | str:
        if obj.thread_id is None:
            return "-"
        return format_html('<span class="th-cut" title="{0}">{0}</span>', obj.thread_id)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Item]:
        # Only the columns a list shows: no join, no error/origin text.
        return (
            super().get_queryset(request).select_related("queue").only(*LIST_COLUMNS, "queue__name")
        )

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Item], search_term: str
    ) -> tuple[QuerySet[Item], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        # queue IN (...) leads the (queue, key) and (queue, thread_id) indexes.
        queues = list(Queue.objects.values_list("id", flat=True))
        match = (
            Q(id=term) | Q(queue_id__in=queues, key=term) | Q(queue_id__in=queues, thread_id=term)
        )
        return queryset.filter(match), False

    # The detail page: the index row plus the file, read without counting as a producer's read.
    def _record(self, obj: Item) -> dict[str, Any] | None:
        cache: dict[str, Any] = obj.__dict__.setdefault("_th_record", {})
        if "record" not in cache:
            try:
                cache["record"] = engine.get_item(item_id=obj.id, producer_read=False)[1]
            except TaskhosterError:
                cache["record"] = None
        return cache["record"]

    @admin.display(description="payload")
    def payload(self, obj: Item) -> SafeString | str:
        record = self._record(obj)
        return "(file missing)" if record is None else pretty(record.get("payload"))

    @admin.display(description="result")
    def result(self, obj: Item) -> SafeString | str:
        record = self._record(obj)
        return "(file missing)" if record is None else pretty(record.get("result"))

    @admin.display(description="origin")
    def origin_link(self, obj: Item) -> SafeString | str:
        if not obj.origin:
            return "-"
        origin = dict(obj.origin)
        return format_html(
            "{} from queue {} {}",
            item_link(str(origin.get("id"))),
            origin.get("queue"),
            pretty(origin),
        )

    @admin.display(description="dead letter")
    def dead_letter_link(self, obj: Item) -> SafeString | str:
        return dead_letter_copy(obj.dead_letter)

    # Actions, each behind a confirmation page that says how many items and which states.
    def _confirm(
        self,
        request: HttpRequest,
        *,
        action: str,
        title: str,
        counts: dict[str, int],
        ids: list[str] | None,
        note: str = "",
    ) -> TemplateResponse:
        return confirm_page(
            self, request, action=action, title=title, counts=counts, ids=ids, note=note
        )

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        extra = {**(extra_context or {}), "can_delete": self.has_engine_delete_permission(request)}
        return super().changelist_view(request, extra_context=extra)

    # The actions change items through the engine: each needs Django's matching model
    # permission (a staff user with only view_item sees the items and nothing more).
    def has_engine_delete_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.delete_item"))

    @admin.action(
        description="Delete selected items (through the engine)", permissions=["engine_delete"]
    )
    def delete_selected_items(
        self, request: HttpRequest, queryset: QuerySet[Item]
    ) -> HttpResponse | None:
        ids = list(queryset.order_by("id").values_list("id", flat=True)[: COUNT_LIMIT + 1])
        if len(ids) > COUNT_LIMIT:
            self.message_user(
                request,
                "Too many for one action: use “Delete all matching the filter”.",
                messages.ERROR,
            )
            return None
        if request.POST.get("confirm") != "yes":
            counts = status_counts(Item.objects.filter(id__in=ids))
            return self._confirm(
                request,
                action="delete_selected_items",
                title="Delete these items?",
                counts=counts,
                ids=ids,
            )
        deleted = engine.delete_items(item_ids=ids)
        self.message_user(request, f"Deleted {deleted} item(s).", messages.SUCCESS)
        return None

    @admin.action(
        description="Restart selected failed items (through the engine)", permissions=["restart"]
    )
    def restart_selected_items(
        self, request: HttpRequest, queryset: QuerySet[Item]
    ) -> HttpResponse | None:
        ids = list(queryset.order_by("id").values_list("id", flat=True)[: COUNT_LIMIT + 1])
        if len(ids) > COUNT_LIMIT:
            self.message_user(request, "Too many items for one action.", messages.ERROR)
            return None
        if request.POST.get("confirm") != "yes":
            counts = status_counts(Item.objects.filter(id__in=ids))
            return self._confirm(
                request,
                action="restart_selected_items",
                title="Restart these items?",
                counts=counts,
                ids=ids,
                note="Only failed items are restarted; the others are left as they are.",
            )
        self.message_user(request, *restart_note(*restart_items(ids)))
        return None

    # "Delete all matching the current filter": its own page, deleting in chunks of ids.
    def get_urls(self) -> list[URLPattern]:
        extra = [
            path(
                "delete-matching/",
                self.admin_site.admin_view(self.delete_matching_view),
                name="taskhoster_item_delete_matching",
            ),
            path(
                "processing/",
                self.admin_site.admin_view(processing_view),
                name="taskhoster_item_processing",
            ),
        ]
        return extra + super().get_urls()

    def delete_matching_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_engine_delete_permission(request):
            raise PermissionDenied("deleting items needs the permission to delete items")
        back = reverse("admin:taskhoster_item_changelist")
        try:
            queryset = self._filtered(request)
        except IncorrectLookupParameters:
            self.message_user(request, "The filter is not valid: nothing done.", messages.ERROR)
            return HttpResponseRedirect(back)
        query = request.META.get("QUERY_STRING", "")
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            deleted = delete_matching(queryset)
            self.message_user(request, f"Deleted {deleted} item(s).", messages.SUCCESS)
            return HttpResponseRedirect(f"{back}?{query}" if query else back)
        return self._confirm(
            request,
            action="",
            title="Delete every item matching the filter?",
            counts=status_counts(queryset),
            ids=None,
            note="Items that arrive while this runs and match the filter are deleted too.",
        )


COUNT_LIMIT = 10_000


def delete_matching(queryset: QuerySet[Item]) -> int:
    """Delete what ``queryset`` matches through the engine, ``DELETE_CHUNK`` ids at a time."""
    deleted = 0
    after = ""
    while True:
        ids = list(
            queryset.filter(id__gt=after).order_by("id").values_list("id", flat=True)[:DELETE_CHUNK]
        )
        if not ids:
            return deleted
        deleted += engine.delete_items(item_ids=ids)
        after = ids[-1]
