"""News that the engine gives after a commit: an item became claimable, an item reached a
verdict, an item a worker may hold was removed.

Within one process a condition variable wakes long-polls at once; other processes notice on
their next poll (``LONG_POLL_INTERVAL``). The ``/work`` socket subscribes here to carry the
news across processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_condition = threading.Condition()
_generation = 0
Listener = Callable[[str, str, str], None]
_listeners: list[Listener] = []


def subscribe(listener: Listener) -> None:
    """Call ``listener(kind, queue, item_id)`` after each event (kind: claimable, verdict, removed)."""
    _listeners.append(listener)


def announce(kind: str, queue: str, item_id: str = "") -> None:
    global _generation
    with _condition:
        _generation += 1
        _condition.notify_all()
    for listener in list(_listeners):
        listener(kind, queue, item_id)


def generation() -> int:
    return _generation


def wait_for_news(since: int, timeout: float) -> int:
    """Block until an event after generation ``since`` or ``timeout`` seconds; return the generation."""
    deadline = time.monotonic() + timeout
    with _condition:
        while _generation == since:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            _condition.wait(remaining)
        return _generation
