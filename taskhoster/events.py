"""News that the engine gives after a commit: an item became claimable, an item reached a
verdict, an item a worker may hold was removed.

``announce`` delivers the news in this process (a condition variable wakes long-polls at once;
listeners such as the ``/work`` dispatcher are called) and publishes it to the other processes
through ``bus``; a server process hands what it hears from the bus to ``deliver``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_condition = threading.Condition()
_generation = 0
Listener = Callable[[str, str, str], None]
_listeners: list[Listener] = []


def subscribe(listener: Listener) -> None:
    """Call ``listener(kind, queue, item_id)`` after each event.

    ``kind`` is ``claimable``, ``verdict`` or ``removed:<reason>``.
    """
    _listeners.append(listener)


def unsubscribe(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def announce(kind: str, queue: str, item_id: str = "") -> None:
    """News made in this process: deliver it here and publish it to the others."""
    deliver(kind, queue, item_id)
    from . import bus

    try:
        bus.publish(kind, queue, item_id)
    except Exception:
        log.exception("could not publish news")


def deliver(kind: str, queue: str, item_id: str = "") -> None:
    """Wake this process's long-polls and listeners."""
    global _generation
    with _condition:
        _generation += 1
        _condition.notify_all()
    for listener in list(_listeners):
        listener(kind, queue, item_id)


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
