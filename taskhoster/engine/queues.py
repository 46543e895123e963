"""Queue settings (SPEC section 2): validation shared by the API and the admin, and upsert.

Each setting is declared once, in ``QUEUE_SETTINGS``: its wire name, its ``Queue`` field, what
it holds and its bounds. ``clean_settings`` validates by them, ``queue_settings`` answers with
them, and ``/api/schema`` (``api.schema``) describes them; the default and the doc are the
model field's (Django's migrations need them there).

The settings are also written to ``<root>/<queue>/queue.json`` so that the state directories
alone can rebuild a lost database.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from django.db import IntegrityError, transaction
from django.db.models import Field

from ..contract import MAX_DELAY_SECONDS, MAX_LEASE_SECONDS
from ..errors import InvalidInput
from ..models import Queue
from ..status import RetainFrom
from ..store import QUEUE_NAME_PATTERN, write_queue_settings
from .common import store

DAY = 86400.0
MAX_LIMIT = 1_000_000  # maxProcessing, and a rateLimit's count
MAX_THREAD_LIMIT = 1000


def clean_rate(wire: str, value: Any) -> dict[str, Any]:
    """A ``rateLimit``: ``{"count": 1..MAX_LIMIT, "seconds": > 0 and at most a day}``."""
    if not isinstance(value, dict) or set(value) != {"count", "seconds"}:
        raise InvalidInput(
            f'{wire} must be {{"count": N, "seconds": S}} or null', code="invalid_setting"
        )
    count, seconds = value["count"], value["seconds"]
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_LIMIT:
        raise InvalidInput(
            f"{wire}.count must be an integer from 1 to {MAX_LIMIT}", code="invalid_setting"
        )
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not 0 < seconds <= DAY
    ):
        raise InvalidInput(
            f"{wire}.seconds must be a number greater than 0 and at most {DAY:g}",
            code="invalid_setting",
        )
    return {"count": count, "seconds": int(seconds) if float(seconds).is_integer() else seconds}


@dataclass(frozen=True)
class QueueSetting:
    """One queue setting. ``kind``: number, integer, boolean, choice (one of ``choices``),
    queue (the name of another live queue) or rate (``{"count", "seconds"}``). ``minimum``
    (with ``exclusive_minimum``: the value must be greater) and ``maximum`` bound a number.
    ``nullable``: null is a value (for none)."""

    wire: str
    field: str
    kind: Literal["number", "integer", "choice", "queue", "boolean", "rate"]
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    nullable: bool = False
    choices: tuple[str, ...] = ()

    @property
    def default(self) -> Any:
        """The model field's default: a new queue's value (None for a nullable one)."""
        found = self._model_field()
        return found.default if found.has_default() else None

    @property
    def doc(self) -> str:
        """The model field's help text."""
        return str(self._model_field().help_text)

    def _model_field(self) -> Field[Any, Any]:
        found = Queue._meta.get_field(self.field)
        assert isinstance(found, Field), self.field
        return found

    def _range(self) -> str:
        """What a number must be, as ``clean_settings`` says it."""
        low = "greater than" if self.exclusive_minimum else "at least"
        parts = [f"{low} {self.minimum:g}"] if self.minimum is not None else []
        if self.maximum is not None:
            parts.append(f"at most {self.maximum:g}")
        return " and ".join(parts)

    def clean(self, queue_name: str, value: Any) -> Any:
        """The model field's value for the wire ``value``, or ``InvalidInput``."""
        if value is None and self.nullable:
            return None
        if self.kind == "choice":
            if not isinstance(value, str) or value not in self.choices:
                allowed = " or ".join(repr(c) for c in self.choices)
                raise InvalidInput(f"{self.wire} must be {allowed}", code="invalid_setting")
            return value
        if self.kind == "boolean":
            if not isinstance(value, bool):
                raise InvalidInput(f"{self.wire} must be true or false", code="invalid_setting")
            return value
        if self.kind == "rate":
            return clean_rate(self.wire, value)
        if self.kind == "queue":
            validate_queue_name(value)
            if value == queue_name:
                raise InvalidInput(f"a queue cannot be its own {self.wire}", code="invalid_setting")
            if not Queue.objects.filter(name=value, deleting=False).exists():
                raise InvalidInput(f"{self.wire} {value!r} does not exist", code="invalid_setting")
            return value
        integer = self.kind == "integer"
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (integer and not isinstance(value, int))
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            kind = "an integer" if integer else "a number"
            raise InvalidInput(f"{self.wire} must be {kind}", code="invalid_setting")
        low, high = self.minimum, self.maximum
        if (low is not None and (value <= low if self.exclusive_minimum else value < low)) or (
            high is not None and value > high
        ):
            raise InvalidInput(f"{self.wire} must be {self._range()}", code="invalid_setting")
        return int(value) if integer else float(value)


QUEUE_SETTINGS: tuple[QueueSetting, ...] = (
    # An extend's seconds and a post's delaySeconds are bounded by the same figures.
    QueueSetting(
        "leaseSeconds", "lease_seconds", "number", 0, MAX_LEASE_SECONDS, exclusive_minimum=True
    ),
    QueueSetting(
        "queueSeconds", "queue_seconds", "number", 0, MAX_DELAY_SECONDS, exclusive_minimum=True
    ),
    QueueSetting("retainSeconds", "retain_seconds", "number", 0, 366 * DAY),
    QueueSetting("maxAttempts", "max_attempts", "integer", 1, 1_000_000, nullable=True),
    QueueSetting("backoffSeconds", "backoff_seconds", "number", 0, DAY),
    QueueSetting("backoffMaxSeconds", "backoff_max_seconds", "number", 0, 7 * DAY),
    QueueSetting("retainFrom", "retain_from", "choice", choices=tuple(r.value for r in RetainFrom)),
    QueueSetting("deadLetterQueue", "dead_letter_queue", "queue", nullable=True),
    # Flow control (section 8.1).
    QueueSetting("paused", "paused", "boolean"),
    QueueSetting("maxProcessing", "max_processing", "integer", 1, MAX_LIMIT, nullable=True),
    QueueSetting("rateLimit", "rate_limit", "rate", nullable=True),
    QueueSetting("threadLimit", "thread_limit", "integer", 1, MAX_THREAD_LIMIT),
)
WIRE_TO_FIELD = {s.wire: s.field for s in QUEUE_SETTINGS}


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
    for setting in QUEUE_SETTINGS:
        if setting.wire in body:
            values[setting.field] = setting.clean(queue_name, body[setting.wire])
    return values


def upsert_queue(*, name: str, body: dict[str, Any]) -> tuple[Queue, bool]:
    """Create the queue or change the given settings; True when it was created."""
    queue, created, _before = change_queue(name=name, body=body)
    return queue, created


def change_queue(*, name: str, body: dict[str, Any]) -> tuple[Queue, bool, dict[str, Any]]:
    """``upsert_queue``, and the settings the queue held just before (read under the row's
    lock, so two changes at once each see the other's; empty when it was created)."""
    validate_queue_name(name)
    values = clean_settings(name, body)
    try:
        with transaction.atomic():
            queue = Queue.objects.select_for_update().filter(name=name, deleting=False).first()
            created = queue is None
            before = {} if queue is None else queue_settings(queue, wire=False)
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
        return change_queue(name=name, body=body)  # created concurrently: update it instead
    return queue, created, before


def queue_settings(queue: Queue, *, wire: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for wire_name, field in WIRE_TO_FIELD.items():
        value = getattr(queue, field)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        out[wire_name if wire else field] = value
    return out
