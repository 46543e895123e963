"""Redis that stops answering holds no work up, and a Redis connection whose far end went
dark without a word is found out and made again.

News between processes is a hint (a socket's backstop finds what it would have said), so
Redis is never in the way of the work itself. It was: every group's commit published its
news to Redis and waited for the answer, so a Redis that hung, or an address that dropped
packets, held every post, claim and result of every process for the client's timeout (2 s
each). And a server's listener waited for news on its connection for ever: one whose far end
was gone (a Redis failed over or restarted while the network between was down, a NAT that
forgot it) left the process deaf to the others' news until it restarted, its sockets getting
other processes' posts only at their backstop. And what was said while a listener was away
(Redis restarting) was never heard: its sockets found it only at their backstop, even once
the listener was back; now a listener's every subscription, once Redis confirms it, has
its process look again at once for what it may have missed.

Redis is reached through a TCP proxy (``tcpproxy``) that can go dark: what either side sends
is taken by the proxy's kernel and never passed on, and nothing is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from taskhoster import bus

from .redishere import REDIS_URL, needs_redis
from .tcpproxy import TcpProxy
from .test_processes import needs_shared
from .wsclient import (
    COMMITTER_PONG,
    assert_nothing_before,
    connect,
    make_queue,
    ping_committer,
    post,
    recv,
    send,
    subscribe,
)

pytestmark = [pytest.mark.slow, needs_redis]

# A post's median time, and the median of an item's whole turn (post, push to the worker,
# result, ack), with Redis dark, on a loaded machine; each waited 2 s or more for Redis before.
POST_MEDIAN_MOST_SECONDS = 1.0
TURN_MEDIAN_MOST_SECONDS = 1.5


@pytest.fixture
def redis_proxy() -> Iterator[TcpProxy]:
    proxy = TcpProxy(urlsplit(REDIS_URL).port or 6379)
    yield proxy
    proxy.close()


def through(proxy: TcpProxy) -> str:
    """``REDIS_URL``, reached through ``proxy``."""
    parts = urlsplit(REDIS_URL)
    return parts._replace(netloc=f"{proxy.host}:{proxy.port}").geturl()


def test_a_redis_that_hangs_holds_up_no_post_push_or_result(server_factory, redis_proxy, key):
    server = server_factory(REDIS_URL=through(redis_proxy))
    headers = {"Authorization": f"Token {key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        make_queue(http)
        post(http, "before")  # the server's connections to Redis are open

        async def run() -> list[tuple[float, float]]:
            ws = await connect(server, key)
            try:
                await subscribe(ws, ["q"], 1)
                first = await recv(ws)
                await send(ws, {"type": "result", "id": first["id"], "result": "ok"})
                assert (await recv(ws))["accepted"] is True
                redis_proxy.go_dark()
                turns = []
                for n in range(8):
                    began = time.monotonic()
                    item_id = await asyncio.to_thread(post, http, n)
                    posted = time.monotonic() - began
                    frame = await recv(ws, 10)
                    assert (frame["type"], frame["id"]) == ("item", item_id)
                    await send(ws, {"type": "result", "id": item_id, "result": "ok"})
                    ack = await recv(ws, 10)
                    assert (ack["type"], ack["accepted"]) == ("ack", True), ack
                    turns.append((posted, time.monotonic() - began))
                return turns
            finally:
                await ws.close()

        turns = asyncio.run(run())
    assert statistics.median(posted for posted, _ in turns) < POST_MEDIAN_MOST_SECONDS, turns
    assert statistics.median(turn for _, turn in turns) < TURN_MEDIAN_MOST_SECONDS, turns


@needs_shared
def test_a_listener_whose_redis_went_dark_hears_the_other_processes_again(
    server_factory, redis_proxy, key
):
    # A hears the bus through the proxy; its sockets learn of B's posts by news alone (the
    # backstop re-check is two minutes away). B publishes to Redis directly.
    a = server_factory(REDIS_URL=through(redis_proxy), TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120")
    b = server_factory(REDIS_URL=REDIS_URL)
    headers = {"Authorization": f"Token {key}"}
    # The old connection found dark (a PING unanswered), a new one made (a second later) and
    # subscribed; a margin for a loaded machine.
    found_within = bus.LISTENER_QUIET_SECONDS + bus.LISTENER_ANSWER_SECONDS + 6

    with httpx.Client(base_url=b.url, headers=headers, timeout=30) as http:
        make_queue(http)

        async def first_item(ws: Any, timeout: float) -> tuple[str, float]:
            """Post to B every 0.3 s until A's socket is pushed an item; its id, and when."""
            began = time.monotonic()
            while True:
                await asyncio.to_thread(post, http, "from b")
                try:
                    frame = await recv(ws, 0.3)
                except TimeoutError:
                    assert time.monotonic() - began < timeout, (
                        f"A's socket had no item {timeout:g} s after the posts to B began"
                    )
                    continue
                assert frame["type"] == "item", frame
                return frame["id"], time.monotonic() - began

        async def run() -> float:
            ws = await connect(a, key)
            try:
                await subscribe(ws, ["q"], 100)
                await ping_committer(ws)
                await assert_nothing_before(ws, COMMITTER_PONG)
                _, took = await first_item(ws, 5)  # news flows from B to A
                redis_proxy.go_dark()
                await asyncio.sleep(0.5)
                redis_proxy.light()  # Redis answers again, but not on A's old connection
                _, took = await first_item(ws, found_within)
                return took
            finally:
                await ws.close()

        took = asyncio.run(run())
    assert took < found_within


@needs_shared
def test_an_item_posted_while_redis_restarted_reaches_a_waiting_worker_once_redis_is_back(
    server_factory, redis_proxy, key
):
    # Both servers reach Redis through the proxy; a "restart" cuts every connection and
    # refuses new ones for a while. A's sockets learn of B's posts by news alone (the backstop
    # re-check is two minutes away). The post made while Redis is away is answered (Redis is
    # never in the way of the work) and its news is lost: A's socket must have it once A's
    # listener is subscribed again, not at the backstop.
    a = server_factory(REDIS_URL=through(redis_proxy), TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120")
    b = server_factory(REDIS_URL=through(redis_proxy))
    headers = {"Authorization": f"Token {key}"}
    away_seconds = 2.0
    # The listener tries again every second; a margin for a loaded machine.
    back_within = 8.0

    with httpx.Client(base_url=b.url, headers=headers, timeout=30) as http:
        make_queue(http)

        async def item(ws: Any, item_id: str, deadline: float) -> None:
            """Wait until ``ws`` is pushed ``item_id`` (passing over the posts before it)."""
            while True:
                frame = await recv(ws, max(0.01, deadline - time.monotonic()))
                assert frame["type"] == "item", frame
                if frame["id"] == item_id:
                    return

        async def run() -> tuple[float, float]:
            ws = await connect(a, key)
            try:
                await subscribe(ws, ["q"], 100)
                await ping_committer(ws)
                await assert_nothing_before(ws, COMMITTER_PONG)
                # News flows from B to A: post until A's socket is pushed one.
                began = time.monotonic()
                while True:
                    await asyncio.to_thread(post, http, "before")
                    with contextlib.suppress(TimeoutError):
                        frame = await recv(ws, 0.3)
                        assert frame["type"] == "item", frame
                        break
                    assert time.monotonic() - began < 10, "no news from B to A before the restart"
                redis_proxy.refuse = True  # Redis restarts: every connection cut, none taken
                redis_proxy.drop_all()
                began = time.monotonic()
                during = await asyncio.to_thread(post, http, "during")
                posted = time.monotonic() - began
                await asyncio.sleep(away_seconds)
                redis_proxy.refuse = False
                back = time.monotonic()
                await item(ws, during, back + back_within)
                took = time.monotonic() - back
                # B's publisher is back too: its next post's news reaches A's socket at once.
                after = await asyncio.to_thread(post, http, "after")
                await item(ws, after, time.monotonic() + 5)
                return posted, took
            finally:
                await ws.close()

        posted, took = asyncio.run(run())
    assert posted < POST_MEDIAN_MOST_SECONDS, posted
    assert took < back_within, took
