"""Helpers shared by the admin pages: a paginator that never counts a huge table, each queue's
figures of the last minutes and its flow control at a glance (the queue list and the overview
show them), links, times to the second, and the confirmation page of the item actions."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .. import engine
from ..models import Item, Queue
from ..status import LIVE_STATUSES, TERMINAL_STATUSES, Status
from ..timeutil import now as utcnow

# Counts made here (never the kept per-queue counts) stop at this many rows ("10000+").
COUNT_CAP = 10_000
# A page number past this is taken as this one (a database refuses an offset of 20 digits).
MAX_PAGE = 1_000_000
# A list counts only this many pages past the one asked for.
PAGES_AHEAD = 10
# What finished or failed this recently is shown per queue.
RECENT = timedelta(minutes=5)


def capped_count(queryset: Any, cap: int = COUNT_CAP) -> int:
    """``min(count, cap + 1)``, counting no more than ``cap + 1`` rows."""
    return int(queryset.order_by().values("pk")[: cap + 1].count())


def capped_label(n: int, cap: int = COUNT_CAP) -> str:
    return f"{cap}+" if n > cap else str(n)


class CappedPaginator(Paginator):
    """Counts no further than ``PAGES_AHEAD`` pages past the requested one, so a page of a
    million-row list never counts the table. Later pages appear as one pages on."""

    cap = PAGES_AHEAD * 100

    @cached_property
    def count(self) -> int:
        return capped_count(self.object_list, self.cap)


def paginator_for(request: Any, queryset: Any, per_page: int) -> CappedPaginator:
    try:
        page = min(max(1, int(request.GET.get("p", 1))), MAX_PAGE)
    except ValueError:
        page = 1
    paginator = CappedPaginator(queryset, per_page)
    paginator.cap = (page + PAGES_AHEAD) * per_page
    return paginator


def status_in(statuses: tuple[Status, ...]) -> str:
    """``status IN ('a', 'b')`` as literal SQL (the values are the enum's, never input).

    A partial index (``item_age_clock``, ``item_retain_finished``) is only usable on SQLite
    when the query repeats its condition literally; Django would send the values as
    parameters, which the planner cannot match.
    """
    return "status IN ({})".format(", ".join(f"'{s.value}'" for s in statuses))


def _recent(status: Status, since: Any) -> Subquery:
    rows = (
        Item.objects.filter(queue=OuterRef("pk"), finished_at__gte=since)
        .extra(where=[status_in(TERMINAL_STATUSES)])
        .filter(status=status)
        .order_by()
        .values("queue")
        .annotate(n=Count("id"))
        .values("n")
    )
    return Subquery(rows, output_field=IntegerField())


def _oldest_pending() -> Subquery:
    # The literal status IN (live) matches the partial index item_age_clock.
    rows = (
        Item.objects.filter(queue=OuterRef("pk"))
        .extra(where=[status_in(LIVE_STATUSES)])
        .filter(status=Status.PENDING)
        .order_by("posted_at")
        .values("posted_at")[:1]
    )
    return Subquery(rows)


def with_stats(queryset: QuerySet[Queue]) -> QuerySet[Queue]:
    """``queryset`` with each queue's finished and failed items of the last ``RECENT``
    (``recent_finished``, ``recent_failed``) and its oldest pending item's post time
    (``oldest_pending``)."""
    since = utcnow() - RECENT
    return queryset.annotate(
        recent_finished=_recent(Status.FINISHED, since),
        recent_failed=_recent(Status.FAILED, since),
        oldest_pending=_oldest_pending(),
    )


# The "paused" badge: the admin's own warning colours, so it reads in light and dark themes.
PAUSED_BADGE = (
    '<span class="th-paused" style="display:inline-block;padding:0 6px;border-radius:8px;'
    "background:var(--message-warning-bg);color:var(--body-fg);font-weight:bold;"
    'text-transform:uppercase;font-size:0.6875rem;white-space:nowrap">paused</span>'
)


def number(value: float) -> str:
    """``2`` for 2.0, ``0.5`` for 0.5: a setting as the API shows it."""
    return f"{value:g}"


def flow_limits(queue: Queue) -> list[tuple[str, str]]:
    """The flow-control limits set on ``queue`` (SPEC section 8.1), by their wire names:
    ``maxProcessing``, ``rateLimit`` and ``threadLimit`` when not at their defaults."""
    limits: list[tuple[str, str]] = []
    if queue.max_processing is not None:
        limits.append(("maxProcessing", str(queue.max_processing)))
    rate = queue.rate_limit
    if isinstance(rate, dict) and {"count", "seconds"} <= set(rate):
        limits.append(("rateLimit", f"{rate['count']} per {number(rate['seconds'])} s"))
    if queue.thread_limit != 1:
        limits.append(("threadLimit", str(queue.thread_limit)))
    return limits


def flow_summary(queue: Queue) -> SafeString | str:
    """``queue``'s flow control at a glance: a "paused" badge when it is paused, then the
    limits set; "-" when nothing holds it back."""
    parts = [SafeString(PAUSED_BADGE)] if queue.paused else []
    parts += [
        format_html(
            '<span class="th-limit" style="display:block;white-space:nowrap">{} {}</span>',
            wire,
            value,
        )
        for wire, value in flow_limits(queue)
    ]
    if not parts:
        return "-"
    return format_html(
        '<span class="th-flow">{}</span>', format_html_join("", "{}", ((p,) for p in parts))
    )


def item_url(item_id: str) -> str:
    return reverse("admin:taskhoster_item_change", args=[item_id])


def item_link(item_id: str | None) -> SafeString | str:
    if not item_id:
        return "-"
    return format_html('<a href="{}">{}</a>', item_url(item_id), item_id)


def items_url(**filters: Any) -> str:
    return reverse("admin:taskhoster_item_changelist") + "?" + urlencode(filters)


def when(value: datetime | None) -> SafeString | str:
    """A time to the second, as Taskhoster's admin pages show every time: ``2026-11-30
    15:13:07`` in the current time zone (UTC unless the project sets another), the exact
    instant in its tooltip. Django's own format ("Nov. 30, 2026, 3:13 p.m.") has no seconds,
    too few for leases of seconds."""
    if value is None:
        return "-"
    local = timezone.localtime(value)
    return format_html(
        '<time class="th-time" datetime="{}" title="{}">'
        '<span class="th-date">{}</span> <span class="th-clock">{}</span></time>',
        local.isoformat(),
        f"{local.isoformat(sep=' ')} ({local.tzname()})",
        local.strftime("%Y-%m-%d"),
        local.strftime("%H:%M:%S"),
    )


def time_column(field: str) -> Callable[[Any, Any], SafeString | str]:
    """A ModelAdmin column or read-only field showing ``field`` with ``when``, sorted by it."""

    def show(model_admin: Any, obj: Any) -> SafeString | str:
        return when(getattr(obj, field))

    show.__name__ = field.removesuffix("_at")
    return admin.display(description=field.replace("_", " "), ordering=field)(show)


# -- the confirmation page of the item actions ----------------------------------------------


def status_counts(queryset: QuerySet[Item]) -> dict[str, int]:
    rows = queryset.order_by().values("status").annotate(n=Count("id"))
    return {row["status"]: row["n"] for row in rows}


def confirm_page(
    model_admin: Any,
    request: HttpRequest,
    *,
    action: str,
    title: str,
    counts: dict[str, int],
    ids: list[str] | None,
    note: str = "",
    back: str = "",
    reason_max: int = 0,
) -> TemplateResponse:
    """The page an item action shows before it acts: how many items, in which states, and a
    "Yes, I am sure" that posts the same request again with ``confirm=yes``. ``action``: the
    list action to post again (with ``ids``), or "" for a view of its own (posted to the
    same address). ``back``: where "No" goes (the item list by default). ``reason_max``:
    above 0, an optional reason of at most that many characters is asked for."""
    context = {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "opts": model_admin.model._meta,
        "action": action,
        "counts": sorted(counts.items()),
        "total": sum(counts.values()),
        "ids": ids or [],
        "note": note,
        "back": back,
        "reason_max": reason_max,
        "query": request.META.get("QUERY_STRING", ""),
    }
    return TemplateResponse(request, "admin/taskhoster/item/confirm.html", context)


# -- progress and leases, as the live pages show them ------------------------------------------


def fraction(value: Any) -> float | None:
    """How far a progress value says the work got, from 0 to 1, when it says so plainly: a
    number from 0 to 1, or ``{"done": n, "of": m}`` with ``m`` above 0 (else None)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if 0 <= value <= 1 else None
    if isinstance(value, dict):
        done, of = plain_number(value.get("done")), plain_number(value.get("of"))
        if done is not None and of is not None and of > 0 and 0 <= done <= of:
            return done / of
    return None


def plain_number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number (never a boolean), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer of 310 digits or more: JSON allows it
            return None
        return number if math.isfinite(number) else None
    return None


def progress_bar(value: Any) -> SafeString | str:
    """A bar and its percentage when the progress is a fraction or ``{done, of}``, else ""."""
    share = fraction(value)
    if share is None:
        return ""
    return format_html(
        '<span class="th-bar"><progress class="th-progress-bar" max="1" value="{}"></progress>'
        '<span class="th-percent">{}%</span></span>',
        f"{share:.4f}",
        f"{share * 100:.0f}",
    )


def lease_left(expires: datetime | None, at: datetime) -> str:
    """A processing item's lease as an operator reads it: "23 s left", or "lapsed 4 s ago"
    (the sweep has not come by yet); "-" for an item that holds none."""
    if expires is None:
        return "-"
    seconds = (expires - at).total_seconds()
    if seconds >= 0:
        return f"{duration(seconds)} left"
    return f"lapsed {duration(-seconds)} ago"


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``: a span to the second, short."""
    whole = int(seconds)
    if whole < 120:
        return f"{whole} s"
    if whole < 7200:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def with_counts(queues: list[Queue]) -> list[Queue]:
    """``queues``, each with its items per status (``status_counts``), from the count rows
    the group commits keep: one query, whatever the number of queues."""
    counts = engine.counts_by_queue([q.pk for q in queues])
    for queue in queues:
        queue.status_counts = counts.get(queue.pk, {})  # type: ignore[attr-defined]
    return queues
