"""Queues: create and edit settings with the API's validation (saved by ``engine.upsert_queue``
so ``queue.json`` is written too), live counts per status linking to the item list, the age
of the oldest pending item and what finished or failed in the last five minutes."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import URLPattern, path
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import engine
from ..errors import InvalidInput
from ..models import Item, Queue
from ..status import Status
from ..timeutil import now as utcnow
from .common import capped_count, capped_label, items_url, with_stats
from .overview import overview_view

FIELD_TO_WIRE = {field: wire for wire, field in engine.WIRE_TO_FIELD.items()}


class QueueForm(forms.ModelForm):
    class Meta:
        model = Queue
        fields = ["name", *FIELD_TO_WIRE]

    def wire_body(self) -> dict[str, Any]:
        data = self.cleaned_data
        body = {FIELD_TO_WIRE[f]: data.get(f) for f in FIELD_TO_WIRE if f in data}
        if body.get("deadLetterQueue") == "":
            body["deadLetterQueue"] = None
        return body

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        name = self.instance.name if self.instance.pk else data.get("name", "")
        try:
            engine.validate_queue_name(name)
            values = engine.clean_settings(name, self.wire_body())
        except InvalidInput as exc:
            raise forms.ValidationError(exc.message, code=exc.code) from None
        if values.get("backoff_max_seconds", 0) < values.get("backoff_seconds", 0):
            raise forms.ValidationError("backoffMaxSeconds must be at least backoffSeconds")
        return data


def count_link(queue: Queue, status: Status) -> SafeString:
    n = capped_count(Item.objects.filter(queue_id=queue.pk, status=status))
    url = items_url(queue__id__exact=queue.pk, status__exact=status.value)
    return format_html(
        '<a class="th-count-{}" href="{}">{}</a>', status.value, url, capped_label(n)
    )


def age(queue: Queue) -> str:
    oldest = getattr(queue, "oldest_pending", None)
    if oldest is None:
        return "-"
    seconds = max(0, int((utcnow() - oldest).total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h"


@admin.register(Queue)
class QueueAdmin(admin.ModelAdmin):
    form = QueueForm
    list_display = (
        "name",
        "pending",
        "processing",
        "finished",
        "failed",
        "oldest_pending_age",
        "finished_5m",
        "failed_5m",
        "lease_seconds",
        "max_attempts",
        "dead_letter_queue",
    )
    sortable_by = ("name",)
    show_facets = admin.ShowFacets.NEVER
    readonly_fields = ("pending", "processing", "finished", "failed", "oldest_pending_age")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        if obj is None:
            return ()
        return ("name", *self.readonly_fields)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # deleting a queue is the API's DELETE /api/queues/{queue}

    def get_queryset(self, request: HttpRequest) -> QuerySet[Queue]:
        return with_stats(super().get_queryset(request).filter(deleting=False))

    def save_model(self, request: HttpRequest, obj: Queue, form: Any, change: bool) -> None:
        queue, _created = engine.upsert_queue(name=obj.name, body=form.wire_body())
        obj.pk = queue.pk
        obj.created_at = queue.created_at

    def get_urls(self) -> list[URLPattern]:
        extra = [
            path(
                "overview/",
                self.admin_site.admin_view(overview_view),
                name="taskhoster_overview",
            )
        ]
        return extra + super().get_urls()

    @admin.display(description="pending")
    def pending(self, obj: Queue) -> SafeString:
        return count_link(obj, Status.PENDING)

    @admin.display(description="processing")
    def processing(self, obj: Queue) -> SafeString:
        return count_link(obj, Status.PROCESSING)

    @admin.display(description="finished")
    def finished(self, obj: Queue) -> SafeString:
        return count_link(obj, Status.FINISHED)

    @admin.display(description="failed")
    def failed(self, obj: Queue) -> SafeString:
        return count_link(obj, Status.FAILED)

    @admin.display(description="oldest pending")
    def oldest_pending_age(self, obj: Queue) -> str:
        return age(obj)

    @admin.display(description="finished (5 min)")
    def finished_5m(self, obj: Queue) -> int:
        return getattr(obj, "recent_finished", None) or 0

    @admin.display(description="failed (5 min)")
    def failed_5m(self, obj: Queue) -> int:
        return getattr(obj, "recent_failed", None) or 0
