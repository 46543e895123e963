"""UTC times on the wire: ISO-8601 with a ``Z``."""

from __future__ import annotations

from datetime import UTC, datetime


def now() -> datetime:
    """Now, aware, in UTC (what ``django.utils.timezone.now`` gives under ``USE_TZ``; the
    engine's times are UTC whatever the project's setting)."""
    return datetime.now(UTC)


# The last time ``to_wire`` wrote, and its text: an item's answer and its file's line carry
# the group's own time (one object) in several fields.
_last: tuple[datetime | None, str] = (None, "")


def to_wire(value: datetime | None) -> str | None:
    global _last
    if value is None:
        return None
    last = _last
    if last[0] is value:
        return last[1]
    text = value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
    _last = (value, text)
    return text


def parse_wire(value: object) -> datetime:
    """Parse an ISO-8601 time with an offset or ``Z``; a naive time is refused."""
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError("expected an ISO-8601 time string")
    parsed = datetime.fromisoformat(value.replace("z", "Z").replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise ValueError("the time needs a UTC offset or Z")
    return parsed.astimezone(UTC)
