"""ASGI middleware that runs each HTTP request's synchronous code on one of a fixed set of
long-lived threads.

Django runs a sync view in a thread made for that one request, so every request pays for
starting (and stopping) an OS thread and for opening a fresh database connection (on SQLite,
closing the last connection also checkpoints the WAL). Here a request borrows one of
``size`` single-thread executors for its whole life, so its thread, and that thread's
database connection, serve request after request. When all are busy (long-polls hold
theirs for up to a minute), a request falls back to Django's own thread-per-request, so
nothing ever waits for a free thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext


class PooledRequestThreads:
    def __init__(self, app: Any, *, size: int = 16) -> None:
        self.app = app
        self.free = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"taskhoster-http-{n}")
            for n in range(size)
        ]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.free:
            await self.app(scope, receive, send)
            return
        executor = self.free.pop()  # no await between the check and the pop: one loop thread
        try:
            async with ThreadSensitiveContext(executor=executor):
                await self.app(scope, receive, send)
        finally:
            self.free.append(executor)
