"""Helpers shared by the admin pages: a paginator that never counts a huge table, and links."""

from __future__ import annotations

from functools import cached_property
from typing import Any
from urllib.parse import urlencode

from django.core.paginator import Paginator
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..status import Status

# Counts stop at this many rows (a queue's count per status shows "10000+").
COUNT_CAP = 10_000
# A list counts only this many pages past the one asked for.
PAGES_AHEAD = 10


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
        page = max(1, int(request.GET.get("p", 1)))
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


def item_url(item_id: str) -> str:
    return reverse("admin:taskhoster_item_change", args=[item_id])


def item_link(item_id: str | None) -> SafeString | str:
    if not item_id:
        return "-"
    return format_html('<a href="{}">{}</a>', item_url(item_id), item_id)


def items_url(**filters: Any) -> str:
    return reverse("admin:taskhoster_item_changelist") + "?" + urlencode(filters)
