"""Work left by the database's absence, done once it answers.

Two kinds of work must not wait for an item's lease to end, nor for an operator's
``sweep --repair``, because the database was away when they were made:

- a group whose ``COMMIT`` met the connection's loss, with the database then away to be
  asked (``OutcomeUnknown``), may or may not have committed. Its files were left as it
  wrote them, and whoever it answered heard ``store_error``. Handed to ``unsettled``, its
  transaction's outcome is asked again until the database answers:

  - committed: its files agree with its rows, but its claims' items are ``processing``
    under leases no caller heard of, held by no worker. They are given back: ``Release``
    operations, made by ``later`` (no attempt counted). Its files are flushed, and its news
    sent, as its commit would have (a worker waiting for its posts gets them now, not at
    the next backstop);
  - rolled back: its files are put back as the database's locks allow
    (``Group.put_back_files``: only those of items no group changed since). Before, they
    stayed ahead of their rows: a post's file with no row, which ``sweep --repair`` made
    an item of (a second one, when its producer had sent it again with its key);
  - still running (a lost session the server has not noticed): that session is ended, and
    asked again;
  - not to be known (a server that crashed and gave the id again): its claims' items are
    given back (each under its lease: a claim that did not commit took nothing) and its
    files left for ``sweep --repair``, as before;

- a ``/work`` socket that closed re-queues what it held (``Requeue``); those that met the
  database away are handed to ``later`` by the dispatcher.

One thread of the process does them (1 s, doubling up to 5 s) until the database answers
each. Every operation names its lease, so an item that changed meanwhile is left as it is.
Nothing here needs to outlive the process: if it dies first, the leases end as they would
have, and a group still unsettled leaves its files for ``sweep --repair``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from django.db import Error as DbError
from django.db import InterfaceError, OperationalError, connection

from ..errors import OutcomeUnknown, StoreError, StoreWriteFailed
from ..osthread import name_os_thread
from . import admission
from . import rows as sql
from .ops import Op, Release, Requeue, Verdict

log = logging.getLogger(__name__)

# An operation that met the database away is made again after this long, doubling up to
# RETRY_MOST_SECONDS, until the database answers.
RETRY_SECONDS = 1.0
RETRY_MOST_SECONDS = 5.0
# What an operation meets while the database is away (its errors, and a commit whose outcome
# it could not be asked for) or while the state root takes no write (full, read-only). It
# changed nothing, or may have: made again (with its lease), it is taken once.
RETRYABLE = (OperationalError, InterfaceError, OutcomeUnknown, StoreWriteFailed)
# A session ended (``sql.end_session_of``) is asked after again every ENDED_ASK_EVERY
# seconds, ENDED_ASKS times, before the next round.
ENDED_ASK_EVERY = 0.1
ENDED_ASKS = 20

Again = Release | Requeue


@dataclass(eq=False)
class Unsettled:
    """A group whose ``COMMIT``'s outcome could not be learned (see the module docstring)."""

    asked: sql.TransactionId  # its transaction
    taken: list[tuple[str, str]]  # what its claims took: (item id, lease)
    items: list[str]  # every item whose file it changed (for the log)
    # Puts its files back under the rows' locks taken again (raises ``DbError`` should the
    # database not answer; then it is asked again later).
    put_back: Callable[[], None]
    flush: Callable[[], None]  # makes its files durable (it committed: they are its rows')
    unflushed: Callable[[], None]  # its flush failed: its items' files to be written again
    # Its news, as its commit would have sent it (posts claimable, verdicts for long-polls).
    announce: Callable[[], None]


_waiting: dict[str, Again] = {}  # by item id: what to make again
_unsettled: list[Unsettled] = []
_changed = threading.Condition()
_thread: threading.Thread | None = None


def unsettled(group: Unsettled) -> None:
    """Settle this group once the database answers (see the module docstring)."""
    with _changed:
        _unsettled.append(group)
        _start()


def later(ops: Iterable[Again]) -> None:
    """Make these operations (each on one item, under its lease) in this process's thread
    for them, again until the database answers each."""
    with _changed:
        _waiting.update((op.item_id, op) for op in ops)
        _start()


def _start() -> None:
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_run, name="taskhoster-giveback", daemon=True)
        _thread.start()
    _changed.notify()


def _run() -> None:
    name_os_thread()
    delay = RETRY_SECONDS
    while True:
        with _changed:
            while not _waiting and not _unsettled:
                _changed.wait()
                delay = RETRY_SECONDS
        # Not at once: the database was away a moment ago.
        with _changed:
            _changed.wait(delay)
            groups = list(_unsettled)
        still = _settle(groups)
        with _changed:
            _unsettled[:] = [g for g in _unsettled if g not in groups or g in still]
            batch = dict(_waiting)
        away = _make(batch) if batch else set()
        with _changed:
            for item_id, op in batch.items():
                if item_id not in away and _waiting.get(item_id) is op:
                    del _waiting[item_id]
        delay = min(2 * delay, RETRY_MOST_SECONDS) if away or still else RETRY_SECONDS


def _settle(groups: list[Unsettled]) -> list[Unsettled]:
    """Settle each group whose outcome the database now tells; those it did not."""
    still: list[Unsettled] = []
    try:
        for group in groups:
            for fresh in (False, True):  # (the first try may meet a connection the outage broke)
                try:
                    if not _settled(group):
                        still.append(group)
                    break
                except DbError as exc:
                    with suppress(Exception):  # (a broken connection may fail to close, too)
                        connection.close()
                    if fresh:
                        log.info("transaction %d: not settled yet (%s)", group.asked.xid, exc)
                        still.append(group)
                except Exception:
                    # Not the database's absence: asked again, it would fail again (and keep
                    # the thread from the rest). Its files wait for ``sweep --repair``.
                    log.exception(
                        "could not settle transaction %d: run `manage.py sweep --repair` "
                        "(items: %s)",
                        group.asked.xid,
                        ", ".join(group.items[:20]),
                    )
                    break
    finally:
        with suppress(Exception):  # this thread's connection is not kept between rounds
            connection.close()
    return still


def _settled(group: Unsettled) -> bool:
    xid = group.asked.xid
    status = sql.transaction_outcome(group.asked)
    if status == "in progress":
        # The lost session, which the server has not noticed yet: ended, it can no longer
        # commit; its end is seen within moments.
        log.warning("transaction %d is still running in a lost session: ending it", xid)
        sql.end_session_of(xid)
        for _ in range(ENDED_ASKS):
            time.sleep(ENDED_ASK_EVERY)
            status = sql.transaction_outcome(group.asked)
            if status != "in progress":
                break
        else:
            return False
    if status == "aborted":
        group.put_back()
        log.warning("transaction %d rolled back: its files were put back", xid)
        return True
    if status == "committed":
        log.warning("transaction %d committed (its answers were lost)", xid)
        try:
            group.flush()  # never flushed: its group stopped at the unknown outcome
        except (OSError, StoreError) as exc:
            log.error("transaction %d committed; its files could not be flushed: %s", xid, exc)
            group.unflushed()  # written again before anything else is changed (``runner``)
        group.announce()  # (logs its own errors): a worker waiting on its queue, say
    else:
        items = group.items
        log.error(
            "whether transaction %d committed cannot be known; its group's files are left as "
            "it wrote them: run `manage.py sweep --repair` to bring the index in line with "
            "them (items: %s)",
            xid,
            ", ".join(items[:20]) + (" ..." if len(items) > 20 else ""),
        )
    if group.taken:
        log.warning(
            "%d item(s) a claim of transaction %d may have taken are given back (%s)",
            len(group.taken),
            xid,
            ", ".join(i for i, _lease in group.taken[:20])
            + (" ..." if len(group.taken) > 20 else ""),
        )
        later(Release(item_id=item_id, lease=lease) for item_id, lease in group.taken)
    return True


def _make(batch: dict[str, Again]) -> set[str]:
    """Make each operation (a fresh copy: an operation is answered once), all in one group
    if they can be; the ids of those that met the database away."""
    committer = admission.current()
    if committer is None:
        return set(batch)
    futures: dict[str, Future[Verdict]] = {}
    ops: list[Op[Any]] = []
    for item_id, op in batch.items():
        again = dataclasses.replace(op)
        again.future = futures[item_id] = Future()
        again.background = True
        ops.append(again)
    committer.submit_many(ops)
    away: set[str] = set()
    for item_id, future in futures.items():
        what = type(batch[item_id]).__name__.lower()
        try:
            verdict = future.result()
        except RETRYABLE:
            away.add(item_id)
        except Exception as exc:
            log.error("could not %s %s (made again after an outage): %s", what, item_id, exc)
        else:
            if verdict.accepted:
                log.warning("item %s: %s made, after an outage", item_id, what)
    return away
