"""The lifecycle's rules (SPEC section 3) as pure functions of plain values.

Nothing here reads a database, a file or the clock: each rule takes an item's row, its queue's
settings, its thread's state, the time and the operation's values, and answers with a
decision:

- ``Move``: the changes to make (the new status, the row's new values, the line the item's file
  gets, what happens to its thread, what is counted and announced);
- ``Remove``: the item goes (rule 9, rule 11);
- ``Keep``: nothing changes (a late result, a stale lease's fail, a clock not yet due);
- ``Refuse``: an error for the caller, and nothing changes.

``group.Group`` is the orchestrator that loads the rows, asks these functions, and writes what
they decide (files, rows, threads), in one transaction and one flush. The model-based tests
(``tests/unit/test_rules_model.py``) drive these functions alone, at thousands of steps a
second, against a model written from the seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta
from enum import Enum, StrEnum
from operator import attrgetter
from typing import Any

from ..errors import Conflict, TaskhosterError
from ..status import RetainFrom, Status
from ..timeutil import to_wire

LEASE_EXPIRED = "lease expired"
WORKER_DISCONNECTED = "worker disconnected"
TIMEOUT = "timeout"
CANCELLED = "cancelled"
HTTP_WORKER = "http"  # the holder of a claim made over REST (an attempt's ``worker``)


class Outcome(StrEnum):
    """How an attempt ended (section 8.2, ``GET /api/items/{id}/attempts``)."""

    RESULT = "result"
    FAIL = "fail"
    LAPSED = "lapsed"
    DROPPED = "dropped"
    CANCELLED = "cancelled"
    DELETED = "deleted"
    TIMEOUT = "timeout"


class Clock(StrEnum):
    """The sweep's clocks: a lease lapses (rule 6), a live item times out (rule 8), a done
    item's retention runs out (rule 11)."""

    LAPSE = "lapse"
    TIMEOUT = "timeout"
    RETAIN = "retain"


# -- the values the rules read -----------------------------------------------------------------


RowStamp = tuple[int, Status, str | None, int]


@dataclass(slots=True, eq=False)
class ItemRow:
    """An item's index row, as the engine reads and changes it (field names as the model's).

    ``dirty`` names the columns changed since it was read, so only they are written back.
    """

    id: str
    queue_id: int
    status: Status
    eligible: bool
    thread_id: str | None
    key: str | None
    seq: str
    scheduled_at: datetime
    posted_at: datetime
    attempts: int
    lease: str | None
    lease_expires_at: datetime | None
    claimed_at: datetime | None
    finished_at: datetime | None
    fetched_at: datetime | None
    error: str | None
    origin: Any
    dead_letter: str | None
    rev: int
    updated_at: datetime
    priority: int = 0
    claimed_by: str | None = None
    progress: Any = None
    cancel_reason: str | None = None
    unflushed: bool = False  # its file left by a failed flush (``Item.unflushed``)
    queue_name: str = ""
    dirty: set[str] = field(default_factory=set)

    def set(self, **values: Any) -> None:
        for name, value in values.items():
            if getattr(self, name) != value:
                setattr(self, name, value)
                self.dirty.add(name)

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal

    @property
    def stamp(self) -> RowStamp:
        """What every change of the row alters, one value or more: (rev, status, lease,
        attempts). A claim writes no line (its ``rev`` stays), but takes a new lease."""
        return (self.rev, self.status, self.lease, self.attempts)

    def snapshot(self) -> ItemRow:
        """A copy as the row is now, for an answer that later changes must not reach (made
        positionally: a fifth of ``dataclasses.replace``'s cost, once per answer)."""
        return ItemRow(*_ROW_VALUES(self))

    def __reduce__(self) -> tuple[type[ItemRow], tuple[Any, ...]]:
        """Pickled (to and from a committer process) as its values, made again by
        ``__init__``: a third less to write and read than a slotted dataclass's state."""
        return ItemRow, (*_ROW_VALUES(self), self.dirty)


# Every field of an ``ItemRow`` but ``dirty`` (its last), in the order ``__init__`` takes them.
assert [f.name for f in fields(ItemRow)][-1] == "dirty"
_ROW_VALUES = attrgetter(*(f.name for f in fields(ItemRow)[:-1]))


@dataclass(frozen=True, slots=True)
class RateLimit:
    """``rateLimit``: at most ``count`` claims start in any ``seconds``."""

    count: int
    seconds: float


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue's settings as the rules read them: its id and name, each of
    ``queues.QUEUE_SETTINGS`` by its field's name, in that order, and whether it is being
    deleted (``rows.QUEUE_COLUMNS``)."""

    id: int
    name: str
    lease_seconds: float
    queue_seconds: float
    retain_seconds: float
    max_attempts: int | None
    backoff_seconds: float
    backoff_max_seconds: float
    retain_from: RetainFrom
    dead_letter_queue: str | None
    paused: bool
    max_processing: int | None
    rate_limit: RateLimit | None
    thread_limit: int
    deleting: bool

    @property
    def controlled(self) -> bool:
        """A claim of this queue must count what it may take (section 8.1): it is paused,
        or has a cap on work in flight or a rate limit."""
        return self.paused or self.max_processing is not None or self.rate_limit is not None


@dataclass(slots=True)
class ThreadState:
    """A thread's row while a group holds it: ``delta`` members joined (or, negative, left)
    in this group; ``touched``: it must be settled (``settle``) before the group commits."""

    queue_id: int
    thread_id: str
    queue_name: str
    pk: int | None = None
    member_count: int = 0
    # How many members are processing, as the item rows said at the last settle (plus this
    # group's claims), and one of them, to show.
    processing: int = 0
    processing_item: str | None = None
    # The eligible members: the first ``threadLimit - processing`` pending ones in line.
    heads: list[str] = field(default_factory=list)
    delta: int = 0
    touched: bool = False

    @property
    def key(self) -> tuple[int, str]:
        return (self.queue_id, self.thread_id)


# -- the decisions -----------------------------------------------------------------------------


class Kind(Enum):
    """What a move is, for what the orchestrator does around it (its crash points)."""

    REQUEUE = "requeue"
    VERDICT = "verdict"
    RELEASE = "release"
    RESTART = "restart"
    CLAIM = "claim"
    EXTEND = "extend"
    FETCHED = "fetched"
    PROGRESS = "progress"


class ThreadEffect(Enum):
    """What a move does to its item's thread (nothing, for an item of none)."""

    NONE = "none"
    FREE = "free"  # it stopped processing but stays a member: the thread may advance
    LEAVE = "leave"  # it left for good (a verdict): the thread advances without it
    JOIN = "join"  # it is a new arrival (a restart)


@dataclass(frozen=True)
class Move:
    """Change an item: to ``status``, its row's ``changes``, its file's new line ``patch``
    (None: a move between directories without a line, or no file change at all)."""

    kind: Kind
    status: Status
    changes: dict[str, Any]
    patch: dict[str, Any] | None = None
    thread: ThreadEffect = ThreadEffect.NONE
    counters: tuple[str, ...] = ()
    news: tuple[str, ...] = ()  # announced for the item ("verdict", "removed:<cause>")
    dead_letter: bool = False  # a death: the item is copied to its dead-letter queue


@dataclass(frozen=True)
class Remove:
    """Rule 9 / rule 11: the item and its file go. ``reason``: told to a worker holding it."""

    reason: str | None


@dataclass(frozen=True)
class Keep:
    """Nothing changes."""


@dataclass(frozen=True)
class Refuse:
    """The operation is refused with ``error``; nothing changes."""

    error: TaskhosterError


Decision = Move | Remove | Keep | Refuse


# -- settings arithmetic -------------------------------------------------------------------------


def backoff_delay(queue: QueueInfo, attempts: int) -> float:
    """Rule 4: a retry waits ``backoffSeconds * 2^(attempts-1)``, at most
    ``backoffMaxSeconds``."""
    exponent = max(0, attempts - 1)
    if exponent > 60:
        return float(queue.backoff_max_seconds)
    return float(min(queue.backoff_max_seconds, queue.backoff_seconds * math.pow(2, exponent)))


def attempts_exhausted(queue: QueueInfo, attempts: int) -> bool:
    """Rule 7: an item whose ``maxAttempts``-th attempt ends without a result dies."""
    return queue.max_attempts is not None and attempts >= queue.max_attempts


def schedule_refusal(
    scheduled_at: datetime, posted_at: datetime, queue_seconds: float
) -> Conflict | None:
    """Rule 1: an item may not be scheduled past its queue's timeout: it would time out
    before it could be claimed. A 409: the body is well formed; it conflicts with
    ``queueSeconds``."""
    if scheduled_at > posted_at + timedelta(seconds=queue_seconds):
        return Conflict(
            "scheduledAt is beyond the queue timeout: the item would time out before it "
            "could be claimed",
            code="scheduled_beyond_timeout",
        )
    return None


# -- the moves every rule is made of ------------------------------------------------------------


def requeue(
    row: ItemRow, *, scheduled_at: datetime, error: str, at: datetime, counted: bool = True
) -> Move:
    """Back to pending, due at ``scheduled_at``; ``error`` keeps the cause, so a producer
    can see why."""
    return Move(
        Kind.REQUEUE,
        Status.PENDING,
        changes={
            "eligible": row.thread_id is None,
            "scheduled_at": scheduled_at,
            "error": error,
            "lease": None,
            "lease_expires_at": None,
            "rev": row.rev + 1,
            "updated_at": at,
        },
        patch={
            "rev": row.rev + 1,
            "status": Status.PENDING.value,
            "scheduledAt": to_wire(scheduled_at),
            "error": error,
            "attempts": row.attempts,
        },
        thread=ThreadEffect.FREE,
        counters=("requeues",) if counted else (),
    )


def verdict(
    row: ItemRow,
    status: Status,
    *,
    error: str | None,
    at: datetime,
    result: Any = None,
    dead_letter: bool = False,
) -> Move:
    """A verdict: ``finished`` or ``failed``, into ``done``, out of its thread, announced."""
    patch: dict[str, Any] = {
        "rev": row.rev + 1,
        "status": status.value,
        "finishedAt": to_wire(at),
        "error": error,
        "attempts": row.attempts,
    }
    if status is Status.FINISHED:
        patch["result"] = result
    return Move(
        Kind.VERDICT,
        status,
        changes={
            "eligible": False,
            "finished_at": at,
            "error": error,
            "lease": None,
            "lease_expires_at": None,
            "rev": row.rev + 1,
            "updated_at": at,
        },
        patch=patch,
        thread=ThreadEffect.LEAVE,
        counters=("results" if status is Status.FINISHED else "failures",),
        news=("verdict",),
        dead_letter=dead_letter,
    )


def die(row: ItemRow, *, error: str, at: datetime) -> Move:
    """Rule 7: failed, out of its thread, copied to the queue's dead-letter queue if any."""
    return verdict(row, Status.FAILED, error=error, at=at, dead_letter=True)


def holds(row: ItemRow, lease: str | None) -> bool:
    """The lease is the item's live one (rule 4, rule 5, rule 6's drop)."""
    return bool(lease) and row.status is Status.PROCESSING and row.lease == lease


def ended(row: ItemRow, outcome: Outcome, *, error: str | None, at: datetime) -> dict[str, Any]:
    """The story of the attempt ``row`` is in, ended now (section 8.2): it rides on the line
    its ending writes to the item's file, so a claim itself writes nothing durable."""
    return {
        "attempt": row.attempts,
        "claimedAt": to_wire(row.claimed_at),
        "worker": row.claimed_by,
        "endedAt": to_wire(at),
        "outcome": outcome.value,
        "error": error,
    }


def with_ended(move: Move, row: ItemRow, outcome: Outcome, *, at: datetime) -> Move:
    """``move`` ending the attempt of a processing ``row``: its line tells how (``ended``)."""
    if row.status is not Status.PROCESSING or move.patch is None:
        return move
    entry = ended(row, outcome, error=move.changes.get("error"), at=at)
    return replace(move, patch={**move.patch, "ended": entry})


# -- the rules ------------------------------------------------------------------------------------


def result(row: ItemRow, *, value: Any, at: datetime) -> Move | Keep:
    """Rule 3: the first result for a non-terminal item wins, lease or no lease; a later one
    changes nothing."""
    if row.is_terminal:
        return Keep()
    move = verdict(row, Status.FINISHED, error=None, result=value, at=at)
    return with_ended(move, row, Outcome.RESULT, at=at)


def fail(
    row: ItemRow,
    queue: QueueInfo,
    *,
    lease: str | None,
    error: str | None,
    retry: bool,
    at: datetime,
) -> Move | Keep:
    """Rule 4: only the lease holder fails an item; a retry waits its backoff, unless the
    attempts are used up (rule 7) or the worker asked for none."""
    if not holds(row, lease):
        return Keep()
    cause = error or "failed"
    if retry and not attempts_exhausted(queue, row.attempts):
        delay = backoff_delay(queue, row.attempts)
        move = requeue(row, scheduled_at=at + timedelta(seconds=delay), error=cause, at=at)
    else:
        move = die(row, error=cause, at=at)
    return with_ended(move, row, Outcome.FAIL, at=at)


def extend(
    row: ItemRow, queue: QueueInfo, *, lease: str | None, seconds: float | None, at: datetime
) -> Move | Keep:
    """Rule 5: the holder pushes its lease out to now + ``seconds``, at most
    ``leaseSeconds``."""
    if not holds(row, lease):
        return Keep()
    limit = queue.lease_seconds
    wanted = limit if seconds is None else min(float(seconds), limit)
    return Move(
        Kind.EXTEND,
        row.status,
        changes={"lease_expires_at": at + timedelta(seconds=wanted), "updated_at": at},
    )


def drop(row: ItemRow, queue: QueueInfo, *, lease: str, cause: str, at: datetime) -> Move | Keep:
    """Rule 6, a socket drop: an item still held under ``lease`` goes back to pending with
    its ``scheduledAt`` (or dies, its attempts used up)."""
    if row.status is not Status.PROCESSING or row.lease != lease:
        return Keep()
    if attempts_exhausted(queue, row.attempts):
        move = die(row, error=cause, at=at)
    else:
        move = requeue(row, scheduled_at=row.scheduled_at, error=cause, at=at)
    return with_ended(move, row, Outcome.DROPPED, at=at)


def release(row: ItemRow, *, lease: str, at: datetime) -> Move | Keep:
    """A claim whose push never reached a worker is undone: pending as if never claimed,
    its attempt taken back (the file moves back without a line)."""
    if row.status is not Status.PROCESSING or row.lease != lease:
        return Keep()
    return Move(
        Kind.RELEASE,
        Status.PENDING,
        changes={
            "eligible": row.thread_id is None,
            "attempts": max(0, row.attempts - 1),
            "lease": None,
            "lease_expires_at": None,
            "claimed_at": None,
            "claimed_by": None,
            "updated_at": at,
        },
        thread=ThreadEffect.FREE,
    )


def lapse(row: ItemRow, queue: QueueInfo, *, at: datetime) -> Move | Keep:
    """Rule 6, a lapse: a lease past its expiry is a drop with ``lease expired``."""
    if row.status is not Status.PROCESSING or row.lease_expires_at is None:
        return Keep()
    if row.lease_expires_at > at:
        return Keep()
    if attempts_exhausted(queue, row.attempts):
        move = die(row, error=LEASE_EXPIRED, at=at)
    else:
        move = requeue(row, scheduled_at=row.scheduled_at, error=LEASE_EXPIRED, at=at)
    return with_ended(move, row, Outcome.LAPSED, at=at)


def time_out(row: ItemRow, queue: QueueInfo, *, at: datetime) -> Move | Keep:
    """Rule 8: a live item older than ``queueSeconds`` fails with ``timeout`` (no dead-letter
    copy); a worker holding it is told."""
    if row.is_terminal or row.posted_at + timedelta(seconds=queue.queue_seconds) > at:
        return Keep()
    move = verdict(row, Status.FAILED, error=TIMEOUT, at=at)
    news = move.news + (("removed:" + TIMEOUT,) if row.status is Status.PROCESSING else ())
    move = replace(move, counters=(*move.counters, "timeouts"), news=news)
    return with_ended(move, row, Outcome.TIMEOUT, at=at)


def stop_reason(status: Status | None, error: str | None) -> str | None:
    """What a worker still holding an item is told (a ``cancel`` frame's reason) when the
    item is, by its row, ``status`` with ``error`` (None: the row is gone): the reason its
    removal's news said (rules 8 and 9, section 8.2), or None when no news tells a holder
    to stop (it is still live, or it ended in a way its holder hears by its own ack)."""
    if status is None:
        return "deleted"
    if status is Status.FAILED and error in (TIMEOUT, CANCELLED):
        return error
    return None


def cancel(row: ItemRow, *, reason: str | None, at: datetime) -> Move | Refuse:
    """Section 8.2: a pending or processing item fails now with ``cancelled`` (no
    dead-letter copy, its thread advances); a worker holding it is told to stop. A
    terminal item cannot be cancelled."""
    if row.is_terminal:
        return Refuse(
            Conflict(
                f"only a pending or processing item can be cancelled; this one is {row.status}",
                code="terminal",
            )
        )
    move = verdict(row, Status.FAILED, error=CANCELLED, at=at)
    assert move.patch is not None
    news = move.news + (("removed:" + CANCELLED,) if row.status is Status.PROCESSING else ())
    move = replace(
        move,
        changes={**move.changes, "cancel_reason": reason},
        patch={**move.patch, "cancelReason": reason},
        counters=(*move.counters, "cancels"),
        news=news,
    )
    return with_ended(move, row, Outcome.CANCELLED, at=at)


def progress(row: ItemRow, *, lease: str | None, value: Any, at: datetime) -> Move | Keep:
    """Section 8.2: the holder reports progress; the item keeps the latest value while it
    is processing. It does not extend the lease; a stale lease changes nothing."""
    if not holds(row, lease):
        return Keep()
    return Move(Kind.PROGRESS, row.status, changes={"progress": value})


def retain(row: ItemRow, queue: QueueInfo, *, at: datetime) -> Remove | Keep:
    """Rule 11: a done item goes ``retainSeconds`` after it finished, or after it was first
    fetched (``retainFrom``)."""
    start = row.finished_at if queue.retain_from == RetainFrom.FINISHED else row.fetched_at
    if not row.is_terminal or start is None:
        return Keep()
    if start + timedelta(seconds=queue.retain_seconds) > at:
        return Keep()
    return Remove(reason=None)


CLOCKS: dict[Clock, Callable[..., Move | Remove | Keep]] = {
    Clock.LAPSE: lapse,
    Clock.TIMEOUT: time_out,
    Clock.RETAIN: retain,
}


def clock(which: Clock, row: ItemRow, queue: QueueInfo, *, at: datetime) -> Move | Remove | Keep:
    """The sweep: one clock's rule for one item, re-checked at ``at``."""
    return CLOCKS[which](row, queue, at=at)


def delete(row: ItemRow, *, queue_id: int | None) -> Remove | Keep:
    """Rule 9: the item goes, whatever its status (a holder is told ``deleted``)."""
    if queue_id is not None and row.queue_id != queue_id:
        return Keep()
    return Remove(reason="deleted")


def restart(row: ItemRow, *, seq: str, at: datetime) -> Move | Refuse:
    """Rule 10: a failed item becomes a brand-new arrival (``seq``: its new place in line)."""
    if row.status is not Status.FAILED:
        return Refuse(
            Conflict(
                f"only a failed item can be restarted; this one is {row.status}",
                code="not_failed",
            )
        )
    return Move(
        Kind.RESTART,
        Status.PENDING,
        changes={
            "eligible": row.thread_id is None,
            "attempts": 0,
            "posted_at": at,
            "scheduled_at": at,
            "seq": seq,
            "finished_at": None,
            "fetched_at": None,
            "error": None,
            "dead_letter": None,
            "lease": None,
            "lease_expires_at": None,
            "claimed_at": None,
            "claimed_by": None,
            "progress": None,
            "cancel_reason": None,
            "rev": row.rev + 1,
            "updated_at": at,
        },
        patch={
            "rev": row.rev + 1,
            "status": Status.PENDING.value,
            "attempts": 0,
            "cancelReason": None,
            "postedAt": to_wire(at),
            "scheduledAt": to_wire(at),
            "seq": seq,
            "finishedAt": None,
            "fetchedAt": None,
            "result": None,
            "error": None,
            "deadLetter": None,
        },
        thread=ThreadEffect.JOIN,
    )


def fetched(row: ItemRow, *, at: datetime) -> Move | Keep:
    """A producer read a done item: its ``fetched`` retention clock starts, once."""
    if not row.is_terminal or row.fetched_at is not None:
        return Keep()
    return Move(Kind.FETCHED, row.status, changes={"fetched_at": at})


def claim(
    row: ItemRow, queue: QueueInfo, *, lease: str, at: datetime, holder: str = HTTP_WORKER
) -> Move:
    """Rule 2: a claimable item is taken under a new lease of ``leaseSeconds``, one more
    attempt counted (the file moves to ``processing/`` without a line). ``holder``: who
    gets it (a socket's name, or ``http``), for the attempt's story; the progress of an
    earlier attempt is cleared."""
    return Move(
        Kind.CLAIM,
        Status.PROCESSING,
        changes={
            "eligible": False,
            "attempts": row.attempts + 1,
            "lease": lease,
            "lease_expires_at": at + timedelta(seconds=queue.lease_seconds),
            "claimed_at": at,
            "claimed_by": holder,
            "progress": None,
            "updated_at": at,
        },
    )


# -- threads (seed 000) ---------------------------------------------------------------------------


def line_order(row: ItemRow) -> tuple[datetime, str]:
    """The order of the line: earliest ``scheduledAt``, then arrival (``seq``)."""
    return (row.scheduled_at, row.seq)


def claim_order(row: ItemRow) -> tuple[int, datetime, str]:
    """The order claims hand claimable items out in (section 8.1): higher ``priority``
    first, then the line's order."""
    return (-row.priority, row.scheduled_at, row.seq)


def thread_head(members: Iterable[ItemRow]) -> str | None:
    """A thread's head: its pending member first in line (``line_order``)."""
    pending = [row for row in members if row.status is Status.PENDING]
    return min(pending, key=line_order).id if pending else None


def thread_heads(members: Iterable[ItemRow], limit: int) -> list[str]:
    """A thread's eligible members under ``threadLimit`` ``limit``: its first ``limit -
    processing`` pending members in line (seed 000 when ``limit`` is 1)."""
    rows = list(members)
    busy = sum(1 for row in rows if row.status is Status.PROCESSING)
    pending = sorted((row for row in rows if row.status is Status.PENDING), key=line_order)
    return [row.id for row in pending[: max(0, limit - busy)]]


def may_take(row: ItemRow, thread: ThreadState | None, limit: int = 1) -> bool:
    """A claim may take a threaded candidate only as one of its thread's heads, while fewer
    than ``limit`` (``threadLimit``) of the thread's members are processing."""
    if row.thread_id is None:
        return True
    return thread is not None and thread.processing < limit and row.id in thread.heads


def apply_to_thread(thread: ThreadState, item_id: str, effect: ThreadEffect) -> None:
    """A member's move, as its thread's row counts it (settled by ``settle``)."""
    if effect is ThreadEffect.NONE:
        return
    if effect is ThreadEffect.JOIN:
        thread.delta += 1
    else:
        if thread.processing_item == item_id:
            thread.processing_item = None
        if effect is ThreadEffect.LEAVE:
            if item_id in thread.heads:
                thread.heads.remove(item_id)
            thread.delta -= 1
    thread.touched = True


def take_head(thread: ThreadState, item_id: str) -> None:
    """A head was claimed: one more member processing, one head fewer (until its verdict or
    return settles the thread again)."""
    thread.processing += 1
    if thread.processing_item is None:
        thread.processing_item = item_id
    if item_id in thread.heads:
        thread.heads.remove(item_id)


@dataclass(frozen=True)
class Line:
    """A thread's members as the index holds them, for ``settle``: up to ``limit`` of its
    processing members, and its first ``limit`` pending ones in line order."""

    processing: list[str]
    pending: list[str]


@dataclass(frozen=True)
class Settled:
    """A thread brought back to its rule: ``delete`` it (no member left), or ``heads`` are
    its eligible members; ``mark`` became eligible, ``unmark`` no longer is."""

    delete: bool
    heads: list[str]
    mark: list[str]
    unmark: list[str]


def settle(thread: ThreadState, line: Callable[[], Line], limit: int = 1) -> Settled | None:
    """Seed 000, with ``threadLimit`` ``limit``: the eligible members are the first ``limit -
    processing`` pending ones in line (``thread_heads``), the processing ones counted from
    the index's rows, never from a tally; a thread with no member left is deleted.
    ``line`` reads the thread's members as the index orders them. None: the thread was not
    touched."""
    if not thread.touched and thread.member_count + thread.delta > 0:
        return None  # (a row with no member is made for a join that was refused)
    thread.touched = False
    thread.member_count = max(0, thread.member_count + thread.delta)
    thread.delta = 0
    old = list(thread.heads)
    if thread.member_count == 0:
        thread.heads = []
        thread.processing = 0
        thread.processing_item = None
        return Settled(delete=True, heads=[], mark=[], unmark=old)
    found = line()
    thread.processing = len(found.processing)
    thread.processing_item = found.processing[0] if found.processing else None
    heads = found.pending[: max(0, limit - thread.processing)]
    thread.heads = heads
    return Settled(
        delete=False,
        heads=heads,
        mark=[h for h in heads if h not in old],
        unmark=[h for h in old if h not in heads],
    )


# -- flow control (section 8.1) --------------------------------------------------------------------


def claim_budget(
    queue: QueueInfo, want: int, *, processing: int, started: int
) -> tuple[int, str | None]:
    """How many of ``want`` a claim of ``queue`` may take now, and the control that holds
    the rest back (``paused``, ``maxProcessing``, ``rateLimit``; None: none). ``processing``:
    the queue's items processing now, counted from their rows; ``started``: the claims that
    started in the last ``rateLimit.seconds``. A held claim costs no item an attempt."""
    if queue.paused:
        return 0, "paused"
    budget, held = want, None
    if queue.max_processing is not None:
        room = max(0, queue.max_processing - processing)
        if room < budget:
            budget, held = room, "maxProcessing"
    if queue.rate_limit is not None:
        room = max(0, queue.rate_limit.count - started)
        if room < budget:
            budget, held = room, "rateLimit"
    return budget, held


def rate_window_opens(
    queue: QueueInfo, starts: Iterable[tuple[datetime, int]], at: datetime
) -> datetime | None:
    """When a claim of ``queue`` may next start, given the claims that started in the last
    ``rateLimit.seconds`` (their times and counts): None if one may start now (or there is
    no rate limit)."""
    if queue.rate_limit is None:
        return None
    window = timedelta(seconds=queue.rate_limit.seconds)
    recent = sorted((t, n) for t, n in starts if t > at - window)
    total = sum(n for _t, n in recent)
    if total < queue.rate_limit.count:
        return None
    # The window opens once enough of the oldest starts have left it.
    excess = total - queue.rate_limit.count + 1
    for started_at, n in recent:
        excess -= n
        if excess <= 0:
            return started_at + window
    return at + window  # (not reached)
