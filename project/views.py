"""The server's front page: what answers at ``/`` (where ``scripts/serve`` points, and where
the admin's "View site" leads), naming the server and linking what it serves.

It belongs to this project, not to the app: a host project that embeds Taskhoster has its own
root. Browsers get a small HTML page, anything else JSON (``curl`` sends ``Accept: */*``).
"""

from __future__ import annotations

from importlib import metadata

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import get_script_prefix, reverse
from django.utils.html import format_html, format_html_join

from taskhoster.asyncapi import public_host

# Where this project mounts the app (project/urls.py includes taskhoster.urls at the root).
LINKS = (
    ("admin", "The admin (staff log in)", None),
    ("apiSchema", "The REST API: OpenAPI 3 schema", "api/schema"),
    ("asyncApi", "The /work socket: AsyncAPI 3 document", "api/asyncapi"),
    ("health", "Health: database, news bus, state root", "healthz"),
    ("metrics", "Metrics: Prometheus text (needs a key)", "metrics"),
)
DOCS = "README.md and docs/ (architecture, deploy, performance) in the source tree"


def _version() -> str:
    try:
        return metadata.version("taskhoster")
    except metadata.PackageNotFoundError:
        return "unknown"


def _links(request: HttpRequest) -> dict[str, str]:
    prefix = get_script_prefix()
    host = public_host(request)  # never a Host header any client could make up
    scheme = "https" if request.is_secure() else "http"
    links = {}
    for name, _title, path in LINKS:
        url = reverse("admin:index") if path is None else prefix + path
        links[name] = f"{scheme}://{host}{url}"
    links["socket"] = f"{'wss' if request.is_secure() else 'ws'}://{host}{prefix}work"
    return links


def _wants_html(request: HttpRequest) -> bool:
    """A browser names ``text/html`` in its ``Accept``; clients that name JSON, or nothing
    but ``*/*``, get JSON."""
    named = {str(t).split(";", 1)[0].strip().lower() for t in request.accepted_types}
    return "text/html" in named and "application/json" not in named


def root(request: HttpRequest) -> HttpResponse:
    """``GET /``: the server's name and version, and links to everything it serves."""
    if request.method not in {"GET", "HEAD"}:
        answer = JsonResponse(
            {"error": {"code": "method_not_allowed", "message": "use GET on /"}}, status=405
        )
        answer["Allow"] = "GET, HEAD"
        return answer
    links = _links(request)
    body = {
        "name": "Taskhoster",
        "version": _version(),
        "description": "A task-queue server: producers post over the REST API under /api/, "
        "workers hold the /work socket, operators use the admin.",
        "links": links,
        "docs": DOCS,
    }
    if not _wants_html(request):
        return JsonResponse(body, json_dumps_params={"indent": 2})
    rows = format_html_join(
        "\n",
        '<li><a href="{}">{}</a> <code>{}</code></li>',
        ((links[name], title, links[name]) for name, title, _path in LINKS),
    )
    page = format_html(
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        "<title>Taskhoster</title>"
        "<style>body{{font:16px/1.5 system-ui,sans-serif;max-width:46em;margin:2em auto;"
        "padding:0 1em}}code{{color:#555}}</style></head><body>\n"
        "<h1>Taskhoster <small>{}</small></h1>\n<p>{}</p>\n<ul>\n{}\n"
        "<li>Workers: a WebSocket at <code>{}</code> "
        "(<code>Authorization: Token &lt;key&gt;</code>)</li>\n</ul>\n"
        "<p>Docs: {}. API calls need <code>Authorization: Token &lt;key&gt;</code>; "
        "<code>scripts/serve</code> saves the first key in "
        "<code>var/credentials.json</code>.</p>\n</body></html>\n",
        body["version"],
        body["description"],
        rows,
        links["socket"],
        DOCS,
    )
    return HttpResponse(page, content_type="text/html; charset=utf-8")
