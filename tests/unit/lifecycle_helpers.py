"""Small helpers shared by the engine tests: post, claim, and look at rows and files."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from taskhoster import engine
from taskhoster.engine import Claimed, ItemRow, NewItem
from taskhoster.models import Item, Thread
from taskhoster.status import State
from taskhoster.store import decode
from taskhoster.timeutil import now as utcnow

__all__ = ["Claimed", "NewItem", "utcnow"]


def post(queue: str = "q", payload: Any = None, **spec: Any) -> ItemRow:
    return engine.post_items(queue_name=queue, items=[NewItem(payload=payload, **spec)])[0].row


def claim(queue: str = "q", max_items: int = 10) -> list[Claimed]:
    return engine.claim(queue_name=queue, max_items=max_items)


def claim_one(queue: str = "q") -> ItemRow:
    got = engine.claim(queue_name=queue, max_items=1)
    assert len(got) == 1, got
    return got[0].row


def claimed_ids(queue: str = "q", max_items: int = 10) -> list[str]:
    return [c.row.id for c in claim(queue, max_items)]


def row(item_id: str) -> Item:
    return Item.objects.get(id=item_id)


def exists(item_id: str) -> bool:
    return Item.objects.filter(id=item_id).exists()


def states_on_disk(root: Path, queue: str, item_id: str) -> list[str]:
    """The state directories holding a file for this item (exactly one, normally)."""
    return [s.value for s in State if (root / queue / s.value / f"{item_id}.json").exists()]


def file_record(root: Path, queue: str, item_id: str) -> dict[str, Any]:
    where = states_on_disk(root, queue, item_id)
    assert len(where) == 1, where
    return decode((root / queue / where[0] / f"{item_id}.json").read_bytes())[0]


def after(moment: datetime | None, seconds: float = 0.0) -> datetime:
    assert moment is not None
    return moment + timedelta(seconds=seconds)


def lease_expiry(held: ItemRow) -> datetime:
    """When a claimed row's lease runs out (a claimed row always has one)."""
    assert held.lease_expires_at is not None
    return held.lease_expires_at


def ago(seconds: float) -> datetime:
    return utcnow() - timedelta(seconds=seconds)


def thread_row(queue_name: str, thread_id: str) -> Thread | None:
    return Thread.objects.filter(queue__name=queue_name, thread_id=thread_id).first()
