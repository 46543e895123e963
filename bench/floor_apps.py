"""The servers ``bench/floor.py`` measures below Taskhoster: not part of the app.

- ``raw``: a bare ASGI application: reads the request's body, parses its JSON and answers
  201 with a small JSON object (what daphne and the client cost alone);
- ``django``: Django's own ASGI handler (settings: this module, no middleware, no
  database), routing to one ``async`` view that does the same (what Django's request and
  response add).

Both answer ``GET /healthz`` 200, which the bench's ``Daphne`` waits for.
"""

from __future__ import annotations

import json
from typing import Any

# -- Django's settings (DJANGO_SETTINGS_MODULE=bench.floor_apps) ----------------------------

SECRET_KEY = "bench-floor-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "bench.floor_apps"
INSTALLED_APPS: list[str] = []
MIDDLEWARE: list[str] = []
DATABASES: dict[str, Any] = {}
USE_TZ = True
LOGGING_CONFIG = None

ANSWER = {"id": "01ARZ3NDEKTSV4RRFFQ69G5FAV", "queue": "bench", "status": "pending"}
ANSWER_BYTES = json.dumps(ANSWER).encode()


async def raw(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The bare ASGI application."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    status, answer = 200, b'{"status":"ok"}'
    if scope["method"] == "POST":
        json.loads(body)
        status, answer = 201, ANSWER_BYTES
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(answer)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": answer})


async def _view(request: Any, **kwargs: Any) -> Any:
    from django.http import JsonResponse

    if request.method == "POST":
        json.loads(request.body)
        return JsonResponse(ANSWER, status=201)
    return JsonResponse({"status": "ok"})


def _urlpatterns() -> list[Any]:
    from django.urls import path

    return [path("healthz", _view), path("api/queues/<str:queue>/items", _view)]


def __getattr__(name: str) -> Any:
    # Made on first use: importing this module as Django's settings must not import Django's
    # URL machinery, nor build the application before the settings are read.
    if name == "urlpatterns":
        return _urlpatterns()
    if name == "django":
        from django.core.asgi import get_asgi_application

        globals()["django"] = application = get_asgi_application()
        return application
    raise AttributeError(name)
