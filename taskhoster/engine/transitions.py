"""Every transition of the lifecycle (SPEC section 3), as calls that run in a group commit.

Each function builds one operation (``ops``) and hands it to the committer; the rules live
in ``group.Group``, once. The ``*_async`` twins are for callers on an event loop (the
``/work`` sockets and their dispatcher): they wait without blocking it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from ..errors import Overloaded, QueueNotFound
from ..models import Queue
from ..timeutil import now as utcnow
from .committer import execute, execute_async, overloaded, submit_async
from .group import WORKER_DISCONNECTED, prepare_post
from .ops import (
    Claim,
    Claimed,
    Delete,
    Extend,
    Fail,
    MarkFetched,
    NewItem,
    Posted,
    Release,
    Requeue,
    Restart,
    Result,
    Sweep,
    Verdict,
)
from .rows import ItemRow


def get_live_queue(name: str) -> Queue:
    queue = Queue.objects.filter(name=name, deleting=False).first()
    if queue is None:
        raise QueueNotFound(f"queue {name!r} does not exist")
    return queue


# -- rule 1: post ---------------------------------------------------------------------------


def admit_post() -> None:
    """Refuse a new post at once (``Overloaded``: 503 with ``Retry-After``) while this
    process's committer is behind (``committer.overloaded``)."""
    retry_after = overloaded()
    if retry_after is not None:
        raise Overloaded(
            "the server is overloaded: posts wait for work already accepted; try again "
            f"in {retry_after:g} s",
            retry_after=retry_after,
        )


def post_items(*, queue_name: str, items: list[NewItem]) -> list[Posted]:
    """Post items to a queue, all or none; an item whose key exists returns the existing one."""
    answer: list[Posted] = execute(prepare_post(queue_name, items))
    return answer


def post_items_soon(
    *, queue_name: str, items: list[NewItem], key_hash: str | None = None
) -> asyncio.Future[list[Posted]]:
    """``post_items`` for a caller on an event loop, which awaits the returned future.
    ``key_hash``: the caller's key, for the group to check (``ops.Post``)."""
    return submit_async(prepare_post(queue_name, items, key_hash))


# -- rule 2: claim, rule 5: extend ----------------------------------------------------------


def claim(*, queue_name: str, max_items: int = 1) -> list[Claimed]:
    """Move up to ``max_items`` claimable items of the queue to processing under new leases."""
    answer: list[Claimed] = execute(Claim(queue_name=queue_name, max_items=max_items))
    return answer


async def claim_async(*, queue_name: str, max_items: int = 1) -> list[Claimed]:
    answer: list[Claimed] = await execute_async(Claim(queue_name=queue_name, max_items=max_items))
    return answer


async def claim_seen_async(*, queue_name: str, max_items: int) -> tuple[list[Claimed], int]:
    """``claim_async``, and ``events.generation()`` when its answer came (``Op.generation``):
    this process's news delivered up to then came from groups no later than the claim's."""
    op = Claim(queue_name=queue_name, max_items=max_items)
    answer: list[Claimed] = await execute_async(op)
    return answer, op.generation


def extend(
    *, item_id: str, lease: str | None, seconds: float | None = None
) -> tuple[bool, ItemRow]:
    """Push the lease out to now + ``seconds`` (at most ``leaseSeconds``) for its holder."""
    answer: tuple[bool, ItemRow] = execute(Extend(item_id=item_id, lease=lease, seconds=seconds))
    return answer


async def extend_async(
    *, item_id: str, lease: str | None, seconds: float | None = None
) -> tuple[bool, ItemRow]:
    op = Extend(item_id=item_id, lease=lease, seconds=seconds)
    answer: tuple[bool, ItemRow] = await execute_async(op)
    return answer


# -- rules 3, 4, 6: result, fail, re-queue ---------------------------------------------------


def submit_result(*, item_id: str, result: Any, queues: frozenset[str] | None = None) -> Verdict:
    """Rule 3: the first result for a non-terminal item wins, lease or no lease. ``queues``:
    those the caller's key may use (an item of another queue is not found for it)."""
    answer: Verdict = execute(Result(item_id=item_id, result=result, queues=queues))
    return answer


async def submit_result_async(
    *, item_id: str, result: Any, queues: frozenset[str] | None = None
) -> Verdict:
    answer: Verdict = await execute_async(Result(item_id=item_id, result=result, queues=queues))
    return answer


def fail(*, item_id: str, lease: str | None, error: str | None, retry: bool = True) -> Verdict:
    """Rule 4: the lease holder reports a failure; retry with backoff, or die."""
    answer: Verdict = execute(Fail(item_id=item_id, lease=lease, error=error, retry=retry))
    return answer


async def fail_async(
    *, item_id: str, lease: str | None, error: str | None, retry: bool = True
) -> Verdict:
    op = Fail(item_id=item_id, lease=lease, error=error, retry=retry)
    answer: Verdict = await execute_async(op)
    return answer


def requeue_held(*, item_id: str, lease: str, cause: str = WORKER_DISCONNECTED) -> Verdict:
    """Rule 6, socket drop: re-queue an item still held under ``lease`` (or let it die)."""
    answer: Verdict = execute(Requeue(item_id=item_id, lease=lease, cause=cause))
    return answer


async def requeue_held_async(
    *, item_id: str, lease: str, cause: str = WORKER_DISCONNECTED
) -> Verdict:
    answer: Verdict = await execute_async(Requeue(item_id=item_id, lease=lease, cause=cause))
    return answer


def release_unsent(*, item_id: str, lease: str) -> Verdict:
    """Undo a claim whose item never reached its worker (the push to a socket that had gone):
    back to ``pending`` as if never claimed, the claim's attempt taken back."""
    answer: Verdict = execute(Release(item_id=item_id, lease=lease))
    return answer


async def release_unsent_async(*, item_id: str, lease: str) -> Verdict:
    answer: Verdict = await execute_async(Release(item_id=item_id, lease=lease))
    return answer


def requeue_if_lapsed(*, item_id: str, at: datetime) -> bool:
    """Rule 6, lease lapse (the sweep): re-queue, or die if attempts are used up."""
    return bool(execute(Sweep(clock="lapse", ids=(item_id,), at=at)))


def time_out_if_aged(*, item_id: str, at: datetime) -> bool:
    """Rule 8: a live item older than ``queueSeconds`` fails with ``timeout``."""
    return bool(execute(Sweep(clock="timeout", ids=(item_id,), at=at)))


def delete_if_retained(*, item_id: str, at: datetime) -> bool:
    """Rule 11: delete a done item whose retention has run out."""
    return bool(execute(Sweep(clock="retain", ids=(item_id,), at=at)))


def apply_clock(*, clock: str, item_ids: Iterable[str], at: datetime) -> int:
    """The sweep: one clock (``lapse``, ``timeout``, ``retain``) on a chunk of items."""
    answer: int = execute(Sweep(clock=clock, ids=tuple(item_ids), at=at))
    return answer


# -- rule 9: delete, rule 10: restart, rule 11: fetched --------------------------------------


def delete_item(*, item_id: str, queue_name: str | None = None) -> bool:
    """Rule 9: the item and its file are gone; a processing thread head is detached at once."""
    return delete_items(item_ids=[item_id], queue_name=queue_name) == 1


def delete_items(*, item_ids: Iterable[str], queue_name: str | None = None) -> int:
    queue_id = get_live_queue(queue_name).id if queue_name is not None else None
    answer: int = execute(Delete(ids=tuple(dict.fromkeys(item_ids)), queue_id=queue_id))
    return answer


def restart(*, item_id: str) -> ItemRow:
    """Rule 10: a failed item becomes a brand-new arrival in its queue (and thread)."""
    answer: ItemRow = execute(Restart(item_id=item_id))
    return answer


def mark_fetched(*, item_id: str) -> datetime | None:
    """A producer read a terminal item: start its ``fetched`` retention clock (once).
    Returns when it was first fetched (None if the item is not terminal or gone)."""
    answer: datetime | None = execute(MarkFetched(item_id=item_id, at=utcnow()))
    return answer
