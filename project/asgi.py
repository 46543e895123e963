"""ASGI entry point: HTTP through Django, WebSockets through Channels."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup(set_prefix=False)

# The state root and the committer process first: the committer's start (a process of its
# own) goes on beside the imports below rather than after them. ``asgi.start()`` does the
# rest of the start.
from taskhoster import startup  # noqa: E402

startup.start_engine()

# Imported only once Django is set up: the consumers import models.
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from taskhoster import asgi  # noqa: E402
from taskhoster.routing import websocket_urlpatterns  # noqa: E402

# The rest of the start: the news from other processes listened for, the health monitor
# (/healthz from now on), the start-up heap frozen.
asgi.start()
asgi.skip_twisted_form_parsing()
asgi.refuse_bodies_early()  # a body that will be refused is refused before it is read

application = ProtocolTypeRouter(
    {
        # The admin's CSS and JS are served by the same process: there is no separate web
        # server.
        "http": ASGIStaticFilesHandler(asgi.OneHopASGIHandler()),
        "websocket": URLRouter(websocket_urlpatterns),
    }
)
