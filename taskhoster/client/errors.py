"""What the client raises, and what a worker's handler may raise.

Every error answer of the server (``{"error": {"code", "message"}}``) becomes an
:class:`APIError` subclass chosen by the HTTP status, carrying the server's ``code`` and
``message``; over the ``/work`` socket, an ``error`` frame becomes a :class:`SocketError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models import Item


class TaskhosterError(Exception):
    """The root of everything the client raises."""

    def __init__(self, message: str, *, code: str = "error", status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status

    def __str__(self) -> str:
        where = f"{self.status} " if self.status is not None else ""
        return f"{where}{self.code}: {self.message}"


class ConfigError(TaskhosterError):
    """No server address or key could be found, or an argument is not usable."""


class ConnectionFailed(TaskhosterError):
    """The server could not be reached (after the retries that were safe to make)."""


class APIError(TaskhosterError):
    """The server answered with an error (``status``, ``code`` and ``message`` are its own)."""


class BadRequest(APIError):
    """400: the request is not valid."""


class Unauthorized(APIError):
    """401: missing or wrong key."""


class Forbidden(APIError):
    """403: the key lacks the scope, or may not use the queue."""


class NotFound(APIError):
    """404: no such queue or item (``code`` says which)."""


class Conflict(APIError):
    """409: the item is not in a state that allows this (e.g. restarting a live item)."""


class TooLarge(APIError):
    """413: a payload, result, batch or body is larger than the server allows."""


class ServerError(APIError):
    """5xx: the server could not do it (retried where that was safe)."""


class SocketError(TaskhosterError):
    """An ``error`` frame on the ``/work`` socket."""


class WaitTimeout(TaskhosterError, TimeoutError):
    """An item was not terminal by the end of the wait."""

    def __init__(self, message: str, item: Item) -> None:
        super().__init__(message, code="wait_timeout")
        self.item = item


class ItemFailed(TaskhosterError):
    """The item ended ``failed`` (its ``error`` is the message); ``item`` is the item."""

    def __init__(self, item: Item) -> None:
        super().__init__(item.error or "failed", code="item_failed")
        self.item = item


class RetryableError(Exception):
    """Raise from a handler: the item failed this time and should be retried (with backoff,
    while attempts are left)."""


class PermanentError(Exception):
    """Raise from a handler: the item failed and must not be retried (it fails now, and goes
    to the queue's dead-letter queue if it has one)."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
}


def api_error(status: int, code: str, message: str) -> APIError:
    """The exception for an error answer."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else APIError
    return cls(message, code=code, status=status)
