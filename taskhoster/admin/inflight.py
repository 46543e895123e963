"""Work in flight on the item pages (SPEC section 8.2): an item's attempts as the engine tells
them (``engine.attempts``, also behind the page's "History" button: Django's own history, the
admin's log, has nothing of items), its progress and cancel reason, and cancelling through
``engine.cancel``, one item from its page or those selected in the list, each behind the
confirmation page of the other item actions, with a report of what was not cancelled.

``WorkInFlightAdmin`` is the item admin's base class (``items.ItemAdmin``): the pages and the
action; the functions below it do the work and draw the tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .. import contract, engine
from ..errors import Conflict, ItemNotFound, TaskhosterError
from ..models import Item
from ..status import LIVE_STATUSES
from ..timeutil import now as utcnow
from ..timeutil import parse_wire
from . import live
from .common import (
    confirm_page,
    item_url,
    lease_left,
    progress_bar,
    status_counts,
    when,
)

# At most this many ids are named in a message; the rest are counted.
IDS_NAMED = 20
# A progress value in the item list: at most this many characters of its JSON (whole in
# its tooltip up to TOOLTIP_CHARS).
TOOLTIP_CHARS = 500

REASON_MAX_CHARS = contract.CANCEL_REASON_MAX_CHARS
# At most this many items are cancelled by one action (each is one engine call).
CANCEL_LIMIT = 10_000
CANCEL_NOTE = (
    "Only pending and processing items are cancelled: each fails now with the error "
    "“cancelled” (no dead-letter copy; its thread moves on), and a worker holding one "
    "is told to stop. Finished and failed items are left as they are."
)


class WorkInFlightAdmin(admin.ModelAdmin):
    """The item admin's pages and action for work in flight (a base class of ``ItemAdmin``)."""

    change_form_template = "admin/taskhoster/item/change_form.html"

    # Cancelling changes an item through the engine: Django's change permission for items,
    # as restarting does.
    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.change_item"))

    @admin.display(description="progress")
    def progress_shown(self, obj: Item) -> SafeString | str:
        return progress_block(obj.progress)

    @admin.display(description="lease")
    def lease_remaining(self, obj: Item) -> str:
        if obj.status != "processing":
            return "-"
        return lease_left(obj.lease_expires_at, utcnow())

    @admin.display(description="status")
    def status_column(self, obj: Item) -> SafeString | str:
        """The list's status; under it, the progress its worker last reported (if any), cut
        to the column's width (no column of its own: the list fits 1280 px as it is)."""
        label = obj.get_status_display()
        if obj.progress is None:
            return label
        return format_html("{}{}", label, progress_cell(obj.progress))

    @admin.display(description="attempts, oldest first")
    def attempt_history(self, obj: Item) -> SafeString | str:
        return attempts_table(obj.id)

    def get_urls(self) -> list[URLPattern]:
        extra = [
            path(
                "<str:object_id>/cancel/",
                self.admin_site.admin_view(self.cancel_view),
                name="taskhoster_item_cancel",
            ),
        ]
        return extra + super().get_urls()

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        running = Item.objects.filter(pk=unquote(object_id), status__in=LIVE_STATUSES).exists()
        extra = {
            **(extra_context or {}),
            "can_cancel": running and self.has_cancel_permission(request),
        }
        # The page is live: its script asks again for its tools and fields (``live``).
        response = super().change_view(request, object_id, form_url, extra_context=extra)
        return live.answer(request, response)

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The "History" button of an item's page: its attempts (the admin's log, Django's
        history, never has an entry for an item: every change goes through the engine)."""
        item_id = unquote(object_id)
        obj = None if "\x00" in item_id else self.get_object(request, item_id)
        if obj is None:
            return self._gone(request, object_id)
        if not self.has_view_or_change_permission(request, obj):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": f"History of item {obj.pk}",
            "subtitle": None,
            "opts": self.opts,
            "original": obj,
            "attempts": attempts_table(obj.pk),
            "progress": progress_block(obj.progress),
            "claimed_by": obj.claimed_by,
            "cancel_reason": obj.cancel_reason,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/taskhoster/item/history.html", context)

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The "Cancel" button of an item's page: the confirmation page, then (its POST)
        the cancel."""
        if not self.has_cancel_permission(request):
            raise PermissionDenied("cancelling items needs the permission to change items")
        item_id = unquote(object_id)
        found = Item.objects.filter(pk=item_id)
        if "\x00" in item_id or not found.exists():
            return self._gone(request, item_id)
        back = item_url(item_id)
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            self._cancel(request, [item_id])
            return HttpResponseRedirect(back)
        return confirm_page(
            self,
            request,
            action="",
            title="Cancel this item?",
            counts=status_counts(found),
            ids=None,
            note=CANCEL_NOTE,
            back=back,
            reason_max=REASON_MAX_CHARS,
        )

    @admin.action(description="Cancel selected items (through the engine)", permissions=["cancel"])
    def cancel_selected_items(
        self, request: HttpRequest, queryset: QuerySet[Item]
    ) -> HttpResponse | None:
        ids = list(queryset.order_by("id").values_list("id", flat=True)[: CANCEL_LIMIT + 1])
        if len(ids) > CANCEL_LIMIT:
            self.message_user(request, "Too many items for one action.", messages.ERROR)
            return None
        if request.POST.get("confirm") != "yes":
            return confirm_page(
                self,
                request,
                action="cancel_selected_items",
                title="Cancel these items?",
                counts=status_counts(Item.objects.filter(id__in=ids)),
                ids=ids,
                note=CANCEL_NOTE,
                reason_max=REASON_MAX_CHARS,
            )
        self._cancel(request, ids)
        return None

    def _gone(self, request: HttpRequest, item_id: str) -> HttpResponse:
        """To the item list, saying the item is not there (deleted, or never was)."""
        self.message_user(request, f"Item {item_id} does not exist.", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:taskhoster_item_changelist"))

    def _cancel(self, request: HttpRequest, ids: list[str]) -> None:
        try:
            reason = clean_reason(request.POST.get("reason"))
        except TaskhosterError as exc:
            self.message_user(request, f"Nothing cancelled: {exc.message}", messages.ERROR)
            return
        for level, text in cancel_items(ids, reason=reason).notes():
            self.message_user(request, text, level)


def clean_reason(raw: str | None) -> str | None:
    """The reason typed on a confirmation page, checked as the API checks it (a
    ``TaskhosterError`` when too long); empty means none."""
    reason = (raw or "").strip() or None
    contract.validate(contract.CANCEL, {"reason": reason})
    return reason


@dataclass
class CancelReport:
    """What a cancel of some items did: cancelled, already terminal, gone, refused otherwise."""

    cancelled: list[str] = field(default_factory=list)
    terminal: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)

    def notes(self) -> list[tuple[int, str]]:
        """(level, text) for each thing to say: how many were cancelled, and which were not."""
        said: list[tuple[int, str]] = []
        level = messages.SUCCESS if self.cancelled else messages.WARNING
        said.append((level, f"Cancelled {len(self.cancelled)} item(s)."))
        if self.terminal:
            said.append(
                (
                    messages.WARNING,
                    f"Not cancelled, already finished or failed: {len(self.terminal)} "
                    f"item(s): {named(self.terminal)}.",
                )
            )
        if self.gone:
            said.append(
                (
                    messages.WARNING,
                    f"Not cancelled, no longer there: {len(self.gone)} item(s): "
                    f"{named(self.gone)}.",
                )
            )
        for item_id, reason in self.refused[:IDS_NAMED]:
            said.append((messages.ERROR, f"Not cancelled: {item_id}: {reason}"))
        return said


def named(ids: list[str]) -> str:
    shown = ", ".join(ids[:IDS_NAMED])
    more = len(ids) - IDS_NAMED
    return f"{shown} and {more} more" if more > 0 else shown


def cancel_items(item_ids: list[str], *, reason: str | None) -> CancelReport:
    """Cancel each item through the engine (a socket holding one is told to stop)."""
    report = CancelReport()
    for item_id in item_ids:
        try:
            engine.cancel(item_id=item_id, reason=reason)
        except Conflict as exc:
            if exc.code == "terminal":
                report.terminal.append(item_id)
            else:
                report.refused.append((item_id, exc.message))
        except ItemNotFound:
            report.gone.append(item_id)
        except TaskhosterError as exc:
            report.refused.append((item_id, exc.message))
        else:
            report.cancelled.append(item_id)
    return report


# -- the attempts, the progress -------------------------------------------------------------


def _time(value: Any) -> SafeString | str:
    if not value:
        return "-"
    try:
        return when(parse_wire(value))
    except ValueError:
        return str(value)


def _attempt_row(entry: dict[str, Any]) -> tuple[Any, ...]:
    outcome = entry.get("outcome")
    return (
        outcome or "running",
        entry.get("attempt", "-"),
        entry.get("worker") or "-",
        _time(entry.get("claimedAt")),
        _time(entry.get("endedAt")),
        outcome or "(running)",
        entry.get("error") or "-",
    )


ATTEMPT_ROW = (
    '<tr class="th-attempt th-outcome-{}"><td class="th-attempt-n">{}</td>'
    '<td class="th-attempt-worker">{}</td><td>{}</td><td>{}</td>'
    '<td class="th-attempt-outcome">{}</td><td class="th-attempt-error">{}</td></tr>'
)


def attempts_table(item_id: str) -> SafeString | str:
    """The item's attempts, oldest first (``engine.attempts``): a table, after a line saying
    how many were omitted (the engine keeps the first ones and the latest of a long story)."""
    try:
        story, omitted = engine.attempts(item_id=item_id)
    except ItemNotFound:
        return "(file missing)"
    if not story:
        return format_html('<p id="th-attempts-none">{}</p>', "No attempts yet.")
    note = (
        format_html(
            '<p class="th-omitted">{} omitted (between the first attempts and the latest '
            "shown here)</p>",
            omitted,
        )
        if omitted
        else ""
    )
    return format_html(
        '{}<table id="th-attempts"><thead><tr><th>attempt</th><th>worker</th><th>claimed</th>'
        "<th>ended</th><th>outcome</th><th>error</th></tr></thead><tbody>{}</tbody></table>",
        note,
        format_html_join("", ATTEMPT_ROW, (_attempt_row(entry) for entry in story)),
    )


def progress_block(value: Any) -> SafeString | str:
    """An item's latest progress, as its worker reported it: a bar when it says how far (a
    fraction, or ``{done, of}``), and its JSON; "-" when none was reported."""
    if value is None:
        return "-"
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return format_html('{}<pre class="th-json th-progress">{}</pre>', progress_bar(value), text)


def progress_cell(value: Any) -> SafeString:
    """The progress in a line of the item list (cut to its column by the list's style), whole
    (up to a point) in its tooltip."""
    text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    tip = text if len(text) <= TOOLTIP_CHARS else text[:TOOLTIP_CHARS] + "…"
    return format_html(
        '<span class="th-progress-line" title="progress: {}">{}</span>', tip, text[:80]
    )
