"""The overview page: every queue in one table (with its flow control at a glance: a "paused"
badge, the limits set), and an inline SVG chart of posts and finishes
per minute over the last hour (drawn on the server; the page loads nothing from outside), and
how many workers are connected, linked to the workers page (for those who may see it).

Posts per minute count the index rows whose id (microseconds at post, in hex) falls in each
minute: primary-key ranges, so it stays cheap. Items already deleted are not counted, and a
restarted item counts at its first post. Finishes (finished or failed) use the per-queue
``finished_at`` index.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..models import Item, Queue
from ..status import TERMINAL_STATUSES
from ..timeutil import now as utcnow
from ..work import registry
from . import live
from .common import flow_summary, status_in, with_counts, with_stats

MINUTES = 60
WIDTH, HEIGHT, PAD = 720, 160, 30


def id_floor(at: datetime) -> str:
    """The smallest item id posted at or after ``at``."""
    return f"{int(at.timestamp() * 1_000_000):014x}"


def per_minute(since: datetime) -> tuple[list[int], list[int]]:
    """Posts and finishes in each of the last ``MINUTES`` minutes: one range count per minute
    on an index (the id for posts, ``(queue, finished_at)`` for finishes)."""
    start = since.replace(second=0, microsecond=0)
    bounds = [start + timedelta(minutes=m) for m in range(MINUTES + 1)]
    queue_ids = list(Queue.objects.values_list("id", flat=True))
    done = Item.objects.filter(queue_id__in=queue_ids).extra(where=[status_in(TERMINAL_STATUSES)])
    posts = [
        Item.objects.filter(id__gte=id_floor(lo), id__lt=id_floor(hi)).count()
        for lo, hi in itertools.pairwise(bounds)
    ]
    finishes = [
        done.filter(finished_at__gte=lo, finished_at__lt=hi).count()
        for lo, hi in itertools.pairwise(bounds)
    ]
    return posts, finishes


def _points(values: list[int], top: int) -> str:
    step = (WIDTH - 2 * PAD) / (MINUTES - 1)
    return " ".join(
        f"{PAD + i * step:.1f},{HEIGHT - PAD - (v / top) * (HEIGHT - 2 * PAD):.1f}"
        for i, v in enumerate(values)
    )


def chart_svg(posts: list[int], finishes: list[int]) -> SafeString:
    top = max([1, *posts, *finishes])
    ticks = format_html_join(
        "",
        '<text x="{}" y="{}" font-size="10" text-anchor="middle">{}</text>',
        (
            (PAD + m * (WIDTH - 2 * PAD) / (MINUTES - 1), HEIGHT - 10, f"-{MINUTES - m} min")
            for m in range(0, MINUTES, 10)
        ),
    )
    return format_html(
        '<svg id="th-chart" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'viewBox="0 0 {w} {h}" role="img" aria-label="posts and finishes per minute">'
        '<line x1="{p}" y1="{b}" x2="{r}" y2="{b}" stroke="#999"/>'
        '<text x="{p}" y="14" font-size="11">max {top}/min</text>'
        '<polyline fill="none" stroke="#417690" stroke-width="2" points="{posts}"/>'
        '<polyline fill="none" stroke="#e08e0b" stroke-width="2" points="{fin}"/>'
        '<text x="{lx}" y="14" font-size="11" fill="#417690">posts</text>'
        '<text x="{lx2}" y="14" font-size="11" fill="#e08e0b">finishes</text>{ticks}</svg>',
        w=WIDTH,
        h=HEIGHT,
        p=PAD,
        r=WIDTH - PAD,
        b=HEIGHT - PAD,
        top=top,
        posts=_points(posts, top),
        fin=_points(finishes, top),
        lx=WIDTH - 150,
        lx2=WIDTH - 100,
        ticks=ticks,
    )


def last_minutes(minutes: int) -> tuple[int, int]:
    """Posts, and finishes or failures, over the last ``minutes`` (two range counts on
    indexes: the id's, and each queue's ``finished_at``)."""
    since = utcnow() - timedelta(minutes=minutes)
    queue_ids = list(Queue.objects.values_list("id", flat=True))
    done = Item.objects.filter(queue_id__in=queue_ids).extra(where=[status_in(TERMINAL_STATUSES)])
    posts = Item.objects.filter(id__gte=id_floor(since)).count()
    return posts, done.filter(finished_at__gte=since).count()


def overview_view(request: HttpRequest) -> HttpResponse:
    from django.contrib import admin

    if not request.user.has_perm("taskhoster.view_queue"):
        # Every queue's name and counts: for those who may view queues.
        raise PermissionDenied("the overview needs the permission to view queues")

    queues = with_counts(list(with_stats(Queue.objects.filter(deleting=False))))
    posted_1m, done_1m = last_minutes(1)
    context: dict[str, Any] = {
        **admin.site.each_context(request),
        "title": "Overview",
        "queues": queues,
        "rows": [(queue, flow_summary(queue)) for queue in queues],
        "posted_1m": posted_1m,
        "done_1m": done_1m,
    }
    if not live.wanted(request):
        # The hour's chart (120 range counts) is drawn when the page loads, never redrawn:
        # the live regions are the table, the last minute and the workers.
        posts, finishes = per_minute(utcnow() - timedelta(minutes=MINUTES - 1))
        context.update(
            chart=chart_svg(posts, finishes),
            posts_total=sum(posts),
            finishes_total=sum(finishes),
        )
    if request.user.has_perm("taskhoster.view_workersocket") or request.user.has_perm(
        "taskhoster.change_workersocket"
    ):
        context["workers"] = len(registry.workers())
    response = TemplateResponse(request, "admin/taskhoster/overview.html", context)
    return live.answer(request, response)
