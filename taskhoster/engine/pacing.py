"""Background work yields to foreground work.

Reclaiming a deleted queue, a delete by status, retention of many finished items, finishing a
list of files to unlink, repair beside a live server: each shares the database, the disk and
the committer with the posts, claims and results that clients wait for. Run flat out, a
reclaim of 200,000 files held SQLite's write lock for long stretches and filled the disk's
queue, and post-to-worker latency on other queues went from milliseconds to seconds. So each
runs in chunks, and a ``Pacer`` between the chunks:

- keeps every chunk short: it sizes the next chunk so that it takes about
  ``BACKGROUND_CHUNK_SECONDS`` (a foreground group waits at most that long behind it);
- keeps the background's share of the time at most ``BACKGROUND_SHARE``: after a chunk of
  ``t`` seconds it rests ``t * (1 - share) / share``;
- and, before the next chunk, waits while this process's committer has operations waiting
  (up to a bound, so that background work always progresses, if slowly, under a steady load).

Nothing here is shared between processes, and nothing needs to be: each process paces the
background work it runs, and the rest is measured in ``bench/background.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..conf import get_conf

# The longest a chunk waits for a busy committer before it runs anyway.
MOST_WAIT_SECONDS = 0.2
WAIT_STEP_SECONDS = 0.005


def _committer_busy() -> bool:
    from .committer import foreground_waiting

    return foreground_waiting()


class Pacer:
    """Sizes and spaces the chunks of one piece of background work (see the module)."""

    def __init__(
        self,
        *,
        start: int = 200,
        least: int = 20,
        most: int = 5000,
        busy: Callable[[], bool] = _committer_busy,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        conf = get_conf()
        self.share = conf.background_share
        self.chunk_seconds = conf.background_chunk_seconds
        self.least = least
        self.most = max(least, most)
        self.size = max(least, min(self.most, start))
        self.busy = busy
        self.sleep = sleep
        self.started = time.monotonic()
        self.worked = 0.0  # seconds spent in chunks
        self.chunks = 0
        self.rest = 0.0  # to rest before the next chunk
        self.done = 0  # units of work done

    def wait_for_turn(self) -> None:
        """Before a chunk: rest for the chunk before (see the module), then let the
        foreground's waiting operations go first (for a while). The first chunk, and work
        of one chunk, never wait."""
        if self.share >= 1 or not self.chunks:
            return
        if self.rest > 0:
            self.sleep(self.rest)
            self.rest = 0.0
        deadline = time.monotonic() + MOST_WAIT_SECONDS
        while self.busy() and time.monotonic() < deadline:
            self.sleep(WAIT_STEP_SECONDS)

    def chunk_done(self, count: int, seconds: float) -> None:
        """After a chunk of ``count`` units that took ``seconds``: size the next one, and
        the rest before it."""
        self.chunks += 1
        self.worked += seconds
        self.done += count
        if count > 0 and seconds > 0:
            per_unit = seconds / count
            wanted = int(self.chunk_seconds / per_unit)
            # Grow slowly, shrink at once: a chunk that took too long is the one to avoid.
            self.size = max(self.least, min(self.most, wanted, self.size * 2))
        if self.share < 1 and seconds > 0:
            self.rest = seconds * (1 - self.share) / self.share

    def run(self, chunk: Callable[[int], int]) -> int:
        """Call ``chunk(size)`` until it returns fewer than ``size`` units; return the total.
        Each call is one chunk (it returns how many units it did)."""
        total = 0
        while True:
            self.wait_for_turn()
            size = self.size
            started = time.perf_counter()
            count = chunk(size)
            self.chunk_done(count, time.perf_counter() - started)
            total += count
            if count < size:
                return total

    @property
    def rate(self) -> float:
        """Units per second of wall time so far."""
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0
