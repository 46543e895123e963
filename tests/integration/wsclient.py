"""A small websocket client for the socket tests (the `websockets` library, for real).

Every frame ``recv`` takes is checked against the server's message of its ``type`` in the
``/work`` AsyncAPI document (``taskhoster.asyncapi``), so the socket tests prove that what the
server sends is what the document says.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

import websockets
from jsonschema import Draft7Validator
from jsonschema.exceptions import best_match


def ws_url(server: Any) -> str:
    return server.url.replace("http://", "ws://") + "/work"


async def connect(server: Any, key: str | None) -> Any:
    headers = {"Authorization": f"Token {key}"} if key else {}
    return await websockets.connect(
        ws_url(server), additional_headers=headers, max_size=8 * 1024 * 1024
    )


async def send(ws: Any, frame: dict[str, Any]) -> None:
    await ws.send(json.dumps(frame))


async def recv(ws: Any, timeout: float = 5.0) -> dict[str, Any]:
    """The next frame, checked against the AsyncAPI document (``check_frame``)."""
    frame = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    check_frame(frame)
    return dict(frame)


def sent_message_validators(document: dict[str, Any]) -> dict[str, Draft7Validator]:
    """A validator per frame type the server sends, by ``type``: the messages of the
    document's ``send`` operations, their payloads followed to ``components``."""
    validators = {}
    for operation in document["operations"].values():
        if operation["action"] != "send":
            continue
        for ref in operation["messages"]:
            message = _follow(document, _follow(document, ref))
            payload = _follow(document, message["payload"])
            Draft7Validator.check_schema(payload)
            validators[payload["properties"]["type"]["const"]] = Draft7Validator(payload)
    return validators


def _follow(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """``node``, or what its local ``$ref`` points at."""
    if "$ref" not in node:
        return node
    for part in node["$ref"].removeprefix("#/").split("/"):
        document = document[part]
    return document


@functools.cache
def _validators() -> dict[str, Draft7Validator]:
    from taskhoster.asyncapi import build_document

    return sent_message_validators(build_document())


def check_frame(frame: Any, validators: dict[str, Draft7Validator] | None = None) -> None:
    """AssertionError unless ``frame`` is a message the server may send, as documented."""
    validators = _validators() if validators is None else validators
    kind = frame.get("type") if isinstance(frame, dict) else None
    if kind not in validators:
        raise AssertionError(f"frame {frame!r}: the server sends no message of type {kind!r}")
    error = best_match(validators[kind].iter_errors(frame))
    if error is not None:
        raise AssertionError(
            f"frame {frame!r} does not match the AsyncAPI {kind!r} message: "
            f"{error.message} (at {error.json_path})"
        )


# An id no item has: an ``extend`` for it is answered at once, changing nothing.
PING_ID = "ping-no-such-item"
PONG = {"type": "ack", "id": PING_ID, "accepted": False}


async def ping(ws: Any) -> None:
    """Send a frame the socket answers with ``PONG`` and nothing else: an ``extend`` of an
    item it does not hold. Frames are answered in the order they come, so ``PONG`` comes
    after the answers (acks, errors) of every frame sent before the ping, and after every
    frame the server sent before it handled the ping. Not after what a commit still under
    way will make it send (an item a claim in flight takes): ``ping_committer`` for that."""
    await send(ws, {"type": "extend", "id": PING_ID})


COMMITTER_PONG = {
    "type": "error",
    "code": "item_not_found",
    "message": f"item {PING_ID!r} does not exist",
    "id": PING_ID,
}


async def ping_committer(ws: Any) -> None:
    """A ping answered (``COMMITTER_PONG``) only once the server's committer has answered
    all it was handed before: a ``result`` for an item that does not exist. So what earlier
    commits made the server send (an item a claim took for a free slot, a cancel) comes
    first. Unlike ``ping``, the socket then looks for work for its free slots (a claim)."""
    await send(ws, {"type": "result", "id": PING_ID, "result": None})


async def assert_nothing_before(
    ws: Any, marker: dict[str, Any] | Callable[[dict[str, Any]], bool], timeout: float = 30.0
) -> dict[str, Any]:
    """The next frame, asserted to be ``marker`` (a frame, or a predicate on one).

    The marker is something the server sends after whatever would have caused an unwanted
    frame (a ``PONG``, the item of a post made later, ...): an unwanted frame would come
    first, and fail this, however slow the machine. Decided by order, not by a clock (the
    generous ``timeout`` only bounds a marker that never comes)."""
    frame = await recv(ws, timeout)
    matches = marker(frame) if callable(marker) else frame == marker
    assert matches, f"unexpected frame {frame!r} before the marker"
    return frame


def item_of(item_id: str) -> Callable[[dict[str, Any]], bool]:
    """A marker: the item frame of ``item_id``."""
    return lambda frame: frame.get("type") == "item" and frame.get("id") == item_id


async def subscribe(ws: Any, queues: list[str], capacity: int) -> None:
    await send(ws, {"type": "subscribe", "queues": queues, "capacity": capacity})


def make_queue(http: Any, name: str = "q", **settings: Any) -> None:
    """Create (or update) a queue over REST with an ``httpx.Client`` holding a key."""
    assert http.put(f"/api/queues/{name}", json=settings).status_code in (200, 201)


def post(http: Any, payload: Any, queue: str = "q", **extra: Any) -> str:
    """Post one item over REST; its id."""
    response = http.post(f"/api/queues/{queue}/items", json={"payload": payload, **extra})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def status_of(http: Any, item_id: str) -> dict[str, Any]:
    """The item as ``GET /api/items/{id}`` shows it."""
    return dict(http.get(f"/api/items/{item_id}").json())
