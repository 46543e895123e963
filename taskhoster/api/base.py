"""The base of every API view: it carries its own DRF configuration.

DRF reads its defaults from the project's ``REST_FRAMEWORK`` setting, which belongs to the
project that installs Taskhoster: a host project may set it for its own views, or not at
all. Taskhoster's views depend on none of it. Each says here how it authenticates (a key),
what it allows (a key, then per view a scope), what it parses (strict JSON), what it renders
(JSON), how an error is answered (one envelope, ``taskhoster.api.errors``) and who an
unauthenticated caller is (nobody), so the API answers the same in any project, whatever its
``REST_FRAMEWORK`` says.
"""

from __future__ import annotations

from typing import Any, cast

from django.db import transaction
from django.http import HttpRequest
from drf_spectacular.openapi import AutoSchema
from rest_framework.metadata import SimpleMetadata
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.settings import DEFAULTS, IMPORT_STRINGS, APISettings
from rest_framework.views import APIView

from .auth import HasKey, KeyAuthentication
from .errors import exception_handler
from .parsers import StrictJSONParser

#: DRF's settings as Taskhoster's views see them: DRF's own defaults and our exception handler,
#: never the project's ``REST_FRAMEWORK``. A view reads ``self.settings`` for the exception
#: handler, its name and the format suffix; the classes it uses are set on the view itself.
DRF_SETTINGS = APISettings(
    user_settings=cast(
        Any,
        {
            "EXCEPTION_HANDLER": exception_handler,
            "UNAUTHENTICATED_USER": None,
            "UNAUTHENTICATED_TOKEN": None,
        },
    ),
    defaults=DEFAULTS,
    import_strings=IMPORT_STRINGS,
)


class TaskhosterJSONRenderer(JSONRenderer):
    """DRF's JSON renderer with DRF's default output, not the project's ``UNICODE_JSON``,
    ``COMPACT_JSON`` or ``STRICT_JSON`` (DRF binds those into the class at import)."""

    ensure_ascii = not DEFAULTS["UNICODE_JSON"]
    compact = DEFAULTS["COMPACT_JSON"]
    strict = DEFAULTS["STRICT_JSON"]


class TaskhosterContentNegotiation(DefaultContentNegotiation):
    """Content negotiation (``?format=``, ``Accept``) read from our settings."""

    settings = cast(Any, DRF_SETTINGS)


class TaskhosterRequest(Request):
    """A request whose caller, without a valid key, is nobody (``None``), not the project's
    ``UNAUTHENTICATED_USER``."""

    def _not_authenticated(self) -> None:
        self._authenticator = None
        self.user = None  # type: ignore[assignment]  # the stubs expect a Django user
        self.auth = None


class ApiView(APIView):
    """JSON in and out, without negotiating per request: there is one renderer, so there is
    nothing to choose."""

    settings = DRF_SETTINGS
    authentication_classes = [KeyAuthentication]
    permission_classes = [HasKey]
    parser_classes = [StrictJSONParser]
    renderer_classes = [TaskhosterJSONRenderer]
    throttle_classes = []
    content_negotiation_class = TaskhosterContentNegotiation
    metadata_class = SimpleMetadata
    versioning_class = None
    # drf-spectacular's, not the project's DEFAULT_SCHEMA_CLASS (/api/schema reads it).
    schema = AutoSchema()
    _renderer = TaskhosterJSONRenderer()

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        """The view, kept out of a host's request-wide transaction (``ATOMIC_REQUESTS``).

        The engine commits each change in a group of its own, its files flushed before it
        answers. Inside a request's transaction a change would run there instead: its row
        rolled back with the request but its file left behind, and (on SQLite) a long-poll
        holding the write lock every other change waits for.
        """
        return transaction.non_atomic_requests(super().as_view(**initkwargs))

    def initialize_request(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Request:
        return TaskhosterRequest(
            request,
            parsers=self.get_parsers(),
            authenticators=self.get_authenticators(),
            negotiator=self.get_content_negotiator(),
            parser_context=self.get_parser_context(request),
        )

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        return self._renderer, self._renderer.media_type
