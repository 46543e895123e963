"""What a group changed beside its rows and files: the queues' status counts, the news to
announce, the metrics to count. Collected while the group runs; announced once it commits."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from .. import events, metrics
from ..faults import raise_if_armed
from ..status import Status
from ..timeutil import to_wire
from .rules import ItemRow

# News: a queue's rate window opens at the time carried in the item id's place.
OPENS = "opens"


@dataclass
class Tally:
    counts: Counter[tuple[int, str]] = field(default_factory=Counter)
    news: list[tuple[str, str, str]] = field(default_factory=list)
    counters: Counter[tuple[str, str]] = field(default_factory=Counter)
    latencies: list[tuple[str, float]] = field(default_factory=list)
    # Queues whose claims in this group took everything claimable there was.
    exhausted: set[str] = field(default_factory=set)

    def status(self, row: ItemRow, status: Status) -> None:
        """The row's status changes: counted out of its old status, into the new."""
        if row.status is not status:
            self.counts[(row.queue_id, row.status.value)] -= 1
            self.counts[(row.queue_id, status.value)] += 1
            row.set(status=status)

    def created(self, queue_id: int, queue_name: str, *, claimable: bool) -> None:
        """A new item (pending), counted; announced if claimable now."""
        self.counts[(queue_id, Status.PENDING.value)] += 1
        if claimable:
            self.claimable(queue_name)

    def gone(self, row: ItemRow) -> None:
        self.counts[(row.queue_id, row.status.value)] -= 1

    def claimable(self, queue_name: str) -> None:
        self.news.append(("claimable", queue_name, ""))

    def opens(self, queue_name: str, at: datetime) -> None:
        """A queue's claims are held back by its rate limit until ``at``: every process's
        waiting workers are told when to look again."""
        self.news.append((OPENS, queue_name, to_wire(at) or ""))

    def count(self, queue_name: str, counter: str, amount: int = 1) -> None:
        self.counters[(queue_name, counter)] += amount

    def announce(self) -> None:
        """After the commit: the news to every process's sockets, the metrics counted."""
        raise_if_armed("group.announce")  # tests: what fails after a commit cannot undo it
        news = list(dict.fromkeys(self.news))
        # This process's claims in this group took everything claimable of these queues:
        # its sockets need not look again (other processes' still do).
        here = [n for n in news if not (n[0] == "claimable" and n[1] in self.exhausted)]
        events.announce_many(news, here=here if len(here) < len(news) else None)
        for (queue, name), amount in self.counters.items():
            metrics.count(queue, name, amount)
        for queue, seconds in self.latencies:
            metrics.observe_latency(queue, seconds)
