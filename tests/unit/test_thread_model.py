"""A model-based test of threads (seed ``000``, SPEC rules 1-10, invariants I3 and I4).

A hypothesis state machine drives the real engine (real files, real database) through posts
(threaded or not, with tied and future ``scheduledAt``s), claims, results (also late ones for
pending items and refused ones for terminal items), retryable and final fails, refused
fails and drops from stale leases, lease lapses (one item, or all of them through the sweep),
socket drops, deletes (also of a processing head), restarts (and refused restarts) and queue
timeouts, with ``maxAttempts`` 1, 2 or 3 so that attempts run out. Beside it, ``Model`` is a
small reference model written from the seed's words:

- a thread's head is its non-processing (pending) member with the earliest ``scheduledAt``,
  ties broken by arrival (the post order; a restart is a brand-new, later arrival);
- claimable: pending, due, and unthreaded or the head of a thread with no processing member;
  a claim hands them out by ``scheduledAt`` then arrival;
- a retry re-enters pending at now + backoff (``backoffSeconds`` is 0 here, so: now); a lapse
  or drop keeps ``scheduledAt``; an item re-queued after its ``maxAttempts``-th claim dies;
- a thread exists while it has a non-terminal member.

Flow control (SPEC section 8.1) too: posts of priority 0 or 2, ``threadLimit`` 1 or 2 (and
changed while items wait), pause and resume: a thread's eligible members are its first
``threadLimit - processing`` pending ones; claims hand out higher priorities first, a thread's
second member after the other threads' heads of its priority, and nothing while paused.

After every step the engine's claimable list (order included), every item's status, attempts,
``scheduledAt``, error and state directory, I3, and each thread row are compared with the model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import event
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from taskhoster import engine
from taskhoster.engine import NewItem
from taskhoster.errors import Conflict
from taskhoster.models import Item, Queue, Thread
from taskhoster.status import State
from taskhoster.timeutil import now as utcnow

from .fair_order import fair_order

pytestmark = pytest.mark.django_db(transaction=True)

MAX_ATTEMPTS = (1, 2, 3)  # each example picks one, so that attempts often run out
QUEUE_SECONDS = 366 * 86400.0  # the largest allowed: nothing times out unless a rule says so
THREADS = ("a", "b", "c")
# Fixed past times (whole seconds, so ties happen), "now", or a time that never comes due.
WHENS = ("past-300", "past-200", "past-100", "now", "future")
ERROR = "boom"

# -- the reference model ---------------------------------------------------------------------


@dataclass
class MItem:
    id: str
    thread: str | None
    scheduled: datetime
    arrival: int
    priority: int = 0
    status: str = "pending"
    attempts: int = 0
    error: str | None = None
    lease: str | None = None
    old_leases: list[str] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.status in ("finished", "failed")

    @property
    def order(self) -> tuple[datetime, int]:
        return (self.scheduled, self.arrival)


class Model:
    """Items as the seed describes them; nothing here is taken from the engine's code."""

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self.thread_limit = 1
        self.paused = False
        self.items: dict[str, MItem] = {}
        self._arrivals = itertools.count()

    def arrive(self) -> int:
        return next(self._arrivals)

    def members(self, thread: str) -> list[MItem]:
        """The live (non-terminal) members of a thread."""
        return [i for i in self.items.values() if i.thread == thread and not i.terminal]

    def threads(self) -> set[str]:
        return {i.thread for i in self.items.values() if i.thread is not None and not i.terminal}

    def processing(self, thread: str) -> list[MItem]:
        return [i for i in self.members(thread) if i.status == "processing"]

    def head(self, thread: str) -> MItem | None:
        waiting = [i for i in self.members(thread) if i.status == "pending"]
        return min(waiting, key=lambda i: i.order) if waiting else None

    def heads(self, thread: str) -> list[MItem]:
        """Its first ``threadLimit - processing`` pending members in line (the head alone,
        while none is processing, when the limit is 1)."""
        waiting = sorted(
            (i for i in self.members(thread) if i.status == "pending"), key=lambda i: i.order
        )
        return waiting[: max(0, self.thread_limit - len(self.processing(thread)))]

    def eligible(self) -> list[MItem]:
        """Pending and unthreaded, or one of its thread's heads; higher priority first."""
        out = [
            i
            for i in self.items.values()
            if i.status == "pending" and (i.thread is None or i in self.heads(i.thread))
        ]
        return sorted(out, key=lambda i: (-i.priority, i.order))

    def claimable(self, at: datetime) -> list[MItem]:
        return [i for i in self.eligible() if i.scheduled <= at]

    def to_claim(self, at: datetime, n: int) -> list[MItem]:
        """What a claim of ``n`` hands out: nothing while paused; within a priority, each
        thread's first before any thread's second."""
        if self.paused:
            return []
        return fair_order(self.claimable(at))[:n]

    # transitions

    def claimed(self, item: MItem, lease: str) -> None:
        item.status = "processing"
        item.attempts += 1
        item.lease = lease

    def _release(self, item: MItem) -> None:
        if item.lease is not None:
            item.old_leases.append(item.lease)
        item.lease = None

    def finish(self, item: MItem) -> None:
        self._release(item)
        item.status = "finished"

    def die(self, item: MItem, error: str) -> None:
        self._release(item)
        item.status = "failed"
        item.error = error

    def requeue(self, item: MItem, error: str, scheduled: datetime | None = None) -> None:
        """Back to pending (scheduledAt unchanged unless given), or death after the last attempt."""
        if item.attempts >= self.max_attempts:
            event(f"dies with attempts exhausted ({error})")
            self.die(item, error)
            return
        self._release(item)
        item.status = "pending"
        if scheduled is not None:
            item.scheduled = scheduled

    def restart(self, item: MItem, at: datetime) -> None:
        item.status = "pending"
        item.attempts = 0
        item.error = None
        item.scheduled = at
        item.arrival = self.arrive()


# -- the machine ---------------------------------------------------------------------------

INDEX = st.integers(min_value=0, max_value=1000)
SPEC = st.tuples(
    st.sampled_from((None, *THREADS)), st.sampled_from(WHENS), st.sampled_from((0, 0, 2))
)


def pick(candidates: list[MItem], index: int) -> MItem:
    return candidates[index % len(candidates)]


class ThreadMachine(RuleBasedStateMachine):
    root: ClassVar[Path]
    examples: ClassVar[itertools.count[int]] = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        # Every example starts from an empty database and a state root without items, in a
        # queue of its own (``teardown`` deletes it, rows and files).
        assert not Item.objects.exists()
        assert not Thread.objects.exists()
        assert not Queue.objects.exists()
        assert not any(self.root.glob("*/*/*.json")), list(self.root.glob("*/*/*.json"))
        self.queue = f"model-{next(self.examples)}"
        # maxAttempts is set again by the ``set_max_attempts`` initializer.
        self.queue_id = engine.upsert_queue(
            name=self.queue,
            body={
                "maxAttempts": MAX_ATTEMPTS[-1],
                "backoffSeconds": 0,
                "queueSeconds": QUEUE_SECONDS,
            },
        )[0].id
        self.model = Model(MAX_ATTEMPTS[-1])
        base = utcnow().replace(microsecond=0)
        self.whens = {
            "past-300": base - timedelta(seconds=300),
            "past-200": base - timedelta(seconds=200),
            "past-100": base - timedelta(seconds=100),
            "future": base + timedelta(hours=1),
        }

    def teardown(self) -> None:
        engine.delete_queue(queue_name=self.queue)
        engine.reclaim_deleted_queues()  # (in the background after a commit; here, now)
        Queue.objects.all().delete()  # nothing else may leak into the next example

    def with_status(self, *statuses: str) -> list[MItem]:
        return [i for i in self.model.items.values() if i.status in statuses]

    # rules --------------------------------------------------------------------------------

    @initialize(max_attempts=st.sampled_from(MAX_ATTEMPTS), limit=st.sampled_from((1, 2)))
    def set_max_attempts(self, max_attempts: int, limit: int) -> None:
        engine.upsert_queue(
            name=self.queue, body={"maxAttempts": max_attempts, "threadLimit": limit}
        )
        self.model.max_attempts = max_attempts
        self.model.thread_limit = limit

    # section 8.1: the operator changes threadLimit (every thread recounted) or pauses
    @rule(limit=st.sampled_from((1, 2)))
    def change_thread_limit(self, limit: int) -> None:
        engine.upsert_queue(name=self.queue, body={"threadLimit": limit})
        self.model.thread_limit = limit

    @rule(paused=st.booleans())
    def pause(self, paused: bool) -> None:
        engine.upsert_queue(name=self.queue, body={"paused": paused})
        self.model.paused = paused

    @rule(specs=st.lists(SPEC, min_size=1, max_size=3))
    def post(self, specs: list[tuple[str | None, str, int]]) -> None:
        before = utcnow()
        posted = engine.post_items(
            queue_name=self.queue,
            items=[
                NewItem(
                    payload=n,
                    thread_id=thread,
                    scheduled_at=self.whens.get(when),
                    priority=priority,
                )
                for n, (thread, when, priority) in enumerate(specs)
            ],
        )
        after = utcnow()
        for (thread, when, priority), answer in zip(specs, posted, strict=True):
            row = answer.row
            if when == "now":
                assert before <= row.scheduled_at <= after
                scheduled = row.scheduled_at
            else:
                scheduled = self.whens[when]
            self.model.items[row.id] = MItem(
                id=row.id,
                thread=thread,
                scheduled=scheduled,
                arrival=self.model.arrive(),
                priority=priority,
            )

    @rule(max_items=st.integers(min_value=1, max_value=3))
    def claim(self, max_items: int) -> None:
        expected = [i.id for i in self.model.to_claim(utcnow(), max_items)]
        got = engine.claim(queue_name=self.queue, max_items=max_items)
        assert [c.row.id for c in got] == expected, "claim did not hand out the model's first"
        if any(self.model.items[i].attempts and self.model.items[i].thread for i in expected):
            event("claims a re-queued thread member")
        for thread in self.model.threads():
            head = self.model.head(thread)
            waiting = [i for i in self.model.members(thread) if i.status == "pending"]
            if head is not None and min(i.arrival for i in waiting) < head.arrival:
                event("a thread's head is not its earliest arrival")
        for claimed in got:
            assert claimed.row.lease
            self.model.claimed(self.model.items[claimed.row.id], claimed.row.lease)

    @precondition(lambda self: self.model.items)
    @rule(index=INDEX)
    def result(self, index: int) -> None:
        """A result for any item: accepted unless the item is terminal (also late, for pending)."""
        item = pick(list(self.model.items.values()), index)
        verdict = engine.submit_result(item_id=item.id, result={"r": index})
        assert verdict.accepted is (not item.terminal)
        if verdict.accepted:
            self.model.finish(item)

    @precondition(lambda self: self.with_status("processing"))
    @rule(index=INDEX)
    def fail_retry(self, index: int) -> None:
        item = pick(self.with_status("processing"), index)
        before = utcnow()
        verdict = engine.fail(item_id=item.id, lease=item.lease, error=ERROR, retry=True)
        after = utcnow()
        assert verdict.accepted
        if item.attempts < self.model.max_attempts:
            # backoffSeconds 0: it re-enters pending at the moment of the fail.
            assert verdict.row is not None
            assert before <= verdict.row.scheduled_at <= after
            self.model.requeue(item, ERROR, scheduled=verdict.row.scheduled_at)
        else:
            event("dies with attempts exhausted (fail)")
            self.model.die(item, ERROR)

    @precondition(lambda self: self.with_status("processing"))
    @rule(index=INDEX)
    def fail_final(self, index: int) -> None:
        item = pick(self.with_status("processing"), index)
        verdict = engine.fail(item_id=item.id, lease=item.lease, error=ERROR, retry=False)
        assert verdict.accepted
        self.model.die(item, ERROR)

    @precondition(lambda self: any(i.old_leases for i in self.model.items.values()))
    @rule(index=INDEX, retry=st.booleans())
    def stale_worker(self, index: int, retry: bool) -> None:
        """A worker whose claim is over fails or drops with its old lease: refused, no change."""
        item = pick([i for i in self.model.items.values() if i.old_leases], index)
        lease = item.old_leases[index % len(item.old_leases)]
        assert not engine.fail(item_id=item.id, lease=lease, error=ERROR, retry=retry).accepted
        assert not engine.fail(item_id=item.id, lease=None, error=ERROR, retry=retry).accepted
        assert not engine.requeue_held(item_id=item.id, lease=lease).accepted

    @precondition(lambda self: self.with_status("processing"))
    @rule(index=INDEX)
    def lease_lapses(self, index: int) -> None:
        item = pick(self.with_status("processing"), index)
        assert engine.requeue_if_lapsed(item_id=item.id, at=utcnow() + timedelta(days=1))
        self.model.requeue(item, engine.LEASE_EXPIRED)

    @precondition(lambda self: self.with_status("processing"))
    @rule()
    def sweep_lapses_every_lease(self) -> None:
        busy = self.with_status("processing")
        report = engine.sweep(at=utcnow() + timedelta(seconds=600))
        assert (report.requeued, report.timed_out, report.retained) == (len(busy), 0, 0)
        for item in busy:
            self.model.requeue(item, engine.LEASE_EXPIRED)

    @precondition(lambda self: self.with_status("processing"))
    @rule(index=INDEX)
    def socket_drops(self, index: int) -> None:
        item = pick(self.with_status("processing"), index)
        assert item.lease is not None
        assert engine.requeue_held(item_id=item.id, lease=item.lease).accepted
        self.model.requeue(item, engine.WORKER_DISCONNECTED)

    @precondition(lambda self: self.model.items)
    @rule(index=INDEX)
    def delete(self, index: int) -> None:
        item = pick(list(self.model.items.values()), index)
        if item.status == "processing" and item.thread is not None:
            event("deletes a processing thread member")
        assert engine.delete_item(item_id=item.id)
        del self.model.items[item.id]

    @precondition(lambda self: self.with_status("failed"))
    @rule(index=INDEX)
    def restart(self, index: int) -> None:
        item = pick(self.with_status("failed"), index)
        if item.thread is not None and item.thread in self.model.threads():
            event("restarts into a live thread")
        before = utcnow()
        row = engine.restart(item_id=item.id)
        after = utcnow()
        assert before <= row.scheduled_at <= after
        self.model.restart(item, row.scheduled_at)

    @precondition(lambda self: self.with_status("pending", "processing", "finished"))
    @rule(index=INDEX)
    def restart_refused(self, index: int) -> None:
        item = pick(self.with_status("pending", "processing", "finished"), index)
        with pytest.raises(Conflict):
            engine.restart(item_id=item.id)

    @precondition(lambda self: self.model.items)
    @rule(index=INDEX)
    def queue_timeout(self, index: int) -> None:
        item = pick(list(self.model.items.values()), index)
        aged = engine.time_out_if_aged(
            item_id=item.id, at=utcnow() + timedelta(seconds=QUEUE_SECONDS + 60)
        )
        assert aged is (not item.terminal)
        if aged:
            self.model.die(item, engine.TIMEOUT)

    # the comparison, after every step ------------------------------------------------------

    @invariant()
    def engine_matches_model(self) -> None:
        at = utcnow()
        model = self.model
        rows = {r.id: r for r in Item.objects.filter(queue_id=self.queue_id)}
        assert set(rows) == set(model.items)

        # (2) every item: status, attempts, scheduledAt or error, and where its file is
        for item in model.items.values():
            row = rows[item.id]
            assert (row.status, row.attempts) == (item.status, item.attempts), item
            if item.terminal:
                assert row.error == item.error, item
            else:
                assert row.scheduled_at == item.scheduled, item
            state = State.DONE.value if item.terminal else item.status
            assert self.states_on_disk(item.id) == [state], item

        # (1) what may be claimed, and in which order (the claim's own query, due or not)
        eligible = sorted(
            (r for r in rows.values() if r.eligible),
            key=lambda r: (-r.priority, r.scheduled_at, r.seq),
        )
        assert [r.id for r in eligible] == [i.id for i in model.eligible()], self.dump()
        claimable = list(
            Item.objects.filter(queue_id=self.queue_id, eligible=True, scheduled_at__lte=at)
            .order_by("-priority", "scheduled_at", "seq")
            .values_list("id", flat=True)
        )
        assert claimable == [i.id for i in model.claimable(at)], self.dump()

        # (3) I3: at most threadLimit processing members per thread (a limit lowered while
        # two were processing lets them finish; nothing more is handed out)
        for thread in THREADS:
            busy = [r for r in rows.values() if r.thread_id == thread and r.status == "processing"]
            assert len(busy) <= 2, busy

        # (4) a thread row exists exactly while the thread has a live member, and is right:
        # its count of live members, its processing member, and its head (the eligible one,
        # kept only while no member is processing)
        threads = {t.thread_id: t for t in Thread.objects.filter(queue_id=self.queue_id)}
        assert set(threads) == model.threads(), self.dump()
        for thread_id, thread_row in threads.items():
            processing = [i.id for i in model.processing(thread_id)]
            assert thread_row.member_count == len(model.members(thread_id)), thread_id
            if processing:
                assert thread_row.processing_item in processing, thread_id
            else:
                assert thread_row.processing_item is None, thread_id
            assert thread_row.processing == min(len(processing), model.thread_limit), thread_id
            assert thread_row.heads == [i.id for i in model.heads(thread_id)], thread_id

    def dump(self) -> str:
        rows = Item.objects.filter(queue_id=self.queue_id).order_by("scheduled_at", "seq")
        lines = [
            f"{r.id} {r.seq} {r.thread_id} {r.status} {r.eligible} {r.scheduled_at}" for r in rows
        ]
        lines += [str(t) for t in Thread.objects.values()]
        lines += [str(i) for i in self.model.items.values()]
        return "\n".join(lines)

    def states_on_disk(self, item_id: str) -> list[str]:
        return [
            s.value
            for s in State
            if (self.root / self.queue / s.value / f"{item_id}.json").exists()
        ]


@pytest.mark.timeout(600)  # a pass takes seconds; a failure's shrinking may take minutes
def test_threads_follow_the_seed(state_root: Path, settings: Any) -> None:
    # Durability is not what this test is about: skip fsync to keep the run short.
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FSYNC": False}
    ThreadMachine.root = state_root
    run_state_machine_as_test(
        ThreadMachine,
        settings=hsettings(
            max_examples=60,
            stateful_step_count=30,
            derandomize=True,
            database=None,
            deadline=None,
        ),
    )
