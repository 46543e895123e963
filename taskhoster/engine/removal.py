"""Deleting many items at once: by status, and a whole queue.

Single deletes (rule 9) and retention (rule 11) are group operations (``group.Group.delete``,
``Group.sweep``). Here:

- ``delete_by_status`` walks the queue's items of one status by keyset and deletes them a
  chunk at a time, each chunk one group operation (set-based: one read, one unlink each,
  one ``DELETE``), so a million items go without one giant transaction.
- ``delete_queue`` makes a queue disappear for clients at once: in one transaction its row
  is marked ``deleting`` (its name is free again: names are unique among live queues only)
  and its directory is renamed into ``<root>/.trash/`` (one rename). Its rows and files are
  reclaimed behind it by ``reclaim_deleted_queues`` (started by the delete, and by every
  sweep until done), in chunks.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from django.db import connection, transaction

from .. import events
from ..conf import get_conf
from ..errors import QueueNotFound
from ..models import Item, Queue, QueueCount, Schedule, Thread
from ..status import Status
from ..store import StoreError, write_queue_settings
from . import reclaim
from . import rows as sql
from .committer import execute
from .common import store
from .ops import Reclaim
from .pacing import Pacer
from .queues import queue_settings
from .transitions import delete_items, get_live_queue

log = logging.getLogger(__name__)

DELETED = "deleted"
QUEUE_DELETED = "queue-deleted"
RECLAIM_CHUNK = 5000


def delete_by_status(*, queue_name: str, status: Status) -> int:
    """Delete every item of the queue in ``status``, a paced chunk at a time (each chunk one
    group operation: ``pacing``), so a million items go without one giant transaction and
    without holding other queues' work behind them."""
    queue = get_live_queue(queue_name)
    deleted = 0
    after = ""

    def chunk(size: int) -> int:
        nonlocal deleted, after
        ids = list(
            Item.objects.filter(queue=queue, status=status, id__gt=after)
            .order_by("id")
            .values_list("id", flat=True)[:size]
        )
        if ids:
            deleted += delete_items(item_ids=ids, queue_name=queue_name)
            after = ids[-1]
        return len(ids)

    Pacer(start=200, most=max(get_conf().sweep_chunk, 2000)).run(chunk)
    return deleted


def _trash_token(queue: Queue) -> str:
    return str(queue.id)


def delete_queue(*, queue_name: str) -> None:
    """Delete a queue: gone for every client at once, its items reclaimed behind it."""
    st = store()
    trash = None
    try:
        with transaction.atomic():
            queue = (
                Queue.objects.select_for_update().filter(name=queue_name, deleting=False).first()
            )
            if queue is None:
                raise QueueNotFound(f"queue {queue_name!r} does not exist")
            # Wait for groups writing into this queue's directory (they hold it shared).
            sql.lock_queue_exclusive(queue.id)
            Queue.objects.filter(id=queue.id).update(deleting=True)
            Schedule.objects.filter(queue_id=queue.id).delete()  # they stop with it
            # Queues that sent their dead letters here stop doing so, visibly.
            for other in Queue.objects.filter(dead_letter_queue=queue_name, deleting=False):
                other.dead_letter_queue = None
                other.save(update_fields=["dead_letter_queue"])
                write_queue_settings(st, other.name, queue_settings(other, wire=False))
            # Out of the namespace before the name is free: a new queue of the same name
            # must never find this one's files.
            trash = st.move_queue_to_trash(queue.name, _trash_token(queue))
    except BaseException:
        if trash is not None:
            trash.rename(st.queue_dir(queue_name))
        raise
    events.announce(QUEUE_DELETED, queue_name, str(queue.id))
    transaction.on_commit(_reclaim_in_background)  # at once, unless inside a transaction


RECLAIM_THREAD = "taskhoster-reclaim"


def _reclaim_in_background() -> None:
    def run() -> None:
        try:
            reclaim_deleted_queues(wait=False)
        except Exception:
            log.exception("reclaiming deleted queues failed; the sweep will try again")
        finally:
            connection.close()

    threading.Thread(target=run, name=RECLAIM_THREAD, daemon=True).start()


_reclaiming = threading.Lock()


def reclaim_deleted_queues(*, wait: bool = True) -> int:
    """Remove the rows and files of every deleted queue; returns the items reclaimed.

    Background work, paced (``pacing``): a chunk of rows at a time, its files unlinked and
    then its rows deleted by an operation of the committer (so the rows go in a group, not
    in a write transaction of their own that the committer would wait for). Safe beside
    another reclaimer (a sweep in another process): each step is idempotent. Within this
    process one runs at a time; without ``wait``, a call finding one under way leaves the
    work to it.
    """
    if not _reclaiming.acquire(blocking=wait):
        return 0
    try:
        reclaimed = 0
        st = store()
        reclaim.leftovers(get_conf().repair_grace_seconds)
        for queue in Queue.objects.filter(deleting=True):
            trash = st.trash_dir / f"{queue.name}.{_trash_token(queue)}"
            if (
                not trash.exists()
                and st.queue_dir(queue.name).exists()
                and not Queue.objects.filter(name=queue.name, deleting=False).exists()
            ):
                # A queue deleted before directories were moved aside: take it away now.
                trash = st.move_queue_to_trash(queue.name, _trash_token(queue)) or trash
            reclaimed += _reclaim_items(queue, trash)
            if trash.exists():
                _remove_trash(trash)  # files no row named (a crash's leftovers)
            with transaction.atomic():
                Thread.objects.filter(queue=queue).delete()
                QueueCount.objects.filter(queue=queue).delete()
                if not Item.objects.filter(queue=queue).exists():
                    Queue.objects.filter(id=queue.id, deleting=True).delete()
        live = {q.id for q in Queue.objects.only("id")}
        for entry in st.trash_entries():
            token = entry.name.rsplit(".", 1)[-1]
            if token.isdigit() and int(token) not in live:
                try:
                    _remove_trash(entry)
                except StoreError as exc:
                    log.warning("could not remove %s: %s", entry, exc)
        return reclaimed
    finally:
        _reclaiming.release()


def _reclaim_items(queue: Queue, trash: Path) -> int:
    """Delete a deleted queue's items, a paced chunk at a time: the files (in its trash
    directory, found by each row's status), then the rows and their counts."""
    st = store()
    table = Item._meta.db_table

    def chunk(size: int) -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT id, status FROM {table} WHERE queue_id = %s LIMIT %s", [queue.id, size]
            )
            found = cursor.fetchall()
        if not found:
            return 0
        for item_id, status in found:
            st.unlink_trashed(trash, Status(status).state, item_id)
        execute(Reclaim(queue_id=queue.id, ids=tuple(item_id for item_id, _ in found)))
        return len(found)

    return Pacer(start=200, most=RECLAIM_CHUNK).run(chunk)


def _remove_trash(path: Path) -> int:
    """Remove a trashed directory's files, a paced chunk at a time, then the directory."""
    st = store()
    return Pacer(start=200, most=RECLAIM_CHUNK).run(lambda size: st.remove_trash(path, limit=size))
