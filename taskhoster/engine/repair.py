"""Bring the index back in line with the state directories (``manage.py sweep --repair``).

The files are the truth. Each file's record is its lines folded in order; a torn last line
(a write a crash cut short, never acknowledged) is cut off, and a file that cannot be read
at all (a new file whose data a power cut lost before its group's flush: never acknowledged)
is moved to ``<root>/.quarantine/``. A file whose last line disagrees with its directory (a
power cut kept the line but not the rename, or the reverse) is moved to where the line says:
a verdict line moves it to ``done/``; a ``done/`` file without one goes back to
``processing/``. Should one id have two files (only an older version of the store could
leave that), the highest ``rev`` wins.

Then a row that disagrees with its file is rewritten from it; a file without a row is
indexed; a row without a file is dropped. A file in processing/ becomes a processing row whose
lease has already lapsed, so the next sweep re-queues it; but beside a pending row of the same
``rev`` it is a claim that never committed (never answered), and goes back to pending/. Every
thread of the queue is rebuilt from its members, and its counts are recounted. Files and rows
touched within ``grace`` seconds are left alone, so repair can run beside a live server
without racing a post or a claim in flight.

A queue row without a directory is left untouched (an empty or wrong state root must never
empty the index), unless its directory is in ``<root>/.trash/`` while the queue is live: a
delete that crashed before it committed, which is undone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Count

from ..models import QUEUE_DEFAULTS, Item, Queue, QueueCount, Thread
from ..status import LIVE_STATUSES, State, Status
from ..store import FoundFile, Record, StoreError, read_queue_settings
from ..timeutil import now as utcnow
from ..timeutil import parse_wire
from . import reclaim
from .common import store
from .pacing import Pacer
from .rows import thread_line
from .schedules import restore_definitions

log = logging.getLogger(__name__)
STATE_RANK = {State.PROCESSING: 0, State.PENDING: 1, State.DONE: 2}


@dataclass
class RepairReport:
    queues_restored: int = 0
    schedules_restored: int = 0
    rows_added: int = 0
    rows_corrected: int = 0
    rows_removed: int = 0
    stale_files_removed: int = 0
    unreadable_files: list[str] = field(default_factory=list)
    threads_rebuilt: int = 0
    files_moved: int = 0
    torn_lines_cut: int = 0

    def __str__(self) -> str:
        text = (
            f"repair: {self.queues_restored} queue(s) restored, {self.rows_added} row(s) "
            f"added, {self.rows_corrected} corrected, {self.rows_removed} removed, "
            f"{self.stale_files_removed} stale file(s) removed, {self.threads_rebuilt} "
            f"thread(s) rebuilt"
        )
        if self.files_moved or self.torn_lines_cut:
            text += (
                f", {self.files_moved} file(s) moved to the state their last line names, "
                f"{self.torn_lines_cut} torn line(s) cut"
            )
        if self.unreadable_files:
            text += f", {len(self.unreadable_files)} unreadable file(s) quarantined"
        if self.schedules_restored:
            text += f", {self.schedules_restored} schedule(s) restored from schedules.json"
        return text


def repair(*, grace_seconds: float) -> RepairReport:
    report = RepairReport()
    st = store()
    # Deletes whose files were still to be unlinked: finish the old ones, and never index a
    # file a younger one names (its row is gone, or going, with the delete).
    report.stale_files_removed += reclaim.leftovers(grace_seconds)
    doomed = st.listed_for_removal()
    for queue in Queue.objects.filter(deleting=False):
        trash = st.trash_dir / f"{queue.name}.{queue.id}"
        if not st.queue_dir(queue.name).exists() and trash.is_dir():
            trash.rename(st.queue_dir(queue.name))  # a delete that never committed
            log.info("repair: queue %s restored from a delete that did not commit", queue.name)
    for name in st.queues():
        found = Queue.objects.filter(name=name, deleting=False).first()
        if found is None:
            found = _restore_queue(name)
            report.queues_restored += 1
        _repair_queue(found, grace_seconds, report, doomed)
        report.schedules_restored += restore_definitions(found)
    return report


def _restore_queue(name: str) -> Queue:
    saved = read_queue_settings(store(), name) or {}
    values = {k: saved[k] for k in QUEUE_DEFAULTS if k in saved}
    return Queue.objects.create(name=name, **values)


def _expected_status(state: State, record: Record) -> Status:
    if state is State.DONE:
        status = Status(record.get("status", Status.FAILED))
        return status if status.is_terminal else Status.FAILED
    return Status(state.value)


def _repair_queue(
    queue: Queue, grace: float, report: RepairReport, doomed: set[tuple[str, str]]
) -> None:
    st = store()
    cutoff = time.time() - grace
    for tmp in st.stale_temporaries(queue.name):
        with contextlib.suppress(OSError):
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                report.stale_files_removed += 1
    by_id: dict[str, list[FoundFile]] = defaultdict(list)
    for found_file in st.scan(queue.name):
        by_id[found_file.item_id].append(found_file)
    # Beside a live server this is background work: a paced chunk of files at a time.
    pending = list(by_id.items())
    done = 0
    unreadable: set[str] = set()  # every file of the item quarantined: as good as no file

    def chunk(size: int) -> int:
        nonlocal done
        part = pending[done : done + size]
        done += len(part)
        for item_id, files in part:
            if (queue.name, item_id) in doomed:
                continue
            try:
                # a claim renames without rewriting: a rename changes ctime, not mtime
                if max(max(s.st_mtime, s.st_ctime) for s in (f.path.stat() for f in files)) >= (
                    cutoff
                ):
                    continue
            except OSError:
                continue  # moved while we looked: in flight
            if not _repair_item(queue, item_id, files, report):
                unreadable.add(item_id)
        return len(part)

    if grace > 0:
        Pacer(start=200).run(chunk)
    else:
        chunk(len(pending))  # at start-up, before any server: as fast as it goes
    _drop_rows_without_files(queue, set(by_id) - unreadable, grace, report)
    report.threads_rebuilt += rebuild_threads(queue)
    recount(queue)


def _repair_item(queue: Queue, item_id: str, found: list[FoundFile], report: RepairReport) -> bool:
    """Make the item's row agree with its file; False if no file of it could be read (each
    was quarantined)."""
    st = store()
    readable: list[tuple[State, Record, FoundFile]] = []
    for f in found:
        try:
            if st.truncate_torn(f.path):
                report.torn_lines_cut += 1
            readable.append((f.state, st.read(queue.name, f.state, item_id), f))
        except (StoreError, OSError) as exc:
            report.unreadable_files.append(f"{f.path}: {exc}")
            with contextlib.suppress(OSError):
                st.quarantine(f.path)
    if not readable:
        return False
    readable.sort(key=lambda t: (int(t[1].get("rev", 0)), STATE_RANK[t[0]]))
    state, record, _winner = readable[-1]
    for _s, _r, loser in readable[:-1]:
        with contextlib.suppress(OSError):
            os.unlink(loser.path)
            report.stale_files_removed += 1
    recorded = Status(record.get("status") or Status.PENDING)
    if recorded.is_terminal and state is not State.DONE:
        state = _move(queue, item_id, state, State.DONE, report)  # the rename was lost
    elif not recorded.is_terminal and state is State.DONE:
        state = _move(queue, item_id, state, State.PROCESSING, report)  # the verdict was lost
    status = _expected_status(state, record)
    row = Item.objects.filter(id=item_id).first()
    if row is not None and row.status == status and row.rev == int(record.get("rev", 0)):
        return True
    if (
        row is not None
        and row.status == Status.PENDING
        and state is State.PROCESSING
        and row.rev == int(record.get("rev", 0))
    ):
        # A claim renamed the file but never committed, so never answered: no worker holds
        # the item. Undo the rename rather than count (and maybe die of) an unseen claim.
        with contextlib.suppress(OSError):
            _move(queue, item_id, State.PROCESSING, State.PENDING, report)
            report.rows_corrected += 1
            log.info("repair: %s/%s claim never committed, back in pending", queue.name, item_id)
        return True
    fields = _fields_from_record(queue, state, status, record)
    if row is not None and row.status == Status.PROCESSING and status == Status.PROCESSING:
        fields["attempts"] = row.attempts
    try:
        with transaction.atomic():
            Item.objects.update_or_create(id=item_id, defaults=fields)
    except IntegrityError:
        fields["key"] = None  # two files claim one key (a post repeated across a crash)
        with transaction.atomic():
            Item.objects.update_or_create(id=item_id, defaults=fields)
    if row is None:
        report.rows_added += 1
    else:
        report.rows_corrected += 1
    log.info("repair: %s/%s indexed as %s", queue.name, item_id, status)
    return True


def _move(queue: Queue, item_id: str, src: State, dst: State, report: RepairReport) -> State:
    st = store()
    os.rename(st.item_path(queue.name, src, item_id), st.item_path(queue.name, dst, item_id))
    report.files_moved += 1
    log.info(
        "repair: %s/%s moved from %s to %s, as its last line says", queue.name, item_id, src, dst
    )
    return dst


def _priority(value: Any) -> int:
    """A file's priority (0-9); a file written before priorities has none: 0."""
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 9 else 0
    )


def _time(value: Any) -> Any:
    return parse_wire(value) if value else None


def _fields_from_record(
    queue: Queue, state: State, status: Status, record: Record
) -> dict[str, Any]:
    at = utcnow()
    attempts = int(record.get("attempts") or 0)
    if state is State.PROCESSING:
        attempts += 1  # a claim renames without rewriting: the file counts one claim less
    return {
        "queue": queue,
        "status": status,
        "eligible": False,
        "priority": _priority(record.get("priority")),
        "thread_id": record.get("threadId"),
        "key": record.get("key"),
        "seq": record.get("seq") or record["id"],
        "scheduled_at": _time(record.get("scheduledAt")) or at,
        "posted_at": _time(record.get("postedAt")) or at,
        "attempts": attempts,
        "lease": None,
        "lease_expires_at": at - timedelta(seconds=1) if state is State.PROCESSING else None,
        "claimed_at": None,
        "finished_at": _time(record.get("finishedAt")),
        "fetched_at": _time(record.get("fetchedAt")),
        "error": record.get("error"),
        "origin": record.get("origin"),
        "dead_letter": record.get("deadLetter"),
        "cancel_reason": _reason(record.get("cancelReason")),
        "rev": int(record.get("rev", 1)),
        "updated_at": at,
    }


def _reason(value: Any) -> str | None:
    """A cancel's reason as the row holds it (a string of at most 500 characters)."""
    return value[:500] if isinstance(value, str) else None


def _drop_rows_without_files(
    queue: Queue, on_disk: set[str], grace: float, report: RepairReport
) -> None:
    cutoff = utcnow() - timedelta(seconds=grace)
    missing = [
        item_id
        for item_id in Item.objects.filter(queue=queue, updated_at__lt=cutoff)
        .values_list("id", flat=True)
        .iterator(chunk_size=2000)
        if item_id not in on_disk
    ]
    for start in range(0, len(missing), 500):
        chunk = missing[start : start + 500]
        report.rows_removed += Item.objects.filter(id__in=chunk).delete()[0]


def rebuild_threads(queue: Queue) -> int:
    """Recompute eligibility and every thread row of the queue from the item rows."""
    with transaction.atomic():
        Item.objects.filter(
            queue=queue, thread_id__isnull=True, status=Status.PENDING, eligible=False
        ).update(eligible=True)
        Item.objects.filter(queue=queue, eligible=True).exclude(status=Status.PENDING).update(
            eligible=False
        )
        Item.objects.filter(queue=queue, thread_id__isnull=False, eligible=True).update(
            eligible=False
        )
        Thread.objects.filter(queue=queue).delete()
        members = (
            Item.objects.filter(queue=queue, thread_id__isnull=False, status__in=LIVE_STATUSES)
            .values("thread_id")
            .annotate(n=Count("id"))
        )
        rebuilt = 0
        for entry in members:
            thread_id = str(entry["thread_id"])
            limit = max(1, queue.thread_limit)
            line = thread_line(queue.id, thread_id, limit)
            heads = line.pending[: max(0, limit - len(line.processing))]
            if heads:
                Item.objects.filter(id__in=heads).update(eligible=True)
            Thread.objects.create(
                queue=queue,
                thread_id=thread_id,
                member_count=entry["n"],
                processing=len(line.processing),
                processing_item=line.processing[0] if line.processing else None,
                heads=heads,
            )
            rebuilt += 1
        return rebuilt


def recount(queue: Queue) -> None:
    """Set the queue's counts from its rows (all on shard 0)."""
    with transaction.atomic():
        QueueCount.objects.filter(queue=queue).delete()
        QueueCount.objects.bulk_create(
            QueueCount(queue=queue, status=entry["status"], shard=0, n=entry["n"])
            for entry in Item.objects.filter(queue=queue).values("status").annotate(n=Count("id"))
        )
