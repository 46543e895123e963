"""Queues: create and edit settings with the API's validation (saved by ``engine.upsert_queue``
so ``queue.json`` is written too), live counts per status linking to the item list, the age
of the oldest pending item and what finished or failed in the last five minutes.

Flow control (SPEC section 8.1): the queue list shows each queue's controls at a glance (a
"paused" badge, the limits set) and pauses or resumes the queues selected; a queue's page
edits the controls (``rateLimit`` as two small fields, count and seconds), shows what waits
only because of one (``engine.held_for``) and has a pause or resume button. Every change goes
through ``engine.upsert_queue``, which wakes the waiting workers of every process."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from .. import engine
from ..errors import InvalidInput
from ..models import Item, Queue, Schedule
from ..status import Status
from ..timeutil import now as utcnow
from . import live
from .common import (
    capped_count,
    capped_label,
    flow_summary,
    items_url,
    with_counts,
    with_stats,
)
from .overview import overview_view

FIELD_TO_WIRE = {field: wire for wire, field in engine.WIRE_TO_FIELD.items()}
# The settings of the "Flow control" box (SPEC section 8.1); every other setting is above it.
FLOW_FIELDS = ("paused", "max_processing", "rate_limit", "thread_limit")
# ``rateLimit`` (``{"count": N, "seconds": S}`` or null) is edited as these two fields.
RATE_FIELDS = ("rate_count", "rate_seconds")
# A message of ``engine.clean_settings`` starts with the wire name it is about: shown there.
MESSAGE_FIELD = {
    **{wire: field for field, wire in FIELD_TO_WIRE.items()},
    "rateLimit": "rate_count",
    "rateLimit.count": "rate_count",
    "rateLimit.seconds": "rate_seconds",
}
STAT_FIELDS = ("pending", "processing", "finished", "failed", "oldest_pending_age")


class QueueForm(forms.ModelForm):
    rate_count = forms.IntegerField(
        required=False,
        label="Rate limit: claims",
        help_text="At most this many claims of the queue's items start in any window of the "
        "seconds below, across every server process. Both empty = no limit.",
    )
    rate_seconds = forms.FloatField(
        required=False,
        label="per seconds",
        help_text="The rate limit's window, in seconds (more than 0, at most a day).",
    )

    class Meta:
        model = Queue
        fields = ["name", *(f for f in FIELD_TO_WIRE if f != "rate_limit")]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each field carries the value the page showed (a hidden input): what was changed
        # on the form is told against that, not against the row as it is at the save. A
        # post without them (a script's) is told against the row.
        shown = not self.is_bound or any(str(k).startswith("initial-") for k in self.data)
        for field in self.fields.values():
            field.show_hidden_initial = shown
        rate = self.instance.rate_limit if self.instance.pk else None
        if isinstance(rate, dict):
            self.initial.setdefault("rate_count", rate.get("count"))
            self.initial.setdefault("rate_seconds", rate.get("seconds"))

    def rate_limit(self) -> dict[str, Any] | None:
        """The wire ``rateLimit`` of the two fields: null when both are empty."""
        count = self.cleaned_data.get("rate_count")
        seconds = self.cleaned_data.get("rate_seconds")
        if count is None and seconds is None:
            return None
        return {"count": count, "seconds": seconds}

    def wire_body(self) -> dict[str, Any]:
        data = self.cleaned_data
        body = {FIELD_TO_WIRE[f]: data.get(f) for f in FIELD_TO_WIRE if f in data}
        if body.get("deadLetterQueue") == "":
            body["deadLetterQueue"] = None
        if "rate_count" in self.fields:
            body["rateLimit"] = self.rate_limit()
        return body

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        if "rate_count" in self.fields:
            count, seconds = data.get("rate_count"), data.get("rate_seconds")
            if (count is None) != (seconds is None):
                missing = "rate_count" if count is None else "rate_seconds"
                self.add_error(
                    missing,
                    "rateLimit needs both a count and seconds (both empty for no limit)",
                )
                return data
        name = self.instance.name if self.instance.pk else data.get("name", "")
        try:
            engine.validate_queue_name(name)
            values = engine.clean_settings(name, self.wire_body())
        except InvalidInput as exc:
            field = MESSAGE_FIELD.get(exc.message.split(" ", 1)[0])
            if field in self.fields:
                self.add_error(field, forms.ValidationError(exc.message, code=exc.code))
                return data
            raise forms.ValidationError(exc.message, code=exc.code) from None
        if values.get("backoff_max_seconds", 0) < values.get("backoff_seconds", 0):
            raise forms.ValidationError("backoffMaxSeconds must be at least backoffSeconds")
        return data


def set_paused(names: list[str], paused: bool) -> None:
    """Pause or resume the queues named, through the engine (which wakes waiting workers)."""
    for name in names:
        engine.upsert_queue(name=name, body={"paused": paused})


def schedules_link(request: HttpRequest, queue: Queue) -> dict[str, Any]:
    """The queue page's "Schedules (N)" link to the schedule list filtered to the queue, for
    those who may see schedules."""
    if not (
        request.user.has_perm("taskhoster.view_schedule")
        or request.user.has_perm("taskhoster.change_schedule")
    ):
        return {}
    url = reverse("admin:taskhoster_schedule_changelist") + f"?queue__id__exact={queue.pk}"
    return {
        "schedules_url": url,
        "schedules_count": Schedule.objects.filter(queue_id=queue.pk).count(),
    }


def count_link(queue: Queue, status: Status) -> SafeString:
    """How many of ``queue``'s items have ``status``, linked to the item list filtered so:
    from the counts the commits keep when the page fetched them for every queue at once
    (``with_counts``: one query for a thousand queues), else counted here (capped)."""
    kept = getattr(queue, "status_counts", None)
    if kept is not None:
        label = str(kept.get(status.value, 0))
    else:
        label = capped_label(capped_count(Item.objects.filter(queue_id=queue.pk, status=status)))
    url = items_url(queue__id__exact=queue.pk, status__exact=status.value)
    return format_html('<a class="th-count-{}" href="{}">{}</a>', status.value, url, label)


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


class CountedChangeList(ChangeList):
    """The queue list, its page's queues each with their counts per status (one query)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        self.result_list = with_counts(list(self.result_list))


@admin.register(Queue)
class QueueAdmin(admin.ModelAdmin):
    form = QueueForm
    list_display = (
        "name",
        "flow",
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
    readonly_fields = (*STAT_FIELDS, "held")
    actions = ["pause_queues", "resume_queues"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        if obj is None:
            return ()
        return ("name", *self.readonly_fields)

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> list[tuple[Any, Any]]:
        general = [f for f in FIELD_TO_WIRE if f not in FLOW_FIELDS]
        flow = [RATE_FIELDS if f == "rate_limit" else f for f in FLOW_FIELDS]
        fieldsets: list[tuple[Any, Any]] = [
            (None, {"fields": ["name", *general]}),
            (
                "Flow control",
                {
                    "fields": flow,
                    "description": "While paused, nothing of the queue is handed out; posts, "
                    "results and every clock go on. The limits hold items back without "
                    "costing them an attempt.",
                },
            ),
        ]
        if obj is not None:
            fieldsets.append(("Now", {"fields": [*STAT_FIELDS, "held"]}))
        return fieldsets

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # deleting a queue is the API's DELETE /api/queues/{queue}

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return CountedChangeList

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        queue = super().get_object(request, object_id, from_field)
        return with_counts([queue])[0] if queue is not None else None

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """A queue's page, live: its counts, what is held back, the paused note and the pause
        button are redrawn about once a second (``live``); the form is left as typed."""
        response = super().change_view(request, object_id, form_url, extra_context)
        return live.answer(request, response)

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        if obj is not None and obj.pk is not None:
            context.update(schedules_link(request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Queue]:
        return with_stats(super().get_queryset(request).filter(deleting=False))

    def save_model(self, request: HttpRequest, obj: Queue, form: Any, change: bool) -> None:
        body = form.wire_body()
        if change:
            # Only what was changed on the form: a setting changed elsewhere since the page
            # loaded (a pause from the list or the API, say) is not put back.
            changed = {FIELD_TO_WIRE[f] for f in form.changed_data if f in FIELD_TO_WIRE}
            if set(RATE_FIELDS) & set(form.changed_data):
                changed.add("rateLimit")
            body = {wire: value for wire, value in body.items() if wire in changed}
        queue, _created = engine.upsert_queue(name=obj.name, body=body)
        obj.pk = queue.pk
        obj.created_at = queue.created_at

    def get_urls(self) -> list[URLPattern]:
        extra = [
            path(
                "overview/",
                self.admin_site.admin_view(overview_view),
                name="taskhoster_overview",
            ),
            path(
                "<int:object_id>/pause/",
                self.admin_site.admin_view(self.pause_view),
                name="taskhoster_queue_pause",
            ),
            path(
                "<int:object_id>/resume/",
                self.admin_site.admin_view(self.resume_view),
                name="taskhoster_queue_resume",
            ),
        ]
        return extra + super().get_urls()

    # Pause and resume: the list's actions and the buttons of a queue's page (a POST each,
    # CSRF-checked by the admin site's view wrapper), all needing the change permission.
    @admin.action(description="Pause selected queues", permissions=["change"])
    def pause_queues(self, request: HttpRequest, queryset: QuerySet[Queue]) -> None:
        names = list(queryset.order_by("name").values_list("name", flat=True))
        set_paused(names, True)
        self.message_user(
            request,
            f"Paused {len(names)} queue(s): nothing of them is handed out until resumed.",
            messages.SUCCESS,
        )

    @admin.action(description="Resume selected queues", permissions=["change"])
    def resume_queues(self, request: HttpRequest, queryset: QuerySet[Queue]) -> None:
        names = list(queryset.order_by("name").values_list("name", flat=True))
        set_paused(names, False)
        self.message_user(request, f"Resumed {len(names)} queue(s).", messages.SUCCESS)

    def _flip(self, request: HttpRequest, object_id: int, paused: bool) -> HttpResponse:
        if not self.has_change_permission(request):
            raise PermissionDenied("pausing or resuming a queue needs the permission to change it")
        queue = Queue.objects.filter(pk=object_id, deleting=False).first()
        if queue is None:
            raise Http404("no such queue")
        set_paused([queue.name], paused)
        done = "paused: nothing of it is handed out until resumed" if paused else "resumed"
        self.message_user(request, f"Queue “{queue.name}” {done}.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:taskhoster_queue_change", args=[queue.pk]))

    def pause_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        return require_POST(self._flip)(request, object_id, True)

    def resume_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        return require_POST(self._flip)(request, object_id, False)

    @admin.display(description="flow control")
    def flow(self, obj: Queue) -> SafeString | str:
        return flow_summary(obj)

    @admin.display(description="held back now")
    def held(self, obj: Queue) -> SafeString:
        """Due pending items that wait only because of a control (``engine.held_for``)."""
        counts = engine.held_for(obj.name).wire()
        return live.region("held", self._held_table(counts))

    def _held_table(self, counts: dict[str, int]) -> SafeString:
        return format_html(
            '<table id="th-held"><thead><tr><th>control</th><th>items held</th></tr></thead>'
            "<tbody>{}</tbody></table>",
            format_html_join(
                "",
                '<tr><td>{}</td><td class="th-held-{}">{}</td></tr>',
                ((HELD_LABELS.get(c, c), c, n) for c, n in counts.items()),
            ),
        )

    @admin.display(description="pending")
    def pending(self, obj: Queue) -> SafeString:
        return live.region("pending", count_link(obj, Status.PENDING))

    @admin.display(description="processing")
    def processing(self, obj: Queue) -> SafeString:
        return live.region("processing", count_link(obj, Status.PROCESSING))

    @admin.display(description="finished")
    def finished(self, obj: Queue) -> SafeString:
        return live.region("finished", count_link(obj, Status.FINISHED))

    @admin.display(description="failed")
    def failed(self, obj: Queue) -> SafeString:
        return live.region("failed", count_link(obj, Status.FAILED))

    @admin.display(description="oldest pending")
    def oldest_pending_age(self, obj: Queue) -> SafeString:
        return live.region("oldest", age(obj))

    @admin.display(description="finished (5 min)")
    def finished_5m(self, obj: Queue) -> int:
        return getattr(obj, "recent_finished", None) or 0

    @admin.display(description="failed (5 min)")
    def failed_5m(self, obj: Queue) -> int:
        return getattr(obj, "recent_failed", None) or 0


HELD_LABELS = {
    "paused": "paused",
    "maxProcessing": "maxProcessing (at its cap)",
    "rateLimit": "rateLimit (window full)",
    "thread": "thread (threadLimit, or behind its thread's heads)",
}
