"""A post of items answered on the server's event loop: when it is, and what happens otherwise.

``taskhoster.asgi.OneHopASGIHandler`` answers a request in one of its threads. A post of
items (``QueueItemsView``: its ``loop_methods``) it answers on its event loop instead, with
no thread at all, and without looking the key up there (that would wait for the database):
the engine's group checks the key with the rest of its work (``ops.Post.key_hash``, by
``keys.refusal``, in its own transaction). That costs the server about a quarter less CPU
for a post of one small item. In order, a post is answered:

1. at once by the handler, 503 ``overloaded``, while this process's committer is behind;
2. in a thread, as any request, unless the handler's middleware is safe on the loop
   (``asgi.LOOP_SAFE_MIDDLEWARE``), the Host is allowed and ``admit`` lets it on: its key is
   one this process saw accepted lately (``keys.known_keys``). Any other key, or none, is
   judged in a thread before the body is read, so a made-up key costs a lookup, not a parse;
3. on the loop otherwise: middleware, DRF and the view run there, the caller an
   ``UncheckedKey``, and the view hands its work to the committer with ``post_later``. Any
   error before that (a bad body, a bad queue name) gives ``RunInThread``: the request is
   answered in a thread, from the start, where the key is judged first, so every error is
   the one a thread gives;
4. once handed on, with its ``LaterResponse``, which the handler completes on the loop when
   the committer answers; but a key the group refused (``KeyRefused``) has the request
   answered in a thread, from the start, too (nothing was posted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils.log import log_response
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from .. import engine, events
from ..errors import KeyRefused
from ..keys import known_keys, parse_authorization, secret_hash
from .base import TaskhosterJSONRenderer
from .errors import exception_handler

#: Set on a request to its ``LaterResponse`` once the view has handed its work on.
_HANDED_ON = "taskhoster_later_response"

_renderer = TaskhosterJSONRenderer()  # what every API view renders with


@dataclass(frozen=True)
class UncheckedKey:
    """The caller of a post on the event loop: a key not looked up, for the engine's group
    to check."""

    key_hash: str
    is_authenticated = True


class RunInThread(HttpResponse):
    """Not an answer: the request is to be answered in a thread, from the start."""


class RunInThreadError(Exception):
    """Raised by ``LaterResponse.complete``: the same, once the engine's answer is known."""


def admit(request: HttpRequest) -> bool:
    """Whether the handler may run this post on its loop: its key is one this process saw
    accepted lately (else it is judged in a thread). If so, its caller is the key unchecked
    (``UncheckedKey``), by DRF's own way to name a request's caller without its
    authenticators (that of its test client's ``force_authenticate``)."""
    secret = parse_authorization(request.META.get("HTTP_AUTHORIZATION"))
    found = None if secret is None else secret_hash(secret)
    if found is None or found not in known_keys:
        return False
    setattr(request, "_force_auth_user", UncheckedKey(found))  # noqa: B010 (DRF reads these)
    setattr(request, "_force_auth_token", secret)  # noqa: B010
    return True


def on_the_loop(request: Request) -> bool:
    """Whether this post runs on the handler's event loop (``admit``): then the view posts
    with ``post_later``."""
    return isinstance(request.user, UncheckedKey)


def post_later(
    view: APIView,
    request: Request,
    queue: str,
    new_items: Callable[[], list[engine.NewItem]],
    answer: Callable[[list[engine.Posted]], Response],
) -> HttpResponse:
    """Hand the post of ``new_items()`` to ``queue`` to the committer, its key left to the
    engine's group, and answer it with ``answer`` when the committer does (``LaterResponse``);
    or ``RunInThread`` if anything fails before it is handed on."""
    caller = request.user
    assert isinstance(caller, UncheckedKey)
    try:
        engine.admit_post()
        soon = engine.post_items_soon(queue_name=queue, items=new_items(), key_hash=caller.key_hash)
        events.posting(queue)  # this process's sockets may claim it in the post's own group
    except Exception:
        return RunInThread()
    return LaterResponse(view, request, soon, answer)


def handed_on(request: HttpRequest) -> LaterResponse | None:
    """The post's ``LaterResponse``, once the view has handed its work on."""
    later: LaterResponse | None = getattr(request, _HANDED_ON, None)
    return later


class LaterResponse(HttpResponse):
    """A post's answer on the event loop, before it is known: middleware sees it as any
    response. The handler then awaits ``complete``, which makes the response from the
    committer's answer (``make``), an error as a thread would answer it; or raises
    ``RunInThreadError`` for a key the engine refused, to have the request answered in a
    thread.

    Made once the view has handed its work on: from then on the request is answered with it
    (``handed_on``), even if middleware failed on its way out; answering it again in a thread
    would post twice.
    """

    def __init__(
        self,
        view: APIView,
        request: Request,
        answer: asyncio.Future[Any],
        make: Callable[[Any], Response],
    ) -> None:
        super().__init__(content_type=_renderer.media_type)
        self.view, self.request, self.answer, self.make = view, request, answer, make
        setattr(request._request, _HANDED_ON, self)

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
        self.finish(response.status_code, _renderer.render(response.data))
        for header, value in response.items():
            if header.lower() != "content-type":  # a Response's own is set as it renders
                self[header] = value
        if self.status_code >= 400:  # as Django logs one answered in a thread
            plain = self.request._request
            log_response("%s: %s", self.reason_phrase, plain.path, response=self, request=plain)

    def finish(self, status: int, content: bytes) -> None:
        self.status_code = status
        self.content = content
        if self.has_header("Content-Length"):
            self["Content-Length"] = str(len(content))
