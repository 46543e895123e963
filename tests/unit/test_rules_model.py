"""The lifecycle's rules alone (``engine.rules``), against a model of the seeds, at speed.

No database and no files: ``Sim`` is the smallest orchestrator there can be (a dict of rows,
a dict of threads, a clock) that asks the pure rules what to do and does exactly what they
decide, as ``group.Group`` does with files and rows. ``Model`` is written from the words of
``SPEC.md`` section 3 and the seeds, and takes nothing from the engine's code. A Hypothesis
state machine drives both through every rule:

- posts (threaded or not, due, tied or in the future), claims of one or several;
- results (from the holder, late from a lapsed or dropped attempt, for a pending item, for a
  terminal one), retryable and final fails (also from stale leases and without a lease);
- extends (also stale, and asking more than ``leaseSeconds``), socket drops (current and stale
  leases), releases of unsent claims;
- the sweep's clocks: lapses, queue timeouts, retention from finished and from fetched;
  producers' first reads (fetched), deletes of any status, restarts (also refused ones);
- queues with and without a dead-letter queue, ``maxAttempts`` unlimited or 1-3, backoffs;
- flow control (section 8.1): posts of priorities 0-2, pause and resume, ``threadLimit`` 1-3
  (changed while items wait: every thread recounted), ``maxProcessing``, ``rateLimit``.

After every step each item's status, attempts, ``scheduledAt``, lease expiry, error,
dead-letter copy and retention clock, each thread's head, and the claimable order are compared
with the model, and I2 (one verdict per arrival), I3 (at most ``threadLimit`` processing
members per thread: one by default), I4 (threads claimed in head order, a freed thread's head
promoted at once), I5 (nothing live after ``postedAt + queueSeconds`` once the sweep ran), and
the controls (no claim while paused, never more than ``maxProcessing`` processing, never more
than ``rateLimit.count`` claims started in any window) are checked.

The real engine is driven by the same kind of machine in ``test_thread_model.py`` (real files,
a real database, a bounded number of sequences); this one runs ``EXAMPLES`` sequences of up to
``STEPS`` steps in every run, and says how many steps it took.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from taskhoster.engine import posts, rules
from taskhoster.engine.rules import (
    Clock,
    ItemRow,
    Keep,
    Move,
    QueueInfo,
    RateLimit,
    Refuse,
    Remove,
    ThreadEffect,
    ThreadState,
)
from taskhoster.status import RetainFrom, Status

from .fair_order import fair_order

EXAMPLES = int(os.environ.get("TASKHOSTER_RULES_EXAMPLES", "400"))
STEPS = int(os.environ.get("TASKHOSTER_RULES_STEPS", "60"))
T0 = datetime(2026, 1, 1, tzinfo=UTC)
THREADS = ("a", "b", "c")
QUEUE, DLQ = 1, 2


def secs(value: float) -> timedelta:
    return timedelta(seconds=value)


# -- the simulator: the rules, and nothing else ------------------------------------------------


class Sim:
    """An engine without a database: every decision is the rules'; this only stores it."""

    def __init__(self, queue: QueueInfo, dlq: QueueInfo) -> None:
        self.queues = {queue.id: queue, dlq.id: dlq}
        self.rows: dict[str, ItemRow] = {}
        self.threads: dict[tuple[int, str], ThreadState] = {}
        self.copies: list[ItemRow] = []  # dead-letter copies, in the order they were made
        self.verdicts: dict[tuple[str, str], int] = {}  # (id, seq) -> verdicts made
        self.news: list[tuple[str, str]] = []
        self.starts: list[tuple[datetime, int]] = []  # claims started (rate limit's log)
        # Each item's ended attempts, from the lines its moves wrote (section 8.2).
        self.stories: dict[str, list[tuple[int, str, str | None, str | None]]] = {}

    def queue(self, row: ItemRow) -> QueueInfo:
        return self.queues[row.queue_id]

    def thread(self, row: ItemRow) -> ThreadState:
        assert row.thread_id is not None
        key = (row.queue_id, row.thread_id)
        if key not in self.threads:
            self.threads[key] = ThreadState(row.queue_id, row.thread_id, "q")
        return self.threads[key]

    def apply(self, row: ItemRow, decision: rules.Decision, at: datetime) -> None:
        if isinstance(decision, Keep):
            return
        if isinstance(decision, Refuse):
            raise decision.error
        if isinstance(decision, Remove):
            del self.rows[row.id]
            self.stories.pop(row.id, None)
            if not row.is_terminal:
                self.effect(row, ThreadEffect.LEAVE)
            return
        changes = dict(decision.changes)
        if decision.dead_letter:
            target = self.queue(row).dead_letter_queue
            if target is not None:
                copy = new_row(f"d{len(self.copies):04d}", DLQ, None, at, at)
                copy.origin = {
                    "queue": "q",
                    "id": row.id,
                    "error": changes["error"],
                    "attempts": row.attempts,
                }
                copy.eligible = True
                self.copies.append(copy)
                changes["dead_letter"] = copy.id
        ended = (decision.patch or {}).get("ended")
        if ended is not None:
            entry = (ended["attempt"], ended["outcome"], ended["error"], ended["worker"])
            self.stories.setdefault(row.id, []).append(entry)
        if decision.kind is rules.Kind.VERDICT:
            key = (row.id, row.seq)
            self.verdicts[key] = self.verdicts.get(key, 0) + 1
        row.set(status=decision.status)
        row.set(**changes)
        self.effect(row, decision.thread)
        self.news.extend((n, row.id) for n in decision.news)

    def effect(self, row: ItemRow, effect: ThreadEffect) -> None:
        if row.thread_id is not None:
            rules.apply_to_thread(self.thread(row), row.id, effect)

    def line(self, key: tuple[int, str], limit: int) -> rules.Line:
        """The thread's members as the index gives them (``rows.thread_line``)."""
        members = [r for r in self.rows.values() if (r.queue_id, r.thread_id) == key]
        pending = sorted((r for r in members if r.status is Status.PENDING), key=rules.line_order)
        return rules.Line(
            processing=[r.id for r in members if r.status is Status.PROCESSING][:limit],
            pending=[r.id for r in pending[:limit]],
        )

    def settle(self) -> None:
        for key, thread in list(self.threads.items()):
            limit = self.queues[key[0]].thread_limit
            settled = rules.settle(thread, partial(self.line, key, limit), limit)
            if settled is None:
                continue
            for item_id in settled.unmark:
                if item_id in self.rows:
                    self.rows[item_id].eligible = False
            if settled.delete:
                del self.threads[key]
                continue
            for item_id in settled.mark:
                if self.rows[item_id].status is Status.PENDING:
                    self.rows[item_id].eligible = True

    def candidates(self, at: datetime) -> list[ItemRow]:
        """What the claim query finds: eligible and due, in claim order."""
        found = [
            r
            for r in self.rows.values()
            if r.queue_id == QUEUE and r.eligible and r.scheduled_at <= at
        ]
        return sorted(found, key=rules.claim_order)

    def may_take(self, row: ItemRow) -> bool:
        thread = self.threads.get((row.queue_id, row.thread_id)) if row.thread_id else None
        return rules.may_take(row, thread, self.queues[row.queue_id].thread_limit)

    def claimable(self, at: datetime) -> list[ItemRow]:
        return [row for row in self.candidates(at) if self.may_take(row)]

    def claim(self, want: int, at: datetime, leases: itertools.count[int]) -> list[ItemRow]:
        """As ``claims.Claims`` does: the controls' budget, then the candidates in claim
        order, a thread's second member after the other threads' heads of its priority."""
        queue = self.queues[QUEUE]
        window = queue.rate_limit.seconds if queue.rate_limit else 0.0
        started = sum(n for t, n in self.starts if t > at - secs(window))
        processing = sum(
            1 for r in self.rows.values() if r.queue_id == QUEUE and r.status is Status.PROCESSING
        )
        budget, _held = rules.claim_budget(queue, want, processing=processing, started=started)
        taken: list[ItemRow] = []
        seconds: list[ItemRow] = []
        taken_from: set[str] = set()

        def take(row: ItemRow) -> None:
            if not self.may_take(row):
                return
            move = rules.claim(row, self.queue(row), lease=f"L{next(leases)}", at=at)
            row.set(status=move.status)
            row.set(**move.changes)
            if row.thread_id is not None:
                rules.take_head(self.threads[(row.queue_id, row.thread_id)], row.id)
                taken_from.add(row.thread_id)
            taken.append(row)

        for row in self.candidates(at) if budget > 0 else []:
            while seconds and seconds[0].priority > row.priority and len(taken) < budget:
                take(seconds.pop(0))
            if len(taken) >= budget:
                break
            if row.thread_id is not None and row.thread_id in taken_from:
                seconds.append(row)
                continue
            take(row)
        while seconds and len(taken) < budget:
            take(seconds.pop(0))
        if queue.rate_limit is not None and taken:
            self.starts.append((at, len(taken)))
        return taken


def new_row(
    item_id: str,
    queue_id: int,
    thread_id: str | None,
    at: datetime,
    scheduled: datetime,
    priority: int = 0,
) -> ItemRow:
    """A new item's row, as a post makes it (``posts.new_row``), in ``queue_id``."""
    row = posts.new_row(
        item_id,
        at=at,
        scheduled_at=scheduled,
        thread_id=thread_id,
        key=None,
        origin=None,
        priority=priority,
    )
    row.queue_id = queue_id
    row.eligible = thread_id is None
    return row


# -- the model: SPEC section 3 in its own words ------------------------------------------------


@dataclass
class MItem:
    id: str
    thread: str | None
    posted: datetime
    scheduled: datetime
    arrival: int
    priority: int = 0
    status: str = "pending"
    attempts: int = 0
    error: str | None = None
    lease: str | None = None
    expires: datetime | None = None
    finished: datetime | None = None
    fetched: datetime | None = None
    dead_letter: bool = False
    old_leases: list[str] = field(default_factory=list)
    # Section 8.2: each ended attempt (number, outcome, error), oldest first.
    story: list[tuple[int, str, str | None]] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.status in ("finished", "failed")


@dataclass
class Settings:
    lease: float
    queue: float
    retain: float
    retain_from: str
    max_attempts: int | None
    backoff: float
    backoff_max: float
    dead_letter: bool
    thread_limit: int = 1
    max_processing: int | None = None
    rate: tuple[int, float] | None = None
    paused: bool = False


class Model:
    """Items as SPEC section 3 says they behave; nothing here is taken from the engine."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.items: dict[str, MItem] = {}
        self.copies: list[tuple[str, str, int]] = []  # (dead item, error, attempts)
        self.arrivals = itertools.count()
        self.started: list[datetime] = []  # when each claim started (one entry per item)

    def live_members(self, thread: str) -> list[MItem]:
        return [i for i in self.items.values() if i.thread == thread and not i.terminal]

    def head(self, thread: str) -> MItem | None:
        """Seed 000: the pending member with the earliest scheduledAt, ties by arrival."""
        waiting = [i for i in self.live_members(thread) if i.status == "pending"]
        return min(waiting, key=lambda i: (i.scheduled, i.arrival)) if waiting else None

    def busy(self, thread: str) -> int:
        return sum(1 for i in self.live_members(thread) if i.status == "processing")

    def heads(self, thread: str) -> list[MItem]:
        """Section 8.1: a thread's eligible members are its earliest-scheduledAt
        non-processing ones, as many as ``threadLimit`` leaves room for (seed 000's one
        head when it is 1)."""
        waiting = sorted(
            (i for i in self.live_members(thread) if i.status == "pending"),
            key=lambda i: (i.scheduled, i.arrival),
        )
        return waiting[: max(0, self.s.thread_limit - self.busy(thread))]

    def claimable(self, at: datetime) -> list[MItem]:
        """Rule 2 and section 8.1: pending, due, and unthreaded or one of its thread's heads;
        higher priority first, then earliest scheduledAt, ties by arrival."""
        out = [
            i
            for i in self.items.values()
            if i.status == "pending"
            and i.scheduled <= at
            and (i.thread is None or i in self.heads(i.thread))
        ]
        return sorted(out, key=lambda i: (-i.priority, i.scheduled, i.arrival))

    def to_claim(self, want: int, at: datetime) -> list[MItem]:
        """What a claim of ``want`` hands out: nothing while paused; at most what
        ``maxProcessing`` and ``rateLimit`` leave; in claim order, except that within a
        priority a thread's second member waits for the other threads' heads."""
        if self.s.paused:
            return []
        budget = want
        if self.s.max_processing is not None:
            busy = sum(1 for i in self.items.values() if i.status == "processing")
            budget = min(budget, max(0, self.s.max_processing - busy))
        if self.s.rate is not None:
            count, seconds = self.s.rate
            recent = sum(1 for t in self.started if t > at - secs(seconds))
            budget = min(budget, max(0, count - recent))
        return fair_order(self.claimable(at))[:budget]

    def exhausted(self, item: MItem) -> bool:
        return self.s.max_attempts is not None and item.attempts >= self.s.max_attempts

    def _unlease(self, item: MItem) -> None:
        if item.lease is not None:
            item.old_leases.append(item.lease)
        item.lease = None
        item.expires = None

    def claim(self, item: MItem, lease: str, at: datetime) -> None:
        item.status = "processing"
        item.attempts += 1
        item.lease = lease
        item.expires = at + secs(self.s.lease)

    def ended(self, item: MItem, outcome: str, error: str | None) -> None:
        """The attempt ``item`` is in (if it is processing) ends, as ``outcome``."""
        if item.status == "processing":
            item.story.append((item.attempts, outcome, error))

    def cancel(self, item: MItem, at: datetime) -> None:
        """Section 8.2: failed now with ``cancelled``, no dead-letter copy."""
        self.ended(item, "cancelled", "cancelled")
        self.fail_final(item, "cancelled", at, death=False)

    def finish(self, item: MItem, at: datetime) -> None:
        self._unlease(item)
        item.status = "finished"
        item.error = None
        item.finished = at

    def fail_final(self, item: MItem, error: str, at: datetime, *, death: bool) -> None:
        """Rule 7 (a death: copied to the dead-letter queue) or rule 8 (a timeout: not)."""
        self._unlease(item)
        item.status = "failed"
        item.error = error
        item.finished = at
        if death and self.s.dead_letter:
            item.dead_letter = True
            self.copies.append((item.id, error, item.attempts))

    def back(self, item: MItem, error: str, at: datetime, scheduled: datetime) -> None:
        """Rules 4 and 6: back to pending at ``scheduled``, or death when attempts are out."""
        if self.exhausted(item):
            self.fail_final(item, error, at, death=True)
            return
        self._unlease(item)
        item.status = "pending"
        item.error = error
        item.scheduled = scheduled

    def backoff(self, attempts: int) -> float:
        return min(self.s.backoff_max, self.s.backoff * 2 ** (attempts - 1))

    def restart(self, item: MItem, at: datetime) -> None:
        item.status = "pending"
        item.attempts = 0
        item.error = None
        item.posted = at
        item.scheduled = at
        item.finished = None
        item.fetched = None
        item.dead_letter = False
        item.arrival = next(self.arrivals)


# -- the machine ---------------------------------------------------------------------------------

INDEX = st.integers(min_value=0, max_value=1000)
SETTINGS = st.builds(
    Settings,
    lease=st.sampled_from((10.0, 30.0)),
    queue=st.sampled_from((100.0, 1000.0)),
    retain=st.sampled_from((0.0, 50.0)),
    retain_from=st.sampled_from(("finished", "fetched")),
    max_attempts=st.sampled_from((None, 1, 2, 3)),
    backoff=st.sampled_from((0.0, 1.0, 5.0)),
    backoff_max=st.sampled_from((4.0, 300.0)),
    dead_letter=st.booleans(),
    thread_limit=st.sampled_from((1, 1, 2, 3)),
    max_processing=st.sampled_from((None, None, 1, 2)),
    rate=st.sampled_from((None, None, (2, 10.0))),
)
STEPS_TAKEN: list[int] = [0]


def pick(items: list[Any], index: int) -> Any:
    return items[index % len(items)]


class RulesMachine(RuleBasedStateMachine):
    """Sim and Model side by side; every step is one operation of the real API."""

    def __init__(self) -> None:
        super().__init__()
        self.at = T0
        self.ids = itertools.count()
        self.leases = itertools.count()
        self.claimed_heads: list[tuple[str, str]] = []

    @initialize(s=SETTINGS)
    def make_queue(self, s: Settings) -> None:
        queue = QueueInfo(
            id=QUEUE,
            name="q",
            lease_seconds=s.lease,
            queue_seconds=s.queue,
            retain_seconds=s.retain,
            retain_from=RetainFrom(s.retain_from),
            max_attempts=s.max_attempts,
            backoff_seconds=s.backoff,
            backoff_max_seconds=s.backoff_max,
            dead_letter_queue="dlq" if s.dead_letter else None,
            paused=False,
            max_processing=s.max_processing,
            rate_limit=RateLimit(*s.rate) if s.rate else None,
            thread_limit=s.thread_limit,
            deleting=False,
        )
        dlq = replace(
            queue,
            id=DLQ,
            name="dlq",
            dead_letter_queue=None,
            max_processing=None,
            rate_limit=None,
            thread_limit=1,
        )
        self.sim = Sim(queue, dlq)
        self.model = Model(s)

    def step(self) -> None:
        STEPS_TAKEN[0] += 1
        self.sim.settle()

    def rows(self) -> list[ItemRow]:
        return [r for r in self.sim.rows.values() if r.queue_id == QUEUE]

    def mitem(self, row: ItemRow) -> MItem:
        return self.model.items[row.id]

    def target(self, index: int, *, held: bool = False) -> ItemRow:
        """An item for a step; ``held``: one being processed, when there is one (a lease's
        steps on other items are refusals, which every item gets its share of anyway)."""
        rows = self.rows()
        busy = [r for r in rows if r.status is Status.PROCESSING]
        return pick(busy if held and busy and index % 4 else rows, index)

    # rule 1
    @rule(
        thread=st.sampled_from((None, *THREADS)),
        delay=st.sampled_from((0.0, 0.0, -20.0, 5.0, 40.0)),
        priority=st.sampled_from((0, 0, 1, 2)),
    )
    def post(self, thread: str | None, delay: float, priority: int) -> None:
        item_id = f"i{next(self.ids):04d}"
        scheduled = self.at + secs(delay)
        refused = rules.schedule_refusal(scheduled, self.at, self.model.s.queue)
        assert refused is None  # every delay here is well within queueSeconds
        row = new_row(item_id, QUEUE, thread, self.at, scheduled, priority)
        self.sim.rows[item_id] = row
        if thread is not None:
            self.sim.thread(row).delta += 1
            self.sim.thread(row).touched = True
        self.model.items[item_id] = MItem(
            item_id, thread, self.at, scheduled, next(self.model.arrivals), priority
        )
        self.step()

    # section 8.1: an operator pauses or resumes the queue, or changes its threadLimit (the
    # engine then settles every thread again: ``Resettle``)
    @rule(paused=st.booleans())
    def pause(self, paused: bool) -> None:
        self.model.s.paused = paused
        self.sim.queues[QUEUE] = replace(self.sim.queues[QUEUE], paused=paused)
        self.step()

    @rule(limit=st.sampled_from((1, 2, 3)))
    def thread_limit(self, limit: int) -> None:
        self.model.s.thread_limit = limit
        self.sim.queues[QUEUE] = replace(self.sim.queues[QUEUE], thread_limit=limit)
        for key, thread in self.sim.threads.items():
            if key[0] == QUEUE:
                thread.touched = True
        self.step()

    # rule 2
    @rule(want=st.integers(min_value=1, max_value=3))
    def claim(self, want: int) -> None:
        self._claim(want)
        self.step()

    def _claim(self, want: int) -> list[ItemRow]:
        expected = self.model.to_claim(want, self.at)
        taken = self.sim.claim(want, self.at, self.leases)
        assert [r.id for r in taken] == [i.id for i in expected]
        for row in taken:
            item = self.mitem(row)
            assert row.lease is not None
            self.model.claim(item, row.lease, self.at)
            self.model.started.append(self.at)
            if item.thread is not None:
                self.claimed_heads.append((item.thread, item.id))
        # The controls, checked on what the claim did (not on the model's arithmetic).
        assert not (taken and self.model.s.paused), "a paused queue handed an item out"
        busy = [r for r in self.rows() if r.status is Status.PROCESSING]
        cap = self.model.s.max_processing
        assert not taken or cap is None or len(busy) <= cap, (len(busy), cap)
        for name in {r.thread_id for r in taken if r.thread_id is not None}:
            members = [r for r in busy if r.thread_id == name]
            assert len(members) <= self.model.s.thread_limit, (name, members)
        if self.model.s.rate is not None:
            count, seconds = self.model.s.rate
            recent = [t for t in self.model.started if t > self.at - secs(seconds)]
            assert len(recent) <= count, (len(recent), count)
        return taken

    # a worker: a claim, and what its worker does with the item at once (or what happens to
    # it: its lease lapses and the sweep re-queues it; the queue's timeout fails it; it fails
    # for good and an operator restarts it)
    @rule(
        action=st.sampled_from(
            (
                "result",
                "retry",
                "fail",
                "extend",
                "drop",
                "release",
                "hold",
                "lapse",
                "timeout",
                "restart",
            )
        ),
        seconds=st.sampled_from((None, 1.0, 1e6)),
    )
    def worker(self, action: str, seconds: float | None) -> None:
        if action in ("lapse", "timeout"):
            claimed = self._claim(1)
            if not claimed:  # nothing due: post one (an unthreaded item, due now), and claim
                self.post(None, 0.0, 0)
                claimed = self._claim(1)
            if claimed:
                clock = Clock.LAPSE if action == "lapse" else Clock.TIMEOUT
                self._sweep(clock, wait=True)
            self.step()
            return
        for row in self._claim(1):
            if action == "restart":
                self._fail(row, "current", retry=False)
                self._restart(row)
            if action == "result":
                self._result(row, 0)
            elif action in ("retry", "fail"):
                self._fail(row, "current", retry=action == "retry")
            elif action == "extend":
                self._extend(row, "current", seconds)
            elif action == "drop":
                self._drop(row, "current")
            elif action == "release":
                self._release(row)
        self.step()

    # rule 3
    @precondition(lambda self: self.rows())
    @rule(index=INDEX)
    def result(self, index: int) -> None:
        self._result(self.target(index, held=True), index)
        self.step()

    def _result(self, row: ItemRow, index: int) -> None:
        item = self.mitem(row)
        decision = rules.result(row, value={"n": index}, at=self.at)
        accepted = not item.terminal
        if accepted:
            self.model.ended(item, "result", None)
            self.model.finish(item, self.at)
        assert isinstance(decision, Move) is accepted
        self.sim.apply(row, decision, self.at)

    # rule 4
    @precondition(lambda self: self.rows())
    @rule(index=INDEX, which=st.sampled_from(("current", "stale", "none")), retry=st.booleans())
    def fail(self, index: int, which: str, retry: bool) -> None:
        self._fail(self.target(index, held=True), which, retry=retry)
        self.step()

    def _fail(self, row: ItemRow, which: str, *, retry: bool) -> None:
        item = self.mitem(row)
        lease = {"current": item.lease, "stale": (item.old_leases or ["x"])[-1], "none": None}[
            which
        ]
        decision = rules.fail(
            row, self.sim.queue(row), lease=lease, error="boom", retry=retry, at=self.at
        )
        accepted = item.status == "processing" and lease is not None and lease == item.lease
        if accepted:
            self.model.ended(item, "fail", "boom")
            if retry:
                after = self.at + secs(self.model.backoff(item.attempts))
                self.model.back(item, "boom", self.at, after)
            else:
                self.model.fail_final(item, "boom", self.at, death=True)
        assert isinstance(decision, Move) is accepted
        self.sim.apply(row, decision, self.at)

    # rule 5
    @precondition(lambda self: self.rows())
    @rule(
        index=INDEX,
        which=st.sampled_from(("current", "stale")),
        seconds=st.sampled_from((None, 1.0, 5.0, 1e6)),
    )
    def extend(self, index: int, which: str, seconds: float | None) -> None:
        self._extend(self.target(index, held=True), which, seconds)
        self.step()

    def _extend(self, row: ItemRow, which: str, seconds: float | None) -> None:
        item = self.mitem(row)
        lease = item.lease if which == "current" else (item.old_leases or ["x"])[-1]
        decision = rules.extend(row, self.sim.queue(row), lease=lease, seconds=seconds, at=self.at)
        accepted = item.status == "processing" and lease is not None and lease == item.lease
        if accepted:
            wanted = self.model.s.lease if seconds is None else min(seconds, self.model.s.lease)
            item.expires = self.at + secs(wanted)
        assert isinstance(decision, Move) is accepted
        self.sim.apply(row, decision, self.at)

    # rule 6: a socket drops what it holds (its lease may be stale)
    @precondition(lambda self: self.rows())
    @rule(index=INDEX, which=st.sampled_from(("current", "stale")))
    def drop(self, index: int, which: str) -> None:
        self._drop(self.target(index, held=True), which)
        self.step()

    def _drop(self, row: ItemRow, which: str) -> None:
        item = self.mitem(row)
        lease = item.lease if which == "current" else (item.old_leases or ["x"])[-1]
        decision = rules.drop(
            row, self.sim.queue(row), lease=lease or "", cause=rules.WORKER_DISCONNECTED, at=self.at
        )
        if item.status == "processing" and lease == item.lease:
            self.model.ended(item, "dropped", rules.WORKER_DISCONNECTED)
            self.model.back(item, rules.WORKER_DISCONNECTED, self.at, item.scheduled)
        self.sim.apply(row, decision, self.at)

    # a claim whose push reached no worker is undone, its attempt taken back
    @precondition(lambda self: any(r.status is Status.PROCESSING for r in self.rows()))
    @rule(index=INDEX)
    def release(self, index: int) -> None:
        self._release(pick([r for r in self.rows() if r.status is Status.PROCESSING], index))
        self.step()

    def _release(self, row: ItemRow) -> None:
        item = self.mitem(row)
        decision = rules.release(row, lease=item.lease or "", at=self.at)
        item.old_leases.append(item.lease or "")
        item.lease, item.expires = None, None
        item.status = "pending"
        item.attempts -= 1
        self.sim.apply(row, decision, self.at)

    @rule(seconds=st.sampled_from((1.0, 5.0, 11.0, 31.0, 60.0, 400.0)))
    def time_passes(self, seconds: float) -> None:
        self.at += secs(seconds)
        self.step()

    # rules 6, 8, 11: the sweep, one clock at a time over every item
    @rule(which=st.sampled_from(tuple(Clock)), wait=st.booleans())
    def sweep(self, which: Clock, wait: bool) -> None:
        self._sweep(which, wait=wait)
        self.step()

    def _sweep(self, which: Clock, *, wait: bool) -> None:
        if wait:  # first let the clock's own period pass, so its rule has work to do
            period = {
                Clock.LAPSE: self.model.s.lease,
                Clock.TIMEOUT: self.model.s.queue,
                Clock.RETAIN: self.model.s.retain,
            }[which]
            self.at += secs(period + 1)
        for row in sorted(self.rows(), key=lambda r: r.id):
            item = self.mitem(row)
            decision = rules.clock(which, row, self.sim.queue(row), at=self.at)
            if which is Clock.LAPSE:
                due = item.status == "processing" and item.expires is not None
                if due and item.expires <= self.at:  # type: ignore[operator]
                    self.model.ended(item, "lapsed", rules.LEASE_EXPIRED)
                    self.model.back(item, rules.LEASE_EXPIRED, self.at, item.scheduled)
                    assert isinstance(decision, Move)
            elif which is Clock.TIMEOUT:
                if not item.terminal and item.posted + secs(self.model.s.queue) <= self.at:
                    self.model.ended(item, "timeout", rules.TIMEOUT)
                    self.model.fail_final(item, rules.TIMEOUT, self.at, death=False)
                    assert isinstance(decision, Move)
            else:
                start = item.finished if self.model.s.retain_from == "finished" else item.fetched
                retained = start is not None and start + secs(self.model.s.retain) <= self.at
                if item.terminal and retained:
                    del self.model.items[item.id]
                    assert isinstance(decision, Remove)
            if isinstance(decision, Keep):
                continue
            self.sim.apply(row, decision, self.at)
        if which is Clock.TIMEOUT:
            # I5: nothing is live past postedAt + queueSeconds once the sweep has run.
            for row in self.rows():
                if row.posted_at + secs(self.model.s.queue) <= self.at:
                    assert row.is_terminal, row

    # rule 11: a producer's read of a terminal item
    @precondition(lambda self: self.rows())
    @rule(index=INDEX)
    def fetch(self, index: int) -> None:
        row = pick(self.rows(), index)
        item = self.mitem(row)
        if item.terminal and item.fetched is None:
            item.fetched = self.at
        self.sim.apply(row, rules.fetched(row, at=self.at), self.at)
        self.step()

    # rule 9
    @precondition(lambda self: self.rows())
    @rule(index=INDEX)
    def delete(self, index: int) -> None:
        row = pick(self.rows(), index)
        del self.model.items[row.id]
        decision = rules.delete(row, queue_id=None)
        assert isinstance(decision, Remove)
        self.sim.apply(row, decision, self.at)
        self.step()

    # section 8.2: cancel
    @precondition(lambda self: self.rows())
    @rule(index=INDEX)
    def cancel(self, index: int) -> None:
        row = pick(self.rows(), index)
        item = self.mitem(row)
        decision = rules.cancel(row, reason="not wanted", at=self.at)
        if item.terminal:
            assert isinstance(decision, Refuse)
            assert decision.error.code == "terminal"
            return
        held = item.status == "processing"
        self.model.cancel(item, self.at)
        assert isinstance(decision, Move)
        assert ("removed:cancelled" in decision.news) is held, "its holder is told"
        assert not decision.dead_letter
        self.sim.apply(row, decision, self.at)
        assert row.cancel_reason == "not wanted"
        self.step()

    # rule 10
    @precondition(lambda self: self.rows())
    @rule(index=INDEX)
    def restart(self, index: int) -> None:
        self._restart(pick(self.rows(), index))
        self.step()

    def _restart(self, row: ItemRow) -> None:
        item = self.mitem(row)
        decision = rules.restart(row, seq=f"i{next(self.ids):04d}", at=self.at)
        if item.status != "failed":
            assert isinstance(decision, Refuse)
            assert decision.error.code == "not_failed"
            return
        self.model.restart(item, self.at)
        assert isinstance(decision, Move)
        self.sim.apply(row, decision, self.at)

    # -- what must hold after every step ---------------------------------------------------------

    @invariant()
    def items_match_the_model(self) -> None:
        if not hasattr(self, "sim"):
            return
        rows = {r.id: r for r in self.rows()}
        assert set(rows) == set(self.model.items)
        for item_id, row in rows.items():
            item = self.model.items[item_id]
            got = (row.status.value, row.attempts, row.error, row.lease, row.finished_at)
            want = (item.status, item.attempts, item.error, item.lease, item.finished)
            assert got == want, (item_id, got, want)
            assert row.scheduled_at == item.scheduled, item_id
            assert row.posted_at == item.posted, item_id
            assert row.lease_expires_at == item.expires, item_id
            assert row.fetched_at == item.fetched, item_id
            assert (row.dead_letter is not None) == item.dead_letter, item_id

    @invariant()
    def attempt_stories_match_the_model(self) -> None:
        """Section 8.2: each attempt's ending rides on the line it writes, and says how it
        ended; a release (never reached a worker) and a claim write none."""
        if not hasattr(self, "sim"):
            return
        for item_id, item in self.model.items.items():
            got = self.sim.stories.get(item_id, [])
            assert [(a, o, e) for a, o, e, _w in got] == item.story, item_id
            assert all(w == rules.HTTP_WORKER for *_rest, w in got), item_id

    @invariant()
    def dead_letter_copies_match(self) -> None:
        if not hasattr(self, "sim"):
            return
        got = [(c.origin["id"], c.origin["error"], c.origin["attempts"]) for c in self.sim.copies]
        assert got == self.model.copies
        for copy in self.sim.copies:
            assert copy.status is Status.PENDING
            assert copy.attempts == 0

    @invariant()
    def claimable_order_matches(self) -> None:
        if not hasattr(self, "sim"):
            return
        got = [r.id for r in self.sim.claimable(self.at)]
        want = [i.id for i in self.model.claimable(self.at)]
        assert got == want

    @invariant()
    def threads_hold_their_rule(self) -> None:
        """I3, and seed 000's bookkeeping under ``threadLimit``: each live thread's row
        counts its processing members and names its heads (the only eligible members); a
        thread with no live member has no row. (A limit lowered while more members were
        processing holds new claims back; those already out finish.)"""
        if not hasattr(self, "sim"):
            return
        for name in THREADS:
            members = self.model.live_members(name)
            thread = self.sim.threads.get((QUEUE, name))
            busy = [i.id for i in members if i.status == "processing"]
            assert len(busy) <= 3
            if not members:
                assert thread is None
                continue
            assert thread is not None
            assert thread.member_count == len(members)
            assert thread.processing == min(len(busy), self.model.s.thread_limit)
            assert (thread.processing_item in busy) if busy else thread.processing_item is None
            heads = [i.id for i in self.model.heads(name)]
            assert thread.heads == heads
            eligible = [r.id for r in self.rows() if r.thread_id == name and r.eligible]
            assert sorted(eligible) == sorted(heads)

    @invariant()
    def one_verdict_per_arrival(self) -> None:
        """I2: each arrival (an item, or its restart) gets at most one verdict."""
        if hasattr(self, "sim"):
            assert all(n == 1 for n in self.sim.verdicts.values())


def test_the_rules_behave_as_the_seeds_say(capsys: Any) -> None:
    STEPS_TAKEN[0] = 0
    started = time.perf_counter()
    run_state_machine_as_test(
        RulesMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    seconds = time.perf_counter() - started
    with capsys.disabled():
        print(
            f"\nrules model: {STEPS_TAKEN[0]} steps in {EXAMPLES} sequences, "
            f"{seconds:.1f} s ({STEPS_TAKEN[0] / max(seconds, 1e-9):.0f} steps/s)"
        )
    assert STEPS_TAKEN[0] >= EXAMPLES  # the machine ran
