"""A socket's frames are handled in order, and a socket with many frames waiting lets the
event loop run others between them (``consumer.FAIR_SHARE``): the consumer's loop takes its
frames without yielding while they wait, so without that turn one busy worker would hold
the loop for all of its frames."""

from __future__ import annotations

import asyncio
from typing import Any

from channels.exceptions import StopConsumer

from taskhoster.work import consumer as consumer_module
from taskhoster.work.consumer import WorkConsumer

FRAMES = 200


def _run(frames: int) -> tuple[list[int], list[int]]:
    """Dispatch ``frames`` messages already waiting in a socket's inbox, beside another task
    that counts how many were handled each time it runs."""
    handled: list[int] = []
    seen_by_other: list[int] = []

    async def dispatch(message: dict[str, Any]) -> None:
        if message["type"] == "websocket.disconnect":
            raise StopConsumer
        handled.append(message["n"])

    async def other() -> None:
        while len(handled) < frames:
            seen_by_other.append(len(handled))
            await asyncio.sleep(0)

    async def main() -> None:
        socket = WorkConsumer()
        socket.dispatch = dispatch  # type: ignore[method-assign]
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for n in range(frames):
            inbox.put_nowait({"type": "websocket.receive", "n": n})
        inbox.put_nowait({"type": "websocket.disconnect"})
        watcher = asyncio.ensure_future(other())
        await asyncio.sleep(0)  # the watcher runs once before the socket's frames
        await socket._consume({"type": "websocket"}, inbox, None)
        await watcher

    asyncio.run(main())
    return handled, seen_by_other


def test_a_sockets_waiting_frames_are_handled_in_order_and_give_the_loop_a_turn() -> None:
    handled, seen_by_other = _run(FRAMES)
    assert handled == list(range(FRAMES))
    # The other task ran between the socket's frames, at most FAIR_SHARE of them apart.
    turns = [n for n in seen_by_other if 0 < n < FRAMES]
    assert turns, "the loop ran nothing else while the socket's frames waited"
    gaps = [b - a for a, b in zip([0, *turns], [*turns, FRAMES], strict=True)]
    assert max(gaps) <= consumer_module.FAIR_SHARE
