"""The one error root of Taskhoster.

Domain code raises these; one DRF exception handler and one socket helper turn them into
``{"error": {"code", "message"}}``. The core never knows about HTTP: ``http_status`` is a hint
that the API layer reads, nothing more.
"""

from __future__ import annotations

from typing import Any


class TaskhosterError(Exception):
    code = "error"
    http_status = 400

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()
        if code is not None:
            self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps its code when it crosses to another process (the committer's answers).
        return (_rebuild, (type(self), self.message, self.code))


def _rebuild(cls: type[TaskhosterError], message: str, code: str) -> TaskhosterError:
    return cls(message, code=code)


class InvalidInput(TaskhosterError):
    """The request is not valid."""

    code = "invalid"
    http_status = 400


class NotFound(TaskhosterError):
    """No such object."""

    code = "not_found"
    http_status = 404


class QueueNotFound(NotFound):
    """No such queue."""

    code = "queue_not_found"


class ItemNotFound(NotFound):
    """No such item."""

    code = "item_not_found"


class ScheduleNotFound(NotFound):
    """No such schedule in the queue."""

    code = "schedule_not_found"


class WorkerNotFound(NotFound):
    """No such worker socket (or its server process is gone)."""

    code = "worker_not_found"


class KeyRefused(TaskhosterError):
    """The key is unknown or revoked (``keys.refusal``, for the views and for the engine's
    group, which checks the key of a post answered on the event loop)."""

    code = "unauthorized"
    http_status = 401


class KeyForbidden(KeyRefused):
    """A live key that may not do this here."""

    code = "forbidden"
    http_status = 403


class Conflict(TaskhosterError):
    """The object is not in a state that allows this."""

    code = "conflict"
    http_status = 409


class TooLarge(TaskhosterError):
    """The request or a value in it is larger than allowed."""

    code = "too_large"
    http_status = 413


class Overloaded(TaskhosterError):
    """The server is behind: it refuses new work at once rather than queue it (try again
    after ``retry_after`` seconds, the ``Retry-After`` of the answer)."""

    code = "overloaded"
    http_status = 503

    def __init__(self, message: str = "", *, code: str | None = None, retry_after: float = 1):
        super().__init__(message, code=code)
        self.retry_after = retry_after


class StoreError(TaskhosterError):
    """The state directories could not be read or written."""

    code = "store_error"
    http_status = 503


class StoreWriteFailed(StoreError):
    """The state root did not take a group's write or its flush (full, read-only, an I/O
    error). Its operations changed nothing (the group undid its files and rolled back), or,
    its flush failing after its commit, may have: made again, an operation is taken once,
    as after ``OutcomeUnknown``. A socket's frame hears ``unavailable`` (send it again)."""


class NotYetDurable(StoreWriteFailed):
    """An item's file was left by a flush that failed after its group committed (in this
    process or another: ``Item.unflushed``), and is not yet written again: nothing about it
    is changed or acknowledged meanwhile. Refuses its operation alone, not its group."""

    def __init__(self, message: str = "", **kwargs: Any) -> None:
        super().__init__(message or NOT_YET_DURABLE, **kwargs)


NOT_YET_DURABLE = (
    "the state root failed to make files durable; nothing is changed until they are "
    "written again: try again later"
)


class OutcomeUnknown(StoreError):
    """The database connection was lost during the commit and the database could not be
    asked, in time, whether it committed: nothing is acknowledged, the state directories are
    left as the operation wrote them (as a crash before its commit leaves them) until the
    database answers (then they are put back if it rolled back: ``engine.giveback``), or
    ``manage.py sweep --repair`` brings the index in line with them."""
