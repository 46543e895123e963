"""Queue settings (SPEC section 2): validation shared by the API and the admin, and upsert.

The settings are also written to ``<root>/<queue>/queue.json`` so that the state directories
alone can rebuild a lost database.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction

from ..contract import MAX_DELAY_SECONDS, MAX_LEASE_SECONDS
from ..errors import InvalidInput
from ..models import Queue
from ..status import RetainFrom
from ..store import QUEUE_NAME_PATTERN, write_queue_settings
from .common import store

DAY = 86400.0


@dataclass(frozen=True)
class Setting:
    wire: str
    field: str
    minimum: float
    maximum: float
    integer: bool = False
    nullable: bool = False
    exclusive_minimum: bool = False


SETTINGS = (
    # An extend's seconds and a post's delaySeconds are bounded by the same figures.
    Setting("leaseSeconds", "lease_seconds", 0, MAX_LEASE_SECONDS, exclusive_minimum=True),
    Setting("queueSeconds", "queue_seconds", 0, MAX_DELAY_SECONDS, exclusive_minimum=True),
    Setting("retainSeconds", "retain_seconds", 0, 366 * DAY),
    Setting("maxAttempts", "max_attempts", 1, 1_000_000, integer=True, nullable=True),
    Setting("backoffSeconds", "backoff_seconds", 0, DAY),
    Setting("backoffMaxSeconds", "backoff_max_seconds", 0, 7 * DAY),
)
WIRE_TO_FIELD = {s.wire: s.field for s in SETTINGS} | {
    "retainFrom": "retain_from",
    "deadLetterQueue": "dead_letter_queue",
}


def validate_queue_name(name: object) -> str:
    if not isinstance(name, str) or QUEUE_NAME_PATTERN.fullmatch(name) is None:
        raise InvalidInput(
            "a queue name is 1-64 characters of letters, digits, '_', '.' and '-', starting "
            "with a letter or digit",
            code="invalid_queue_name",
        )
    return name


def clean_settings(queue_name: str, body: dict[str, Any]) -> dict[str, Any]:
    """Turn wire settings into model fields, or raise ``InvalidInput`` naming the bad one."""
    unknown = sorted(set(body) - set(WIRE_TO_FIELD))
    if unknown:
        raise InvalidInput(f"unknown setting(s): {', '.join(unknown)}", code="unknown_field")
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.wire not in body:
            continue
        value = body[setting.wire]
        if value is None and setting.nullable:
            values[setting.field] = None
            continue
        kind = "an integer" if setting.integer else "a number"
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (setting.integer and not isinstance(value, int))
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            raise InvalidInput(f"{setting.wire} must be {kind}", code="invalid_setting")
        low_ok = value > setting.minimum if setting.exclusive_minimum else value >= setting.minimum
        if not low_ok or value > setting.maximum:
            bound = "greater than" if setting.exclusive_minimum else "at least"
            raise InvalidInput(
                f"{setting.wire} must be {bound} {setting.minimum:g} and at most "
                f"{setting.maximum:g}",
                code="invalid_setting",
            )
        values[setting.field] = int(value) if setting.integer else float(value)
    if "retainFrom" in body:
        if not isinstance(body["retainFrom"], str) or body["retainFrom"] not in {
            r.value for r in RetainFrom
        }:
            raise InvalidInput("retainFrom must be 'finished' or 'fetched'", code="invalid_setting")
        values["retain_from"] = body["retainFrom"]
    if "deadLetterQueue" in body:
        dlq = body["deadLetterQueue"]
        if dlq is not None:
            validate_queue_name(dlq)
            if dlq == queue_name:
                raise InvalidInput(
                    "a queue cannot be its own deadLetterQueue", code="invalid_setting"
                )
            if not Queue.objects.filter(name=dlq, deleting=False).exists():
                raise InvalidInput(
                    f"deadLetterQueue {dlq!r} does not exist", code="invalid_setting"
                )
        values["dead_letter_queue"] = dlq
    return values


def upsert_queue(*, name: str, body: dict[str, Any]) -> tuple[Queue, bool]:
    """Create the queue or change the given settings; True when it was created."""
    validate_queue_name(name)
    values = clean_settings(name, body)
    try:
        with transaction.atomic():
            queue = Queue.objects.select_for_update().filter(name=name, deleting=False).first()
            created = queue is None
            if queue is None:
                queue = Queue(name=name)
            for field, value in values.items():
                setattr(queue, field, value)
            if queue.backoff_max_seconds < queue.backoff_seconds:
                raise InvalidInput(
                    "backoffMaxSeconds must be at least backoffSeconds", code="invalid_setting"
                )
            queue.save()
            write_queue_settings(store(), name, queue_settings(queue, wire=False))
    except IntegrityError:
        return upsert_queue(name=name, body=body)  # created concurrently: update it instead
    return queue, created


def queue_settings(queue: Queue, *, wire: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for wire_name, field in WIRE_TO_FIELD.items():
        value = getattr(queue, field)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        out[wire_name if wire else field] = value
    return out
