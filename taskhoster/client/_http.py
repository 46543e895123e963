"""What the sync and async producers share: where the server is, which key to send, what each
call sends and how its answer is read, and when a failed call may be sent again.

Each API call is described once, as a :class:`Call` (method, path, body, how to parse the
answer, whether resending it is safe); the two producers only differ in how they send it.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import quote

import httpx

from ._wire import WireError
from .errors import APIError, ConfigError, ConnectionFailed, api_error
from .models import (
    AttemptHistory,
    Item,
    ItemOptions,
    NewItem,
    QueueInfo,
    RateLimit,
    Schedule,
    WorkerInfo,
    to_seconds,
)

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "TASKHOSTER_URL"
KEY_ENV = "TASKHOSTER_KEY"
#: Written by ``scripts/serve`` on its first run; read when no key is given or set.
CREDENTIALS_FILE = Path("var") / "credentials.json"
# The contract's figures (SPEC section 5: a batch of at most 1000 items, a long-poll of at most
# 60 s), which are also the server's defaults (MAX_BATCH, MAX_WAIT_SECONDS in
# ``taskhoster.conf``). The client runs without Django and cannot read a server's settings, so
# it keeps to these; a server set below them refuses such requests (400 invalid_wait, 413
# batch_too_large), and its system checks warn of that (taskhoster.W004).
MAX_WAIT_SECONDS = 60.0
MAX_BATCH = 1000
USER_AGENT = "taskhoster-client"
#: Answers that say "not now" rather than "no": resent when resending is safe.
RETRY_STATUSES = frozenset({502, 503, 504})


def resolve_url(url: str | None = None) -> str:
    """The server's base address: the argument, else ``$TASKHOSTER_URL``, else the default
    address of ``scripts/serve``."""
    value = url or os.environ.get(URL_ENV) or DEFAULT_URL
    if not value.startswith(("http://", "https://")):
        raise ConfigError(f"the server address must start with http:// or https://: {value!r}")
    return value.rstrip("/")


def resolve_key(key: str | None = None, credentials: Path | None = None) -> str:
    """The API key: the argument, else ``$TASKHOSTER_KEY``, else the ``apiKey`` saved in
    ``var/credentials.json`` (under the current directory) by ``scripts/serve``."""
    if key:
        return key
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    path = credentials or CREDENTIALS_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = None
    if isinstance(saved, dict) and isinstance(saved.get("apiKey"), str):
        return str(saved["apiKey"])
    raise ConfigError(
        f"no API key: pass key=..., set {KEY_ENV}, or run where scripts/serve saved "
        f"{CREDENTIALS_FILE}",
        code="no_key",
    )


def auth_headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Token {key}", "User-Agent": USER_AGENT}


def new_key() -> str:
    """An idempotency key for a post that was given none."""
    return f"auto-{uuid.uuid4().hex}"


def retry_delay(attempt: int, base: float = 0.25, cap: float = 5.0) -> float:
    """Exponential backoff with jitter: about base, 2*base, 4*base ... at most ``cap``, at
    any attempt (a worker's thousandth reconnect in a long outage, too: ``2.0**1024`` would
    overflow)."""
    return float(min(cap, base * 2.0 ** min(attempt, 60)) * random.uniform(0.5, 1.0))


def seg(value: str) -> str:
    """One path segment, escaped (names and ids never reach the path as anything else)."""
    return quote(str(value), safe="")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API call: what to send, how to read the answer, and whether resending is safe.

    ``idempotent``: the call may be sent again after an error that may have come after the
    server acted on it (a lost answer). Calls that are not are resent only when the request
    never left (the connection could not be made). ``gone_ok``: a 404 on a resend means the
    first send did it (a delete).
    """

    method: str
    path: str
    parse: Callable[[Any], T]
    body: Any = None
    has_body: bool = False
    params: dict[str, str] | None = None
    idempotent: bool = True
    wait: float = 0.0
    gone_ok: bool = False


#: The longest ``Retry-After`` the client waits for before a resend.
MAX_RETRY_AFTER = 30.0


class Reply(Protocol):
    """What is read of an answer: httpx's ``Response`` and the wire's ``Answer`` alike."""

    @property
    def status_code(self) -> int: ...

    @property
    def reason_phrase(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content(self) -> bytes: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


def retry_after(response: Reply) -> float | None:
    """The answer's ``Retry-After`` in seconds (a number of seconds; an HTTP date is not
    sent by the server), at most ``MAX_RETRY_AFTER``; None without one."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    if seconds != seconds or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER)


def _refused_unseen(response: Reply) -> bool:
    """A 503 ``overloaded``: refused before the server did anything with the call."""
    if response.status_code != 503:
        return False
    try:
        return bool(response.json()["error"]["code"] == "overloaded")
    except (ValueError, KeyError, TypeError):
        return False


class Attempt:
    """Decides, call by call, what to do with a failed send."""

    def __init__(self, call: Call[Any], retries: int) -> None:
        self.call = call
        self.retries = retries
        self.number = 0

    def on_transport_error(self, exc: httpx.TransportError | WireError) -> float:
        """Seconds to wait before resending; raises ConnectionFailed when it must not."""
        if isinstance(exc, WireError):
            never_sent = exc.never_sent
        else:
            never_sent = isinstance(
                exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout
            )
        if self.number < self.retries and (never_sent or self.call.idempotent):
            self.number += 1
            return retry_delay(self.number - 1)
        raise ConnectionFailed(
            f"{self.call.method} {self.call.path}: {type(exc).__name__}: {exc}",
            code="connection_failed",
        ) from exc

    def on_answer(self, response: Reply) -> float | None:
        """Seconds to wait before resending this answer's call, or None to read it.

        A 502/503/504 is resent when resending is safe, after the server's ``Retry-After``
        if it gave one (at most ``MAX_RETRY_AFTER``), else after a backoff. A 503
        ``overloaded`` is always safe to resend: the server refused the call before doing
        anything with it."""
        if response.status_code not in RETRY_STATUSES or self.number >= self.retries:
            return None
        if not (self.call.idempotent or _refused_unseen(response)):
            return None
        self.number += 1
        backoff = retry_delay(self.number - 1)
        after = retry_after(response)
        return backoff if after is None else max(after * random.uniform(1.0, 1.25), backoff)

    def read(self, response: Reply) -> Any:
        """The parsed answer, or the typed error it carries."""
        if response.status_code == 404 and self.call.gone_ok and self.number > 0:
            return self.call.parse(None)
        if response.status_code >= 400:
            raise error_of(response)
        if response.status_code == 204 or not response.content:
            return self.call.parse(None)
        try:
            data = response.json()
        except ValueError:
            raise APIError(
                f"the server answered {response.status_code} with something that is not JSON",
                code="bad_answer",
                status=response.status_code,
            ) from None
        return self.call.parse(data)


def error_of(response: Reply) -> APIError:
    try:
        data = response.json()
        error = data["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code = f"http_{response.status_code}"
        message = response.text[:500] or response.reason_phrase
    return api_error(response.status_code, code, message)


def request_kwargs(call: Call[Any], timeout: float) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"params": call.params, "timeout": timeout + call.wait}
    if call.has_body:
        kwargs["json"] = call.body
    return kwargs


# -- the calls ------------------------------------------------------------------------------

_UNSET: Any = object()


def _item(data: Any) -> Item:
    return Item.from_wire(data)


def _items(data: Any) -> list[Item]:
    return [Item.from_wire(i) for i in data["items"]]


def _queue(data: Any) -> QueueInfo:
    return QueueInfo.from_wire(data)


def _none(data: Any) -> None:
    return None


def put_queue(name: str, settings: dict[str, Any]) -> Call[QueueInfo]:
    return Call("PUT", f"/api/queues/{seg(name)}", _queue, body=settings, has_body=True)


def queue_settings(
    *,
    lease_seconds: float | None,
    queue_seconds: float | None,
    retain_seconds: float | None,
    retain_from: str | None,
    max_attempts: Any,
    backoff_seconds: float | None,
    backoff_max_seconds: float | None,
    dead_letter_queue: Any,
    paused: bool | None = None,
    max_processing: Any = _UNSET,
    rate_limit: Any = _UNSET,
    thread_limit: int | None = None,
) -> dict[str, Any]:
    """The settings that were given, by their wire names (``max_attempts``,
    ``dead_letter_queue``, ``max_processing`` and ``rate_limit`` may be None, meaning
    unlimited or none). A :class:`RateLimit` is sent as its wire form; any other
    ``rate_limit`` (a ``{"count", "seconds"}`` dict) as it is, for the server to judge."""
    given: dict[str, Any] = {
        "leaseSeconds": lease_seconds,
        "queueSeconds": queue_seconds,
        "retainSeconds": retain_seconds,
        "retainFrom": retain_from,
        "backoffSeconds": backoff_seconds,
        "backoffMaxSeconds": backoff_max_seconds,
        "paused": paused,
        "threadLimit": thread_limit,
    }
    body = {name: value for name, value in given.items() if value is not None}
    if max_attempts is not _UNSET:
        body["maxAttempts"] = max_attempts
    if dead_letter_queue is not _UNSET:
        body["deadLetterQueue"] = dead_letter_queue
    if max_processing is not _UNSET:
        body["maxProcessing"] = max_processing
    if rate_limit is not _UNSET:
        body["rateLimit"] = rate_limit.wire() if isinstance(rate_limit, RateLimit) else rate_limit
    return body


def set_paused(name: str, paused: bool) -> Call[QueueInfo]:
    """Pause or resume a queue: a PUT of ``paused`` alone (the other settings are kept)."""
    return put_queue(name, {"paused": paused})


def get_queue(name: str) -> Call[QueueInfo]:
    return Call("GET", f"/api/queues/{seg(name)}", _queue)


def list_queues() -> Call[list[QueueInfo]]:
    return Call("GET", "/api/queues", lambda data: [QueueInfo.from_wire(q) for q in data])


def delete_queue(name: str) -> Call[None]:
    return Call("DELETE", f"/api/queues/{seg(name)}", _none, gone_ok=True)


def item_body(payload: Any, options: ItemOptions, auto_key: bool) -> dict[str, Any]:
    """An item's REST body: ``delay`` always as a float, and a made-up ``key`` when none is
    given and ``auto_key``."""
    if options.delay is not None and options.scheduled_at is not None:
        raise ValueError("give delay or scheduled_at, not both")
    if options.delay is not None:
        options = replace(options, delay=to_seconds(options.delay))
    if options.key is None and auto_key:
        options = replace(options, key=new_key())
    return options.wire(payload)


def post_item(queue: str, body: dict[str, Any]) -> Call[Item]:
    # Safe to resend only with a key: the server then answers the first post's item.
    return Call(
        "POST",
        f"/api/queues/{seg(queue)}/items",
        _item,
        body=body,
        has_body=True,
        idempotent="key" in body,
    )


def batch_bodies(items: list[Any], auto_key: bool, size: int = MAX_BATCH) -> list[list[Any]]:
    """The bodies of the items (bare payloads or :class:`NewItem`), in chunks of at most
    ``size``."""
    bodies = [item_body(new.payload, new, auto_key) for new in map(NewItem.of, items)]
    return [bodies[n : n + size] for n in range(0, len(bodies), size)]


def post_batch(queue: str, bodies: list[dict[str, Any]]) -> Call[list[Item]]:
    return Call(
        "POST",
        f"/api/queues/{seg(queue)}/items",
        _items,
        body={"items": bodies},
        has_body=True,
        idempotent=all("key" in b for b in bodies),
    )


def get_item(item_id: str, wait: float = 0.0) -> Call[Item]:
    params = {"wait": f"{wait:.3f}"} if wait > 0 else None
    return Call("GET", f"/api/items/{seg(item_id)}", _item, params=params, wait=wait)


def wait_slice(remaining: float | None) -> float:
    """How long the next long-poll asks the server to wait."""
    if remaining is None:
        return MAX_WAIT_SECONDS
    return max(0.0, min(MAX_WAIT_SECONDS, remaining))


def list_items(
    queue: str, status: str | None, thread_id: str | None, cursor: str | None, limit: int | None
) -> Call[tuple[list[Item], str | None]]:
    params = {
        name: str(value)
        for name, value in {
            "status": status,
            "threadId": thread_id,
            "cursor": cursor,
            "limit": limit,
        }.items()
        if value is not None
    }
    return Call(
        "GET",
        f"/api/queues/{seg(queue)}/items",
        lambda data: (_items(data), data.get("next")),
        params=params,
    )


def delete_item(item_id: str) -> Call[None]:
    return Call("DELETE", f"/api/items/{seg(item_id)}", _none, gone_ok=True)


def delete_items(queue: str, ids: list[str] | None, status: str | None) -> Call[int]:
    if (ids is None) == (status is None):
        raise ValueError("give ids or status")
    body = {"ids": list(ids)} if ids is not None else {"status": status}
    return Call(
        "POST",
        f"/api/queues/{seg(queue)}/items/delete",
        lambda data: int(data["deleted"]),
        body=body,
        has_body=True,
    )


def restart_item(item_id: str) -> Call[Item]:
    # A resent restart would meet a pending item (409): resent only if it never left.
    return Call("POST", f"/api/items/{seg(item_id)}/restart", _item, idempotent=False)


# -- work in flight (SPEC section 8.2) ----------------------------------------------------


def cancel_item(item_id: str, reason: str | None) -> Call[Item]:
    # A resent cancel would meet a terminal item (409): resent only if it never left.
    body = {} if reason is None else {"reason": reason}
    return Call(
        "POST",
        f"/api/items/{seg(item_id)}/cancel",
        _item,
        body=body,
        has_body=True,
        idempotent=False,
    )


def item_attempts(item_id: str) -> Call[AttemptHistory]:
    return Call("GET", f"/api/items/{seg(item_id)}/attempts", AttemptHistory.from_wire)


def report_progress(item_id: str, lease: str, progress: Any) -> Call[bool]:
    # Resending the same latest value is harmless.
    return Call(
        "POST",
        f"/api/items/{seg(item_id)}/progress",
        lambda data: bool(data["accepted"]),
        body={"lease": lease, "progress": progress},
        has_body=True,
    )


def _workers(data: Any) -> list[WorkerInfo]:
    return [WorkerInfo.from_wire(w) for w in data["workers"]]


def list_workers() -> Call[list[WorkerInfo]]:
    return Call("GET", "/api/workers", _workers)


def drain_worker(worker_id: str) -> Call[WorkerInfo]:
    # Draining twice is draining once: safe to resend.
    return Call("POST", f"/api/workers/{seg(worker_id)}/drain", WorkerInfo.from_wire)


def drain_workers(name_prefix: str) -> Call[list[WorkerInfo]]:
    return Call(
        "POST",
        "/api/workers/drain",
        _workers,
        body={"namePrefix": name_prefix},
        has_body=True,
    )


# -- schedules (SPEC section 8.3) ---------------------------------------------------------


def _schedule_path(queue: str, name: str) -> str:
    return f"/api/queues/{seg(queue)}/schedules/{seg(name)}"


def schedule_settings(
    *,
    cron: str | None = None,
    every: int | None = None,
    timezone: str | None = None,
    payload: Any = _UNSET,
    thread_id: Any = _UNSET,
    priority: int | None = None,
    overlap: str | None = None,
    catchup_seconds: float | None = None,
    paused: bool | None = None,
) -> dict[str, Any]:
    """The schedule's settings that were given, by their wire names (``payload`` may be
    None, a null payload; ``thread_id`` None means no thread). ``cron`` and ``every`` are
    exclusive."""
    if cron is not None and every is not None:
        raise ValueError("give cron or every, not both")
    given: dict[str, Any] = {
        "cron": cron,
        "every": every,
        "timezone": timezone,
        "priority": priority,
        "overlap": overlap,
        "catchupSeconds": catchup_seconds,
        "paused": paused,
    }
    body = {name: value for name, value in given.items() if value is not None}
    if payload is not _UNSET:
        body["payload"] = payload
    if thread_id is not _UNSET:
        body["threadId"] = thread_id
    return body


def put_schedule(queue: str, name: str, settings: dict[str, Any]) -> Call[Schedule]:
    # Putting the same settings twice leaves the schedule as once: safe to resend.
    return Call(
        "PUT", _schedule_path(queue, name), Schedule.from_wire, body=settings, has_body=True
    )


def set_schedule_paused(queue: str, name: str, paused: bool) -> Call[Schedule]:
    """Pause or resume a schedule: a PUT of ``paused`` alone (the rest is kept)."""
    return put_schedule(queue, name, {"paused": paused})


def get_schedule(queue: str, name: str) -> Call[Schedule]:
    return Call("GET", _schedule_path(queue, name), Schedule.from_wire)


def list_schedules(
    queue: str, cursor: str | None, limit: int | None
) -> Call[tuple[list[Schedule], str | None]]:
    params = {
        name: str(value)
        for name, value in {"cursor": cursor, "limit": limit}.items()
        if value is not None
    }
    return Call(
        "GET",
        f"/api/queues/{seg(queue)}/schedules",
        lambda data: ([Schedule.from_wire(s) for s in data["schedules"]], data.get("next")),
        params=params,
    )


def delete_schedule(queue: str, name: str) -> Call[None]:
    return Call("DELETE", _schedule_path(queue, name), _none, gone_ok=True)
