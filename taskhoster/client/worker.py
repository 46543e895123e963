"""A worker over the ``/work`` socket: one handler function per queue.

    worker = Worker(capacity=4)

    @worker.handler("emails")
    async def send(job: Job) -> dict:
        ...                      # return a result, or raise RetryableError / PermanentError
        return {"sent": True}

    worker.run()                 # until SIGINT or SIGTERM

What it does for the handlers (SPEC section 6):

- **capacity**: subscribes with ``capacity``; the server pushes at most that many items at once
  and every pushed item runs at once, as its own asyncio task (a plain function runs in a
  thread).
- **verdicts**: a returned value is sent as the ``result`` (it must be JSON); a
  :class:`RetryableError` as a retryable ``fail``, a :class:`PermanentError` as a ``fail`` with
  ``retry: false``; any other exception as a retryable ``fail`` (``retry_errors=False`` makes
  those permanent). A result the server refuses as too large becomes a permanent failure.
- **keepalive**: while a handler runs, the lease is extended each time half of it has gone
  (``extend_at``); if an extend is refused (the lease lapsed, the item is gone) the handler
  is cancelled, as the item is no longer this worker's.
- **cancel**: a ``cancel`` frame (the item was deleted or timed out) cancels the handler's task.
- **leases**: every ``result``, ``fail`` and ``extend`` carries the ``lease`` of the item frame
  the handler now answers for (an item that comes back to this socket while its handler still
  runs is adopted by that handler, under its new lease), so the server never applies one to
  an attempt the worker does not mean.
- **reconnect**: when the socket drops, the server re-queues what it held at once, so those
  handlers are cancelled; the worker reconnects with exponential backoff and jitter. A key or
  queue the server refuses (401, 403, no such queue) stops it with the typed error instead.
- **stop**: the first SIGINT or SIGTERM stops new items (capacity 0) and lets the running
  handlers finish for up to ``stop_timeout`` seconds; whatever still runs then, or at a second
  signal, is handed back by closing the socket (the server re-queues it at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import signal
import threading
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
from .models import parse_time

log = logging.getLogger("taskhoster.client.worker")

#: A handler takes the job and returns its result (a coroutine function, or a plain function
#: that is run in a thread).
Handler = Callable[["Job"], Any]

MAX_ERROR_CHARS = 10_000
#: Error frames that answer a subscribe: the worker cannot go on (unless it is stopping).
SUBSCRIBE_ERRORS = frozenset(
    {"invalid_queues", "invalid_capacity", "forbidden", "queue_not_found", "unauthorized"}
)
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403


@dataclass(frozen=True)
class Job:
    """One item pushed to this worker, as its handler sees it."""

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


class Worker:
    """Runs handlers for items pushed over ``/work``; see the module's text for the rules.

    ``url``/``key`` default as for :class:`Producer`. ``capacity``: items held at once.
    ``stop_timeout``: seconds a graceful stop waits for running handlers (0: hand back at
    once). ``retry_errors``: whether an unexpected exception is a retryable failure.
    ``extend_at``: the fraction of the lease after which it is extended.
    ``reconnect_delay``/``reconnect_max_delay``: the backoff between reconnects.
    """

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        capacity: int = 1,
        stop_timeout: float = 30.0,
        retry_errors: bool = True,
        extend_at: float = 0.5,
        reconnect_delay: float = 0.5,
        reconnect_max_delay: float = 30.0,
        ping_interval: float | None = 20.0,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if not 0 < extend_at < 1:
            raise ValueError("extend_at must be between 0 and 1")
        self.url = _http.resolve_url(url)
        self.key = _http.resolve_key(key)
        self.capacity = capacity
        self.stop_timeout = stop_timeout
        self.retry_errors = retry_errors
        self.extend_at = extend_at
        self.reconnect_delay = reconnect_delay
        self.reconnect_max_delay = reconnect_max_delay
        self.ping_interval = ping_interval
        self.handlers: dict[str, Handler] = {}
        self.connected = 0  # how many times a socket was opened and subscribed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._hand_back: asyncio.Event | None = None
        self._stop_asked: bool | None = None  # stop() before serve(): hand back?

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, queues={sorted(self.handlers)}, capacity={self.capacity})"

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
        if hand_back or self._stopping.is_set() or self.stop_timeout <= 0:
            self._hand_back.set()
        self._stopping.set()

    def _on_signal(self, signum: int) -> None:
        assert self._stopping is not None
        name = signal.Signals(signum).name
        if self._stopping.is_set():
            log.warning("%s again: handing back what this worker holds", name)
        else:
            log.warning(
                "%s: finishing the items in hand (up to %gs; send it again to hand them back)",
                name,
                self.stop_timeout,
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
                try:
                    leases = await self._lease_seconds(http)
                    async with connect(
                        ws_url(self.url),
                        additional_headers=_http.auth_headers(self.key),
                        max_size=None,
                        ping_interval=self.ping_interval,
                        open_timeout=30,
                    ) as ws:
                        failures = 0
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

    async def run(self) -> None:
        assert self.worker._stopping is not None
        await self.send(
            {"type": "subscribe", "queues": self.queues, "capacity": self.worker.capacity}
        )
        self.worker.connected += 1
        log.info(
            "connected to %s; serving %s with capacity %d",
            self.worker.url,
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
            await self.abandon("the socket closed")

    # -- frames out -----------------------------------------------------------------------

    async def send(self, frame: dict[str, Any]) -> None:
        async with self.lock:
            await self.ws.send(_encode(frame))

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send a result, fail or extend and wait for its ack (acks come in order)."""
        future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        future.add_done_callback(_retrieve)
        entry = (str(frame["id"]), future)
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
            elif kind == "ack":
                self.on_ack(frame)
            elif kind == "cancel":
                self.on_cancel(frame)
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
        entry.task = asyncio.create_task(self.run_job(entry, handler), name=f"taskhoster-{job.id}")
        self.running[job.id] = entry

    def on_ack(self, frame: dict[str, Any]) -> None:
        if not self.pending:
            log.warning("an ack for nothing sent: %r", frame)
            return
        item_id, future = self.pending.popleft()
        if frame.get("id") != item_id:
            log.warning("ack for %s while waiting for %s", frame.get("id"), item_id)
        if not future.done():
            future.set_result(frame)

    def on_cancel(self, frame: dict[str, Any]) -> None:
        entry = self.running.get(str(frame.get("id")))
        lease = frame.get("lease")
        if entry is not None and lease is not None and lease != entry.job.lease:
            return  # for another attempt of the item than the one this handler answers for
        if entry is not None and entry.task is not None and not entry.task.done():
            log.info("item %s: cancelled by the server (%s)", entry.job.id, frame.get("reason"))
            entry.stop_reason = f"cancelled: {frame.get('reason')}"
            entry.task.cancel()

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
            if frame is None:
                return
            try:
                ack = await self.request(frame)
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
        while True:
            await asyncio.sleep(max(0.0, due - self.loop.time()))
            sent = self.loop.time()
            try:
                ack = await self.request(_leased({"type": "extend", "id": entry.job.id}, entry.job))
            except (_Lost, SocketError):
                return
            if not ack.get("accepted"):
                log.warning(
                    "item %s: lost its lease (it lapsed, or the item is gone); "
                    "stopping its handler",
                    entry.job.id,
                )
                if entry.task is not None and not entry.task.done():
                    entry.stop_reason = "lease lost"
                    entry.task.cancel()
                return
            due = sent + extend_at * lease_left(parse_time(ack.get("leaseExpiresAt")), lease)

    # -- the end --------------------------------------------------------------------------

    async def drain(self, reader: asyncio.Task[None]) -> None:
        """Stop new items, let running handlers finish (up to stop_timeout), then return so
        the socket closes and hands back the rest."""
        assert self.worker._hand_back is not None
        self.draining = True
        try:
            await self.send({"type": "subscribe", "queues": self.queues, "capacity": 0})
        except ConnectionClosed:
            return
        hand_back = asyncio.create_task(self.worker._hand_back.wait())
        deadline = self.loop.time() + self.worker.stop_timeout
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
                entry.stop_reason = entry.stop_reason or reason
                entry.task.cancel()
                tasks.append(entry.task)
        if tasks:
            await asyncio.wait(tasks, timeout=10)


def _encode(frame: dict[str, Any]) -> str:
    """A frame as compact JSON, UTF-8 unescaped: a result of non-ASCII text is sent at its own
    size (escaped, it could grow sixfold past the server's frame limit, which counts the
    UTF-8 bytes)."""
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
