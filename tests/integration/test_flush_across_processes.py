"""A post's file moved on by another server process between its group's commit and its flush.

The news of a post goes out at its group's commit, so a second server process's socket may
claim the item, and move its file from ``pending/`` to ``processing/``, before the first
process has flushed the group. A flush file by file (``FLUSH = "fsync"``, or ``auto`` where one
file measured cheaper that way) must then find the file where it is now and flush it there:
otherwise the post is answered with its data never made durable. On a quiet machine the window
is a fraction of a millisecond; the fault ``post.slow_flush`` holds the posting process's
group between its commit and its flush for seconds, so the other process's claim always comes
in between, over a real database, Redis and two daphnes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from taskhoster import engine
from taskhoster.models import Item
from taskhoster.status import Status

from ..conftest import Server
from .test_processes import REDIS_URL, needs_shared
from .wsclient import PONG, assert_nothing_before, connect, ping, recv, send, subscribe

MOVED = "where another process moved it"
STALL_SECONDS = 3


def _post(url: str, key: str) -> tuple[str, float]:
    """Post one item; its id and when the answer came (monotonic)."""
    answer = httpx.post(
        f"{url}/api/queues/q/items",
        json={"payload": {"keep": "me"}},
        headers={"Authorization": f"Token {key}"},
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"]), time.monotonic()


def _moved_lines(log: Path, item_id: str) -> list[str]:
    return [
        line
        for line in log.read_text(errors="replace").splitlines()
        if MOVED in line and item_id in line
    ]


@needs_shared
def test_a_post_claimed_by_another_process_before_its_flush_is_flushed_where_it_was_moved(
    transactional_db, state_root, make_key
):
    shared = {"REDIS_URL": REDIS_URL, "TASKHOSTER_SOCKET_BACKSTOP_SECONDS": "60"}
    posting = Server(
        state_root,
        TASKHOSTER_FSYNC="1",
        TASKHOSTER_FLUSH="fsync",  # file by file: a moved file is not in a syncfs's reach
        TASKHOSTER_FAULT="post.slow_flush",
        TASKHOSTER_FAULT_SLOW_SECONDS=str(STALL_SECONDS),
        TASKHOSTER_LOG="DEBUG",
        **shared,
    ).start()
    claiming = Server(state_root, **shared).start()
    try:
        engine.upsert_queue(name="q", body={})
        key = make_key()

        async def run() -> tuple[str, dict[str, object], float, float]:
            ws = await connect(claiming, key)
            try:
                await subscribe(ws, ["q"], 1)
                await ping(ws)
                await assert_nothing_before(ws, PONG)  # subscribed, and nothing came
                posted = asyncio.create_task(asyncio.to_thread(_post, posting.url, key))
                # The other process claims on the commit's news, not a backstop's poll.
                frame = await recv(ws, timeout=STALL_SECONDS * 3)
                delivered_at = time.monotonic()
                item_id, answered_at = await posted
                await send(ws, {"type": "result", "id": item_id, "result": "done"})
                ack = await recv(ws, timeout=10)
                assert ack == {"type": "ack", "id": item_id, "accepted": True, "status": "finished"}
                return item_id, frame, delivered_at, answered_at
            finally:
                await ws.close()

        item_id, frame, delivered_at, answered_at = asyncio.run(run())
        assert (frame["type"], frame["id"]) == ("item", item_id), frame
        assert frame["payload"] == {"keep": "me"}
        assert delivered_at < answered_at - 1, (
            "the other process claimed the item while its post's group was held before "
            "its flush (else this test proves nothing)"
        )
        moved = _moved_lines(posting.log, item_id)
        assert moved, "the post's flush found its file in processing/ and flushed it there"
        assert "/pending/" in moved[0], moved
        assert "/processing/" in moved[0], moved
        item = Item.objects.get(id=item_id)
        assert item.status == Status.FINISHED
    finally:
        posting.stop()
        claiming.stop()
