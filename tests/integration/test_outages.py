"""A shared part that does not answer: the server says which, and answers 503, never 500."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from ..conftest import Server
from .wsclient import connect, recv

pytestmark = pytest.mark.slow


def test_an_unreachable_database_gives_503_unavailable_and_healthz_names_it(state_root):
    state_root.mkdir()
    # Port 1: nothing listens, so every connection is refused at once.
    server = Server(
        state_root, DATABASE_URL="postgres://postgres@127.0.0.1:1/nowhere", TASKHOSTER_DB_POOL="0"
    )
    server.start(healthy=False)
    try:
        health = httpx.get(f"{server.url}/healthz", timeout=10)
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "unavailable"
        assert body["database"]["reachable"] is False
        assert body["stateRoot"]["reachable"] is True

        # No key can be judged without the database: the names are in the server's log.
        def log_says() -> bool:
            text = server.log.read_text()
            return "127.0.0.1" in text and "port 1" in text

        deadline = time.monotonic() + 15
        while not log_says() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert log_says(), "the log names the database that does not answer"
        headers = {"Authorization": "Token th_whatever"}
        for method, path, json in [
            ("POST", "/api/queues/q/items", {"payload": 1}),
            ("GET", "/api/queues", None),
            ("GET", "/api/items/01ARZ3NDEKTSV4RRFFQ69G5FAV", None),
        ]:
            answer = httpx.request(
                method, f"{server.url}{path}", json=json, headers=headers, timeout=10
            )
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["error"]["code"] == "unavailable"
            assert answer.headers.get("retry-after") == "1", path
    finally:
        server.stop()


def test_what_fails_after_a_groups_commit_does_not_undo_it(server_factory, make_key, state_root):
    """A group's announcement (its news, its counts written to the database) runs after its
    commit: its failure (the fault ``group.announce``: a metrics write meeting the database
    gone, say) is logged, and the post stays posted, its file on disk, answered 201; not
    rolled back on disk under a committed row, nor answered as failed."""
    server = server_factory(TASKHOSTER_FAULT="group.announce=1")
    headers = {"Authorization": f"Token {make_key()}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as http:
        assert http.put("/api/queues/q", json={}).status_code in (200, 201)
        answer = http.post("/api/queues/q/items", json={"payload": "kept"})
        assert answer.status_code == 201, answer.text
        item_id = answer.json()["id"]
        assert http.get(f"/api/items/{item_id}").json()["status"] == "pending"
        files = list(state_root.glob(f"**/pending/{item_id}*"))
        assert files, "the post's file is on disk"
        claimed = http.post("/api/queues/q/claim", json={"max": 1})
        assert claimed.status_code == 200, claimed.text
        assert [item["id"] for item in claimed.json()["items"]] == [item_id]
        assert claimed.json()["items"][0]["payload"] == "kept"


def test_a_work_socket_whose_key_cannot_be_judged_hears_unavailable_and_is_closed_4503(
    state_root,
):
    """The database away at a socket's connect: no key can be judged. The socket hears
    ``unavailable`` and is closed with 4503 (connect again later), as a REST call hears 503
    ``unavailable``; before, its handshake failed on the server's exception (logged with a
    traceback each time a worker tried)."""
    state_root.mkdir()
    server = Server(
        state_root, DATABASE_URL="postgres://postgres@127.0.0.1:1/nowhere", TASKHOSTER_DB_POOL="0"
    )
    server.start(healthy=False)
    try:

        async def run() -> tuple[dict[str, Any], int | None]:
            ws = await connect(server, "th_whatever")
            frame = await recv(ws, timeout=15)
            with pytest.raises(ConnectionClosed):
                await recv(ws, timeout=15)
            return frame, ws.close_code

        frame, code = asyncio.run(run())
        assert (frame["type"], frame["code"]) == ("error", "unavailable"), frame
        assert code == 4503
        assert "Traceback" not in server.log.read_text()
    finally:
        server.stop()
