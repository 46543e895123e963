"""Flow control as the readers see it (SPEC section 8.1): when a queue's next claim could take
something, and what waits only because of a control.

The claims themselves apply the controls (``claims.Claims``, by ``rules.claim_budget``);
this module only reads, for the socket dispatcher's timers, the long-poll and
``GET /api/queues/{q}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .. import events
from ..models import Queue, Thread
from ..timeutil import now as utcnow
from . import rows as sql
from . import rules
from .committer import execute
from .ops import Resettle
from .queues import change_queue
from .rules import QueueInfo

# Settings whose change may let a waiting worker take something now.
OPENING = ("paused", "max_processing", "rate_limit", "thread_limit")
RESETTLE_BATCH = 500

# Held counts are exact up to this many; beyond it they say this many (a count of a million
# waiting items would cost a scan of them on every read).
HELD_CAP = 10_000
# ``Held``'s field for each control ``rules.claim_budget`` names.
FIELD_OF_CONTROL = {
    "paused": "paused",
    "maxProcessing": "max_processing",
    "rateLimit": "rate_limit",
}


def gate(queue: QueueInfo, at: datetime) -> datetime | None:
    """When a claim of ``queue`` could take something, as far as its controls say: ``at`` if
    now, a later time if a rate window is full, None if only news can open it (paused, or at
    its cap: a resume or a freed slot is announced)."""
    processing, starts = sql.control_state(queue, at)
    started = sum(n for _t, n in starts)
    _budget, held_by = rules.claim_budget(queue, 1, processing=processing, started=started)
    if held_by in ("paused", "maxProcessing"):
        return None
    if held_by == "rateLimit":
        return rules.rate_window_opens(queue, starts, at) or at
    return at


def next_due(queue_names: Sequence[str]) -> dict[str, datetime]:
    """For each live queue named, when its next claim could take an item: its earliest
    claimable item's ``scheduledAt``, or later if a rate window is full; a queue that is
    paused or at its cap is left out, as one with nothing claimable (only news opens it).
    One query for all the queues, and a few more for each with a control set and something
    claimable."""
    earliest = sql.earliest_claimable(queue_names)
    if not earliest:
        return {}
    at = utcnow()
    found: dict[str, datetime] = {}
    limited = sorted(name for name, (_due, control) in earliest.items() if control)
    controlled = {q.name: q for q in sql.select_queues(names=limited)}
    for name, (due, _control) in earliest.items():
        queue = controlled.get(name)
        if queue is None:
            found[name] = due
            continue
        opens = gate(queue, at)
        if opens is not None:
            found[name] = max(due, opens)
    return found


@dataclass(frozen=True)
class Held:
    """What waits only because of a control: due claimable items a pause, a full cap or a
    full rate window holds back (counted under the first of them that applies), and due
    pending members of threads held back by ``threadLimit``. Exact up to ``HELD_CAP``."""

    paused: int = 0
    max_processing: int = 0
    rate_limit: int = 0
    thread: int = 0

    def wire(self) -> dict[str, int]:
        return {
            "paused": self.paused,
            "maxProcessing": self.max_processing,
            "rateLimit": self.rate_limit,
            "thread": self.thread,
        }


def held(queue: QueueInfo) -> Held:
    """``queue``'s held counts (``Held``): a few bounded index scans, only for the controls
    that apply now."""
    at = utcnow()
    values: dict[str, int] = {}
    if queue.controlled:
        processing, starts = sql.control_state(queue, at)
        started = sum(n for _t, n in starts)
        _budget, held_by = rules.claim_budget(queue, 1, processing=processing, started=started)
        if held_by is not None:
            values[FIELD_OF_CONTROL[held_by]] = sql.count_due_eligible(queue.id, at, HELD_CAP)
    values["thread"] = sql.count_thread_waiting(queue.id, at, HELD_CAP)
    return Held(**values)


def put_queue(*, name: str, body: dict[str, Any]) -> tuple[Queue, bool]:
    """Create the queue or change the given settings (``queues.upsert_queue``), then make the
    change felt at once: a changed ``threadLimit`` recounts every thread's heads (through
    the engine, in batches), and a change of any control wakes the waiting workers and
    long-polls of every process (I6), who claim again under the new settings."""
    queue, created, before = change_queue(name=name, body=body)
    if created:
        return queue, created
    if before["thread_limit"] != queue.thread_limit:
        resettle_threads(queue.id)
    if any(before[f] != getattr(queue, f) for f in OPENING):
        events.announce_many([("claimable", queue.name, "")])
    return queue, created


def resettle_threads(queue_id: int) -> int:
    """Every thread of the queue settled again under its ``threadLimit``; how many."""
    done = 0
    after = ""
    while True:
        batch = list(
            Thread.objects.filter(queue_id=queue_id, thread_id__gt=after)
            .order_by("thread_id")
            .values_list("thread_id", flat=True)[:RESETTLE_BATCH]
        )
        if not batch:
            return done
        done += execute(Resettle(queue_id=queue_id, thread_ids=tuple(batch)))
        after = batch[-1]


def held_by_queue(queue_names: Sequence[str]) -> dict[str, Held]:
    """The held counts of the live queues named (``held``), for ``/metrics`` and the admin:
    a queue with no control set and no thread costs nothing beyond one query for all."""
    queues = sql.select_queues(names=list(queue_names))
    threaded = set(
        Thread.objects.filter(queue_id__in=[q.id for q in queues])
        .values_list("queue_id", flat=True)
        .distinct()
    )
    return {q.name: held(q) if q.controlled or q.id in threaded else Held() for q in queues}


def held_for(queue_name: str) -> Held:
    """The held counts of a live queue (``held``); zeros if it is gone."""
    found = sql.select_queues(names=[queue_name])
    return held(found[0]) if found else Held()
