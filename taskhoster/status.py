"""The one status vocabulary.

``Status`` is what a producer sees; ``State`` is where the item's file lives. Model choices,
admin labels and wire strings are all derived from these two enums.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """The state directory an item's file is in."""

    PENDING = "pending"
    PROCESSING = "processing"
    DONE = "done"


class Status(StrEnum):
    """An item's status as a producer sees it. ``finished`` and ``failed`` are terminal."""

    PENDING = "pending"
    PROCESSING = "processing"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def state(self) -> State:
        return _STATE_OF[self]

    @property
    def is_terminal(self) -> bool:
        return _STATE_OF[self] is State.DONE

    @classmethod
    def choices(cls) -> list[tuple[str, str]]:
        return [(member.value, member.value.capitalize()) for member in cls]


# Where each status's file lives (looked up: the engine asks several times per item).
_STATE_OF = {
    Status.PENDING: State.PENDING,
    Status.PROCESSING: State.PROCESSING,
    Status.FINISHED: State.DONE,
    Status.FAILED: State.DONE,
}
assert set(_STATE_OF) == set(Status)

LIVE_STATUSES = (Status.PENDING, Status.PROCESSING)
TERMINAL_STATUSES = (Status.FINISHED, Status.FAILED)


class RetainFrom(StrEnum):
    """When the retention clock of a done item starts."""

    FINISHED = "finished"
    FETCHED = "fetched"
