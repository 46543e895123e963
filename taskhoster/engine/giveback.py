"""Giving back what a claim may have taken when whether it committed could not be learned.

A claim whose ``COMMIT`` met the connection's loss, with the database then away to be asked
(``OutcomeUnknown``), may have committed: its items would then be ``processing`` under leases
no caller heard of, held by no worker, until those leases end. So its group hands its
``(item, lease)`` pairs to ``later``, and one thread of this process gives each back
(``Release``: no attempt counted) once the database answers: a release names its lease, so
an item the claim did not take (its commit lost), or that changed since, is left as it is.
Nothing here needs to outlive the process: if it dies first, the leases end as they would
have.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from django.db import InterfaceError, OperationalError

from ..errors import OutcomeUnknown
from ..osthread import name_os_thread
from . import admission
from .ops import Op, Release, Verdict

log = logging.getLogger(__name__)

# A release that met the database away is made again after this long, doubling up to
# RETRY_MOST_SECONDS, until the database answers.
RETRY_SECONDS = 1.0
RETRY_MOST_SECONDS = 5.0
AWAY = (OperationalError, InterfaceError, OutcomeUnknown)

_waiting: dict[str, str] = {}  # item id: the lease the claim gave it
_changed = threading.Condition()
_thread: threading.Thread | None = None


def later(taken: Iterable[tuple[str, str]]) -> None:
    """Give these ``(item id, lease)`` pairs back, in this process's give-back thread."""
    global _thread
    taken = list(taken)
    if not taken:
        return
    log.warning(
        "a claim's outcome is unknown: %d item(s) it may have taken are given back once the "
        "database answers (%s)",
        len(taken),
        ", ".join(item_id for item_id, _lease in taken[:20]) + (" ..." if len(taken) > 20 else ""),
    )
    with _changed:
        _waiting.update(taken)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="taskhoster-giveback", daemon=True)
            _thread.start()
        _changed.notify()


def waiting() -> dict[str, str]:
    """What waits to be given back (tests, health)."""
    with _changed:
        return dict(_waiting)


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
        away = _give_back(batch)
        with _changed:
            for item_id in batch:
                if item_id not in away and _waiting.get(item_id) == batch[item_id]:
                    del _waiting[item_id]
        delay = min(2 * delay, RETRY_MOST_SECONDS) if away else RETRY_SECONDS


def _give_back(batch: dict[str, str]) -> set[str]:
    """Release each item under its lease, all in one group if they can be; the ids whose
    release met the database away."""
    committer = admission.current()
    if committer is None:
        return set(batch)
    releases: dict[str, Future[Verdict]] = {}
    ops: list[Op[Any]] = []
    for item_id, lease in batch.items():
        op = Release(item_id=item_id, lease=lease)
        op.future = releases[item_id] = Future()
        op.background = True
        ops.append(op)
    committer.submit_many(ops)
    away: set[str] = set()
    for item_id, future in releases.items():
        try:
            verdict = future.result()
        except AWAY:
            away.add(item_id)
        except Exception as exc:
            log.error("could not give back %s, which a claim may have taken: %s", item_id, exc)
        else:
            if verdict.accepted:
                log.warning("item %s, taken by a claim of unknown outcome, given back", item_id)
    return away
