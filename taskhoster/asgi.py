"""Django's ASGI handler with a request's synchronous part run in one hop to a long-lived
thread.

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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.http import HttpResponseBase
from django.urls import set_script_prefix


class OneHopASGIHandler(ASGIHandler):
    def __init__(self, *, size: int = 16) -> None:
        BaseHandler.__init__(self)
        self.load_middleware(is_async=False)
        self.free = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"taskhoster-http-{n}")
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
