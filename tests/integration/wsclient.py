"""A small websocket client for the socket tests (the `websockets` library, for real).

Every frame ``recv`` takes is checked against the server's message of its ``type`` in the
``/work`` AsyncAPI document (``taskhoster.asyncapi``), so the socket tests prove that what the
server sends is what the document says.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
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


async def subscribed(server: Any, key: str, n: int, queues: list[str], capacity: int) -> list[Any]:
    """``n`` sockets, each subscribed to ``queues`` with ``capacity``, once each subscription
    is in force (its ``PONG`` has come; the claim it made was handed to the committer)."""
    sockets = [await connect(server, key) for _ in range(n)]
    for ws in sockets:
        await subscribe(ws, queues, capacity)
        await ping(ws)
    for ws in sockets:
        await assert_nothing_before(ws, PONG)
    return sockets


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


# -- /metrics, as a test reads it over HTTP -------------------------------------------------------


def metric(http: Any, name: str, queue: str = "q") -> float:
    """A counter of ``/metrics`` for one queue (0 before it is first written)."""
    text = http.get("/metrics").text
    found = re.search(rf'^taskhoster_{name}_total{{queue="{queue}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for_metric(
    http: Any, name: str, value: float, queue: str = "q", within: float = 30
) -> None:
    """Until ``/metrics`` shows ``value`` for the counter (written behind the work, within a
    second or so); never more than it."""
    deadline = time.monotonic() + within
    while (seen := metric(http, name, queue)) != value:
        assert seen < value, f"{name}: {seen}, more than the expected {value}"
        assert time.monotonic() < deadline, f"{name}: {seen} after {within} s, not {value}"
        time.sleep(0.1)


def committed(http: Any, barrier: str = "barrier") -> None:
    """Return once all the server handed its committer before this call is committed (the
    claim a subscription made, say): a claim on a queue of its own is answered at its
    group's commit, which comes no earlier than theirs."""
    ensure_queue(http, barrier)
    assert http.post(f"/api/queues/{barrier}/claim", json={}).json()["items"] == []


def settled_metric(http: Any, name: str, queue: str = "q", barrier: str = "barrier") -> float:
    """``metric`` once all the server handed its committer before this call is counted in it.

    The committer counts each group after its commit and writes the counts out later (at most
    once a second, or when it idles), all that it has counted at once. So two claims on
    ``barrier`` (a queue no socket serves), the second made after the first was answered (a
    later group than the first and all before it): once the second shows, everything before
    the first does."""
    ensure_queue(http, barrier)
    base = metric(http, "claim_attempts", barrier)
    for _ in range(2):
        assert http.post(f"/api/queues/{barrier}/claim", json={}).json()["items"] == []
    deadline = time.monotonic() + 30
    while metric(http, "claim_attempts", barrier) < base + 2:
        assert time.monotonic() < deadline, "the barrier's claims were never counted"
        time.sleep(0.05)
    return metric(http, name, queue)


def ensure_queue(http: Any, name: str) -> None:
    """Create the queue with the defaults, unless it exists (its settings are left alone)."""
    if http.get(f"/api/queues/{name}").status_code == 404:
        make_queue(http, name)


# -- the admin, as a browser uses it ---------------------------------------------------------------


def admin_session(server: Any, username: str, password: str = "pw") -> Any:
    """An ``httpx.Client`` holding a browser's session with a real daphne's admin, logged in
    through the login form (CSRF cookie and token, as a browser sends them)."""
    import httpx

    browser = httpx.Client(base_url=server.url, timeout=30)
    login = "/admin/login/?next=/admin/"
    browser.get(login)
    answer = browser.post(
        login,
        data={
            "username": username,
            "password": password,
            "csrfmiddlewaretoken": browser.cookies["csrftoken"],
            "next": "/admin/",
        },
    )
    assert answer.status_code == 302, answer.text[:300]
    return browser
