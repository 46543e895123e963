"""ASGI entry point: HTTP through Django, WebSockets through Channels."""

import os

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
# The admin's CSS and JS are served by the same process: there is no separate web server.
django_asgi_app = ASGIStaticFilesHandler(get_asgi_application())

# Imported only once Django is set up: the consumers import models.
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from taskhoster.asgi import PooledRequestThreads  # noqa: E402
from taskhoster.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": PooledRequestThreads(django_asgi_app),
        "websocket": URLRouter(websocket_urlpatterns),
    }
)
