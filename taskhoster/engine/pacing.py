"""Background work yields to foreground work.

Reclaiming a deleted queue, a delete by status, retention of many finished items, finishing a
list of files to unlink, repair beside a live server: each shares the database, the disk and
the committer with the posts, claims and results that clients wait for. Run flat out, a
reclaim of 200,000 files held SQLite's write lock for long stretches and filled the disk's
queue, and post-to-worker latency on other queues went from milliseconds to seconds. So each
runs in chunks, and a ``Pacer`` between the chunks:

- keeps every chunk short: it sizes the next chunk so that it takes about
  ``BACKGROUND_CHUNK_SECONDS`` (a foreground group waits at most that long behind it);
  alone, chunks grow to ``ALONE_CHUNKS`` times that;
- keeps the background's share of the time at most ``BACKGROUND_SHARE``: after a chunk of
  ``t`` seconds it rests ``t * (1 - share) / share``;
- and, before the next chunk, waits while this process's committer has operations waiting
  (up to a bound, so that background work always progresses, if slowly, under a steady load).

It rests, and keeps chunks short, only while there is a foreground to yield to: when a
committer of this host ran a group with foreground work in the last
``FOREGROUND_RECENT_SECONDS``. Alone, background work runs flat out (a million items deleted
by status on an idle server take what they took before pacing). The mark is shared by every
process of the host (a slot in ``/dev/shm`` per state root): a delete by status runs in a
request thread of one server process, the unlinks behind it in that process's committer
process, retention in the sweep's own process, and the foreground they yield to may be in
any server process of the host. Operations that background work hands to the committer (its
chunks run inside ``background()``) do not mark it. Measured in ``bench/background.py``
(beside a probe) and ``bench/removal.py`` (alone).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..conf import get_conf
from . import admission

# The longest a chunk waits for a busy committer before it runs anyway.
MOST_WAIT_SECONDS = 0.2
WAIT_STEP_SECONDS = 0.005
# Foreground work this recent (on any process of the host) makes background work rest.
FOREGROUND_RECENT_SECONDS = 1.0
# Alone, a chunk may take up to this many times ``BACKGROUND_CHUNK_SECONDS``.
ALONE_CHUNKS = 5
SHARED_MEMORY = Path("/dev/shm")

_SLOT = struct.Struct("d")  # time.monotonic() of the last foreground group: one host's clock
_local = threading.local()


class ForegroundMark:
    """When a committer of this host last ran foreground work, for the state root ``root``:
    one double in a shared-memory file that every process of the host maps (falling back to
    this process alone where there is no ``/dev/shm``). A write is one store into memory:
    nothing reaches a disk, and no flush of the state root waits for it."""

    def __init__(self, root: Path) -> None:
        self.value = 0.0  # the fallback: this process only
        self.map: mmap.mmap | None = None
        with contextlib.suppress(OSError):
            fd = os.open(self.path(root), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < _SLOT.size:
                    os.ftruncate(fd, _SLOT.size)
                self.map = mmap.mmap(fd, _SLOT.size)
            finally:
                os.close(fd)

    @staticmethod
    def path(root: Path) -> Path:
        """The shared-memory file of the state root ``root``."""
        name = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:20]
        return SHARED_MEMORY / f"taskhoster-{name}.foreground"

    def mark(self, at: float) -> None:
        if self.map is None:
            self.value = at
        else:
            _SLOT.pack_into(self.map, 0, at)

    def last(self) -> float:
        if self.map is None:
            return self.value
        return float(_SLOT.unpack_from(self.map, 0)[0])


_marks: dict[Path, ForegroundMark] = {}


def _mark_for_root() -> ForegroundMark:
    root = get_conf().root
    found = _marks.get(root)
    if found is None:
        found = _marks[root] = ForegroundMark(root)
    return found


def mark_foreground() -> None:
    """A committer is running a group with foreground work (anything not handed to it
    inside ``background()``)."""
    _mark_for_root().mark(time.monotonic())


def foreground_recent(within: float = FOREGROUND_RECENT_SECONDS) -> bool:
    """Whether any committer of this host ran foreground work in the last ``within`` s."""
    return time.monotonic() - _mark_for_root().last() < within


@contextlib.contextmanager
def background() -> Iterator[None]:
    """Operations this thread hands to the committer meanwhile are background work: they
    do not make other background work rest."""
    before = in_background()
    _local.background = True
    try:
        yield
    finally:
        _local.background = before


def in_background() -> bool:
    return bool(getattr(_local, "background", False))


def _committer_busy() -> bool:
    return admission.foreground_waiting()


class Pacer:
    """Sizes and spaces the chunks of one piece of background work (see the module)."""

    def __init__(
        self,
        *,
        start: int = 200,
        least: int = 20,
        most: int = 5000,
        busy: Callable[[], bool] = _committer_busy,
        foreground: Callable[[], bool] = foreground_recent,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        conf = get_conf()
        self.share = conf.background_share
        self.chunk_seconds = conf.background_chunk_seconds
        self.least = least
        self.most = max(least, most)
        self.size = max(least, min(self.most, start))
        self.fit = self.size  # the size that takes about ``chunk_seconds``
        self.grow = False  # alone: chunks grow (to ``ALONE_CHUNKS`` times ``fit``)
        self.busy = busy
        self.foreground = foreground
        self.sleep = sleep
        self.started = time.monotonic()
        self.worked = 0.0  # seconds spent in chunks
        self.chunks = 0
        self.rest = 0.0  # to rest before the next chunk
        self.rested = 0.0  # seconds rested so far
        self.done = 0  # units of work done

    def wait_for_turn(self) -> None:
        """Before a chunk: rest for the chunk before while there is foreground work to yield
        to (see the module), then let the foreground's waiting operations go first (for a
        while). The first chunk, and work of one chunk, never wait."""
        if self.share >= 1 or not self.chunks:
            return
        yielding = self.foreground()
        if self.rest > 0:
            if yielding:
                self.sleep(self.rest)
                self.rested += self.rest
            self.rest = 0.0
        # Alone, chunks grow (nobody waits behind them, and each chunk has a cost of its own:
        # a round trip and a flush), up to ``ALONE_CHUNKS`` times ``BACKGROUND_CHUNK_SECONDS``
        # (foreground work that starts meanwhile waits behind one such chunk, once); beside
        # the foreground, they take about ``BACKGROUND_CHUNK_SECONDS``.
        self.grow = not yielding
        if self.grow:
            self.size = min(self.most, self.fit * ALONE_CHUNKS, max(self.fit, self.size * 2))
        else:
            self.size = self.fit
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
            self.fit = max(self.least, min(self.most, wanted, self.fit * 2))
            self.size = max(self.fit, self.size) if self.grow else self.fit
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
            with background():
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
