"""Producers: create queues, post items, read them and wait for their verdicts, and manage
schedules.

``Producer`` blocks; ``AsyncProducer`` has the same methods as coroutines. Both resend a call
after a connection error or a 502/503/504 when that is safe: reads, queue and schedule
updates, deletes, and posts, which always carry an idempotency key (one is made up when none
is given), so a post whose answer was lost is answered with the first post's item instead of
a duplicate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar, Unpack

import httpx

from . import _http
from ._http import _UNSET, Attempt, Call, Reply
from ._wire import AsyncWire, Wire, WireError, body_of, plain_http
from .errors import ItemFailed, WaitTimeout
from .models import (
    AttemptHistory,
    Item,
    ItemOptionFields,
    ItemOptions,
    QueueInfo,
    RateLimit,
    Schedule,
    WorkerInfo,
)

T = TypeVar("T")


class _Base:
    def __init__(
        self,
        url: str | None,
        key: str | None,
        *,
        timeout: float,
        retries: int,
        auto_key: bool,
    ) -> None:
        self.url = _http.resolve_url(url)
        self.key = _http.resolve_key(key)
        self.timeout = timeout
        self.retries = retries
        self.auto_key = auto_key

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class Producer(_Base):
    """A blocking client for the REST API.

    ``url`` defaults to ``$TASKHOSTER_URL`` or ``http://127.0.0.1:8000``; ``key`` to
    ``$TASKHOSTER_KEY`` or the key ``scripts/serve`` saved in ``var/credentials.json``.
    ``retries``: how many times a call is resent when that is safe. ``auto_key=False`` posts
    items without a made-up idempotency key (and then does not resend posts that may have
    arrived).

    An ``http://`` address is called with the standard library's HTTP
    (``taskhoster.client._wire``: some 40 % of httpx's CPU a call) unless an HTTP proxy is set;
    ``https://``, a proxy, or a ``transport`` (an httpx transport) go through httpx.
    """

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        auto_key: bool = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, key, timeout=timeout, retries=retries, auto_key=auto_key)
        self._wire: Wire | None = None
        self._client: httpx.Client | None = None
        if transport is None and plain_http(self.url):
            self._wire = Wire(self.url, _http.auth_headers(self.key))
        else:
            self._client = httpx.Client(
                base_url=self.url,
                headers=_http.auth_headers(self.key),
                timeout=timeout,
                transport=transport,
            )

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self, call: Call[T]) -> T:
        attempt = Attempt(call, self.retries)
        body = body_of(call.body) if call.has_body and self._wire is not None else None
        while True:
            try:
                response = self._send(call, body)
            except (httpx.TransportError, WireError) as exc:
                time.sleep(attempt.on_transport_error(exc))
                continue
            delay = attempt.on_answer(response)
            if delay is None:
                result: T = attempt.read(response)
                return result
            time.sleep(delay)

    def _send(self, call: Call[Any], body: bytes | None) -> Reply:
        if self._wire is not None:
            return self._wire.request(
                call.method,
                call.path,
                params=call.params,
                body=body,
                timeout=self.timeout + call.wait,
            )
        assert self._client is not None
        return self._client.request(
            call.method, call.path, **_http.request_kwargs(call, self.timeout)
        )

    # -- queues ---------------------------------------------------------------------------

    def put_queue(
        self,
        name: str,
        *,
        lease_seconds: float | None = None,
        queue_seconds: float | None = None,
        retain_seconds: float | None = None,
        retain_from: str | None = None,
        max_attempts: int | None = _UNSET,
        backoff_seconds: float | None = None,
        backoff_max_seconds: float | None = None,
        dead_letter_queue: str | None = _UNSET,
        paused: bool | None = None,
        max_processing: int | None = _UNSET,
        rate_limit: RateLimit | dict[str, Any] | None = _UNSET,
        thread_limit: int | None = None,
    ) -> QueueInfo:
        """Create the queue, or update the settings given (the others are kept).
        ``max_attempts=None`` means unlimited; ``dead_letter_queue=None`` means none.

        Flow control (SPEC section 8.1): ``paused`` (nothing is handed out while true),
        ``max_processing`` (at most this many items processing at once; None: no limit),
        ``rate_limit`` (a :class:`RateLimit`, or ``{"count": N, "seconds": S}``: at most N
        claims start in any S seconds; None: no limit) and ``thread_limit`` (at most this
        many members of one thread processing at once; 1 by default)."""
        settings = _http.queue_settings(
            lease_seconds=lease_seconds,
            queue_seconds=queue_seconds,
            retain_seconds=retain_seconds,
            retain_from=retain_from,
            max_attempts=max_attempts,
            backoff_seconds=backoff_seconds,
            backoff_max_seconds=backoff_max_seconds,
            dead_letter_queue=dead_letter_queue,
            paused=paused,
            max_processing=max_processing,
            rate_limit=rate_limit,
            thread_limit=thread_limit,
        )
        return self._run(_http.put_queue(name, settings))

    def pause(self, queue: str) -> QueueInfo:
        """Hand out nothing more of the queue (claims get no items, sockets no pushes) until
        :meth:`resume`; posts, verdicts and every clock go on. A PUT: it creates a queue
        that does not exist."""
        return self._run(_http.set_paused(queue, True))

    def resume(self, queue: str) -> QueueInfo:
        """Undo :meth:`pause`: waiting workers get the queue's items at once."""
        return self._run(_http.set_paused(queue, False))

    def queue(self, name: str) -> QueueInfo:
        """The queue's settings, counts and ``held`` counts."""
        return self._run(_http.get_queue(name))

    def queues(self) -> list[QueueInfo]:
        return self._run(_http.list_queues())

    def delete_queue(self, name: str) -> None:
        self._run(_http.delete_queue(name))

    # -- items ----------------------------------------------------------------------------

    def post(
        self,
        queue: str,
        payload: Any,
        *,
        options: ItemOptions | None = None,
        **fields: Unpack[ItemOptionFields],
    ) -> Item:
        """Post one item, with ``options`` or their fields as keywords (``thread_id=``,
        ``delay=`` or ``scheduled_at=``, ``key=``, ``priority=``; a keyword wins over
        ``options``). With a
        ``key`` whose item still exists in the queue, that item is returned instead of a new
        one."""
        body = _http.item_body(payload, ItemOptions.given(options, fields), self.auto_key)
        return self._run(_http.post_item(queue, body))

    def post_many(self, queue: str, items: Iterable[Any]) -> list[Item]:
        """Post many items (bare payloads, or :class:`NewItem` for options), in list order.
        Each request holds at most 1000 and is all or none."""
        posted: list[Item] = []
        for chunk in _http.batch_bodies(list(items), self.auto_key):
            batch: list[Item] = self._run(_http.post_batch(queue, chunk))
            posted.extend(batch)
        return posted

    def get(self, item_id: str) -> Item:
        return self._run(_http.get_item(item_id))

    def wait(self, item_id: str, timeout: float | None = None) -> Item:
        """The item once it is finished or failed (long-polls of at most 60 s each).
        Raises :class:`WaitTimeout` if it is not terminal within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            item = self._run(_http.get_item(item_id, _http.wait_slice(remaining)))
            if item.terminal:
                return item
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"item {item_id} is still {item.status}", item)

    def result(self, item_id: str, timeout: float | None = None) -> Any:
        """The item's result once it is finished; :class:`ItemFailed` if it failed."""
        item = self.wait(item_id, timeout)
        if item.failed:
            raise ItemFailed(item)
        return item.result

    def items(
        self,
        queue: str,
        *,
        status: str | None = None,
        thread_id: str | None = None,
        page_size: int | None = None,
    ) -> Iterator[Item]:
        """Every item of the queue in arrival order, page by page (without payloads)."""
        cursor: str | None = None
        while True:
            page, cursor = self._run(_http.list_items(queue, status, thread_id, cursor, page_size))
            yield from page
            if not cursor:
                return

    def delete(self, item_id: str) -> None:
        self._run(_http.delete_item(item_id))

    def delete_many(
        self, queue: str, *, ids: list[str] | None = None, status: str | None = None
    ) -> int:
        """Delete the given ids, or every item with the status; the number deleted."""
        return self._run(_http.delete_items(queue, ids, status))

    def restart(self, item_id: str) -> Item:
        """A failed item posted again as a new arrival (409 Conflict unless failed)."""
        return self._run(_http.restart_item(item_id))

    # -- work in flight (SPEC section 8.2) -------------------------------------------------

    def cancel(self, item_id: str, reason: str | None = None) -> Item:
        """Fail a pending or processing item now with error ``cancelled`` (``reason``, at
        most 500 characters, is kept as its ``cancel_reason``); the worker holding it is
        told to stop, and its later verdict is refused. :class:`Conflict` (code
        ``terminal``) if it is already finished or failed."""
        return self._run(_http.cancel_item(item_id, reason))

    def attempts(self, item_id: str) -> AttemptHistory:
        """The item's claims, oldest first: who took it, when, and how each ended."""
        return self._run(_http.item_attempts(item_id))

    def workers(self) -> list[WorkerInfo]:
        """Every connected ``/work`` socket, of every server process (needs ``manage``)."""
        return self._run(_http.list_workers())

    def drain_worker(self, worker_id: str) -> WorkerInfo:
        """Push nothing more to this worker and tell it to finish what it holds and close
        (needs ``manage``); :class:`NotFound` if it is not connected."""
        return self._run(_http.drain_worker(worker_id))

    def drain_workers(self, name_prefix: str) -> list[WorkerInfo]:
        """Drain every worker whose name starts with ``name_prefix`` (a deploy: the host's
        name, say); the workers drained, none if no name matched."""
        return self._run(_http.drain_workers(name_prefix))

    def report_progress(self, item_id: str, lease: str, progress: Any) -> bool:
        """For a worker that claimed over REST (needs ``work``): the item's ``progress`` is
        now ``progress`` (any JSON of at most 4 KiB), if ``lease`` is still its lease;
        whether it was taken. It does not extend the lease. (A :class:`Worker`'s handler
        calls ``job.progress(value)`` instead.)"""
        return self._run(_http.report_progress(item_id, lease, progress))

    # -- schedules (SPEC section 8.3) -----------------------------------------------------

    def put_schedule(
        self,
        queue: str,
        name: str,
        *,
        cron: str | None = None,
        every: int | None = None,
        payload: Any = _UNSET,
        timezone: str | None = None,
        thread_id: str | None = _UNSET,
        priority: int | None = None,
        overlap: str | None = None,
        catchup_seconds: float | None = None,
        paused: bool | None = None,
    ) -> Schedule:
        """Create the schedule (``cron`` or ``every``, and ``payload``, are needed then), or
        change what is given (the rest is kept; ``thread_id=None`` means no thread). Needs
        ``manage``.

        ``cron``: five fields read in ``timezone`` (default UTC); ``every``: seconds between
        slots, counted from the Unix epoch. Each slot posts one item of ``payload`` (with
        ``thread_id`` and ``priority``) under the key ``schedule:<name>:<slot>``.
        ``overlap="skip"``: a slot posts nothing while the previous item is not terminal.
        ``catchup_seconds`` (default 60): a slot found late is posted if at most this late.
        A change of the timing, or a resume, starts again from the first slot after now."""
        settings = _http.schedule_settings(
            cron=cron,
            every=every,
            timezone=timezone,
            payload=payload,
            thread_id=thread_id,
            priority=priority,
            overlap=overlap,
            catchup_seconds=catchup_seconds,
            paused=paused,
        )
        return self._run(_http.put_schedule(queue, name, settings))

    def get_schedule(self, queue: str, name: str) -> Schedule:
        """The schedule, with its next and last slots; :class:`NotFound` (code
        ``schedule_not_found``) if there is none of that name."""
        return self._run(_http.get_schedule(queue, name))

    def list_schedules(self, queue: str, *, page_size: int | None = None) -> Iterator[Schedule]:
        """Every schedule of the queue, by name, page by page."""
        cursor: str | None = None
        while True:
            page, cursor = self._run(_http.list_schedules(queue, cursor, page_size))
            yield from page
            if not cursor:
                return

    def delete_schedule(self, queue: str, name: str) -> None:
        """Delete the schedule: none of its slots is posted from now on (the items it
        posted stay)."""
        self._run(_http.delete_schedule(queue, name))

    def pause_schedule(self, queue: str, name: str) -> Schedule:
        """Post none of the schedule's slots until :meth:`resume_schedule`."""
        return self._run(_http.set_schedule_paused(queue, name, True))

    def resume_schedule(self, queue: str, name: str) -> Schedule:
        """Undo :meth:`pause_schedule`: the first slot after now is the next one posted (the
        slots passed while paused are not)."""
        return self._run(_http.set_schedule_paused(queue, name, False))


class AsyncProducer(_Base):
    """:class:`Producer` for asyncio: the same methods, awaited (``items`` is an async
    iterator). Use it as ``async with AsyncProducer() as producer:`` or call ``aclose()``.
    As :class:`Producer`, it calls an ``http://`` address with the standard library
    (``taskhoster.client._wire``) unless an HTTP proxy is set; ``https://``, a proxy, or a
    ``transport`` (an httpx async transport) go through httpx."""

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        auto_key: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(url, key, timeout=timeout, retries=retries, auto_key=auto_key)
        self._wire: AsyncWire | None = None
        self._client: httpx.AsyncClient | None = None
        if transport is None and plain_http(self.url):
            self._wire = AsyncWire(self.url, _http.auth_headers(self.key))
        else:
            self._client = httpx.AsyncClient(
                base_url=self.url,
                headers=_http.auth_headers(self.key),
                timeout=timeout,
                transport=transport,
            )

    async def aclose(self) -> None:
        if self._wire is not None:
            self._wire.close()
        if self._client is not None:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _run(self, call: Call[T]) -> T:
        attempt = Attempt(call, self.retries)
        body = body_of(call.body) if call.has_body and self._wire is not None else None
        while True:
            try:
                response = await self._send(call, body)
            except (httpx.TransportError, WireError) as exc:
                await asyncio.sleep(attempt.on_transport_error(exc))
                continue
            delay = attempt.on_answer(response)
            if delay is None:
                result: T = attempt.read(response)
                return result
            await asyncio.sleep(delay)

    async def _send(self, call: Call[Any], body: bytes | None) -> Reply:
        if self._wire is not None:
            return await self._wire.request(
                call.method,
                call.path,
                params=call.params,
                body=body,
                timeout=self.timeout + call.wait,
            )
        assert self._client is not None
        return await self._client.request(
            call.method, call.path, **_http.request_kwargs(call, self.timeout)
        )

    async def put_queue(
        self,
        name: str,
        *,
        lease_seconds: float | None = None,
        queue_seconds: float | None = None,
        retain_seconds: float | None = None,
        retain_from: str | None = None,
        max_attempts: int | None = _UNSET,
        backoff_seconds: float | None = None,
        backoff_max_seconds: float | None = None,
        dead_letter_queue: str | None = _UNSET,
        paused: bool | None = None,
        max_processing: int | None = _UNSET,
        rate_limit: RateLimit | dict[str, Any] | None = _UNSET,
        thread_limit: int | None = None,
    ) -> QueueInfo:
        settings = _http.queue_settings(
            lease_seconds=lease_seconds,
            queue_seconds=queue_seconds,
            retain_seconds=retain_seconds,
            retain_from=retain_from,
            max_attempts=max_attempts,
            backoff_seconds=backoff_seconds,
            backoff_max_seconds=backoff_max_seconds,
            dead_letter_queue=dead_letter_queue,
            paused=paused,
            max_processing=max_processing,
            rate_limit=rate_limit,
            thread_limit=thread_limit,
        )
        return await self._run(_http.put_queue(name, settings))

    async def pause(self, queue: str) -> QueueInfo:
        return await self._run(_http.set_paused(queue, True))

    async def resume(self, queue: str) -> QueueInfo:
        return await self._run(_http.set_paused(queue, False))

    async def queue(self, name: str) -> QueueInfo:
        return await self._run(_http.get_queue(name))

    async def queues(self) -> list[QueueInfo]:
        return await self._run(_http.list_queues())

    async def delete_queue(self, name: str) -> None:
        await self._run(_http.delete_queue(name))

    async def post(
        self,
        queue: str,
        payload: Any,
        *,
        options: ItemOptions | None = None,
        **fields: Unpack[ItemOptionFields],
    ) -> Item:
        body = _http.item_body(payload, ItemOptions.given(options, fields), self.auto_key)
        return await self._run(_http.post_item(queue, body))

    async def post_many(self, queue: str, items: Iterable[Any]) -> list[Item]:
        posted: list[Item] = []
        for chunk in _http.batch_bodies(list(items), self.auto_key):
            batch: list[Item] = await self._run(_http.post_batch(queue, chunk))
            posted.extend(batch)
        return posted

    async def get(self, item_id: str) -> Item:
        return await self._run(_http.get_item(item_id))

    async def wait(self, item_id: str, timeout: float | None = None) -> Item:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            item = await self._run(_http.get_item(item_id, _http.wait_slice(remaining)))
            if item.terminal:
                return item
            if deadline is not None and loop.time() >= deadline:
                raise WaitTimeout(f"item {item_id} is still {item.status}", item)

    async def result(self, item_id: str, timeout: float | None = None) -> Any:
        item = await self.wait(item_id, timeout)
        if item.failed:
            raise ItemFailed(item)
        return item.result

    async def items(
        self,
        queue: str,
        *,
        status: str | None = None,
        thread_id: str | None = None,
        page_size: int | None = None,
    ) -> AsyncIterator[Item]:
        cursor: str | None = None
        while True:
            page, cursor = await self._run(
                _http.list_items(queue, status, thread_id, cursor, page_size)
            )
            for item in page:
                yield item
            if not cursor:
                return

    async def delete(self, item_id: str) -> None:
        await self._run(_http.delete_item(item_id))

    async def delete_many(
        self, queue: str, *, ids: list[str] | None = None, status: str | None = None
    ) -> int:
        return await self._run(_http.delete_items(queue, ids, status))

    async def restart(self, item_id: str) -> Item:
        return await self._run(_http.restart_item(item_id))

    async def cancel(self, item_id: str, reason: str | None = None) -> Item:
        return await self._run(_http.cancel_item(item_id, reason))

    async def attempts(self, item_id: str) -> AttemptHistory:
        return await self._run(_http.item_attempts(item_id))

    async def workers(self) -> list[WorkerInfo]:
        return await self._run(_http.list_workers())

    async def drain_worker(self, worker_id: str) -> WorkerInfo:
        return await self._run(_http.drain_worker(worker_id))

    async def drain_workers(self, name_prefix: str) -> list[WorkerInfo]:
        return await self._run(_http.drain_workers(name_prefix))

    async def report_progress(self, item_id: str, lease: str, progress: Any) -> bool:
        return await self._run(_http.report_progress(item_id, lease, progress))

    async def put_schedule(
        self,
        queue: str,
        name: str,
        *,
        cron: str | None = None,
        every: int | None = None,
        payload: Any = _UNSET,
        timezone: str | None = None,
        thread_id: str | None = _UNSET,
        priority: int | None = None,
        overlap: str | None = None,
        catchup_seconds: float | None = None,
        paused: bool | None = None,
    ) -> Schedule:
        settings = _http.schedule_settings(
            cron=cron,
            every=every,
            timezone=timezone,
            payload=payload,
            thread_id=thread_id,
            priority=priority,
            overlap=overlap,
            catchup_seconds=catchup_seconds,
            paused=paused,
        )
        return await self._run(_http.put_schedule(queue, name, settings))

    async def get_schedule(self, queue: str, name: str) -> Schedule:
        return await self._run(_http.get_schedule(queue, name))

    async def list_schedules(
        self, queue: str, *, page_size: int | None = None
    ) -> AsyncIterator[Schedule]:
        cursor: str | None = None
        while True:
            page, cursor = await self._run(_http.list_schedules(queue, cursor, page_size))
            for schedule in page:
                yield schedule
            if not cursor:
                return

    async def delete_schedule(self, queue: str, name: str) -> None:
        await self._run(_http.delete_schedule(queue, name))

    async def pause_schedule(self, queue: str, name: str) -> Schedule:
        return await self._run(_http.set_schedule_paused(queue, name, True))

    async def resume_schedule(self, queue: str, name: str) -> Schedule:
        return await self._run(_http.set_schedule_paused(queue, name, False))
