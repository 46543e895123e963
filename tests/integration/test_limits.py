"""Limits come from the settings, and REST and the socket hold an operation to the same rules.

A real daphne runs with every limit lowered (``limits_settings``); requests at each limit are
served and requests one past it refused, over REST and over the ``/work`` socket, and the
served OpenAPI and AsyncAPI documents state the same figures. Then the same bad values, sent
as a REST body and as a socket frame, are refused with the same error code."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from taskhoster.contract import ERROR_MAX_CHARS, MAX_LEASE_SECONDS

from .wsclient import (
    PONG,
    assert_nothing_before,
    connect,
    make_queue,
    ping,
    post,
    recv,
    send,
    settled_metric,
    subscribe,
)

pytestmark = pytest.mark.slow

LIMITS = {
    "MAX_PAYLOAD_BYTES": 2000,
    "MAX_BATCH": 3,
    "MAX_CLAIM": 2,
    "MAX_WAIT_SECONDS": 2,
    "MAX_CAPACITY": 3,
    "MAX_SUBSCRIBE_QUEUES": 2,
    "MAX_DELETE_IDS": 2,
    "PAGE_SIZE": 2,
    "MAX_PAGE_SIZE": 4,
}


@pytest.fixture
def server(server_factory):
    return server_factory(
        DJANGO_SETTINGS_MODULE="tests.integration.limits_settings",
        TASKHOSTER_TEST_LIMITS=json.dumps(LIMITS),
    )


def code_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def string_of_json_bytes(size: int) -> str:
    """A string whose compact JSON is ``size`` bytes."""
    return "x" * (size - 2)


def test_every_rest_limit_comes_from_the_servers_settings(http):
    make_queue(http, "q")
    items = [{"payload": n} for n in range(3)]
    assert http.post("/api/queues/q/items", json={"items": items}).status_code == 201
    too_many = {"items": [*items, {"payload": 3}]}
    assert code_of(http.post("/api/queues/q/items", json=too_many)) == (413, "batch_too_large")

    at_limit = string_of_json_bytes(2000)
    assert http.post("/api/queues/q/items", json={"payload": at_limit}).status_code == 201
    over = {"payload": at_limit + "x"}
    assert code_of(http.post("/api/queues/q/items", json=over)) == (413, "too_large")

    page = http.get("/api/queues/q/items").json()
    assert len(page["items"]) == 2
    assert page["next"]
    assert len(http.get("/api/queues/q/items?limit=4").json()["items"]) == 4
    assert code_of(http.get("/api/queues/q/items?limit=5")) == (400, "invalid_limit")

    first = page["items"][0]["id"]
    assert code_of(http.get(f"/api/items/{first}?wait=2.5")) == (400, "invalid_wait")
    assert http.get(f"/api/items/{first}?wait=0").status_code == 200

    assert code_of(http.post("/api/queues/q/claim", json={"max": 3}))[0] == 400
    assert code_of(http.post("/api/queues/q/claim", json={"wait": 2.5}))[0] == 400
    claimed = http.post("/api/queues/q/claim", json={"max": 2, "wait": 2}).json()["items"]
    assert len(claimed) == 2

    ids = [i["id"] for i in http.get("/api/queues/q/items?limit=4").json()["items"]]
    three = {"ids": ids[:3]}
    assert code_of(http.post("/api/queues/q/items/delete", json=three))[0] == 400
    two = {"ids": ids[:2]}
    assert http.post("/api/queues/q/items/delete", json=two).json() == {"deleted": 2}


def test_every_socket_limit_comes_from_the_servers_settings(server, http, key):
    for name in ("a", "b", "c"):
        make_queue(http, name)

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["a"], 4)
        assert (await recv(ws))["code"] == "invalid_capacity"
        await subscribe(ws, ["a", "b", "c"], 1)
        assert (await recv(ws))["code"] == "invalid_queues"
        await subscribe(ws, ["a", "b"], 3)
        await ping(ws)
        # Taken: no error. And the claims it made (finding nothing) went to the committer
        # before the ping was answered: ``before`` counts them.
        await assert_nothing_before(ws, PONG)
        # Three items for three free slots: one claim takes at most MAX_CLAIM (2), so the
        # dispatcher makes two (it made one of 3 when the cap was a constant 100).
        before = settled_metric(http, "claim_attempts", "a", barrier="c")
        batch = [{"payload": n} for n in range(3)]
        answer = http.post("/api/queues/a/items", json={"items": batch}).json()
        pushed = [await recv(ws) for _ in range(3)]
        assert {f["id"] for f in pushed} == {i["id"] for i in answer["items"]}
        # The socket is full now: no claim for a can come after the pushes.
        assert settled_metric(http, "claim_attempts", "a", barrier="c") - before == 2
        result = {"type": "result", "id": pushed[0]["id"], "result": "x" * 1999}
        await send(ws, result)
        assert (await recv(ws))["code"] == "too_large"
        await send(ws, {**result, "result": "x" * 1998})
        assert (await recv(ws))["accepted"] is True
        await ws.close()

    asyncio.run(run())


def test_served_documents_state_the_servers_limits(http):
    asyncapi = http.get("/api/asyncapi").json()["components"]["schemas"]
    subscribe_frame = next(s for s in asyncapi.values() if s.get("title") == "SubscribeFrame")
    assert subscribe_frame["properties"]["capacity"]["maximum"] == 3
    assert subscribe_frame["properties"]["queues"]["maxItems"] == 2
    openapi = http.get("/api/schema?format=json").json()["components"]["schemas"]
    assert openapi["Claim"]["properties"]["max"]["maximum"] == 2
    assert openapi["Claim"]["properties"]["wait"]["maximum"] == 2
    assert openapi["BulkDelete"]["properties"]["ids"]["maxItems"] == 2


BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    # (operation, fields, code): the same fields as a REST body and as a socket frame
    ("extend", {"seconds": MAX_LEASE_SECONDS + 1}, "invalid_seconds"),
    ("extend", {"seconds": 0}, "invalid_seconds"),
    ("extend", {"seconds": "10"}, "invalid_seconds"),
    ("extend", {"lease": ""}, "invalid_lease"),
    ("extend", {"leaseSeconds": 5}, "unknown_field"),
    ("fail", {"lease": "x" * 65}, "invalid_lease"),
    ("fail", {"lease": 7}, "invalid_lease"),
    ("fail", {"error": "x" * (ERROR_MAX_CHARS + 1)}, "invalid_error"),
    ("fail", {"error": {"why": 1}}, "invalid_error"),
    ("fail", {"retry": "no"}, "invalid_retry"),
    ("fail", {"bogus": 1}, "unknown_field"),
    ("result", {"result": "x" * 1999}, "too_large"),
    ("result", {"results": 1}, "unknown_field"),
]
BASE: dict[str, dict[str, Any]] = {
    "result": {"result": 1},
    "fail": {"lease": "a-lease"},
    "extend": {"lease": "a-lease"},
}


def test_rest_and_socket_refuse_the_same_bad_values_with_the_same_code(server, http, key):
    make_queue(http, "q")
    item = post(http, "work")
    rest = {}
    for operation, fields, _code in BAD_VALUES:
        body = {**BASE[operation], **fields}
        response = http.post(f"/api/items/{item}/{operation}", json=body)
        rest[(operation, json.dumps(fields))] = code_of(response)
    for bad_id in ("not an id", "x" * 65):
        response = http.post(f"/api/items/{bad_id}/extend", json={"lease": "a-lease"})
        rest[("extend", bad_id)] = code_of(response)

    async def run():
        ws = await connect(server, key)
        socket = {}
        for operation, fields, _code in BAD_VALUES:
            base = BASE[operation] if operation == "result" else {}
            await send(ws, {"type": operation, "id": item, **base, **fields})
            socket[(operation, json.dumps(fields))] = (await recv(ws))["code"]
        for bad_id in ("not an id", "x" * 65):
            await send(ws, {"type": "extend", "id": bad_id})
            socket[("extend", bad_id)] = (await recv(ws))["code"]
        await ws.close()
        return socket

    socket = asyncio.run(run())
    for operation, fields, code in BAD_VALUES:
        case = (operation, json.dumps(fields))
        status = 413 if code == "too_large" else 400
        assert rest[case] == (status, code), case
        assert socket[case] == code, case
    for bad_id in ("not an id", "x" * 65):
        assert rest[("extend", bad_id)] == (400, "invalid_id")
        assert socket[("extend", bad_id)] == "invalid_id"
    assert http.get(f"/api/items/{item}").json()["status"] == "pending"  # nothing changed
