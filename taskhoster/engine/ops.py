"""The requests a group commit carries, and their answers.

Every change to an item is one of these operations, typed by its answer (``Op[T]``). Callers
build one and run it with ``committer.execute`` (or await it with ``execute_async``): it joins
the next group, and its own answer (or its own error) comes back. A single-item call is a
group of one: there is no second implementation of any rule.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

from ..status import Status
from .rules import Clock, ItemRow

T = TypeVar("T")


@dataclass(frozen=True)
class NewItem:
    """What a producer asks to post, already validated for shape."""

    payload: Any
    thread_id: str | None = None
    scheduled_at: datetime | None = None
    delay_seconds: float | None = None
    key: str | None = None
    origin: dict[str, Any] | None = None
    priority: int = 0


@dataclass(frozen=True)
class Posted:
    """A post's answer: the new item, or (``created`` false) the live item with its key,
    with its result (the one a read shows) when it is finished."""

    row: ItemRow
    payload: Any
    created: bool
    result: Any = None


@dataclass(frozen=True)
class Claimed:
    row: ItemRow
    payload: Any


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    status: Status | None
    row: ItemRow | None = None


@dataclass(eq=False)
class Op(Generic[T]):
    """One request in a group. ``size`` is how many items it may touch (for group limits).

    A caller in a thread waits on ``future``; a caller on an event loop on ``waiter``, which
    the committer settles on ``loop`` together with the rest of its group's answers there
    (one wake-up of the loop per group, not one per operation).
    """

    future: Future[T] | None = field(default=None, init=False, repr=False, compare=False)
    loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    waiter: asyncio.Future[T] | None = field(default=None, init=False, repr=False)
    # Its number on the way to and from a committer process (``engine.process``).
    wire_id: int | None = field(default=None, init=False, repr=False)
    # When it was handed to this process's committer (time.monotonic), for admission.
    submitted: float = field(default=0.0, init=False, repr=False)
    # Handed in by background work (``pacing.background``): it does not make other
    # background work rest.
    background: bool = field(default=False, init=False, repr=False)
    # ``events.generation()`` when its answer came: news delivered before it came from
    # groups no later than this operation's (one committer answers in order).
    generation: int = field(default=0, init=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        """Sent to a committer process without what waits for it here."""
        state = dict(self.__dict__)
        state.update(future=None, loop=None, waiter=None)
        return state

    @property
    def size(self) -> int:
        return 1


@dataclass(eq=False)
class Post(Op[list[Posted]]):
    """Rule 1. ``rows[i]`` and ``lines[i]`` are ``items[i]``'s new row and the first line of
    its file, made before the group by ``posts.prepare_post``.

    ``key_hash``: a caller that has not looked its key up (a post answered on the event loop,
    which must not wait for the database) leaves the check to the group: the key must be live,
    have the ``produce`` scope and may use the queue, or the post is refused (``KeyRefused``).
    """

    queue_name: str
    items: list[NewItem]
    rows: list[ItemRow]
    lines: list[bytes]
    key_hash: str | None = None
    # A schedule's slot: its item's id is the same in every attempt, so a file already at
    # that name is an attempt's that never committed, and is replaced (``FileBatch.create``).
    replace_leftover: bool = False

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass(eq=False)
class Claim(Op[list[Claimed]]):
    """Rule 2: up to ``max_items`` claimable items of a queue, under new leases."""

    queue_name: str
    max_items: int
    # Who gets each item, in order (the sockets' names, for the attempts' stories); an item
    # past them goes to ``http`` (a REST claim).
    holders: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return self.max_items


@dataclass(eq=False)
class ItemOp(Op[T]):
    """An operation on items that already exist."""

    def item_ids(self) -> tuple[str, ...]:
        raise NotImplementedError


@dataclass(eq=False)
class OneItemOp(ItemOp[T]):
    """An operation on one item."""

    item_id: str

    def item_ids(self) -> tuple[str, ...]:
        return (self.item_id,)


@dataclass(eq=False)
class Result(OneItemOp[Verdict]):
    """Rule 3: the first result for a non-terminal item wins. ``queues``: the queues the
    caller's key may use (None: any); an item of another queue is not found, for that key."""

    result: Any
    queues: frozenset[str] | None = None
    # False: the caller needs the verdict alone (a socket's ack), not the row with it, which
    # a committer process would copy back for nothing.
    with_row: bool = True


@dataclass(eq=False)
class Fail(OneItemOp[Verdict]):
    """Rule 4: the lease holder failed; retry with backoff, or die."""

    lease: str | None
    error: str | None
    retry: bool = True
    with_row: bool = True  # as ``Result.with_row``


@dataclass(eq=False)
class Extend(OneItemOp[tuple[bool, ItemRow]]):
    """Rule 5: push the lease out."""

    lease: str | None
    seconds: float | None = None


@dataclass(eq=False)
class Progress(OneItemOp[tuple[bool, ItemRow]]):
    """Section 8.2: the holder's latest progress, kept while it is processing."""

    lease: str | None
    progress: Any


@dataclass(eq=False)
class Cancel(OneItemOp[ItemRow]):
    """Section 8.2: a pending or processing item fails now, ``cancelled``."""

    reason: str | None = None


@dataclass(eq=False)
class Requeue(OneItemOp[Verdict]):
    """Rule 6, socket drop: back to pending (or die) if still held under ``lease``."""

    lease: str
    cause: str


@dataclass(eq=False)
class Release(OneItemOp[Verdict]):
    """Undo a claim whose push never reached a worker: no attempt is counted."""

    lease: str


@dataclass(eq=False)
class ItemsOp(ItemOp[T]):
    """An operation on each of ``ids``."""

    ids: tuple[str, ...]

    def item_ids(self) -> tuple[str, ...]:
        return self.ids

    @property
    def size(self) -> int:
        return len(self.ids)


@dataclass(eq=False)
class Sweep(ItemsOp[int]):
    """The sweep's clocks on a chunk of items, each re-checked under the lock:
    ``lapse`` (rule 6), ``timeout`` (rule 8), ``retain`` (rule 11). Answers how many changed."""

    clock: Clock
    at: datetime


@dataclass(eq=False)
class Delete(ItemsOp[int]):
    """Rule 9 for each id (in ``queue_id`` only, when given). Answers how many went."""

    queue_id: int | None = None
    # One item asked for by name (``delete_item``): marked ``unflushed``, it is refused
    # (503); of many (a selection, a status's items), marked ones are passed by.
    refuse_marked: bool = False


@dataclass(eq=False)
class Restart(OneItemOp[ItemRow]):
    """Rule 10: a failed item becomes a brand-new arrival."""


@dataclass(eq=False)
class Rewrite(ItemsOp[int]):
    """The committer's own: write the files of ``ids`` again as new files, which a flush
    failed to make durable after their group committed (``runner``: nothing else is
    changed until it succeeds). Answers how many it wrote; an item gone since needs none.

    ``asked``: by a producer's read (``reading.durable_row``), which waits for it. An item
    this committer already writes again at its own pace (its own, taken up) or has set
    aside (its file does not read as its row says) is left to that, and answers 0: reads
    in a flood cost no more writes than that pace."""

    asked: bool = False


@dataclass(eq=False)
class MarkFetched(OneItemOp[datetime | None]):
    """A producer read a terminal item: its ``fetched`` retention clock starts."""

    at: datetime


@dataclass(eq=False)
class Reclaim(Op[int]):
    """The rows ``ids`` of a deleted queue (``deleting``), whose files are already gone with
    its directory: their rows and counts go. Answers how many rows went."""

    queue_id: int
    ids: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.ids)


@dataclass(eq=False)
class Resettle(Op[int]):
    """The threads ``thread_ids`` of a queue are brought back to their rule
    (``rules.settle``) under its current ``threadLimit``, which has changed: their heads
    recounted. Answers how many threads there were."""

    queue_id: int
    thread_ids: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.thread_ids)


@dataclass(frozen=True)
class Firing:
    """One step of a schedule (SPEC section 8.3), made by the sweep from the schedule as it
    read it: if the schedule is still at ``rev`` and its next slot is still ``expect``, post
    ``slot``'s item (``post``, under the slot's key; none when ``slot`` is None: slots too
    late to catch up are only passed over) and move the schedule's next slot to ``after``."""

    schedule_id: int
    rev: int
    expect: datetime
    after: datetime | None
    slot: datetime | None = None
    post: Post | None = None


@dataclass(frozen=True)
class Fired:
    """A firing's answer: ``done`` false if another sweep or a change of the schedule got
    there first (nothing changed); else the slot's item (``item``: made now, or found under
    its key), or none (``overlap``: its previous item is not terminal, so ``skip`` posted
    nothing)."""

    done: bool
    item: str | None = None
    created: bool = False
    overlap: bool = False
    error: str | None = None  # why its post was refused (a full disk, say): tried again


@dataclass(eq=False)
class Fire(Op[list[Fired]]):
    """The sweep's schedule steps, in order, in one group (one per slot: a schedule behind by
    several slots has several, each expecting the one before it)."""

    firings: list[Firing]

    @property
    def size(self) -> int:
        return len(self.firings)
