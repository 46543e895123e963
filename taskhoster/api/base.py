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

import asyncio
from collections.abc import Callable
from typing import Any, cast

from django.db import transaction
from django.http import HttpRequest, HttpResponseBase
from django.utils.log import log_response
from drf_spectacular.openapi import AutoSchema
from rest_framework.metadata import SimpleMetadata
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import DEFAULTS, IMPORT_STRINGS, APISettings
from rest_framework.views import APIView

from ..asgi import LaterResponse, RunInThread, RunInThreadError, is_on_loop
from ..errors import KeyRefused
from .auth import HasKey, KeyAuthentication, UncheckedKey, known_keys
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
    #: The methods this view answers on the handler's event loop (``taskhoster.asgi``).
    loop_methods: frozenset[str] = frozenset()

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

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        if is_on_loop(request) and (request.method or "").lower() not in self.loop_methods:
            raise RunInThreadError  # not answered on the loop (handle_exception says so)
        super().initial(request, *args, **kwargs)

    # DRF's stubs say Response; DRF itself takes any HttpResponse from here.
    def handle_exception(self, exc: Exception) -> HttpResponseBase:  # type: ignore[override]
        """On the event loop, anything but the view's own answer is answered in a thread,
        from the start: there the key is checked first, as always, and every error is the
        one it has always been."""
        if is_on_loop(self.request):
            return RunInThread()
        response: HttpResponseBase = super().handle_exception(exc)
        return response


class EngineAnswer(LaterResponse):
    """A view's answer on the event loop: ``make`` turns the engine's answer into the
    response, on the loop, once ``answer`` settles; an error is answered as in a thread, and
    a key the engine refused (``KeyRefused``) sends the request to a thread."""

    def __init__(
        self,
        view: APIView,
        request: Request,
        answer: asyncio.Future[Any],
        make: Callable[[Any], Response],
    ) -> None:
        super().__init__(request._request, content_type=ApiView._renderer.media_type)
        self.view, self.request, self.answer, self.make = view, request, answer, make

    async def complete(self) -> None:
        response: Response | None
        try:
            response = self.make(await self.answer)
            user = self.request.user
            if isinstance(user, UncheckedKey):
                known_keys.add(user.key_hash)  # the group accepted it: it may stay on the loop
        except KeyRefused as exc:
            raise RunInThreadError from exc
        except Exception as exc:
            response = exception_handler(exc, {"view": self.view, "request": self.request})
        assert response is not None  # the handler answers every exception
        self.finish(response.status_code, ApiView._renderer.render(response.data))
        for header, value in response.items():
            if header.lower() != "content-type":  # a Response's own is set as it renders
                self[header] = value
        if self.status_code >= 400:  # as Django logs one answered in a thread
            plain = self.request._request
            log_response("%s: %s", self.reason_phrase, plain.path, response=self, request=plain)
