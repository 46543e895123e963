"""WebSocket routes. The ``/work`` consumer arrives with the socket issue; until then a socket
is refused with close code 4404 rather than left hanging."""

from __future__ import annotations

from channels.generic.websocket import WebsocketConsumer
from django.urls import re_path


class NotYetConsumer(WebsocketConsumer):
    def connect(self) -> None:
        self.close(code=4404)


websocket_urlpatterns = [re_path(r"^work$", NotYetConsumer.as_asgi())]
