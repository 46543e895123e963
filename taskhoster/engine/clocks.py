"""The sweep (rule 12): post schedules' due slots (section 8.3), re-queue lapsed leases, fail
aged items, delete retained ones, and reclaim the items of deleted queues.

Each clock is a query over the index, walked in keyset chunks of ``SWEEP_CHUNK`` rows; each
chunk is one operation of a group commit that re-checks the rule for every item under the
lock. So a million expired items neither block the server nor make one giant transaction,
and two sweeps at once (or a sweep racing a result) each lose cleanly: the loser finds
nothing to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import Q, QuerySet

from ..conf import get_conf
from ..errors import TaskhosterError
from ..models import Item, Queue
from ..status import LIVE_STATUSES, TERMINAL_STATUSES, RetainFrom, Status
from ..timeutil import now as utcnow
from .common import seconds
from .pacing import Pacer, background
from .removal import reclaim_deleted_queues
from .rows import ITEM, adapt_time
from .rules import Clock
from .schedules import ON_TIME_SECONDS, ScheduleReport, fire_due
from .transitions import apply_clock

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    requeued: int = 0
    timed_out: int = 0
    retained: int = 0
    queues: int = 0
    reclaimed: int = 0
    errors: list[str] = field(default_factory=list)
    schedules: ScheduleReport = field(default_factory=ScheduleReport)

    @property
    def changed(self) -> bool:
        """Whether the pass did anything worth a line of the log."""
        s = self.schedules
        return bool(
            self.requeued or self.timed_out or self.retained or s.posted or s.skipped or s.errors
        )

    def __str__(self) -> str:
        text = (
            f"swept {self.queues} queue(s): {self.requeued} lapsed lease(s) re-queued, "
            f"{self.timed_out} item(s) timed out, {self.retained} done item(s) deleted"
        )
        if self.reclaimed:
            text += f", {self.reclaimed} item(s) of deleted queues reclaimed"
        s = self.schedules
        if s.posted or s.found or s.overlapped or s.skipped:
            text += (
                f"; schedules: {s.posted} slot(s) posted, {s.found} found posted already, "
                f"{s.overlapped} passed over (overlap), {s.skipped} too late to catch up"
            )
        if s.errors:
            text += f"; {len(s.errors)} schedule step(s) failed: " + "; ".join(s.errors[:5])
        if self.errors:
            text += f"; {len(self.errors)} item(s) could not be changed: " + "; ".join(
                self.errors[:5]
            )
        return text


def _walk(queryset: QuerySet[Item], column: str, pacer: Pacer) -> Iterator[list[str]]:
    """Yield ids in (column, id) order, a chunk at a time, by keyset (never OFFSET), in the
    chunk sizes ``pacer`` gives."""
    last: tuple[datetime, str] | None = None
    while True:
        page = queryset
        if last is not None:
            page = page.filter(
                Q(**{f"{column}__gt": last[0]}) | Q(**{column: last[0], "id__gt": last[1]})
            )
        size = pacer.size
        rows = list(page.order_by(column, "id").values_list(column, "id")[:size])
        if not rows:
            return
        yield [r[1] for r in rows]
        last = rows[-1]
        if len(rows) < size:
            return


def _clock(
    queryset: QuerySet[Item], column: str, clock: Clock, at: datetime, report: SweepReport
) -> int:
    """One clock over every item it applies to, paced: background work (``pacing``)."""
    chunk = get_conf().sweep_chunk
    pacer = Pacer(start=chunk, least=min(20, chunk), most=chunk)
    changed = 0
    for ids in _walk(queryset, column, pacer):
        pacer.wait_for_turn()
        started = time.perf_counter()
        with background():
            changed += _apply(ids, clock, at, report)
        pacer.chunk_done(len(ids), time.perf_counter() - started)
    return changed


def _apply(ids: list[str], clock: Clock, at: datetime, report: SweepReport) -> int:
    """Apply one clock to a chunk; a chunk that cannot be changed is logged and passed over,
    so it never stops the sweep for every other item."""
    try:
        return apply_clock(clock=clock, item_ids=ids, at=at)
    except TaskhosterError as exc:
        log.error("sweep: %s on %d item(s) failed: %s", clock, len(ids), exc.message)
        report.errors.append(f"{clock} on {ids[0]}..: {exc.message}")
        return 0


def _literals(statuses: tuple[Status, ...]) -> str:
    # Written out, as in the partial indexes' conditions, so that the planner uses them.
    return ", ".join(f"'{s.value}'" for s in statuses)


def _queues_with_work(queues: list[Queue], at: datetime) -> set[int]:
    """The ids of the queues that have an item to time out or to delete at ``at``: one
    query, an index probe or two per queue, so an idle queue costs a sweep next to nothing
    (not two queries each)."""
    probes: list[tuple[str, list[Any]]] = []
    for queue in queues:
        aged = adapt_time(at - seconds(queue.queue_seconds))
        kept = adapt_time(at - seconds(queue.retain_seconds))
        column = "finished_at" if queue.retain_from == RetainFrom.FINISHED else "fetched_at"
        probes.append(
            (
                f"SELECT %s WHERE EXISTS (SELECT 1 FROM {ITEM} WHERE queue_id = %s AND status "
                f"IN ({_literals(LIVE_STATUSES)}) AND posted_at <= %s) OR EXISTS (SELECT 1 "
                f"FROM {ITEM} WHERE queue_id = %s AND status IN ({_literals(TERMINAL_STATUSES)})"
                f" AND {column} <= %s)",
                [queue.id, queue.id, aged, queue.id, kept],
            )
        )
    found: set[int] = set()
    with connection.cursor() as cursor:
        for start in range(0, len(probes), 100):
            part = probes[start : start + 100]
            cursor.execute(
                " UNION ALL ".join(sql for sql, _params in part),
                [value for _sql, params in part for value in params],
            )
            found |= {int(row[0]) for row in cursor.fetchall()}
    return found


def sweep(*, at: datetime | None = None, on_time: float = ON_TIME_SECONDS) -> SweepReport:
    """One pass of every clock. ``on_time``: schedules' slots at most this late were found
    on time (``schedules.fire_due``)."""
    at = at or utcnow()
    report = SweepReport()
    report.schedules = fire_due(at=at, on_time=on_time)
    lapsed = Item.objects.filter(status=Status.PROCESSING, lease_expires_at__lte=at)
    report.requeued += _clock(lapsed, "lease_expires_at", Clock.LAPSE, at, report)
    queues = list(Queue.objects.filter(deleting=False))
    report.queues = len(queues)
    due = _queues_with_work(queues, at)
    for queue in queues:
        if queue.id not in due:
            continue
        aged = Item.objects.filter(
            queue=queue, status__in=LIVE_STATUSES, posted_at__lte=at - seconds(queue.queue_seconds)
        )
        report.timed_out += _clock(aged, "posted_at", Clock.TIMEOUT, at, report)
        column = "finished_at" if queue.retain_from == RetainFrom.FINISHED else "fetched_at"
        retained = Item.objects.filter(
            queue=queue,
            status__in=TERMINAL_STATUSES,
            **{f"{column}__lte": at - seconds(queue.retain_seconds)},
        )
        report.retained += _clock(retained, column, Clock.RETAIN, at, report)
    report.reclaimed += reclaim_deleted_queues()
    return report
