"""News that the engine gives after a commit: an item became claimable, an item reached a
verdict, an item a worker may hold was removed.

``announce`` delivers a group's news in this process (a condition variable wakes long-polls at
once; listeners such as the ``/work`` dispatcher are called once with the whole batch) and
publishes it to the other processes through ``bus`` in one message; what a server process hears
from the bus (``bus.listen_in_background``) comes to ``deliver`` too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from . import bus
from .faults import fault

log = logging.getLogger(__name__)

News = tuple[str, str, str]  # kind, queue, item id
# Called with each batch, and whether it came from another process (by the bus).
Listener = Callable[[Sequence[News], bool], None]

_condition = threading.Condition()
_generation = 0
_listeners: list[Listener] = []
# The generation of the latest news naming each item (a verdict, a removal) and each queue
# (claimable, deleted), so that a long-poll wakes for its own news only, not for every
# batch (``wait_for``). Bounded: the oldest are forgotten first (a long-poll whose news was
# forgotten finds out at its next look, ``LONG_POLL_INTERVAL``).
_named: OrderedDict[str, int] = OrderedDict()
NAMED_MOST = 100_000


def subscribe(listener: Listener) -> None:
    """Call ``listener(batch, remote)`` after each batch of news: ``(kind, queue, item_id)``
    each, where ``kind`` is ``claimable``, ``verdict``, ``removed:<reason>``,
    ``queue-deleted`` (or ``key-revoked``, ``posting``); ``remote``: it came from another
    process, by the bus."""
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
        listener([(POSTING, queue, "")], False)


def deliver(news: Sequence[News], *, remote: bool = False) -> None:
    """Wake this process's long-polls and listeners (``news`` may be empty: a wake-up).
    ``remote``: news of another process, heard on the bus (``bus.listen_in_background``)."""
    global _generation
    with _condition:
        _generation += 1
        for piece in news:
            name = _name_of(piece)
            if name:
                _named[name] = _generation
                _named.move_to_end(name)
        while len(_named) > NAMED_MOST:
            _named.popitem(last=False)
        _condition.notify_all()
    for listener in list(_listeners):
        listener(news, remote)


def _heard(news: Sequence[News]) -> None:
    deliver(news, remote=True)


bus.hear_with(_heard)  # what this process hears on the bus is delivered here


def _name_of(piece: News) -> str:
    """What a long-poll waits on, for a piece of news: ``i:<item id>`` (a verdict, a
    removal), ``c:<queue>`` (claimable), ``d:<queue>`` (deleted); "" for the rest."""
    kind, queue, item_id = piece
    if kind == "claimable":
        return f"c:{queue}"
    if kind == "queue-deleted":
        return f"d:{queue}"
    if kind == "verdict" or kind.startswith("removed:"):
        return f"i:{item_id}"
    return ""


def named_since(names: Sequence[str], since: int) -> bool:
    """Whether news after generation ``since`` named any of ``names`` (``_name_of``)."""
    return any(_named.get(name, 0) > since for name in names)


def wait_for(names: Sequence[str], since: int, timeout: float) -> int:
    """Block until news after generation ``since`` names one of ``names`` (``_name_of``), or
    ``timeout`` seconds; the generation then current. Other news wakes the thread only to
    look at a dictionary, never the database."""
    deadline = time.monotonic() + timeout
    with _condition:
        while not named_since(names, since):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            _condition.wait(remaining)
        return _generation


def generation() -> int:
    return _generation
