"""The admin's live pages: the overview, a queue's page, an item's page, the workers and the
items in flight redraw parts of themselves about once a second, in every tab, whichever
server process made the change.

How: each such page marks its changing parts as regions (``<!--live:NAME-->…<!--/live:NAME-->``
inside an element with ``data-th-region="NAME"``) and loads ``taskhoster/live.js``. The
script asks for the page's own address again with the header ``X-Taskhoster-Live: 1``; the
page's view runs as for a visit (the same login, staff check, permissions and queries, so a
region can never show what the page would not), and ``answer`` sends back only the regions,
as JSON. The script puts each region that changed in place.

Why polling, not a push: every server process can answer any tab (it reads the database, as
the page does), so nothing is held per tab or per process and nothing is lost when a process
restarts; it needs no connection beyond the admin's own, so it works behind any proxy and in
a WSGI deployment. Its cost is bounded per open tab (one page's queries a second, none while
the tab is hidden) whatever the rate of change: a thousand items changing in a second are
one redraw. A push would still reread the database to draw the page.
"""

from __future__ import annotations

import re

from django.contrib.messages import get_messages
from django.contrib.messages.storage.base import BaseStorage
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..timeutil import now as utcnow
from ..timeutil import to_wire

HEADER = "HTTP_X_TASKHOSTER_LIVE"
REGION = re.compile(r"<!--live:([a-z0-9-]+)-->(.*?)<!--/live:\1-->", re.S)


def wanted(request: HttpRequest) -> bool:
    """Whether this request is the live script's (it wants the regions, not the page)."""
    return request.META.get(HEADER) == "1"


def region(name: str, html: SafeString | str) -> SafeString:
    """``html`` as a live region of its own (for a field or a cell drawn by Python)."""
    return format_html(
        '<span data-th-region="{0}"><!--live:{0}-->{1}<!--/live:{0}--></span>', name, html
    )


def regions(html: str) -> dict[str, str]:
    """The live regions of a drawn page, by name."""
    return {match.group(1): match.group(2) for match in REGION.finditer(html)}


def answer(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """``response`` as the live script wants it when it asked (else ``response`` itself):
    the page's regions as JSON, or ``{"gone": ...}`` when the page is not there any more
    (a redirect: the item deleted, the session ended), so the script stops asking.

    The page's messages ("Deleted 3 items") are left for the next real visit: a redraw must
    not take them."""
    if not wanted(request):
        return response
    if response.status_code != 200 or not hasattr(response, "render"):
        gone = {"gone": True, "status": response.status_code}
        return no_store(JsonResponse(gone))
    response.render()
    storage = get_messages(request)
    if isinstance(storage, BaseStorage):
        storage.used = False
    body = {"at": to_wire(utcnow()), "regions": regions(response.content.decode())}
    return no_store(JsonResponse(body))


def no_store(response: HttpResponse) -> HttpResponse:
    response["Cache-Control"] = "no-store"
    return response
