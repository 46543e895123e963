"""The sweep (rule 12): re-queue lapsed leases, fail aged items, delete retained ones.

Each clock is a query over the index, walked in keyset chunks of ``SWEEP_CHUNK`` rows; each
item changes in its own short transaction that re-checks the rule under the row lock. So a
million expired items neither block the server nor make one giant transaction, and two sweeps
at once (or a sweep racing a result) each lose cleanly: the loser finds nothing to do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Q, QuerySet

from ..conf import get_conf
from ..errors import TaskhosterError
from ..models import Item, Queue
from ..status import LIVE_STATUSES, TERMINAL_STATUSES, RetainFrom, Status
from ..timeutil import now as utcnow
from .common import seconds
from .removal import delete_if_retained
from .verdicts import requeue_if_lapsed, time_out_if_aged

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    requeued: int = 0
    timed_out: int = 0
    retained: int = 0
    queues: int = 0
    errors: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        text = (
            f"swept {self.queues} queue(s): {self.requeued} lapsed lease(s) re-queued, "
            f"{self.timed_out} item(s) timed out, {self.retained} done item(s) deleted"
        )
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


def _apply(ids: list[str], change: Callable[..., bool], at: datetime, report: SweepReport) -> int:
    """Apply one clock to each item; one item that cannot be changed (say, an unreadable
    file) is logged and passed over, so it never stops the sweep for every other item."""
    done = 0
    for item_id in ids:
        try:
            done += bool(change(item_id=item_id, at=at))
        except TaskhosterError as exc:
            log.error("sweep: %s on %s failed: %s", change.__name__, item_id, exc.message)
            report.errors.append(f"{item_id}: {exc.message}")
    return done


def sweep(*, at: datetime | None = None) -> SweepReport:
    at = at or utcnow()
    chunk = get_conf().sweep_chunk
    report = SweepReport()
    lapsed = Item.objects.filter(status=Status.PROCESSING, lease_expires_at__lte=at)
    for ids in _walk(lapsed, "lease_expires_at", chunk):
        report.requeued += _apply(ids, requeue_if_lapsed, at, report)
    for queue in Queue.objects.filter(deleting=False):
        report.queues += 1
        aged = Item.objects.filter(
            queue=queue, status__in=LIVE_STATUSES, posted_at__lte=at - seconds(queue.queue_seconds)
        )
        for ids in _walk(aged, "posted_at", chunk):
            report.timed_out += _apply(ids, time_out_if_aged, at, report)
        column = "finished_at" if queue.retain_from == RetainFrom.FINISHED else "fetched_at"
        retained = Item.objects.filter(
            queue=queue,
            status__in=TERMINAL_STATUSES,
            **{f"{column}__lte": at - seconds(queue.retain_seconds)},
        )
        for ids in _walk(retained, column, chunk):
            report.retained += _apply(ids, delete_if_retained, at, report)
    return report
