"""A small websocket client for the socket tests (the `websockets` library, for real)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets


def ws_url(server: Any) -> str:
    return server.url.replace("http://", "ws://") + "/work"


async def connect(server: Any, key: str | None) -> Any:
    headers = {"Authorization": f"Token {key}"} if key else {}
    return await websockets.connect(
        ws_url(server), additional_headers=headers, max_size=8 * 1024 * 1024
    )


async def send(ws: Any, frame: dict[str, Any]) -> None:
    await ws.send(json.dumps(frame))


async def recv(ws: Any, timeout: float = 5.0) -> dict[str, Any]:
    return dict(json.loads(await asyncio.wait_for(ws.recv(), timeout)))


async def recv_none(ws: Any, timeout: float = 0.5) -> None:
    """Assert that nothing arrives within ``timeout`` seconds."""
    try:
        frame = await asyncio.wait_for(ws.recv(), timeout)
    except TimeoutError:
        return
    raise AssertionError(f"unexpected frame {frame}")


async def subscribe(ws: Any, queues: list[str], capacity: int) -> None:
    await send(ws, {"type": "subscribe", "queues": queues, "capacity": capacity})
