"""A worker process that records, from its own side, every interval in which it held an item.

Run: python lease_worker.py NAME KEY LOGFILE SEED SOCKETS URL [URL ...]. It keeps SOCKETS
``/work`` sockets open at once (socket n to URL n mod len(URLs), so its sockets are spread
over every server process), each subscribed to queue ``stress`` with capacity 3, and for each
item pushed to it picks at random: a result after a short piece of work (most items); a
result after a slow one; a retryable fail; or dropping its socket without a close handshake,
holding whatever it holds (the socket then reconnects, and sends some of the dropped items'
results late, on its new socket: rule 3 takes a result whoever sends it).

Every held interval is one JSON line in LOGFILE: ``{"ev": "held", "id", "thread", "lease",
"start", "end", "how"}``, ``start`` taken when the item frame was read and ``end`` before the
frame that gives the item up was sent (a result or a fail), before the socket was dropped,
or when a ``cancel`` arrived. A late result is ``{"ev": "late-sent", "id", "sent"}`` when it
is sent and ``{"ev": "late", "id", "sent", "accepted"}`` when its ack comes, ``sent`` taken
before it was sent; its value is ``{"late": true, "by", "sent"}``, so the item's stored
result tells which late result won even when the socket dropped before the ack could come.
Times are ``time.monotonic()``, which every process of the machine shares. So a correct
server never gives an item, or two members of one thread, to two holders whose intervals
overlap (up to an accepted late result, which ends every holder's claim on the item). It
runs until SIGTERM, then closes its sockets cleanly and writes what it still holds as held
until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from typing import Any

import websockets

QUEUE = "stress"
CAPACITY = 3


class Log:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a")  # noqa: SIM115 (closed at exit)

    def write(self, **entry: Any) -> None:
        self.file.write(json.dumps(entry) + "\n")


class Socket:
    """One ``/work`` socket, reconnected whenever it drops."""

    def __init__(self, worker: Worker, n: int, url: str) -> None:
        self.worker = worker
        self.n = n
        self.url = url
        self.rng = random.Random(worker.seed * 1000 + n)
        self.late: list[str] = []  # dropped items whose results go out late

    async def run(self) -> None:
        while not self.worker.stopping.is_set():
            with contextlib.suppress(OSError, websockets.WebSocketException, TimeoutError):
                await self.session()
            await asyncio.sleep(0.05)

    async def session(self) -> None:
        ws = await websockets.connect(
            self.url,
            additional_headers={"Authorization": f"Token {self.worker.key}"},
            open_timeout=5,
            max_size=8 * 1024 * 1024,
        )
        held: dict[str, dict[str, Any]] = {}
        awaiting: list[dict[str, Any]] = []  # frames sent, in order, awaiting their ack
        dropped = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()
        log = self.worker.log

        def give_up(item_id: str, how: str) -> None:
            holding = held.pop(item_id, None)
            if holding is not None:
                log.write(ev="held", end=time.monotonic(), how=how, **holding)

        async def send(frame: dict[str, Any]) -> None:
            awaiting.append(frame)
            await ws.send(json.dumps(frame))

        async def handle(item: dict[str, Any]) -> None:
            # The socket may go meanwhile: what it held ends in ``finally`` below.
            with contextlib.suppress(websockets.WebSocketException):
                await work_on(item)

        async def work_on(item: dict[str, Any]) -> None:
            item_id = item["id"]
            roll = self.rng.random()
            if roll < 0.03:
                # Drop the socket, holding everything: as a worker that crashed. Its items
                # end here, on the worker's side, before the server can hear of it.
                for other in list(held):
                    give_up(other, "dropped")
                    if self.rng.random() < 0.5:
                        self.late.append(other)
                dropped.set()
                ws.transport.abort()
                return
            if roll < 0.11:
                await asyncio.sleep(self.rng.random() * 0.01)
                if dropped.is_set() or item_id not in held:
                    return
                give_up(item_id, "fail")
                await send({"type": "fail", "id": item_id, "error": "stress", "retry": True})
                return
            work = self.rng.random() * (0.25 if roll < 0.25 else 0.02)
            await asyncio.sleep(work)
            if dropped.is_set() or item_id not in held:
                return
            give_up(item_id, "result")
            await send({"type": "result", "id": item_id, "result": {"by": self.worker.name}})

        async def send_late() -> None:
            await asyncio.sleep(0.1 + self.rng.random() * 0.2)
            while self.late and not dropped.is_set():
                item_id = self.late.pop()
                sent = time.monotonic()
                # The result names its sending, so the test learns from the item itself
                # whether this late result won, even when the socket drops before its ack.
                late = {"late": True, "by": f"{self.worker.name}.{self.n}", "sent": sent}
                frame = {"type": "result", "id": item_id, "result": late}
                awaiting.append({**frame, "sent": sent})
                log.write(ev="late-sent", id=item_id, sent=sent)
                await ws.send(json.dumps(frame))

        async def late_results() -> None:
            with contextlib.suppress(websockets.WebSocketException):
                await send_late()

        await ws.send(json.dumps({"type": "subscribe", "queues": [QUEUE], "capacity": CAPACITY}))
        tasks.add(asyncio.create_task(late_results()))
        try:
            async for raw in ws:
                frame = json.loads(raw)
                kind = frame.get("type")
                if kind == "item":
                    held[frame["id"]] = {
                        "id": frame["id"],
                        "thread": frame.get("threadId"),
                        "lease": frame["lease"],
                        "start": time.monotonic(),
                        "w": f"{self.worker.name}.{self.n}",
                    }
                    task = asyncio.create_task(handle(frame))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif kind == "ack":
                    mine = awaiting.pop(0) if awaiting else {}
                    if "sent" in mine:
                        log.write(
                            ev="late", id=mine["id"], sent=mine["sent"], accepted=frame["accepted"]
                        )
                elif kind == "cancel":
                    give_up(frame["id"], "cancel")
                if self.worker.stopping.is_set():
                    break
        except websockets.WebSocketException:
            pass
        finally:
            for task in tasks:
                task.cancel()
            for item_id in list(held):
                give_up(item_id, "closed")
            if not dropped.is_set():
                await ws.close()


class Worker:
    def __init__(self, name: str, key: str, log_path: str, seed: int) -> None:
        self.name = name
        self.key = key
        self.seed = seed
        self.log = Log(log_path)
        self.stopping = asyncio.Event()


def main() -> None:
    name, key, log_path, seed, sockets, *urls = sys.argv[1:]
    loop = asyncio.new_event_loop()
    worker = Worker(name, key, log_path, int(seed))
    loop.add_signal_handler(signal.SIGTERM, worker.stopping.set)
    runners = [
        loop.create_task(Socket(worker, n, urls[n % len(urls)]).run()) for n in range(int(sockets))
    ]
    loop.run_until_complete(worker.stopping.wait())
    for runner in runners:
        runner.cancel()
    loop.run_until_complete(asyncio.gather(*runners, return_exceptions=True))
    worker.log.file.close()


if __name__ == "__main__":
    main()
