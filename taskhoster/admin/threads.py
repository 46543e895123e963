"""Threads: each live thread's head, member count and processing member; the detail page
lists its members in head order (the engine's own read, ``engine.thread_members``)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .. import engine
from ..models import Thread
from .common import CappedPaginator, item_link, items_url, paginator_for, when

MEMBERS_SHOWN = 500


@admin.register(Thread)
class ThreadAdmin(admin.ModelAdmin):
    list_display = ("thread_id", "queue", "head", "member_count", "processing_members")
    list_filter = ("queue",)
    search_fields = ("=thread_id",)
    search_help_text = "An exact threadId."
    sortable_by = ()
    ordering = ("-id",)
    paginator = CappedPaginator

    def get_paginator(
        self, request: HttpRequest, queryset: Any, per_page: int, *args: Any, **kw: Any
    ) -> CappedPaginator:
        return paginator_for(request, queryset, per_page)

    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    fields = ("queue", "thread_id", "member_count", "head", "processing_members", "members")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Thread]:
        return super().get_queryset(request).select_related("queue")

    @admin.display(description="head")
    def head(self, obj: Thread) -> SafeString | str:
        return item_link(engine.thread_head(obj))

    # Not named "processing": that is the model's count of processing members, which Django
    # would show in place of a ModelAdmin method of the same name.
    @admin.display(description="processing")
    def processing_members(self, obj: Thread) -> SafeString | str:
        """A member processing (linked), and how many more are (``threadLimit`` above 1)."""
        if obj.processing_item is None:
            return "-"
        link = item_link(obj.processing_item)
        if obj.processing <= 1:
            return link
        return format_html("{} and {} more", link, obj.processing - 1)

    @admin.display(description="members in head order")
    def members(self, obj: Thread) -> SafeString:
        rows, more = engine.thread_members(
            queue=obj.queue, thread_id=obj.thread_id, after=None, limit=MEMBERS_SHOWN
        )
        body = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (n, item_link(m.id), m.status, when(m.scheduled_at), m.attempts)
                for n, m in enumerate(rows, 1)
            ),
        )
        tail = (
            format_html(
                '<p>First {} shown; <a href="{}">all members</a>.</p>',
                MEMBERS_SHOWN,
                items_url(queue__id__exact=obj.queue_id, thread_id=obj.thread_id),
            )
            if more
            else ""
        )
        return format_html(
            '<table id="th-members"><thead><tr><th>#</th><th>item</th><th>status</th>'
            "<th>scheduledAt</th><th>attempts</th></tr></thead><tbody>{}</tbody></table>{}",
            body,
            tail,
        )
