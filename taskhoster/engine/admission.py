"""This process's committer, as the rest of the engine sees it: what it holds, and whether
new posts are admitted.

``committer.committer()`` makes the committer (a thread, ``runner.Committer``, or a process,
``process.ChildCommitter``) and registers it here; a committer process registers its own
thread. Pacing (``pacing``), health and admission read it through the ``Committer`` protocol
both kinds implement.
"""

from __future__ import annotations

import math
import os
from typing import Any, Protocol

from ..conf import get_conf
from .ops import Op


class Committer(Protocol):
    """What every kind of committer does."""

    pid: int  # the process that made it (a forked child makes its own)

    def submit(self, op: Op[Any]) -> None:
        """Hand ``op`` to the next group; its answer comes on its future or waiter."""

    def submit_many(self, ops: list[Op[Any]]) -> None:
        """Hand in several operations together (so they can share a group)."""

    def start(self) -> None:
        """Be ready now rather than at the first operation."""

    def waiting(self) -> int:
        """Operations handed in and not yet answered (or, for a thread, taken)."""

    def backlog(self) -> tuple[int, float]:
        """(items waiting, seconds the oldest of them has waited)."""

    def starting(self) -> bool:
        """Whether it is still starting: made, not yet able to take a group (a committer
        process importing Django)."""

    def unflushed(self) -> int:
        """The items whose files a failed flush left and are not written again yet (it
        changes nothing meanwhile: ``runner``)."""


_current: Committer | None = None


def register(committer: Committer) -> None:
    global _current
    _current = committer


def current() -> Committer | None:
    """This process's committer, if it has made one (not one inherited through a fork)."""
    found = _current
    if found is None or found.pid != os.getpid():
        return None
    return found


def backlog() -> tuple[int, float]:
    """(items waiting for this process's committer, seconds the oldest has waited)."""
    found = current()
    if found is None:
        return 0, 0.0
    items, age = found.backlog()
    return int(items), float(age)


def unflushed() -> int:
    """``Committer.unflushed`` of this process's committer (0 without one)."""
    found = current()
    return 0 if found is None else found.unflushed()


def starting() -> bool:
    """Whether this process's committer is still starting: ``/healthz`` says the process is
    not ready yet."""
    found = current()
    return found is not None and found.starting()


def overloaded() -> float | None:
    """Admission control for new posts: the seconds a client should wait before trying
    again (``Retry-After``) when this process's committer is behind (the oldest operation
    waiting for it has waited more than ``ADMISSION_WAIT_SECONDS``, or more than
    ``ADMISSION_MAX_ITEMS`` items or more wait), else None. Refusing at once beats queueing for
    seconds: a queue of waiting work is latency, for every client."""
    items, age = backlog()
    conf = get_conf()
    if age > conf.admission_wait_seconds or items >= conf.admission_max_items:
        return float(max(1, min(30, math.ceil(age))))
    return None


def foreground_waiting() -> bool:
    """Whether this process's committer has operations waiting for it (background work lets
    them go first: ``pacing``)."""
    found = current()
    return found is not None and bool(found.waiting())
