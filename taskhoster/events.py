"""News that the engine gives after a commit: an item became claimable, an item reached a
verdict, an item a worker may hold was removed.

``announce`` delivers a group's news in this process (a condition variable wakes long-polls at
once; listeners such as the ``/work`` dispatcher are called once with the whole batch) and
publishes it to the other processes through ``bus`` in one message; a server process hands
what it hears from the bus to ``deliver``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from .faults import fault

log = logging.getLogger(__name__)

News = tuple[str, str, str]  # kind, queue, item id
Listener = Callable[[Sequence[News]], None]

_condition = threading.Condition()
_generation = 0
_listeners: list[Listener] = []


def subscribe(listener: Listener) -> None:
    """Call ``listener(batch)`` after each batch of news: ``(kind, queue, item_id)`` each,
    where ``kind`` is ``claimable``, ``verdict``, ``removed:<reason>`` or ``queue-deleted``."""
    _listeners.append(listener)


def unsubscribe(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def announce(kind: str, queue: str, item_id: str = "") -> None:
    announce_many([(kind, queue, item_id)])


# In a committer process, news also goes back to its server process (engine.process).
forward: Callable[[Sequence[News]], None] | None = None


def announce_many(news: Sequence[News], *, here: Sequence[News] | None = None) -> None:
    """News made in this process: deliver it here and publish it to the others. ``here``:
    what of it this process (and the server a committer process works for) needs, when that
    is less (a group whose claims took every claimable item of a queue has nothing for this
    process's sockets there; the others still hear of it)."""
    if not news or fault("news.lost"):  # (a test's stand-in for news that never arrives)
        return
    local = news if here is None else here
    deliver(local)
    if forward is not None:
        forward(local)
    from . import bus

    try:
        bus.publish(news)
    except Exception:
        log.exception("could not publish news")


POSTING = "posting"


def posting(queue: str) -> None:
    """A post to ``queue`` was just handed to this process's committer: this process's
    listeners may claim for it now, so that the claim joins the post's own group (claims run
    last in a group) rather than wait for the news of its commit. A hint, never published;
    the group leaves out of this process's news what its own claims took (``here``)."""
    for listener in list(_listeners):
        listener([(POSTING, queue, "")])


def deliver(news: Sequence[News]) -> None:
    """Wake this process's long-polls and listeners (``news`` may be empty: a wake-up)."""
    global _generation
    with _condition:
        _generation += 1
        _condition.notify_all()
    for listener in list(_listeners):
        listener(news)


def generation() -> int:
    return _generation


def wait_for_news(since: int, timeout: float) -> int:
    """Block until an event after generation ``since``, or ``timeout`` seconds.

    Returns the generation then current.
    """
    deadline = time.monotonic() + timeout
    with _condition:
        while _generation == since:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            _condition.wait(remaining)
        return _generation
