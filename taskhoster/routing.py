"""WebSocket routes: workers connect to ``work``, under whatever prefix the project's ASGI
router mounts these at (``/work`` in our server, ``/tasks/work`` in docs/embedding.md)."""

from __future__ import annotations

from django.urls import re_path

from .work.consumer import WorkConsumer

websocket_urlpatterns = [re_path(r"^work$", WorkConsumer.as_asgi())]
