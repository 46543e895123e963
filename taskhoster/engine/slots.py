"""A schedule's slots (SPEC section 8.3), as pure functions: no database, no files, no clock.

A slot is an instant (UTC). A schedule of ``every: N`` has a slot at every multiple of N
seconds since the Unix epoch (so ``every: 3600`` fires at the top of each UTC hour, and two
processes computing slots always agree). A schedule of ``cron`` has a slot at every
wall-clock minute its five fields match (``cronsim`` parses and matches them: ``*/n``,
ranges, lists, month and day names), in its IANA timezone.

Daylight-saving changes, as Vixie cron handles fixed-time jobs:

- **clocks go forward** (a wall-clock hour that does not exist that day): a slot whose wall
  time falls in the gap does not exist, and is skipped (``30 2 * * *`` in Europe/Berlin posts
  nothing on the last Sunday of March);
- **clocks go back** (a wall-clock hour that happens twice): a wall time in the repeated hour
  is one slot, at its first occurrence; the second pass through that hour posts nothing, so
  ``*/15 * * * *`` posts four items in that hour, not eight, and ``30 2 * * *`` one.

So a schedule's slots are always strictly increasing instants, and a slot's key
(``schedule:<name>:<slot>``) names exactly one of them.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from cronsim import CronSim, CronSimError

KEY_PREFIX = "schedule:"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MAX_EVERY = 366 * 86400  # a year and a day
MOST_COUNTED = 10_000  # late cron slots counted one by one before the rest are jumped over


class BadSpec(ValueError):
    """A cron, interval or timezone that cannot be a schedule (the message says why)."""


@dataclass(frozen=True)
class Spec:
    """When a schedule fires: ``cron`` in ``timezone``, or ``every`` seconds."""

    cron: str | None = None
    every: int | None = None
    timezone: str = "UTC"


@functools.cache
def _known_zones() -> frozenset[str]:
    return frozenset(available_timezones()) | {"UTC"}


def zone(name: str) -> ZoneInfo:
    """The IANA timezone ``name``, or ``BadSpec``. Only the names of the timezone database
    (not the host's ``localtime``, ``posixrules`` or ``Factory``)."""
    if not isinstance(name, str) or not name or len(name) > 64 or "\x00" in name:
        raise BadSpec("timezone must be an IANA name such as Europe/Berlin")
    if name not in _known_zones() or name in ("localtime", "posixrules", "Factory"):
        raise BadSpec(f"unknown timezone {name!r} (an IANA name such as Europe/Berlin)")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise BadSpec(f"unknown timezone {name!r} (an IANA name such as Europe/Berlin)") from None


def check_cron(expr: str) -> str:
    """A five-field cron expression, normalised to single spaces, or ``BadSpec``."""
    fields = expr.split()
    if len(fields) != 5:
        raise BadSpec(
            "cron must have five fields (minute hour day-of-month month day-of-week), "
            f"not {len(fields)}"
        )
    text = " ".join(fields)
    try:
        CronSim(text, datetime(2000, 1, 1))
    except (CronSimError, ValueError, IndexError, OverflowError) as exc:
        raise BadSpec(f"cron {text!r} is not valid: {exc or 'bad expression'}") from None
    if next_cron(text, "UTC", datetime(2000, 1, 1, tzinfo=UTC)) is None:
        raise BadSpec(f"cron {text!r} never fires")
    return text


def next_slot(spec: Spec, after: datetime) -> datetime | None:
    """The first slot strictly after ``after`` (UTC), or None if there is none."""
    if spec.every is not None:
        return next_every(spec.every, after)
    assert spec.cron is not None
    return next_cron(spec.cron, spec.timezone, after)


def next_every(every: int, after: datetime) -> datetime:
    elapsed = (after - EPOCH) // timedelta(microseconds=1)  # exact, in microseconds
    step = every * 1_000_000
    return EPOCH + timedelta(microseconds=(elapsed // step + 1) * step)


def next_cron(expr: str, timezone: str, after: datetime) -> datetime | None:
    """The first wall-clock match of ``expr`` in ``timezone`` that is an instant strictly
    after ``after``: matches in a gap are skipped, a repeated wall time counts at its first
    occurrence only (the module docstring)."""
    tz = zone(timezone)
    # From ``after``'s wall time; in a repeated hour's second pass its next matches are
    # instants of the first pass, earlier than ``after``, which the loop passes over.
    wall = after.astimezone(tz).replace(tzinfo=None, fold=0)
    try:
        matches = CronSim(expr, wall)
    except (CronSimError, ValueError):
        return None
    for _ in range(10_000):
        try:
            candidate = next(matches)
        except (StopIteration, CronSimError, OverflowError, ValueError):
            return None
        instant = _instant(candidate, tz)
        if instant is None:
            continue  # in a gap: this wall time does not exist today
        if instant > after:
            return instant
    return None


def _instant(wall: datetime, tz: ZoneInfo) -> datetime | None:
    """The instant of a naive wall time in ``tz``: its first occurrence, or None in a gap."""
    first = wall.replace(tzinfo=tz, fold=0)
    at = first.astimezone(UTC)
    if at.astimezone(tz).replace(tzinfo=None) != wall:
        return None
    return at


def first_slot(spec: Spec, at: datetime) -> datetime | None:
    """A new (or resumed, or changed) schedule's first slot: the first one after ``at``."""
    return next_slot(spec, at)


def slot_wire(slot: datetime) -> str:
    """A slot as its key and ``schedule.slot`` say it: RFC 3339 UTC, to the second when whole
    (every slot is), else to the microsecond."""
    slot = slot.astimezone(UTC)
    if slot.microsecond:
        return slot.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return slot.strftime("%Y-%m-%dT%H:%M:%SZ")


def slot_key(name: str, slot: datetime) -> str:
    return f"{KEY_PREFIX}{name}:{slot_wire(slot)}"


def schedule_of_key(key: str | None) -> dict[str, str] | None:
    """An item's ``schedule`` (``{"name", "slot"}``) from its key; None for any other key (a
    producer's key never starts with ``schedule:``: the contract refuses it)."""
    if not key or not key.startswith(KEY_PREFIX):
        return None
    name, sep, slot = key[len(KEY_PREFIX) :].partition(":")
    if not sep or not name or not slot:
        return None
    return {"name": name, "slot": slot}


def slot_item_id(salt: str, slot: datetime) -> str:
    """The id of a slot's item, the same in every process and every attempt: a crash between
    an attempt's file and its commit leaves a file at this very name, which the next attempt
    replaces instead of making a second one (``group._fire``).

    Like every id, it starts with 14 hex digits of microseconds, so it sorts near the items
    posted at its slot: the slot's whole seconds and a sub-second offset, then 6 hex digits,
    both from a hash of the schedule's ``salt`` (made with the schedule, new when it is made
    again) and the slot."""
    digest = hashlib.sha256(f"{salt}\x00{slot_wire(slot)}".encode()).digest()
    offset = int.from_bytes(digest[:4], "big") % 1_000_000
    tail = int.from_bytes(digest[4:7], "big")
    whole = math.floor((slot.astimezone(UTC) - EPOCH).total_seconds())
    return f"{whole * 1_000_000 + offset:014x}{tail:06x}"


def due_slots(
    spec: Spec, next_at: datetime, at: datetime, catchup_seconds: float, most: int
) -> tuple[list[datetime], int, datetime | None]:
    """What a sweep at ``at`` does with a schedule whose next slot is ``next_at``: the slots
    to post now (oldest first, at most ``most``), how many it skips as later than
    ``catchup_seconds``, and the slot after the last one it posts or skips (None: no more)."""
    skipped = 0
    slot: datetime | None = next_at
    oldest = at - timedelta(seconds=catchup_seconds)
    if spec.every is not None and slot is not None and slot < oldest:
        # Straight to the first slot still in time (an interval's slots are arithmetic).
        first = next_every(spec.every, oldest - timedelta(microseconds=1))
        skipped = int((first - slot) / timedelta(seconds=spec.every))
        slot = first
    elif slot is not None and slot < oldest:
        # A cron's late slots are counted up to a point, then passed over at once (a
        # minute's cron after a month without a sweep is 43,200 of them).
        while slot is not None and slot < oldest and skipped < MOST_COUNTED:
            skipped += 1
            slot = next_slot(spec, slot)
        if slot is not None and slot < oldest:
            slot = next_slot(spec, oldest - timedelta(microseconds=1))
    post: list[datetime] = []
    while slot is not None and slot <= at and len(post) < most:
        if slot < oldest:
            skipped += 1
        else:
            post.append(slot)
        slot = next_slot(spec, slot)
    return post, skipped, slot
