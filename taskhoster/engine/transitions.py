"""Every transition of the lifecycle (SPEC section 3), as calls that run in a group commit.

Each function builds one operation (``ops``) and runs it (``committer.execute``); the rules
live in ``rules``, once, and ``group.Group`` makes what they decide. A caller on an event loop
(the ``/work`` sockets and their dispatcher) builds the same operation and awaits it
(``committer.execute_async``): it waits without blocking the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from .. import contract
from ..errors import Overloaded, QueueNotFound
from ..models import Queue
from ..timeutil import now as utcnow
from .admission import overloaded
from .committer import execute, submit_async
from .ops import (
    Cancel,
    Claim,
    Claimed,
    Delete,
    Extend,
    Fail,
    MarkFetched,
    NewItem,
    Posted,
    Progress,
    Release,
    Requeue,
    Restart,
    Result,
    Rewrite,
    Sweep,
    Verdict,
)
from .posts import prepare_post
from .rules import WORKER_DISCONNECTED, Clock, ItemRow, schedule_refusal


def get_live_queue(name: str) -> Queue:
    queue = Queue.objects.filter(name=name, deleting=False).first()
    if queue is None:
        raise QueueNotFound(f"queue {name!r} does not exist")
    return queue


# -- rule 1: post ---------------------------------------------------------------------------


def admit_post() -> None:
    """Refuse a new post at once (``Overloaded``: 503 with ``Retry-After``) while this
    process's committer is behind (``admission.overloaded``)."""
    retry_after = overloaded()
    if retry_after is not None:
        raise Overloaded(
            "the server is overloaded: posts wait for work already accepted; try again "
            f"in {retry_after:g} s",
            retry_after=retry_after,
        )


def check_schedule(scheduled_at: datetime, posted_at: datetime, queue_seconds: float) -> None:
    """Raise what the post's group would: an item scheduled past its queue's timeout
    (``rules.schedule_refusal``)."""
    refused = schedule_refusal(scheduled_at, posted_at, queue_seconds)
    if refused is not None:
        raise refused


def post_items(*, queue_name: str, items: list[NewItem]) -> list[Posted]:
    """Post items to a queue, all or none; an item whose key exists returns the existing one."""
    return execute(prepare_post(queue_name, items))


def post_items_soon(
    *, queue_name: str, items: list[NewItem], key_hash: str | None = None
) -> asyncio.Future[list[Posted]]:
    """``post_items`` for a caller on an event loop, which awaits the returned future.
    ``key_hash``: the caller's key, for the group to check (``ops.Post``)."""
    return submit_async(prepare_post(queue_name, items, key_hash))


# -- rule 2: claim, rule 5: extend ----------------------------------------------------------


def claim(*, queue_name: str, max_items: int = 1) -> list[Claimed]:
    """Move up to ``max_items`` claimable items of the queue to processing under new leases."""
    return execute(Claim(queue_name=queue_name, max_items=max_items))


def extend(
    *, item_id: str, lease: str | None, seconds: float | None = None
) -> tuple[bool, ItemRow]:
    """Push the lease out to now + ``seconds`` (at most ``leaseSeconds``) for its holder."""
    return execute(Extend(item_id=item_id, lease=lease, seconds=seconds))


# -- rules 3, 4, 6: result, fail, re-queue ---------------------------------------------------


def submit_result(*, item_id: str, result: Any, queues: frozenset[str] | None = None) -> Verdict:
    """Rule 3: the first result for a non-terminal item wins, lease or no lease. ``queues``:
    those the caller's key may use (an item of another queue is not found for it)."""
    return execute(Result(item_id=item_id, result=result, queues=queues))


def fail(*, item_id: str, lease: str | None, error: str | None, retry: bool = True) -> Verdict:
    """Rule 4: the lease holder reports a failure; retry with backoff, or die."""
    return execute(Fail(item_id=item_id, lease=lease, error=error, retry=retry))


def cancel(*, item_id: str, reason: str | None = None) -> ItemRow:
    """Section 8.2: a pending or processing item fails now, ``cancelled`` (``Conflict``
    for a terminal one); a socket holding it is told to stop, in whichever process. The
    reason is judged as the API judges it (``InvalidInput``)."""
    if reason is not None:
        reason = contract.validate(contract.CANCEL, {"reason": reason})["reason"]
    return execute(Cancel(item_id=item_id, reason=reason))


def report_progress(*, item_id: str, lease: str | None, progress: Any) -> tuple[bool, ItemRow]:
    """Section 8.2: the lease holder's latest progress (the lease is not extended)."""
    return execute(Progress(item_id=item_id, lease=lease, progress=progress))


def requeue_held(*, item_id: str, lease: str, cause: str = WORKER_DISCONNECTED) -> Verdict:
    """Rule 6, socket drop: re-queue an item still held under ``lease`` (or let it die)."""
    return execute(Requeue(item_id=item_id, lease=lease, cause=cause))


def release_unsent(*, item_id: str, lease: str) -> Verdict:
    """Undo a claim whose item never reached its worker (the push to a socket that had gone):
    back to ``pending`` as if never claimed, the claim's attempt taken back."""
    return execute(Release(item_id=item_id, lease=lease))


def requeue_if_lapsed(*, item_id: str, at: datetime) -> bool:
    """Rule 6, lease lapse (the sweep): re-queue, or die if attempts are used up."""
    return bool(execute(Sweep(clock=Clock.LAPSE, ids=(item_id,), at=at)))


def time_out_if_aged(*, item_id: str, at: datetime) -> bool:
    """Rule 8: a live item older than ``queueSeconds`` fails with ``timeout``."""
    return bool(execute(Sweep(clock=Clock.TIMEOUT, ids=(item_id,), at=at)))


def delete_if_retained(*, item_id: str, at: datetime) -> bool:
    """Rule 11: delete a done item whose retention has run out."""
    return bool(execute(Sweep(clock=Clock.RETAIN, ids=(item_id,), at=at)))


def apply_clock(*, clock: Clock, item_ids: Iterable[str], at: datetime) -> int:
    """The sweep: one clock on a chunk of items."""
    return execute(Sweep(clock=Clock(clock), ids=tuple(item_ids), at=at))


# -- rule 9: delete, rule 10: restart, rule 11: fetched --------------------------------------


def delete_item(*, item_id: str, queue_name: str | None = None) -> bool:
    """Rule 9: the item and its file are gone; a processing thread head is detached at once."""
    return delete_items(item_ids=[item_id], queue_name=queue_name, one=True) == 1


def delete_items(
    *, item_ids: Iterable[str], queue_name: str | None = None, one: bool = False
) -> int:
    """Rule 9 for each item (of ``queue_name`` only, when given): how many went. ``one``:
    the item asked for by name, refused while its file waits to be written again (of many,
    such an item is passed by: ``Delete.refuse_marked``)."""
    queue_id = get_live_queue(queue_name).id if queue_name is not None else None
    ids = tuple(dict.fromkeys(item_ids))
    return execute(Delete(ids=ids, queue_id=queue_id, refuse_marked=one))


def restart(*, item_id: str) -> ItemRow:
    """Rule 10: a failed item becomes a brand-new arrival in its queue (and thread)."""
    return execute(Restart(item_id=item_id))


def mark_fetched(*, item_id: str) -> datetime | None:
    """A producer read a terminal item: start its ``fetched`` retention clock (once).
    Returns when it was first fetched (None if the item is not terminal or gone)."""
    return execute(MarkFetched(item_id=item_id, at=utcnow()))


def write_again(*, item_id: str) -> int:
    """An item marked ``unflushed`` is asked for: write its file again now, in the committer
    (``Group.rewrite``; its mark is cleared once that is durable). Answers 1 if it wrote it,
    0 if it could not (the disk still refuses, or the file does not read as its row says:
    the mark stands) or the item needed nothing."""
    return execute(Rewrite((item_id,), asked=True))
