"""WebSocket routes: workers connect to ``/work``."""

from __future__ import annotations

from django.urls import re_path

from .work.consumer import WorkConsumer

websocket_urlpatterns = [re_path(r"^work$", WorkConsumer.as_asgi())]
