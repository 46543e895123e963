"""News in Redis is the installation's own: two installations (each its own database and
state root) that share one Redis never hear each other.

Pub/sub ignores Redis's database numbers, so a second installation on the same Redis, even
on another database number, used to wake the first one's sockets: a claim for every piece
of its news, for nothing (and a thousand queues' worth of news at its busiest). The channel
is now named by the installation's identity (``bus.news_channel``).
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import redis

from taskhoster import bus, identity

from .redishere import REDIS_URL, needs_redis
from .wsclient import (
    COMMITTER_PONG,
    assert_nothing_before,
    connect,
    item_of,
    make_queue,
    ping_committer,
    settled_metric,
    subscribe,
)

pytestmark = [pytest.mark.slow, needs_redis]

POST_ONE = textwrap.dedent(
    """
    from taskhoster import engine, local
    engine.upsert_queue(name="q", body={})
    print(local.post("q", {"from": "%s"}).id)
    """
)


def test_two_installations_sharing_one_redis_do_not_hear_each_others_news(
    server_factory, manage, tmp_path: Path, make_key
) -> None:
    # Installation A: this test's database and state root. Its sockets learn of new work
    # from news alone here (the backstop re-check is a minute away).
    a_env = {"REDIS_URL": REDIS_URL, "TASKHOSTER_SOCKET_BACKSTOP_SECONDS": "60"}
    server = server_factory(**a_env)
    # Installation B: a database and a state root of its own, on the same Redis.
    b_env = {
        "DATABASE_URL": f"sqlite:///{tmp_path / 'b.sqlite3'}",
        "TASKHOSTER_ROOT": str(tmp_path / "b-root"),
        "REDIS_URL": REDIS_URL,
    }
    manage("migrate", "-v", "0", **b_env)

    def post_from_another_process(env: dict[str, str], who: str) -> str:
        """Post one item to queue ``q`` from a process of its own (its committer publishes
        the news on the bus of the installation that ``env`` names); the item's id."""
        return manage("shell", "-c", POST_ONE % who, **env).stdout.strip().splitlines()[-1]

    key = make_key()
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=30
    ) as http:
        make_queue(http, "q")

        async def run() -> tuple[float, float]:
            ws = await connect(server, key)
            try:
                await subscribe(ws, ["q"], 1)
                await ping_committer(ws)  # the subscription's own claim is answered
                await assert_nothing_before(ws, COMMITTER_PONG)
                before = await asyncio.to_thread(settled_metric, http, "claim_attempts")
                # B's post: news for B's queue "q", on B's channel.
                await asyncio.to_thread(post_from_another_process, b_env, "b")
                # Then a post to A's own "q" from another process of A (news on A's
                # channel, published after B's): its item is the socket's next frame.
                item_id = await asyncio.to_thread(post_from_another_process, a_env, "a")
                frame = await assert_nothing_before(ws, item_of(item_id))
                assert frame["payload"] == {"from": "a"}
                after = await asyncio.to_thread(settled_metric, http, "claim_attempts")
                return before, after
            finally:
                await ws.close()

        before, after = asyncio.run(run())
    # One claim, for A's own news. Hearing B's news too made one more (it found nothing).
    assert after - before == 1, f"{after - before:g} claims for one item of A's"


def test_a_listener_started_before_its_installation_has_an_identity_moves_to_its_channel(
    state_root: Path,
) -> None:
    """A server's listener may start before the state root has its identity (a first start
    whose database did not answer; an embedding whose first socket comes before its first
    queue). It listens on the shared channel until then, and on the installation's channel
    once the identity is written, without a reconnect."""
    state_root.mkdir(parents=True, exist_ok=True)
    assert bus.news_channel() == bus.REDIS_CHANNEL  # no identity yet
    heard: list[tuple[str, str, str]] = []
    listener = bus.Listener(heard.extend)
    publisher = redis.Redis.from_url(REDIS_URL)

    def message(queue: str) -> bytes:  # from another process (a listener drops its own)
        return json.dumps({"o": "another-process", "n": [["claimable", queue, ""]]}).encode()

    async def until_heard(channel: str, queue: str) -> None:
        deadline = time.monotonic() + 15
        while ("claimable", queue, "") not in heard:
            assert time.monotonic() < deadline, f"nothing heard on {channel}"
            await asyncio.to_thread(publisher.publish, channel, message(queue))
            await asyncio.sleep(0.1)

    async def run() -> None:
        task = asyncio.create_task(listener._listen_redis(REDIS_URL))
        try:
            await until_heard(bus.REDIS_CHANNEL, "before")
            identity._write_file(state_root, "a1b2c3d4e5f6a7b8")
            channel = bus.news_channel()
            assert channel == f"{bus.REDIS_CHANNEL}:a1b2c3d4e5f6a7b8"
            await until_heard(channel, "after")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        publisher.close()
