"""However a /work socket ends, it ends once: its items go back at once, and it is never dealt
to again (issue 13).

Each test arms one fault in a real daphne (``TASKHOSTER_FAULT``): a send that fails inside
the closing handshake, for each frame the server sends, or an exception inside each frame
handler. Then it checks, with a real websocket client, that the socket's held items are
pending at once with their attempts unchanged, that new items reach another socket at once
and none is left processing with no worker, and that ``/metrics`` shows only live sockets.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
import pytest
import websockets

from .wsclient import connect, recv, send, subscribe

pytestmark = pytest.mark.slow


def _client(server, key):
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=10)


def _post(http, payload, queue="q"):
    response = http.post(f"/api/queues/{queue}/items", json={"payload": payload})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _item(http, item_id):
    return http.get(f"/api/items/{item_id}").json()


def _counts(http):
    return http.get("/api/queues/q").json()["counts"]


def _wait(condition, timeout=3.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _gauges(http):
    text = http.get("/metrics").text
    sockets = sum(
        float(v) for v in re.findall(r"^taskhoster_sockets_open\{[^}]*\} (\S+)$", text, re.M)
    )
    held = sum(
        float(v) for v in re.findall(r"^taskhoster_socket_held_items\{[^}]*\} (\S+)$", text, re.M)
    )
    return sockets, held


async def _take(ws, n):
    """Receive ``n`` item frames (other frames are skipped)."""
    items: list[dict[str, Any]] = []
    while len(items) < n:
        frame = await recv(ws, 5)
        if frame["type"] == "item":
            items.append(frame)
    return items


async def _until_closed(ws):
    """Read what is left until the server closes; return the frames and the close code."""
    frames = []
    try:
        while True:
            frames.append(await recv(ws, 5))
    except websockets.ConnectionClosed as closed:
        return frames, closed.rcvd.code if closed.rcvd else None


async def _victim_holding_two(server, key, http, capacity=2):
    """A socket that holds two items, attempts 1 each."""
    ws = await connect(server, key)
    await subscribe(ws, ["q"], capacity)
    ids = [_post(http, n) for n in range(2)]
    items = await _take(ws, 2)
    assert [i["id"] for i in items] == ids
    assert all(i["attempts"] == 1 for i in items)
    return ws, ids


async def _another_socket_gets_everything(server, key, http, pending_ids):
    """The items the dead socket held, and new ones, all reach a fresh socket at once, and
    nothing is processing that this socket does not hold."""
    other = await connect(server, key)
    await subscribe(other, ["q"], 10)
    old = await _take(other, len(pending_ids))
    assert sorted(i["id"] for i in old) == sorted(pending_ids)
    assert all(i["attempts"] == 2 for i in old), old  # one for the dead socket, one for this
    started = time.monotonic()
    new_ids = [_post(http, f"new {n}") for n in range(3)]
    new = await _take(other, 3)
    assert [i["id"] for i in new] == new_ids
    assert all(i["attempts"] == 1 for i in new)
    assert time.monotonic() - started < 3
    assert _counts(http)["processing"] == len(pending_ids) + 3
    _wait(lambda: _gauges(http) == (1, len(pending_ids) + 3), what="gauges of the live socket")
    await other.close()
    _wait(lambda: _counts(http)["processing"] == 0, what="the fresh socket's items re-queued")


def _held_items_pending_at_once(http, ids):
    _wait(
        lambda: all(_item(http, i)["status"] == "pending" for i in ids),
        timeout=2,
        what="the dead socket's items back in pending",
    )
    for item_id in ids:
        item = _item(http, item_id)
        assert item["attempts"] == 1, item
        assert item["error"] == "worker disconnected"
    assert _counts(http)["processing"] == 0
    _wait(lambda: _gauges(http) == (0, 0), what="gauges without the dead socket")


# -- a send that fails inside the closing handshake -----------------------------------------


def test_failed_ack_send_ends_the_socket_and_requeues_what_it_held(server_factory, key):
    server = server_factory(TASKHOSTER_FAULT="socket.send.ack=1")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={}).status_code == 201

        async def run():
            ws, ids = await _victim_holding_two(server, key, http)
            await send(ws, {"type": "result", "id": ids[0], "result": "ok"})
            frames, code = await _until_closed(ws)
            assert frames == []  # the ack could not be sent
            assert code == 1000
            assert _item(http, ids[0])["status"] == "finished"
            _held_items_pending_at_once(http, ids[1:])
            await _another_socket_gets_everything(server, key, http, ids[1:])

        asyncio.run(run())


def test_failed_item_send_gives_the_item_back_without_an_attempt(server_factory, key):
    server = server_factory(TASKHOSTER_FAULT="socket.send.item=1")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={}).status_code == 201

        async def run():
            ws = await connect(server, key)
            await subscribe(ws, ["q"], 2)
            item_id = _post(http, "never pushed")
            frames, code = await _until_closed(ws)
            assert frames == []
            assert code == 1000
            _wait(lambda: _item(http, item_id)["status"] == "pending", what="given back")
            item = _item(http, item_id)
            assert item["attempts"] == 0  # it never reached a worker
            assert item["error"] is None
            _wait(lambda: _gauges(http) == (0, 0), what="gauges without the dead socket")
            other = await connect(server, key)
            await subscribe(other, ["q"], 5)
            (pushed,) = await _take(other, 1)
            assert pushed["id"] == item_id
            assert pushed["attempts"] == 1
            await other.close()

        asyncio.run(run())


def test_failed_cancel_send_ends_the_socket_and_requeues_what_it_held(server_factory, key):
    server = server_factory(TASKHOSTER_FAULT="socket.send.cancel=1")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={}).status_code == 201

        async def run():
            ws, ids = await _victim_holding_two(server, key, http)
            assert http.delete(f"/api/items/{ids[0]}").status_code == 204
            frames, code = await _until_closed(ws)
            assert frames == []
            assert code == 1000
            _held_items_pending_at_once(http, ids[1:])
            await _another_socket_gets_everything(server, key, http, ids[1:])

        asyncio.run(run())


def test_failed_error_send_ends_the_socket_and_requeues_what_it_held(server_factory, key):
    server = server_factory(TASKHOSTER_FAULT="socket.send.error=1")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={}).status_code == 201

        async def run():
            ws, ids = await _victim_holding_two(server, key, http)
            await ws.send("not json")
            frames, code = await _until_closed(ws)
            assert frames == []
            assert code == 1000
            _held_items_pending_at_once(http, ids)
            await _another_socket_gets_everything(server, key, http, ids)

        asyncio.run(run())


# -- an exception inside a frame handler -------------------------------------------------------


async def _server_error_close(ws, item_id=None):
    frames, code = await _until_closed(ws)
    errors = [f for f in frames if f["type"] == "error"]
    assert errors, frames
    assert errors[-1]["code"] == "internal"
    if item_id is not None:
        assert errors[-1]["id"] == item_id
    assert code == 4500


def test_exception_in_subscribe_closes_with_4500_and_requeues(server_factory, key):
    server = server_factory(TASKHOSTER_FAULT="socket.subscribe@2")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={}).status_code == 201

        async def run():
            ws, ids = await _victim_holding_two(server, key, http)
            await subscribe(ws, ["q"], 3)  # the second subscribe raises
            await _server_error_close(ws)
            _held_items_pending_at_once(http, ids)
            await _another_socket_gets_everything(server, key, http, ids)

        asyncio.run(run())
    assert "socket frame 'subscribe'" in server.log.read_text()


def test_exception_in_result_closes_with_4500_and_requeues_the_rest(server_factory, key):
    server = server_factory(TASKHOSTER_FAULT="socket.result=1")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={}).status_code == 201

        async def run():
            ws, ids = await _victim_holding_two(server, key, http)
            await send(ws, {"type": "result", "id": ids[0], "result": "kept"})
            await _server_error_close(ws, ids[0])
            assert _item(http, ids[0])["result"] == "kept"  # the verdict was taken
            _held_items_pending_at_once(http, ids[1:])
            await _another_socket_gets_everything(server, key, http, ids[1:])

        asyncio.run(run())
    log = server.log.read_text()
    assert "socket frame 'result' for item" in log
    assert "injected fault socket.result" in log


def test_exception_in_fail_closes_with_4500_and_requeues_the_rest(server_factory, key):
    server = server_factory(TASKHOSTER_FAULT="socket.fail=1")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={"backoffSeconds": 60}).status_code == 201

        async def run():
            ws, ids = await _victim_holding_two(server, key, http)
            await send(ws, {"type": "fail", "id": ids[0], "error": "boom"})
            await _server_error_close(ws, ids[0])
            failed = _item(http, ids[0])
            assert failed["status"] == "pending"  # the fail was taken: backed off 60 s
            assert failed["error"] == "boom"
            _held_items_pending_at_once(http, ids[1:])
            await _another_socket_gets_everything(server, key, http, ids[1:])

        asyncio.run(run())


def test_exception_in_extend_closes_with_4500_and_requeues_both(server_factory, key):
    server = server_factory(TASKHOSTER_FAULT="socket.extend=1")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={}).status_code == 201

        async def run():
            ws, ids = await _victim_holding_two(server, key, http)
            await send(ws, {"type": "extend", "id": ids[0]})
            await _server_error_close(ws, ids[0])
            _held_items_pending_at_once(http, ids)
            await _another_socket_gets_everything(server, key, http, ids)

        asyncio.run(run())


# -- the real-world sequence ------------------------------------------------------------------


def test_worker_closing_with_results_in_flight_leaves_nothing_processing(server_factory, key):
    """A worker sends its last results and closes without waiting for the acks, many times
    over; the server must never keep a closed socket as a live one."""
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")
    with _client(server, key) as http:
        assert http.put("/api/queues/q", json={"maxAttempts": 1}).status_code == 201

        async def one_round():
            ws = await connect(server, key)
            await subscribe(ws, ["q"], 16)
            ids = [_post(http, n) for n in range(16)]
            items = await _take(ws, 16)
            assert sorted(i["id"] for i in items) == sorted(ids)
            for item in items[:12]:
                await send(ws, {"type": "result", "id": item["id"], "result": 1})
            await ws.close()  # 4 unanswered, acks of the 12 in flight
            return ids

        async def run():
            for _round in range(5):
                ids = await one_round()
                _wait(lambda: _counts(http)["processing"] == 0, what="nothing left processing")
                statuses = [_item(http, i)["status"] for i in ids]
                assert statuses.count("finished") == 12
                # maxAttempts 1: what the worker held unanswered died of its disconnect
                assert statuses.count("failed") == 4
            http.post("/api/queues/q/items/delete", json={"status": "failed"})
            fresh = await connect(server, key)
            await subscribe(fresh, ["q"], 4)
            probe = [_post(http, f"probe {n}") for n in range(4)]
            got = await _take(fresh, 4)
            assert [g["id"] for g in got] == probe
            await fresh.close()

        asyncio.run(run())
    assert "Exception inside application" not in server.log.read_text()
