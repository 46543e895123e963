"""ASGI entry point: HTTP through Django, WebSockets through Channels."""

import contextlib
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup(set_prefix=False)

# Imported only once Django is set up: the consumers import models.
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from twisted.web import http as twisted_http  # noqa: E402

from taskhoster.asgi import OneHopASGIHandler  # noqa: E402
from taskhoster.conf import get_conf  # noqa: E402
from taskhoster.engine import committer  # noqa: E402
from taskhoster.routing import websocket_urlpatterns  # noqa: E402

# The state root exists from the start, so /healthz answers about it plainly (a root that
# cannot be created is reported there, not raised here).
with contextlib.suppress(OSError):
    get_conf().root.mkdir(parents=True, exist_ok=True)
committer.start()


def _content_type(line: bytes) -> bytes:
    """The media type of a Content-Type header, without its parameters.

    Twisted parses every POST's Content-Type with the email package to look for a form
    submission, which daphne never reads (it hands the raw body to the application); that
    parse cost more than a fifth of a small JSON post. This gives the same answer for any
    header a form submission could carry.
    """
    media = line.split(b";", 1)[0].strip().lower()
    return media if b"/" in media else b"text/plain"


twisted_http._parseContentType = _content_type

application = ProtocolTypeRouter(
    {
        # The admin's CSS and JS are served by the same process: there is no separate web
        # server.
        "http": ASGIStaticFilesHandler(OneHopASGIHandler()),
        "websocket": URLRouter(websocket_urlpatterns),
    }
)
