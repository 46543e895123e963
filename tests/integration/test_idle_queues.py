"""Idle costs nothing, however many queues and sockets: the `/work` dispatcher's backstop is one
query for all its queues, and makes no claim for a queue with nothing to take; yet it still
finds an item whose news was lost, and a delayed item comes when it is due.

Against a real daphne and real sockets. A thousand idle sockets on a thousand queues once cost
a claim (and a query for the next due item) per queue per backstop: 200 claims a second at
idle, 19% of a core, and posts waited behind them. The counts here come from ``/metrics``
(``taskhoster_claim_attempts_total``), so they are exact, not timed.
"""

from __future__ import annotations

import asyncio
import re
import time
from datetime import datetime

import httpx
import pytest

from taskhoster import engine

from .wsclient import connect, recv, subscribe

pytestmark = pytest.mark.slow

QUEUES = 30


def claim_attempts(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    found = re.findall(r'^taskhoster_claim_attempts_total\{queue="[^"]+"\} (\S+)$', text, re.M)
    return sum(float(n) for n in found)


def test_idle_sockets_on_many_queues_cost_no_claims(server_factory, make_key):
    for n in range(QUEUES):
        engine.upsert_queue(name=f"q{n}", body={})
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="0.2")
    key = make_key()

    async def run() -> tuple[float, float]:
        sockets = [await connect(server, key) for _ in range(QUEUES)]
        for n, ws in enumerate(sockets):
            await subscribe(ws, [f"q{n}"], 1)
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=10
        ) as http:
            # Each subscription looks once (one claim attempt each); then nothing more.
            deadline = time.monotonic() + 30
            while claim_attempts(http) < QUEUES and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            settled = claim_attempts(http)
            await asyncio.sleep(3)  # fifteen backstops
            later = claim_attempts(http)
        for ws in sockets:
            await ws.close()
        return settled, later

    settled, later = asyncio.run(run())
    assert settled == QUEUES
    assert later == settled, f"{later - settled:g} claims for queues with nothing to take"


def test_the_backstop_finds_an_item_whose_news_was_lost(server_factory, make_key):
    engine.upsert_queue(name="q", body={})
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="0.5", TASKHOSTER_FAULT="news.lost")
    key = make_key()

    async def run() -> str:
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        posted = httpx.post(
            f"{server.url}/api/queues/q/items",
            json={"payload": 1},
            headers={"Authorization": f"Token {key}"},
            timeout=30,
        ).json()
        frame = await recv(ws, 30)  # no news ever comes: only the backstop finds it
        await ws.close()
        assert frame["type"] == "item"
        return str(frame["id"]) if frame["id"] == posted["id"] else ""

    assert asyncio.run(run())


def test_a_delayed_item_reaches_a_waiting_socket_when_due_without_news(server_factory, make_key):
    """The backstop's one query also says when each queue's next delayed item is due, and a
    timer wakes the queue then (here news is lost, so nothing else would)."""
    engine.upsert_queue(name="q", body={})
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="0.5", TASKHOSTER_FAULT="news.lost")
    key = make_key()

    async def run() -> float:
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        httpx.post(
            f"{server.url}/api/queues/q/items",
            json={"payload": 1, "delaySeconds": 2},
            headers={"Authorization": f"Token {key}"},
            timeout=30,
        )
        frame = await recv(ws, 30)
        arrived = time.time()
        await ws.close()
        assert frame["type"] == "item"
        due = datetime.fromisoformat(frame["scheduledAt"].replace("Z", "+00:00")).timestamp()
        return arrived - due

    # Pushed once due (this machine's one clock), and soon after: by a timer, not the news.
    late_by = asyncio.run(run())
    assert late_by >= -0.01, "not before it is due"
