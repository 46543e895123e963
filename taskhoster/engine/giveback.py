"""Operations on one item, under its lease, made again until the database answers.

Two kinds of work must not wait for an item's lease to end because the database was away
when they were made:

- a claim whose ``COMMIT`` met the connection's loss, with the database then away to be
  asked (``OutcomeUnknown``), may have committed: its items would then be ``processing``
  under leases no caller heard of, held by no worker. Its group hands their ``(item,
  lease)`` pairs to ``later`` as ``Release`` operations (no attempt counted);
- a ``/work`` socket that closed re-queues what it held (``Requeue``); those that met the
  database away are handed to ``later`` by the dispatcher.

One thread of the process makes them again (1 s, doubling up to 5 s) until the database
answers each. Every one names its lease, so an item that changed meanwhile (or that the
claim did not take: its commit lost) is left as it is. Nothing here needs to outlive the
process: if it dies first, the leases end as they would have.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from django.db import InterfaceError, OperationalError

from ..errors import OutcomeUnknown
from ..osthread import name_os_thread
from . import admission
from .ops import Op, Release, Requeue, Verdict

log = logging.getLogger(__name__)

# An operation that met the database away is made again after this long, doubling up to
# RETRY_MOST_SECONDS, until the database answers.
RETRY_SECONDS = 1.0
RETRY_MOST_SECONDS = 5.0
# What an operation meets while the database is away: its errors, and a commit whose outcome
# it could not be asked for. It changed nothing, or may have: made again (with its lease), it
# is taken once.
DATABASE_AWAY = (OperationalError, InterfaceError, OutcomeUnknown)

Again = Release | Requeue

_waiting: dict[str, Again] = {}  # by item id: what to make again
_changed = threading.Condition()
_thread: threading.Thread | None = None


def claimed(taken: Iterable[tuple[str, str]]) -> None:
    """Give back these ``(item id, lease)`` pairs, which a claim of unknown outcome took."""
    taken = list(taken)
    if not taken:
        return
    log.warning(
        "a claim's outcome is unknown: %d item(s) it may have taken are given back once the "
        "database answers (%s)",
        len(taken),
        ", ".join(item_id for item_id, _lease in taken[:20]) + (" ..." if len(taken) > 20 else ""),
    )
    later(Release(item_id=item_id, lease=lease) for item_id, lease in taken)


def later(ops: Iterable[Again]) -> None:
    """Make these operations (each on one item, under its lease) in this process's thread
    for them, again until the database answers each."""
    global _thread
    with _changed:
        _waiting.update((op.item_id, op) for op in ops)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="taskhoster-giveback", daemon=True)
            _thread.start()
        _changed.notify()


def _run() -> None:
    name_os_thread()
    delay = RETRY_SECONDS
    while True:
        with _changed:
            while not _waiting:
                _changed.wait()
                delay = RETRY_SECONDS
        # Not at once: the database was away a moment ago.
        with _changed:
            _changed.wait(delay)
            batch = dict(_waiting)
        away = _make(batch)
        with _changed:
            for item_id, op in batch.items():
                if item_id not in away and _waiting.get(item_id) is op:
                    del _waiting[item_id]
        delay = min(2 * delay, RETRY_MOST_SECONDS) if away else RETRY_SECONDS


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
        except DATABASE_AWAY:
            away.add(item_id)
        except Exception as exc:
            log.error("could not %s %s (made again after an outage): %s", what, item_id, exc)
        else:
            if verdict.accepted:
                log.warning("item %s: %s made, after an outage", item_id, what)
    return away
