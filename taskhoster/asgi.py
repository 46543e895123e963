"""Opt-in ASGI helpers for a server process: a faster HTTP handler, an early start, and a
shortcut in twisted's request parsing.

Nothing here is needed: a project may serve Taskhoster with Django's own
``get_asgi_application()`` and the ``/work`` route of ``taskhoster.routing`` (see
docs/embedding.md). Our own server (``project/asgi.py``) uses all three.

``OneHopASGIHandler``: Django's ASGI handler with a request's synchronous part run in one hop
to a long-lived thread.

Django's own ASGI handler runs a sync project asynchronously: each sync middleware method,
the view, the request signals and closing the response are separate ``sync_to_async`` calls,
each a round trip between the event loop and a thread (and every round trip a fight for the
GIL). A request of this API spent far more time in those hops than in its own code. Here a
request is read on the event loop, then everything Django does with it (middleware, view,
rendering, the request signals) runs in one call on one of ``size`` long-lived threads,
whose database connections serve request after request, and the response is sent back on
the loop. When every thread is busy (long-polls hold theirs for up to a minute), a request
gets a thread of its own, so nothing waits for a free one.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.http import HttpResponseBase
from django.urls import set_script_prefix

from .osthread import name_os_thread


def start() -> None:
    """Make the state root and start this process's committer now, rather than at the first
    operation that needs them (a committer process takes a moment to start). Call it once
    Django is set up, in the ASGI module.

    Optional: without it the committer starts itself on first use, and the state root is made
    with the first queue (until then ``/healthz`` reports it missing).
    """
    from .conf import get_conf
    from .engine import committer

    if committer.start_is_held():
        return  # the system checks are importing the ASGI module: nothing is started
    # A root that cannot be made is reported by /healthz, not raised here.
    with contextlib.suppress(OSError):
        get_conf().root.mkdir(parents=True, exist_ok=True)
    committer.start()


def _media_type(line: bytes) -> bytes:
    """The media type of a Content-Type header, without its parameters."""
    media = line.split(b";", 1)[0].strip().lower()
    return media if b"/" in media else b"text/plain"


def skip_twisted_form_parsing() -> None:
    """Under daphne: make twisted read a request's Content-Type without the email package.

    Twisted parses every POST's Content-Type with the email package to look for a form
    submission, which daphne never reads (it hands the raw body to the application); that
    parse cost more than a fifth of a small JSON post. The replacement gives the same answer
    for any header a form submission could carry. It changes twisted for the whole process,
    so it is the server's choice to call it; it does nothing for other servers.
    """
    from twisted.web import http as twisted_http

    twisted_http._parseContentType = _media_type


class OneHopASGIHandler(ASGIHandler):
    def __init__(self, *, size: int = 16) -> None:
        BaseHandler.__init__(self)
        self.load_middleware(is_async=False)
        self.free = [
            ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"taskhoster-http-{n}",
                initializer=name_os_thread,
                initargs=(f"taskhoster-http-{n}",),
            )
            for n in range(size)
        ]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"this handler serves HTTP, not {scope['type']}")
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        loop = asyncio.get_running_loop()
        own = not self.free
        executor = ThreadPoolExecutor(max_workers=1) if own else self.free.pop()
        try:
            response = await loop.run_in_executor(executor, self._respond, scope, body_file)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client went away while we sent
            finally:
                if response.streaming:
                    await loop.run_in_executor(executor, response.close)
        finally:
            body_file.close()
            if own:
                executor.shutdown(wait=False)
            else:
                self.free.append(executor)

    def _respond(self, scope: dict[str, Any], body_file: Any) -> HttpResponseBase:
        """Everything Django does with the request, in this thread (the event loop only
        reads the request and sends the response)."""
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error = self.create_request(scope, body_file)
        response = self.get_response(request) if request is not None else error
        assert response is not None
        response._handler_class = self.__class__  # type: ignore[attr-defined]
        if not response.streaming:
            response.close()  # its content is rendered; this sends request_finished here
        return response
