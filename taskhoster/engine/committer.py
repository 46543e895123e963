"""Where operations are handed in: this process's committer, made at its first operation.

Callers from any thread (HTTP requests, the ``/work`` sockets' event loop, the sweep) build an
operation (``ops``) and run it with ``execute`` (a thread waits for the answer) or await it
with ``execute_async`` (an event loop does not block): one operation, typed by its answer,
two ways to wait for it. The committer (``runner.Committer``, a thread, or
``process.ChildCommitter``, a process of its own: ``COMMITTER``) runs it in the next group
commit (``group.Group``), makes its files durable and answers.

A caller inside a database transaction of its own (``transaction.atomic``) runs its operation
right there, as a group of one, so it commits (and announces) with the caller's transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from django.db import connection

from ..conf import get_conf
from . import admission, pacing
from .ops import Op
from .process import CHILD_ENV, ChildCommitter
from .runner import COUNT_SHARDS, Committer, run_group

T = TypeVar("T")

_lock = threading.Lock()
_shard = random.randrange(COUNT_SHARDS)  # for groups run in the caller's own transaction


def committer() -> admission.Committer:
    """This process's committer: a ``runner.Committer`` thread, or with ``COMMITTER =
    "process"`` (the server's default) a ``process.ChildCommitter`` standing for one in a
    process of its own."""
    with _lock:
        found = admission.current()
        if found is None:
            in_child = bool(os.environ.get(CHILD_ENV))
            if get_conf().committer == "process" and not in_child:
                found = ChildCommitter()
            else:
                found = Committer()
            admission.register(found)
        return found


_held = 0  # ``hold_start`` blocks in force


@contextlib.contextmanager
def hold_start() -> Iterator[None]:
    """Within, ``start`` (and ``taskhoster.asgi.start``) does nothing: the committer starts
    at its first operation instead.

    The system checks import the project's ASGI module to look for the ``/work`` route; a
    module that calls ``start`` at import must not start a committer process, or make a
    state root, for that.
    """
    global _held
    with _lock:
        _held += 1
    try:
        yield
    finally:
        with _lock:
            _held -= 1


def start_is_held() -> bool:
    """Whether a ``hold_start`` is in force."""
    with _lock:
        return bool(_held)


def start() -> None:
    """Start this process's committer now rather than at the first operation (a server
    calls this at start-up, so that no request waits for a committer process to start)."""
    if start_is_held():
        return
    committer().start()


def execute(op: Op[T]) -> T:
    """Run ``op`` in the next group and return its answer (or raise its error).

    Inside the caller's own transaction it runs there and then, as a group of one.
    """
    future: Future[T] = Future()
    op.future = future
    op.background = pacing.in_background()
    if connection.in_atomic_block:
        run_group([op], _shard)
    else:
        committer().submit(op)
    return future.result()


def submit_async(op: Op[T]) -> asyncio.Future[T]:
    """From code running on an event loop: hand ``op`` to the next group now; the returned
    future (of this loop) settles with its answer or its error."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()
    op.loop = loop
    op.waiter = waiter
    committer().submit(op)
    return waiter


def submit_many_async(ops: list[Op[Any]]) -> list[asyncio.Future[Any]]:
    """``submit_async`` for several operations at once: handed to the committer together
    (one write to a committer process), so they join the same group; each has its own
    answer. If they cannot be handed in, none is."""
    loop = asyncio.get_running_loop()
    waiters: list[asyncio.Future[Any]] = []
    for op in ops:
        waiter: asyncio.Future[Any] = loop.create_future()
        op.loop = loop
        op.waiter = waiter
        waiters.append(waiter)
    committer().submit_many(ops)
    return waiters


async def execute_async(op: Op[T]) -> T:
    """The same as ``execute`` for a caller on an event loop: it waits without blocking the
    loop."""
    return await submit_async(op)
