"""``api/schema``: the OpenAPI document of Taskhoster's API, in any project that includes it.

The document is made with Taskhoster's own drf-spectacular settings (``SPECTACULAR``: the
title, the shared components and links of ``schema.finish``, and drf-spectacular's defaults
for everything else), never the project's ``SPECTACULAR_SETTINGS``, and it holds Taskhoster's
operations only: a host project's own DRF views are not in it. Paths carry the prefix the
project includes the app under (``/tasks/api/queues``).

drf-spectacular applies per-view settings by patching its global settings while the document
is made; the lock keeps two of these views from interleaving their patches.
"""

from __future__ import annotations

import threading
from typing import Any

from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.settings import SPECTACULAR_DEFAULTS
from drf_spectacular.views import SpectacularAPIView
from rest_framework.metadata import SimpleMetadata
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from .base import DRF_SETTINGS, ApiView, TaskhosterContentNegotiation
from .schema import annotate

#: drf-spectacular's settings for the document (also for ``manage.py spectacular
#: --custom-settings taskhoster.api.schema_view.SPECTACULAR``). Keys drf-spectacular refuses
#: to patch per view (``SERVE_*``, the generator class) are the view's attributes instead.
SPECTACULAR: dict[str, Any] = {
    **{
        name: value
        for name, value in SPECTACULAR_DEFAULTS.items()
        if not name.startswith("SERVE_") and name != "DEFAULT_GENERATOR_CLASS"
    },
    "TITLE": "Taskhoster API",
    "DESCRIPTION": "Producers post items and read results; workers claim items and hand back "
    "results. Authenticate with `Authorization: Token <key>`.",
    "VERSION": "1",
    "COMPONENT_SPLIT_REQUEST": True,
    "PREPROCESSING_HOOKS": ["taskhoster.api.schema_view.only_taskhoster"],
    # The shared components (bodies from the contract), the error envelope and the links.
    "POSTPROCESSING_HOOKS": ["taskhoster.api.schema.finish"],
}

_generating = threading.Lock()


def only_taskhoster(endpoints: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """drf-spectacular pre-processing: Taskhoster's API views, not the rest of the project."""
    return [
        endpoint
        for endpoint in endpoints
        if isinstance(getattr(endpoint[3], "cls", None), type)
        and issubclass(endpoint[3].cls, ApiView)
    ]


class SchemaView(SpectacularAPIView):
    """The document, as YAML or (``?format=json`` or by ``Accept``) JSON; no key needed."""

    settings = DRF_SETTINGS
    authentication_classes = []
    permission_classes = [AllowAny]
    throttle_classes = []
    content_negotiation_class = TaskhosterContentNegotiation
    versioning_class = None
    metadata_class = SimpleMetadata
    generator_class = SchemaGenerator
    # drf-spectacular's, not the project's DEFAULT_SCHEMA_CLASS: its system check generates
    # a schema of every DRF view of the project (this one is excluded from the document).
    schema = AutoSchema()
    custom_settings = SPECTACULAR
    serve_public = True
    urlconf = None

    @annotate(exclude=True)  # as drf-spectacular's own view: not an operation of the API
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        with _generating:
            response: Response = super().get(request, *args, **kwargs)
            return response
