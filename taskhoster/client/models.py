"""The shapes the client hands back (items, queues, attempts, workers, schedules), and what it
posts:
items and their options."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

TERMINAL = frozenset({"finished", "failed"})
#: An item's ``priority`` runs from 0 (the default) to 9 (SPEC section 8.1).
MAX_PRIORITY = 9
#: SPEC section 8.2: a progress report is at most this many bytes of compact JSON, a cancel's
#: reason at most this many characters, and a worker's name at most this many.
PROGRESS_MAX_BYTES = 4096
CANCEL_REASON_MAX_CHARS = 500
WORKER_NAME_MAX_CHARS = 200


def parse_time(value: Any) -> datetime | None:
    """A wire time (``2026-01-31T12:00:00.123Z``) as an aware datetime; None stays None."""
    if not isinstance(value, str) or not value:
        return None
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def to_wire_time(value: datetime | str) -> str:
    """A datetime (naive means UTC) or an already formatted string, as a wire time."""
    if isinstance(value, str):
        return value
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def progress_size(value: Any) -> int:
    """The bytes of ``value`` as compact JSON, as the server counts a progress report; raises
    ValueError if it is larger than ``PROGRESS_MAX_BYTES`` or not JSON (NaN), TypeError if
    JSON cannot hold it."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    size = len(text.encode())
    if size > PROGRESS_MAX_BYTES:
        raise ValueError(
            f"a progress report is at most {PROGRESS_MAX_BYTES} bytes of JSON; this is {size}"
        )
    return size


def to_seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


@dataclass(frozen=True)
class Item:
    """An item as the server returned it. ``payload`` and ``result`` are None in listings."""

    id: str
    queue: str
    status: str
    payload: Any = None
    thread_id: str | None = None
    scheduled_at: datetime | None = None
    posted_at: datetime | None = None
    attempts: int = 0
    lease_expires_at: datetime | None = None
    finished_at: datetime | None = None
    result: Any = None
    error: str | None = None
    key: str | None = None
    origin: dict[str, Any] | None = None
    dead_letter: str | None = None
    priority: int = 0
    progress: Any = None
    cancel_reason: str | None = None
    schedule: ScheduleSlot | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def terminal(self) -> bool:
        """Finished or failed: no worker will touch it again."""
        return self.status in TERMINAL

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Item:
        return cls(
            id=str(data["id"]),
            queue=str(data.get("queue", "")),
            status=str(data["status"]),
            payload=data.get("payload"),
            thread_id=data.get("threadId"),
            scheduled_at=parse_time(data.get("scheduledAt")),
            posted_at=parse_time(data.get("postedAt")),
            attempts=int(data.get("attempts") or 0),
            lease_expires_at=parse_time(data.get("leaseExpiresAt")),
            finished_at=parse_time(data.get("finishedAt")),
            result=data.get("result"),
            error=data.get("error"),
            key=data.get("key"),
            origin=data.get("origin"),
            dead_letter=data.get("deadLetter"),
            priority=int(data.get("priority") or 0),  # a server before priorities: 0
            progress=data.get("progress"),
            cancel_reason=data.get("cancelReason"),
            schedule=ScheduleSlot.from_wire(data.get("schedule")),
            raw=data,
        )

    @property
    def cancelled(self) -> bool:
        """Cancelled by a producer or an operator (SPEC section 8.2): failed with error
        ``cancelled``, its reason (if one was given) in ``cancel_reason``."""
        return self.failed and self.error == "cancelled"


@dataclass(frozen=True)
class ItemAttempt:
    """One claim of an item (``GET /api/items/{id}/attempts``). ``worker``: the name of
    the socket it went to, or ``"http"`` for a REST claim. ``outcome``: ``result``,
    ``fail``, ``lapsed``, ``dropped``, ``cancelled``, ``deleted`` or ``timeout``; None (and
    no ``ended_at``) while it runs."""

    attempt: int
    claimed_at: datetime | None
    worker: str | None
    ended_at: datetime | None
    outcome: str | None
    error: str | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ItemAttempt:
        return cls(
            attempt=int(data.get("attempt") or 0),
            claimed_at=parse_time(data.get("claimedAt")),
            worker=data.get("worker"),
            ended_at=parse_time(data.get("endedAt")),
            outcome=data.get("outcome"),
            error=data.get("error"),
            raw=data,
        )


@dataclass(frozen=True)
class AttemptHistory:
    """An item's attempts, oldest first. An item claimed very many times is told by its
    first and its latest attempts: ``omitted`` says how many were left out between."""

    attempts: list[ItemAttempt]
    omitted: int = 0

    def __iter__(self) -> Iterator[ItemAttempt]:
        return iter(self.attempts)

    def __len__(self) -> int:
        return len(self.attempts)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> AttemptHistory:
        return cls(
            attempts=[ItemAttempt.from_wire(a) for a in data.get("attempts") or []],
            omitted=int(data.get("omitted") or 0),
        )


@dataclass(frozen=True)
class WorkerInfo:
    """A connected ``/work`` socket as ``GET /api/workers`` lists it: its ``name`` (sent in
    its subscribe; ``host:pid`` for the Python worker), the ``queues`` and ``capacity`` it
    subscribed with, the ids of the items it ``held``, whether it is ``draining`` (it gets
    nothing more), and when it connected and was last heard from."""

    id: str
    name: str
    queues: list[str]
    capacity: int
    held: list[str]
    draining: bool
    connected_at: datetime | None
    last_seen_at: datetime | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> WorkerInfo:
        return cls(
            id=str(data["id"]),
            name=str(data.get("name") or ""),
            queues=[str(q) for q in data.get("queues") or []],
            capacity=int(data.get("capacity") or 0),
            held=[str(i) for i in data.get("held") or []],
            draining=bool(data.get("draining", False)),
            connected_at=parse_time(data.get("connectedAt")),
            last_seen_at=parse_time(data.get("lastSeenAt")),
            raw=data,
        )


@dataclass(frozen=True)
class RateLimit:
    """A queue's ``rateLimit``: at most ``count`` claims of its items start in any
    ``seconds``."""

    count: int
    seconds: float

    def wire(self) -> dict[str, Any]:
        return {"count": self.count, "seconds": self.seconds}

    @classmethod
    def from_wire(cls, data: Any) -> RateLimit | None:
        """``{"count": N, "seconds": S}`` as a RateLimit; null (no limit) as None."""
        if not isinstance(data, dict):
            return None
        return cls(count=int(data["count"]), seconds=float(data["seconds"]))


@dataclass(frozen=True)
class QueueInfo:
    """A queue's settings and its live counts per status.

    The flow controls (``paused``, ``max_processing``, ``rate_limit``, ``thread_limit``) read
    as their defaults from a server that does not send them. ``held``: how many due items
    wait only because of a control, by the control's wire name (``paused``,
    ``maxProcessing``, ``rateLimit``, ``thread``); sent only for one queue
    (:meth:`Producer.queue`), None in a listing.
    """

    name: str
    lease_seconds: float
    queue_seconds: float
    retain_seconds: float
    retain_from: str
    max_attempts: int | None
    backoff_seconds: float
    backoff_max_seconds: float
    dead_letter_queue: str | None
    counts: dict[str, int]
    paused: bool = False
    max_processing: int | None = None
    rate_limit: RateLimit | None = None
    thread_limit: int = 1
    held: dict[str, int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> QueueInfo:
        return cls(
            name=str(data["name"]),
            lease_seconds=float(data["leaseSeconds"]),
            queue_seconds=float(data["queueSeconds"]),
            retain_seconds=float(data["retainSeconds"]),
            retain_from=str(data["retainFrom"]),
            max_attempts=data.get("maxAttempts"),
            backoff_seconds=float(data["backoffSeconds"]),
            backoff_max_seconds=float(data["backoffMaxSeconds"]),
            dead_letter_queue=data.get("deadLetterQueue"),
            counts={str(k): int(v) for k, v in (data.get("counts") or {}).items()},
            paused=bool(data.get("paused", False)),
            max_processing=data.get("maxProcessing"),
            rate_limit=RateLimit.from_wire(data.get("rateLimit")),
            thread_limit=int(data.get("threadLimit") or 1),
            held=(
                {str(k): int(v) for k, v in data["held"].items()}
                if isinstance(data.get("held"), dict)
                else None
            ),
            raw=data,
        )


@dataclass(frozen=True)
class ScheduleSlot:
    """An item's ``schedule``: the schedule that posted it (its ``name``) and the ``slot`` it
    was posted for (SPEC section 8.3); its key is ``schedule:<name>:<slot>``."""

    name: str
    slot: datetime

    @classmethod
    def from_wire(cls, data: Any) -> ScheduleSlot | None:
        """``{"name", "slot"}`` as a ScheduleSlot; anything else (no schedule) as None."""
        if not isinstance(data, dict):
            return None
        slot = parse_time(data.get("slot"))
        if slot is None:
            return None
        return cls(name=str(data["name"]), slot=slot)


@dataclass(frozen=True)
class Schedule:
    """A queue's schedule (SPEC section 8.3): it posts ``payload`` at each slot of ``cron``
    (five fields, read in ``timezone``) or of ``every`` seconds (counted from the Unix
    epoch), one at most of the two being set.

    ``overlap``: ``allow`` or ``skip`` (a slot posts nothing while the previous item is not
    terminal); ``catchup_seconds``: how late a slot found late may still be posted.
    ``next_at``: its next slot (None while ``paused``); ``last_slot`` and ``last_item``: the
    last slot it posted and that item's id (None before the first)."""

    queue: str
    name: str
    cron: str | None
    every: int | None
    timezone: str
    payload: Any
    thread_id: str | None
    priority: int
    overlap: str
    catchup_seconds: float
    paused: bool
    next_at: datetime | None
    last_slot: datetime | None
    last_item: str | None
    created_at: datetime | None
    updated_at: datetime | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Schedule:
        every = data.get("every")
        return cls(
            queue=str(data.get("queue", "")),
            name=str(data["name"]),
            cron=data.get("cron"),
            every=None if every is None else int(every),
            timezone=str(data.get("timezone") or "UTC"),
            payload=data.get("payload"),
            thread_id=data.get("threadId"),
            priority=int(data.get("priority") or 0),
            overlap=str(data.get("overlap") or "allow"),
            catchup_seconds=float(data.get("catchupSeconds") or 0),
            paused=bool(data.get("paused", False)),
            next_at=parse_time(data.get("nextAt")),
            last_slot=parse_time(data.get("lastSlot")),
            last_item=data.get("lastItem"),
            created_at=parse_time(data.get("createdAt")),
            updated_at=parse_time(data.get("updatedAt")),
            raw=data,
        )


class ItemOptionFields(TypedDict, total=False):
    """The fields of :class:`ItemOptions` as the keyword arguments of a post (kept in step with
    it: ``ItemOptions(**fields)`` is how they are read)."""

    thread_id: str | None
    delay: float | timedelta | None
    scheduled_at: datetime | str | None
    key: str | None
    priority: int | None


@dataclass(frozen=True, kw_only=True)
class ItemOptions:
    """How an item is posted, besides its payload: one type for every post. The keyword
    arguments of ``post`` (:class:`Producer`, :class:`AsyncProducer`, ``taskhoster.local``)
    build one, ``post`` takes one as ``options=``, and a :class:`NewItem` is one with a payload.

    ``thread_id``: the items of a thread are handed out one at a time, in order. ``delay``
    (seconds or a timedelta, from the post) and ``scheduled_at`` (a datetime or a wire time)
    are exclusive. ``key``: while an item of that key is still in the queue, a post with the
    same key answers that item instead of making another. ``priority``: 0 to 9 (None: the
    server's default, 0); among a queue's claimable items the higher priority is handed out
    first.
    """

    thread_id: str | None = None
    delay: float | timedelta | None = None
    scheduled_at: datetime | str | None = None
    key: str | None = None
    priority: int | None = None

    @classmethod
    def given(cls, options: ItemOptions | None, fields: ItemOptionFields) -> ItemOptions:
        """What a post was given: ``options`` (or none), with the keyword arguments ``fields``
        in place of its fields of the same names."""
        if options is None:
            return cls(**fields)
        return replace(options, **fields) if fields else options

    def wire(self, payload: Any) -> dict[str, Any]:
        """The REST body of an item of ``payload`` with these options: the options by their
        wire names, those left None left out (as fields not given). A timedelta ``delay`` is
        sent as its seconds and a datetime ``scheduled_at`` as a wire time (naive means UTC);
        any other value goes as it is, for the server to judge."""
        body: dict[str, Any] = {"payload": payload}
        if self.thread_id is not None:
            body["threadId"] = self.thread_id
        if self.delay is not None:
            delay = self.delay
            body["delaySeconds"] = delay.total_seconds() if isinstance(delay, timedelta) else delay
        if self.scheduled_at is not None:
            at = self.scheduled_at
            body["scheduledAt"] = to_wire_time(at) if isinstance(at, datetime) else at
        if self.key is not None:
            body["key"] = self.key
        if self.priority is not None:
            body["priority"] = self.priority
        return body


@dataclass(frozen=True)
class NewItem(ItemOptions):
    """One item of ``post_many`` with its options (a bare payload needs none):
    ``NewItem(payload, thread_id=..., delay=..., scheduled_at=..., key=..., priority=...)``.

    Without ``key``, a :class:`Producer` makes one up, so that resending the batch after a lost
    answer is safe.
    """

    payload: Any

    @classmethod
    def of(cls, member: Any) -> NewItem:
        """A member of ``post_many``: a NewItem as it is, a bare payload as one without
        options."""
        return member if isinstance(member, NewItem) else cls(member)
