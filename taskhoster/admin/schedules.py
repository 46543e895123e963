"""Schedules (SPEC section 8.3): the list (each schedule's timing, next and last slot, last
item), a page to create or edit one, and pause, resume and delete.

Every change goes through the engine (``engine.put_schedule``, ``engine.delete_schedule``),
never a save of the row: the engine bumps the schedule's ``rev`` and computes its next slot,
which is what keeps each slot posted exactly once while a sweep runs. The form is checked
by the engine itself (its put with ``check_only``, which changes nothing), so what the API
refuses the page shows as the field's error; the admin then saves it with one put. Pause
and resume (the list's actions, the buttons of a schedule's page) need the change
permission; delete (Django's action and button, with its confirmation page) the delete
permission.
"""

from __future__ import annotations

import contextlib
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from .. import engine
from ..errors import NotFound, TaskhosterError
from ..models import Queue, Schedule
from .common import PAUSED_BADGE, CappedPaginator, item_link, number, paginator_for, when

# The list's queue filter: the parameter of the item list's, so a link reads the same.
QUEUE_PARAM = "queue__id__exact"
# The form's fields, by the wire names the engine takes.
FIELD_TO_WIRE = {
    "cron": "cron",
    "every": "every",
    "timezone": "timezone",
    "payload": "payload",
    "thread_id": "threadId",
    "priority": "priority",
    "overlap": "overlap",
    "catchup_seconds": "catchupSeconds",
    "paused": "paused",
}
WIRE_TO_FIELD = {wire: field for field, wire in FIELD_TO_WIRE.items()}
TIMING_FIELDS = ("cron", "every", "timezone")
NOW_FIELDS = ("next_slot", "last_slot_shown", "last_item_link", "rev", "created", "updated")


def error_field(message: str) -> str | None:
    """The form field an engine message is about (it starts with the wire name)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if first in WIRE_TO_FIELD:
        return WIRE_TO_FIELD[first]
    if "timezone" in message:
        return "timezone"
    if message.startswith("a schedule name"):
        return "name"
    if message.startswith("queue "):
        return "queue"
    return None


class ScheduleForm(forms.ModelForm):
    class Meta:
        model = Schedule
        fields = ["queue", "name", *FIELD_TO_WIRE]
        widgets = {"payload": forms.Textarea(attrs={"rows": 6, "cols": 60})}
        help_texts = {
            "cron": "Five cron fields (minute hour day-of-month month day-of-week), read in "
            "the timezone below. Give cron or every, not both.",
            "every": "Seconds between slots, counted from the Unix epoch (3600: the top of "
            "each UTC hour).",
            "timezone": "The IANA timezone a cron is read in (Europe/Berlin).",
            "payload": "Each slot's item's payload, as JSON.",
            "overlap": "skip: a slot posts nothing while the previous item is not finished "
            "or failed.",
            "catchup_seconds": "A slot found late is posted if at most this late; later, "
            "it is skipped.",
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "queue" in self.fields:
            field = self.fields["queue"]
            assert isinstance(field, forms.ModelChoiceField)
            field.queryset = Queue.objects.filter(deleting=False).order_by("name")

    @property
    def adding(self) -> bool:
        return self.instance.pk is None

    def names(self) -> tuple[str, str]:
        """The queue and schedule names the form is about."""
        if not self.adding:
            return self.instance.queue.name, self.instance.name
        queue = self.cleaned_data.get("queue")
        return (queue.name if queue is not None else ""), self.cleaned_data.get("name", "")

    def wire_body(self) -> dict[str, Any]:
        """What to put: every field of a new schedule, the fields changed on the form of an
        existing one (a pause made elsewhere since the page loaded is not undone). The
        timing is sent as cron or every, whichever is set (the engine clears the other)."""
        data = self.cleaned_data
        changed = set(FIELD_TO_WIRE) if self.adding else set(self.changed_data)
        body = {
            FIELD_TO_WIRE[f]: data.get(f)
            for f in FIELD_TO_WIRE
            if f in changed and f not in ("cron", "every")
        }
        if changed & {"cron", "every"}:
            if data.get("cron"):
                body["cron"] = data["cron"]
            elif data.get("every") is not None:
                body["every"] = data["every"]
        return body

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        cron, every = data.get("cron"), data.get("every")
        if cron and every is not None:
            raise forms.ValidationError("Give cron or every, not both.")
        if not cron and every is None:
            raise forms.ValidationError("A schedule needs cron or every.")
        queue_name, name = self.names()
        if self.adding and Schedule.objects.filter(queue__name=queue_name, name=name).exists():
            self.add_error("name", "This queue already has a schedule of this name.")
            return data
        body = self.wire_body()
        if not body:
            return data
        try:
            # The engine's own checks, changing nothing (the admin puts it once valid).
            engine.put_schedule(queue_name, name, body, check_only=True)
        except TaskhosterError as exc:
            field = error_field(exc.message)
            if field in self.fields:
                self.add_error(field, forms.ValidationError(exc.message, code=exc.code))
            else:
                raise forms.ValidationError(exc.message, code=exc.code) from None
        return data


class QueueFilter(admin.SimpleListFilter):
    """One queue (``?queue__id__exact=<id>``, as the item list and the queue's page link to
    it). Offers the queues with schedules; the queue chosen stays offered, so a stale or
    bad id is never silently dropped (Django's filter ignores one it has no choice for)."""

    title = "queue"
    parameter_name = QUEUE_PARAM

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        rows = (
            Queue.objects.filter(deleting=False, schedules__isnull=False)
            .distinct()
            .order_by("name")
            .values_list("id", "name")
        )
        choices = [(str(pk), name) for pk, name in rows]
        chosen = self.value()
        if chosen is not None and chosen not in {c for c, _ in choices}:
            choices.append((chosen, "(no schedules)"))
        return choices

    def queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> QuerySet[Schedule]:
        value = self.value()
        if value is None:
            return queryset
        try:
            queue_id = int(value)
        except ValueError:
            raise IncorrectLookupParameters("a queue id is a number") from None
        if not 0 < queue_id < 2**63:
            return queryset.none()
        return queryset.filter(queue_id=queue_id)


def flip(schedules: list[tuple[str, str]], paused: bool) -> tuple[int, list[str]]:
    """Pause or resume the schedules named ``(queue, name)`` through the engine: how many
    were, and the messages of those that could not be (gone meanwhile)."""
    done, failed = 0, []
    for queue_name, name in schedules:
        try:
            engine.put_schedule(queue_name, name, {"paused": paused})
        except TaskhosterError as exc:
            failed.append(exc.message)
        else:
            done += 1
    return done, failed


@admin.register(Schedule)
class ScheduleAdmin(admin.ModelAdmin):
    form = ScheduleForm
    list_display = (
        "queue_name",
        "name",
        "timing",
        "next_slot",
        "last_slot_shown",
        "last_item_link",
        "overlap",
        "catchup",
    )
    list_filter = (QueueFilter, "paused")
    search_fields = ("name",)
    search_help_text = "A schedule's name, or part of it."
    ordering = ("queue__name", "name")
    sortable_by = ("queue_name", "name", "next_slot", "last_slot_shown")
    show_facets = admin.ShowFacets.NEVER
    show_full_result_count = False
    paginator = CappedPaginator
    actions = ["pause_schedules", "resume_schedules"]
    readonly_fields = NOW_FIELDS

    def get_paginator(
        self, request: HttpRequest, queryset: Any, per_page: int, *args: Any, **kw: Any
    ) -> CappedPaginator:
        return paginator_for(request, queryset, per_page)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        return super().get_queryset(request).select_related("queue").filter(queue__deleting=False)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Schedule], search_term: str
    ) -> tuple[QuerySet[Schedule], bool]:
        if "\x00" in search_term:  # no name holds one (PostgreSQL refuses to look)
            return queryset.none(), False
        return super().get_search_results(request, queryset, search_term)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        if obj is None:
            return ()
        return ("queue", "name", *NOW_FIELDS)

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> list[tuple[Any, Any]]:
        fieldsets: list[tuple[Any, Any]] = [
            (None, {"fields": ["queue", "name"]}),
            ("When", {"fields": list(TIMING_FIELDS)}),
            ("Each slot's item", {"fields": ["payload", "thread_id", "priority"]}),
            ("Running", {"fields": ["overlap", "catchup_seconds", "paused"]}),
        ]
        if obj is not None:
            fieldsets.append(("Now", {"fields": list(NOW_FIELDS)}))
        return fieldsets

    # -- saving and deleting: through the engine ------------------------------------------

    def save_model(self, request: HttpRequest, obj: Schedule, form: Any, change: bool) -> None:
        queue_name, name = form.names()
        body = form.wire_body()
        if change and not body:
            return  # nothing changed: no put, no new rev
        schedule, _created = engine.put_schedule(queue_name, name, body)
        obj.pk = schedule.pk
        for field in ("rev", "next_at", "created_at", "updated_at", "salt"):
            setattr(obj, field, getattr(schedule, field))

    def delete_model(self, request: HttpRequest, obj: Schedule) -> None:
        with contextlib.suppress(NotFound):  # gone already: done
            engine.delete_schedule(obj.queue.name, obj.name)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        for queue_name, name in queryset.order_by().values_list("queue__name", "name"):
            with contextlib.suppress(NotFound):
                engine.delete_schedule(queue_name, name)

    # -- pause and resume: the list's actions and the buttons of a schedule's page ----------

    def _report(self, request: HttpRequest, verb: str, done: int, failed: list[str]) -> None:
        self.message_user(request, f"{verb} {done} schedule(s).", messages.SUCCESS)
        if failed:
            self.message_user(
                request,
                f"{len(failed)} could not be: {'; '.join(failed[:3])}",
                messages.WARNING,
            )

    @admin.action(description="Pause selected schedules", permissions=["change"])
    def pause_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        names = list(queryset.filter(paused=False).values_list("queue__name", "name"))
        self._report(request, "Paused", *flip(names, True))

    @admin.action(description="Resume selected schedules", permissions=["change"])
    def resume_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        names = list(queryset.filter(paused=True).values_list("queue__name", "name"))
        self._report(request, "Resumed", *flip(names, False))

    def get_urls(self) -> list[URLPattern]:
        extra = [
            path(
                "<int:object_id>/pause/",
                self.admin_site.admin_view(self.pause_view),
                name="taskhoster_schedule_pause",
            ),
            path(
                "<int:object_id>/resume/",
                self.admin_site.admin_view(self.resume_view),
                name="taskhoster_schedule_resume",
            ),
        ]
        return extra + super().get_urls()

    def _flip(self, request: HttpRequest, object_id: int, paused: bool) -> HttpResponse:
        if not self.has_change_permission(request):
            raise PermissionDenied("pausing or resuming a schedule needs the change permission")
        schedule = (
            self.get_queryset(request).filter(pk=object_id).first()
            if 0 < object_id < 2**63
            else None
        )
        if schedule is None:
            raise Http404("no such schedule")
        _done, failed = flip([(schedule.queue.name, schedule.name)], paused)
        if failed:
            self.message_user(request, failed[0], messages.ERROR)
        else:
            self.message_user(
                request,
                f"Schedule “{schedule.name}” {'paused' if paused else 'resumed'}.",
                messages.SUCCESS,
            )
        return HttpResponseRedirect(reverse("admin:taskhoster_schedule_change", args=[schedule.pk]))

    def pause_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        return require_POST(self._flip)(request, object_id, True)

    def resume_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        return require_POST(self._flip)(request, object_id, False)

    # -- the columns ----------------------------------------------------------------------

    @admin.display(description="queue", ordering="queue__name")
    def queue_name(self, obj: Schedule) -> SafeString:
        url = reverse("admin:taskhoster_queue_change", args=[obj.queue_id])
        return format_html('<a href="{}">{}</a>', url, obj.queue.name)

    @admin.display(description="timing")
    def timing(self, obj: Schedule) -> SafeString | str:
        if obj.cron:
            return format_html("<code>{}</code> ({})", obj.cron, obj.timezone)
        if obj.every is not None:
            return f"every {obj.every} s"
        return "-"

    @admin.display(description="next slot", ordering="next_at")
    def next_slot(self, obj: Schedule) -> SafeString | str:
        if obj.paused:
            return SafeString(PAUSED_BADGE)
        return when(obj.next_at)

    @admin.display(description="last slot", ordering="last_slot")
    def last_slot_shown(self, obj: Schedule) -> SafeString | str:
        return when(obj.last_slot)

    @admin.display(description="last item")
    def last_item_link(self, obj: Schedule) -> SafeString | str:
        return item_link(obj.last_item)

    @admin.display(description="catch-up")
    def catchup(self, obj: Schedule) -> str:
        return f"{number(obj.catchup_seconds)} s"

    @admin.display(description="created")
    def created(self, obj: Schedule) -> SafeString | str:
        return when(obj.created_at)

    @admin.display(description="updated")
    def updated(self, obj: Schedule) -> SafeString | str:
        return when(obj.updated_at)
