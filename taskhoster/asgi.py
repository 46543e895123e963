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

A post of items (its view's ``loop_methods``) is answered on the event loop itself, without
a thread, when ``taskhoster.api.loop_posts`` lets it: that module says when, and what happens
otherwise (the request is answered in a thread, from the start, as any other). This needs
middleware known neither to block nor to read the database (``LOOP_SAFE_MIDDLEWARE``); with
any other middleware every request goes to a thread. A post of one small item costs the
server about a quarter less CPU this way: the two thread hops per request, and the key's
lookup (the engine's group checks the key with the rest of its work) were most of what a post
cost beyond a plain request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.core import signals
from django.core.exceptions import DisallowedHost, RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.db import connections
from django.http import HttpResponseBase
from django.http.request import split_domain_port, validate_host
from django.urls import Resolver404, get_resolver, set_script_prefix

from . import bus, engine, health, startup
from .api import loop_posts
from .conf import get_conf
from .faults import fault, slow_seconds
from .keys import known_keys, parse_authorization, secret_hash
from .osthread import name_os_thread

log = logging.getLogger(__name__)

#: Middleware that may run on the event loop: each neither blocks nor reads the database for a
#: request that does not use the session or the user, nor reads a response's body
#: (``CommonMiddleware`` sets ``Content-Length``, which ``loop_posts.LaterResponse`` sets again),
#: nor changes the URLconf; unless ``SESSION_SAVE_EVERY_REQUEST`` or ``CSRF_USE_SESSIONS``
#: make the session middleware or the CSRF middleware read the session store for every
#: request (with either, every request goes to a thread).
LOOP_SAFE_MIDDLEWARE = frozenset(
    {
        "django.middleware.security.SecurityMiddleware",
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.common.CommonMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
        "django.middleware.clickjacking.XFrameOptionsMiddleware",
    }
)


def start() -> None:
    """Make the state root and start this process's committer now, rather than at the first
    operation that needs them (a committer process takes a moment to start). Call it once
    Django is set up, in the ASGI module.

    It also refuses a state root that another database indexes (``taskhoster.identity``), and
    starts the health monitor that ``/healthz`` is answered from at once.

    Optional: without it the committer starts itself on first use, and the state root is made
    with the first queue (until then ``/healthz`` reports it missing).
    """
    if engine.start_is_held():
        return  # the system checks are importing the ASGI module: nothing is started
    startup.start_engine()  # (done already where the ASGI module called it first)
    bus.listen_in_background()  # other processes' news: for long-polls and sockets alike
    health.monitor.start()  # /healthz from now on: at once, from its latest report
    health.own_port.start()  # and on HEALTH_LISTEN, if set
    # What is loaded by now (Django, the apps, the URL resolvers, every module) lives as long
    # as the process: out of the collector's sight, so that each full collection looks only
    # at what requests made. A full collection held the GIL for ~0.1 s, and every thread
    # (a /healthz on HEALTH_LISTEN among them) waited that long; with this the own port's
    # p99 went from 135-169 ms to 62-78 ms under 512 connections, and ~15% more posts were
    # accepted (bench/overload.py).
    gc.collect()
    gc.freeze()


#: The media types twisted parses a POST's body for (into ``request.args``, which daphne never
#: reads); ``_media_type`` names them as no form.
_FORM_TYPES = (b"application/x-www-form-urlencoded", b"multipart/form-data")


def _media_type(line: bytes) -> bytes:
    """The media type of a Content-Type header, without its parameters; a form's as a plain
    body's. Twisted parses a form's body before daphne hands the request on, and answers a
    multipart body that does not parse with a bare 400 of its own, no JSON error (I8): daphne
    never reads that parse, and the application answers such a body (415)."""
    media = line.split(b";", 1)[0].strip().lower()
    if media in _FORM_TYPES:
        return b"application/octet-stream"
    return media if b"/" in media else b"text/plain"


def skip_twisted_form_parsing() -> None:
    """Under daphne: make twisted read a request's Content-Type without the email package.

    Twisted parses every POST's Content-Type with the email package to look for a form
    submission, which daphne never reads (it hands the raw body to the application); that
    parse cost more than a fifth of a small JSON post. The replacement names no form at all,
    so twisted parses no form body either (nor answers one that does not parse by itself).
    It changes twisted for the whole process, so it is the server's choice to call it; it
    does nothing for other servers.
    """
    from twisted.web import http as twisted_http

    twisted_http._parseContentType = _media_type


#: A request to the API without a key may carry at most this much of a body: more is
#: refused (401) before it is read (``refuse_bodies_early``).
KEYLESS_BODY_BYTES = 64 * 1024


def refuse_bodies_early() -> None:
    """Under daphne: refuse a request body before reading it, when it will be refused anyway.

    Daphne reads a whole request body (into memory or a temporary file) before the
    application sees the request, so a 300 MB POST without a key was read whole just to be
    told 401, and a 60 MB one with a made-up key held the event loop for its length. With
    this, twisted answers at once, as soon as the headers are in, and closes the connection:

    - a body longer than the body limit (``Content-Length``, or a chunked body as it
      arrives): 413 ``too_large``;
    - a body over ``KEYLESS_BODY_BYTES`` to ``/api/`` without an ``Authorization: Token``
      header: 401 ``unauthorized``.

    A well-formed key is judged by the application, before the body is parsed
    (``keys.KnownKeys``, ``api.loop_posts``). Like ``skip_twisted_form_parsing`` it changes
    twisted for the whole process: it is the server's choice to call it.
    """
    from twisted.web import http as twisted_http

    channel = twisted_http.HTTPChannel
    if getattr(channel, "_taskhoster_refusing", False):
        return
    headers_done = channel.allHeadersReceived
    chunk = twisted_http.Request.handleContentChunk

    def all_headers_received(self: Any) -> None:
        headers_done(self)
        request = self.requests[-1] if self.requests else None
        if request is None:
            return
        limit = get_conf().max_body_bytes
        if self.length is not None and self.length > limit:
            _refuse_early(self, 413, "too_large", f"the request body is larger than {limit} bytes")
            return
        path = bytes(getattr(self, "_path", b"") or b"").split(b"?", 1)[0]  # (the request's
        # own uri is set only once its body is in)
        key = request.requestHeaders.getRawHeaders(b"authorization") or []
        if (
            (self.length or 0) > KEYLESS_BODY_BYTES
            and b"/api/" in path
            and not any(parse_authorization(v.decode("latin-1")) for v in key)
        ):
            _refuse_early(
                self,
                401,
                "unauthorized",
                "this needs an API key: send the header Authorization: Token <key>",
                [(b"www-authenticate", b"Token")],
            )

    def handle_content_chunk(self: Any, data: bytes) -> None:
        received = getattr(self, "_taskhoster_received", 0) + len(data)
        self._taskhoster_received = received
        limit = get_conf().max_body_bytes
        if received > limit:
            if not getattr(self, "_taskhoster_refused", False):
                self._taskhoster_refused = True
                _refuse_early(
                    self.channel, 413, "too_large", f"the request body is larger than {limit} bytes"
                )
            return
        chunk(self, data)

    channel.allHeadersReceived = all_headers_received  # type: ignore[method-assign]
    twisted_http.Request.handleContentChunk = handle_content_chunk  # type: ignore[method-assign]
    channel._taskhoster_refusing = True  # type: ignore[attr-defined]


def _refuse_early(
    channel: Any,
    status: int,
    code: str,
    message: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Answer on a twisted channel before the body is read, and close the connection."""
    if channel is None or getattr(channel, "transport", None) is None:
        return
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    reason = {401: b"Unauthorized", 413: b"Payload Too Large"}.get(status, b"Error")
    lines = [
        b"HTTP/1.1 %d %s" % (status, reason),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
        *(name + b": " + value for name, value in headers or []),
    ]
    channel.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
    channel.loseConnection()


# What a request is to the handler (``OneHopASGIHandler._kind``).
LOOP = "loop"
HEALTH = "health"
OVERLOADED_MESSAGE = (
    "the server is overloaded: posts wait for work already accepted; try again after the "
    "Retry-After seconds"
)


def _authorization(scope: dict[str, Any]) -> str | None:
    """The secret of the request's ``Authorization: Token <key>`` header, if it has one."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return parse_authorization(value.decode("latin-1"))
    return None


def _host_allowed_in(scope: dict[str, Any]) -> bool:
    """Whether Django would allow this request's Host header (``ALLOWED_HOSTS``)."""
    host = ""
    for name, value in scope.get("headers", []):
        if name == b"host":
            host = value.decode("latin-1")
            break
    if not host:
        server = scope.get("server")
        host = f"{server[0]}:{server[1]}" if server else ""
    domain, _port = split_domain_port(host)
    allowed = list(settings.ALLOWED_HOSTS)
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    return bool(domain) and validate_host(domain, allowed)


async def _send_json(
    send: Any,
    status: int,
    body: Any,
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    head: bool = False,
) -> None:
    content = json.dumps(body, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
                (b"cache-control", b"no-store"),
                (b"x-content-type-options", b"nosniff"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b"" if head else content})


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
        self.loop_safe = (
            set(settings.MIDDLEWARE) <= LOOP_SAFE_MIDDLEWARE
            and not getattr(settings, "SESSION_SAVE_EVERY_REQUEST", False)
            and not getattr(settings, "CSRF_USE_SESSIONS", False)
        )
        self.loop_paths: dict[str, str] = {}
        self.size = size
        self.extra = 0  # threads of their own, for requests beyond the pool's

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"this handler serves HTTP, not {scope['type']}")
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        try:
            kind = self._kind(scope)
            if kind == HEALTH and await self._health_at_once(scope, send):
                return
            if kind == LOOP:
                if fault("loop.stall"):
                    time.sleep(slow_seconds())  # a test's stand-in for an event loop flooded
                retry_after = engine.overloaded()
                if retry_after is not None:
                    await _send_json(
                        send,
                        503,
                        {"error": {"code": "overloaded", "message": OVERLOADED_MESSAGE}},
                        [(b"retry-after", f"{math.ceil(retry_after)}".encode())],
                    )
                    return
                response = await self._respond_on_loop(scope, body_file)
                if response is not None:
                    with contextlib.suppress(asyncio.CancelledError):  # the client went away
                        await self.send_response(response, send)
                    return
                body_file.seek(0)
            await self._respond_in_thread(scope, body_file, send)
        finally:
            body_file.close()

    async def _respond_in_thread(self, scope: dict[str, Any], body_file: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        own = not self.free
        if own and self.size + self.extra >= get_conf().max_request_threads:
            # Every thread is taken (long-polls hold theirs): refuse at once, never queue.
            message = "the server is overloaded: every request thread is busy; try again"
            await _send_json(
                send,
                503,
                {"error": {"code": "overloaded", "message": message}},
                [(b"retry-after", b"1")],
            )
            return
        if own:
            self.extra += 1
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
            if own:
                self.extra -= 1
                # A thread of the moment: its database connection goes with it, now (left to
                # the garbage collector, hundreds of descriptors stayed open after a burst).
                executor.submit(connections.close_all)
                executor.shutdown(wait=False)
            else:
                self.free.append(executor)

    def _kind(self, scope: dict[str, Any]) -> str:
        """What this request is to the handler: ``LOOP`` (its view answers its method on
        the loop), ``HEALTH`` (``/healthz``, answered from the health monitor), or ""."""
        method = str(scope.get("method", "")).lower()
        prefix = get_script_prefix(scope)  # as ASGIRequest finds its path_info
        path = f"{method} {prefix} {scope['path']}"
        known = self.loop_paths.get(path)
        if known is None:
            path_info = scope["path"].removeprefix(prefix) if prefix else scope["path"]
            try:
                match = get_resolver().resolve(path_info)
            except Resolver404:
                known = ""
            else:
                view = getattr(match.func, "view_class", None)
                if self.loop_safe and method in getattr(view, "loop_methods", ()):
                    known = LOOP
                elif method in ("get", "head") and getattr(view, "health_check", False):
                    known = HEALTH
                else:
                    known = ""
            if len(self.loop_paths) >= 10_000:  # one per queue and method: keep it bounded
                self.loop_paths.clear()
            self.loop_paths[path] = known
        return known

    async def _health_at_once(self, scope: dict[str, Any], send: Any) -> bool:
        """Answer ``/healthz`` from the health monitor's latest report, on the loop, ahead of
        every request queued for a thread or the committer. False (Django answers it) when
        there is no fresh report yet, or the Host is not one Django would allow."""
        found = health.monitor.current()
        if found is None or not _host_allowed_in(scope):
            return False
        healthy, body = found
        secret = _authorization(scope)
        if secret is None:
            body = health.public(body)
        else:
            hashed = secret_hash(secret)
            if hashed is None or hashed not in known_keys:
                return False  # a key to judge: Django's view does, with the database
        await _send_json(send, 200 if healthy else 503, body, head=scope.get("method") == "HEAD")
        return True

    async def _respond_on_loop(
        self, scope: dict[str, Any], body_file: Any
    ) -> HttpResponseBase | None:
        """The answer made on the loop (``api.loop_posts``), or None: a thread is to answer,
        from the start."""
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        finished = False
        try:
            request, _error = self.create_request(scope, body_file)
            if request is None or not self._host_allowed(request):
                return None
            if not loop_posts.admit(request):
                return None  # a key to judge before the body is read
            response = self.get_response(request)
            later = loop_posts.handed_on(request)
            if later is None:
                return None  # the view did not hand the post on (``RunInThread``)
            if later is not response:
                log.error(
                    "middleware failed on the way out of %s (it answered %s); the work was "
                    "handed on, so its own answer is sent",
                    request.path,
                    response.status_code,
                )
            try:
                await later.complete()
            except loop_posts.RunInThreadError:
                return None  # nothing was done: the thread answers from the start
            later._handler_class = self.__class__  # type: ignore[attr-defined]
            finished = True
            later.close()  # this sends request_finished
            return later
        finally:
            if not finished:
                # Not response.close(): that would close the request's body, which the thread
                # reads again.
                signals.request_finished.send(sender=self.__class__)

    @staticmethod
    def _host_allowed(request: Any) -> bool:
        """Whether the Host header is allowed (else the thread answers it, and logs it once)."""
        try:
            request.get_host()
        except DisallowedHost:
            return False
        return True

    def _respond(self, scope: dict[str, Any], body_file: Any) -> HttpResponseBase:
        """Everything Django does with the request, in a thread (the event loop only reads
        the request and sends the response)."""
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error = self.create_request(scope, body_file)
        response = self.get_response(request) if request is not None else error
        assert response is not None
        response._handler_class = self.__class__  # type: ignore[attr-defined]
        if not response.streaming:
            response.close()  # its content is rendered; this sends request_finished here
        return response
