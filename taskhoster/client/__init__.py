"""The Taskhoster client: producers over the REST API, workers over the ``/work`` socket.

    from taskhoster.client import Producer, Worker

    with Producer() as producer:                 # $TASKHOSTER_URL, $TASKHOSTER_KEY
        item = producer.post("emails", {"to": "ada@example.com"})
        print(producer.result(item.id, timeout=30))

    worker = Worker(capacity=4)

    @worker.handler("emails")
    async def send(job):
        return {"sent": job.payload["to"]}

    worker.run()

This package needs only httpx and websockets: it does not import Django, so it runs in plain
worker processes.
"""

from .errors import (
    APIError,
    BadRequest,
    ConfigError,
    Conflict,
    ConnectionFailed,
    Forbidden,
    ItemFailed,
    NotFound,
    PermanentError,
    RetryableError,
    ServerError,
    SocketError,
    TaskhosterError,
    TooLarge,
    Unauthorized,
    WaitTimeout,
)
from .models import Item, NewItem, QueueInfo
from .producer import AsyncProducer, Producer
from .worker import Handler, Job, Worker

__all__ = [
    "APIError",
    "AsyncProducer",
    "BadRequest",
    "ConfigError",
    "Conflict",
    "ConnectionFailed",
    "Forbidden",
    "Handler",
    "Item",
    "ItemFailed",
    "Job",
    "NewItem",
    "NotFound",
    "PermanentError",
    "Producer",
    "QueueInfo",
    "RetryableError",
    "ServerError",
    "SocketError",
    "TaskhosterError",
    "TooLarge",
    "Unauthorized",
    "WaitTimeout",
    "Worker",
]
