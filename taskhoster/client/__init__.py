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
worker processes. It imports them when a producer or the worker is first asked for: the
errors and models (``ItemOptions``, which ``taskhoster.local`` shares) come without them.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

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
from .models import (
    AttemptHistory,
    Item,
    ItemAttempt,
    ItemOptions,
    NewItem,
    QueueInfo,
    RateLimit,
    Schedule,
    ScheduleSlot,
    WorkerInfo,
)

if TYPE_CHECKING:
    from .producer import AsyncProducer, Producer
    from .worker import Handler, Job, Worker

#: What is imported on first use, and from where (httpx and websockets come with it).
_LAZY = {
    "AsyncProducer": "producer",
    "Producer": "producer",
    "Handler": "worker",
    "Job": "worker",
    "Worker": "worker",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "APIError",
    "AsyncProducer",
    "AttemptHistory",
    "BadRequest",
    "ConfigError",
    "Conflict",
    "ConnectionFailed",
    "Forbidden",
    "Handler",
    "Item",
    "ItemAttempt",
    "ItemFailed",
    "ItemOptions",
    "Job",
    "NewItem",
    "NotFound",
    "PermanentError",
    "Producer",
    "QueueInfo",
    "RateLimit",
    "RetryableError",
    "Schedule",
    "ScheduleSlot",
    "ServerError",
    "SocketError",
    "TaskhosterError",
    "TooLarge",
    "Unauthorized",
    "WaitTimeout",
    "Worker",
    "WorkerInfo",
]
