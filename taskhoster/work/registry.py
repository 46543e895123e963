"""Which workers are connected, to every server process (SPEC section 8.2: ``GET
/api/workers``, ``POST /api/workers/{id}/drain``).

Each server process writes its own open ``/work`` sockets to ``WorkerSocket`` rows, from its
dispatcher's reporter (``publish``, once a second): only the sockets that changed (subscribed,
took or gave back an item, were drained; ``lastSeenAt`` moves at most every
``SEEN_GRANULARITY`` seconds), so a thousand idle sockets cost nothing per second. The
process's own ``ServerProcess`` row is touched every ``HEARTBEAT_SECONDS`` whatever its number
of sockets: that is what says its rows are current.

A process that stops cleanly deletes its rows (``forget``). One that dies leaves them, and its
heartbeat stops: its sockets are left out of every listing once its heartbeat is older than
``ALIVE_SECONDS`` (no sweep has to notice), and its rows are deleted at the next heartbeat
of any process serving a socket once it is ``FORGET_SECONDS`` old. After a restart of every
process the listing is right at once: the old processes' heartbeats are old. A process
forgotten while alive (the database away that long) finds its row gone at its next
heartbeat and writes every socket's row again.

Draining reaches the socket's process by news (``DRAIN`` names the socket; the bus carries
it to every process) and, should that news be lost, by the ``draining`` column, which each
process reads back for its own sockets at every heartbeat.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket as socket_module
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from .. import events
from ..metrics import PROCESS
from ..models import ServerProcess, WorkerSocket
from ..timeutil import now as utcnow
from ..timeutil import to_wire

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0
ALIVE_SECONDS = 3 * HEARTBEAT_SECONDS + 1  # a heartbeat older than this: the process is gone
FORGET_SECONDS = 60.0  # a gone process's rows are deleted after this long
SEEN_GRANULARITY = 5.0  # lastSeenAt is written when it has moved this much
DRAIN = "drain-worker"  # news: (DRAIN, "", socket id): that socket is drained

_started = utcnow()


@dataclass(frozen=True)
class Entry:
    """One socket as its process publishes it."""

    id: str
    name: str
    key_id: int | None
    queues: tuple[str, ...]
    capacity: int
    held: tuple[str, ...]
    draining: bool
    connected_at: datetime
    last_seen_at: datetime

    def same(self, other: Entry | None) -> bool:
        """Whether ``other`` (the last published) needs no new write for this one."""
        if other is self:
            return True  # given again unchanged (``Dispatcher.registry_entries``)
        if other is None:
            return False
        moved = (self.last_seen_at - other.last_seen_at).total_seconds()
        return (
            self.name == other.name
            and self.queues == other.queues
            and self.capacity == other.capacity
            and self.held == other.held
            and self.draining == other.draining
            and moved < SEEN_GRANULARITY
        )


class Publisher:
    """What one process has written of its sockets, to write only what changed."""

    def __init__(self) -> None:
        self.written: dict[str, Entry] = {}
        self.beat = 0.0  # time.monotonic() of the last heartbeat

    def publish(self, entries: Sequence[Entry], now_monotonic: float) -> set[str]:
        """Write the sockets that changed, delete those that closed, and (every heartbeat)
        touch this process's row. Returns the ids of this process's sockets marked
        draining in the table (read back at each heartbeat; empty otherwise)."""
        if not entries and not self.written:
            return set()  # no socket: nothing to list, no heartbeat needed
        changed = [e for e in entries if not e.same(self.written.get(e.id))]
        live = {e.id for e in entries}
        closed = [i for i in self.written if i not in live]
        beat = now_monotonic - self.beat >= HEARTBEAT_SECONDS
        if not changed and not closed and not beat:
            return set()
        draining: set[str] = set()
        with transaction.atomic():
            if beat and _touch():
                # This process's row was gone, and with it its sockets' rows: another process
                # forgot it (its heartbeat had stopped FORGET_SECONDS, the database away that
                # long), or the database lost them. What was written is written again.
                changed = list(entries)
            if closed:
                WorkerSocket.objects.filter(id__in=closed).delete()
            for entry in changed:
                WorkerSocket.objects.update_or_create(id=entry.id, defaults=_fields(entry))
            if beat:
                draining = set(
                    WorkerSocket.objects.filter(process=PROCESS, draining=True).values_list(
                        "id", flat=True
                    )
                )
        for entry in changed:
            self.written[entry.id] = entry
        for item in closed:
            self.written.pop(item, None)
        if beat:
            self.beat = now_monotonic
            _forget_gone()
        return draining


def _fields(entry: Entry) -> dict[str, Any]:
    return {
        "process": PROCESS,
        "name": entry.name,
        "key_id": entry.key_id,
        "queues": list(entry.queues),
        "capacity": entry.capacity,
        "held": list(entry.held),
        "connected_at": entry.connected_at,
        "last_seen_at": entry.last_seen_at,
        # Never set back here: a drain written by another process stays.
        **({"draining": True} if entry.draining else {}),
    }


def _touch() -> bool:
    """This process's heartbeat; whether its row had to be made (the first, or it was gone)."""
    _row, created = ServerProcess.objects.update_or_create(
        process=PROCESS,
        defaults={
            "host": socket_module.gethostname()[:255],
            "pid": os.getpid(),
            "started_at": _started,
            "seen_at": utcnow(),
        },
    )
    return created


def _forget_gone() -> None:
    """Delete the rows of processes whose heartbeat stopped ``FORGET_SECONDS`` ago.

    Only rows still stale when deleted go: the stale processes are read in the deleting
    transaction, their rows locked (PostgreSQL; SQLite's IMMEDIATE transaction holds every
    writer off), so a heartbeat that commits meanwhile either comes first (the row is fresh
    when read and kept) or waits for the delete (its ``_touch`` then makes the row again and
    its process writes every socket's row again)."""
    cutoff = utcnow() - timedelta(seconds=FORGET_SECONDS)
    stale = ServerProcess.objects.filter(seen_at__lt=cutoff)
    if not stale.exists():
        return  # the usual case: no write transaction
    with transaction.atomic():
        # (In one order: two processes forgetting at once lock the same rows alike.)
        gone = list(stale.select_for_update().order_by("process").values_list("process", flat=True))
        if gone:
            ServerProcess.objects.filter(process__in=gone).delete()
            WorkerSocket.objects.filter(process__in=gone).delete()


def forget() -> None:
    """This process stops: its sockets leave the listing now."""
    try:
        with transaction.atomic():  # in ``_forget_gone``'s order: the process row first
            ServerProcess.objects.filter(process=PROCESS).delete()
            WorkerSocket.objects.filter(process=PROCESS).delete()
    except Exception as exc:  # the database is away: the heartbeat's age tells instead
        log.info("could not remove this process's workers from the registry: %s", exc)


_forget_registered = False


def forget_at_exit() -> None:
    """Once a process has published sockets: forget them when it exits."""
    global _forget_registered
    if not _forget_registered:
        _forget_registered = True
        atexit.register(forget)


# -- reading and draining (any process) -----------------------------------------------------


def is_socket_id(value: str) -> bool:
    """The shape of a socket's id (``secrets.token_hex(8)``)."""
    return len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _live_processes() -> set[str]:
    cutoff = utcnow() - timedelta(seconds=ALIVE_SECONDS)
    return set(ServerProcess.objects.filter(seen_at__gte=cutoff).values_list("process", flat=True))


def wire(row: WorkerSocket) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name,
        "queues": list(row.queues or []),
        "capacity": row.capacity,
        "held": list(row.held or []),
        "draining": row.draining,
        "connectedAt": to_wire(row.connected_at),
        "lastSeenAt": to_wire(row.last_seen_at),
    }


def may_see(row: WorkerSocket, queues: frozenset[str] | None) -> bool:
    """A key limited to ``queues`` sees (and drains) only sockets of those queues alone."""
    if queues is None:
        return True
    subscribed = set(row.queues or [])
    return bool(subscribed) and subscribed <= queues


def workers(queues: frozenset[str] | None = None) -> list[WorkerSocket]:
    """Every open socket of every live server process (those a key limited to ``queues``
    may see), in the order they connected."""
    live = _live_processes()
    rows = WorkerSocket.objects.filter(process__in=live).order_by("connected_at", "id")
    return [row for row in rows if may_see(row, queues)]


def worker(socket_id: str, queues: frozenset[str] | None = None) -> WorkerSocket | None:
    row = WorkerSocket.objects.filter(id=socket_id, process__in=_live_processes()).first()
    return row if row is not None and may_see(row, queues) else None


def drain(rows: Iterable[WorkerSocket]) -> list[WorkerSocket]:
    """Drain these sockets: marked in the table, and the news sent to every process (the
    socket's own sends it the ``drain`` frame and deals it nothing more)."""
    chosen = list(rows)
    if not chosen:
        return []
    WorkerSocket.objects.filter(id__in=[r.id for r in chosen]).update(draining=True)
    for row in chosen:
        row.draining = True
    events.announce_many([(DRAIN, "", row.id) for row in chosen])
    return chosen
