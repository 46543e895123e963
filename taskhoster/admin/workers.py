"""Workers (SPEC section 8.2): every open ``/work`` socket of every live server process, as
the registry lists it (``registry.workers``: a stopped or dead process's sockets are never
shown), each with a "Drain" button (``registry.drain``: the socket is dealt nothing more and
told ``drain``; what it holds stays with it until answered).

It is the admin's page of the ``WorkerSocket`` model (so it is on the index, and Django's
permissions for the model say who sees it: view, and who drains: change), but its list is the
registry's, not a query of the table: each process writes its sockets there about once a
second, and only the registry knows which processes are still alive. There is no page per
socket: the list says all there is.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from ..models import Item, ServerProcess, WorkerSocket
from ..timeutil import now as utcnow
from ..work import registry
from . import live
from .common import duration, item_link, progress_bar, when

# A socket's held items shown in its row (the rest counted).
HELD_SHOWN = 50


def held_links(held: list[str], rows: dict[str, dict[str, Any]] | None = None) -> SafeString | str:
    """The items a socket holds, each linked to its page, with how long it has held it and
    its progress bar when its worker said how far (``rows``: the items' index rows)."""
    if not held:
        return "-"
    rows = rows or {}
    at = utcnow()
    links = format_html_join(
        "",
        '<span class="th-held-item">{}{}{}</span>',
        (held_item(i, rows.get(i), at) for i in held[:HELD_SHOWN]),
    )
    more = len(held) - HELD_SHOWN
    if more > 0:
        return format_html("{} and {} more", links, more)
    return links


def held_item(item_id: str, row: dict[str, Any] | None, at: datetime) -> tuple[Any, Any, Any]:
    if row is None:
        return item_link(item_id), "", ""
    claimed = row["claimed_at"]
    since = (
        format_html(
            ' <span class="th-held-for">{}</span>', duration((at - claimed).total_seconds())
        )
        if claimed
        else ""
    )
    return item_link(item_id), since, progress_bar(row["progress"])


def held_rows(sockets: list[WorkerSocket]) -> dict[str, dict[str, Any]]:
    """The index rows (claim time, progress) of the items these sockets hold, shown ones
    only: one query."""
    ids = [i for row in sockets for i in list(row.held or [])[:HELD_SHOWN]]
    found = Item.objects.filter(id__in=ids).values("id", "claimed_at", "progress")
    return {row["id"]: dict(row) for row in found}


def processes() -> dict[str, str]:
    """Each server process's "host pid N", by its id."""
    return {p.process: f"{p.host} pid {p.pid}" for p in ServerProcess.objects.all()}


@admin.register(WorkerSocket)
class WorkerAdmin(admin.ModelAdmin):
    # Nothing is added, edited or deleted here: sockets come and go with their processes.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_drain_permission(self, request: HttpRequest) -> bool:
        """Draining changes what a socket is dealt: Django's change permission for worker
        sockets."""
        return bool(request.user.has_perm(f"{self.opts.app_label}.change_workersocket"))

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        opts = self.opts
        return bool(
            request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}")
            or self.has_drain_permission(request)
        )

    def get_urls(self) -> list[URLPattern]:
        # The list and the drain button only: no add, change, delete or history pages.
        return [
            path(
                "",
                self.admin_site.admin_view(self.changelist_view),
                name="taskhoster_workersocket_changelist",
            ),
            path(
                "<str:socket_id>/drain/",
                self.admin_site.admin_view(require_POST(self.drain_view)),
                name="taskhoster_workersocket_drain",
            ),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied("the workers page needs the permission to view worker sockets")
        sockets = registry.workers()
        # How long each item has been held, and its progress: for those who may see items.
        may_see_items = request.user.has_perm("taskhoster.view_item") or request.user.has_perm(
            "taskhoster.change_item"
        )
        items = held_rows(sockets) if may_see_items else {}
        names = processes()
        rows = [
            {
                "socket": row,
                "process": names.get(row.process, row.process),
                "queues": ", ".join(row.queues or []) or "-",
                "held": held_links(list(row.held or []), items),
                "held_count": len(row.held or []),
                "connected": when(row.connected_at),
                "last_seen": when(row.last_seen_at),
            }
            for row in sockets
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": "Workers",
            "subtitle": None,
            "opts": self.opts,
            "rows": rows,
            "can_drain": self.has_drain_permission(request),
            **(extra_context or {}),
        }
        response = TemplateResponse(request, "admin/taskhoster/workers.html", context)
        return live.answer(request, response)

    def drain_view(self, request: HttpRequest, socket_id: str) -> HttpResponse:
        """A row's "Drain" button (a POST, CSRF-checked by the admin site's view wrapper)."""
        if not self.has_drain_permission(request):
            raise PermissionDenied(
                "draining a worker needs the permission to change worker sockets"
            )
        back = reverse("admin:taskhoster_workersocket_changelist")
        found = registry.worker(socket_id) if registry.is_socket_id(socket_id) else None
        if found is None:
            self.message_user(
                request, f"Worker {socket_id} is no longer connected.", messages.WARNING
            )
            return HttpResponseRedirect(back)
        (drained,) = registry.drain([found])
        self.message_user(
            request,
            f"Worker “{drained.name or drained.id}” drained: it is dealt nothing more and told "
            "to finish what it holds, then close.",
            messages.SUCCESS,
        )
        return HttpResponseRedirect(back)


def workers_count() -> int:
    """How many workers are connected to every live server process (the overview says)."""
    return len(registry.workers())
