"""What ``/api/schema`` says of each operation, from the declarations the server enforces.

Request bodies are ``contract``'s bodies and queue settings are ``engine.QUEUE_SETTINGS``,
turned into JSON Schema by ``schemas``; path and query parameters use the same patterns and
the limits of ``conf``. Each view names its operation with ``documented(...)``: its scopes,
the parameters it reads, its answers and the error codes each status can carry. The
``finish`` hook (``schema_view.SPECTACULAR``'s POSTPROCESSING_HOOKS) adds the shared components, the
error envelope and the links from the operations that create queues and items to those that
use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema

from .. import contract, schemas
from ..conf import get_conf
from ..engine import MAX_LIMIT, QUEUE_SETTINGS, Outcome, QueueSetting
from ..status import Status

F = TypeVar("F", bound=Callable[..., Any])

CURSOR = {
    "type": "string",
    "maxLength": 400,
    "pattern": "^[A-Za-z0-9_-]*$",
    "description": "The `next` of the previous page (opaque).",
}
TIME = {"type": "string", "format": "date-time"}
NULLABLE_TIME = {**TIME, "nullable": True}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _path(name: str, schema: dict[str, Any], description: str) -> OpenApiParameter:
    return OpenApiParameter(
        name, schema, location=OpenApiParameter.PATH, required=True, description=description
    )


def _query(name: str, schema: dict[str, Any], description: str) -> OpenApiParameter:
    return OpenApiParameter(name, schema, location=OpenApiParameter.QUERY, description=description)


def queue_param() -> OpenApiParameter:
    return _path(
        "queue", {"type": "string", "pattern": schemas.QUEUE_REGEX, "maxLength": 64}, "A queue."
    )


def item_param() -> OpenApiParameter:
    return _path("item_id", schemas.field_schema(contract.ITEM_ID), "An item.")


def worker_param() -> OpenApiParameter:
    return _path(
        "worker_id",
        {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "A worker socket (its id in GET /api/workers).",
    )


def thread_param() -> OpenApiParameter:
    return _path("thread_id", schemas.field_schema(contract.THREAD_ID), "A thread of the queue.")


def limit_param() -> OpenApiParameter:
    conf = get_conf()
    return _query(
        "limit",
        {"type": "integer", "minimum": 1, "maximum": conf.max_page_size},
        f"Page size (default {conf.page_size}).",
    )


def cursor_param() -> OpenApiParameter:
    return _query("cursor", CURSOR, "Continue after the previous page.")


def status_param() -> OpenApiParameter:
    return _query(
        "status", {"type": "string", "enum": [s.value for s in Status]}, "Only this status."
    )


def thread_filter_param() -> OpenApiParameter:
    return _query(
        "threadId", schemas.field_schema(contract.THREAD_ID), "Only this thread's members."
    )


def wait_param() -> OpenApiParameter:
    return _query(
        "wait",
        {"type": "number", "minimum": 0, "maximum": get_conf().max_wait_seconds},
        "Wait up to this many seconds for the item's verdict.",
    )


# -- errors ------------------------------------------------------------------------------

# Every operation with a key can answer these: 503 ``unavailable`` when the database does
# not answer, ``overloaded`` when every request thread is taken (``taskhoster.asgi``).
AUTH_ERRORS = {
    401: ["unauthorized"],
    403: ["forbidden"],
    503: ["overloaded", "unavailable"],
}
# ... and those that hand an operation to the committer, read an item's file or write a
# queue's definitions beside its items (a schedule's), these: the state root did not take
# a write or a flush (full, read-only), an item's file left by a failed flush is not yet
# written again, the committer stopped, or whether a commit whose connection was lost
# committed could not be learnt in time.
STORE_ERRORS = {503: ["store_error"]}
ERROR_TEXT = {
    400: "Invalid request",
    401: "Missing, malformed or revoked key",
    403: "The key lacks the scope, or may not use the queue",
    404: "Not found",
    409: "Conflict with the item's or queue's state",
    413: "Too large",
    415: "Not JSON",
    503: "Not now: the database did not answer, the state directories could not be written, "
    "or the server is overloaded (Retry-After says when to try again)",
}
BODY_ERRORS = {
    400: ["bad_json", "invalid_body", "unknown_field", "missing_field", "too_deep"],
    413: ["too_large"],
    415: ["unsupported_media_type"],
}


def _errors(codes: dict[int, list[str]]) -> dict[int, OpenApiResponse]:
    out: dict[int, OpenApiResponse] = {}
    for status, names in sorted(codes.items()):
        text = ERROR_TEXT.get(status, "Error")
        out[status] = OpenApiResponse(
            _ref("Error"), description=f"{text}. `error.code`: {', '.join(sorted(set(names)))}."
        )
    return out


def error_responses(codes: dict[int, list[str]]) -> dict[int, OpenApiResponse]:
    """The documented error answers of these statuses and codes (for ``annotate``)."""
    return _errors(codes)


def merge_errors(*tables: dict[int, list[str]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for table in tables:
        for status, names in table.items():
            out.setdefault(status, []).extend(names)
    return out


def annotate(**kwargs: Any) -> Callable[[F], F]:
    """``extend_schema`` over drf-spectacular's ``AutoSchema``, whatever the project's
    ``DEFAULT_SCHEMA_CLASS`` (``extend_schema`` would build on that, and DRF's own cannot
    make this document)."""

    def decorate(method: F) -> F:
        method.kwargs = {"schema": AutoSchema}  # type: ignore[attr-defined]
        return extend_schema(**kwargs)(method)

    return decorate


def documented(
    operation_id: str,
    *,
    summary: str,
    scopes: tuple[str, ...] = (),
    parameters: list[OpenApiParameter] | None = None,
    request: str | None = None,
    responses: dict[int, Any],
    errors: dict[int, list[str]] | None = None,
    body: bool = False,
    public: bool = False,
) -> Callable[[F], F]:
    """``extend_schema`` for one operation: ``responses`` maps a status to a component name
    (or None for no body); ``errors`` maps a status to the error codes it can carry."""
    answers: dict[int, Any] = {}
    for status, name in responses.items():
        answers[status] = (
            OpenApiResponse(description="No content")
            if name is None
            else OpenApiResponse(_ref(name), description=name)
        )
    if not public:
        answers |= _errors(merge_errors(AUTH_ERRORS, BODY_ERRORS if body else {}, errors or {}))
    elif errors:
        answers |= _errors(errors)
    # x-scopes: the scopes of which the key needs one (empty: any valid key will do).
    extensions = None if public else {"x-scopes": list(scopes)}
    description = None
    if scopes:
        description = f"Needs a key with the {' or '.join(f'`{s}`' for s in scopes)} scope."
    elif not public:
        description = "Needs a valid key (of any scope) that may use the queue."
    return annotate(
        operation_id=operation_id,
        tags=[TAGS.get(operation_id, "service")],
        summary=summary,
        description=description,
        parameters=parameters,
        request={"application/json": _ref(request)} if request else None,
        responses=answers,
        auth=[] if public else None,
        extensions=extensions,
    )


# The groups of operations (a generated client makes one module of each).
TAGS = {
    **dict.fromkeys(("listQueues", "getQueue", "putQueue", "deleteQueue"), "queues"),
    **dict.fromkeys(
        (
            "listItems",
            "postItems",
            "deleteItems",
            "getItem",
            "deleteItem",
            "restartItem",
            "cancelItem",
            "getAttempts",
        ),
        "items",
    ),
    **dict.fromkeys(
        ("claimItems", "submitResult", "failItem", "extendLease", "reportProgress"), "work"
    ),
    **dict.fromkeys(("listWorkers", "drainWorker", "drainWorkers"), "workers"),
    **dict.fromkeys(("listThreads", "getThread"), "threads"),
    **dict.fromkeys(("listSchedules", "getSchedule", "putSchedule", "deleteSchedule"), "schedules"),
}
QUEUE_ERRORS = {400: ["invalid_queue_name"], 404: ["queue_not_found"]}
WORKER_ERRORS = {400: ["invalid_worker_id"], 404: ["worker_not_found"]}
ATTEMPT_OUTCOMES = tuple(o.value for o in Outcome)
ITEM_ERRORS = {400: ["invalid_id"], 404: ["item_not_found"]}
SCHEDULE_ERRORS = {
    400: ["invalid_queue_name", "invalid_schedule_name"],
    404: ["queue_not_found", "schedule_not_found"],
}


def schedule_param() -> OpenApiParameter:
    return _path(
        "name",
        {"type": "string", "pattern": schemas.QUEUE_REGEX, "maxLength": 64},
        "A schedule of the queue.",
    )


# -- components ----------------------------------------------------------------------------


def _setting_schema(setting: QueueSetting) -> dict[str, Any]:
    if setting.kind == "rate":
        return {
            "type": "object",
            "nullable": True,
            "properties": {
                "count": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                "seconds": {
                    "type": "number",
                    "minimum": 0,
                    "exclusiveMinimum": True,
                    "maximum": 86400,
                },
            },
            "required": ["count", "seconds"],
            "additionalProperties": False,
            "description": "At most count claims start in any seconds, across every server "
            "process; null: no limit.",
        }
    if setting.kind == "queue":
        return {
            "type": "string",
            "pattern": schemas.QUEUE_REGEX,
            "maxLength": 64,
            "nullable": setting.nullable,
            "description": "An existing queue other than this one"
            + (", or null." if setting.nullable else "."),
        }
    spec = contract.Field(
        setting.wire,
        setting.kind,
        nullable=setting.nullable,
        minimum=setting.minimum,
        maximum=setting.maximum,
        exclusive_minimum=setting.exclusive_minimum,
        choices=setting.choices,
    )
    return schemas.field_schema(spec)


def _settings_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {s.wire: _setting_schema(s) for s in QUEUE_SETTINGS},
        "additionalProperties": False,
        "description": "Queue settings; those left out keep their value (or the default). "
        "backoffMaxSeconds must be at least backoffSeconds.",
    }


def _item_schema(*, claimed: bool = False) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "id": {"type": "string", "pattern": schemas.ID_REGEX},
        "queue": {"type": "string"},
        "status": {"type": "string", "enum": [s.value for s in Status]},
        "payload": {"description": "The work (left out of listings)."},
        "threadId": {"type": "string", "nullable": True},
        "priority": {"type": "integer", "minimum": 0, "maximum": contract.MAX_PRIORITY},
        "scheduledAt": TIME,
        "postedAt": TIME,
        "attempts": {"type": "integer", "minimum": 0},
        "leaseExpiresAt": NULLABLE_TIME,
        "finishedAt": NULLABLE_TIME,
        "result": {"description": "The result of a finished item (left out of listings)."},
        "error": {"type": "string", "nullable": True},
        "key": {"type": "string", "nullable": True},
        "schedule": {
            "type": "object",
            "description": "Set on an item a schedule posted (its key is schedule:<name>:<slot>).",
            "properties": {"name": {"type": "string"}, "slot": TIME},
            "required": ["name", "slot"],
        },
        "origin": {"description": "Where a dead-lettered copy came from."},
        "deadLetter": {"type": "string", "description": "The copy's id in the dead-letter queue."},
        "progress": {
            "nullable": True,
            "description": "The latest progress its worker reported while it was processing "
            "(any JSON); null until the current attempt reports some.",
        },
        "cancelReason": {
            "type": "string",
            "description": "The reason given when it was cancelled (set only then).",
        },
    }
    required = [
        "id",
        "queue",
        "status",
        "threadId",
        "priority",
        "scheduledAt",
        "postedAt",
        "attempts",
        "leaseExpiresAt",
        "finishedAt",
        "error",
        "key",
        "progress",
    ]
    if claimed:
        properties["lease"] = {"type": "string", "description": "Send it with fail and extend."}
        required = [*required, "payload", "lease"]
    return {"type": "object", "properties": properties, "required": required}


def _page(key: str, item: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            key: {"type": "array", "items": _ref(item)},
            "next": {**CURSOR, "nullable": True, "description": "The next page's cursor."},
        },
        "required": [key, "next"],
    }


def _schedule_schema() -> dict[str, Any]:
    settings = schemas.body_schema(contract.SCHEDULE)["properties"]
    nullable = {
        name: {**settings[name], "nullable": True}
        for name in ("cron", "every", "threadId", "priority")
    }
    properties = {
        "queue": {"type": "string", "pattern": schemas.QUEUE_REGEX},
        "name": {"type": "string", "pattern": schemas.QUEUE_REGEX},
        **settings,
        **nullable,
        "nextAt": {
            **NULLABLE_TIME,
            "description": "The next slot it posts; null while paused.",
        },
        "lastSlot": {**NULLABLE_TIME, "description": "The last slot it posted an item for."},
        "lastItem": {
            "type": "string",
            "nullable": True,
            "description": "That slot's item (it may be deleted by now).",
        },
        "createdAt": TIME,
        "updatedAt": TIME,
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def components() -> dict[str, Any]:
    thread: dict[str, Any] = {
        "type": "object",
        "properties": {
            "threadId": {"type": "string"},
            "memberCount": {"type": "integer", "minimum": 0},
            "head": {"type": "string", "nullable": True},
            "processing": {"type": "string", "nullable": True},
        },
        "required": ["threadId", "memberCount", "head", "processing"],
    }
    queue = _settings_schema()
    queue = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": schemas.QUEUE_REGEX},
            **queue["properties"],
            "counts": {
                "type": "object",
                "properties": {s.value: {"type": "integer"} for s in Status},
                "required": [s.value for s in Status],
            },
            "held": {
                "type": "object",
                "description": "Items waiting only because of a control (given by getQueue): "
                "due claimable items a pause, a full maxProcessing or a full rateLimit window "
                "holds back (under the first that applies), and due members of threads held "
                "back by threadLimit. Exact up to 10000.",
                "properties": {
                    k: {"type": "integer", "minimum": 0}
                    for k in ("paused", "maxProcessing", "rateLimit", "thread")
                },
                "required": ["paused", "maxProcessing", "rateLimit", "thread"],
            },
        },
        "required": ["name", *queue["properties"], "counts"],
    }
    return {
        "PostItem": schemas.body_schema(contract.POST_ITEM),
        "PostBatch": schemas.body_schema(contract.POST_BATCH),
        "PostItems": {"oneOf": [_ref("PostItem"), _ref("PostBatch")]},
        "Claim": schemas.body_schema(contract.CLAIM),
        "Result": schemas.body_schema(contract.RESULT),
        "Fail": schemas.body_schema(contract.FAIL),
        "Extend": schemas.body_schema(contract.EXTEND),
        "BulkDelete": schemas.body_schema(contract.BULK_DELETE),
        "Progress": schemas.body_schema(contract.PROGRESS),
        "Cancel": schemas.body_schema(contract.CANCEL),
        "DrainWorkers": schemas.body_schema(contract.DRAIN_WORKERS),
        "ScheduleSettings": schemas.body_schema(contract.SCHEDULE),
        "Schedule": _schedule_schema(),
        "SchedulePage": _page("schedules", "Schedule"),
        "Progressed": {
            "type": "object",
            "properties": {"accepted": {"type": "boolean"}},
            "required": ["accepted"],
        },
        "Attempt": {
            "type": "object",
            "properties": {
                "attempt": {"type": "integer", "minimum": 0},
                "claimedAt": NULLABLE_TIME,
                "worker": {
                    "type": "string",
                    "nullable": True,
                    "description": "The socket's name, or http for a REST claim.",
                },
                "endedAt": NULLABLE_TIME,
                "outcome": {
                    "type": "string",
                    "nullable": True,
                    "enum": [*ATTEMPT_OUTCOMES, None],
                    "description": "How it ended; null while it runs.",
                },
                "error": {"type": "string", "nullable": True},
            },
            "required": ["attempt", "claimedAt", "worker", "endedAt", "outcome", "error"],
        },
        "Attempts": {
            "type": "object",
            "properties": {
                "attempts": {"type": "array", "items": _ref("Attempt")},
                "omitted": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Attempts left out between the first and the latest.",
                },
            },
            "required": ["attempts", "omitted"],
        },
        "Worker": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "name": {"type": "string"},
                "queues": {"type": "array", "items": {"type": "string"}},
                "capacity": {"type": "integer", "minimum": 0},
                "held": {"type": "array", "items": {"type": "string"}},
                "draining": {"type": "boolean"},
                "connectedAt": TIME,
                "lastSeenAt": TIME,
            },
            "required": [
                "id",
                "name",
                "queues",
                "capacity",
                "held",
                "draining",
                "connectedAt",
                "lastSeenAt",
            ],
        },
        "WorkerList": {
            "type": "object",
            "properties": {"workers": {"type": "array", "items": _ref("Worker")}},
            "required": ["workers"],
        },
        "QueueSettings": _settings_schema(),
        "Queue": queue,
        "QueueList": {"type": "array", "items": _ref("Queue")},
        "Item": _item_schema(),
        "ClaimedItem": _item_schema(claimed=True),
        "ItemPage": _page("items", "Item"),
        "Posted": {
            "oneOf": [_ref("Item"), _ref("ItemBatch")],
            "description": "The item posted, or for a batch {items: [...]}.",
        },
        "ItemBatch": {
            "type": "object",
            "properties": {"items": {"type": "array", "items": _ref("Item")}},
            "required": ["items"],
        },
        "Claimed": {
            "type": "object",
            "properties": {"items": {"type": "array", "items": _ref("ClaimedItem")}},
            "required": ["items"],
        },
        "Verdict": {
            "type": "object",
            "properties": {
                "accepted": {"type": "boolean"},
                "status": {
                    "type": "string",
                    "enum": [s.value for s in Status],
                    "nullable": True,
                },
            },
            "required": ["accepted", "status"],
        },
        "Extended": {
            "type": "object",
            "properties": {"accepted": {"type": "boolean"}, "leaseExpiresAt": NULLABLE_TIME},
            "required": ["accepted", "leaseExpiresAt"],
        },
        "Deleted": {
            "type": "object",
            "properties": {"deleted": {"type": "integer", "minimum": 0}},
            "required": ["deleted"],
        },
        "Thread": thread,
        "ThreadPage": _page("threads", "Thread"),
        "ThreadDetail": {
            "type": "object",
            "properties": {
                **thread["properties"],
                "members": {"type": "array", "items": _ref("Item")},
                "next": {**CURSOR, "nullable": True},
            },
            "required": [*thread["required"], "members", "next"],
        },
        "Health": {
            "type": "object",
            "description": "Each dependency and whether it answered (see docs/deploy.md).",
            "properties": {
                "status": {"type": "string", "enum": ["ok", "unavailable"]},
            },
            "required": ["status"],
        },
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string", "description": "A stable, machine code."},
                        "message": {"type": "string", "description": "For people."},
                    },
                    "required": ["code", "message"],
                }
            },
            "required": ["error"],
        },
    }


# A body whose every field has a default: the request may leave the body out.
OPTIONAL_BODIES = {"Claim", "QueueSettings"}

# -- links ---------------------------------------------------------------------------------

QUEUE_USERS = ("getQueue", "listItems", "postItems", "claimItems", "deleteItems", "listThreads")
ITEM_USERS = (
    "getItem",
    "deleteItem",
    "restartItem",
    "submitResult",
    "cancelItem",
    "getAttempts",
)
HELD_ITEM_USERS = ("submitResult", "failItem", "extendLease")


def _links(schema: dict[str, Any]) -> None:
    def add(operation_id: str, statuses: tuple[str, ...], links: dict[str, Any]) -> None:
        for path in schema["paths"].values():
            for operation in path.values():
                if operation.get("operationId") != operation_id:
                    continue
                for status in statuses:
                    answer = operation["responses"].get(status)
                    if answer is not None:
                        answer["links"] = links

    add(
        "putQueue",
        ("200", "201"),
        {
            target: {"operationId": target, "parameters": {"queue": "$response.body#/name"}}
            for target in QUEUE_USERS
        },
    )
    item_links = {
        target: {"operationId": target, "parameters": {"item_id": "$response.body#/id"}}
        for target in ITEM_USERS
    }
    item_links["listThreadOfItem"] = {
        "operationId": "getThread",
        "parameters": {
            "queue": "$response.body#/queue",
            "thread_id": "$response.body#/threadId",
        },
    }
    add("postItems", ("200", "201"), item_links)
    add("getItem", ("200",), item_links)
    add(
        "claimItems",
        ("200",),
        {
            target: {
                "operationId": target,
                "parameters": {"item_id": "$response.body#/items/0/id"},
                **(
                    {"requestBody": {"lease": "$response.body#/items/0/lease"}}
                    if target != "submitResult"
                    else {}
                ),
            }
            for target in HELD_ITEM_USERS
        },
    )


def finish(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular post-processing: the shared components and the links."""
    result.setdefault("components", {}).setdefault("schemas", {}).update(components())
    for path in result["paths"].values():
        for operation in path.values():
            body = operation.get("requestBody")
            if body is not None:
                ref = body["content"]["application/json"]["schema"]["$ref"]
                body["required"] = ref.rsplit("/", 1)[1] not in OPTIONAL_BODIES
    _links(result)
    return result
