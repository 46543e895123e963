"""A worker over the ``/work`` socket: one handler function per queue.

    worker = Worker(capacity=4)

    @worker.handler("emails")
    async def send(job: Job) -> dict:
        job.progress({"step": "rendering"})     # the item's progress, for whoever reads it
        ...                      # return a result, or raise RetryableError / PermanentError
        return {"sent": True}

    worker.run()                 # until SIGINT, SIGTERM or a drain

What it does for the handlers (SPEC sections 6 and 8.2):

- **capacity**: subscribes with ``capacity``; the server pushes at most that many items at once
  and every pushed item runs at once, as its own asyncio task (a plain function runs in a
  thread).
- **name**: subscribes with ``name`` (default ``host:pid``), which ``GET /api/workers`` and
  ``taskhoster workers`` show and ``drain --prefix`` matches.
- **verdicts**: a returned value is sent as the ``result`` (it must be JSON); a
  :class:`RetryableError` as a retryable ``fail``, a :class:`PermanentError` as a ``fail`` with
  ``retry: false``; any other exception as a retryable ``fail`` (``retry_errors=False`` makes
  those permanent). A result the server refuses as too large becomes a permanent failure.
- **progress**: ``job.progress(value)`` (any JSON of at most 4 KiB; from an async handler or a
  plain function's thread) sends a ``progress`` frame without waiting for it; reports made
  while one is on its way are coalesced, the latest wins. It does not extend the lease.
- **keepalive**: while a handler runs, the lease is extended each time half of it has gone
  (``extend_at``); if an extend is refused (the lease lapsed, the item is gone) the handler
  is stopped, as the item is no longer this worker's.
- **cancel**: a ``cancel`` frame (the item was cancelled, deleted or timed out, or another
  attempt's result finished it) stops the handler: an async handler's task is cancelled; a
  plain function, which Python cannot interrupt, sees ``job.cancelled`` turn true (or
  ``job.wait_cancelled(seconds)`` return true) and should return. Whatever a stopped handler
  returns or raises is dropped: no result or fail is sent for that item.
- **the database away**: a verdict or an extend the server answers ``unavailable`` (nothing
  was done) is sent again, 0.5 s later, then 1 s, ... up to 5 s apart, while the socket is
  open.
- **leases**: every ``result``, ``fail``, ``extend`` and ``progress`` carries the ``lease`` of
  the item frame the handler now answers for (an item that comes back to this socket while
  its handler still runs is adopted by that handler, under its new lease), so the server never
  applies one to an attempt the worker does not mean.
- **reconnect**: when the socket drops, the server re-queues what it held at once, so those
  handlers are stopped; the worker reconnects with exponential backoff and jitter. The
  backoff starts again from ``reconnect_delay`` only after a socket that stayed open
  ``STABLE_SOCKET_SECONDS``: a server that accepts the handshake and closes at once (its
  database away: 4503; an internal error: 4500) is not asked again every half second by
  every worker. A key or queue the server refuses (401, 403, no such queue) stops it with
  the typed error instead.
- **batch** (optional, default 1): with ``batch=N`` over 1 the worker subscribes with the
  socket's ``batch`` extension: the server may push up to N items in one ``items`` frame, and
  the results that handlers return within a turn or two of the event loop go back in one
  ``results`` frame (a result of more than 16 KiB of JSON still goes alone; a ``fail`` always
  goes alone). That saves the server and the worker a frame each way per item. A server
  older than the extension refuses the subscribe (``unknown_field``), and the worker stops
  with that ``SocketError``: leave it at 1 against one. A ``results`` frame the server
  refuses whole is sent again one result at a time, so each result meets the fate it would
  have met alone.
- **stop and drain**: the first SIGINT or SIGTERM (with ``run()``, or ``serve(handle_signals=
  True)``), a ``drain`` frame from the server (``POST /api/workers/{id}/drain``) or
  :meth:`Worker.stop` take no new items (capacity 0) and let the running handlers finish for
  up to ``grace`` seconds; then the socket closes and the worker returns. Whatever still runs
  at the end of the grace, or at a second signal, is left: closing the socket hands it back
  (the server re-queues it at once) and its handler is stopped as for a cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from . import _http
from .errors import (
    ConfigError,
    ConnectionFailed,
    Forbidden,
    NotFound,
    PermanentError,
    RetryableError,
    ServerError,
    SocketError,
    Unauthorized,
    api_error,
)
from .models import WORKER_NAME_MAX_CHARS, parse_time, progress_size

log = logging.getLogger("taskhoster.client.worker")

#: A handler takes the job and returns its result (a coroutine function, or a plain function
#: that is run in a thread).
Handler = Callable[["Job"], Any]

MAX_ERROR_CHARS = 10_000
#: Error frames that answer a subscribe: the worker cannot go on (unless it is stopping).
SUBSCRIBE_ERRORS = frozenset(
    {
        "invalid_queues",
        "invalid_capacity",
        "invalid_batch",
        "forbidden",
        "queue_not_found",
        "unauthorized",
        # Only the subscribe can carry a field a server does not know: ``batch``, to a
        # server older than it. Left alone, the worker would hold an idle socket forever.
        "unknown_field",
    }
)
#: A result of more JSON than this (in UTF-8 bytes) goes alone, never in a ``results`` frame
#: (``batch``): a frame of gathered results stays far below any server's frame limit (the
#: largest payload and 64 KiB).
GATHERED_RESULT_BYTES = 16 * 1024
GATHERED_FRAME_BYTES = 48 * 1024
#: A socket that stayed open this long starts the reconnect backoff again from its first
#: delay when it drops; one closed sooner (the server accepted its handshake, then refused
#: its subscribe or failed) counts as a failed connect, and the next delay doubles.
STABLE_SOCKET_SECONDS = 10.0
#: A verdict (or an extend) the server answered ``unavailable`` (its database away; nothing
#: was done) is sent again after this long, doubling up to the most.
VERDICT_RETRY_SECONDS = 0.5
VERDICT_RETRY_MOST_SECONDS = 5.0
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403


class _JobState:
    """What a job's handler shares with the session running it: whether it should stop, and
    where its progress goes. Shared by every copy of the job (an item that came back under a
    new lease is the same job to its handler)."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.reason: str | None = None
        # Set by the session while the handler runs; safe to call from any thread.
        self.report: Callable[[Any], None] | None = None

    def stop(self, reason: str) -> None:
        if not self.stopped.is_set():
            self.reason = reason
            self.stopped.set()


@dataclass(frozen=True)
class Job:
    """One item pushed to this worker, as its handler sees it.

    ``cancelled`` turns true when the item is no longer this worker's to finish (see
    :attr:`cancelled`); ``progress(value)`` reports how far the handler has got.
    """

    id: str
    queue: str
    payload: Any
    attempts: int
    thread_id: str | None
    scheduled_at: datetime | None
    lease_expires_at: datetime | None
    lease: str
    priority: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _state: _JobState = field(default_factory=_JobState, repr=False, compare=False)

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> Job:
        return cls(
            id=str(frame["id"]),
            queue=str(frame["queue"]),
            payload=frame.get("payload"),
            attempts=int(frame.get("attempts") or 0),
            thread_id=frame.get("threadId"),
            scheduled_at=parse_time(frame.get("scheduledAt")),
            lease_expires_at=parse_time(frame.get("leaseExpiresAt")),
            lease=str(frame.get("lease") or ""),
            priority=int(frame.get("priority") or 0),  # a server before priorities: 0
            raw=frame,
        )

    @property
    def cancelled(self) -> bool:
        """True once the handler should stop: the server cancelled the item (a producer's
        cancel, a delete, its queue's timeout, or another attempt's result finished it),
        its lease was lost, or the worker handed it back (a dropped socket, the end of a stop's
        grace). An async handler's task is cancelled then too; a plain function (run in a
        thread, which cannot be interrupted) should look at this between steps and return.
        What a stopped handler returns or raises is dropped."""
        return self._state.stopped.is_set()

    @property
    def cancel_reason(self) -> str | None:
        """Why it was stopped: the server's reason (``cancelled``, ``deleted``, ``timeout``,
        ``finished``), ``lease lost``, or ``handed back``; None while it runs."""
        return self._state.reason

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block for up to ``timeout`` seconds (None: until then) or until the job is
        cancelled; whether it is. For a plain-function handler, in place of ``time.sleep``;
        never from an async handler (it would block the worker's event loop)."""
        return self._state.stopped.wait(timeout)

    def progress(self, value: Any) -> None:
        """Report the handler's progress: the item's ``progress`` becomes ``value`` (any
        JSON, at most 4 KiB of it) while it is processing. Sent at once and not waited for,
        from an async handler or a plain function alike; reports made while one is on its
        way are coalesced (the latest wins). Raises ValueError (TypeError) at once for a value
        that is too large or not JSON. Does nothing once the job is cancelled or outside a
        worker."""
        progress_size(value)
        report = self._state.report
        if report is not None and not self._state.stopped.is_set():
            report(value)


class _Lost(Exception):
    """The socket closed before the server answered."""


class _Dropped(Exception):
    """The socket ended (the server closed it, or the connection broke)."""


def ws_url(url: str) -> str:
    if url.startswith("https://"):
        return "wss://" + url[len("https://") :] + "/work"
    return "ws://" + url[len("http://") :] + "/work"


def lease_left(expires: datetime | None, lease_seconds: float) -> float:
    """Seconds of lease this worker may count on: ``lease_seconds``, or less if the server's
    ``leaseExpiresAt`` says so by this machine's clock (a skewed clock is not believed)."""
    if expires is None:
        return lease_seconds
    wall = (expires - datetime.now(UTC)).total_seconds()
    if wall <= 0 or wall >= lease_seconds:
        return lease_seconds
    return max(wall, lease_seconds / 2)


def _describe(exc: BaseException, *, bare: bool) -> str:
    text = str(exc) if bare and str(exc) else f"{type(exc).__name__}: {exc}".rstrip(": ")
    return text[-MAX_ERROR_CHARS:]


def _is_async(handler: Handler) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(handler):
        return True
    return not inspect.isroutine(handler) and inspect.iscoroutinefunction(type(handler).__call__)


def _leased(frame: dict[str, Any], job: Job) -> dict[str, Any]:
    """The frame with the lease of the item frame it answers (none if the server sent none)."""
    if job.lease:
        frame["lease"] = job.lease
    return frame


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass
class _Running:
    job: Job
    received: float
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None
    answering: bool = False  # its verdict is being sent: no more progress
    progress: Any = None  # the latest progress not yet sent, while ``progress_due``
    progress_due: bool = False
    progress_sender: asyncio.Task[None] | None = None

    def stop(self, reason: str) -> None:
        """Stop its handler: the item is no longer this worker's (``reason`` says why)."""
        self.stop_reason = self.stop_reason or reason
        self.job._state.stop(reason)
        if self.task is not None and not self.task.done():
            self.task.cancel()


_CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f]")


def default_name() -> str:
    """``host:pid``: what ``taskhoster workers`` shows for a worker given no name."""
    name = _CONTROL_CHARACTERS.sub("", f"{socket.gethostname()}:{os.getpid()}")
    return name[-WORKER_NAME_MAX_CHARS:]


class Worker:
    """Runs handlers for items pushed over ``/work``; see the module's text for the rules.

    ``url``/``key`` default as for :class:`Producer`. ``capacity``: items held at once.
    ``name``: how operators see it (1-200 printable characters; default ``host:pid``).
    ``grace``: seconds a graceful stop or a drain waits for running handlers (0: hand back
    at once); ``stop_timeout`` is its older name. ``retry_errors``: whether an unexpected
    exception is a retryable failure. ``extend_at``: the fraction of the lease after which
    it is extended. ``reconnect_delay``/``reconnect_max_delay``: the backoff between
    reconnects. ``batch``: items per pushed frame, and results gathered per frame (above).
    """

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        capacity: int = 1,
        name: str | None = None,
        grace: float = 30.0,
        stop_timeout: float | None = None,
        retry_errors: bool = True,
        extend_at: float = 0.5,
        reconnect_delay: float = 0.5,
        reconnect_max_delay: float = 30.0,
        ping_interval: float | None = 20.0,
        batch: int = 1,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if batch < 1:
            raise ValueError("batch must be at least 1")
        if not 0 < extend_at < 1:
            raise ValueError("extend_at must be between 0 and 1")
        if name is not None and (
            not 0 < len(name) <= WORKER_NAME_MAX_CHARS or _CONTROL_CHARACTERS.search(name)
        ):
            raise ValueError(
                f"a worker's name is 1-{WORKER_NAME_MAX_CHARS} printable characters: {name!r}"
            )
        self.url = _http.resolve_url(url)
        self.key = _http.resolve_key(key)
        self.capacity = capacity
        self.name = name if name is not None else default_name()
        self.grace = grace if stop_timeout is None else stop_timeout
        self.retry_errors = retry_errors
        self.extend_at = extend_at
        self.reconnect_delay = reconnect_delay
        self.reconnect_max_delay = reconnect_max_delay
        self.ping_interval = ping_interval
        self.batch = batch
        self.handlers: dict[str, Handler] = {}
        self.connected = 0  # how many times a socket was opened and subscribed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._hand_back: asyncio.Event | None = None
        self._stop_asked: bool | None = None  # stop() before serve(): hand back?

    def __repr__(self) -> str:
        return (
            f"Worker({self.url!r}, name={self.name!r}, queues={sorted(self.handlers)}, "
            f"capacity={self.capacity})"
        )

    @property
    def stop_timeout(self) -> float:
        """The older name of ``grace``."""
        return self.grace

    @property
    def stopping(self) -> bool:
        """Whether it is stopping (a signal, :meth:`stop` or a drain): it takes no new items
        and returns once those it holds are done or the grace is over."""
        return self._stopping is not None and self._stopping.is_set()

    # -- set up ---------------------------------------------------------------------------

    def handler(self, queue: str) -> Callable[[Handler], Handler]:
        """Decorator: ``fn`` handles the items of ``queue``."""

        def register(fn: Handler) -> Handler:
            self.add_handler(queue, fn)
            return fn

        return register

    def add_handler(self, queue: str, fn: Handler) -> None:
        self.handlers[queue] = fn

    # -- run and stop ---------------------------------------------------------------------

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM (blocking; installs the signal handlers)."""
        asyncio.run(self.serve(handle_signals=True))

    def stop(self, *, hand_back: bool = False) -> None:
        """Stop gracefully (or hand back at once); safe from any thread."""
        loop = self._loop
        if loop is None or self._stopping is None:
            self._stop_asked = hand_back or bool(self._stop_asked)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._request_stop(hand_back)
        else:
            loop.call_soon_threadsafe(self._request_stop, hand_back)

    def _request_stop(self, hand_back: bool) -> None:
        assert self._stopping is not None
        assert self._hand_back is not None
        if hand_back or self._stopping.is_set() or self.grace <= 0:
            self._hand_back.set()
        self._stopping.set()

    def _on_drain(self) -> None:
        """The server drained this worker's socket: stop as for a first signal (a drain
        during a stop changes nothing)."""
        assert self._stopping is not None
        if self._stopping.is_set():
            return
        log.warning(
            "drained by the server: finishing the items in hand (up to %gs), then stopping",
            self.grace,
        )
        self._request_stop(hand_back=False)

    def _on_signal(self, signum: int) -> None:
        assert self._stopping is not None
        name = signal.Signals(signum).name
        if self._stopping.is_set():
            log.warning("%s again: handing back what this worker holds", name)
        else:
            log.warning(
                "%s: finishing the items in hand (up to %gs; send it again to hand them back)",
                name,
                self.grace,
            )
        self._request_stop(hand_back=False)

    async def serve(self, *, handle_signals: bool = False) -> None:
        """Serve until :meth:`stop` (or a signal, with ``handle_signals``). Raises the typed
        error if the server refuses the key or a queue; reconnects after anything else."""
        if not self.handlers:
            raise ConfigError("no handlers: register one with @worker.handler(queue)")
        self._loop = asyncio.get_running_loop()
        self._stopping, self._hand_back = asyncio.Event(), asyncio.Event()
        if self._stop_asked is not None:
            self._request_stop(self._stop_asked)
        installed: list[signal.Signals] = []
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._loop.add_signal_handler(sig, self._on_signal, sig)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    pass
        try:
            await self._serve()
            log.info("stopped")
        finally:
            for sig in installed:
                self._loop.remove_signal_handler(sig)
            self._stop_asked = None
            self._loop = None

    async def _serve(self) -> None:
        assert self._stopping is not None
        failures = 0
        async with httpx.AsyncClient(
            base_url=self.url, headers=_http.auth_headers(self.key), timeout=30
        ) as http:
            while not self._stopping.is_set():
                opened: float | None = None
                try:
                    leases = await self._lease_seconds(http)
                    async with connect(
                        ws_url(self.url),
                        additional_headers=_http.auth_headers(self.key),
                        max_size=None,
                        ping_interval=self.ping_interval,
                        open_timeout=30,
                    ) as ws:
                        opened = time.monotonic()
                        await _Session(self, ws, leases).run()
                except InvalidStatus as exc:
                    code = exc.response.status_code
                    if code in (401, 403, 404):
                        raise api_error(
                            code, "refused", f"the /work socket was refused: {exc}"
                        ) from exc
                    log.warning("the /work socket was refused (%s); retrying", exc)
                except InvalidURI as exc:
                    raise ConfigError(f"bad server address {self.url!r}: {exc}") from exc
                except ConnectionClosed as exc:
                    self._raise_if_refused(exc)
                    log.warning("the /work socket closed (%s)", exc)
                except (_Dropped, ConnectionFailed, ServerError) as exc:
                    log.warning("%s", exc)
                except (OSError, TimeoutError, InvalidHandshake) as exc:
                    log.warning("could not reach %s: %s", self.url, exc or type(exc).__name__)
                if self._stopping.is_set():
                    break
                if opened is not None and time.monotonic() - opened >= STABLE_SOCKET_SECONDS:
                    failures = 0
                delay = _http.retry_delay(failures, self.reconnect_delay, self.reconnect_max_delay)
                failures += 1
                log.info("reconnecting in %.1fs", delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)

    @staticmethod
    def _raise_if_refused(exc: ConnectionClosed) -> None:
        code = exc.rcvd.code if exc.rcvd is not None else None
        reason = exc.rcvd.reason if exc.rcvd is not None else ""
        if code == CLOSE_UNAUTHORIZED:
            raise Unauthorized(reason or "the key was refused", code="unauthorized") from exc
        if code == CLOSE_FORBIDDEN:
            raise Forbidden(reason or "the key lacks the work scope", code="forbidden") from exc

    async def _lease_seconds(self, http: httpx.AsyncClient) -> dict[str, float]:
        """Each queue's lease (the keepalive's clock); checks that the key may use them."""
        leases: dict[str, float] = {}
        for name in self.handlers:
            call = _http.get_queue(name)
            attempt = _http.Attempt(call, retries=0)
            try:
                response = await http.get(call.path)
            except httpx.TransportError as exc:
                attempt.on_transport_error(exc)  # raises ConnectionFailed
                raise
            leases[name] = attempt.read(response).lease_seconds
        return leases

    async def _call(self, handler: Handler, job: Job) -> Any:
        if _is_async(handler):
            return await handler(job)
        value = await asyncio.to_thread(handler, job)
        if inspect.isawaitable(value):
            value = await value
        return value


class _Session:
    """One socket, from subscribe to close."""

    def __init__(self, worker: Worker, ws: ClientConnection, leases: dict[str, float]) -> None:
        self.worker = worker
        self.ws = ws
        self.leases = leases
        self.loop = asyncio.get_running_loop()
        self.queues = list(worker.handlers)
        self.pending: deque[tuple[str, asyncio.Future[dict[str, Any]]]] = deque()
        self.lock = asyncio.Lock()
        self.running: dict[str, _Running] = {}
        self.draining = False
        self.closed = False
        # Results waiting to go out together (``batch``), with what waits for each one's ack
        # and their size; the tasks sending them.
        self.gathered: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]], int]] = []
        self.sending: set[asyncio.Future[None]] = set()

    async def run(self) -> None:
        assert self.worker._stopping is not None
        await self.send(self.subscribe(self.worker.capacity))
        self.worker.connected += 1
        log.info(
            "connected to %s as %s; serving %s with capacity %d",
            self.worker.url,
            self.worker.name,
            ", ".join(self.queues),
            self.worker.capacity,
        )
        reader = asyncio.create_task(self.read())
        stopper = asyncio.create_task(self.worker._stopping.wait())
        try:
            done, _ = await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # raises what ended it
                raise _Dropped("the server closed the /work socket")
            await self.drain(reader)
        finally:
            stopper.cancel()
            reader.cancel()
            await self.abandon("handed back")

    # -- frames out -----------------------------------------------------------------------

    def subscribe(self, capacity: int) -> dict[str, Any]:
        frame: dict[str, Any] = {
            "type": "subscribe",
            "queues": self.queues,
            "capacity": capacity,
            "name": self.worker.name,
        }
        if self.worker.batch > 1:
            frame["batch"] = self.worker.batch
        return frame

    async def send(self, frame: dict[str, Any]) -> None:
        async with self.lock:
            await self.ws.send(_encode(frame))

    async def request(self, frame: dict[str, Any], *, key: str | None = None) -> dict[str, Any]:
        """Send a result, fail or extend and wait for its ack (acks come in order); a
        ``results`` frame (``key`` "results") waits for its acks frame."""
        future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        future.add_done_callback(_retrieve)
        entry = (key or str(frame["id"]), future)
        async with self.lock:
            if self.closed:
                raise _Lost()
            self.pending.append(entry)
            try:
                await self.ws.send(_encode(frame))
            except ConnectionClosed:
                with contextlib.suppress(ValueError):
                    self.pending.remove(entry)
                raise _Lost() from None
        return await future

    async def answer(self, frame: dict[str, Any]) -> dict[str, Any]:
        """``request`` for a verdict; with ``batch``, a small result waits for the other
        results of this turn of the loop (and the next) and goes out with them."""
        if self.worker.batch <= 1 or frame["type"] != "result":
            return await self.request(frame)
        size = _utf8_size(frame)
        if size > GATHERED_RESULT_BYTES:
            return await self.request(frame)
        future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        future.add_done_callback(_retrieve)
        self.gathered.append((frame, future, size))
        if len(self.gathered) == 1:
            self.loop.call_soon(self._send_gathered_soon)
        return await future

    def _send_gathered_soon(self) -> None:
        task = asyncio.ensure_future(self.send_gathered())
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def send_gathered(self) -> None:
        """Send the gathered results: ``results`` frames of at most GATHERED_FRAME_BYTES
        (a ``result`` frame for one alone), all at once, their acks in order. A result whose
        handler was stopped meanwhile (a cancel: its future is cancelled) is not sent."""
        gathered = [entry for entry in self.gathered if not entry[1].done()]
        self.gathered = []
        chunks: list[list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]]] = [[]]
        size = 0
        for frame, future, length in gathered:
            if chunks[-1] and size + length > GATHERED_FRAME_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append((frame, future))
            size += length
        await asyncio.gather(*(self._send_chunk(chunk) for chunk in chunks if chunk))

    async def _send_chunk(
        self, chunk: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]]
    ) -> None:
        if len(chunk) == 1:
            await _settle(chunk[0][1], self.request(chunk[0][0]))
            return
        results = [{k: v for k, v in frame.items() if k != "type"} for frame, _f in chunk]
        try:
            acks = await self.request({"type": "results", "results": results}, key="results")
        except SocketError:
            # Refused whole (which changed nothing): each alone, to meet its own fate.
            await asyncio.gather(*(_settle(f, self.request(frame)) for frame, f in chunk))
            return
        except (Exception, asyncio.CancelledError) as exc:
            for _frame, future in chunk:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, _Lost) else _Lost())
            return
        try:
            for (_frame, future), ack in zip(chunk, acks.get("acks", []), strict=False):
                if future.done():
                    continue
                error = ack.get("error")
                if error:
                    future.set_exception(
                        SocketError(str(error.get("message")), code=str(error.get("code")))
                    )
                else:
                    future.set_result({"type": "ack", **ack})
        finally:
            for _frame, future in chunk:
                if not future.done():  # no (readable) ack for it: the server's fault
                    future.set_exception(SocketError("no ack came for this result", code="no_ack"))

    # -- frames in ------------------------------------------------------------------------

    async def read(self) -> None:
        async for text in self.ws:
            try:
                frame = json.loads(text)
                kind = frame["type"]
            except (ValueError, TypeError, KeyError):
                log.warning("ignoring a frame that is not understood: %.200r", text)
                continue
            if kind == "item":
                self.on_item(frame)
            elif kind == "items":
                for entry in frame.get("items", []):
                    self.on_item({"type": "item", **entry})
            elif kind in ("ack", "acks"):
                self.on_ack(frame)
            elif kind == "cancel":
                self.on_cancel(frame)
            elif kind == "drain":
                self.worker._on_drain()
            elif kind == "error":
                self.on_error(frame)
            else:
                log.debug("ignoring a %r frame", kind)

    def on_item(self, frame: dict[str, Any]) -> None:
        job = Job.from_frame(frame)
        running = self.running.get(job.id)
        if running is not None:
            # Its lease lapsed and it came back to this socket while the handler still runs:
            # the socket holds it again under the new lease; keep the handler.
            running.job = replace(
                running.job,
                lease=job.lease,
                attempts=job.attempts,
                lease_expires_at=job.lease_expires_at,
            )
            running.received = self.loop.time()
            return
        if self.draining:
            log.info("item %s arrived while stopping: handing it back", job.id)
            return  # closing the socket re-queues it
        handler = self.worker.handlers.get(job.queue)
        if handler is None:  # not subscribed to it: cannot happen, but never hold it
            log.error("item %s of queue %s has no handler", job.id, job.queue)
            return
        entry = _Running(job=job, received=self.loop.time())
        job._state.report = self.reporter(entry)
        entry.task = asyncio.create_task(self.run_job(entry, handler), name=f"taskhoster-{job.id}")
        self.running[job.id] = entry

    def on_ack(self, frame: dict[str, Any]) -> None:
        if not self.pending:
            log.warning("an ack for nothing sent: %r", frame)
            return
        item_id, future = self.pending.popleft()
        if frame.get("id", "results") != item_id:
            log.warning("ack for %s while waiting for %s", frame.get("id"), item_id)
        if not future.done():
            future.set_result(frame)

    def on_cancel(self, frame: dict[str, Any]) -> None:
        entry = self.running.get(str(frame.get("id")))
        lease = frame.get("lease")
        if entry is not None and lease is not None and lease != entry.job.lease:
            return  # for another attempt of the item than the one this handler answers for
        if entry is not None and entry.task is not None and not entry.task.done():
            reason = str(frame.get("reason") or "cancelled")
            log.info("item %s: cancelled by the server (%s)", entry.job.id, reason)
            entry.stop(reason)

    def on_error(self, frame: dict[str, Any]) -> None:
        code, message = str(frame.get("code")), str(frame.get("message"))
        if code in SUBSCRIBE_ERRORS:
            if self.draining:
                log.warning("while stopping: %s: %s", code, message)
                return
            if code == "unauthorized":
                raise Unauthorized(message, code=code)
            if code == "forbidden":
                raise Forbidden(message, code=code)
            if code == "queue_not_found":
                raise NotFound(message, code=code)
            raise SocketError(message, code=code)
        if not self.pending:
            log.warning("error frame from the server: %s: %s", code, message)
            return
        _item_id, future = self.pending.popleft()
        if not future.done():
            future.set_exception(SocketError(message, code=code))

    # -- one job --------------------------------------------------------------------------

    async def run_job(self, entry: _Running, handler: Handler) -> None:
        job = entry.job
        try:
            frame = await self.outcome(entry, handler)
            if frame is None or entry.stop_reason is not None:
                # Stopped (cancelled, lease lost, handed back): the handler may have caught
                # the cancellation and returned, but the item is not this worker's to answer.
                return
            entry.answering = True
            try:
                ack = await self.answer_until_taken(frame)
            except SocketError as exc:
                if frame["type"] == "result" and exc.code in ("too_large", "item_not_found"):
                    if exc.code == "item_not_found":
                        log.info("item %s is gone; its result was dropped", job.id)
                        return
                    frame = self.fail_frame(
                        entry.job, f"the result is too large: {exc.message}", False
                    )
                    ack = await self.request(frame)
                else:
                    log.warning(
                        "item %s: the server refused the %s: %s", job.id, frame["type"], exc
                    )
                    return
            if ack.get("accepted") and frame["type"] == "fail":
                outcome = "will be retried" if ack.get("status") == "pending" else "failed"
                log.info("item %s (%s): %s: %s", job.id, job.queue, outcome, frame["error"])
            elif ack.get("accepted"):
                log.info("item %s (%s): %s", job.id, job.queue, ack.get("status"))
            else:
                log.info(
                    "item %s (%s): %s not accepted (already done or gone)",
                    job.id,
                    job.queue,
                    frame["type"],
                )
        except _Lost:
            log.info("item %s: the socket closed before its verdict was acked", job.id)
        finally:
            self.running.pop(job.id, None)

    async def answer_until_taken(self, frame: dict[str, Any]) -> dict[str, Any]:
        """``answer``, sent again while the server answers ``unavailable`` (its database is
        away, and the verdict changed nothing): after ``VERDICT_RETRY_SECONDS``, doubling up
        to ``VERDICT_RETRY_MOST_SECONDS``, for as long as the socket is open."""
        delay = VERDICT_RETRY_SECONDS
        while True:
            try:
                return await self.answer(frame)
            except SocketError as exc:
                if exc.code != "unavailable":
                    raise
                log.warning(
                    "item %s: the server could not take the %s now (%s); again in %.1f s",
                    frame.get("id"),
                    frame["type"],
                    exc,
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(2 * delay, VERDICT_RETRY_MOST_SECONDS)

    async def outcome(self, entry: _Running, handler: Handler) -> dict[str, Any] | None:
        """Run the handler under keepalive; the verdict frame, or None if it was stopped."""
        job = entry.job
        keepalive = asyncio.create_task(self.keepalive(entry))
        try:
            value = await self.worker._call(handler, job)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if entry.stop_reason is not None or (task is not None and task.cancelling()):
                raise
            return self.fail_frame(entry.job, "the handler was cancelled", True)
        except RetryableError as exc:
            return self.fail_frame(entry.job, _describe(exc, bare=True), True)
        except PermanentError as exc:
            return self.fail_frame(entry.job, _describe(exc, bare=True), False)
        except Exception as exc:
            log.exception("item %s (%s): the handler raised", job.id, job.queue)
            return self.fail_frame(entry.job, _describe(exc, bare=False), self.worker.retry_errors)
        finally:
            keepalive.cancel()
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            return self.fail_frame(entry.job, f"the result is not JSON: {exc}", False)
        # ``entry.job``, not ``job``: the item may have come back under a new lease meanwhile.
        return _leased({"type": "result", "id": job.id, "result": value}, entry.job)

    @staticmethod
    def fail_frame(job: Job, error: str, retry: bool) -> dict[str, Any]:
        frame = {"type": "fail", "id": job.id, "error": error[-MAX_ERROR_CHARS:], "retry": retry}
        return _leased(frame, job)

    async def keepalive(self, entry: _Running) -> None:
        lease = self.leases[entry.job.queue]
        extend_at = self.worker.extend_at
        due = entry.received + extend_at * lease_left(entry.job.lease_expires_at, lease)
        again = VERDICT_RETRY_SECONDS
        while True:
            await asyncio.sleep(max(0.0, due - self.loop.time()))
            sent = self.loop.time()
            try:
                ack = await self.request(_leased({"type": "extend", "id": entry.job.id}, entry.job))
            except SocketError as exc:
                if exc.code != "unavailable":
                    return
                due = self.loop.time() + again  # the database is away: again, less often
                again = min(2 * again, VERDICT_RETRY_MOST_SECONDS)
                continue
            except _Lost:
                return
            again = VERDICT_RETRY_SECONDS
            if not ack.get("accepted"):
                log.warning(
                    "item %s: lost its lease (it lapsed, or the item is gone); "
                    "stopping its handler",
                    entry.job.id,
                )
                entry.stop("lease lost")
                return
            due = sent + extend_at * lease_left(parse_time(ack.get("leaseExpiresAt")), lease)

    # -- progress -------------------------------------------------------------------------

    def reporter(self, entry: _Running) -> Callable[[Any], None]:
        """``job.progress`` of the entry's handler: safe from the handler's thread."""

        def report(value: Any) -> None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self.loop:
                self.queue_progress(entry, value)
                return
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to tell
                self.loop.call_soon_threadsafe(self.queue_progress, entry, value)

        return report

    def queue_progress(self, entry: _Running, value: Any) -> None:
        """Send ``value`` as the item's progress, after the report already on its way."""
        if entry.answering or entry.stop_reason is not None or self.closed:
            return
        entry.progress, entry.progress_due = value, True
        if entry.progress_sender is None or entry.progress_sender.done():
            entry.progress_sender = asyncio.create_task(self.send_progress(entry))

    async def send_progress(self, entry: _Running) -> None:
        while entry.progress_due and not entry.answering and entry.stop_reason is None:
            entry.progress_due = False
            value, entry.progress = entry.progress, None
            frame = {"type": "progress", "id": entry.job.id, "progress": value}
            try:
                ack = await self.request(_leased(frame, entry.job))
            except _Lost:
                return
            except SocketError as exc:
                log.warning("item %s: the server refused a progress report: %s", entry.job.id, exc)
                continue
            if not ack.get("accepted"):
                log.debug("item %s: progress not accepted (no longer held)", entry.job.id)

    # -- the end --------------------------------------------------------------------------

    async def drain(self, reader: asyncio.Task[None]) -> None:
        """Stop new items, let running handlers finish (up to the grace), then return so
        the socket closes and hands back the rest."""
        assert self.worker._hand_back is not None
        self.draining = True
        try:
            await self.send(self.subscribe(0))
        except ConnectionClosed:
            return
        hand_back = asyncio.create_task(self.worker._hand_back.wait())
        deadline = self.loop.time() + self.worker.grace
        try:
            while True:
                tasks = {e.task for e in self.running.values() if e.task is not None}
                remaining = deadline - self.loop.time()
                if not tasks or remaining <= 0 or hand_back.done() or reader.done():
                    break
                await asyncio.wait(
                    tasks | {reader, hand_back},
                    timeout=remaining,
                    return_when=asyncio.FIRST_COMPLETED,
                )
        finally:
            hand_back.cancel()
        if self.running:
            log.warning("handing back %d item(s): %s", len(self.running), ", ".join(self.running))

    async def abandon(self, reason: str) -> None:
        """The socket is going: the server re-queues what it holds, so stop its handlers."""
        self.closed = True
        while self.pending:
            _item_id, future = self.pending.popleft()
            if not future.done():
                future.set_exception(_Lost())
        tasks = []
        for entry in self.running.values():
            if entry.task is not None and not entry.task.done():
                entry.stop(reason)
                tasks.append(entry.task)
        if tasks:
            await asyncio.wait(tasks, timeout=10)


async def _settle(future: asyncio.Future[dict[str, Any]], request: Any) -> None:
    """Hand ``request``'s answer, or its error, to ``future``."""
    try:
        answer = await request
    except (Exception, asyncio.CancelledError) as exc:
        if not future.done():
            future.set_exception(exc if isinstance(exc, Exception) else _Lost())
    else:
        if not future.done():
            future.set_result(answer)


def _utf8_size(frame: dict[str, Any]) -> int:
    """The bytes of UTF-8 ``_encode`` makes of ``frame``."""
    return len(json.dumps(frame, ensure_ascii=False, separators=(",", ":")).encode())


def _encode(frame: dict[str, Any]) -> str:
    """A frame as compact JSON, UTF-8 unescaped: a result of non-ASCII text is sent at its own
    size (escaped, it could grow sixfold past the server's frame limit, which counts the
    UTF-8 bytes)."""
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
