"""The ``/work`` socket (SPEC section 6) as an AsyncAPI 3.0 document, made from the one source.

The frames a worker sends are ``contract.FRAMES``, the declarations the consumer validates
with; their JSON Schemas are made from those ``Body``s by ``schemas`` (as ``/api/schema``'s
bodies are), so the document
says what the server enforces, with the limits the settings give now. The frames the server
sends are declared once below, in the same vocabulary, from what the consumer sends
(``deliver`` pushes ``engine.item_json`` plus the lease; ``ack``, ``cancel`` and ``error``).
The close codes are the consumer's own constants.

Served at ``/api/asyncapi`` (no auth, like ``/api/schema``) and printed by
``manage.py asyncapi``; the socket tests check every frame the server sends against it.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from . import contract, engine, schemas
from .conf import get_conf
from .contract import Body, Field
from .status import Status
from .work import consumer

ASYNCAPI_VERSION = "3.0.0"
DEFAULT_HOST = "127.0.0.1:8000"


def field_schema(spec: Field, *, sent: bool = False) -> dict[str, Any]:
    """The JSON Schema (draft 7) of one field (``schemas``, shared with ``/api/schema``)."""
    return schemas.field_schema(spec, "jsonschema", sent=sent)


def body_schema(body: Body, *, frame_type: str | None = None, sent: bool = False) -> dict[str, Any]:
    """The JSON Schema (draft 7) of a body; for a frame, its ``type`` as a constant."""
    return schemas.body_schema(body, "jsonschema", sent=sent, frame_type=frame_type)


# -- what the server sends, declared once -------------------------------------------------------

_POSTED = {spec.name: spec for spec in contract.POST_ITEM.fields}
_SENT_TYPE = Field("type", "string", required=True)


def _always(spec: Field, **changes: Any) -> Field:
    """A contract field as the server always sends it."""
    return dataclasses.replace(spec, required=True, default=None, **changes)


ORIGIN = Body(
    "Origin",
    (
        Field("queue", "string", required=True, pattern="queue"),
        _always(contract.ITEM_ID, description="The dead item's id."),
        Field("error", "string", required=True, nullable=True),
        Field("attempts", "integer", required=True, minimum=0),
    ),
)
ITEM_SCHEDULE = Body(
    "ItemSchedule",
    (
        Field("name", "string", required=True, pattern="queue", description="The schedule."),
        Field("slot", "time", required=True, description="The slot the item was posted for."),
    ),
)
ITEM_FRAME = Body(
    "ItemFrame",
    (
        _SENT_TYPE,
        _always(contract.ITEM_ID),
        Field("queue", "string", required=True, pattern="queue", description="Its queue."),
        Field(
            "status",
            "choice",
            required=True,
            choices=(Status.PROCESSING.value,),
            description="Always processing: the socket holds it now.",
        ),
        _always(_POSTED["payload"]),
        _always(_POSTED["threadId"]),
        Field(
            "priority",
            "integer",
            required=True,
            minimum=0,
            maximum=contract.MAX_PRIORITY,
            description="Higher first among a queue's claimable items.",
        ),
        Field("scheduledAt", "time", required=True, description="When it became claimable."),
        Field("postedAt", "time", required=True),
        Field(
            "attempts",
            "integer",
            required=True,
            minimum=1,
            description="Claims so far, this one included.",
        ),
        Field("leaseExpiresAt", "time", required=True, description="When this lease lapses."),
        Field(
            "finishedAt",
            "time",
            required=True,
            nullable=True,
            description="Null: the item is not done.",
        ),
        _always(contract.ERROR_TEXT, description="The cause of the last re-queue, if any."),
        # (The server's keys include its schedules' slots, which a producer may not use.)
        _always(_POSTED["key"], pattern=None),
        Field(
            "schedule",
            "object",
            body=ITEM_SCHEDULE,
            description="Set on an item a schedule posted: its name and slot.",
        ),
        Field("origin", "object", body=ORIGIN, description="Set on a dead-letter copy."),
        Field(
            "progress",
            "json",
            required=True,
            nullable=True,
            description="Null: each attempt starts without progress (a progress frame sets it).",
        ),
        _always(contract.LEASE, description="The lease this socket now holds for the item."),
    ),
    description="An item pushed to the socket under a lease: the item as the REST API shows "
    "it (without result), plus its lease.",
)
ACK_FRAME = Body(
    "AckFrame",
    (
        _SENT_TYPE,
        _always(contract.ITEM_ID),
        Field("accepted", "boolean", required=True),
        Field(
            "status",
            "choice",
            choices=tuple(s.value for s in Status),
            description="After a result or fail: the item's status now (absent when the "
            "socket did not hold the item, or it no longer exists).",
        ),
        Field(
            "leaseExpiresAt",
            "time",
            nullable=True,
            description="After an extend the socket held: the new expiry; null if refused.",
        ),
    ),
    at_most_one_of=(("status", "leaseExpiresAt"),),
    description="The answer to one result, fail or extend, in the order they came.",
)
CANCEL_FRAME = Body(
    "CancelFrame",
    (
        _SENT_TYPE,
        _always(contract.ITEM_ID),
        Field(
            "reason",
            "choice",
            required=True,
            # "deleted" is what rule 9 (an item or its queue deleted) tells the holder;
            # "finished" ends a later attempt held here when an earlier one's result won.
            choices=("deleted", engine.TIMEOUT, Status.FINISHED.value, engine.CANCELLED),
            description="deleted (the item or its queue), timeout (queueSeconds passed), "
            "finished (a result for an earlier attempt of the item ended it), or cancelled "
            "(POST /api/items/{id}/cancel).",
        ),
        dataclasses.replace(
            contract.LEASE,
            required=False,
            description="The lease of the attempt to stop, when the cancel names one.",
        ),
    ),
    description="An item this socket holds is over; stop work on it (its slot is free now).",
)
ERROR_FRAME = Body(
    "ErrorFrame",
    (
        _SENT_TYPE,
        Field(
            "code",
            "string",
            required=True,
            min_length=1,
            description="What went wrong, e.g. unauthorized, forbidden, bad_json, unknown_type, "
            "unknown_field, missing_field, invalid_capacity, invalid_lease, queue_not_found, "
            "item_not_found, too_large, unavailable (the database did not answer, or the "
            "state root took no write: nothing was done; send the frame again, or, in answer "
            "to a connect or a subscribe, connect again later), internal.",
        ),
        Field("message", "string", required=True, description="For people."),
        dataclasses.replace(contract.ITEM_ID, required=False, description="The frame's item."),
    ),
    description="A frame the server could not take (in place of its ack); the socket stays "
    "open, except after 'internal' (closed with 4500), on connect without a valid key (4401, "
    "or 4403 without the work scope), and after 'unavailable' in answer to a connect or a "
    "subscribe, whose key or queues could not be looked up (4503: connect again later).",
)
DRAIN_FRAME = Body(
    "DrainFrame",
    (_SENT_TYPE,),
    description="An operator drained this socket (POST /api/workers/{id}/drain): nothing more "
    "is pushed to it; finish what it holds, answer it, then close.",
)
ITEMS_FRAME = Body(
    "ItemsFrame",
    (
        _SENT_TYPE,
        Field(
            "items",
            "list",
            required=True,
            min_length=1,
            item=Field(
                "item",
                "object",
                body=Body(
                    "ItemEntry",
                    tuple(f for f in ITEM_FRAME.fields if f.name != "type"),
                    description="An item frame without its type.",
                ),
            ),
        ),
    ),
    description="Several items pushed at once, to a socket that subscribed with a batch over "
    "1: each as an item frame would carry it, at most batch of them, each under its own lease.",
)
ACK_ERROR = Body(
    "AckError",
    (
        Field("code", "string", required=True, min_length=1, description="As an error frame's."),
        Field("message", "string", required=True, description="For people."),
    ),
)
ACKS_FRAME = Body(
    "AcksFrame",
    (
        _SENT_TYPE,
        Field(
            "acks",
            "list",
            required=True,
            min_length=1,
            item=Field(
                "ack",
                "object",
                body=Body(
                    "AckEntry",
                    (
                        _always(contract.ITEM_ID),
                        Field("accepted", "boolean", required=True),
                        next(f for f in ACK_FRAME.fields if f.name == "status"),
                        Field(
                            "error",
                            "object",
                            body=ACK_ERROR,
                            description="Where a lone result frame would have been answered "
                            "with an error frame (item_not_found, say): that error, with "
                            "accepted false.",
                        ),
                    ),
                    at_most_one_of=(("status", "error"),),
                    description="An ack frame without its type, or an error in its place.",
                ),
            ),
        ),
    ),
    description="The answer to a results frame: one entry per result, in their order.",
)
SENT_FRAMES = {
    "item": ITEM_FRAME,
    "items": ITEMS_FRAME,
    "ack": ACK_FRAME,
    "acks": ACKS_FRAME,
    "cancel": CANCEL_FRAME,
    "drain": DRAIN_FRAME,
    "error": ERROR_FRAME,
}

SUMMARIES = {
    "subscribe": "Serve these queues, holding at most capacity items at once; sent again, it "
    "replaces the last.",
    "result": "Hand back an item's result (accepted unless the item is already terminal).",
    "results": "Hand back several results at once (each as a result frame would); one acks "
    "frame answers them, in order.",
    "fail": "Say the work failed: retried after a backoff, or (retry false) the item dies.",
    "extend": "Keep the lease alive: by seconds, at most the queue's leaseSeconds.",
    "progress": "Report progress on a held item (any JSON up to 4 KiB; the lease is not "
    "extended); GET /api/items/{id} shows the latest.",
    "drain": "Take nothing more: finish what this socket holds, then close.",
    "item": "An item for this socket to work on, pushed while it holds fewer than capacity.",
    "ack": "The answer to a result, fail, extend or progress.",
    "items": "Several items at once, for a socket that subscribed with a batch over 1.",
    "acks": "The answer to a results frame: an ack per result, in order.",
    "cancel": "Stop work on an item: it was deleted, timed out, cancelled or finished by "
    "another attempt.",
    "error": "A frame the server could not take.",
}
EXAMPLES: dict[str, dict[str, Any]] = {
    "subscribe": {"type": "subscribe", "queues": ["emails"], "capacity": 4, "name": "web-1:4242"},
    "result": {"type": "result", "id": "0641f3a0c2b1d4e5f6a7b8", "result": {"sent": True}},
    "results": {
        "type": "results",
        "results": [
            {"id": "0641f3a0c2b1d4e5f6a7b8", "result": {"sent": True}},
            {"id": "0641f3a0c2b1d4e5f6a7b9", "result": {"sent": False}},
        ],
    },
    "fail": {"type": "fail", "id": "0641f3a0c2b1d4e5f6a7b8", "error": "smtp down", "retry": True},
    "extend": {"type": "extend", "id": "0641f3a0c2b1d4e5f6a7b8", "seconds": 30},
    "progress": {"type": "progress", "id": "0641f3a0c2b1d4e5f6a7b8", "progress": {"done": 40}},
    "drain": {"type": "drain"},
    "item": {
        "type": "item",
        "id": "0641f3a0c2b1d4e5f6a7b8",
        "queue": "emails",
        "status": "processing",
        "payload": {"to": "ada@example.com"},
        "threadId": None,
        "priority": 0,
        "scheduledAt": "2026-01-31T12:00:00.000000Z",
        "postedAt": "2026-01-31T12:00:00.000000Z",
        "attempts": 1,
        "leaseExpiresAt": "2026-01-31T12:01:00.000000Z",
        "finishedAt": None,
        "error": None,
        "key": None,
        "progress": None,
        "lease": "Jq3k1n0sYvB2h4W8xZ7c5A",
    },
    "ack": {"type": "ack", "id": "0641f3a0c2b1d4e5f6a7b8", "accepted": True, "status": "finished"},
    "acks": {
        "type": "acks",
        "acks": [
            {"id": "0641f3a0c2b1d4e5f6a7b8", "accepted": True, "status": "finished"},
            {
                "id": "0641f3a0c2b1d4e5f6a7b9",
                "accepted": False,
                "error": {"code": "item_not_found", "message": "no such item"},
            },
        ],
    },
    "cancel": {"type": "cancel", "id": "0641f3a0c2b1d4e5f6a7b8", "reason": "deleted"},
    "error": {"type": "error", "code": "unknown_type", "message": "unknown frame type 'hello'"},
}


# An items frame's example: the item frame's example, as an entry (without its type).
EXAMPLES["items"] = {
    "type": "items",
    "items": [{k: v for k, v in EXAMPLES["item"].items() if k != "type"}],
}


def frame_schemas() -> dict[str, dict[str, Any]]:
    """Every frame type's JSON Schema, keyed by ``type``: the worker's, then the server's."""
    schemas = {kind: body_schema(body, frame_type=kind) for kind, body in contract.FRAMES.items()}
    schemas.update(
        {kind: body_schema(body, frame_type=kind, sent=True) for kind, body in SENT_FRAMES.items()}
    )
    return schemas


# -- the document -------------------------------------------------------------------------------


def close_codes() -> dict[int, str]:
    """The codes the server closes a socket with (the consumer's constants), and when."""
    return {
        consumer.CLOSE_UNAUTHORIZED: "no key, or not a valid one (after an `error` frame, "
        "code `unauthorized`)",
        consumer.CLOSE_FORBIDDEN: "the key lacks the `work` scope (after an `error` frame, "
        "code `forbidden`)",
        consumer.CLOSE_ABUSE: f"more than {consumer.ABUSE_ERRORS} `error` frames within "
        f"{consumer.ABUSE_WINDOW_SECONDS:g} s",
        consumer.CLOSE_SERVER_ERROR: "the server failed on a frame (after an `error` frame, "
        "code `internal`); reconnect",
    }


def _description() -> str:
    conf = get_conf()
    table = "\n".join(f"| {code} | {when} |" for code, when in close_codes().items())
    return f"""\
A worker holds a WebSocket at `/work`, one JSON object per text frame, and gets items pushed
to it under a lease (SPEC section 6).

**Auth.** Send `Authorization: Token <key>` when opening the socket; the key needs the `work`
scope, and a key limited to some queues may subscribe to those only. A socket without an
`Origin` header is accepted: the token is the authentication.

**Order.** Every result, fail and extend is answered by one `ack`, or an `error` in its place,
in the order the frames came. `subscribe` is not acked; a refused one gets an `error`.

**Several at once (optional).** A `results` frame carries several results; one `acks` frame
answers it, an entry per result in order (an entry that a lone `result` would have had
answered by an `error` frame says `accepted: false` with that `error`). A bad entry refuses
the whole frame with one `error` and changes nothing. A socket that subscribes with
`batch` over 1 may get `items` frames of up to that many items instead of `item` frames;
without `batch`, every item comes alone, as ever. A frame of either kind is at most the
frame limit below.

**Closing.** However the socket closes, everything it still holds is re-queued at once;
results and fails sent before the close still count. Close codes the server uses (also in the
channel's `x-close-codes`):

| code | when |
|---|---|
{table}

**Limits now.** capacity at most {conf.max_capacity}; a payload or result at most
{conf.max_payload_bytes} bytes of JSON; a frame at most {contract.max_frame_bytes()} bytes.
"""


def _ref(*path: str) -> dict[str, str]:
    return {"$ref": "#/" + "/".join(path)}


def build_document(*, host: str = DEFAULT_HOST, protocol: str = "ws") -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the ``/work`` socket, with the limits the settings give."""
    schemas = frame_schemas()
    sent = set(SENT_FRAMES)
    messages = {
        kind: {
            "name": kind,
            "title": f"{kind} frame",
            "summary": SUMMARIES[kind],
            "contentType": "application/json",
            "payload": _ref("components", "schemas", schemas[kind]["title"]),
            "examples": [{"name": kind, "payload": EXAMPLES[kind]}],
        }
        for kind in schemas
    }
    answers = [_ref("channels", "work", "messages", kind) for kind in ("ack", "error")]
    operations: dict[str, Any] = {}
    for kind in schemas:
        operation: dict[str, Any] = {
            "action": "send" if kind in sent else "receive",
            "channel": _ref("channels", "work"),
            "summary": SUMMARIES[kind],
            "messages": [_ref("channels", "work", "messages", kind)],
        }
        if kind in ("result", "fail", "extend", "progress"):
            operation["reply"] = {"channel": _ref("channels", "work"), "messages": answers}
        if kind == "results":
            operation["reply"] = {
                "channel": _ref("channels", "work"),
                "messages": [_ref("channels", "work", "messages", k) for k in ("acks", "error")],
            }
        operations[("send" if kind in sent else "receive") + kind.capitalize()] = operation
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "Taskhoster /work socket",
            "version": _version(),
            "description": _description(),
        },
        "defaultContentType": "application/json",
        "servers": {
            "taskhoster": {
                "host": host,
                "protocol": protocol,
                "description": "A Taskhoster server (any of its processes).",
                "security": [_ref("components", "securitySchemes", "token")],
            }
        },
        "channels": {
            "work": {
                "address": "/work",
                "title": "The worker socket",
                "x-close-codes": {str(code): when for code, when in close_codes().items()},
                "messages": {kind: _ref("components", "messages", kind) for kind in schemas},
                "bindings": {
                    "ws": {
                        "method": "GET",
                        "headers": {
                            "type": "object",
                            "properties": {
                                "Authorization": {
                                    "type": "string",
                                    "pattern": r"^\s*[Tt][Oo][Kk][Ee][Nn]\s+\S+\s*$",
                                    "description": "Token <key>; the key needs the work scope.",
                                }
                            },
                            "required": ["Authorization"],
                        },
                        "bindingVersion": "0.1.0",
                    }
                },
            }
        },
        "operations": operations,
        "components": {
            "schemas": {schema["title"]: schema for schema in schemas.values()},
            "messages": messages,
            "securitySchemes": {
                "token": {
                    "type": "httpApiKey",
                    "name": "Authorization",
                    "in": "header",
                    "description": "`Authorization: Token <key>`; the key needs the `work` "
                    "scope (4401 without a valid key, 4403 without the scope).",
                }
            },
        },
    }


def _version() -> str:
    try:
        return metadata.version("taskhoster")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def public_host(request: HttpRequest) -> str:
    """The host to name in links: the request's ``Host`` when ``ALLOWED_HOSTS`` names the
    hosts it may be (Django checks it); with ``ALLOWED_HOSTS = ["*"]`` any ``Host`` passes,
    so the address the server answers on is named instead (never a header echoed back into
    a document a client trusts)."""
    if "*" not in settings.ALLOWED_HOSTS:
        return request.get_host()
    name = str(request.META.get("SERVER_NAME") or "localhost")
    port = str(request.META.get("SERVER_PORT") or "")
    default = "443" if request.is_secure() else "80"
    return name if port in ("", default) else f"{name}:{port}"


@require_GET
def asyncapi_view(request: HttpRequest) -> HttpResponse:
    """``GET /api/asyncapi``: the document, naming the server it was asked of."""
    document = build_document(
        host=public_host(request), protocol="wss" if request.is_secure() else "ws"
    )
    return JsonResponse(document)
