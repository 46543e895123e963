"""The request bodies of the REST API and the ``/work`` socket, declared once.

Each body is a ``Body`` of ``Field``s with their types, bounds and limits. The same
declaration validates a request (``validate``: plain Python, no framework, fast enough to
run on every post) and describes it in ``/api/schema`` and in the socket's AsyncAPI document
(``schemas`` turns it into JSON Schema). The REST API and the socket validate the same
operation with the same declaration: a socket frame is its REST body plus ``type`` and
``id`` (``frame``), so a bound or an error code is written once for both.

Two kinds of limits. Those that are settings (the largest payload, batch, claim, wait,
capacity, subscription and bulk delete) are read from ``conf`` when they are used, never at
import time (``limit``). Those fixed by the wire format or the index's columns are the
constants below; a project cannot change them.

A refused value raises ``InvalidInput`` (400) naming the field (a batch's member by its index,
``items[3].threadId``), or ``TooLarge`` (413) for a payload, result or batch over its limit;
unknown fields are refused, never ignored, and a post body mixing one item's fields with a
batch's ``items`` is refused as that mix.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .conf import Conf, get_conf
from .errors import InvalidInput, TooLarge
from .ids import ID_PATTERN
from .patterns import is_printable, is_producer_key, is_wire_time
from .status import Status
from .store import QUEUE_NAME_PATTERN
from .timeutil import parse_wire

DAY = 86400.0

# -- fixed by the wire format ------------------------------------------------------------------
ID_MAX_CHARS = 64  # an item id, as ``patterns.ID`` (the index's primary key column)
LEASE_MAX_CHARS = 64  # a lease token (the index's lease column)
THREAD_ID_MAX_CHARS = 200  # SPEC section 1 (the index's thread column)
KEY_MAX_CHARS = 200  # an idempotency key (the index's key column)
ERROR_MAX_CHARS = 10_000  # a fail's error text (taskhoster.client cuts its texts to this)
MAX_LEASE_SECONDS = 7 * DAY  # a queue's leaseSeconds, hence an extend's seconds
MAX_DELAY_SECONDS = 366 * DAY  # a queue's queueSeconds, hence a post's delaySeconds
MAX_PRIORITY = 9  # SPEC section 8.1 (the claim index is probed once per level)
PROGRESS_MAX_BYTES = 4096  # SPEC section 8.2: an item's progress, as compact JSON
CANCEL_REASON_MAX_CHARS = 500  # SPEC section 8.2
WORKER_NAME_MAX_CHARS = 200  # SPEC section 8.2: a socket's name in subscribe
# What a socket frame or a REST body of one item may hold besides its payload or result (the
# id, lease, threadId, key, error text, and JSON's escapes of them).
ENVELOPE_BYTES = 64 * 1024

Bound = float | int | Callable[[Conf], float] | None


def limit(name: str) -> Callable[[Conf], float]:
    """A bound read from the settings when it is needed."""

    def read(conf: Conf) -> float:
        return float(getattr(conf, name))

    read.__name__ = f"conf.{name}"
    return read


def resolve(bound: Bound) -> float | None:
    if bound is None or isinstance(bound, int | float):
        return bound
    return bound(get_conf())


@dataclass(frozen=True)
class Field:
    """One field of a body. ``kind`` is json, string, integer, number, boolean, time,
    choice, list or object."""

    name: str
    kind: str
    required: bool = False
    nullable: bool = False
    default: Any = None
    minimum: Bound = None
    maximum: Bound = None
    exclusive_minimum: bool = False
    min_length: int | None = None
    max_length: Bound = None
    pattern: str | None = None
    printable: bool = False
    choices: tuple[str, ...] = ()
    item: Field | None = None
    body: Body | None = None
    sized: bool = False  # a payload or result: at most MAX_PAYLOAD_BYTES of JSON (413)
    max_bytes: int | None = None  # other JSON: at most this many bytes of it (413)
    too_large: str | None = None  # a list over max_length is 413 with this code
    code: str = "invalid"
    description: str = ""


@dataclass(frozen=True)
class Body:
    name: str
    fields: tuple[Field, ...]
    at_most_one_of: tuple[tuple[str, ...], ...] = ()
    exactly_one_of: tuple[tuple[str, ...], ...] = ()
    # The body this one stands instead of (a batch, of one item), and what to say of a body
    # that mixes the two: a field of that one given here is refused as such a mix (400
    # invalid_body), not as an unknown field.
    instead_of: Body | None = None
    mixed: str = ""
    description: str = ""
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(f.name for f in self.fields))


def validate(body: Body, data: Any, *, where: str = "") -> dict[str, Any]:
    """The body's values (with defaults), or ``InvalidInput``/``TooLarge`` naming the field."""
    if not isinstance(data, dict):
        raise InvalidInput(
            f"{where.rstrip('.') or 'the body'} must be a JSON object", code="invalid_body"
        )
    if body.instead_of is not None:
        others = [f.name for f in body.instead_of.fields if f.name in data]
        if others:
            own = [f.name for f in body.fields if f.name in data]
            raise InvalidInput(
                f"{body.mixed}: this one has {', '.join(own)} and {', '.join(others)}",
                code="invalid_body",
            )
    unknown = sorted(set(data) - body.names)
    if unknown:
        named = ", ".join(f"{where}{n}" for n in unknown)
        raise InvalidInput(f"unknown field(s): {named}", code="unknown_field")
    values: dict[str, Any] = {}
    for spec in body.fields:
        name = f"{where}{spec.name}"
        if spec.name not in data:
            if spec.required:
                raise InvalidInput(f"{name} is required", code="missing_field")
            if spec.default is not None:
                values[spec.name] = spec.default
            continue
        value = data[spec.name]
        if value is None:
            if not spec.nullable:
                raise InvalidInput(f"{name} must not be null", code=spec.code)
            values[spec.name] = None
            continue
        values[spec.name] = _check(spec, value, name)
    for group in body.at_most_one_of:  # given at all, even as null (as the schemas say)
        if sum(n in values for n in group) > 1:
            named = " or ".join(f"{where}{n}" for n in group)
            raise InvalidInput(f"give {named}, not both", code="invalid")
    for group in body.exactly_one_of:
        if sum(n in values for n in group) != 1:
            named = " or ".join(f"{where}{n}" for n in group)
            raise InvalidInput(f"give either {named}", code="invalid_body")
    return values


def _check(spec: Field, value: Any, name: str) -> Any:
    kind = spec.kind
    if kind == "json":
        if spec.sized:
            check_size(value, name)
        if spec.max_bytes is not None:
            check_size(value, name, most=spec.max_bytes)
        return value
    if kind == "string" or kind == "choice":
        if not isinstance(value, str):
            raise InvalidInput(f"{name} must be a string", code=spec.code)
        if kind == "choice":
            if value not in spec.choices:
                raise InvalidInput(
                    f"{name} must be one of {', '.join(spec.choices)}", code=spec.code
                )
            return value
        longest = resolve(spec.max_length)
        if (spec.min_length is not None and len(value) < spec.min_length) or (
            longest is not None and len(value) > longest
        ):
            raise InvalidInput(
                f"{name} must be {spec.min_length or 0}-{longest:g} characters", code=spec.code
            )
        if "\x00" in value:  # no text store (files, database) keeps a NUL intact
            raise InvalidInput(f"{name} must not contain NUL characters", code=spec.code)
        if spec.printable and not is_printable(value):
            raise InvalidInput(f"{name} must be printable characters", code=spec.code)
        if spec.pattern == "id" and ID_PATTERN.fullmatch(value) is None:
            raise InvalidInput(f"{name} may hold only letters, digits, '_' and '-'", code=spec.code)
        if spec.pattern == "queue" and QUEUE_NAME_PATTERN.fullmatch(value) is None:
            raise InvalidInput(f"{name} must be a queue name", code=spec.code)
        if spec.pattern == "key" and not is_producer_key(value):
            raise InvalidInput(
                f"{name} must not begin with 'schedule:' (the keys of schedules' slots)",
                code=spec.code,
            )
        return value
    if kind == "integer" or kind == "number":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidInput(f"{name} must be a number", code=spec.code)
        if kind == "integer" and not isinstance(value, int):
            raise InvalidInput(f"{name} must be an integer", code=spec.code)
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput(f"{name} must be finite", code=spec.code)
        low, high = resolve(spec.minimum), resolve(spec.maximum)
        too_low = low is not None and (value <= low if spec.exclusive_minimum else value < low)
        if too_low or (high is not None and value > high):
            bound = "more than" if spec.exclusive_minimum else "at least"
            raise InvalidInput(
                f"{name} must be {bound} {low:g} and at most {high:g}", code=spec.code
            )
        return value
    if kind == "boolean":
        if not isinstance(value, bool):
            raise InvalidInput(f"{name} must be true or false", code=spec.code)
        return value
    if kind == "time":
        if not isinstance(value, str) or not is_wire_time(value):
            raise InvalidInput(
                f"{name} must be an ISO-8601 time such as 2026-01-31T12:00:00Z",
                code=spec.code,
            )
        try:
            return parse_wire(value)
        except (ValueError, OverflowError):
            raise InvalidInput(
                f"{name} must be an ISO-8601 UTC time such as 2026-01-31T12:00:00Z",
                code=spec.code,
            ) from None
    if kind == "list":
        if not isinstance(value, list):
            raise InvalidInput(f"{name} must be a list", code=spec.code)
        longest = resolve(spec.max_length)
        if longest is not None and len(value) > longest:
            if spec.too_large:
                raise TooLarge(f"{name} holds at most {entries(longest)}", code=spec.too_large)
            raise InvalidInput(f"{name} holds at most {entries(longest)}", code=spec.code)
        if spec.min_length is not None and len(value) < spec.min_length:
            raise InvalidInput(f"{name} needs at least {entries(spec.min_length)}", code=spec.code)
        assert spec.item is not None
        item = spec.item
        if item.kind == "object":
            assert item.body is not None
            return [validate(item.body, v, where=f"{name}[{n}].") for n, v in enumerate(value)]
        return [_check(item, v, f"{name}[{n}]") for n, v in enumerate(value)]
    if kind == "object":
        assert spec.body is not None
        return validate(spec.body, value, where=f"{name}.")
    raise ValueError(f"unknown field kind {kind}")


def entries(n: float) -> str:
    """A count of list entries as a message says it: 1 entry, 1000 entries."""
    return f"{n:g} entry" if n == 1 else f"{n:g} entries"


def check(spec: Field, value: Any, name: str) -> Any:
    """One value (a path or query parameter) against its declaration."""
    if value is None:
        raise InvalidInput(f"{name} must not be null", code=spec.code)
    return _check(spec, value, name)


def max_frame_bytes() -> int:
    """The largest ``/work`` frame: one payload or result at its limit, and its envelope."""
    return get_conf().max_payload_bytes + ENVELOPE_BYTES


def check_depth(text: str, value: Any) -> None:
    """JSON nested more than ``MAX_JSON_DEPTH`` levels is refused (400 ``too_deep``): deeper
    values cost the server out of proportion (they cannot even be handed to the committer
    process past a few hundred levels), and no work item needs them. ``text`` is the JSON
    ``value`` was read from: one with fewer brackets than the limit is not walked."""
    most = get_conf().max_json_depth
    if text.count("[") + text.count("{") <= most:
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > most:
            raise InvalidInput(f"the JSON is nested more than {most} levels deep", code="too_deep")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


# A \uD800-\uDFFF escape: valid JSON syntax, but unpaired it is no Unicode text and cannot
# be stored (UTF-8 files, database text).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def holds_lone_surrogate(text: str, value: Any) -> bool:
    """Whether ``value``, read from the JSON ``text``, holds a lone surrogate (an escape
    ``\\ud800``-``\\udfff`` without its pair): no text a file or a database can keep. Only a
    text with such an escape is looked at further."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_size(value: Any, name: str, *, most: int | None = None) -> None:
    """A payload or result: at most ``MAX_PAYLOAD_BYTES`` of JSON (or ``most``), else 413."""
    if most is None:
        most = get_conf().max_payload_bytes
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > most:
        raise TooLarge(f"{name} is {size} bytes of JSON; the limit is {most}")


# -- the bodies --------------------------------------------------------------------------------

LEASE = Field(
    "lease",
    "string",
    required=True,
    min_length=1,
    max_length=LEASE_MAX_CHARS,
    code="invalid_lease",
    description="The lease token of the claim (from the item as claimed).",
)
ITEM_ID = Field(
    "id",
    "string",
    required=True,
    min_length=1,
    max_length=ID_MAX_CHARS,
    pattern="id",
    code="invalid_id",
    description="An item id.",
)
RESULT_VALUE = Field(
    "result",
    "json",
    required=True,
    nullable=True,
    sized=True,
    description="Any JSON: the item's result (at most the payload limit).",
)
ERROR_TEXT = Field(
    "error",
    "string",
    nullable=True,
    min_length=0,
    max_length=ERROR_MAX_CHARS,
    code="invalid_error",
    description="Why the work failed.",
)
RETRY = Field(
    "retry",
    "boolean",
    default=True,
    code="invalid_retry",
    description="false: the item dies now; true (default): retried after a backoff.",
)
EXTEND_SECONDS = Field(
    "seconds",
    "number",
    nullable=True,
    minimum=0,
    exclusive_minimum=True,
    maximum=MAX_LEASE_SECONDS,
    code="invalid_seconds",
    description="Extend by this much (at most the queue's leaseSeconds).",
)

THREAD_ID = Field(
    "threadId",
    "string",
    min_length=1,
    max_length=THREAD_ID_MAX_CHARS,
    printable=True,
    code="invalid_thread_id",
    description=(
        f"Members of one thread run one at a time: 1-{THREAD_ID_MAX_CHARS} printable characters."
    ),
)
PRIORITY = Field(
    "priority",
    "integer",
    nullable=True,
    minimum=0,
    maximum=MAX_PRIORITY,
    description=(
        f"0-{MAX_PRIORITY} (default 0): among a queue's claimable items, higher priorities are "
        "handed out first, then earliest scheduledAt, then arrival."
    ),
)
POST_ITEM = Body(
    "PostItem",
    (
        Field(
            "payload",
            "json",
            required=True,
            nullable=True,
            sized=True,
            description="Any JSON: the work (at most the payload limit).",
        ),
        replace(THREAD_ID, nullable=True, code="invalid"),
        Field(
            "scheduledAt",
            "time",
            nullable=True,
            description="Not claimable before this time (ISO-8601 with Z).",
        ),
        Field(
            "delaySeconds",
            "number",
            nullable=True,
            minimum=0,
            maximum=MAX_DELAY_SECONDS,
            description="Not claimable for this many seconds.",
        ),
        Field(
            "key",
            "string",
            nullable=True,
            min_length=1,
            max_length=KEY_MAX_CHARS,
            pattern="key",
            description="Idempotency key: a post repeating a live key gets that item. Keys "
            "beginning with schedule: are the server's (a schedule's slots).",
        ),
        PRIORITY,
    ),
    at_most_one_of=(("scheduledAt", "delaySeconds"),),
    description="One item to post.",
)
# Section 8.3: a schedule's definition (``PUT /api/queues/{queue}/schedules/{name}``). Those
# left out of a change keep their value; a new schedule needs cron or every, and payload.
MAX_EVERY_SECONDS = 366 * 86400
MAX_CATCHUP_SECONDS = 366 * DAY
SCHEDULE = Body(
    "ScheduleSettings",
    (
        Field(
            "cron",
            "string",
            min_length=1,
            max_length=200,
            printable=True,
            code="invalid_schedule",
            description="Five cron fields (minute hour day-of-month month day-of-week: */n, "
            "ranges, lists, month and day names), in the schedule's timezone. Instead of every.",
        ),
        Field(
            "every",
            "integer",
            minimum=1,
            maximum=MAX_EVERY_SECONDS,
            code="invalid_schedule",
            description="Seconds between slots, counted from the Unix epoch (every: 3600 is at "
            "the top of each UTC hour). Instead of cron.",
        ),
        Field(
            "timezone",
            "string",
            min_length=1,
            max_length=64,
            printable=True,
            code="invalid_schedule",
            description="The IANA timezone a cron is read in (default UTC).",
        ),
        Field(
            "payload",
            "json",
            nullable=True,
            sized=True,
            description="Each slot's item's payload (required for a new schedule).",
        ),
        replace(THREAD_ID, nullable=True),
        PRIORITY,
        Field(
            "overlap",
            "choice",
            choices=("allow", "skip"),
            code="invalid_schedule",
            description='"allow" (default): every slot posts; "skip": a slot posts nothing '
            "while the schedule's previous item is not terminal.",
        ),
        Field(
            "catchupSeconds",
            "number",
            minimum=0,
            maximum=MAX_CATCHUP_SECONDS,
            code="invalid_schedule",
            description="A slot found late (nothing ran at its time) is posted if at most this "
            "late (default 60), oldest first; later than that it is skipped.",
        ),
        Field(
            "paused",
            "boolean",
            code="invalid_schedule",
            description="While on, no slot is posted; at resume the next slot after that "
            "moment is the first.",
        ),
    ),
    at_most_one_of=(("cron", "every"),),
    description="A schedule's definition; those left out of a change keep their value.",
)
POST_BATCH = Body(
    "PostBatch",
    (
        Field(
            "items",
            "list",
            required=True,
            min_length=1,
            max_length=limit("max_batch"),
            item=Field("item", "object", body=POST_ITEM),
            too_large="batch_too_large",
            description="Items to post, all or none.",
        ),
    ),
    instead_of=POST_ITEM,
    mixed=(
        "a post body is either one item "
        f"({', '.join(f.name for f in POST_ITEM.fields)}) or a batch (items), not both"
    ),
    description="Several items to post at once, all or none.",
)
CLAIM = Body(
    "Claim",
    (
        Field(
            "max",
            "integer",
            default=1,
            minimum=1,
            maximum=limit("max_claim"),
            description="Claim up to this many items.",
        ),
        Field(
            "wait",
            "number",
            default=0,
            minimum=0,
            maximum=limit("max_wait_seconds"),
            description="Wait up to this many seconds for an item.",
        ),
    ),
)
# Optional on a REST result, as on the socket's result frame, so a worker sends one shape
# either way; it changes nothing: a result is taken whatever its lease (SPEC rule 3, the first
# result wins). A REST fail or extend needs its lease: over HTTP the lease is the only holder.
RESULT_LEASE = replace(
    LEASE,
    required=False,
    description=(
        "The lease of the claim this answers. Optional, and it changes nothing: a result is "
        "taken whatever its lease (the first result wins)."
    ),
)
RESULT = Body("Result", (RESULT_VALUE, RESULT_LEASE))
FAIL = Body("Fail", (LEASE, ERROR_TEXT, RETRY))
EXTEND = Body("Extend", (LEASE, EXTEND_SECONDS))
BULK_DELETE = Body(
    "BulkDelete",
    (
        Field(
            "ids",
            "list",
            max_length=limit("max_delete_ids"),
            item=ITEM_ID,
            description="Delete these items.",
        ),
        Field(
            "status",
            "choice",
            choices=tuple(s.value for s in Status),
            description="Delete every item of the queue in this status.",
        ),
    ),
    exactly_one_of=(("ids", "status"),),
)

PROGRESS_VALUE = Field(
    "progress",
    "json",
    required=True,
    nullable=True,
    max_bytes=PROGRESS_MAX_BYTES,
    description=(
        f"Any JSON of at most {PROGRESS_MAX_BYTES} bytes: the item's progress while it is "
        "processing (it does not extend the lease)."
    ),
)
PROGRESS = Body("Progress", (LEASE, PROGRESS_VALUE))
CANCEL = Body(
    "Cancel",
    (
        Field(
            "reason",
            "string",
            nullable=True,
            min_length=0,
            max_length=CANCEL_REASON_MAX_CHARS,
            code="invalid_reason",
            description="Why it was cancelled (the item's cancelReason).",
        ),
    ),
)
WORKER_NAME = Field(
    "name",
    "string",
    min_length=1,
    max_length=WORKER_NAME_MAX_CHARS,
    printable=True,
    code="invalid_name",
    description="The worker's name, for operators (host and pid, say).",
)
DRAIN_WORKERS = Body(
    "DrainWorkers",
    (
        replace(
            WORKER_NAME,
            name="namePrefix",
            required=True,
            code="invalid_name_prefix",
            description="Drain every worker whose name starts with this.",
        ),
    ),
)

# The /work socket's frames (SPEC section 6): their ``type`` is checked before these.
FRAME_TYPE = Field("type", "string", required=True)
SUBSCRIBE_FRAME = Body(
    "SubscribeFrame",
    (
        FRAME_TYPE,
        Field(
            "queues",
            "list",
            required=True,
            min_length=1,
            max_length=limit("max_subscribe_queues"),
            item=Field("queue", "string", pattern="queue", code="invalid_queues"),
            code="invalid_queues",
            description="The queues to take items from.",
        ),
        Field(
            "capacity",
            "integer",
            required=True,
            minimum=0,
            maximum=limit("max_capacity"),
            code="invalid_capacity",
            description="Hold at most this many items at once.",
        ),
        WORKER_NAME,
        Field(
            "batch",
            "integer",
            minimum=1,
            maximum=limit("max_capacity"),
            code="invalid_batch",
            description="Optional (default 1): the server may push up to this many items in "
            "one items frame. With 1, every item comes in an item frame of its own.",
        ),
    ),
)
# Optional on the socket (SPEC section 6: the socket knows the lease it holds), but a worker
# that names the attempt it answers cannot have its fail or extend applied to a later attempt
# of the same item pushed to the same socket (see ``work.consumer``).
FRAME_LEASE = replace(
    LEASE,
    required=False,
    description=(
        "The lease of the item frame this answers. Optional; when given, a fail or extend "
        "for another lease than the one the socket holds is acked accepted: false."
    ),
)


def frame(body: Body) -> Body:
    """The socket frame of a REST body: ``type``, the item's ``id``, and the body's own
    fields, the same declarations (so the same bounds and error codes), with the lease
    optional (``FRAME_LEASE``)."""
    own = tuple(f for f in body.fields if f.name != "lease")
    return Body(f"{body.name}Frame", (FRAME_TYPE, ITEM_ID, *own, FRAME_LEASE))


RESULT_FRAME = frame(RESULT)
# Several results in one frame: each entry is a result frame without its type.
RESULT_ENTRY = Body("ResultEntry", (ITEM_ID, RESULT_VALUE, FRAME_LEASE))
RESULTS_FRAME = Body(
    "ResultsFrame",
    (
        FRAME_TYPE,
        Field(
            "results",
            "list",
            required=True,
            min_length=1,
            max_length=limit("max_capacity"),
            item=Field("result", "object", body=RESULT_ENTRY),
            code="invalid_results",
            description="Results, each as a result frame would carry it (id, result, lease "
            "optional); answered by one acks frame, in the same order.",
        ),
    ),
)
FAIL_FRAME = frame(FAIL)
EXTEND_FRAME = frame(EXTEND)
PROGRESS_FRAME = frame(PROGRESS)
FRAMES = {
    "subscribe": SUBSCRIBE_FRAME,
    "result": RESULT_FRAME,
    "results": RESULTS_FRAME,
    "fail": FAIL_FRAME,
    "extend": EXTEND_FRAME,
    "progress": PROGRESS_FRAME,
}
