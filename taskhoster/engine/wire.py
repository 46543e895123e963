"""An item as clients see it: the one JSON shape for the REST API and the ``/work`` socket;
and the items a post's body asks for, for the REST API and ``taskhoster.local`` alike."""

from __future__ import annotations

from typing import Any

from .. import contract
from ..status import Status
from ..timeutil import to_wire
from .ops import NewItem
from .slots import schedule_of_key

_OMIT: Any = object()


def item_json(
    row: Any,
    *,
    queue_name: str | None = None,
    payload: Any = _OMIT,
    result: Any = _OMIT,
    lease: str | None = None,
) -> dict[str, Any]:
    """An item's wire JSON (SPEC section 5) from its row (an ``ItemRow`` or an ``Item``).

    Without ``payload`` and ``result`` (listings) those fields are left out; ``result`` is
    shown only for a finished item; ``lease`` is added for the holder of a claim.
    """
    if queue_name is None:
        queue_name = row.queue_name if hasattr(row, "queue_name") else row.queue.name
    processing = row.status == Status.PROCESSING
    out: dict[str, Any] = {"id": row.id, "queue": queue_name, "status": row.status}
    if payload is not _OMIT:
        out["payload"] = payload
    out["threadId"] = row.thread_id
    out["priority"] = row.priority
    out["scheduledAt"] = to_wire(row.scheduled_at)
    out["postedAt"] = to_wire(row.posted_at)
    out["attempts"] = row.attempts
    out["leaseExpiresAt"] = to_wire(row.lease_expires_at) if processing else None
    out["finishedAt"] = to_wire(row.finished_at)
    if result is not _OMIT:
        out["result"] = result if row.status == Status.FINISHED else None
    out["error"] = row.error
    out["key"] = row.key
    schedule = schedule_of_key(row.key)
    if schedule is not None:
        out["schedule"] = schedule
    if row.origin is not None:
        out["origin"] = row.origin
    if row.dead_letter is not None:
        out["deadLetter"] = row.dead_letter
    out["progress"] = row.progress
    if row.cancel_reason is not None:
        out["cancelReason"] = row.cancel_reason
    if lease is not None:
        out["lease"] = lease
    return out


def new_items(body: Any) -> list[NewItem]:
    """The items a post's body asks for: one item, or ``{"items": [...]}``, judged by the
    contract (``InvalidInput`` or ``TooLarge`` for what it refuses)."""
    if isinstance(body, dict) and "items" in body:
        specs = contract.validate(contract.POST_BATCH, body)["items"]
    else:
        specs = [contract.validate(contract.POST_ITEM, body)]
    return [
        NewItem(
            payload=s.get("payload"),
            thread_id=s.get("threadId"),
            scheduled_at=s.get("scheduledAt"),
            delay_seconds=s.get("delaySeconds"),
            key=s.get("key"),
            priority=s.get("priority") or 0,
        )
        for s in specs
    ]
