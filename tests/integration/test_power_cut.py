"""I1 and I2 under a power cut: every state the disk can be left in after any file operation
of a run of group commits loses no acknowledged post, undoes no acknowledged verdict or
delete, and leaves a state the server runs on from correctly.

How (in the spirit of the ALICE and CrashMonkey studies, which enumerate crash states from
syscall traces): a workload of every operation that writes files goes through the real engine
with the store's syscalls recorded in order, with the moment each answer went out and what it
said: posts (single, batched, threaded, keyed), claims, results, retryable and final failures
with a dead-letter copy, extends, a socket's re-queue and release, restarts, lapsed leases, a
new queue and a settings change, single deletes, a delete by status and retention taking the
list path (the list's threshold is lowered to 3 here so a small workload takes it; the code
is the same), the unlinks behind a list, a queue deleted and reclaimed, and two groups
overlapped as the committer overlaps them under load (the second committed before the
first's flush, or after it and before its answers). A power cut after
operation k leaves what ``crash_model`` allows: durability per file and per directory (a
file's ``fsync`` keeps its data, a directory's keeps its entries, directories being inodes
too, ``syncfs`` keeps everything; of the rest any subset of the entries, and of each file a
prefix of its writes, the last one cut short or zeroed). Each state is written out as a tree,
the index is rebuilt from the files alone (``repair`` on an empty database: a power cut may
also lose the database), and then:

- every post answered before k exists, with its payload;
- every verdict answered before k (a result accepted, with its value; a failure, with its
  error; a restart; a socket's re-queue) stands;
- every delete answered before k (single, by status, retention, a whole queue) stays done;
- every queue setting answered before k is the queue's;
- the index says what the directories say (each file's last line agreeing with its
  directory), every thread is consistent;
- and the server runs on from there: every lease lapses, every queue is drained by claims
  and results, and no item gets a second verdict, no thread two members at once, and no
  acknowledged verdict is taken back by a later result.

Every crash point is visited (one after each recorded operation). The states of a point are
counted exactly; CI checks up to 4 of them on SQLite and 2 on PostgreSQL (the state that keeps
nothing unflushed, and a seeded sample of the rest; ``TASKHOSTER_POWER_CUT_STATES_PER_POINT``
sets that number for both), and ``TASKHOSTER_POWER_CUT_ALL=1`` (``scripts/power-cut-all``)
checks every one. Each mode prints ``explored N of M states``. (On PostgreSQL a state costs
some three times what it costs on SQLite, its repair and drain being round trips; the disk's
states do not depend on the database, and the run on PostgreSQL is the longer of CI's two:
it checks the dialect's way through the repair and the drain on up to 2 states a point.)
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from taskhoster import engine, identity
from taskhoster import store as store_module
from taskhoster.engine import reclaim, removal, runner, schedules
from taskhoster.engine.common import store as the_store
from taskhoster.engine.ops import (
    Claim,
    Delete,
    Extend,
    Fail,
    Fire,
    NewItem,
    Release,
    Requeue,
    Restart,
    Result,
    Sweep,
)
from taskhoster.engine.posts import prepare_post
from taskhoster.engine.queues import queue_settings
from taskhoster.engine.rules import Clock
from taskhoster.models import Item, Queue, QueueCount, Schedule, Thread
from taskhoster.status import State, Status
from taskhoster.store import Syscalls, decode
from taskhoster.timeutil import now as utcnow

from .consistency import assert_index_matches_directories, assert_threads_consistent
from .crash_model import Disk, write_tree

# Every state of every crash point (``scripts/power-cut-all``), or up to this many a point
# (unset, empty or 0: ``states_per_point``).
ALL_STATES = os.environ.get("TASKHOSTER_POWER_CUT_ALL") == "1"
STATES_PER_POINT = int(os.environ.get("TASKHOSTER_POWER_CUT_STATES_PER_POINT") or 0)
# With every state, this process checks the states numbered i modulo n ("i/n"; all: "0/1").
SHARD, SHARDS = map(int, os.environ.get("TASKHOSTER_POWER_CUT_SHARD", "0/1").split("/"))


def states_per_point() -> int:
    """Up to how many states of a crash point CI checks: 4 on SQLite, 2 on PostgreSQL (see
    the module's docstring), or ``TASKHOSTER_POWER_CUT_STATES_PER_POINT``."""
    return STATES_PER_POINT or (2 if connection.vendor == "postgresql" else 4)


@dataclass
class Trace:
    root: Path
    ops: list[tuple[Any, ...]] = field(default_factory=list)
    recording: bool = True

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def add(self, *op: Any) -> None:
        if self.recording:
            self.ops.append(op)


class RecordingSyscalls(Syscalls):
    """Does every operation for real and writes it down."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def create(self, path: str, data: bytes) -> None:
        super().create(path, data)
        self.trace.add("create", self.trace.rel(path), data)

    def append(self, path: str, data: bytes) -> int:
        size = super().append(path, data)
        self.trace.add("append", self.trace.rel(path), data)
        return size

    def truncate(self, path: str, size: int) -> None:
        super().truncate(path, size)
        self.trace.add("truncate", self.trace.rel(path), size)

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self.trace.add("rename", self.trace.rel(src), self.trace.rel(dst))

    def unlink(self, path: str) -> None:
        super().unlink(path)
        self.trace.add("unlink", self.trace.rel(path))

    def mkdir(self, path: str) -> None:
        super().mkdir(path)
        self.trace.add("mkdir", self.trace.rel(path))

    def rmdir(self, path: str) -> None:
        super().rmdir(path)
        self.trace.add("rmdir", self.trace.rel(path))

    def fsync(self, path: str) -> None:
        super().fsync(path)
        kind = "fsync-dir" if os.path.isdir(path) else "fsync"
        self.trace.add(kind, self.trace.rel(path))

    def syncfs(self, path: str) -> None:
        super().syncfs(path)
        self.trace.add("barrier")


def record_acks(trace: Trace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note, at the moment each answer goes out, what it acknowledged, with its value."""
    deliver = runner.answer

    def answer(outcomes: list[tuple[Any, bool, Any]]) -> None:
        for op, ok, value in outcomes:
            if not ok:
                continue
            for posted in value if isinstance(value, list) else []:
                if isinstance(posted, engine.Posted) and posted.created:
                    trace.add("ack-post", posted.row.id, posted.payload)
            if isinstance(op, Fire):  # a schedule's slots: their items, as posts
                for firing, fired in zip(op.firings, value, strict=True):
                    if fired.created and firing.post is not None:
                        trace.add("ack-post", fired.item, firing.post.items[0].payload)
            if isinstance(op, Result | Fail) and value.accepted:
                if value.status == "finished" and isinstance(op, Result):
                    trace.add("ack-verdict", op.item_id, value.status, op.result)
                elif value.status == "failed":
                    error = op.error if isinstance(op, Fail) else None
                    trace.add("ack-verdict", op.item_id, value.status, error)
                else:  # a retryable failure: the item waits again
                    trace.add("ack-verdict", op.item_id, "pending", None)
            elif isinstance(op, Requeue) and value.accepted:
                trace.add("ack-verdict", op.item_id, "pending", None)
            # (A release is answered at the commit, to the server itself: it gives back an
            # item whose push never went out, a claim that was not durable either.)
            elif isinstance(op, Restart):
                trace.add("ack-verdict", op.item_id, "restarted", None)
            elif isinstance(op, Delete) or (isinstance(op, Sweep) and op.clock == "retain"):
                left = set(Item.objects.filter(id__in=op.ids).values_list("id", flat=True))
                for item_id in op.ids:
                    if item_id not in left:
                        trace.add("ack-delete", item_id)
        deliver(outcomes)

    monkeypatch.setattr(runner, "answer", answer)


def group(*ops: Any) -> list[Any]:
    """Run ``ops`` as one group commit and return their answers."""
    for op in ops:
        op.future = Future()
    runner.run_group(list(ops), 0)
    return [op.future.result() for op in ops]


def overlapped(first: list[Any], second: list[Any], *, flushed_first: bool) -> Any:
    """Two groups as the committer runs them under load (``runner.Committer._run``): the
    second commits while the first's files are flushed (on the flusher's thread), the first
    is answered after that, then the second is flushed and answered. Of the orders the two
    threads may take, the two ends: the first's flush wholly before the second's file
    operations (``flushed_first``: it keeps none of them), or wholly after (it meets the
    files the second moved). Returns each group's answers."""
    for op in (*first, *second):
        op.future = Future()
    one = runner.commit_group(list(first), 0)
    assert isinstance(one, runner.Committed)
    assert one.may_overlap(), "the first group writes files, and may overlap the next"
    if flushed_first:
        error = runner.flush(one)
        two = runner.commit_group(list(second), 0)
    else:
        two = runner.commit_group(list(second), 0)
        error = runner.flush(one)
    runner.flushed(one, error)
    assert isinstance(two, runner.Committed), "the second group commits"
    runner.flushed(two, runner.flush(two))
    return [op.future.result() for op in first], [op.future.result() for op in second]


def post(queue: str, *payloads: Any, thread: str | None = None, key: str | None = None) -> Any:
    return prepare_post(queue, [NewItem(payload=p, thread_id=thread, key=key) for p in payloads])


def settings_changed(trace: Trace, name: str, body: dict[str, Any]) -> None:
    """Create or change a queue; acknowledged (with its settings) once it returns."""
    queue, _created = engine.upsert_queue(name=name, body=body)
    trace.add("ack-settings", name, queue_settings(queue))


def schedule_changed(trace: Trace, queue: str, name: str, body: dict[str, Any]) -> Any:
    """Create or change a schedule; acknowledged (with its definition) once it returns.
    While it runs, the fields it changes may hold either value after a power cut."""
    trace.add("schedule-changing", queue, name, *body)
    made, _created = engine.put_schedule(queue, name, body)
    trace.add("ack-schedule", queue, name, engine.schedule_wire(made, queue))
    return made


def schedule_steps(trace: Trace) -> None:
    """A schedule made (its definitions file), a slot's step that finds the file a crashed
    attempt left at the slot's id (moved aside, its own written), the same step again (a
    second sweep's: nothing), and a change of the schedule."""
    made = schedule_changed(trace, "q", "tick", {"every": 1, "payload": "tick", "priority": 3})
    time.sleep(max(0.0, (made.next_at - utcnow()).total_seconds()) + 0.01)  # its slot is due
    row = Schedule.objects.select_related("queue").get(id=made.id)
    steps, _skipped = schedules._firings(row, utcnow())
    first = steps[:1]
    assert first[0].post is not None
    leftover = the_store().item_file("q", State.PENDING, first[0].post.rows[0].id)
    the_store().sys.create(leftover, b'{"id": "torn')  # an attempt that never committed
    ((fired,),) = group(Fire(firings=first))
    assert fired.created
    ((again,),) = group(Fire(firings=first))
    assert not again.done
    schedule_changed(trace, "q", "tick", {"paused": True, "catchupSeconds": 5})


def run_workload(trace: Trace, lists: list[Path]) -> None:
    """Groups of every kind of operation that writes files."""
    settings_changed(trace, "r", {"retainSeconds": 60})  # a new queue: its directories
    settings_changed(trace, "gone", {})
    # Small groups (a few files each) keep each crash point's states few enough to count
    # and, with ``scripts/power-cut-all``, to check every one.
    group(post("q", "a"), post("q", "b", "c"))
    group(post("q", "t1", "t2", thread="t"))
    group(post("q", "kp", key="k1"), post("r", "r1", "r2"))
    group(post("r", "r3"), post("gone", "g1", "g2"))
    group(post("q", "kp", key="k1"))  # the key again: nothing new
    claimed = (
        group(Claim(queue_name="q", max_items=3))[0] + group(Claim(queue_name="q", max_items=2))[0]
    )
    (r1, r2) = group(Claim(queue_name="r", max_items=2))[0]
    assert len(claimed) == 5
    a, b, c, t1, kp = (x.row for x in claimed)
    group(
        Result(item_id=a.id, result={"done": "a"}),
        Fail(item_id=b.id, lease=b.lease, error="again", retry=True),
    )
    group(Fail(item_id=c.id, lease=c.lease, error="fatal", retry=False))  # and its dead letter
    group(
        post("q", "d"),
        Extend(item_id=kp.id, lease=kp.lease, seconds=600),
        Requeue(item_id=r1.row.id, lease=r1.row.lease, cause="worker disconnected"),
        Release(item_id=r2.row.id, lease=r2.row.lease),
    )
    (again,) = group(Claim(queue_name="q", max_items=3))
    # A post and its claim in one group (a socket's dispatcher joins a post's group), and a
    # retryable failure claimed again in its own group: the file is written under one name
    # and flushed under another.
    ((h,), held) = group(post("s", "h"), Claim(queue_name="s", max_items=1))
    assert [x.row.id for x in held] == [h.row.id]
    _fail, held = group(
        Fail(item_id=h.row.id, lease=held[0].row.lease, error="again", retry=True),
        Claim(queue_name="s", max_items=1),
    )
    assert [x.row.id for x in held] == [h.row.id]
    # A restart may take back a verdict (rule 10): from here on, c's may be undone.
    trace.add("restart", c.id)
    group(
        Restart(item_id=c.id),
        *(Result(item_id=x.row.id, result=x.payload) for x in again[:1]),
        Result(item_id=kp.id, result="kp done"),
    )
    # Under load the next group commits while a group's files are flushed (``overlapped``):
    # a post, and a claim that takes its file before or after that flush; then a post and
    # that item's result, and a claim of the new one, likewise.
    ((o1,),), ((taken,),) = overlapped(
        [post("s", "o1")], [Claim(queue_name="s", max_items=1)], flushed_first=True
    )
    assert taken.row.id == o1.row.id
    ((o2,), _verdict), ((taken,),) = overlapped(
        [post("s", "o2"), Result(item_id=o1.row.id, result="o1 done")],
        [Claim(queue_name="s", max_items=1)],
        flushed_first=False,
    )
    assert taken.row.id == o2.row.id
    ((e, _f),) = group(post("q", "e", "f"))
    settings_changed(trace, "q", {"deadLetterQueue": "dead", "backoffSeconds": 0, "maxAttempts": 7})
    schedule_steps(trace)
    # Deletes: one item, then one beside a post (each file unlinked in the group), then a
    # delete by status and retention, each of three or more files (by a list, unlinked
    # behind the answer).
    group(Delete(ids=(e.row.id,)))
    pending = list(
        Item.objects.filter(queue__name="r", status="pending").values_list("id", flat=True)
    )
    group(Delete(ids=tuple(pending[:1])), post("r", "r4"))
    group(post("r", "r5", "r6"))
    assert removal.delete_by_status(queue_name="r", status=Status.PENDING) >= 3
    assert any(op[0] == "create" and op[1].endswith(".unlink") for op in trace.ops), (
        "the delete by status did not take the list path"
    )
    later = utcnow().replace(year=utcnow().year + 1)
    done = tuple(
        Item.objects.filter(status__in=["finished", "failed"]).values_list("id", flat=True)
    )
    group(Sweep(clock=Clock.RETAIN, ids=done, at=later), post("q", "g"))
    for path in list(lists):  # the unlinks behind the lists (a thread of the committer's)
        the_store().reclaim_list(path)
        lists.remove(path)
    gone = list(Item.objects.filter(queue__name="gone").values_list("id", flat=True))
    trace.add("deleting-queue", "gone", *gone)
    removal.delete_queue(queue_name="gone")
    trace.add("ack-delete-queue", "gone", *gone)
    removal.reclaim_deleted_queues()
    # Every lease lapses; a late result of t1 (its lease lapsed) is not accepted.
    processing = tuple(Item.objects.filter(status="processing").values_list("id", flat=True))
    group(
        Sweep(clock=Clock.LAPSE, ids=processing, at=later),
        Result(item_id=t1.id, result="late"),
    )


# -- crash states -----------------------------------------------------------------------------


FILE_OPS = {
    "create",
    "append",
    "truncate",
    "rename",
    "unlink",
    "mkdir",
    "rmdir",
    "fsync",
    "fsync-dir",
    "barrier",
}


def crash_points(base: Path, ops: list[tuple[Any, ...]]) -> Any:
    """(k, the disk as a power cut after the first k operations may leave it), for every k."""
    disk = Disk(base)
    yield 0, disk.crash_point()
    for k, op in enumerate(ops, start=1):
        if op[0] in FILE_OPS:
            disk.play(op)
        yield k, disk.crash_point()


def chosen_states(count: int, per_point: int, rng: random.Random) -> list[int]:
    """Which of a crash point's ``count`` states to check: all of them with ``ALL_STATES``
    (or when there are few), else the state that keeps nothing unflushed, and a seeded
    sample (``per_point`` in all)."""
    if ALL_STATES or count <= per_point:
        return list(range(count))
    return [0, *rng.sample(range(1, count), per_point - 1)]


@dataclass
class Acknowledged:
    """What was acknowledged before operation k."""

    posts: dict[str, Any] = field(default_factory=dict)  # id: payload
    verdicts: dict[str, tuple[str, Any]] = field(default_factory=dict)  # id: (status, value)
    deleted: set[str] = field(default_factory=set)
    deleted_queues: set[str] = field(default_factory=set)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    schedules: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    schedules_changing: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    restarting: set[str] = field(default_factory=set)  # a restart under way may undo a verdict
    deleting: set[str] = field(default_factory=set)  # a delete under way may have taken them
    deleting_queues: set[str] = field(default_factory=set)
    moved_after: set[str] = field(default_factory=set)  # claimed since its last line

    @classmethod
    def before(cls, ops: list[tuple[Any, ...]], k: int) -> Acknowledged:
        acks = cls()
        last_line: dict[str, int] = {}  # where each item's last line was written
        verdict_line: dict[str, int] = {}  # where the line of its last verdict was
        claims: dict[str, list[int]] = {}  # where a claim renamed it into processing/
        for n, op in enumerate(ops[:k]):
            kind = op[0]
            if kind == "ack-post":
                acks.posts[op[1]] = op[2]
            elif kind == "ack-verdict":
                acks.verdicts[op[1]] = (op[2], op[3])
                verdict_line[op[1]] = last_line.get(op[1], -1)
            elif kind == "append":
                last_line[Path(op[1]).stem] = n
            elif kind == "rename" and "/processing/" in op[2]:
                claims.setdefault(Path(op[2]).stem, []).append(n)
            elif kind == "restart":
                acks.restarting.add(op[1])
            elif kind == "deleting-queue":
                acks.deleting_queues.add(op[1])
                acks.deleting.update(op[2:])
            elif kind == "unlink" and op[1].endswith(".json"):
                acks.deleting.add(Path(op[1]).stem)
            elif kind == "create" and op[1].endswith(".unlink"):
                acks.deleting.update(line.rsplit("/", 1)[-1] for line in op[2].decode().split())
            elif kind == "ack-delete":
                acks.deleted.add(op[1])
            elif kind == "ack-delete-queue":
                acks.deleted_queues.add(op[1])
                acks.deleted.update(op[2:])
            elif kind == "ack-settings":
                acks.settings[op[1]] = op[2]
            elif kind == "schedule-changing":
                acks.schedules_changing[(op[1], op[2])] = set(op[3:])
            elif kind == "ack-schedule":
                acks.schedules[(op[1], op[2])] = op[3]
                acks.schedules_changing.pop((op[1], op[2]), None)
        # A claim since the verdict's line (in the same group or later), and its result,
        # durable or not, answered or not, may have moved the item on.
        acks.moved_after = {
            item_id
            for item_id, line in verdict_line.items()
            if any(n > line for n in claims.get(item_id, []))
        }
        return acks

    def final(self) -> set[str]:
        """Items whose acknowledged verdict no later transition may take back."""
        return {
            item_id
            for item_id, (status, _value) in self.verdicts.items()
            if status in ("finished", "failed")
            and item_id not in self.restarting
            and item_id not in self.deleted
        }


@dataclass
class StateName:
    """A crash state as a failure names it: which one, after what."""

    number: int
    count: int
    ops: list[tuple[Any, ...]]
    k: int

    def __str__(self) -> str:
        recent = [
            " ".join(str(x) if not isinstance(x, bytes) else f"<{len(x)} bytes>" for x in op)
            for op in self.ops[max(0, self.k - 25) : self.k]
        ]
        return f"state {self.number} of {self.count} after op {self.k} (the last ops: {recent})"


def check_after_repair(root: Path, acks: Acknowledged, what: StateName) -> None:
    Item.objects.all().delete()
    Thread.objects.all().delete()
    QueueCount.objects.all().delete()
    Queue.objects.all().delete()
    engine.repair(grace_seconds=0)
    rows = {r.id: r for r in Item.objects.select_related("queue")}
    records = {}
    for item_id in (set(acks.posts) | set(acks.verdicts)) - acks.deleted:
        row = rows.get(item_id)
        if row is None and item_id in acks.deleting:
            continue  # a delete not yet answered may take effect (as a retried one would)
        assert row is not None, f"acknowledged item {item_id} lost in {what}"
        found = next(root.glob(f"{row.queue.name}/*/{item_id}.json"))
        records[item_id] = decode(found.read_bytes())[0]
    for item_id, payload in acks.posts.items():
        if item_id in records:
            got = records[item_id]["payload"]
            assert got == payload, f"post {item_id} has another payload in {what}"
    for item_id, (status, value) in acks.verdicts.items():
        if item_id not in records:
            continue
        row = rows[item_id]
        if status in ("restarted", "pending"):
            # (a restart; a retryable failure, a socket's re-queue: the item waits again)
            # Unless a claim since (and its result, answered or not) moved it on, it waits.
            if item_id not in acks.moved_after:
                assert row.status == "pending", f"{item_id} is {row.status}, not waiting, in {what}"
        elif item_id not in acks.restarting:
            assert row.status == status, f"verdict {status} of {item_id} undone in {what}"
            key = "result" if status == "finished" else "error"
            got = records[item_id].get(key)
            assert got == value, f"{key} of {item_id} is {got!r}, not {value!r}, in {what}"
    for item_id in acks.deleted:
        assert item_id not in rows, f"deleted item {item_id} came back in {what}"
        assert not list(root.glob(f"*/*/{item_id}.json")), f"{item_id}'s file is back in {what}"
    for name in acks.deleted_queues:
        assert not Queue.objects.filter(name=name, deleting=False).exists(), (
            f"deleted queue {name} came back in {what}"
        )
    for name, expected_settings in acks.settings.items():
        if name in acks.deleting_queues:
            continue
        queue = Queue.objects.filter(name=name, deleting=False).first()
        assert queue is not None, f"queue {name} lost in {what}"
        assert queue_settings(queue) == expected_settings, f"settings of {name} in {what}"
    for (queue_name, name), wire in acks.schedules.items():
        if queue_name in acks.deleting_queues:
            continue
        schedule = Schedule.objects.filter(queue__name=queue_name, name=name).first()
        assert schedule is not None, f"schedule {name} of {queue_name} lost in {what}"
        got = engine.schedule_wire(schedule, queue_name)
        changing = acks.schedules_changing.get((queue_name, name), set())
        for field_name in ("every", "cron", "timezone", "payload", "priority", "paused"):
            if field_name not in changing:
                assert got[field_name] == wire[field_name], f"{field_name} of {name} in {what}"
        if "catchupSeconds" not in changing:
            assert got["catchupSeconds"] == wire["catchupSeconds"], f"catch-up in {what}"
    slot_files: Counter[str] = Counter()
    item_files = [
        path
        for state in ("pending", "processing", "done")
        for path in root.glob(f"*/{state}/*.json")
        if not path.parent.parent.name.startswith(".")  # the trash, the quarantine
    ]
    for path in item_files:
        try:
            key = decode(path.read_bytes())[0].get("key") or ""
        except Exception as exc:
            raise AssertionError(f"{path} unreadable after repair in {what}") from exc
        if key.startswith("schedule:"):
            slot_files[key] += 1
    twice = [key for key, n in slot_files.items() if n > 1]
    assert not twice, f"slots {twice} have two items in {what}"
    assert_index_matches_directories(root)
    assert_threads_consistent()
    run_on(acks, what)


def run_on(acks: Acknowledged, what: StateName) -> None:
    """The server runs on from the repaired state: every lease lapses, then every queue is
    drained by claims and results. No item is handed out twice, no thread has two members
    out at once, and nothing acknowledged as finished or failed is claimed or finished
    again."""
    final = acks.final()
    later = utcnow().replace(year=utcnow().year + 2)
    processing = tuple(Item.objects.filter(status="processing").values_list("id", flat=True))
    if processing:
        group(Sweep(clock=Clock.LAPSE, ids=processing, at=later))
    handed: Counter[str] = Counter()
    for _round in range(20):
        queues = list(Queue.objects.filter(deleting=False).values_list("name", flat=True))
        answers = group(*(Claim(queue_name=name, max_items=50) for name in queues))
        claimed = [x for answer in answers for x in answer]
        if not claimed:
            break
        handed.update(x.row.id for x in claimed)
        twice = [item_id for item_id, n in handed.items() if n > 1]
        assert not twice, f"{twice} handed out twice after repair in {what}"
        again = final & {x.row.id for x in claimed}
        assert not again, f"{again}, with an acknowledged verdict, handed out again in {what}"
        out = Counter(
            Item.objects.filter(status="processing", thread_id__isnull=False).values_list(
                "queue_id", "thread_id"
            )
        )
        crowded = [thread for thread, n in out.items() if n > 1]
        assert not crowded, f"threads {crowded} have two members out at once in {what}"
        verdicts = group(*(Result(item_id=x.row.id, result="after") for x in claimed))
        assert all(v.accepted for v in verdicts), f"a result after repair refused in {what}"
    else:
        raise AssertionError(f"the queues did not drain after repair in {what}")
    assert not Item.objects.filter(status__in=["pending", "processing"]).exists(), (
        f"items left waiting after the drain in {what}"
    )
    for item_id in final:
        if item_id in acks.deleting and not Item.objects.filter(id=item_id).exists():
            continue  # a delete under way took it
        (verdict,) = group(Result(item_id=item_id, result="second"))
        assert not verdict.accepted, f"{item_id} got a second verdict in {what}"


@pytest.mark.slow
@pytest.mark.django_db
# On PostgreSQL (2 states a point) some 158 s for the three modes on a quiet machine (with 4
# a point, up to 145 s a mode beside the SQLite run); 30-48 s a mode on SQLite (4 a point)
# beside the PostgreSQL run. Each state is repaired into an empty database and drained:
# bounded by the count of states, not by this clock.
@pytest.mark.timeout(600)
# "auto": syncfs for a group of several files, the fsyncs for a group of one (as a journaled
# ext4 measures it), the two barriers mixed in one workload.
@pytest.mark.parametrize("flush", ["syncfs", "fsync", "auto"])
def test_no_power_cut_loses_an_acknowledged_post_or_undoes_a_verdict_or_a_delete(
    flush: str,
    settings: Any,
    state_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FSYNC": True, "FLUSH": flush}
    engine.upsert_queue(name="dead", body={})
    engine.upsert_queue(name="s", body={"backoffSeconds": 0})
    engine.upsert_queue(
        name="q", body={"deadLetterQueue": "dead", "backoffSeconds": 0, "maxAttempts": 5}
    )
    identity.check()  # the state root is this database's (every crash state keeps that)
    base = tmp_path / "base"
    shutil.copytree(state_root, base)
    trace = Trace(root=the_store().root)
    monkeypatch.setattr(the_store(), "sys", RecordingSyscalls(trace))
    if flush == "auto":
        monkeypatch.setattr(the_store(), "one_file_way", "fsync")
    record_acks(trace, monkeypatch)
    # A group removing three files or more lists them (the list path of a large delete).
    monkeypatch.setattr(store_module, "DEFER_UNLINKS_AT", 3)
    lists: list[Path] = []
    monkeypatch.setattr(reclaim, "later", lambda paths: lists.extend(map(Path, paths)))
    run_workload(trace, lists)
    trace.recording = False
    ops = trace.ops
    kinds = {op[0] for op in ops}
    assert kinds >= {
        "ack-post",
        "ack-verdict",
        "ack-delete",
        "ack-delete-queue",
        "ack-settings",
        "ack-schedule",
    }
    assert kinds >= {"create", "append", "rename", "unlink", "mkdir", "rmdir"}
    if flush == "auto":
        assert kinds >= {"barrier", "fsync", "fsync-dir"}, "both ways, in one workload"

    # Each state is written out in memory where there is a tmpfs (a disk's metadata writes
    # cost more than the check).
    shm = Path("/dev/shm")
    scratch = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else tmp_path))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    crashed = scratch / "crashed"
    # The crashed copies are checked, not power-cut again: no flushes there.
    settings.TASKHOSTER = {**settings.TASKHOSTER, "ROOT": str(crashed), "FSYNC": False}
    rng = random.Random(20261201)
    per_point = states_per_point()
    total = explored = points = 0
    checked: set[tuple[int, int]] = set()  # (tree, acknowledgements) already checked
    for k, point in crash_points(base, ops):
        count = point.count()
        total += count
        points += 1
        acks = Acknowledged.before(ops, k)
        acks_seen = hash(repr([op for op in ops[:k] if op[0] not in FILE_OPS]))
        for number in chosen_states(count, per_point, rng):
            if ALL_STATES and (total - count + number) % SHARDS != SHARD:
                continue
            contents, directories = point.tree(number)
            explored += 1
            seen = (hash((tuple(sorted(contents.items())), tuple(sorted(directories)))), acks_seen)
            if seen in checked:
                continue
            checked.add(seen)
            shutil.rmtree(crashed, ignore_errors=True)
            write_tree(crashed, contents, directories)
            check_after_repair(crashed, acks, StateName(number, count, ops, k))
    with capsys.disabled():
        print(
            f"\npower cut ({flush}): explored {explored} of {total} states "
            f"({len(checked)} distinct trees checked) over {points} crash points of "
            f"{len(ops)} recorded operations"
            + (
                f" (shard {SHARD} of {SHARDS})"
                if ALL_STATES and SHARDS > 1
                else ""
                if ALL_STATES
                else f" (up to {per_point} a point, seeded, on {connection.vendor})"
            )
        )
    assert points == len(ops) + 1
    if ALL_STATES:
        assert explored == len(range(SHARD, total, SHARDS))
