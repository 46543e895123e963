"""Under load the committer commits the next group while a group's files are flushed (on its
flusher's thread). The next group answers at its commit only what needs nothing durable; the
rest waits for the flush before it, even where it wrote no file itself.

The faults hold the first group twice, so that the second always comes in between: between
its commit and its flush (``post.slow_flush``: the post sent again queues meanwhile, so the
flush goes to the flusher's thread), and then in that flush itself (``flush.slow``: the
second group commits meanwhile).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from taskhoster import engine

from ..conftest import Server
from .test_overload import wait_for

STALL_SECONDS = 4


def _post(url: str, key: str) -> tuple[int, float]:
    """Post the item with the key ``once``; its status code and when it came (monotonic)."""
    answer = httpx.post(
        f"{url}/api/queues/q/items",
        json={"payload": {"keep": "me"}, "key": "once"},
        headers={"Authorization": f"Token {key}"},
        timeout=60,
    )
    return answer.status_code, time.monotonic()


def test_a_post_sent_again_is_answered_only_after_the_flush_of_the_group_that_made_it(
    transactional_db, state_root: Path, make_key
):
    server = Server(
        state_root,
        TASKHOSTER_FSYNC="1",
        TASKHOSTER_FAULT="post.slow_flush=1,flush.slow=1",
        TASKHOSTER_FAULT_SLOW_SECONDS=str(STALL_SECONDS),
    ).start()
    try:
        engine.upsert_queue(name="q", body={})
        key = make_key()
        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            first = pool.submit(_post, server.url, key)
            # Its group has written its file (and holds before its flush): the post sent
            # again cannot join it, it finds the row in the next group.
            wait_for(lambda: any(state_root.glob("q/pending/*.json")), 15, "the first group")
            again = pool.submit(_post, server.url, key)
            (made, made_at), (found, found_at) = first.result(), again.result()
    finally:
        server.stop()
    assert (made, found) == (201, 200)
    assert made_at - started >= 2 * STALL_SECONDS - 0.5, "both stalls were met"
    # Before, the second group answered it at its commit: seconds before the first group's
    # flush, with nothing of the item on the disk for certain.
    assert found_at > made_at - 1, (found_at - started, made_at - started)
