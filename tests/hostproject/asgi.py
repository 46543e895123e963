"""The host project's ASGI application: its HTTP through Django, and Taskhoster's ``/work``
socket under the same prefix as its URLs (``/tasks/work``)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.hostproject.settings")
django_application = get_asgi_application()  # sets Django up: import consumers after it

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

import taskhoster.routing  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_application,
        "websocket": URLRouter(
            [path("tasks/", URLRouter(taskhoster.routing.websocket_urlpatterns))]
        ),
    }
)
