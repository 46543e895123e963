"""An item as clients see it: the one JSON shape for the REST API and the ``/work`` socket."""

from __future__ import annotations

from typing import Any

from ..status import Status
from ..timeutil import to_wire

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
    out["scheduledAt"] = to_wire(row.scheduled_at)
    out["postedAt"] = to_wire(row.posted_at)
    out["attempts"] = row.attempts
    out["leaseExpiresAt"] = to_wire(row.lease_expires_at) if processing else None
    out["finishedAt"] = to_wire(row.finished_at)
    if result is not _OMIT:
        out["result"] = result if row.status == Status.FINISHED else None
    out["error"] = row.error
    out["key"] = row.key
    if row.origin is not None:
        out["origin"] = row.origin
    if row.dead_letter is not None:
        out["deadLetter"] = row.dead_letter
    if lease is not None:
        out["lease"] = lease
    return out
