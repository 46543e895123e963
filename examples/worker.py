"""A worker for the "greetings" queue: up to four items at once; Ctrl-C stops it gracefully.

Run from the repository root while ``scripts/serve`` runs:

    .venv/bin/python examples/worker.py

The server and key come from TASKHOSTER_URL and TASKHOSTER_KEY, else from the defaults of
``scripts/serve`` (http://127.0.0.1:8000 and the key it saved in var/credentials.json).
"""

import asyncio
import logging

from taskhoster.client import Job, PermanentError, Producer, Worker

logging.basicConfig(format="%(asctime)s %(message)s")
logging.getLogger("taskhoster").setLevel(logging.INFO)  # what the worker does with each item

with Producer() as producer:  # the worker may start before any producer: make the queue
    producer.put_queue("greetings", lease_seconds=30, max_attempts=3)

worker = Worker(capacity=4)


@worker.handler("greetings")
async def greet(job: Job) -> dict[str, str]:
    name = job.payload.get("name")
    if not name:
        raise PermanentError("no name to greet")  # fails now; no retry
    await asyncio.sleep(1)  # the real work; the lease is extended while it runs
    return {"greeting": f"Hello, {name}!"}


worker.run()
