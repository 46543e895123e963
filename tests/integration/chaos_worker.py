"""A misbehaving worker process for the cross-process fault test.

Run: python chaos_worker.py NAME KEY LOGFILE SEED URL [URL ...]. It holds one ``/work``
socket at a time (to the first of the URLs that answers, rotating on every reconnect),
subscribes to queue ``chaos`` with capacity 4 and, for each item pushed to it, picks at
random: answer with a result at once (most items); fail it with ``retry``; extend, then
answer; hold it past its lease and answer late; or drop the socket without a close
handshake, holding whatever it holds. Every item received, every frame sent and every ack
is one JSON line in LOGFILE (a result's value names the worker and the lease it was sent
under). It runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import time
from typing import Any

import websockets

QUEUE = "chaos"
CAPACITY = 4


class Chaos:
    def __init__(self, name: str, key: str, log_path: str, seed: int, urls: list[str]) -> None:
        self.name = name
        self.key = key
        self.log = open(log_path, "a")  # noqa: SIM115 (closed at exit)
        self.rng = random.Random(seed)
        self.urls = urls
        self.turn = 0
        self.stopping = asyncio.Event()

    def write(self, **entry: Any) -> None:
        entry["t"] = time.time()
        entry["w"] = self.name
        self.log.write(json.dumps(entry) + "\n")
        self.log.flush()

    async def run(self) -> None:
        while not self.stopping.is_set():
            url = self.urls[self.turn % len(self.urls)]
            self.turn += 1
            try:
                await self.session(url)
            except (OSError, websockets.WebSocketException, TimeoutError) as exc:
                self.write(ev="disconnected", url=url, why=type(exc).__name__)
            await asyncio.sleep(0.1)

    async def session(self, url: str) -> None:
        ws = await websockets.connect(
            url, additional_headers={"Authorization": f"Token {self.key}"}, open_timeout=3
        )
        self.write(ev="connected", url=url)
        sent: list[dict[str, Any]] = []  # frames awaiting their ack, in order
        tasks: set[asyncio.Task[None]] = set()
        dropped = asyncio.Event()

        async def send(frame: dict[str, Any]) -> None:
            if dropped.is_set():
                return
            sent.append(frame)
            self.write(ev="send", **frame)
            await ws.send(json.dumps(frame))

        async def handle(item: dict[str, Any]) -> None:
            lease = item["lease"]
            value = {"w": self.name, "lease": lease}
            roll = self.rng.random()
            try:
                if roll < 0.04:
                    self.write(ev="drop", id=item["id"])
                    dropped.set()
                    ws.transport.abort()  # no close handshake: as a crashed worker
                    return
                if roll < 0.12:
                    await send({"type": "fail", "id": item["id"], "error": "chaos", "retry": True})
                    return
                if roll < 0.20:
                    # Late: past the lease (and the sweep), then a result all the same.
                    lapse = max(0.0, item_expiry(item) - time.time())
                    await asyncio.sleep(lapse + 1.0)
                    self.write(ev="late", id=item["id"])
                elif roll < 0.30:
                    await send({"type": "extend", "id": item["id"], "seconds": 5})
                    await asyncio.sleep(0.05)
                else:
                    await asyncio.sleep(self.rng.random() * 0.02)
                await send({"type": "result", "id": item["id"], "result": value})
            except websockets.WebSocketException:
                pass

        await ws.send(json.dumps({"type": "subscribe", "queues": [QUEUE], "capacity": CAPACITY}))
        try:
            async for raw in ws:
                frame = json.loads(raw)
                kind = frame.get("type")
                if kind == "item":
                    self.write(
                        ev="item",
                        id=frame["id"],
                        attempts=frame["attempts"],
                        lease=frame["lease"],
                        thread=frame.get("threadId"),
                    )
                    task = asyncio.create_task(handle(frame))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif kind == "ack":
                    mine = sent.pop(0) if sent else {}
                    self.write(
                        ev="ack",
                        id=frame["id"],
                        accepted=frame["accepted"],
                        kind=mine.get("type"),
                        result=mine.get("result"),
                        mine=mine.get("id"),
                    )
                elif kind == "cancel":
                    self.write(ev="cancel", id=frame["id"], reason=frame.get("reason"))
                elif kind == "error":
                    self.write(ev="error", code=frame.get("code"), message=frame.get("message"))
                if self.stopping.is_set():
                    break
        finally:
            for task in tasks:
                task.cancel()
            if not dropped.is_set():
                await ws.close()
            self.write(ev="closed", url=url)


def item_expiry(item: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(item["leaseExpiresAt"].replace("Z", "+00:00")).timestamp()


def main() -> None:
    name, key, log_path, seed, *urls = sys.argv[1:]
    chaos = Chaos(name, key, log_path, int(seed), urls)
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, chaos.stopping.set)
    runner = loop.create_task(chaos.run())
    loop.run_until_complete(chaos.stopping.wait())
    runner.cancel()
    loop.run_until_complete(asyncio.gather(runner, return_exceptions=True))
    chaos.log.close()


if __name__ == "__main__":
    main()
