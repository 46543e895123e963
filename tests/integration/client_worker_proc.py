"""A worker process built on taskhoster.client, for the tests that signal or kill it.

Run: python client_worker_proc.py URL KEY SLEEP_SECONDS STOP_TIMEOUT. It serves queue ``q``
with capacity 1; its handler prints ``started ID``, sleeps, prints ``finished ID`` (or
``cancelled ID``) and returns ``{"slept": SLEEP_SECONDS}``; ``stopped`` once it has stopped.
"""

from __future__ import annotations

import asyncio
import sys

from taskhoster.client import Job, Worker


def main(url: str, key: str, seconds: float, stop_timeout: float) -> None:
    worker = Worker(url, key, capacity=1, stop_timeout=stop_timeout)

    @worker.handler("q")
    async def handle(job: Job) -> dict[str, float]:
        print(f"started {job.id}", flush=True)
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            print(f"cancelled {job.id}", flush=True)
            raise
        print(f"finished {job.id}", flush=True)
        return {"slept": seconds}

    print("ready", flush=True)
    worker.run()
    print("stopped", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
