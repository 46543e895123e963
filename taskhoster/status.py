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
        if self in (Status.FINISHED, Status.FAILED):
            return State.DONE
        return State(self.value)

    @property
    def is_terminal(self) -> bool:
        return self.state is State.DONE

    @classmethod
    def choices(cls) -> list[tuple[str, str]]:
        return [(member.value, member.value.capitalize()) for member in cls]


LIVE_STATUSES = (Status.PENDING, Status.PROCESSING)
TERMINAL_STATUSES = (Status.FINISHED, Status.FAILED)


class RetainFrom(StrEnum):
    """When the retention clock of a done item starts."""

    FINISHED = "finished"
    FETCHED = "fetched"
