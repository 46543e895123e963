"""Bring the index back in line with the state directories (``manage.py sweep --repair``).

The files are the truth. For each id the file with the highest ``rev`` wins (a crash between
writing a new file and removing the old one leaves both) and the others are removed; a row
that disagrees with its file is rewritten from it; a file without a row is indexed; a row
without a file is dropped. A file in processing/ becomes a processing row whose lease has
already lapsed, so the next sweep re-queues it; but beside a pending row of the same ``rev``
it is a claim that never committed (never answered), and goes back to pending/. Then every
thread of the queue is rebuilt from its members. Files and rows touched (written, or renamed)
within ``grace`` seconds are left alone, so repair can run beside a live server without racing
a post or a claim in flight.

A queue row without a directory is left untouched: an empty or wrong state root must never
empty the index.
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

from ..models import QUEUE_DEFAULTS, Item, Queue, Thread
from ..status import LIVE_STATUSES, State, Status
from ..store import FoundFile, Record, StoreError, read_queue_settings
from ..timeutil import now as utcnow
from ..timeutil import parse_wire
from .common import first_pending_member, store

log = logging.getLogger(__name__)
STATE_RANK = {State.PROCESSING: 0, State.PENDING: 1, State.DONE: 2}


@dataclass
class RepairReport:
    queues_restored: int = 0
    rows_added: int = 0
    rows_corrected: int = 0
    rows_removed: int = 0
    stale_files_removed: int = 0
    unreadable_files: list[str] = field(default_factory=list)
    threads_rebuilt: int = 0

    def __str__(self) -> str:
        text = (
            f"repair: {self.queues_restored} queue(s) restored, {self.rows_added} row(s) "
            f"added, {self.rows_corrected} corrected, {self.rows_removed} removed, "
            f"{self.stale_files_removed} stale file(s) removed, {self.threads_rebuilt} "
            f"thread(s) rebuilt"
        )
        if self.unreadable_files:
            text += f", {len(self.unreadable_files)} unreadable file(s) left in place"
        return text


def repair(*, grace_seconds: float) -> RepairReport:
    report = RepairReport()
    st = store()
    for name in st.queues():
        queue = Queue.objects.filter(name=name).first()
        if queue is None:
            queue = _restore_queue(name)
            report.queues_restored += 1
        if queue.deleting:
            continue
        _repair_queue(queue, grace_seconds, report)
    return report


def _restore_queue(name: str) -> Queue:
    saved = read_queue_settings(store(), name) or {}
    values = {k: saved[k] for k in QUEUE_DEFAULTS if k in saved}
    queue, _ = Queue.objects.get_or_create(name=name, defaults=values)
    return queue


def _expected_status(state: State, record: Record) -> Status:
    if state is State.DONE:
        status = Status(record.get("status", Status.FAILED))
        return status if status.is_terminal else Status.FAILED
    return Status(state.value)


def _repair_queue(queue: Queue, grace: float, report: RepairReport) -> None:
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
    for item_id, files in by_id.items():
        try:
            # a claim renames without rewriting: a rename changes ctime, not mtime
            if max(max(s.st_mtime, s.st_ctime) for s in (f.path.stat() for f in files)) >= cutoff:
                continue
        except OSError:
            continue  # moved while we looked: in flight
        _repair_item(queue, item_id, files, report)
    _drop_rows_without_files(queue, set(by_id), grace, report)
    report.threads_rebuilt += rebuild_threads(queue)


def _repair_item(queue: Queue, item_id: str, found: list[FoundFile], report: RepairReport) -> None:
    st = store()
    readable: list[tuple[State, Record, FoundFile]] = []
    for f in found:
        try:
            readable.append((f.state, st.read(queue.name, f.state, item_id), f))
        except StoreError:
            report.unreadable_files.append(str(f.path))
    if not readable:
        return
    readable.sort(key=lambda t: (int(t[1].get("rev", 0)), STATE_RANK[t[0]]))
    state, record, _winner = readable[-1]
    for _s, _r, loser in readable[:-1]:
        with contextlib.suppress(OSError):
            os.unlink(loser.path)
            report.stale_files_removed += 1
    status = _expected_status(state, record)
    row = Item.objects.filter(id=item_id).first()
    if row is not None and row.status == status and row.rev == int(record.get("rev", 0)):
        return
    if (
        row is not None
        and row.status == Status.PENDING
        and state is State.PROCESSING
        and row.rev == int(record.get("rev", 0))
    ):
        # A claim renamed the file but never committed, so never answered: no worker holds
        # the item. Undo the rename rather than count (and maybe die of) an unseen claim.
        with contextlib.suppress(StoreError):
            st.move(queue.name, item_id, State.PROCESSING, State.PENDING, durable=True)
            report.rows_corrected += 1
            log.info("repair: %s/%s claim never committed, back in pending", queue.name, item_id)
        return
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
        "rev": int(record.get("rev", 1)),
        "updated_at": at,
    }


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
            processing = (
                Item.objects.filter(queue=queue, thread_id=thread_id, status=Status.PROCESSING)
                .order_by("id")
                .values_list("id", flat=True)
                .first()
            )
            head = None if processing else first_pending_member(queue.id, thread_id)
            if head is not None:
                Item.objects.filter(id=head).update(eligible=True)
            Thread.objects.create(
                queue=queue,
                thread_id=thread_id,
                member_count=entry["n"],
                processing_item=processing,
                head_item=head,
            )
            rebuilt += 1
        return rebuilt
