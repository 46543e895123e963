"""The sweep (rule 12): re-queue lapsed leases, fail aged items, delete retained ones, and
reclaim the items of deleted queues.

Each clock is a query over the index, walked in keyset chunks of ``SWEEP_CHUNK`` rows; each
chunk is one operation of a group commit that re-checks the rule for every item under the
lock. So a million expired items neither block the server nor make one giant transaction,
and two sweeps at once (or a sweep racing a result) each lose cleanly: the loser finds
nothing to do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Q, QuerySet

from ..conf import get_conf
from ..errors import TaskhosterError
from ..models import Item, Queue
from ..status import LIVE_STATUSES, TERMINAL_STATUSES, RetainFrom, Status
from ..timeutil import now as utcnow
from .common import seconds
from .removal import reclaim_deleted_queues
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

    def __str__(self) -> str:
        text = (
            f"swept {self.queues} queue(s): {self.requeued} lapsed lease(s) re-queued, "
            f"{self.timed_out} item(s) timed out, {self.retained} done item(s) deleted"
        )
        if self.reclaimed:
            text += f", {self.reclaimed} item(s) of deleted queues reclaimed"
        if self.errors:
            text += f"; {len(self.errors)} item(s) could not be changed: " + "; ".join(
                self.errors[:5]
            )
        return text


def _walk(queryset: QuerySet[Item], column: str, chunk: int) -> Iterator[list[str]]:
    """Yield ids in (column, id) order, a chunk at a time, by keyset (never OFFSET)."""
    last: tuple[datetime, str] | None = None
    while True:
        page = queryset
        if last is not None:
            page = page.filter(
                Q(**{f"{column}__gt": last[0]}) | Q(**{column: last[0], "id__gt": last[1]})
            )
        rows = list(page.order_by(column, "id").values_list(column, "id")[:chunk])
        if not rows:
            return
        yield [r[1] for r in rows]
        last = rows[-1]
        if len(rows) < chunk:
            return


def _apply(ids: list[str], clock: str, at: datetime, report: SweepReport) -> int:
    """Apply one clock to a chunk; a chunk that cannot be changed is logged and passed over,
    so it never stops the sweep for every other item."""
    try:
        return apply_clock(clock=clock, item_ids=ids, at=at)
    except TaskhosterError as exc:
        log.error("sweep: %s on %d item(s) failed: %s", clock, len(ids), exc.message)
        report.errors.append(f"{clock} on {ids[0]}..: {exc.message}")
        return 0


def sweep(*, at: datetime | None = None) -> SweepReport:
    at = at or utcnow()
    chunk = get_conf().sweep_chunk
    report = SweepReport()
    lapsed = Item.objects.filter(status=Status.PROCESSING, lease_expires_at__lte=at)
    for ids in _walk(lapsed, "lease_expires_at", chunk):
        report.requeued += _apply(ids, "lapse", at, report)
    for queue in Queue.objects.filter(deleting=False):
        report.queues += 1
        aged = Item.objects.filter(
            queue=queue, status__in=LIVE_STATUSES, posted_at__lte=at - seconds(queue.queue_seconds)
        )
        for ids in _walk(aged, "posted_at", chunk):
            report.timed_out += _apply(ids, "timeout", at, report)
        column = "finished_at" if queue.retain_from == RetainFrom.FINISHED else "fetched_at"
        retained = Item.objects.filter(
            queue=queue,
            status__in=TERMINAL_STATUSES,
            **{f"{column}__lte": at - seconds(queue.retain_seconds)},
        )
        for ids in _walk(retained, column, chunk):
            report.retained += _apply(ids, "retain", at, report)
    report.reclaimed += reclaim_deleted_queues()
    return report
