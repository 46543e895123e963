"""Reads: one item (a producer's read starts the ``fetched`` retention clock), long-poll for a
verdict, pages of items, live counts per status (kept by every group: flat however many items a
queue holds), which queues are live and which one an item is in, and where the state root is."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.db import connection
from django.db.models import Sum

from .. import events
from ..conf import get_conf
from ..errors import ItemNotFound, NotYetDurable
from ..models import Item, Queue, QueueCount
from ..status import Status
from ..store import FileMissing, Record
from ..timeutil import to_wire
from . import rows as sql
from .common import store
from .rules import ItemRow, stop_reason
from .transitions import mark_fetched, write_again


def stopped_holds(item_ids: Iterable[str]) -> dict[str, str]:
    """Of items sockets hold, those their workers are to be told to stop, each with the
    reason (``rules.stop_reason``), from their rows: what the news of their removal said,
    for when that news was lost. One query per 500 items."""
    wanted = list(item_ids)
    states = sql.select_states(wanted)
    found: dict[str, str] = {}
    for item_id in wanted:
        status, error = states.get(item_id, (None, None))
        reason = stop_reason(status, error)
        if reason is not None:
            found[item_id] = reason
    return found


def get_row(item_id: str) -> ItemRow | None:
    """The item's row, with its queue's name; None if it does not exist (or its queue is
    being deleted)."""
    found = sql.select_rows([item_id], lock=False).get(item_id)
    if found is None:
        return None
    queue = Queue.objects.filter(id=found.queue_id, deleting=False).values_list("name").first()
    if queue is None:
        return None
    found.queue_name = queue[0]
    return found


def item_queue(item_id: str) -> str | None:
    """The name of the item's queue; None if the item does not exist or its queue is being
    deleted."""
    return (
        Item.objects.filter(id=item_id, queue__deleting=False)
        .values_list("queue__name", flat=True)
        .first()
    )


def live_queues() -> list[Queue]:
    """Every queue, but those being deleted."""
    return list(Queue.objects.filter(deleting=False))


def live_queue_names(names: Iterable[str]) -> list[str]:
    """Those of ``names`` that are queues, not being deleted."""
    return list(
        Queue.objects.filter(name__in=list(names), deleting=False).values_list("name", flat=True)
    )


def store_root() -> Path:
    """The state root of this process's store (resolved): where the item files are."""
    return store().root


def get_item(*, item_id: str, producer_read: bool = False) -> tuple[ItemRow, Record]:
    """The item's row and file. A producer's read of a terminal item marks it fetched, and
    of an item marked ``unflushed`` writes its file again first (``durable_row``)."""
    row = get_row(item_id)
    if row is None:
        raise ItemNotFound(f"item {item_id!r} does not exist")
    if producer_read:
        row = durable_row(row)
    try:
        _state, record = store().read_any(row.queue_name, row.id, Status(row.status).state)
    except FileMissing:
        raise ItemNotFound(f"item {item_id!r} does not exist") from None
    if producer_read and row.is_terminal and row.fetched_at is None:
        row.fetched_at = mark_fetched(item_id=item_id)
    return row, record


ATTEMPTS_FIRST = 10  # an item's story shows its first attempts,
ATTEMPTS_LAST = 40  # and its latest, with a count of those left out between


def durable_row(row: ItemRow) -> ItemRow:
    """``row``, or, marked ``unflushed`` (its file left by a flush that failed after its
    group committed), the row once its file is written again and durable: what the cache
    says of it otherwise is what a power cut may take back (a result the producer acted
    on, gone, and the item run again). Refused (``NotYetDurable``) while it cannot be
    written (the disk still refuses, or the file does not read as the row says). The
    rewrite runs in the committer (a process of its own, by default): a look here would
    reach none."""
    if not row.unflushed:
        return row
    if connection.in_atomic_block:
        # Inside a caller's own transaction (an embedding's) a rewrite would run there,
        # its mark's clearing and its locks the caller's: refused, and written again by a
        # committer's own look at marked rows (every 30 s) or the next read outside one.
        raise NotYetDurable()
    write_again(item_id=row.id)
    again = get_row(row.id)
    if again is None:
        raise ItemNotFound(f"item {row.id!r} does not exist")
    if again.unflushed:
        raise NotYetDurable()
    return again


def attempts(*, item_id: str, producer_read: bool = False) -> tuple[list[dict[str, Any]], int]:
    """Section 8.2: the item's attempts, oldest first, and how many were left out between
    its first ``ATTEMPTS_FIRST`` and its last ``ATTEMPTS_LAST``.

    Each ended attempt is told by the line its ending wrote to the item's file (``ended``:
    durable with that line, so with every acknowledged outcome); the running one by the
    item's row. A claim writes nothing durable of its own. A producer's read of an item
    marked ``unflushed`` writes its file again first (``durable_row``); an operator's (the
    admin) shows the file as it reads.
    """
    row = get_row(item_id)
    if row is None:
        raise ItemNotFound(f"item {item_id!r} does not exist")
    if producer_read:
        row = durable_row(row)
    try:
        lines = store().read_lines(row.queue_name, row.id, Status(row.status).state)
    except FileMissing:
        raise ItemNotFound(f"item {item_id!r} does not exist") from None
    story = [line["ended"] for line in lines if isinstance(line.get("ended"), dict)]
    if row.status is Status.PROCESSING:
        story.append(
            {
                "attempt": row.attempts,
                "claimedAt": to_wire(row.claimed_at),
                "worker": row.claimed_by,
                "endedAt": None,
                "outcome": None,
                "error": None,
            }
        )
    omitted = max(0, len(story) - ATTEMPTS_FIRST - ATTEMPTS_LAST)
    if omitted:
        story = story[:ATTEMPTS_FIRST] + story[-ATTEMPTS_LAST:]
    return story, omitted


def wait_for_verdict(*, item_id: str, wait: float) -> None:
    """Return once the item is terminal or gone, or after ``wait`` seconds. It looks at the
    item again when news names it (its verdict, its removal, its queue's deletion, from this
    process or, by the bus, any other), and else every ``LONG_POLL_INTERVAL``: a hundred
    idle long-polls cost a hundred looks a second at most, not a thousand."""
    deadline = time.monotonic() + wait
    interval = get_conf().long_poll_interval
    names = [f"i:{item_id}"]
    while True:
        seen = events.generation()
        found = Item.objects.filter(id=item_id).values_list("status", "queue__name").first()
        if found is None or Status(found[0]).is_terminal:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if len(names) == 1:
            names.append(f"d:{found[1]}")
        wait_for_news(names, seen, min(remaining, interval))


def wait_for_news(names: list[str], since: int, timeout: float) -> int:
    """``events.wait_for``, with this thread's database connection given back to the pool
    first: a long-poll holds no connection while it waits (forty of them once took every
    connection of PostgreSQL's pool of twenty, and a result waited for one until it timed
    out). Without a pool (SQLite) the thread keeps its connection, which costs nothing."""
    if getattr(connection, "pool", None) is not None and not connection.in_atomic_block:
        connection.close()  # to the pool, not to the server
    return events.wait_for(names, since, timeout)


def list_items(
    *, queue: Queue, status: Status | None, thread_id: str | None, after: str | None, limit: int
) -> tuple[list[Item], str | None]:
    """A page of items in id order (arrival), and the id to continue after, if any."""
    rows = Item.objects.filter(queue=queue)
    if status is not None:
        rows = rows.filter(status=status)
    if thread_id is not None:
        rows = rows.filter(thread_id=thread_id)
    if after:
        rows = rows.filter(id__gt=after)
    page = list(rows.order_by("id")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return page, (page[-1].id if more and page else None)


def counts_by_queue(queue_ids: list[int]) -> dict[int, dict[str, int]]:
    """Items per status of each queue: a sum over a handful of count rows, never a count of
    the items themselves."""
    counts: dict[int, dict[str, int]] = {q: {s.value: 0 for s in Status} for q in queue_ids}
    for row in (
        QueueCount.objects.filter(queue_id__in=queue_ids)
        .values("queue_id", "status")
        .annotate(n=Sum("n"))
    ):
        counts[row["queue_id"]][row["status"]] = int(row["n"] or 0)
    return counts


def payload_and_result(record: Record) -> tuple[Any, Any]:
    return record.get("payload"), record.get("result")
