"""The shapes the client hands back: items, queues, and items to post."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

TERMINAL = frozenset({"finished", "failed"})


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
            raw=data,
        )


@dataclass(frozen=True)
class QueueInfo:
    """A queue's settings and its live counts per status."""

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
            raw=data,
        )


@dataclass(frozen=True)
class NewItem:
    """One item of :meth:`Producer.post_many` with its options (a bare payload needs none).

    ``delay`` (seconds or a timedelta) and ``scheduled_at`` are exclusive. Without ``key``,
    the client makes one up, so that resending the batch after a lost answer is safe.
    """

    payload: Any
    thread_id: str | None = None
    delay: float | timedelta | None = None
    scheduled_at: datetime | str | None = None
    key: str | None = None
