"""A worker is told to stop even when the news of its item's removal is lost (a Redis
reconnect drops what was published meanwhile): the sockets' backstop looks at what they hold
and cancels, with the reason the news would have given, what was deleted, timed out or
cancelled; an item still the worker's is left alone."""

from __future__ import annotations

import asyncio

import pytest

from .wsclient import (
    PONG,
    assert_nothing_before,
    connect,
    make_queue,
    ping,
    post,
    recv,
    send,
    subscribe,
)

pytestmark = pytest.mark.slow

BACKSTOP = 0.5


@pytest.fixture
def server(server_factory):
    # Every removal's news (an item's, a queue's) is lost in the server's own dispatcher:
    # only the backstop tells.
    return server_factory(
        TASKHOSTER_FAULT="dispatch.lose_stop_news",
        TASKHOSTER_SOCKET_BACKSTOP_SECONDS=str(BACKSTOP),
    )


def test_a_held_item_removed_while_its_news_was_lost_is_cancelled_by_the_backstop(
    server, http, key
):
    make_queue(http)
    deleted, cancelled, kept = post(http, "a"), post(http, "b"), post(http, "c")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 3)
        assert {(await recv(ws))["id"] for _ in range(3)} == {deleted, cancelled, kept}
        assert http.delete(f"/api/items/{deleted}").status_code == 204
        assert http.post(f"/api/items/{cancelled}/cancel", json={}).status_code == 200
        got = [await recv(ws, 10 * BACKSTOP), await recv(ws, 10 * BACKSTOP)]
        assert sorted(got, key=lambda f: f["reason"]) == [
            {"type": "cancel", "id": cancelled, "reason": "cancelled"},
            {"type": "cancel", "id": deleted, "reason": "deleted"},
        ]
        # The item still its own is not cancelled over several backstops.
        await asyncio.sleep(4 * BACKSTOP)
        await ping(ws)
        await assert_nothing_before(ws, PONG)
        # A cancelled item's late result is refused; the freed slots take new work.
        await send(ws, {"type": "result", "id": deleted, "result": "late"})
        assert await recv(ws) == {"type": "ack", "id": deleted, "accepted": False}
        nxt = post(http, "next")
        assert (await recv(ws))["id"] == nxt
        await send(ws, {"type": "result", "id": kept, "result": "done"})
        assert await recv(ws) == {"type": "ack", "id": kept, "accepted": True, "status": "finished"}
        await ws.close()

    asyncio.run(run())


def test_a_held_item_of_a_deleted_queue_is_cancelled_by_the_backstop(server, http, key):
    make_queue(http)
    item = post(http, "a")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        assert (await recv(ws))["id"] == item
        assert http.delete("/api/queues/q").status_code in (202, 204)
        assert await recv(ws, 10 * BACKSTOP) == {"type": "cancel", "id": item, "reason": "deleted"}
        await ws.close()

    asyncio.run(run())


def test_a_held_item_timed_out_by_a_separate_sweep_is_cancelled_by_the_backstop(
    server, http, key, manage
):
    make_queue(http, queueSeconds=0.5, leaseSeconds=60)
    item = post(http, "x")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        assert (await recv(ws))["id"] == item
        await asyncio.sleep(0.7)
        manage("sweep")
        assert await recv(ws, 10 * BACKSTOP) == {"type": "cancel", "id": item, "reason": "timeout"}
        await ws.close()

    asyncio.run(run())
