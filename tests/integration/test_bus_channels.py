"""News in Redis is the installation's own: two installations (each its own database and
state root) that share one Redis never hear each other.

Pub/sub ignores Redis's database numbers, so a second installation on the same Redis, even
on another database number, used to wake the first one's sockets: a claim for every piece
of its news, for nothing (and a thousand queues' worth of news at its busiest). The channel
is now named by the installation's identity (``bus.news_channel``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx

from tests.conftest import REPO, server_env

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

# The machine's Redis (CI's and the development machine's) when the suite runs without one.
REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"

POST_ONE = textwrap.dedent(
    """
    from taskhoster import engine, local
    engine.upsert_queue(name="q", body={})
    print(local.post("q", {"from": "%s"}).id)
    """
)


def _post_from_another_process(env: dict[str, str], who: str) -> str:
    """Post one item to queue ``q`` from a process of its own (its committer publishes the
    news on the bus of the installation that ``env`` names); the item's id."""
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", POST_ONE % who],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def test_two_installations_sharing_one_redis_do_not_hear_each_others_news(
    server_factory, state_root: Path, tmp_path: Path, make_key
) -> None:
    # Installation A: this test's database and state root. Its sockets learn of new work
    # from news alone here (the backstop re-check is a minute away).
    a_env = {"REDIS_URL": REDIS_URL, "TASKHOSTER_SOCKET_BACKSTOP_SECONDS": "60"}
    server = server_factory(**a_env)
    # Installation B: a database and a state root of its own, on the same Redis.
    b_env = server_env(
        tmp_path / "b-root",
        DATABASE_URL=f"sqlite:///{tmp_path / 'b.sqlite3'}",
        REDIS_URL=REDIS_URL,
    )
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"],
        cwd=REPO,
        env=b_env,
        check=True,
        timeout=120,
    )
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
                await asyncio.to_thread(_post_from_another_process, b_env, "b")
                # Then a post to A's own "q" from another process of A (news on A's
                # channel, published after B's): its item is the socket's next frame.
                item_id = await asyncio.to_thread(
                    _post_from_another_process, server_env(state_root, **a_env), "a"
                )
                frame = await assert_nothing_before(ws, item_of(item_id))
                assert frame["payload"] == {"from": "a"}
                after = await asyncio.to_thread(settled_metric, http, "claim_attempts")
                return before, after
            finally:
                await ws.close()

        before, after = asyncio.run(run())
    # One claim, for A's own news. Hearing B's news too made one more (it found nothing).
    assert after - before == 1, f"{after - before:g} claims for one item of A's"
