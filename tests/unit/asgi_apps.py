"""ASGI applications for the ``/work`` route check (``tests/unit/test_checks.py``): what a host
project might name in ``ASGI_APPLICATION``, with and without the route."""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddlewareStack
from channels.generic.websocket import WebsocketConsumer
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.core.asgi import get_asgi_application
from django.urls import path

from taskhoster.routing import websocket_urlpatterns
from taskhoster.work.consumer import WorkConsumer

http = get_asgi_application()


class ChatConsumer(WebsocketConsumer):
    """The host project's own socket."""


# A host project's usual stack, with /work under a prefix among its own routes.
wrapped = ProtocolTypeRouter(
    {
        "http": http,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(
                URLRouter(
                    [
                        path("chat", ChatConsumer.as_asgi()),
                        path("tasks/", URLRouter([path("work", WorkConsumer.as_asgi())])),
                    ]
                )
            )
        ),
    }
)
# Taskhoster's own routes as they are.
plain = ProtocolTypeRouter({"http": http, "websocket": URLRouter(websocket_urlpatterns)})

# No /work route: HTTP only, Django's handler alone, and websockets to another consumer.
http_only = ProtocolTypeRouter({"http": http})
django_only = http
other_sockets = ProtocolTypeRouter(
    {"http": http, "websocket": URLRouter([path("chat", ChatConsumer.as_asgi())])}
)


async def hand_written_router(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A router the check cannot look into."""


opaque = ProtocolTypeRouter({"http": http, "websocket": hand_written_router})
